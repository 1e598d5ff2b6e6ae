"""The exceptions of :mod:`marginkit.train`, and the "did you mean" hint their messages carry.

One level below every other module of the package (it imports none of them), so the config,
the loss registry, the run directory and the trainer can all raise the same types.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["CheckpointError", "ConfigError", "RunDirError", "TrainingError", "nearest", "suggest"]


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it."""


class RunDirError(ValueError):
    """The run directory cannot be used (not writable, in use, already holds a run, holds no
    checkpoint, or a write into it failed)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, corrupted or not a marginkit checkpoint."""


class TrainingError(RuntimeError):
    """Training diverged (non-finite loss), a peer process stalled, or the run cannot proceed."""


# ---------------------------------------------------------------------- suggestions
def suggest(key: str, valid: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the nearest valid name (:func:`nearest`), or ``""``."""
    close = nearest(key, valid)
    return f" (did you mean {close!r}?)" if close is not None else ""


def nearest(key: str, valid: Iterable[str]) -> str | None:
    """The valid name nearest to ``key``, or ``None`` if none is close.

    Tried in order: a known alias (``learning_rate`` → ``lr``), the longest valid name the
    key starts with (``lr_rate`` → ``lr``), a valid name starting with the key (``epo`` →
    ``epochs``), then :func:`difflib.get_close_matches`.
    """
    valid = list(valid)
    norm = key.lower().replace("-", "_")
    alias = _ALIASES.get(norm)
    if alias in valid:
        return alias
    heads = sorted((v for v in valid if len(v) >= 2 and norm.startswith(v.lower())), key=len, reverse=True)
    tails = [v for v in valid if len(norm) >= 3 and v.lower().startswith(norm)]
    close = heads[:1] or tails[:1] or difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not close:
        lowered = {v.lower().replace("-", "_"): v for v in valid}
        close = [lowered[c] for c in difflib.get_close_matches(norm, list(lowered), n=1, cutoff=0.6)]
    return close[0] if close else None


_ALIASES = {
    "learning_rate": "lr",
    "rate": "lr",
    "n_epochs": "epochs",
    "num_epochs": "epochs",
    "bs": "batch_size",
    "dim": "embedding_dim",
    "emb_dim": "embedding_dim",
    "embed_dim": "embedding_dim",
    "neighbors": "k",
    "neighbours": "k",
    "knn_k": "k",
    "dataset": "data",
    "backbone": "model",
    "arch": "model",
    "criterion": "loss",
    "clip": "grad_clip",
    "wd": "weight_decay",
    "warmup": "warmup_epochs",
    "lr_schedule": "scheduler",
    "schedule": "scheduler",
    "optim": "optimizer",
}
