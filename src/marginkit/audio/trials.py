"""Speaker-verification trial lists: read them (:func:`read_trials`) and score them from
utterance embeddings (:func:`score_trials`): EER, minDCF at the field's two priors, TAR@FAR.

The VoxCeleb format, one trial per line, label first (1 = same speaker, 0 = different)::

    1 id10270/x6uYqmx31kE/00001.wav id10270/8jEAjG6SegY/00008.wav

wespeaker's own lists (``enrol test target|nontarget``, label last) are read too. Paths are
utterances relative to the data root, as :meth:`LazySamples.relative_path` gives them and
``marginkit embed`` writes them (``<split>_paths``).

Each utterance is embedded once; a trial's score is the cosine of its two embeddings, all
trials at once (gathered rows, in chunks that bound memory). The metrics are those of
:func:`marginkit.metrics.verification_metrics` (accept iff score > t), with minDCF at
``p_target`` 0.01 (NIST SRE, wespeaker) and 0.05 (VoxSRC), ``C_miss = C_fa = 1``, and
optionally adaptive S-norm (:func:`marginkit.metrics.normalize_scores`) against a cohort,
usually one averaged embedding per training speaker (top-N 300 in wespeaker).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["P_TARGETS", "Trials", "missing_message", "read_trials", "score_trials", "trial_scores"]

#: The field's priors of minDCF: NIST SRE / wespeaker (0.01) and VoxSRC (0.05).
P_TARGETS = (0.01, 0.05)
_MAX_BYTES = 2**30  # a trial list over 1 GiB (~15 M trials) is refused before reading
_CHUNK = 2**16  # trials scored per gather


@dataclass(frozen=True)
class Trials:
    """A parsed trial list.

    Attributes:
        labels: ``[T]`` bool, True for a target (same-speaker) trial.
        utterances: ``[U]`` the distinct paths the list names, sorted (str array).
        pairs: ``[T, 2]`` int64 rows of each trial's enrolment and test utterance in ``utterances``.
        source: the file read (for messages).
        lines: ``[T]`` int64 line number of each trial in ``source`` (for messages), or None.
    """

    labels: np.ndarray
    utterances: np.ndarray
    pairs: np.ndarray
    source: str
    lines: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.labels.size)

    @property
    def enrol(self) -> np.ndarray:
        return self.utterances[self.pairs[:, 0]]

    @property
    def test(self) -> np.ndarray:
        return self.utterances[self.pairs[:, 1]]


_LABELS = {"1": True, "0": False, "target": True, "nontarget": False}


def read_trials(path: str | os.PathLike[str]) -> Trials:
    """Read and validate a trial list (``label enrol test``, or wespeaker's ``enrol test target|nontarget``).

    Blank lines and lines starting with ``#`` are skipped. A line that is not three fields with a
    0/1 label raises :class:`ValueError` naming the file, the line number and what was expected;
    so does a list with no trials, with no target or no non-target trial, or over 1 GiB.
    """
    source = os.fspath(path)
    p = Path(source)
    if not p.is_file():
        raise FileNotFoundError(f"trial list {source!r} does not exist or is not a file")
    size = p.stat().st_size
    if size > _MAX_BYTES:
        raise ValueError(f"trial list {source!r} is {size} bytes, over the {_MAX_BYTES}-byte limit")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"trial list {source!r} is not UTF-8 text (byte {err.start})") from None
    labels: list[bool] = []
    sides: list[str] = []
    lines: list[int] = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 3:
            raise ValueError(
                f"{source}, line {number}: expected 3 fields 'label enrol_path test_path' "
                f"(e.g. '1 id10270/x6uYqmx31kE/00001.wav id10270/8jEAjG6SegY/00008.wav'), got {len(fields)}: "
                f"{line.strip()[:200]!r}"
            )
        if fields[0] in ("0", "1"):
            label, enrol, test = fields
        elif fields[2] in ("target", "nontarget"):
            enrol, test, label = fields
        else:
            raise ValueError(
                f"{source}, line {number}: the label must be 1 (same speaker) or 0 (different) first, or "
                f"'target' / 'nontarget' last; got {line.strip()[:200]!r}"
            )
        labels.append(_LABELS[label])
        sides.extend((enrol, test))
        lines.append(number)
    if not labels:
        raise ValueError(f"trial list {source!r} holds no trials")
    label_array = np.asarray(labels, dtype=bool)
    if label_array.all() or not label_array.any():
        kind = "target" if label_array.all() else "non-target"
        raise ValueError(
            f"trial list {source!r} holds only {kind} trials ({label_array.size}); "
            "EER and minDCF need both kinds"
        )
    utterances, inverse = np.unique(np.asarray(sides, dtype=str), return_inverse=True)
    pairs = inverse.reshape(-1, 2).astype(np.int64)
    return Trials(label_array, utterances, pairs, source, np.asarray(lines, dtype=np.int64))


def missing_message(trials: Trials, missing: np.ndarray, where: str = "the data") -> str:
    """What to say when the utterances ``missing`` (a bool mask over ``trials.utterances``) have no
    row in ``where``: the file, the line of the first trial naming one, and that path."""
    first = int(np.flatnonzero(missing[trials.pairs].any(axis=1))[0])
    side = 0 if missing[trials.pairs[first, 0]] else 1
    path = str(trials.utterances[trials.pairs[first, side]])
    line = f", line {int(trials.lines[first])}" if trials.lines is not None else ""
    count = int(missing.sum())
    return (
        f"{trials.source}{line}: utterance {path!r} is not in {where} ({count} of the "
        f"{trials.utterances.size} utterances the list names are missing; paths must be relative to the "
        "data root, as `marginkit embed` writes them in <split>_paths)"
    )


def _rows_of(trials: Trials, paths: Sequence[str] | np.ndarray) -> np.ndarray:
    """Row in ``paths`` of each utterance of ``trials`` (a sorted search, no Python loop per trial)."""
    paths = np.asarray(paths, dtype=str)
    if paths.ndim != 1:
        raise ValueError(f"paths must be a 1-D array of utterance paths, got shape {paths.shape}")
    order = np.argsort(paths, kind="stable")
    ordered = paths[order]
    if ordered.size > 1 and (ordered[1:] == ordered[:-1]).any():
        dup = ordered[1:][ordered[1:] == ordered[:-1]][0]
        raise ValueError(
            f"paths name utterance {str(dup)!r} more than once; each utterance must be embedded once"
        )
    at = np.searchsorted(ordered, trials.utterances).clip(max=max(ordered.size - 1, 0))
    found = ordered[at] == trials.utterances if ordered.size else np.zeros(trials.utterances.size, bool)
    if not found.all():
        raise ValueError(missing_message(trials, ~found, "the embedded utterances"))
    return order[at]


def trial_scores(
    trials: Trials, embeddings: np.ndarray | torch.Tensor, paths: Sequence[str] | np.ndarray
) -> torch.Tensor:
    """Cosine score of every trial, ``[T]`` float32 (float64 for float64 embeddings).

    ``embeddings[i]`` is the embedding of utterance ``paths[i]``; every utterance the list names
    must be among ``paths`` (extra rows are ignored).
    """
    from marginkit._validation import compute_dtype

    e = torch.as_tensor(embeddings)
    if e.dim() != 2 or e.shape[0] != len(paths):
        raise ValueError(
            f"embeddings must be [len(paths), dim] = [{len(paths)}, dim], got shape {list(e.shape)}"
        )
    if not torch.is_floating_point(e):
        raise TypeError(f"embeddings must be floating point, got {e.dtype}")
    rows = torch.from_numpy(_rows_of(trials, paths)).to(e.device)
    used = e[rows].to(compute_dtype(e.dtype))
    if not torch.isfinite(used).all():
        raise ValueError("embeddings of the trial list's utterances hold NaN or infinite values")
    used = torch.nn.functional.normalize(used, dim=1)
    pairs = torch.from_numpy(trials.pairs).to(e.device)
    return torch.cat(
        [
            (used[pairs[i : i + _CHUNK, 0]] * used[pairs[i : i + _CHUNK, 1]]).sum(dim=1)
            for i in range(0, len(trials), _CHUNK)
        ]
    )


def score_trials(
    trials: Trials,
    embeddings: np.ndarray | torch.Tensor,
    paths: Sequence[str] | np.ndarray,
    *,
    fars: Sequence[float] = (1e-1, 1e-2, 1e-3),
    cohort: np.ndarray | torch.Tensor | None = None,
    top_k: int = 300,
    bootstrap: int = 0,
    speakers: Sequence[str] | np.ndarray | None = None,
    seed: int = 0,
    calibration: Any = None,
) -> dict[str, object]:
    """EER, minDCF (p_target 0.01 and 0.05, C_miss = C_fa = 1), TAR@FAR, min Cllr of a trial list.

    Args:
        trials: from :func:`read_trials`.
        embeddings, paths: one embedding per utterance and its path relative to the data root.
        fars: FARs of ``tar_at_far``.
        cohort: ``[C, D]`` cohort embeddings (one per training speaker): scores are then
            adaptive-S-normalised (AS-norm) with the ``min(top_k, C)`` largest cohort scores of each side.
        bootstrap, speakers, seed: subject-bootstrap intervals (``bootstrap`` replicates) for EER and
            TAR@FAR; ``speakers[i]`` is the speaker of utterance ``paths[i]`` (required with ``bootstrap``).
        calibration: a :class:`~marginkit.metrics.Calibration` fitted on other trials (normalised
            like these): adds ``cllr`` and ``actual_dcf_0.01`` of the calibrated llrs (Brümmer and
            du Preez 2006: Cllr = mean over both classes of log2(1 + e^(∓llr))) and its slope and
            offset under ``calibration``; a string: why there is none (``calibration.skipped``).

    Returns:
        ``{"eer", "min_dcf_0.01", "min_dcf_0.05", "tar_at_far": {far: tar | None}, "auc",
        "num_trials", "num_target", "num_nontarget", "num_utterances", "norm", "min_cllr"}``,
        ``"confidence_intervals"`` with ``bootstrap``, and ``"cllr"``, ``"actual_dcf_0.01"``,
        ``"calibration"`` with ``calibration``.
    """
    from marginkit.metrics.calibration import actual_dcf, cllr, min_cllr
    from marginkit.metrics.verification import min_dcf, verification_metrics

    scores = trial_scores(trials, embeddings, paths)
    norm = "none"
    if cohort is not None:
        from marginkit.metrics.normalization import cohort_stats, normalize_scores

        e = torch.as_tensor(embeddings)
        rows = torch.from_numpy(_rows_of(trials, paths)).to(e.device)
        c = torch.as_tensor(cohort).to(e.device)
        k = min(int(top_k), c.shape[0])
        stats = cohort_stats(e[rows], c, top_k=k)
        scores = normalize_scores(
            scores, stats, stats, method="as-norm", trials=torch.from_numpy(trials.pairs).to(e.device)
        )
        norm = f"as-norm (top {k} of {c.shape[0]} cohort rows)"
    genuine = torch.from_numpy(trials.labels).to(scores.device)
    groups = None
    if bootstrap:
        if speakers is None:
            raise ValueError("bootstrap needs speakers: the speaker of each utterance in paths")
        speaker_ids = np.unique(np.asarray(speakers, dtype=str), return_inverse=True)[1]
        groups = torch.from_numpy(speaker_ids[_rows_of(trials, paths)][trials.pairs])
    metrics = verification_metrics(
        scores, genuine, fars, p_target=P_TARGETS[0], bootstrap=bootstrap, groups=groups, seed=seed
    )
    out: dict[str, object] = {
        "eer": metrics["eer"],
        "min_dcf_0.01": metrics["min_dcf"],
        "min_dcf_0.05": min_dcf(scores, genuine, p_target=P_TARGETS[1])[0],
        "tar_at_far": metrics["tar_at_far"],
        "auc": metrics["auc"],
        "num_trials": len(trials),
        "num_target": int(trials.labels.sum()),
        "num_nontarget": int((~trials.labels).sum()),
        "num_utterances": int(trials.utterances.size),
        "norm": norm,
        "min_cllr": min_cllr(scores, genuine),
    }
    if isinstance(calibration, str):
        out.update({"cllr": None, "actual_dcf_0.01": None, "calibration": {"skipped": calibration}})
    elif calibration is not None:
        llr = calibration.llr(scores)
        out["cllr"] = cllr(llr, genuine)
        out["actual_dcf_0.01"] = actual_dcf(llr, genuine, p_target=P_TARGETS[0])
        out["calibration"] = {
            "fitted_on": "validation split (all pairs, normalised alike)", "slope": calibration.slope,
            "offset": calibration.offset, "num_genuine": calibration.num_genuine,
            "num_impostor": calibration.num_impostor,
        }  # fmt: skip
    if "confidence_intervals" in metrics:
        out["confidence_intervals"] = metrics["confidence_intervals"]
    return out
