"""The scores' histogram by a compiled kernel (numba, optional): one pass to count, one to take.

:func:`marginkit.ops.selection.histogram` codes each score by the top bits of its IEEE pattern after
``+0.0`` is added (``-0.0`` becomes ``+0.0``), counts the codes with ``torch.bincount`` and, for the
verification metrics, counts the genuine pairs' codes again; a metric then takes the scores of one or
two bins with boolean masks. Each of those steps is a pass over every score. Here one loop codes a
score, counts it and, if it is flagged (genuine), counts it again; another takes the scores of the
wanted bins (coding each score again: cheaper than storing the codes), in index order, with their
flags. Integer work only: the counts are the numpy path's exactly, and the scores taken are the same
entries in the same order.

This module imports numba, an optional dependency (``pip install marginkit[fast]``);
:mod:`marginkit.ops.selection` runs the numpy path without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

__all__ = ["count", "take"]


@njit(cache=True, nogil=True, inline="always")
def _code(b: Any, shift: Any, negative_zero: Any) -> Any:  # pragma: no cover (compiled)
    # -0.0 + 0.0 is +0.0, pattern 0 (b - b: a zero of b's unsigned type, which a literal 0 is not)
    return np.int32((b - b if b == negative_zero else b) >> shift)


@njit(cache=True, nogil=True)
def _count(
    bits: Any, flags: Any, shift: Any, negative_zero: Any, counts: Any, flagged: Any
) -> None:  # pragma: no cover
    for i in range(bits.shape[0]):
        c = _code(bits[i], shift, negative_zero)
        counts[c] += 1
        if flags[i]:
            flagged[c] += 1


@njit(cache=True, nogil=True)
def _take(
    values: Any,
    bits: Any,
    flags: Any,
    shift: Any,
    negative_zero: Any,
    c1: int,
    c2: int,
    out: Any,
    out_flags: Any,
) -> int:  # pragma: no cover
    j = 0
    for i in range(bits.shape[0]):
        c = _code(bits[i], shift, negative_zero)
        if c == c1 or c == c2:  # noqa: SIM109 (two compares compile to two compares in numba)
            if j < out.shape[0]:
                out[j] = values[i]
                out_flags[j] = flags[i]
            j += 1
    return j


def _unsigned(a: np.ndarray, bits: int) -> tuple[np.ndarray, Any, Any]:
    """``a``'s patterns, the shift to its top ``bits`` bits and the pattern of ``-0.0``."""
    width = a.dtype.itemsize * 8
    unsigned = np.uint32 if width == 32 else np.uint64
    return a.view(unsigned), unsigned(width - bits), unsigned(1 << (width - 1))


def count(a: np.ndarray, flags: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, flagged)`` of the flat float32 / float64 ``a`` (C-contiguous, no NaN) and the bool
    ``flags``: the counts of every code and of the flagged entries' codes (int64, ``2**bits`` each,
    in code order)."""
    counts = np.zeros(1 << bits, np.int64)
    flagged = np.zeros(1 << bits, np.int64)
    pattern, shift, negative_zero = _unsigned(a, bits)
    _count(pattern, flags, shift, negative_zero, counts, flagged)
    return counts, flagged


def take(
    a: np.ndarray, flags: np.ndarray, bits: int, wanted: tuple[int, int], size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The entries of ``a`` and ``flags`` whose code is one of ``wanted`` (``size`` of them, from the
    counts), in index order."""
    out, out_flags = np.empty(size, a.dtype), np.empty(size, np.bool_)
    pattern, shift, negative_zero = _unsigned(a, bits)
    taken = _take(a, pattern, flags, shift, negative_zero, int(wanted[0]), int(wanted[1]), out, out_flags)
    if taken != size:  # (the counts said otherwise: a bug, never a silent short array)
        raise AssertionError(f"took {taken} scores from the bins, expected {size}")
    return out, out_flags
