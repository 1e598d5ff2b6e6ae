"""MEP of float32 rows by a compiled kernel (numba, optional): L2 without a sort, and L1 with a mask.

The torch reference (:func:`marginkit.ops.projection._l2_level`) sorts the breakpoints ``u`` (``x_i`` on
the positives, ``x_j + m`` on the negatives) and reads the level off float64 prefix sums. Those sums
depend on the sorted order only through their rounding, and a row can rule rounding out (docs/mep.md):

* **exact sums**: every float32 breakpoint is a multiple of the spacing ``g = 2^(e_small - 150)``
  at the row's smallest nonzero magnitude (``e`` the biased exponent field; 1 for subnormals), and
  every partial sum of the reference is at most ``2 Σ|u|``; where that is below ``2^53 g`` every
  such sum is a float64 number, exact in any order;
* **exact comparisons**: a breakpoint and a quotient ``A_k / C_k`` that differ do so by at least
  ``g / n``; where that exceeds half a float64 ulp of every quotient
  (``e_big - e_small + log2 n < 29``) the reference's ``u_k < fl(A_k / C_k)`` are decided exactly;
  otherwise (``h`` rises with slope ≥ 1 on the row's range) only a breakpoint within ``n`` such
  half ulps of the root can be misjudged, and the row is kept only if none lies within
  ``n · 2^(e_big - 177)`` of the level.

On such a row the reference's level is ``fl(A / C)`` for the active set of the root ``ℓ*``,
``A = Σ_{P: u < ℓ*} u + Σ_{N: u ≥ ℓ*} u`` and ``C`` its size (entries equal to ``ℓ*`` change neither
the exact quotient nor its rounding). The set is found by Newton's iteration on the piecewise-linear
``h(ℓ) = Σ_P (ℓ - u)_+ - Σ_N (u - ℓ)_+``, ``ℓ ← fl(A(ℓ) / C(ℓ))``, one pass over the row each,
summed in any order (the loop is vectorised with reassociation allowed: the sums are exact). It has
converged when a Newton step leaves ``(A, C)`` unchanged: no breakpoint lies between a level and its
float64 rounding, so the quotient is the root of the piece it came from. A step outside the bracket
``[min_P u, max_N u]``, narrowed by the steps' signs, bisects it instead.

The output is then the reference's, entry by entry (``t = fl32(ℓ - m)``, ``ℓ ← fl32(t + m)``, the
clamp, the selects), bit for bit. A row the kernel cannot vouch for — a NaN or an infinity, sums
that may be inexact, a breakpoint near the root, a level clamped onto a zero bound (whose sign
``fmax`` / ``fmin`` choose), no convergence within ``_MAX_STEPS``, a label outside the row (only
with ``validate=False``; the sorting path reports it) — is flagged, and the caller
projects it by the sorting path. Rows without a positive or a negative, and rows that keep the
margin, are copied.

L1 with a mask (:func:`project_l1_mask`) needs no sums: its level is the order statistic
``u_(|N|)``, read off numpy's sort of the breakpoints' values (a zero, whose sign the stable order
decides, goes back to the sorting path); the breakpoints, clamp and selects are the kernel's.

This module imports numba, an optional dependency (``pip install marginkit[fast]``):
:mod:`marginkit.ops.projection` imports it when numba is there, and runs its numpy path otherwise.
The kernel compiles on first use, then loads from numba's on-disk cache.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

__all__ = ["project_l1_mask", "project_l2"]

_MAX_STEPS = 64


# Each loop does one thing, so that it is vectorised: the float64 sums with reassociation
# allowed (they are exact in any order), the extremes as integer keys.
@njit(cache=True, nogil=True)
def breakpoints(x: Any, pos: Any, m: Any, b: Any) -> bool:  # pragma: no cover (compiled)
    # b = x on the positives, x + m elsewhere (float32); whether b holds a NaN
    nan = False
    for j in range(x.shape[0]):
        bv = x[j] if pos[j] else x[j] + m
        b[j] = bv
        nan |= bv != bv
    return nan


@njit(cache=True, nogil=True)
def extremes(b: Any, pos: Any) -> tuple[Any, Any, Any, Any, int]:  # pragma: no cover
    # order keys of min_P b and max_N b (integer order = float order), the largest biased
    # exponent and the smallest of the nonzero entries (1 for a subnormal: their spacing is
    # 2^(1 - 150)), |P|
    bits = b.view(np.int32)
    top = np.int32(2**31 - 1)
    key_p, key_n = top, np.int32(-(2**31))
    e_big, e_small = np.int32(0), np.int32(255)
    n_pos = 0
    for j in range(bits.shape[0]):
        v = bits[j]
        key = v ^ ((v >> 31) & top)
        e = (v >> 23) & np.int32(0xFF)
        e_big = max(e_big, e)
        e_small = min(e_small, max(e, np.int32(1)) if v & top else np.int32(255))
        p = pos[j]
        key_p = min(key_p, key if p else top)
        key_n = max(key_n, np.int32(-(2**31)) if p else key)
        n_pos += p
    return key_p, key_n, e_big, e_small, n_pos


@njit(cache=True, fastmath={"reassoc"}, nogil=True)
def magnitude(b: Any) -> float:  # pragma: no cover
    total = 0.0
    for j in range(b.shape[0]):
        total += abs(np.float64(b[j]))
    return total


@njit(cache=True, fastmath={"reassoc"}, nogil=True)
def active_set(b: Any, pos: Any, level: float) -> tuple[float, int]:  # pragma: no cover
    # the active set at `level` (positives below it, negatives at or above it): sum and size
    total = 0.0
    count = 0
    for j in range(b.shape[0]):
        u = np.float64(b[j])
        act = (u < level) == pos[j]
        total += u if act else 0.0
        count += act
    return total, count


@njit(cache=True, fastmath={"reassoc"}, nogil=True)
def near(b: Any, level: float, width: float) -> int:  # pragma: no cover
    count = 0
    for j in range(b.shape[0]):
        count += abs(np.float64(b[j]) - level) <= width
    return count


@njit(cache=True, nogil=True)
def value(key: Any) -> Any:  # pragma: no cover
    out = np.empty(1, np.int32)
    out[0] = key ^ ((key >> 31) & np.int32(2**31 - 1))
    return out.view(np.float32)[0]


@njit(cache=True, nogil=True)
def output(
    x: Any, pos: Any, b: Any, min_p: Any, max_n: Any, t: Any, cut: Any, z: Any
) -> bool:  # pragma: no cover
    # the reference's clamp of ℓ = fl(t + m) into [min_P b, max_N b] and its selects; False (nothing
    # written) where a zero bound decides the clamp (fmax / fmin choose its sign)
    if (cut <= min_p and min_p == 0) or (cut >= max_n and max_n == 0):
        return False
    cut = max(cut, min_p)
    cut = min(cut, max_n)
    for j in range(x.shape[0]):
        xv = x[j]
        z[j] = (cut if xv < cut else xv) if pos[j] else (xv if b[j] <= cut else t)
    return True


@njit(cache=True, nogil=True)
def rows(x: Any, mask: Any, labels: Any, m32: Any, m64: Any, z: Any, redo: Any) -> None:  # pragma: no cover
    n_rows, n = x.shape
    b = np.empty(n, np.float32)
    own = np.zeros(n, np.bool_)  # the positives of a labelled row
    log_n = math.log2(n)
    for r in range(n_rows):
        pos = own if labels.shape[0] else mask[r]
        if labels.shape[0]:
            if not 0 <= labels[r] < n:  # (possible with validate=False: the sorting path reports it)
                redo[r] = True
                continue
            own[labels[r]] = True
        mm = m32[r]
        redo[r] = breakpoints(x[r], pos, mm, b)
        key_p, key_n, e_big, e_small, n_pos = extremes(b, pos)
        if redo[r] or e_big == 255:  # a NaN or an infinity
            redo[r] = True
        elif n_pos == 0 or n_pos == n or key_n <= key_p:  # nothing to move
            z[r] = x[r]
        elif math.frexp(2.0 * magnitude(b) * (1.0 + n * 2.0**-50))[1] > e_small - 97:
            # not every partial sum (at most 2 Σ|b|) is a float64 multiple of the spacing
            # g = 2^(e_small - 150)
            redo[r] = True
        else:
            min_p, max_n = value(key_p), value(key_n)
            lo, hi = np.float64(min_p), np.float64(max_n)  # h(lo) < 0 < h(hi)
            level = 0.5 * (lo + hi)
            last_total, last_count, newton, done = 0.0, -1, False, False
            for _ in range(_MAX_STEPS):
                total, count = active_set(b, pos, level)
                if newton and total == last_total and count == last_count:
                    done = True  # `level` = fl(total / count), the root of this piece
                    break
                if count * level - total < 0:  # (rounded: the sign only narrows the bracket)
                    lo = max(lo, level)
                else:
                    hi = min(hi, level)
                last_total, last_count = total, count
                step = total / count
                newton = lo <= step <= hi  # (closed: a step back onto the level converges)
                level = step if newton else 0.5 * (lo + hi)
            if done and e_big - e_small + log_n >= 29:
                # g / n is not above half a float64 ulp of every quotient (at most
                # max |b| < 2^(e_big - 126)), so a breakpoint within (n + 1) such half ulps of
                # the root could compare otherwise in the reference: none may lie there
                done = near(b, level, n * 2.0 ** (e_big - 177)) == 0
            t = np.float32(level - m64[r])
            redo[r] = not (done and output(x[r], pos, b, min_p, max_n, t, np.float32(t + mm), z[r]))
        if labels.shape[0]:
            own[labels[r]] = False


@njit(cache=True, nogil=True)
def l1_breakpoints(x: Any, mask: Any, m32: Any, b: Any) -> None:  # pragma: no cover
    for r in range(x.shape[0]):
        breakpoints(x[r], mask[r], m32[r], b[r])


@njit(cache=True, nogil=True)
def l1_rows(x: Any, mask: Any, b: Any, u: Any, m32: Any, z: Any, redo: Any) -> None:  # pragma: no cover
    # the L1 level u_(|N|) read off each row's ascending values u: the reference's value, unless it
    # is a zero (the stable order decides which sign comes first) or the row holds a NaN
    n = x.shape[1]
    for r in range(x.shape[0]):
        key_p, key_n, e_big, _, n_pos = extremes(b[r], mask[r])
        redo[r] = False
        if e_big == 255:  # a NaN or an infinity
            redo[r] = True
        elif n_pos == 0 or n_pos == n or key_n <= key_p:  # nothing to move
            z[r] = x[r]
        else:
            level = u[r, n - 1 - n_pos]
            mm = m32[r]
            t = level - mm  # (float32, as the reference's)
            cut = t + mm
            ok = level != 0 and output(x[r], mask[r], b[r], value(key_p), value(key_n), t, cut, z[r])
            redo[r] = not ok


def _margins(margin: Any, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row margins in float32 (as the breakpoints add them) and in float64 (as ℓ - m subtracts them)."""
    if isinstance(margin, np.ndarray):
        m32 = np.ascontiguousarray(margin.reshape(-1), dtype=np.float32)
        return m32, m32.astype(np.float64)
    return np.full(n_rows, np.float32(margin)), np.full(n_rows, float(margin))


def project_l1_mask(x: np.ndarray, mask: np.ndarray, margin: Any) -> tuple[np.ndarray, np.ndarray]:
    """MEP L1 of float32 rows ``x`` with a bool ``mask`` (``[rows, n]``): ``(z, redo)`` as
    :func:`project_l2`. The level is one order statistic: numpy's sort of the breakpoints' values
    (the fastest sort here), the rest in the kernel."""
    m32, _ = _margins(margin, x.shape[0])
    b = np.empty_like(x)
    l1_breakpoints(x, mask, m32, b)
    u = np.sort(b, axis=-1)
    z = np.empty_like(x)
    redo = np.empty(x.shape[0], np.bool_)
    l1_rows(x, mask, b, u, m32, z, redo)
    return z, redo


def project_l2(
    x: np.ndarray, mask: np.ndarray | None, labels: np.ndarray | None, margin: Any
) -> tuple[np.ndarray, np.ndarray]:
    """MEP L2 of float32 rows ``x`` (``[rows, n]``, C-contiguous) by the kernel: ``(z, redo)``.

    ``mask``: bool ``[rows, n]``, or ``labels``: int64 ``[rows, 1]``; ``margin`` a Python float or a
    float32 ``[rows, 1]`` array. ``redo[r]`` marks the rows left for the sorting path (their ``z`` is
    unspecified).
    """
    n_rows = x.shape[0]
    m32, m64 = _margins(margin, n_rows)
    z = np.empty_like(x)
    redo = np.empty(n_rows, np.bool_)
    if labels is None:
        assert mask is not None
        rows(x, mask, np.empty(0, np.int64), m32, m64, z, redo)
        return z, redo
    rows(x, np.empty((1, 1), np.bool_), np.ascontiguousarray(labels.reshape(-1), np.int64), m32, m64, z, redo)
    return z, redo
