"""Evaluation of a trained run: K-NN accuracy, head accuracy, retrieval and verification.

Closed-set data (test classes = training classes):

- ``knn_accuracy`` — a :class:`~marginkit.knn.KNNClassifier` (``k``, ``knn_metric``,
  ``knn_weights`` from the config) fitted on the *training* embeddings, queried with the
  test embeddings; ``per_class_recall`` and the confusion matrix from the same predictions.
- ``head_accuracy`` — arg-max of the cosine head (class-level losses only).
- retrieval on the test set (query = every test sample, references = the other test
  samples): ``precision_at_1``, ``r_precision``, ``map_at_r`` (Musgrave et al. 2020).
- verification of every genuine and up to ``max_impostors`` impostor test pairs (as below, without
  the intervals);
- the margin gap ``min_pos cos − max_neg cos`` of the head on every test sample
  (:func:`marginkit.ops.margin_gap`) and, for alpha losses, the support size of the sparse
  posterior on the test set.

Open-set data (test classes never seen in training: ``identities``, a class-disjoint
``split``, or a source whose test split holds other classes):

- ``knn_accuracy`` — leave-one-out K-NN *within* the test set (each query's own sample is
  excluded), since training classes cannot be predicted for new identities;
- retrieval metrics within the test set, as above;
- verification: genuine / impostor cosine scores of test pairs
  (:func:`marginkit.metrics.pair_scores`), then :func:`marginkit.metrics.verification_metrics`
  (EER, TAR at FAR 1e-1 … 1e-4 where measurable, minDCF) with percentile intervals from
  :data:`BOOTSTRAP_REPLICATES` replicates of the subject bootstrap, and the ROC and DET curves
  for the report.

Model selection during training (:func:`validation_metrics`) uses the validation split only,
never the test split; ``selection`` (:func:`selection_metric`) says what it scores: K-NN
accuracy against the training embeddings (validation classes seen in training), or leave-one-out
precision@1 or the EER of the pairs *within* validation (validation classes disjoint from
training, as in the test).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from marginkit.train.config import TrainConfig
from marginkit.train.sources import register_sources

register_sources()  # audio: (above data/, which may not import it)

__all__ = [
    "BOOTSTRAP_REPLICATES",
    "check_k_fits",
    "check_selection",
    "check_trials",
    "confusion_matrix",
    "data_note",
    "embed",
    "embed_split",
    "evaluate_model",
    "evaluate_run",
    "evaluate_run_trials",
    "pca_2d",
    "roc_curve",
    "selection_metric",
    "selection_note",
    "trial_metrics",
    "validation_metrics",
]

FARS = (1e-1, 1e-2, 1e-3, 1e-4)
#: Subject-bootstrap replicates behind the intervals of open-set verification figures.
BOOTSTRAP_REPLICATES = 200
MAX_PROJECTED = 2000
#: Float32 input bytes of one evaluation batch at most (``eval_batch_size`` is lowered for large
#: inputs: a batch's activations are a multiple of it, and they bound evaluation's memory).
EVAL_INPUT_BYTES = 32 * 2**20


@torch.no_grad()
def embed(
    model: nn.Module,
    x: Any,
    *,
    batch_size: int = 1024,
    device: torch.device | str | None = None,
    workers: int | None = None,
) -> torch.Tensor:
    """Embeddings ``[N, D]`` (float32, on CPU) of inputs ``x`` in eval mode, batch by batch.

    ``x``: model input, a split's stored inputs (``uint8`` images are converted on the device:
    :func:`marginkit.data.device.to_model_input`), or a streamed split's lazy source, read by
    ``workers`` processes (:mod:`marginkit.data.loading`); only the ``[N, D]`` result is held.
    """
    return embed_rows(model, x, batch_size=batch_size, device=device, workers=workers)[0]


@torch.no_grad()
def embed_rows(
    model: nn.Module,
    x: Any,
    *,
    batch_size: int = 1024,
    device: torch.device | str | None = None,
    workers: int | None = None,
    on_bad_sample: str = "raise",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`embed`, and the rows embedded (all of them, unless ``on_bad_sample="skip"`` dropped
    bad samples of a streamed source)."""
    from marginkit.data.device import to_model_input
    from marginkit.data.loading import evaluation_loader

    if device is None:
        device = next(model.parameters()).device
    n = len(x)
    if getattr(x, "kind", None) == "audio":
        # whole utterances of any length, one per forward pass (wespeaker's practice): no
        # padding, so an utterance's embedding never depends on the others of its batch
        batch_size = 1
    else:
        sample = 4 * math.prod(tuple(x.shape)[1:])  # float32 bytes of one model input
        batch_size = max(1, min(batch_size, EVAL_INPUT_BYTES // max(1, sample)))
    loader = evaluation_loader(
        x, torch.arange(n), batch_size=batch_size, device=device, workers=workers, on_bad_sample=on_bad_sample
    )
    was_training = model.training
    model.eval()
    # one [N, D] result filled batch by batch (a list of chunks and their concatenation would
    # hold the embeddings twice at the end)
    out: torch.Tensor | None = None
    rows = torch.empty(n, dtype=torch.long)
    done = 0
    try:
        for batch in loader.epoch():
            emb = model(to_model_input(batch.x, device)).float()
            if out is None:
                out = torch.empty((n, emb.shape[1]), dtype=torch.float32)
            out[done : done + len(emb)] = emb.cpu()
            rows[done : done + len(emb)] = batch.y
            done += len(emb)
    finally:
        model.train(was_training)
        loader.close()
    if out is None:
        return torch.empty(0, int(getattr(model, "embedding_dim", 0))), torch.zeros(0, dtype=torch.long)
    return out[:done], rows[:done]


def embed_split(
    model: nn.Module, split: Any, config: TrainConfig, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A split's embeddings ``[N', D]`` and labels ``[N']``, batch by batch from its loader
    (``N' < N`` only when a streamed split skipped bad samples, ``on_bad_sample=skip``)."""
    emb, rows = embed_rows(
        model, split.data, batch_size=config.eval_batch_size, device=device, workers=config.workers,
        on_bad_sample=str(config.data_options.get("on_bad_sample", "raise")),
    )  # fmt: skip
    return emb, (split.y if rows.numel() == len(split) else split.y[rows])


def confusion_matrix(predicted: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``[C, C]`` int64 counts, rows = true class, columns = predicted class."""
    flat = labels.long() * num_classes + predicted.long()
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def pca_2d(x: torch.Tensor) -> torch.Tensor:
    """Project rows of ``x`` onto their two leading principal components (via SVD)."""
    x = x.double()
    centred = x - x.mean(0, keepdim=True)
    if centred.shape[0] < 2:
        return torch.zeros(centred.shape[0], 2)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    comps = vh[:2].T
    if comps.shape[1] < 2:
        comps = torch.cat([comps, torch.zeros(comps.shape[0], 2 - comps.shape[1], dtype=comps.dtype)], 1)
    # fix the sign of each axis (largest loading positive) so projections are reproducible
    signs = torch.sign(comps.gather(0, comps.abs().argmax(0, keepdim=True)))
    signs[signs == 0] = 1
    return (centred @ (comps * signs)).float()


def roc_curve(scores: torch.Tensor, is_genuine: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """False-accept and true-accept rates at every distinct threshold (descending scores).

    Ties are handled by evaluating only at the last position of each run of equal scores.
    Returns ``(far, tar)`` as float64 arrays starting at ``(0, 0)``.
    """
    s = scores.double().flatten()
    g = is_genuine.bool().flatten()
    order = torch.argsort(s, descending=True, stable=True)
    s, g = s[order], g[order]
    tp = torch.cumsum(g.double(), 0)
    fp = torch.cumsum((~g).double(), 0)
    last = torch.ones_like(g)
    if s.numel() > 1:
        last[:-1] = s[1:] != s[:-1]
    n_pos, n_neg = max(1.0, float(g.sum())), max(1.0, float((~g).sum()))
    far = torch.cat([torch.zeros(1, dtype=s.dtype), fp[last] / n_neg])
    tar = torch.cat([torch.zeros(1, dtype=s.dtype), tp[last] / n_pos])
    return far.numpy(), tar.numpy()


def check_k_fits(config: TrainConfig, splits: Any, k: int | None = None) -> None:
    """Refuse, before any training, a K-NN ``k`` that the data set cannot serve.

    Closed set: the references are the training samples, so ``k`` may not exceed their
    number; open set: leave-one-out within the test split needs ``k + 1`` test samples.
    Raises :class:`~marginkit.train.config.ConfigError` with what to change.
    """
    from marginkit.train.errors import ConfigError

    k = k or config.k
    if splits.open_set:
        need, have, what = k + 1, len(splits.test), "test samples (leave-one-out within the test split)"
    else:
        need, have, what = k, len(splits.train), "training samples (the K-NN references)"
    if have < need:
        fits = have - int(splits.open_set)
        lower = f"lower --k (at most {fits}) or " if fits >= 1 else ""
        raise ConfigError(
            f"k={k} needs at least {need} {what}, but {splits.name!r} has {have}: {lower}use more data "
            "(a larger train_per_class or data set, a smaller val_fraction)"
        )


def _has_pairs(labels: torch.Tensor) -> bool:
    """Whether ``labels`` give genuine pairs (a class with 2 samples) and impostor pairs (2 classes)."""
    counts = torch.unique(labels, return_counts=True)[1]
    return counts.numel() >= 2 and int(counts.max()) >= 2


def _retrieval_cutoffs(labels: torch.Tensor) -> tuple[int, ...]:
    """Recall@k cut-offs that the test split can serve (each query has ``N - 1`` references)."""
    if labels.numel() < 2 or int(torch.bincount(labels).max()) < 2:
        return ()  # no query has a relevant reference: retrieval is undefined
    return tuple(k for k in (1, 5, 10) if k <= labels.numel() - 1)


def _knn(config: TrainConfig, k: int | None = None) -> Any:
    from marginkit.knn import KNNClassifier

    return KNNClassifier(k=k or config.k, metric=config.knn_metric, weights=config.knn_weights)


def selection_metric(config: TrainConfig, splits: Any) -> str:
    """What chooses ``best.pt``: ``config.selection``, or for ``auto`` K-NN accuracy against the
    training embeddings (validation classes seen in training) or leave-one-out precision@1
    within validation (validation classes disjoint from training)."""
    if config.selection != "auto":
        return config.selection
    return "precision_at_1" if splits.val_open_set else "knn_accuracy"


def check_selection(config: TrainConfig, splits: Any) -> None:
    """Refuse, before training, a ``selection`` the validation split cannot score."""
    from marginkit.train.errors import ConfigError

    if len(splits.val) == 0:
        return
    what = selection_metric(config, splits)
    if what == "knn_accuracy" and splits.val_open_set:
        raise ConfigError(
            "selection=knn_accuracy predicts training classes, but the validation classes are disjoint from "
            "training: use selection=precision_at_1 or eer (or auto)"
        )
    counts = torch.bincount(splits.val.y)
    if what in ("precision_at_1", "eer") and int(counts.max()) < 2:
        raise ConfigError(
            f"selection={what} scores pairs within validation, but no validation class has 2 samples: "
            "use more validation data (val_fraction, val_classes)"
        )
    if what == "eer" and int((counts > 0).sum()) < 2:
        raise ConfigError("selection=eer needs impostor pairs: at least 2 validation classes")


#: Speaker splits a trial list's utterances are looked up in (paths relative to the data root).
_TRIAL_SPLITS = ("train", "val", "test")


def _read_trials(path: str) -> Any:
    """The trial list at ``path``; a missing or malformed file is a :class:`ConfigError` naming it."""
    from marginkit.audio.trials import read_trials
    from marginkit.train.errors import ConfigError

    try:
        return read_trials(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def check_trials(config: TrainConfig, splits: Any, trials: str | None = None) -> None:
    """Refuse, before training, a trial list (``trials``, default ``config.trials``) that cannot be
    scored on ``splits``: a missing or malformed file, a source that is not audio, or an utterance
    of the list that is in no split (the error names the file, the line and the path)."""
    from marginkit.audio.evaluate import relative_paths
    from marginkit.audio.trials import missing_message
    from marginkit.train.errors import ConfigError

    path = trials or config.trials
    if not path:
        return
    if getattr(splits, "kind", None) != "audio":
        raise ConfigError(
            f"trials (--trials) scores a speaker-verification trial list over the utterances of an audio "
            f"source: data {splits.name!r} is not audio (use --data audio:DIR or audio:wav.scp)"
        )
    listed = _read_trials(path)
    parts = [getattr(splits, name) for name in _TRIAL_SPLITS]
    names = np.concatenate([relative_paths(part.data) for part in parts if len(part)])
    found = np.isin(listed.utterances, names)
    if not found.all():
        raise ConfigError(missing_message(listed, ~found, f"data {splits.name!r}"))


def trial_metrics(
    model: nn.Module,
    splits: Any,
    config: TrainConfig,
    device: torch.device | str,
    *,
    trials: str | None = None,
    known: dict[str, torch.Tensor] | None = None,
    cohort: np.ndarray | None = None,
    top_k: int = 300,
) -> dict[str, Any]:
    """EER, minDCF (p_target 0.01 and 0.05), TAR@FAR of a trial list (``trials``, default
    ``config.trials``) over the utterances of every split of ``splits``, whatever split each is in,
    with intervals from :data:`BOOTSTRAP_REPLICATES` replicates of the speaker bootstrap
    (:func:`marginkit.audio.evaluate.score_trial_parts`, :func:`marginkit.audio.trials.score_trials`).

    ``known``: ``{split: embeddings of all its rows}`` already computed, reused. ``cohort`` /
    ``top_k``: AS-norm against these cohort rows (one per training speaker); without ``cohort``,
    ``config.trials_norm="as-norm"`` builds the cohort of :func:`evaluate_run_trials` from the
    training split (:func:`marginkit.audio.evaluate.speaker_cohort`) and keeps
    ``config.trials_top_k`` scores, so that ``eval RUN --trials F --norm as-norm`` repeats it.
    """
    from marginkit.audio.evaluate import score_trial_parts
    from marginkit.train.errors import ConfigError

    path = trials or config.trials
    if not path:
        raise ConfigError("no trial list: pass trials= or set the run's trials option")
    check_trials(config, splits, path)
    if cohort is None and config.trials_norm == "as-norm":
        cohort, top_k = _trial_cohort(model, splits, config, device), config.trials_top_k
    parts = [
        (part.data, part.y.numpy(), (known or {}).get(name))
        for name in _TRIAL_SPLITS
        if len(part := getattr(splits, name))
    ]
    listed = _read_trials(path)
    return score_trial_parts(
        model, parts, listed, device=device, workers=config.workers,
        where=f"data {splits.name!r}", cohort=cohort, top_k=top_k, bootstrap=BOOTSTRAP_REPLICATES,
        seed=config.seed,
        calibration=_trial_calibration(model, splits, listed, config, device, cohort, top_k),
    )  # fmt: skip


def _trial_cohort(
    model: nn.Module, splits: Any, config: TrainConfig, device: torch.device | str
) -> np.ndarray:
    """The AS-norm cohort of a trial list: the run's training speakers
    (:func:`marginkit.audio.evaluate.speaker_cohort`)."""
    from marginkit.audio.evaluate import speaker_cohort

    return speaker_cohort(
        model, splits.train.data, splits.train.y.numpy(), seed=config.seed, device=device,
        workers=config.workers,
    )  # fmt: skip


def _trial_calibration(
    model: nn.Module, splits: Any, listed: Any, config: TrainConfig, device: torch.device | str,
    cohort: np.ndarray | None, top_k: int,
) -> Any:  # fmt: skip
    """The trial list's calibration, fitted on the run's validation speakers
    (:func:`marginkit.audio.evaluate.validation_calibration`), or why there is none."""
    from marginkit.audio.evaluate import relative_paths, validation_calibration

    val = splits.val
    if len(val) == 0:
        return "no validation split"
    if np.isin(relative_paths(val.data), listed.utterances).any():
        return "the trial list names utterances of the validation split (a fit there would see them)"
    return validation_calibration(
        model, val.data, val.y.numpy(), cohort=cohort, top_k=top_k, max_impostors=config.max_impostors,
        seed=config.seed, device=device, workers=config.workers,
    )  # fmt: skip


def evaluate_run_trials(
    run_dir: str | Path,
    trials: str,
    *,
    data: str | None = None,
    device: torch.device | str = "cpu",
    which: str = "best",
    norm: str | None = None,
    top_k: int = 300,
) -> dict[str, Any]:
    """Score a trial list with ``RUN_DIR/{which}.pt``, embedding exactly the utterances it names.

    ``data`` (default: the run's own) is the ``audio:`` source whose root the list's paths are
    relative to; every utterance of it is eligible, unsplit (another folder of unseen speakers
    is the usual case). ``norm="as-norm"``: adaptive S-norm against a cohort of the run's
    *training* speakers (:func:`marginkit.audio.evaluate.speaker_cohort`: the mean unit embedding
    of 3 utterances each), the ``min(top_k, speakers)`` largest cohort scores of each side.

    Returns ``{"run", "checkpoint", "epoch", "data", "model", "fingerprint", "trials": {...}}``,
    ``trials`` as in :func:`trial_metrics`. Writes nothing.
    """
    from marginkit.audio.evaluate import score_trial_parts
    from marginkit.audio.sources import read_audio_files
    from marginkit.train.components import load_splits, resolve_model_name
    from marginkit.train.errors import ConfigError
    from marginkit.train.rundir import load_run

    if norm not in (None, "as-norm"):
        raise ConfigError(f"a trial list is normalised with as-norm only, got norm {norm!r}")
    if top_k < 1:
        raise ConfigError(f"top_k must be >= 1 (cohort scores kept by as-norm), got {top_k}")
    run = load_run(run_dir, which, device)
    config: TrainConfig = run["config"]
    spec = data or config.data
    if not spec.startswith("audio:") or run["facts"].get("kind") != "audio":
        what = f"data {spec!r}" if not spec.startswith("audio:") else f"the run's data {config.data!r}"
        raise ConfigError(
            f"--trials scores a speaker-verification trial list over the utterances of an audio source "
            f"with a speaker model: {what} is not audio (use --data audio:DIR or audio:wav.scp)"
        )
    listed = _read_trials(trials)
    own = spec == config.data
    unreadable = ""
    try:
        splits = load_splits(config)
    except (OSError, ValueError) as exc:
        if own or norm:  # its rows or its training speakers are needed
            raise
        splits = None  # only the calibration (its validation speakers) is lost
        unreadable = f"the run's data {config.data!r} is not readable here ({exc})"
    if own:
        parts = [(part.data, part.y.numpy(), None) for n in _TRIAL_SPLITS if len(part := getattr(splits, n))]
    else:  # the signal options the model was trained with; no split
        signal = {k: config.data_options[k] for k in ("sample_rate", "channel", "resample") if k in
                  config.data_options}  # fmt: skip
        try:
            files, labels, _ = read_audio_files(spec[len("audio:") :], **signal)
        except (OSError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        parts = [(files, labels, None)]
    model = run["model"]
    cohort = _trial_cohort(model, splits, config, device) if norm else None
    try:
        found = score_trial_parts(
            model, parts, listed, device=device, workers=config.workers, where=f"data {spec!r}",
            cohort=cohort, top_k=top_k, bootstrap=BOOTSTRAP_REPLICATES, seed=config.seed,
            calibration=(
                unreadable if splits is None
                else _trial_calibration(model, splits, listed, config, device, cohort, top_k)
            ),
        )  # fmt: skip
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    facts = run["facts"]
    ckpt = run["checkpoint"]
    return _jsonable({
        "run": str(run_dir), "checkpoint": Path(run["path"]).name, "epoch": int(ckpt["epoch"]), "data": spec,
        "model": resolve_model_name(config, tuple(facts["input_shape"]), facts.get("name", "")),
        "fingerprint": run["fingerprint"], "trials": found,
    })  # fmt: skip


def data_note(splits: Any) -> str:
    """The log's line on the data: its splits' sizes and classes, closed- or open-set, and how
    the classes were split."""
    info = getattr(splits, "info", {})
    sizes = f"{len(splits.train)} train / {len(splits.val)} val / {len(splits.test)} test samples"
    if not splits.open_set:
        closed = "closed set: the test classes are training classes"
        return f"data {splits.name}: {sizes}, {splits.num_classes} classes ({closed})"
    classes = info.get("classes")
    if classes:
        shown = f"training classes {classes['train']}, validation {classes['val']}, test {classes['test']}"
    else:
        shown = (
            f"{splits.num_classes} training classes, {int(torch.unique(splits.test.y).numel())} test classes"
        )
    how = f" [{info['split']}]" if "split" in info else ""
    return (
        f"data {splits.name}: {sizes}; open set: the test classes are never seen in training, scored by "
        f"verification and retrieval within them; {shown}{how}"
    )


def selection_note(config: TrainConfig, splits: Any) -> str:
    """The log's line on model selection."""
    if len(splits.val) == 0:
        why = splits.info.get("val_split", "val_fraction=0")
        return f"no validation split ({why}): best.pt is the last epoch's checkpoint"
    classes = int(torch.unique(splits.val.y).numel())
    where = (
        f"the {len(splits.val)} validation samples of {classes} "
        f"class{'es' if classes > 1 else ''} never trained on"
        if splits.val_open_set
        else f"{len(splits.val)} validation samples of the training classes"
    )
    what = {
        "knn_accuracy": f"{config.k}-NN accuracy against the training embeddings",
        "precision_at_1": "leave-one-out precision@1 within validation",
        "eer": "the EER of the validation pairs (lower is better)",
    }[selection_metric(config, splits)]
    return f"model selection: {what}, on {where}; the test split is never looked at"


def validation_metrics(
    model: nn.Module, head: nn.Module | None, splits: Any, config: TrainConfig, device: torch.device
) -> dict[str, Any]:
    """Per-epoch validation: ``val_selection`` is the model-selection score (higher is better)."""
    if len(splits.val) == 0:
        return {}
    what = selection_metric(config, splits)
    val, y_val = embed_split(model, splits.val, config, device)
    out: dict[str, Any] = {}
    if not splits.val_open_set:
        train, y_train = embed_split(model, splits.train, config, device)
        pred = _knn(config).fit(train, y_train).predict(val)
        out["val_knn_accuracy"] = float((pred.cpu() == y_val).double().mean())
        if head is not None:
            with torch.no_grad():
                head_pred = head(val.to(device)).argmax(-1).cpu()
            out["val_head_accuracy"] = float((head_pred == y_val).double().mean())
    if what == "precision_at_1" or splits.val_open_set:
        from marginkit.metrics import knn_accuracy

        # leave-one-out 1-NN within validation = precision@1
        p1 = knn_accuracy(val, y_val, k=1, metric=config.knn_metric) if len(y_val) > 1 else None
        out["val_precision_at_1"] = p1
    if what == "eer":
        from marginkit.metrics import eer, pair_scores

        scores, genuine = pair_scores(val, y_val, max_impostors=config.max_impostors, seed=config.seed)
        out["val_eer"] = eer(scores, genuine)
        out["val_selection"] = -out["val_eer"]
    else:
        out["val_selection"] = out[f"val_{what}"]
    return out


@torch.no_grad()
def _support_sizes(config: TrainConfig, cosines: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    """Classes with non-zero probability in the alpha loss's posterior, per test sample.

    Runs the run's own loss module (same alpha, scale and, for Q-Margin, the margin in the
    reference measure) and reads its ``last_support_size``.
    """
    from marginkit.train.registry import build_loss

    loss = build_loss(config.loss, config.loss_options, k=config.k)
    loss(cosines, labels)
    return loss.last_support_size.reshape(-1).cpu().numpy().astype(np.int64)


def evaluate_model(
    model: nn.Module,
    head: nn.Module | None,
    splits: Any,
    config: TrainConfig,
    device: torch.device | str = "cpu",
    *,
    k: int | None = None,
    protocol: Any = None,
    trials: str | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray], Any]:
    """Test metrics, the report's arrays, and the K-NN index fitted on the training embeddings.

    ``protocol`` (a :class:`marginkit.train.protocols.ProtocolOptions`) adds that protocol's
    metrics and curves (:func:`marginkit.train.protocols.evaluate_protocol`). ``trials`` (default:
    ``config.trials``) adds ``metrics["trials"]``: the trial list scored over the utterances of
    every split (:func:`trial_metrics`), the train and test embeddings reused.
    """
    from marginkit.knn import model_fingerprint
    from marginkit.metrics import (
        det_curve,
        knn_accuracy,
        pair_scores,
        per_class_recall,
        retrieval_metrics,
        verification_metrics,
    )
    from marginkit.ops import margin_gap
    from marginkit.train.registry import LOSSES

    k = k or config.k
    train_emb, y_train = embed_split(model, splits.train, config, device)
    test_emb, y_test = embed_split(model, splits.test, config, device)
    metrics: dict[str, Any] = {
        "loss": config.loss,
        "data": str(splits.name),
        "open_set": bool(splits.open_set),
        "k": k,
        "num_train": len(splits.train),
        "num_test": len(splits.test),
    }
    for key in ("split", "val_split", "class_split"):
        if key in getattr(splits, "info", {}):
            metrics[key] = splits.info[key]
    arrays: dict[str, np.ndarray] = {}
    knn = _knn(config, k).fit(train_emb, y_train, model_fingerprint=model_fingerprint(model))
    if not splits.open_set:
        pred = knn.predict(test_emb).cpu()
        metrics["knn_accuracy"] = float((pred == y_test).double().mean())
        conf = confusion_matrix(pred, y_test, splits.num_classes)
        arrays["confusion"] = conf.numpy()
        recall = per_class_recall(pred, y_test, splits.num_classes)
        metrics["per_class_recall"] = [None if math.isnan(r) else round(r, 6) for r in recall.tolist()]
        if head is not None:
            with torch.no_grad():
                cos = head(test_emb.to(device)).float().cpu()
            metrics["head_accuracy"] = float((cos.argmax(-1) == y_test).double().mean())
            gaps = margin_gap(cos, y_test)
            arrays["margin_gap"] = gaps.numpy()
            metrics["margin_gap_median"] = float(gaps.median())
            metrics["margin_gap_positive_fraction"] = float((gaps > 0).double().mean())
            if LOSSES[config.loss].alpha:
                sizes = _support_sizes(config, cos, y_test)
                arrays["support_size"] = sizes
                metrics["support_size_mean"] = float(np.mean(sizes))
    else:
        metrics["knn_accuracy"] = knn_accuracy(
            test_emb, y_test, k=k, metric=config.knn_metric, weights=config.knn_weights
        )
        metrics["knn_protocol"] = "leave-one-out within the test identities"
    if _has_pairs(y_test):  # verification of the test pairs (open set: with subject-bootstrap intervals)
        scores, genuine, pairs = pair_scores(
            test_emb, y_test, max_impostors=config.max_impostors, seed=config.seed, return_pairs=True
        )
        replicates = BOOTSTRAP_REPLICATES if splits.open_set else 0
        ver = verification_metrics(
            scores, genuine, fars=FARS, bootstrap=replicates, groups=y_test[pairs], seed=config.seed
        )
        metrics["verification"] = _jsonable(ver)
        far, tar = roc_curve(scores, genuine)
        arrays["roc_far"], arrays["roc_tar"] = far, tar
        det = det_curve(scores, genuine)
        arrays["det_verification_p_fa"] = det["p_fa"].numpy()
        arrays["det_verification_p_miss"] = det["p_miss"].numpy()
    if protocol is not None:
        from marginkit.train.protocols import evaluate_protocol

        val_emb, y_val = embed_split(model, splits.val, config, device)
        embs = {"train": train_emb, "val": val_emb, "test": test_emb}
        found, curves = evaluate_protocol(
            protocol, embs, {"train": y_train, "val": y_val, "test": y_test}, seed=config.seed,
            metric=config.knn_metric, max_impostors=config.max_impostors, fars=FARS,
        )  # fmt: skip
        metrics.update(_jsonable(found))
        arrays.update(curves)
    if trials or config.trials:
        known = {"train": train_emb, "test": test_emb}
        metrics["trials"] = _jsonable(
            trial_metrics(model, splits, config, device, trials=trials, known=known)
        )
    cutoffs = _retrieval_cutoffs(y_test)
    if cutoffs:
        retrieval = retrieval_metrics(test_emb, y_test, metric=config.knn_metric, ks=cutoffs)
        for key, value in _jsonable(retrieval).items():
            metrics[key] = value
    gen = torch.Generator().manual_seed(config.seed)
    n = test_emb.shape[0]
    idx = (
        torch.randperm(n, generator=gen)[:MAX_PROJECTED].sort().values
        if n > MAX_PROJECTED
        else torch.arange(n)
    )
    arrays["projection"] = pca_2d(test_emb[idx]).numpy()
    arrays["projection_labels"] = y_test[idx].numpy()
    return metrics, arrays, knn


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, np.ndarray):
        return value.item() if value.size == 1 else value.tolist()
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def evaluate_checkpoint(
    run_dir: str | Path,
    *,
    splits: Any,
    device: torch.device | str,
    which: str = "best",
    k: int | None = None,
    protocol: Any = None,
    model: Any = None,
    trials: str | None = None,
    trials_norm: str | None = None,
    trials_top_k: int | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray], Any, bool]:
    """Evaluate ``RUN_DIR/{which}.pt`` on ``splits`` (``None``: the run's own data set), as
    :func:`evaluate_run` does, but write nothing. ``model``, ``trials``, ``trials_norm``,
    ``trials_top_k``: as in :func:`evaluate_run`.

    Returns the (JSON-able) metrics, the report's arrays, the K-NN index fitted on the
    training embeddings, and whether ``splits`` is the run's own data set.
    """
    from marginkit.train.components import load_splits, resolve_model_name
    from marginkit.train.rundir import load_run, read_history

    run_dir = Path(run_dir)
    run = load_run(run_dir, which, device, model=model)
    config: TrainConfig = run["config"]
    own_data = splits is None or str(getattr(splits, "name", "")) == run["facts"].get("name")
    if splits is None:
        splits = load_splits(config)
    if tuple(splits.input_shape) != tuple(run["facts"]["input_shape"]):
        raise ValueError(
            f"data set {splits.name!r} has input shape {tuple(splits.input_shape)}, but the run's model "
            f"expects {tuple(run['facts']['input_shape'])}"
        )
    check_k_fits(config, splits, k)
    head = run["head"]
    if head is not None and splits.num_classes != run["facts"]["num_classes"]:
        head = None  # another label space: the head's classes mean nothing here
    if not own_data:  # the run's trial list names utterances of its own data root
        config = dataclasses.replace(config, trials=None)
    if trials_norm is not None:
        config = dataclasses.replace(config, trials_norm=None if trials_norm == "none" else trials_norm)
    if trials_top_k is not None:
        config = dataclasses.replace(config, trials_top_k=trials_top_k)
    metrics, arrays, knn = evaluate_model(
        run["model"], head, splits, config, device, k=k, protocol=protocol, trials=trials
    )
    ckpt = run["checkpoint"]
    metrics["checkpoint"] = Path(run["path"]).name
    metrics["epoch"] = int(ckpt["epoch"])
    metrics["best_epoch"] = int(ckpt.get("best_epoch", ckpt["epoch"]))
    metrics["fingerprint"] = run["fingerprint"]
    facts = run["facts"]
    metrics["model"] = resolve_model_name(config, tuple(facts["input_shape"]), facts.get("name", ""))
    metrics["embedding_dim"] = config.embedding_dim
    metrics["seed"] = config.seed
    history_path = run_dir / "metrics.jsonl"
    if history_path.is_file():
        rows = read_history(history_path)
        metrics["train_seconds"] = round(sum(r.get("epoch_seconds", 0.0) for r in rows), 3)
    return _jsonable(metrics), arrays, knn, own_data


def evaluate_run(
    run_dir: str | Path,
    *,
    splits: Any = None,
    device: torch.device | str = "cpu",
    which: str = "best",
    k: int | None = None,
    write: bool = True,
    report: bool = True,
    protocol: Any = None,
    model: Any = None,
    trials: str | None = None,
    trials_norm: str | None = None,
    trials_top_k: int | None = None,
) -> dict[str, Any]:
    """Evaluate ``RUN_DIR/{which}.pt`` on ``splits`` (default: the run's own data set).

    With ``write`` (and the run's own data), writes ``metrics.json``, ``eval.npz``, the
    K-NN reference index ``knn_index.npz`` (training embeddings + model fingerprint) and,
    with ``report``, ``report.html``, holding the run directory's lock. Returns the metrics.
    ``protocol``: see :func:`evaluate_model`. ``model``: for a run that trained your own module
    (``train(..., model=module)``), a new instance of its class (the checkpoint's weights go
    into it). ``trials``: a trial list to score into ``metrics["trials"]`` (default: the run's
    ``trials`` option, on its own data; see :func:`trial_metrics`). ``trials_norm`` (``as-norm``
    or ``none``) / ``trials_top_k``: how its scores are normalised (default: the run's options).
    """
    from marginkit.train.rundir import RunDir

    with RunDir(run_dir, create=False) if write else contextlib.nullcontext() as rundir:
        metrics, arrays, knn, own_data = evaluate_checkpoint(
            run_dir, splits=splits, device=device, which=which, k=k, protocol=protocol, model=model,
            trials=trials, trials_norm=trials_norm, trials_top_k=trials_top_k,
        )  # fmt: skip
        if rundir is not None and own_data:
            rundir.write_results(metrics, arrays, knn, report=report)
    return metrics
