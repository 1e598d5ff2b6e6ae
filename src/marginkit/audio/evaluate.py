"""Embedding utterances and scoring a trial list with a speaker model.

Evaluation embeds each utterance whole, one utterance per forward pass (wespeaker's practice:
no padding, so an embedding never depends on the other utterances of a batch), decoded by the
data loader's workers (:func:`marginkit.data.loading.evaluation_loader`). A trial list is scored
from the embeddings of exactly the utterances it names, found by their path relative to the data
root (:meth:`~marginkit.data.samples.LazySamples.relative_path`), whatever split they are in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from marginkit.audio.trials import Trials, missing_message, score_trials

__all__ = [
    "as_dotted",
    "embed_utterances",
    "evaluate_trials",
    "relative_paths",
    "score_trial_parts",
    "speaker_cohort",
]


def relative_paths(samples: Any) -> np.ndarray:
    """Every row's path relative to the data root, as a str array."""
    if hasattr(samples, "relative_paths"):
        return np.asarray(samples.relative_paths(), dtype=str)
    return np.array([samples.relative_path(i) for i in range(len(samples))], dtype=str)


@torch.no_grad()
def embed_utterances(
    model: torch.nn.Module,
    samples: Any,
    *,
    rows: Sequence[int] | np.ndarray | None = None,
    device: torch.device | str = "cpu",
    workers: int | None = 0,
    on_bad_sample: str = "raise",
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Embed whole utterances ``rows`` (default: all) of a lazy audio source, one per forward pass.

    Returns ``(embeddings [N', D] float32, the rows embedded [N'], skipped files)``; ``N' < N``
    only with ``on_bad_sample="skip"``. The model is put in eval mode (no dither) and left so.
    """
    from marginkit.data.loading import evaluation_loader

    index = np.arange(len(samples)) if rows is None else np.asarray(rows, dtype=np.int64)
    model.eval()
    loader = evaluation_loader(
        samples, torch.arange(len(samples)), batch_size=1, device=device, workers=workers,
        on_bad_sample=on_bad_sample, rows=torch.from_numpy(index),
    )  # fmt: skip
    out: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    try:
        for batch in loader.epoch():
            if len(batch.x) == 0:
                continue
            out.append(model(batch.x.to(device, torch.float32, non_blocking=True)).float())
            kept.append(batch.y)
    finally:
        loader.close()
    if not out:
        dim = int(getattr(model, "embedding_dim", 0))
        return np.zeros((0, dim), np.float32), np.zeros(0, np.int64), loader.skipped
    return torch.cat(out).cpu().numpy(), torch.cat(kept).numpy(), loader.skipped


def speaker_cohort(
    model: torch.nn.Module,
    samples: Any,
    labels: np.ndarray,
    *,
    per_speaker: int = 3,
    seed: int = 0,
    device: torch.device | str = "cpu",
    workers: int | None = 0,
) -> np.ndarray:
    """An AS-norm cohort: one row per speaker of ``labels``, the mean of the unit embeddings of up
    to ``per_speaker`` of its utterances (drawn with ``seed``). ``[speakers, D]`` float32."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    ranked = order[np.argsort(labels[order], kind="stable")]
    speakers, first = np.unique(labels[ranked], return_index=True)
    position = np.arange(len(ranked)) - np.repeat(first, np.diff(np.append(first, len(ranked))))
    chosen = np.sort(ranked[position < per_speaker])
    emb, kept, _ = embed_utterances(model, samples, rows=chosen, device=device, workers=workers)
    unit = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    who = np.searchsorted(speakers, labels[kept])
    sums = np.zeros((len(speakers), unit.shape[1]), np.float64)
    np.add.at(sums, who, unit)
    return (sums / np.bincount(who, minlength=len(speakers))[:, None]).astype(np.float32)


def evaluate_trials(
    model: torch.nn.Module,
    samples: Any,
    trials: Trials,
    *,
    device: torch.device | str = "cpu",
    workers: int | None = 0,
    cohort: np.ndarray | None = None,
    top_k: int = 300,
    **options: Any,
) -> dict[str, object]:
    """Embed the utterances ``trials`` names (rows of ``samples`` found by relative path) and score
    the list (:func:`~marginkit.audio.trials.score_trials`; ``options`` go there)."""
    names = relative_paths(samples)
    rows = np.flatnonzero(np.isin(names, trials.utterances))
    emb, kept, _ = embed_utterances(model, samples, rows=rows, device=device, workers=workers)
    metrics = score_trials(trials, emb, names[kept], cohort=cohort, top_k=top_k, **options)
    metrics["source"] = trials.source
    return metrics


def as_dotted(metrics: dict[str, Any], prefix: str = "trials") -> dict[str, Any]:
    """``{"trials.eer": ..., "trials.min_dcf_0.01": ...}``: the scalar entries under ``prefix``."""
    return {f"{prefix}.{k}": v for k, v in metrics.items() if isinstance(v, (int, float, str))}


def score_trial_parts(
    model: torch.nn.Module,
    parts: Sequence[tuple[Any, np.ndarray, np.ndarray | torch.Tensor | None]],
    trials: Trials,
    *,
    device: torch.device | str = "cpu",
    workers: int | None = 0,
    where: str = "the data",
    cohort: np.ndarray | None = None,
    top_k: int = 300,
    bootstrap: int = 0,
    seed: int = 0,
    calibration: Any = None,
) -> dict[str, object]:
    """Score ``trials`` over the utterances of several sources, e.g. the train / val / test splits
    of one data root, embedding only the rows the list names, each once.

    Args:
        parts: ``(samples, speaker labels [N], embeddings [N, D] or None)`` per source; given
            embeddings of every row (from an evaluation that embedded the whole split, whole
            utterances, eval mode) are reused instead of embedding again.
        where: the data's name in the error raised (:func:`~marginkit.audio.trials.missing_message`,
            with the trial file, line and path) when an utterance of the list is in no part;
            checked before anything is embedded.
        cohort, top_k, bootstrap, seed, calibration: as in :func:`~marginkit.audio.trials.score_trials`
            (``bootstrap`` resamples the speakers of ``labels``).
    """
    names = [relative_paths(samples) for samples, _, _ in parts]
    found = np.isin(trials.utterances, np.concatenate(names)) if names else np.zeros(0, bool)
    if not found.all():
        raise ValueError(missing_message(trials, ~found, where))
    embeddings, paths, speakers = [], [], []
    for (samples, labels, known), part_names in zip(parts, names, strict=True):
        rows = np.flatnonzero(np.isin(part_names, trials.utterances))
        if rows.size == 0:
            continue
        if known is not None and len(known) == len(samples):
            emb, kept = np.asarray(torch.as_tensor(known)[torch.from_numpy(rows)].float()), rows
        else:
            emb, kept, _ = embed_utterances(model, samples, rows=rows, device=device, workers=workers)
        embeddings.append(emb)
        paths.append(part_names[kept])
        speakers.append(np.asarray(labels)[kept])
    metrics = score_trials(
        trials, np.concatenate(embeddings), np.concatenate(paths), cohort=cohort, top_k=top_k,
        bootstrap=bootstrap, speakers=np.concatenate(speakers).astype(str), seed=seed,
        calibration=calibration,
    )  # fmt: skip
    metrics["source"] = trials.source
    return metrics


def validation_calibration(
    model: torch.nn.Module,
    samples: Any,
    labels: np.ndarray,
    *,
    cohort: np.ndarray | None = None,
    top_k: int = 300,
    max_impostors: int | None = 200_000,
    seed: int = 0,
    device: torch.device | str = "cpu",
    workers: int | None = 0,
) -> Any:
    """A score-to-llr calibration (:func:`marginkit.metrics.calibrate`, prior-weighted logistic
    regression) fitted on every genuine and up to ``max_impostors`` impostor pairs (seeded) of
    whole utterances of ``samples`` (a validation split: speakers of neither the training nor
    the trial list), AS-normalised against ``cohort`` as the trial scores are; or a string
    saying why there is none (fewer than 2 speakers, no genuine pair, separable scores).
    """
    from marginkit.metrics import calibrate, pair_scores

    labels = np.asarray(labels)
    counts = np.unique(labels, return_counts=True)[1] if labels.size else np.zeros(0, int)
    if counts.size < 2 or counts.max() < 2:
        return "the validation split has no genuine and impostor pairs (2 speakers, one with 2 utterances)"
    emb, kept, _ = embed_utterances(model, samples, device=device, workers=workers)
    # float32 cosines and the raw cohort, as score_trials scores the list
    unit = torch.nn.functional.normalize(torch.from_numpy(emb), dim=1)
    scores, genuine, pairs = pair_scores(
        unit, torch.from_numpy(labels[kept]), max_impostors=max_impostors, seed=seed, return_pairs=True
    )
    if cohort is not None:
        from marginkit.metrics.normalization import cohort_stats, normalize_scores

        c = torch.as_tensor(cohort)
        stats = cohort_stats(unit, c, top_k=min(int(top_k), c.shape[0]))
        scores = normalize_scores(scores, stats, stats, method="as-norm", trials=pairs)
    try:
        return calibrate(scores, genuine)
    except ValueError as exc:  # perfectly separated validation scores: no finite fit
        return str(exc).split(":")[0]
