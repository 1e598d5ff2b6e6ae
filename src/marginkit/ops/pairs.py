"""Pairwise distances, label masks and input checks shared by the pair losses and miners.

Private helpers (not re-exported): the pair losses in :mod:`marginkit.losses` and the miners
in :mod:`marginkit.mining` build on them.

Distances between the rows of ``x`` (``[B, D]``) and ``y`` (``[R, D]``):

- ``"squared_l2"``: ``‖x_i − y_j‖² = ‖x_i‖² + ‖y_j‖² − 2 x_i·y_j``, clamped at 0 (the
  expansion can round to a tiny negative number);
- ``"l2"``: ``torch.cdist`` (the same expansion in one matrix product for more than 25 rows,
  exact differences below), whose closed-form backward is 0 at a zero distance instead of
  ``inf``/NaN (two coinciding embeddings stay trainable); :func:`safe_sqrt` does the same
  for the row-wise distances of mined triplets;
- ``"cosine"``: ``1 − cos(x_i, y_j)``.

Host synchronisation: every check that needs a value from the device (non-finite inputs,
"no positive pair", "collapsed embeddings", index ranges, block sizes) is gathered into ONE
small tensor and read with a single ``.tolist()`` per forward (:func:`read_flags`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import torch

from marginkit._validation import compute_dtype, float_tensor, label_tensor
from marginkit.ops.norms import unit_rows

DISTANCES = ("squared_l2", "l2", "cosine")

#: Relative tolerance of the "collapsed embeddings" warning: all pairwise distances below
#: ``COLLAPSE_TOL`` times the largest embedding norm.
COLLAPSE_TOL = 1e-3


# ---------------------------------------------------------------------------- distances


def squared_l2_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` squared Euclidean distances ``‖x_i − y_j‖²`` (expansion, clamped at 0)."""
    xx = x.pow(2).sum(-1)
    yy = y.pow(2).sum(-1)
    return torch.addmm(xx[:, None] + yy[None, :], x, y.T, alpha=-2.0).clamp_min(0.0)


class _SafeSqrt(torch.autograd.Function):
    """``sqrt(x)`` for ``x >= 0`` with derivative ``1 / (2 sqrt(x))`` for ``x > 0`` and 0 at 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.clamp_min(0.0).sqrt()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        positive = out > 0
        return torch.where(positive, grad / (2.0 * torch.where(positive, out, 1.0)), 0.0)


def safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Square root whose gradient is finite everywhere: 0 at ``x = 0`` (a subgradient choice).

    ``torch.sqrt`` has an infinite derivative at 0, which turns into NaN once multiplied by
    the zero derivative of a distance between coinciding points.
    """
    return _SafeSqrt.apply(x)


def cosine_similarity_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` cosine similarities (rows normalised, finite at 0 and for huge entries)."""
    return unit_rows(x) @ unit_rows(y).T


def distance_matrix(x: torch.Tensor, y: torch.Tensor, distance: str) -> torch.Tensor:
    """``[B, R]`` distance matrix for ``distance`` in :data:`DISTANCES`."""
    if distance == "squared_l2":
        return squared_l2_matrix(x, y)
    if distance == "l2":
        return torch.cdist(x, y)
    if distance == "cosine":
        return 1.0 - cosine_similarity_matrix(x, y)
    raise ValueError(f"distance must be one of {DISTANCES}; got {distance!r}")


def rowwise_distance(x: torch.Tensor, y: torch.Tensor, distance: str) -> torch.Tensor:
    """Distances between matching rows of ``x`` and ``y`` (both ``[T, D]``), computed exactly."""
    if distance == "cosine":
        return 1.0 - (unit_rows(x) * unit_rows(y)).sum(-1)
    sq = (x - y).pow(2).sum(-1)
    return safe_sqrt(sq) if distance == "l2" else sq


# ---------------------------------------------------------------------------- inputs


class PairBatch(NamedTuple):
    """Validated pair-loss inputs in the working precision."""

    x: torch.Tensor  # [B, D] queries (float32 or float64)
    y: torch.Tensor  # [R, D] references (x itself when self_ref)
    labels: torch.Tensor | None  # [B]
    ref_labels: torch.Tensor | None  # [R]
    self_ref: bool  # references are the batch itself: exclude i == j pairs


def _embedding_tensor(x: Any, name: str, *, allow_empty_batch: bool = False) -> torch.Tensor:
    """Type and shape checks of an embedding matrix (no host sync; finiteness is a flag)."""
    float_tensor(x, name, min_dim=0, allow_empty=True, check_values=False)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [batch, dim], got shape {tuple(x.shape)}")
    if (x.shape[0] == 0 and not allow_empty_batch) or x.shape[1] == 0:
        raise ValueError(f"{name} must have a non-empty batch and embedding dimension, got {tuple(x.shape)}")
    return x


def prepare_pairs(
    embeddings: Any,
    labels: Any,
    ref_embeddings: Any = None,
    ref_labels: Any = None,
    *,
    labels_required: bool = True,
) -> PairBatch:
    """Check a pair-loss call and cast the embeddings to the working precision.

    The references are the batch itself (self-pairs excluded) when ``ref_embeddings`` is
    ``None`` or is the very same tensor object as ``embeddings``; otherwise every
    query/reference pair counts, including equal indices. An empty reference set (``[0, D]``,
    e.g. a memory bank before its first update) is accepted: see :func:`empty_reference_loss`.
    """
    x = _embedding_tensor(embeddings, "embeddings")
    batch = x.shape[0]
    if labels is None:
        if labels_required:
            raise ValueError("labels must be given (a 1-D integer tensor with one label per embedding)")
    else:
        labels = label_tensor(labels, "labels", shape=(batch,))
    if ref_embeddings is None and ref_labels is not None:
        raise ValueError("ref_labels was given without ref_embeddings; pass both or neither")
    self_ref = ref_embeddings is None or ref_embeddings is embeddings
    if ref_embeddings is None:
        y, ref_lab = x, labels
    else:
        y = _embedding_tensor(ref_embeddings, "ref_embeddings", allow_empty_batch=True)
        if y.shape[1] != x.shape[1]:
            raise ValueError(
                f"ref_embeddings must have the embedding dimension of embeddings ({x.shape[1]}), "
                f"got shape {tuple(y.shape)}"
            )
        if ref_labels is None:
            if self_ref:
                ref_lab = labels
            elif labels is not None:
                raise ValueError("ref_embeddings was given without ref_labels; pass both or neither")
            else:
                ref_lab = None
        else:
            ref_lab = label_tensor(ref_labels, "ref_labels", shape=(y.shape[0],))
            if self_ref and labels is not None and ref_lab is not labels and not torch.equal(ref_lab, labels):
                raise ValueError("ref_embeddings is embeddings but ref_labels differs from labels")
    work = compute_dtype(torch.promote_types(x.dtype, y.dtype))
    x_work = x.to(work)
    y_work = x_work if y is x else y.to(work)
    return PairBatch(x_work, y_work, labels, ref_lab, self_ref)


def label_masks(
    labels: torch.Tensor, ref_labels: torch.Tensor, self_ref: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean ``[B, R]`` masks of positive pairs (same label, self excluded) and negatives."""
    same = labels[:, None] == ref_labels[None, :]
    pos = same
    if self_ref:
        pos = same & ~torch.eye(same.shape[0], same.shape[1], dtype=torch.bool, device=same.device)
    return pos, ~same


def empty_reference_loss(owner: Any, batch: PairBatch, reduction: str) -> torch.Tensor:
    """Result of a pair loss against an empty reference set: no pair, loss 0, no warning.

    The graph stays connected (zero gradient); the NaN check still runs when ``owner.validate``.
    """
    if owner.validate:
        report_checks(owner, type(owner).__name__, read_flags(nonfinite_flag(batch.x))[0], None, None)
    zero = batch.x.sum() * 0.0
    owner.last_active_fraction = zero.detach()
    if hasattr(owner, "last_counts"):
        owner.last_counts = torch.zeros(batch.x.shape[0], dtype=zero.dtype, device=zero.device)
    return (
        zero + torch.zeros(batch.x.shape[0], dtype=zero.dtype, device=zero.device)
        if reduction == "none"
        else zero
    )


# ---------------------------------------------------------------------------- checks


def nonfinite_flag(*tensors: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: some entry of ``tensors`` is NaN or infinite (no sync)."""
    flag = torch.zeros((), dtype=torch.bool, device=tensors[0].device)
    for t in tensors:
        flag = flag | ~torch.isfinite(t).all()
    return flag


def collapsed_flag(sq_dist: torch.Tensor, scale: torch.Tensor | float, self_ref: bool) -> torch.Tensor:
    """0-d bool tensor: every pairwise distance is ≈ 0 relative to the embedding scale.

    ``sq_dist`` is the ``[B, R]`` squared Euclidean distance matrix between the (possibly
    normalised) embeddings and ``scale`` their largest squared norm (1 when normalised);
    collapse means ``max sq_dist <= COLLAPSE_TOL² · scale`` (all-zero embeddings count as
    collapsed). A batch of one sample against itself has no pair and never counts.
    """
    if self_ref and sq_dist.shape[0] * sq_dist.shape[1] <= 1:
        return torch.zeros((), dtype=torch.bool, device=sq_dist.device)
    return sq_dist.detach().amax() <= COLLAPSE_TOL**2 * scale


def underflow_flag(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: the raw embeddings are so small that their squared distances lose digits.

    Squares of entries below ``sqrt(tiny / eps)`` (3e-16 in float32) fall within ``1/eps`` of the
    subnormal numbers, where they keep fewer digits and then vanish: a raw Euclidean distance of
    embeddings of 1e-21 comes out a few 1e-4 off, of 1e-23 as 0. True when the largest entry is
    below that but not 0 (all-zero embeddings are the "collapsed" warning's case). No sync.
    """
    info = torch.finfo(x.dtype)
    ends = [torch.stack(torch.aminmax(t.detach())).abs() for t in (x, y) if t.numel()]
    top = torch.cat(ends).amax()
    return (top > 0) & (top < math.sqrt(info.tiny / info.eps))


def too_small_error(x: torch.Tensor, y: torch.Tensor, distance: str) -> ValueError:
    """The error for :func:`underflow_flag` (names the largest entry and the bound)."""
    info = torch.finfo(x.dtype)
    top = float(torch.maximum(x.detach().abs().max(), y.detach().abs().max()))
    dtype = str(x.dtype).removeprefix("torch.")
    return ValueError(
        f"embeddings are too small: their {distance} distances underflow {dtype} "
        f"(largest |entry| {top:.3g}, below {math.sqrt(info.tiny / info.eps):.2g}, where squares lose their "
        "digits); scale them up or set normalize=True"
    )


def max_sq_norm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Largest squared row norm of ``x`` and ``y`` (detached, 0-d)."""
    return torch.maximum(x.detach().pow(2).sum(-1).amax(), y.detach().pow(2).sum(-1).amax())


def read_flags(*flags: torch.Tensor) -> list[int]:
    """Read several 0-d tensors (bool or int) with a single host synchronisation."""
    return [int(v) for v in torch.stack([f.to(torch.int64) for f in flags]).tolist()]


def warn_once(owner: Any, key: str, message: str) -> None:
    """``warnings.warn`` ``message`` once per ``owner`` instance and ``key``."""
    warned = owner.__dict__.setdefault("_warned", set())
    if key not in warned:
        warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def report_checks(
    owner: Any, name: str, nonfinite: int, no_positive: int | None, collapsed: int | None
) -> None:
    """Raise on non-finite embeddings; warn once about missing positives / collapse."""
    if nonfinite:
        raise ValueError("embeddings (or ref_embeddings) contain NaN or infinite values")
    if no_positive:
        warn_once(
            owner,
            "no_positive",
            f"{name}: the batch has no positive pair (no two samples share a label), so the loss is 0 "
            "and gives no gradient; build batches with several samples per class "
            "(e.g. marginkit.data.PKSampler). This warning is shown once per loss instance.",
        )
    if collapsed:
        warn_once(
            owner,
            "collapsed",
            f"{name}: all pairwise distances are ~0 — the embeddings have collapsed to a single point "
            "(check the learning rate, the margin and the sampler). This warning is shown once per "
            "loss instance.",
        )


def check_indices(
    indices: Any, batch: int, ref_batch: int, device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Check a mined triplet tuple ``(a, p, n)``; returns it and a 0-d "out of range" flag.

    Types, shapes and lengths are checked here; the range is returned as a flag so that the
    caller reads it in its single host sync.
    """
    if not isinstance(indices, (tuple, list)) or len(indices) != 3:
        raise TypeError("indices must be a tuple (anchor, positive, negative) of 1-D integer tensors")
    out = []
    for part, t in zip(("anchor", "positive", "negative"), indices, strict=True):
        label_tensor(t, f"indices[{part}]")
        if t.dim() != 1:
            raise ValueError(f"indices[{part}] must be 1-D, got shape {tuple(t.shape)}")
        out.append(t.to(device=device, dtype=torch.long))
    a, p, n = out
    if not (a.shape == p.shape == n.shape):
        raise ValueError(
            f"indices must have equal lengths, got {a.shape[0]}, {p.shape[0]}, {n.shape[0]} (a, p, n)"
        )
    bad = torch.zeros((), dtype=torch.bool, device=device)
    if a.numel() and (batch == 0 or ref_batch == 0):
        raise ValueError("indices out of range: the reference set is empty")
    if a.numel():
        bad = (a.min() < 0) | (a.max() >= batch) | (torch.minimum(p.min(), n.min()) < 0)
        bad = bad | (torch.maximum(p.max(), n.max()) >= ref_batch)
    return (a, p, n), bad


PairIndices = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def check_pair_indices(
    indices: Any, batch: int, ref_batch: int, device: torch.device
) -> tuple[PairIndices, torch.Tensor]:
    """Check mined pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)`` (read as ``(a, p, a, n)``).

    Returns the four index tensors and a 0-d "out of range" flag for the caller's single sync.
    """
    if not isinstance(indices, (tuple, list)) or len(indices) not in (3, 4):
        raise TypeError(
            "indices must be a tuple of 1-D integer tensors: pairs (anchor1, positive, anchor2, negative) "
            "or triplets (anchor, positive, negative)"
        )
    parts = (
        ("anchor1", "positive", "anchor2", "negative")
        if len(indices) == 4
        else ("anchor", "positive", "negative")
    )
    out = []
    for part, t in zip(parts, indices, strict=True):
        label_tensor(t, f"indices[{part}]")
        if t.dim() != 1:
            raise ValueError(f"indices[{part}] must be 1-D, got shape {tuple(t.shape)}")
        out.append(t.to(device=device, dtype=torch.long))
    a1, p, a2, n = out if len(out) == 4 else (out[0], out[1], out[0], out[2])
    if a1.shape != p.shape or a2.shape != n.shape:
        raise ValueError(
            f"indices must pair up: got {a1.shape[0]} anchors for {p.shape[0]} positives and "
            f"{a2.shape[0]} anchors for {n.shape[0]} negatives"
        )
    bad = torch.zeros((), dtype=torch.bool, device=device)
    for anchors, refs in ((a1, p), (a2, n)):
        if anchors.numel() and (batch == 0 or ref_batch == 0):
            raise ValueError("indices out of range: the reference set is empty")
        if anchors.numel():
            bad = (
                bad
                | (anchors.min() < 0)
                | (anchors.max() >= batch)
                | (refs.min() < 0)
                | (refs.max() >= ref_batch)
            )
    return (a1, p, a2, n), bad


def pair_masks_from_indices(
    indices: PairIndices, shape: tuple[int, int], *, counts: bool, clamp: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, R]`` positive / negative masks of mined pairs: bool sets, or multiplicities.

    ``clamp`` clips out-of-range indices first (their error is raised after the forward's
    single host sync, from the flag of :func:`check_pair_indices`).
    """
    a1, p, a2, n = indices
    if clamp:
        a1, a2 = a1.clamp(0, shape[0] - 1), a2.clamp(0, shape[0] - 1)
        p, n = p.clamp(0, shape[1] - 1), n.clamp(0, shape[1] - 1)
    masks = []
    for a, j in ((a1, p), (a2, n)):
        if counts:
            m = torch.zeros(shape, dtype=torch.int64, device=a.device)
            m.index_put_((a, j), torch.ones_like(a), accumulate=True)
        else:
            m = torch.zeros(shape, dtype=torch.bool, device=a.device)
            m[a, j] = True
        masks.append(m)
    return masks[0], masks[1]
