"""The process state a run depends on: thread count, deterministic algorithms, seeds, RNG states.

A resumed run reproduces the uninterrupted one bit for bit when it restores the same state:
the global RNGs (:func:`capture_rng` / :func:`restore_rng`, stored in every checkpoint as
tensors, so checkpoints load with ``weights_only=True``) and the thread count (recorded in the
run's config; CPU reductions may depend on it).

Threads: by default a run uses ``cores // jobs`` intra-op threads (at least one), where
``cores`` are the CPUs this process may run on (``os.sched_getaffinity``) and ``jobs`` the
runs or ranks sharing them, so that threads × jobs never exceeds the cores; torch's own default
(every core, per process) oversubscribes a shared machine.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["available_cores", "capture_rng", "choose_threads", "restore_rng", "runtime", "seed_everything"]


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def choose_threads(jobs: int = 1, requested: int | None = None) -> int:
    """``requested`` if given, else ``available_cores() // jobs`` (at least 1)."""
    if requested is not None:
        return int(requested)
    return max(1, available_cores() // max(1, int(jobs)))


@contextlib.contextmanager
def runtime(num_threads: int, *, deterministic: bool) -> Iterator[None]:
    """Thread count and deterministic algorithms for the duration of a run (restored after)."""
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.set_num_threads(num_threads)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        yield
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)


def seed_everything(seed: int) -> None:
    """Seed the global torch, numpy and python RNGs (third-party code may use them)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 (third-party code may use it)
    random.seed(seed)


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
