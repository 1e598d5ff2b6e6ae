"""Checkpoints: atomic writes, safe loading, exact-resume state.

A checkpoint is a plain dict of tensors and primitive containers, so it loads with
``torch.load(weights_only=True)`` (no arbitrary unpickling): the run's config is stored as a
JSON string, the random-number-generator states as tensors. It is written to a temporary
file in the same directory, flushed and ``fsync``-ed, then moved over the target with
``os.replace`` — a crash never leaves a half-written ``last.pt``.

Keys: ``format``, ``version``, ``epoch`` (completed epochs), ``global_step``, ``config``
(JSON), ``data`` (data set facts), ``model``, ``head`` (state dicts; ``head`` is empty for
pair losses), ``optimizer``, ``scheduler``, ``rng``, ``best_metric``, ``best_epoch``,
``fingerprint`` (:func:`marginkit.knn.model_fingerprint` of the embedding model).
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "FORMAT",
    "CheckpointError",
    "atomic_save",
    "capture_rng",
    "load_checkpoint",
    "restore_rng",
]

FORMAT = "marginkit.checkpoint"
VERSION = 1
_REQUIRED = ("format", "version", "epoch", "config", "model", "head", "optimizer", "scheduler", "rng")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, corrupted or not a marginkit checkpoint."""


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to ``path`` atomically (temporary file + fsync + ``os.replace``)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _umask_mode())  # mkstemp creates 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(text: str, path: str | Path) -> None:
    """Write a text file atomically."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and check a checkpoint with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: the file is missing, truncated/corrupted, or not a marginkit
            checkpoint (the message names the file and says which).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        first = first.split(". ")[0].rstrip(".")[:160]
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupted or not a safe marginkit checkpoint "
            f"({type(exc).__name__}: {first})"
        ) from None
    if not isinstance(payload, Mapping) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a marginkit checkpoint (no {FORMAT!r} format tag)")
    missing = [k for k in _REQUIRED if k not in payload]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: missing {', '.join(missing)}")
    if payload["version"] != VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {payload['version']}; "
            f"this marginkit reads version {VERSION}"
        )
    return dict(payload)


def capture_rng() -> dict[str, Any]:
    """The global RNG states (torch CPU, CUDA if initialised, numpy, python) as tensors/primitives."""
    np_state = np.random.get_state()  # noqa: NPY002 (saving the global state)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
        "python": _python_state_to_tensor(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    keys = state["numpy_keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state(  # noqa: NPY002 (restoring the global state)
        ("MT19937", keys, int(state["numpy_pos"]), int(state["numpy_has_gauss"]), float(state["numpy_gauss"]))
    )
    random.setstate(_python_state_from_tensor(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _python_state_to_tensor(st: tuple) -> tuple[torch.Tensor, float]:
    version, internal, gauss = st
    flag = 0 if gauss is None else 1
    return torch.tensor([version, *internal, flag], dtype=torch.int64), (0.0 if gauss is None else gauss)


def _python_state_from_tensor(packed: Any) -> tuple:
    values, gauss = packed
    values = [int(v) for v in values.tolist()]
    version, internal, flag = values[0], tuple(values[1:-1]), values[-1]
    return (version, internal, float(gauss) if flag else None)
