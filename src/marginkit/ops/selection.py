"""Sorts and selections on the CPU at numpy's speed, identical to ``torch.sort(..., stable=True)``.

Every sort-bound op of the library (MEP, the local-margin triplet's k-th positive, the tie-ordered
K-NN top-k, the verification metrics) sorts or selects through this module. The contract is
exactness: a fast result equals the reference ``torch.sort(x, dim=-1, descending=d, stable=True)``
bit for bit, ties in index order, ``-0.0`` and ``+0.0`` equal (kept in index order, each with its
own sign), NaN above ``+inf`` (last ascending, first descending, in index order), float32 and float64.

The kernel. On a CPU with AVX-512, numpy sorts with Intel's x86-simd-sort (vectorised bitonic
networks inside a quicksort); ``torch.sort`` on the CPU is a scalar stable sort that also computes
the permutation, about 9x slower on ``[256, 1000]`` float32 rows, and ``np.argsort`` about 3.5x
(measured side by side: ``benchmarks/bench_mep.py``). ``np.partition`` (introselect) is no faster
than that sort at these row lengths, so selections that need one order statistic per row sort
values only and pick. Hence:

* :func:`sort_values` — values only: ``np.sort``; the two runs whose members compare equal but
  differ in bits (the zeros of both signs, the NaNs) are then rewritten in index order, on the rows
  that have them only, which makes the result equal to the stable reference.
* :func:`values_at_ranks` — one order statistic per row (MEP L1's level with a mask): ``np.sort``
  and a pick; only the rows whose picked value is a zero or a NaN need the runs rewritten.
* :func:`stable_sort` — values and permutation: each float32 value becomes a 32-bit key whose
  unsigned order is the float order (``-0.0`` folded onto ``+0.0``, every NaN onto the largest
  key), shifted above its column index in one uint64, and the uint64 rows are sorted values only
  (the same kernel, 64-bit lanes, ~2.3x the float32 sort): ``(value, index)`` order is exactly the
  stable order. The values are then gathered from the input (their exact bits). float64 cannot be
  packed so: it takes the reference.
* :func:`topk_stable` — the first ``k`` of the stable descending order (the K-NN's rule: key
  descending, index ascending): the same packed keys, ``np.partition`` (introselect, ``O(n)``)
  for the ``k`` smallest packed keys, then a sort of those ``k`` only. Exact with ties straddling
  the cut (the index is part of the key), where ``torch.topk`` leaves the choice among ties open.
* :func:`kth_smallest` — the value at a per-row rank ``< bound`` of the ascending order, for a
  small ``bound`` (:func:`kth_smallest_column`'s other dtypes): ``torch.topk`` of ``bound``
  smallest on every device, a selection already (a partial sort per row).
* :func:`local_select` — the local-margin triplet's whole selection (each anchor's k-th nearest
  positive, in the stable order, and its nearest negative) for float32 CPU distances by a compiled
  kernel (:mod:`marginkit.ops._local_kernel`, numba; optional): one pass per row with a ``k``-entry
  sorted buffer of the reference's distinct keys, where ``torch.topk`` partial-sorts each row (the
  selection was about half of the loss's forward at ``[256, 256]``). ``None`` elsewhere (no numba,
  another device or dtype, ``k > 64``): the caller runs its torch reference, which every device
  runs and which the tests compare bit for bit.
* :func:`kth_smallest_column` — the column of that entry in the stable order (ties in index
  order), in torch on every device: float32 rows become int64 ``(order key << 32) | column`` and
  one ``torch.topk`` of the packed integers gives the column exactly (~1.6x the value selection
  plus the counting of tied entries that other dtypes take, on ``[256, 256]``).
* :func:`packed_column_keys` — those int64 ``(order key << 32) | column`` keys themselves (either
  direction), for callers that count rather than sort: the retrieval metrics place every reference
  among a query's relevant ones with one ``torch.searchsorted`` of the packed keys.
* :func:`histogram` — the value-ordered histogram of a flat array's float bits (sign, exponent and
  the top mantissa bits), for exact order statistics of very long arrays in two passes: a
  histogram, then the few values of the bins that matter (``marginkit.metrics``).

Elsewhere — a CUDA tensor, a tensor that needs its gradient, a switched-off fast path
(:data:`FAST_CPU`, the tests' reference switch), a call that ``torch.compile`` traces — every
function calls ``torch.sort`` with
``stable=True``: the device-agnostic reference. Callers that need a gradient gather their
differentiable values with the returned indices, as before.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from marginkit.ops._compiled import CompiledKernel

__all__ = [
    "FAST_CPU",
    "fast_path",
    "flagged_histogram",
    "histogram",
    "kth_smallest",
    "kth_smallest_column",
    "local_select",
    "packed_column_keys",
    "sort_values",
    "sort_with_flags",
    "stable_sort",
    "take_bins",
    "topk_stable",
    "values_at_ranks",
]

#: The CPU fast path is on; tests switch it off (``monkeypatch``) to run the torch reference.
FAST_CPU = True

_NUMPY_DTYPES = (torch.float32, torch.float64)
LOCAL_KERNEL = CompiledKernel("_local_kernel", "the local-margin triplet's compiled selection")
BINS_KERNEL = CompiledKernel("_bins_kernel", "the scores' compiled histogram")
#: the largest ``k`` :func:`local_select` takes (its buffer's insertions cost up to ``k`` each)
LOCAL_MAX_K = 64
_SIGN32 = np.uint32(0x80000000)


def fast_path(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the numpy path: a float32/float64 CPU tensor whose gradient is not needed,
    outside ``torch.compile``'s tracing (dynamo's numpy emulation lacks some of its integer ops)."""
    return (
        FAST_CPU
        and not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype in _NUMPY_DTYPES
        and not (x.requires_grad and torch.is_grad_enabled())
        and x.numel() > 0
        and x.dim() > 0
    )


def _rows(x: torch.Tensor) -> np.ndarray:
    """``x`` as a C-contiguous 2-D numpy array ``[rows, n]`` (a view when ``x`` is contiguous)."""
    return x.detach().contiguous().numpy().reshape(-1, x.shape[-1])


def _keys32(a: np.ndarray) -> np.ndarray:
    """Unsigned 32-bit keys of float32 ``a`` in float order: ``-0.0`` = ``+0.0``, every NaN largest."""
    bits = a.view(np.int32)
    neg = bits >> 31  # -1 for a set sign bit, else 0
    key = np.bitwise_and(neg, 0x7FFFFFFF)
    key ^= bits  # signed order of the floats
    key -= neg  # fold -0.0 onto +0.0 (every negative moves up by one, order kept)
    key = key.view(np.uint32)
    key ^= _SIGN32
    nan = np.isnan(a)
    if nan.any():
        key[nan] = np.uint32(0xFFFFFFFF)
    return key


def _place_runs(out: np.ndarray, a: np.ndarray, members: np.ndarray, start: np.ndarray) -> None:
    """Write, in each row, the ``members`` of ``a`` in index order at ``out[row, start[row]:]``."""
    r, c = np.nonzero(members)
    counts = members.sum(1)
    first = np.cumsum(counts) - counts
    out[r, start[r] + np.arange(r.size) - first[r]] = a[r, c]


def _sort_values_np(a: np.ndarray, descending: bool) -> np.ndarray:
    """``np.sort`` of the rows of ``a``, then the zero and NaN runs in index order (see the module)."""
    out = np.sort(a, axis=-1)
    if descending:
        out = out[:, ::-1].copy()
    nan = np.isnan(a)
    if nan.any():
        rows = nan.any(1)
        sub = nan[rows]
        start = np.zeros(sub.shape[0], np.intp) if descending else a.shape[1] - sub.sum(1)
        view = out[rows]
        _place_runs(view, a[rows], sub, start)
        out[rows] = view
    zero = a == 0
    if (zero & np.signbit(a)).any():  # both zeros may be present: their order is the index order
        rows = zero.any(1)
        sub, ar = zero[rows], a[rows]
        before = (ar > 0) | np.isnan(ar) if descending else ar < 0
        view = out[rows]
        _place_runs(view, ar, sub, before.sum(1))
        out[rows] = view
    return out


def sort_values(x: torch.Tensor, *, descending: bool = False) -> torch.Tensor:
    """``torch.sort(x, dim=-1, descending=descending, stable=True).values``, bit-identical.

    Detached on the numpy path (callers that need a gradient use :func:`stable_sort` and gather).
    """
    if not fast_path(x):
        return torch.sort(x, dim=-1, descending=descending, stable=True).values
    return torch.from_numpy(_sort_values_np(_rows(x), descending)).reshape(x.shape)


def values_at_ranks(
    a: np.ndarray, index: np.ndarray, work: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per row of numpy ``a`` (``[rows, n]``, float32/float64), the value at rank ``index``
    (``[rows, 1]``, ``0 <= index < n``) of the stable ascending order, and whether the row holds a NaN.

    Equal to ``np.take_along_axis(sort_values(a), index, -1)`` bit for bit: a value's rank among
    the others does not depend on how equal values are ordered, so ``np.sort`` alone gives the
    picked value — except its bits where it is a zero (``-0.0`` or ``+0.0``, their order is the
    index order) or a NaN (which NaN's payload): those rows take :func:`sort_values`. NaN sorts last
    in both, so a row holds one exactly when its last sorted value is NaN. ``work`` (``a``'s shape
    and dtype, C-contiguous) takes the sorted copy: a fresh array's first touch costs page faults.
    """
    if work is None:
        u = np.sort(a, axis=-1)
    else:
        u = work
        np.copyto(u, a)
        u.sort(axis=-1)
    picked = np.take_along_axis(u, index, -1)
    nan = np.isnan(u[:, -1:])
    redo = (picked == 0) | np.isnan(picked)
    if redo.any():
        r = np.flatnonzero(redo)
        picked[r] = np.take_along_axis(_sort_values_np(a[r], False), index[r], -1)
    return picked, nan


def stable_sort(x: torch.Tensor, *, descending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(x, dim=-1, descending=descending, stable=True)``: ``(values, indices)``, bit-identical.

    float32 on the numpy path: one sort of packed ``(key, index)`` uint64 rows (see the module);
    other dtypes and devices: the reference.
    """
    n = x.shape[-1] if x.dim() else 0
    if not fast_path(x) or x.dtype != torch.float32 or n >= 2**32:
        return torch.sort(x, dim=-1, descending=descending, stable=True)
    a = _rows(x)
    packed = _packed(a, descending)
    packed.sort(axis=-1)
    idx = _columns(packed)
    values = np.take_along_axis(a, idx, axis=-1)
    return torch.from_numpy(values).reshape(x.shape), torch.from_numpy(idx).reshape(x.shape)


def histogram(a: np.ndarray, bits: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Value-ordered histogram of the flat float32/float64 array ``a`` (finite values, no NaN).

    The bin of a value is the top ``bits`` bits (``<= 31``) of its IEEE pattern (sign, exponent,
    leading mantissa bits) after ``+0.0`` is added (``-0.0`` becomes ``+0.0``): every bin is an
    interval of values, and the intervals are disjoint. Returns ``(codes, counts, order)``:
    ``codes[i]`` the bin of ``a[i]`` (int32), ``counts[r]`` the number of values in the ``r``-th
    bin in ascending value order, ``order[r]`` that bin's code. One pass to code (in place),
    one to count (``torch.bincount``: about 2.5x numpy's, which first widens the codes to intp).
    """
    width = a.dtype.itemsize * 8
    canon = a + a.dtype.type(0)
    raw = canon.view(np.uint32 if width == 32 else np.uint64)
    np.right_shift(raw, raw.dtype.type(width - bits), out=raw)
    codes = raw.view(np.int32) if width == 32 else raw.astype(np.int32)
    order = _bin_order(bits)
    counts = torch.bincount(torch.from_numpy(codes), minlength=order.size).numpy()[order]
    return codes, counts, order


def bincount_at(codes: np.ndarray, where: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Value-ordered counts (as :func:`histogram`'s) of the entries at the flat indices ``where``."""
    return np.bincount(codes[where], minlength=order.size)[order]


@functools.lru_cache(maxsize=4)
def _bin_order(bits: int) -> np.ndarray:
    """The codes of :func:`histogram`'s bins in ascending value order (read-only)."""
    half = 1 << (bits - 1)
    # negative values: the larger the code, the smaller the value; then the positive codes
    order = np.concatenate([np.arange(2 * half - 1, half - 1, -1), np.arange(half)])
    order.setflags(write=False)
    return order


def flagged_histogram(
    a: np.ndarray, flags: np.ndarray, bits: int = 20
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`histogram` of ``a`` and the counts of its flagged entries (bool ``flags``, as
    :func:`bincount_at`): ``(codes, counts, flagged, order)``. With numba, one compiled pass
    (:mod:`marginkit.ops._bins_kernel`) gives the same counts and no codes (``None``: :func:`take_bins`
    codes the scores again)."""
    a, flags = np.ascontiguousarray(a), np.ascontiguousarray(flags)
    out = BINS_KERNEL.run("count", a, flags, bits) if a.size < 2**31 else None
    if out is not None:
        order = _bin_order(bits)
        return None, out[0][order], out[1][order], order
    codes, counts, order = histogram(a, bits)
    return codes, counts, bincount_at(codes, np.flatnonzero(flags), order), order


def take_bins(
    a: np.ndarray,
    flags: np.ndarray,
    codes: np.ndarray | None,
    wanted: tuple[int, int],
    size: int,
    bits: int = 20,
) -> tuple[np.ndarray, np.ndarray]:
    """The entries of ``a`` and ``flags`` in the bins ``wanted`` (two codes of :func:`histogram`,
    equal for one bin; ``size`` entries, from the counts), in index order. ``codes``: those of
    :func:`flagged_histogram` (``None``: its compiled pass left none, and so does this one)."""
    if codes is None:
        out = BINS_KERNEL.run(
            "take", np.ascontiguousarray(a), np.ascontiguousarray(flags), bits, wanted, size
        )
        if out is not None:
            return out
        codes = histogram(np.ascontiguousarray(a), bits)[0]  # (numba failed since the count)
    pick = codes == wanted[0]
    if wanted[1] != wanted[0]:
        pick |= codes == wanted[1]
    return a[pick], flags[pick]


def _halves(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ``(high, low)`` uint32 halves of uint64 keys ``[rows, n]``, as strided views."""
    halves = packed.view(np.uint32)
    return (halves[:, 1::2], halves[:, 0::2]) if np.little_endian else (halves[:, 0::2], halves[:, 1::2])


def _packed(a: np.ndarray, descending: bool, flags: np.ndarray | None = None) -> np.ndarray:
    """uint64 keys ``(float order key << 32) | column`` (``| column << 1 | flag`` with ``flags``):
    their order is the stable order of ``a``'s rows. Written as two uint32 halves (numpy's widening
    cast from uint32 is several times slower than the strided stores)."""
    key = _keys32(a)
    if descending:
        np.invert(key, out=key)
    out = np.empty(a.shape, np.uint64)
    high, low = _halves(out)
    high[...] = key
    if flags is None:
        low[...] = np.arange(a.shape[1], dtype=np.uint32)
    else:
        np.add(
            np.arange(0, 2 * a.shape[1], 2, dtype=np.uint32), flags.view(np.uint8), out=low, dtype=np.uint32
        )
    return out


def _decode32(packed: np.ndarray) -> np.ndarray:
    """The float32 values of packed ascending keys (``-0.0`` comes back as ``+0.0``, NaN canonical)."""
    key = np.bitwise_xor(_halves(packed)[0], _SIGN32).view(np.int32)
    neg = key >> 31
    key += neg
    neg &= 0x7FFFFFFF
    key ^= neg
    return key.view(np.float32)


def sort_with_flags(x: torch.Tensor, flags: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Rows of float32 CPU ``x`` in the stable ascending order, and bool ``flags`` moved alike.

    ``(values, flags)`` as ``[rows, n]`` numpy arrays, equal to ``torch.sort(x, stable=True)``'s
    values and ``flags.gather(-1, indices)``; for :func:`fast_path` float32 tensors. The flag
    rides in the lowest bit of the packed key (under the column), so no gather is needed; the
    values are decoded from the keys, or gathered where a ``-0.0`` or a NaN must keep its bits.
    """
    a = _rows(x)
    f = flags.contiguous().numpy().reshape(a.shape)
    packed = _packed(a, False, f)
    packed.sort(axis=-1)
    high, low = _halves(packed)
    moved = np.bitwise_and(low, 1, out=np.empty(low.shape, np.uint8), casting="unsafe").view(bool)
    # a NaN or a -0.0 keeps its bits: a NaN's key is the largest, so it sorts to the end of its row
    if (high[:, -1] == np.uint32(0xFFFFFFFF)).any() or (a.view(np.uint32) == _SIGN32).any():
        values = np.take_along_axis(a, (low >> 1).astype(np.int64), axis=-1)
    else:
        values = _decode32(packed)
    return values, moved


def _columns(packed: np.ndarray) -> np.ndarray:
    return _halves(packed)[1].astype(np.int64)


def topk_stable(
    x: torch.Tensor, k: int, *, block_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(x, dim=-1, descending=True, stable=True)`` cut to the first ``k`` (``1 <= k``).

    Float32 ``[rows, n]`` on the numpy path: ``np.partition`` of packed keys (see the module),
    ``block_rows`` rows at a time (bounds the temporaries to ~21 bytes per entry of a block);
    float64 rows without NaN: a partition of the values, then the tied entries in column order
    (:func:`_topk_columns64`, ~23 bytes per entry); elsewhere the reference (a full stable sort).
    """
    n = x.shape[-1]
    wide = x.dtype == torch.float64 and fast_path(x) and x.dim() == 2 and not bool(torch.isnan(x).any())
    if not wide and (not fast_path(x) or x.dtype != torch.float32 or x.dim() != 2 or n >= 2**32):
        v, i = torch.sort(x, dim=-1, descending=True, stable=True)
        return v[:, :k], i[:, :k]
    a = _rows(x)
    k = min(k, n)
    values = np.empty((a.shape[0], k), a.dtype)
    indices = np.empty((a.shape[0], k), np.int64)
    step = block_rows or a.shape[0]
    for start in range(0, a.shape[0], step):
        part = a[start : start + step]
        if wide:
            cols = _topk_columns64(part, k)
            indices[start : start + step] = cols
            values[start : start + step] = np.take_along_axis(part, cols, axis=-1)
            continue
        packed = _packed(part, descending=True)
        if k < n:
            packed.partition(k - 1, axis=-1)
            packed = packed[:, :k]
        packed = np.sort(packed, axis=-1)
        cols = _columns(packed)
        indices[start : start + step] = cols
        values[start : start + step] = np.take_along_axis(part, cols, axis=-1)
    return torch.from_numpy(values), torch.from_numpy(indices)


def _topk_columns64(a: np.ndarray, k: int) -> np.ndarray:
    """Columns of the first ``k`` of each float64 row (no NaN) in the stable descending order.

    float64 values leave no room for the column in a 64-bit key, so the cut is found by value:
    ``np.partition`` gives the ``k``-th largest value ``v``; the entries above ``v`` and, of those
    equal to ``v`` (``-0.0 == +0.0``), the first ones in column order make up exactly ``k``; a
    stable ``argsort`` of those ``k`` (taken in column order) puts equal values in column order.
    ``O(n)`` per row plus a sort of ``k``, where the reference sorts all ``n``.
    """
    n = a.shape[-1]
    if k < n:
        negated = np.negative(a)
        negated.partition(k - 1, axis=-1)
        kth = -negated[:, k - 1 : k]
        del negated
        above = a > kth
        tied = a == kth
        room = k - above.sum(axis=-1, keepdims=True, dtype=np.int64)
        chosen = above | (tied & (np.cumsum(tied, axis=-1, dtype=np.int32) <= room))
        cols = np.nonzero(chosen)[1].reshape(a.shape[0], k)
    else:
        cols = np.broadcast_to(np.arange(n), a.shape)
    order = np.argsort(np.negative(np.take_along_axis(a, cols, axis=-1)), axis=-1, kind="stable")
    return np.take_along_axis(cols, order, axis=-1)


def kth_smallest(x: torch.Tensor, index: torch.Tensor, bound: int) -> torch.Tensor:
    """Per row, the value at rank ``index`` (``[rows]`` int64, ``0 <= index < bound``) of the ascending order.

    ``[rows, n]`` → ``[rows, 1]``, detached; values only (equal values are equal whatever their
    order): ``torch.topk`` of the ``bound`` smallest (see the module for the choice).
    """
    bound = min(bound, x.shape[-1])
    return torch.topk(x.detach(), bound, dim=-1, largest=False, sorted=True).values.gather(-1, index[:, None])


def local_select(
    d: torch.Tensor, labels: torch.Tensor, ref_labels: torch.Tensor, self_ref: bool, k: int
) -> tuple[torch.Tensor, ...] | None:
    """The local-margin triplet's selection by the compiled kernel, or ``None`` (see the module).

    ``d [B, R]`` the squared distances (float32, ``>= 0`` or NaN), ``labels [B]`` / ``ref_labels
    [R]``; returns :func:`marginkit.mining.triplets._local_select`'s ``(p_idx, n_idx, d_pos, d_neg,
    has_pos, has_neg)`` with its bits, reading ``d`` without writing it.
    """
    if not (fast_path(d) and d.dtype == torch.float32 and d.dim() == 2 and d.shape[1] < 2**29):
        return None
    if not 1 <= k <= LOCAL_MAX_K or LOCAL_KERNEL.get() is None:
        return None
    out = LOCAL_KERNEL.run(
        "local_select",
        d.detach().contiguous().numpy(),
        np.ascontiguousarray(labels.numpy(), np.int64),
        np.ascontiguousarray(ref_labels.numpy(), np.int64),
        bool(self_ref),
        int(k),
    )
    return None if out is None else tuple(torch.from_numpy(a) for a in out)


def packed_column_keys(x: torch.Tensor, *, descending: bool = False) -> torch.Tensor:
    """float32 ``[..., n]`` → int64 keys whose ascending order is the stable order of each row.

    Each value becomes a 32-bit integer in float order (``-0.0`` equal to ``+0.0``, NaN above
    ``+inf``; bitwise-negated for ``descending``), shifted above its column: ``(key << 32) | column``.
    So no two keys of a row are equal, and a key compares below another exactly when
    ``torch.sort(x, descending=descending, stable=True)`` puts its entry first. Torch ops only
    (no host read), any device; ``n < 2**31``.
    """
    if x.dtype != torch.float32 or x.shape[-1] >= 2**31:
        raise ValueError(
            f"packed_column_keys needs float32 rows shorter than 2**31, got {x.dtype} {tuple(x.shape)}"
        )
    # in place on one int64 buffer: a chain of fresh int32 temporaries costs twice the time
    key = (x.detach() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes +0.0
    flip = key >> 31
    flip &= 0x7FFFFFFF
    key ^= flip  # negative floats: all but the sign bit flipped, so integer order = float order
    key.masked_fill_(torch.isnan(x), torch.iinfo(torch.int32).max)
    if descending:
        key.bitwise_not_()
    key <<= 32
    key |= torch.arange(x.shape[-1], device=x.device)
    return key


def kth_smallest_column(x: torch.Tensor, index: torch.Tensor, bound: int) -> torch.Tensor:
    """Per row, the column at rank ``index`` (``[rows]``, ``< bound``) of the stable ascending order.

    ``[rows, n]`` → ``[rows]`` int64, equal to ``torch.sort(x, stable=True).indices`` at ``index``
    (NaN above ``+inf``, ``-0.0`` equal to ``+0.0``). Torch ops only (no host read), any device.
    """
    x = x.detach()
    bound = min(bound, x.shape[-1])
    if x.dtype == torch.float32 and x.shape[-1] < 2**31:
        packed = packed_column_keys(x)
        chosen = torch.topk(packed, bound, dim=-1, largest=False, sorted=True).values.gather(
            -1, index[:, None]
        )
        return (chosen & 0xFFFFFFFF).squeeze(-1)
    # the k-th value, then its column with ties in index order: the (index - #smaller + 1)-th
    # entry, counting in index order, whose value equals it
    value = kth_smallest(x, index, bound)
    nan, nan_value = torch.isnan(x), torch.isnan(value)
    smaller = ((x < value) | (nan_value & ~nan)).sum(-1, keepdim=True)  # NaN lies above everything
    tied = (x == value) | (nan & nan_value)
    rank = tied.cumsum(-1, dtype=torch.int32)
    return (tied & (rank == index[:, None] - smaller + 1)).to(torch.uint8).argmax(-1)
