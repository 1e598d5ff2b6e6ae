"""Triplet mining: K-NN-aware local triplets and batch-hard triplets, as index tensors.

The selection rules are shared with the triplet losses (:mod:`marginkit.losses.triplet`):
a loss selects its triplets with the private ``_*_select`` functions below (under
``no_grad``) and then differentiates through the selected distances only, so a mined triplet
tuple passed back as ``indices=`` gives the same value and gradient.

Ties are broken by index (first the smallest index), so the selection is deterministic.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from marginkit._validation import choice, float_tensor, positive_float, positive_int
from marginkit.ops.norms import unit_rows
from marginkit.ops.pairs import DISTANCES, PairBatch, distance_matrix, label_masks, prepare_pairs
from marginkit.ops.selection import kth_smallest_column, local_select

Triplets = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


#: The key of ``+inf`` at column 0: the bits of the float64 ``+inf``.
_INF_KEY = 0x7FF0000000000000


def _order_keys(d: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Distinct ``int64`` keys in the stable order of the rows of ``d`` (float32, ``>= 0`` or NaN).

    A float32 widened to float64 leaves the low 29 bits of its pattern 0, and the patterns of
    non-negative float64 numbers are in their order as integers; the column (``columns``: the
    ``arange`` of ``d``'s width, below ``2**29``) fills those bits. So ``key[i] < key[j]`` iff
    ``d[i] < d[j]``, or they are equal and ``i < j``: the order of ``torch.sort(row,
    stable=True)``, ``+inf`` (key ``_INF_KEY | column``) above every number and NaN above
    ``+inf`` (NaNs with the one pattern arithmetic gives them tie among themselves). ``d`` is
    overwritten with ``|d|`` (which only clears the sign of a NaN or of ``-0.0``).
    """
    return d.abs_().to(torch.float64).view(torch.int64).bitwise_or_(columns)


def _local_select(
    dist: torch.Tensor, labels: torch.Tensor, ref_labels: torch.Tensor, self_ref: bool, k: int
) -> tuple[torch.Tensor, ...]:
    """Per anchor: the k-th nearest positive (k capped by #positives) and the nearest negative.

    ``dist [B, R]`` (detached; overwritten) between the anchors (``labels [B]``) and the
    references (``ref_labels [R]``; with ``self_ref`` they are the anchors, and ``i == j`` is no
    positive). Called without grad. Returns ``(p_idx, n_idx, d_pos, d_neg, has_pos, has_neg)``,
    all ``[B]``: the columns, their distances, and which anchors have a positive / a negative
    (the other entries are in range but meaningless).

    The k-th positive is the entry at rank ``min(k, #positives) − 1`` in the stable ascending
    order of the row with every other entry set to ``+inf`` (equal distances in index order,
    NaN last): for float32, the column of one ``torch.topk`` of the keys of :func:`_order_keys`
    (distinct: exact whatever order topk leaves ties in); for other dtypes
    :func:`marginkit.ops.selection.kth_smallest_column`. The nearest negative is the
    first minimal one (``torch.min``). float32 on the CPU with numba installed:
    :func:`marginkit.ops.selection.local_select`, the same bits in one compiled pass (``dist`` is
    then left as it was).
    """
    fast = local_select(dist, labels, ref_labels, self_ref, k)
    if fast is not None:  # float32 on the CPU with numba: the same bits without a topk
        return fast
    same = labels.unsqueeze(1) == ref_labels
    n_same = same.sum(1)
    npos = n_same - 1 if self_ref else n_same
    kth = (npos.clamp(max=k) - 1).clamp_min_(0)
    if dist.dtype == torch.float32 and dist.shape[1] < 2**29:
        columns = torch.arange(dist.shape[1], device=dist.device)
        inf_keys = columns | _INF_KEY  # the other entries count as +inf (distinct keys: topk is faster)
        keys = _order_keys(dist, columns)
        keys = torch.where(same, keys, inf_keys, out=keys)
        if self_ref:
            keys.diagonal().copy_(inf_keys)
        cols = torch.topk(keys, min(k, dist.shape[1]), dim=1, largest=False).indices
        p_idx = cols.gather(1, kth.unsqueeze(1)).squeeze(1)
    else:
        pos = same & ~torch.eye(*same.shape, dtype=torch.bool, device=same.device) if self_ref else same
        p_idx = kth_smallest_column(dist.masked_fill(~pos, math.inf), kth, k)
    d_pos = dist.gather(1, p_idx.unsqueeze(1)).squeeze(1)
    d_neg, n_idx = dist.masked_fill_(same, math.inf).min(dim=1)
    return p_idx, n_idx, d_pos, d_neg, npos > 0, n_same != same.shape[1]


@torch.no_grad()
def _batch_hard_select(
    dist: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per anchor: the farthest positive and the nearest negative (Hermans et al., 2017)."""
    d = dist.detach()
    p_idx = d.masked_fill(~pos, -math.inf).max(dim=1).indices
    n_idx = d.masked_fill(~neg, math.inf).min(dim=1).indices
    valid = pos.any(1) & neg.any(1)
    return p_idx, n_idx, valid


@torch.no_grad()
def _semi_hard_select(
    dist: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per anchor-positive pair: the semi-hard negative of FaceNet / TF ``triplet_semihard_loss``.

    For the pair ``(a, p)``: the nearest negative strictly farther than ``d(a, p)``; if there
    is none, the farthest negative. Done with one sort and ``searchsorted`` per anchor row,
    ``O(B R log R)`` time and ``O(B R)`` memory. Returns ``(n_idx [B, R], valid [B, R])``.
    """
    d = dist.detach()
    nneg = neg.sum(1, keepdim=True)
    sorted_neg, order = torch.sort(d.masked_fill(~neg, math.inf), dim=1, stable=True)
    first_farther = torch.searchsorted(sorted_neg, d.contiguous(), right=True)
    slot = torch.where(first_farther >= nneg, nneg - 1, first_farther).clamp_min(0)
    n_idx = order.gather(1, slot)
    valid = pos & (nneg > 0)
    return n_idx, valid


def _prepare(
    embeddings: Any,
    labels: Any,
    ref_embeddings: Any,
    ref_labels: Any,
    distance: str,
    normalize: bool,
) -> tuple[torch.Tensor, PairBatch]:
    batch = prepare_pairs(embeddings, labels, ref_embeddings, ref_labels)
    float_tensor(batch.x, "embeddings")
    if not batch.self_ref and batch.y.shape[0]:
        float_tensor(batch.y, "ref_embeddings")
    x, y = batch.x, batch.y
    if normalize:  # (unit_rows: F.normalize overflows or leaves tiny rows unnormalised)
        x = unit_rows(x)
        y = x if batch.self_ref else unit_rows(y)
    return distance_matrix(x, y, distance), batch


def _no_triplets(device: torch.device) -> Triplets:
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return empty, empty.clone(), empty.clone()


@torch.no_grad()
def local_triplets(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    k: int,
    margin: float,
    *,
    normalize: bool = True,
    ref_embeddings: torch.Tensor | None = None,
    ref_labels: torch.Tensor | None = None,
) -> Triplets:
    """K-NN-aware local triplet mining (Thammasorn et al., arXiv:1911.07940).

    With squared Euclidean distances ``d`` (on L2-normalised embeddings by default), for each
    anchor ``a`` that has a positive and a negative: the local positive ``p`` is its k-th
    nearest positive (``k`` = the downstream K-NN's K, capped by the number of positives)
    and the negative ``n`` its nearest negative. The triplet is returned when it violates
    the local margin, i.e. ``d(a, n) < d(a, p) + margin`` — the negative lies within the
    anchor's local positive bound plus the margin. These are exactly the triplets with a
    non-zero :class:`~marginkit.losses.LocalMarginTripletLoss`.

    Args:
        embeddings: ``[B, D]`` float tensor.
        labels: ``[B]`` integer labels.
        k: the K of the downstream K-NN classifier, ``>= 1``.
        margin: ``>= 0``, in squared-distance units.
        normalize: L2-normalise the embeddings first (default, as the loss does).
        ref_embeddings, ref_labels: optional reference set (then ``p``, ``n`` index it and
            no self-pair is excluded unless it is ``embeddings`` itself).

    Returns:
        ``(anchor, positive, negative)``: 1-D ``int64`` index tensors of equal length.

    Example:
        >>> import torch
        >>> from marginkit.mining import local_triplets
        >>> emb = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
        >>> local_triplets(emb, torch.tensor([0, 0, 1, 1]), k=1, margin=0.0)  # 1 and 2 sit closer
        (tensor([1, 2]), tensor([0, 3]), tensor([2, 1]))
    """
    k = positive_int(k, "k")
    margin = positive_float(margin, "margin", allow_zero=True)
    dist, batch = _prepare(embeddings, labels, ref_embeddings, ref_labels, "squared_l2", normalize)
    if dist.shape[1] == 0:
        return _no_triplets(dist.device)
    p_idx, n_idx, d_pos, d_neg, has_pos, has_neg = _local_select(
        dist, batch.labels, batch.ref_labels, batch.self_ref, k
    )
    keep = has_pos & has_neg & (d_neg < d_pos + margin)
    anchors = keep.nonzero().squeeze(1)
    return anchors, p_idx[anchors], n_idx[anchors]


@torch.no_grad()
def batch_hard_triplets(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    *,
    margin: float | None = None,
    distance: str = "squared_l2",
    normalize: bool = True,
    ref_embeddings: torch.Tensor | None = None,
    ref_labels: torch.Tensor | None = None,
) -> Triplets:
    """Batch-hard mining (Hermans, Beyer, Leibe, "In Defense of the Triplet Loss", 2017).

    For each anchor with a positive and a negative: its farthest positive and nearest
    negative. With ``margin`` given, only the triplets that violate it
    (``d(a, p) − d(a, n) + margin > 0``) are returned.

    Args:
        embeddings: ``[B, D]`` float tensor.
        labels: ``[B]`` integer labels.
        margin: optional ``>= 0``: keep only margin-violating triplets.
        distance: ``"squared_l2"`` | ``"l2"`` | ``"cosine"`` (``1 − cos``).
        normalize: L2-normalise the embeddings first (default).
        ref_embeddings, ref_labels: optional reference set (``p``, ``n`` index it).

    Returns:
        ``(anchor, positive, negative)``: 1-D ``int64`` index tensors of equal length.

    Example:
        >>> import torch
        >>> from marginkit.mining import batch_hard_triplets
        >>> points = torch.tensor([[0.0], [1.0], [3.0], [4.5]])  # on a line, two classes
        >>> a, p, n = batch_hard_triplets(points, torch.tensor([0, 0, 1, 1]), normalize=False)
        >>> p.tolist(), n.tolist()  # farthest positive, nearest negative of each anchor
        ([1, 0, 3, 2], [2, 2, 1, 1])
    """
    distance = choice(distance, "distance", DISTANCES)
    if margin is not None:
        margin = positive_float(margin, "margin", allow_zero=True)
    dist, batch = _prepare(embeddings, labels, ref_embeddings, ref_labels, distance, normalize)
    if dist.shape[1] == 0:
        return _no_triplets(dist.device)
    pos, neg = label_masks(batch.labels, batch.ref_labels, batch.self_ref)
    p_idx, n_idx, keep = _batch_hard_select(dist, pos, neg)
    if margin is not None:
        rows = torch.arange(dist.shape[0], device=dist.device)
        keep = keep & (dist[rows, p_idx] - dist[rows, n_idx] + margin > 0)
    anchors = keep.nonzero().squeeze(1)
    return anchors, p_idx[anchors], n_idx[anchors]
