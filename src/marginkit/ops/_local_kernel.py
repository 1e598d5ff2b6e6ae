"""The local-margin triplet's selection by a compiled kernel (numba, optional), without a ``topk``.

The torch reference (:func:`marginkit.mining.triplets._local_select`) builds, for each anchor row of
the float32 distances ``d`` (``[B, R]``), distinct ``int64`` keys: the bits of ``float64(|d|)``
(non-negative, so integer order is number order; the low 29 bits of a widened float32 are 0) with
the column in those bits, and ``_INF_KEY | column`` for every entry that is not a positive (and for
the anchor itself when the references are the batch). Its k-th positive is the column of the key at
rank ``min(k, #positives) − 1`` of ``torch.topk(keys, min(k, R))``: keys are distinct, so that rank
is one well-defined entry of the row. Its nearest negative is ``torch.min`` of ``|d|`` with every
same-label entry set to ``+inf``: the first NaN of the row, else the first smallest entry.

The kernel computes the same keys, one row at a time, and keeps the ``min(k, R)`` smallest in a
sorted buffer (an entry enters only below the buffer's largest key: a pass over the row and a few
insertions, where ``topk`` runs a partial sort per row); the nearest negative is the least of the
keys ``(bits of the masked |d|) << 32 | column`` — the first least entry, as ``torch.min`` picks
it — or, in a row with a NaN, the first NaN. Distinct keys make the selection exact whatever the
method; the values it returns are the entries of ``|d|`` themselves. So the outputs equal the
reference's bit for bit, including the entries of rows without a positive or a negative (in
range, unused by the loss).

This module imports numba, an optional dependency (``pip install marginkit[fast]``);
:mod:`marginkit.mining.triplets` runs the torch reference without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

__all__ = ["local_select"]

_INF_KEY = 0x7FF0000000000000  # the bits of the float64 +inf
_INF_BITS = np.int32(0x7F800000)  # the bits of the float32 +inf
_ABS = np.int32(0x7FFFFFFF)
_COLUMN = (1 << 29) - 1
_NO_ENTRY = np.int64(2**63 - 1)
_BLOCK = 16


# Each loop does one thing, so that it is vectorised (numba's LLVM vectorises none of them fused):
# the widening; the keys; the nearest negative as integer reductions (the bits of |d| are
# non-negative: integer order is number order, a NaN lies above +inf, and the column below the
# bits makes the least such key the first least entry); and the test of a block of keys against
# the buffer's largest, which an entry rarely passes.
@njit(cache=True, nogil=True)
def rows(
    d: Any,
    labels: Any,
    ref_labels: Any,
    self_ref: bool,
    k: int,
    p_idx: Any,
    n_idx: Any,
    d_pos: Any,
    d_neg: Any,
    has_pos: Any,
    has_neg: Any,
) -> None:  # pragma: no cover (compiled)
    n_rows, width = d.shape
    size = min(k, width)
    buf = np.empty(size, np.int64)
    wide = np.empty(width, np.float64)
    keys = wide.view(np.int64)
    bits = d.view(np.int32)
    for a in range(n_rows):
        la = labels[a]
        row = d[a]
        for j in range(width):
            wide[j] = abs(np.float64(row[j]))  # (the reference widens |d|: the same bits)
        own = a if self_ref else -1
        n_same = 0
        for j in range(width):
            same = ref_labels[j] == la
            n_same += same
            keys[j] = (keys[j] | j) if (same and j != own) else (_INF_KEY | j)
        least, high = _NO_ENTRY, np.int32(0)
        for j in range(width):
            masked = _INF_BITS if ref_labels[j] == la else bits[a, j] & _ABS  # +inf on the class
            least = min(least, (np.int64(masked) << 32) | j)
            high = max(high, masked)
        filled = 0
        for start in range(0, width, _BLOCK):
            stop = min(start + _BLOCK, width)
            if filled == size:
                top = buf[size - 1]
                enters = False
                for j in range(start, stop):
                    enters |= keys[j] < top
                if not enters:
                    continue
            for j in range(start, stop):
                key = keys[j]
                if filled < size or key < buf[size - 1]:
                    i = filled if filled < size else size - 1
                    while i > 0 and buf[i - 1] > key:
                        buf[i] = buf[i - 1]
                        i -= 1
                    buf[i] = key
                    filled = min(filled + 1, size)
        best = least & _COLUMN
        if high > _INF_BITS:  # torch.min: the first NaN
            best = 0
            while not (ref_labels[best] != la and bits[a, best] & _ABS > _INF_BITS):
                best += 1
        n_pos = n_same - 1 if self_ref else n_same
        col = buf[max(min(n_pos, k) - 1, 0)] & _COLUMN
        p_idx[a] = col
        d_pos[a] = abs(row[col])
        n_idx[a] = best
        d_neg[a] = np.inf if ref_labels[best] == la else abs(row[best])
        has_pos[a] = n_pos > 0
        has_neg[a] = n_same != width


def local_select(
    d: np.ndarray, labels: np.ndarray, ref_labels: np.ndarray, self_ref: bool, k: int
) -> tuple[np.ndarray, ...]:
    """The reference's ``(p_idx, n_idx, d_pos, d_neg, has_pos, has_neg)`` (all ``[B]``) for float32
    ``d [B, R]`` (C-contiguous, ``R < 2**29``), int64 labels and ``k >= 1`` (the caller keeps ``k``
    small: an insertion into the buffer costs up to ``k``)."""
    n = d.shape[0]
    p_idx, n_idx = np.empty(n, np.int64), np.empty(n, np.int64)
    d_pos, d_neg = np.empty(n, np.float32), np.empty(n, np.float32)
    has_pos, has_neg = np.empty(n, np.bool_), np.empty(n, np.bool_)
    rows(d, labels, ref_labels, self_ref, k, p_idx, n_idx, d_pos, d_neg, has_pos, has_neg)
    return p_idx, n_idx, d_pos, d_neg, has_pos, has_neg
