"""Reading users' files without trusting them: one input memory limit, and ``.npz`` reads under it.

Every reader of data from a file (data sets, K-NN indices, cached built-ins) checks what a file
*claims* — array shapes in ``.npy`` headers, IDX dimensions, image sizes — against what the file
holds and against :func:`input_limit_bytes` *before* allocating, so a corrupt or hostile file
ends in a :class:`ValueError` naming it, never in ``MemoryError`` or a machine swapping.

The limit bounds the bytes decoded from one source (all the files of one data set, one index
file); it is ``$MARGINKIT_MAX_INPUT_MB`` megabytes, :data:`DEFAULT_INPUT_LIMIT_MB` when unset,
and never more than half the address space the process has left under its ``RLIMIT_AS`` (when
one is set, e.g. ``ulimit -v``): past that the decoding itself would end in ``MemoryError``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_INPUT_LIMIT_MB",
    "INPUT_LIMIT_ENV",
    "InputBudget",
    "address_space_left",
    "input_limit_bytes",
    "read_npz_arrays",
]

INPUT_LIMIT_ENV = "MARGINKIT_MAX_INPUT_MB"
DEFAULT_INPUT_LIMIT_MB = 4096


def _configured_limit_bytes() -> int:
    raw = os.environ.get(INPUT_LIMIT_ENV, "").strip()
    if not raw:
        return DEFAULT_INPUT_LIMIT_MB * 2**20
    try:
        mb = float(raw)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb > 0):
        raise ValueError(f"${INPUT_LIMIT_ENV} must be a number of megabytes > 0, got {raw!r}")
    return int(mb * 2**20)


def address_space_left() -> tuple[int, int] | None:
    """``(bytes left, RLIMIT_AS)`` under the process's address-space limit; ``None`` when none is set.

    The bytes left are the soft limit less the process's current virtual size
    (``/proc/self/statm``); where that cannot be read, the whole limit.
    """
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
        used = pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        used = 0
    return max(0, soft - used), soft


def input_limit_bytes() -> int:
    """The input memory limit in bytes: ``$MARGINKIT_MAX_INPUT_MB`` (default 4096 MB), capped at
    half the address space left under ``RLIMIT_AS`` when the process has one (:func:`address_space_left`)."""
    limit = _configured_limit_bytes()
    left = address_space_left()
    return limit if left is None else min(limit, left[0] // 2)


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MB"


class InputBudget:
    """Running total of the bytes one source decodes, refused past :func:`input_limit_bytes`."""

    def __init__(self, where: str | os.PathLike[str]) -> None:
        self.where, self.limit, self.used = str(where), input_limit_bytes(), 0

    def take(self, nbytes: int, what: str) -> None:
        """Account for ``nbytes`` more (before allocating them); raise past the limit."""
        self.used += int(nbytes)
        if self.used > self.limit:
            raise ValueError(
                f"{self.where}: {what} needs {_mb(self.used)} in all, above the input memory limit "
                f"of {_mb(self.limit)}; {self.advice}"
            )

    @property
    def advice(self) -> str:
        left = address_space_left()
        if left is not None and self.limit < _configured_limit_bytes():
            return (
                f"the limit is half the address space left under this process's RLIMIT_AS of "
                f"{_mb(left[1])} (ulimit -v); raise that limit if the file is genuine"
            )
        return f"set ${INPUT_LIMIT_ENV} (now {_mb(self.limit)}) to raise it if the file is genuine"


def read_npz_arrays(path: str | os.PathLike[str], budget: InputBudget | None = None) -> dict[str, np.ndarray]:
    """All arrays of the ``.npz`` at ``path``, within what is left of ``budget``.

    The archive is read by :func:`marginkit._npz.read_npz` (every member's ``.npy`` header
    checked against the budget before its data is read, no pickle, no object or structured
    dtypes), with the budget (a fresh one for ``path`` by default) as its bound.
    """
    from marginkit._npz import NpzError, read_npz

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a .npz archive)")
    budget = budget or InputBudget(path)
    try:
        arrays = read_npz(path, where=str(path), max_bytes=max(0, budget.limit - budget.used))
    except NpzError as exc:
        if "exceeds the limit" in str(exc):
            raise NpzError(f"{exc}: above the input memory limit; {budget.advice}") from None
        raise
    budget.take(sum(a.nbytes for a in arrays.values()), "its arrays")
    return arrays
