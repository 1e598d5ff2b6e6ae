"""Triplet losses: the local-margin (K-NN-aware) triplet loss and the classic triplet baseline.

- :class:`LocalMarginTripletLoss` — Thammasorn et al., "Neighborhood Watch: Representation
  Learning with Local-Margin Triplet Loss and Sampling Strategy for K-Nearest-Neighbor Image
  Classification", arXiv:1911.07940 (formulation of SPEC §5).
- :class:`TripletMarginLoss` — Schroff, Kalenichenko, Philbin, "FaceNet", CVPR 2015 (semi-hard
  mining); Hermans, Beyer, Leibe, "In Defense of the Triplet Loss for Person
  Re-Identification", arXiv:1703.07737 (batch-hard, batch-all).

Every loss works on a ``[B, R]`` distance matrix between the batch and its references, never
on a ``[B, R, R]`` triplet tensor held for backward: batch-hard / local-margin select one
triplet per anchor, semi-hard one negative per anchor-positive pair (sort + searchsorted),
and batch-all runs a custom autograd function over blocks of anchors whose backward only
needs per-pair counts of active triplets (memory ``O(B·R)`` plus one block).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
import torch.nn.functional as F

from marginkit._validation import REDUCTIONS, choice, nonnegative, positive_int
from marginkit.losses.pair_loss import PairLoss
from marginkit.mining.triplets import _batch_hard_select, _local_select, _semi_hard_select
from marginkit.ops.norms import unit_rows
from marginkit.ops.pairs import (
    COLLAPSE_TOL,
    DISTANCES,
    PairBatch,
    check_indices,
    collapsed_flag,
    distance_matrix,
    empty_reference_loss,
    label_masks,
    max_sq_norm,
    nonfinite_flag,
    read_flags,
    report_checks,
    rowwise_distance,
    too_small_error,
    underflow_flag,
)

MINING = ("batch_hard", "batch_all", "semi_hard")
AVERAGES = ("valid", "active")

#: Elements of one block of the batch-all triplet tensor (anchors × positives × references).
BLOCK_ELEMENTS = 1 << 22


class _BatchAllTriplets(torch.autograd.Function):
    """Sum over all valid triplets of ``h(d[a, p] − d[a, n] + margin)``, per anchor.

    ``h`` is ``relu``, or the softplus ``log(1 + e^t)`` when ``smooth``. Inputs: ``dist [B, R]``;
    ``pos_idx [B, P]`` the positive columns of each anchor (padded), ``pos_valid [B, P]``;
    ``neg [B, R]`` the negative mask. Outputs per anchor: the sum and the number of active
    triplets (``h > 0``; ``int64``, not differentiable).

    Backward: with ``A[a, p, n] = h′(t)`` over the valid triplets (the active indicator for
    ``relu``, ``sigmoid(t)`` for softplus), ``∂/∂d[a, p] = Σ_n A[a, p, n]`` and
    ``∂/∂d[a, n] = −Σ_p A[a, p, n]`` — only these two ``[B, P]`` / ``[B, R]`` matrices are
    saved, never the triplet tensor.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        dist: torch.Tensor,
        pos_idx: torch.Tensor,
        pos_valid: torch.Tensor,
        neg: torch.Tensor,
        margin: float,
        block: int,
        smooth: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_anchor = dist.shape[0]
        d_ap = dist.gather(1, pos_idx)
        sums = dist.new_zeros(n_anchor)
        active = torch.zeros(n_anchor, dtype=torch.int64, device=dist.device)
        cnt_p = torch.zeros_like(d_ap)
        cnt_n = torch.zeros_like(dist)
        for start in range(0, n_anchor, block):  # blocks of anchors bound the memory, not a row loop
            sl = slice(start, start + block)
            t = d_ap[sl, :, None] - dist[sl, None, :] + margin
            valid = pos_valid[sl, :, None] & neg[sl, None, :]
            if smooth:
                value = _softplus(t)
                act = valid & (value > 0)
                weight = torch.where(valid, torch.sigmoid(t), 0.0)
                sums[sl] = torch.where(valid, value, 0.0).sum((1, 2))
                cnt_p[sl] = weight.sum(2)
                cnt_n[sl] = weight.sum(1)
            else:
                act = (t > 0) & valid
                sums[sl] = torch.where(act, t, 0.0).sum((1, 2))
                cnt_p[sl] = act.sum(2, dtype=dist.dtype)
                cnt_n[sl] = act.sum(1, dtype=dist.dtype)
            active[sl] = act.sum((1, 2))
        ctx.save_for_backward(pos_idx, cnt_p, cnt_n)
        ctx.mark_non_differentiable(active)
        return sums, active

    @staticmethod
    def backward(ctx: Any, grad_sums: torch.Tensor, _grad_active: Any) -> tuple[Any, ...]:
        pos_idx, cnt_p, cnt_n = ctx.saved_tensors
        g = grad_sums[:, None]
        grad = (-g * cnt_n).scatter_add_(1, pos_idx, g * cnt_p)
        return grad, None, None, None, None, None, None


def _unit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`marginkit.ops.norms.unit_rows` of ``x`` (bit for bit), with what its backward needs.

    Returns ``(u, norm, scale, top)``: ``u = (x / scale) / norm``, ``top`` the largest magnitude of
    each row, ``scale`` that or 1 for an all-zero row, ``norm = max(‖x / scale‖, 1e-12)`` (all
    ``[B, 1]``).
    """
    top = x.abs().amax(-1, keepdim=True)
    scale = torch.where(top > 0, top, 1.0)
    z = x / scale
    norm = torch.linalg.vector_norm(z, dim=-1, keepdim=True).clamp_min_(1e-12)
    return z.div_(norm), norm, scale, top


def _unit_backward(grad: torch.Tensor, u: torch.Tensor, norm_scale: torch.Tensor) -> torch.Tensor:
    """Gradient through :func:`_unit`: ``(g − u (u·g)) / (norm · scale)``, in place of ``grad``.

    The projection is ``F.normalize``'s derivative; where the norm was clamped (all-zero rows)
    ``u = 0`` and it is ``g / (1e-12 · scale)``, as autograd's (the clamp stops the norm's part).
    """
    dot = (u * grad).sum(-1, keepdim=True)
    return grad.addcmul_(u, dot, value=-1.0).div_(norm_scale)


class _LocalMarginTriplets(torch.autograd.Function):
    """The local-margin triplet loss of SPEC §5, reduced, with a hand-written backward.

    Inputs: the embeddings ``x [B, D]`` and references ``y [R, D]`` (``x`` itself when
    ``self_ref``), their labels. Forward: with ``normalize``, the unit rows of
    :func:`marginkit.ops.norms.unit_rows`; the squared distances ``d = max(‖x‖² + ‖y‖² − 2·x·yᵀ,
    0)`` of :func:`marginkit.ops.pairs.squared_l2_matrix` (the same ops, bit for bit); the
    selection of :func:`marginkit.mining.triplets._local_select`; the hinge ``relu(d[a, p_a] −
    d[a, n_a] + margin)`` on the two selected entries of each anchor (0 where it has no positive
    or no negative), summed, averaged over the anchors that have both, or kept per anchor
    (``reduction``). Outputs: that, then (not differentiable) 1 for the anchors that count in
    the mean, else 0, and ``stats``: the numbers of those, of the active ones (loss > 0) and of
    the anchors with a positive, the active fraction, then, with ``checks``, the extremes
    :meth:`LocalMarginTripletLoss._report` reads.

    Backward, by hand: only the two selected distances of an active anchor have a gradient,
    ``w = ∂L/∂loss_a`` for ``d[a, p]`` and ``−w`` for ``d[a, n]``, and ``∂d[a, j]/∂x_a =
    2 (x_a − y_j) = −∂d[a, j]/∂y_j`` — the derivative of ``‖x_a − y_j‖²`` — so ``∂/∂x_a =
    2w (y_n − y_p)``, ``∂/∂y_p += 2w (y_p − x_a)``, ``∂/∂y_n += 2w (x_a − y_n)``: ``O((B + R)·D)``
    work where autograd carried a dense ``[B, R]`` gradient through two matrix products. Then
    the unit rows' derivative (:func:`_unit_backward`). Autograd through the clamped expansion
    gave 0 where rounding had made it negative (near-duplicates), this gives the exact
    derivative there too; elsewhere the two agree up to rounding. Second derivatives
    (``create_graph=True``) are refused by name.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        labels: torch.Tensor,
        ref_labels: torch.Tensor,
        self_ref: bool,
        k: int,
        margin: float,
        normalize: bool,
        reduction: str,
        checks: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if normalize:
            u, norm_u, scale_u, top_u = _unit(x)
            v, norm_v, scale_v, top_v = (u, norm_u, scale_u, top_u) if self_ref else _unit(y)
        else:
            u, v = x, y
        uu = (u * u).sum(-1)
        vv = uu if self_ref else (v * v).sum(-1)
        d = (uu.unsqueeze(1) + vv).addmm_(u, v.T, alpha=-2.0).clamp_min_(0.0)
        top_d = d.amax() if checks else None  # before the selection overwrites d
        p_idx, n_idx, d_pos, d_neg, has_pos, has_neg = _local_select(d, labels, ref_labels, self_ref, k)
        valid = has_pos & has_neg
        loss = torch.where(valid, (d_pos - d_neg + margin).clamp_min_(0.0), 0.0)
        active = loss > 0
        counts = torch.stack((valid, active, has_pos)).sum(1, dtype=loss.dtype)
        n_valid = counts[0].clamp_min(1.0)
        if reduction == "mean":
            loss = loss.sum() / n_valid
        elif reduction == "sum":
            loss = loss.sum()
        # [valid, active, with a positive] / max(valid, 1): [1 or 0, active fraction, > 0 iff any]
        stats = counts / n_valid
        if top_d is not None:
            if normalize:
                top = top_u.amax() if self_ref else torch.maximum(top_u.amax(), top_v.amax())
                extremes = torch.stack((top, top_d))
            else:
                top = x.abs().amax() if self_ref else torch.maximum(x.abs().amax(), y.abs().amax())
                scale = uu.amax() if self_ref else torch.maximum(uu.amax(), vv.amax())
                extremes = torch.stack((top, top_d, scale))
            stats = torch.cat((stats, extremes))
        ctx.set_materialize_grads(False)
        ctx.self_ref, ctx.normalize = self_ref, normalize
        # d loss / d d[a, p]: 2w for an active anchor (w = its weight in the reduction), else 0
        w2 = active * (2.0 / n_valid if reduction == "mean" else 2.0)
        saved = (u, v, torch.cat((p_idx, n_idx)), w2)
        if normalize:
            saved += (norm_u * scale_u,) if self_ref else (norm_u * scale_u, norm_v * scale_v)
        ctx.save_for_backward(*saved)
        counted = valid.to(loss.dtype)
        ctx.mark_non_differentiable(counted, stats)
        return loss, counted, stats

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None, *_unused: Any) -> tuple[Any, ...]:
        if torch.is_grad_enabled():  # create_graph=True: this backward is not differentiable
            raise RuntimeError(
                "LocalMarginTripletLoss has a hand-written first derivative only: second derivatives "
                "(create_graph=True) are not supported"
            )
        none = (None,) * 8
        if grad is None:
            return None, None, *none
        u, v, pn_idx, w2, *rest = ctx.saved_tensors
        w2 = (w2 * grad).unsqueeze(1)
        # rows [0]: 2w (y_p − x_a), the gradient of y_p; rows [1]: 2w (y_n − x_a), minus that of y_n
        both = v.index_select(0, pn_idx).view(2, *u.shape).sub_(u).mul_(w2)
        grad_u = torch.sub(both[1], both[0])  # 2w (y_n − y_p)
        both[1].neg_()
        grad_v = grad_u if ctx.self_ref else torch.zeros_like(v)
        grad_v.index_add_(0, pn_idx, both.view(-1, u.shape[1]))
        if ctx.normalize:
            grad_u = _unit_backward(grad_u, u, rest[0])
            if not ctx.self_ref:
                grad_v = _unit_backward(grad_v, v, rest[1])
        return grad_u, (None if ctx.self_ref else grad_v), *none


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (float32 or float64), as a tensor op of that dtype has it."""
    return struct.unpack("f", struct.pack("f", value))[0] if dtype == torch.float32 else value


def _softplus(t: torch.Tensor) -> torch.Tensor:
    """Exact ``log(1 + e^t)`` (``F.softplus`` is linear above 20: an absolute error up to 2e-9)."""
    return torch.logaddexp(t, torch.zeros_like(t))


def _sq_dist(d: torch.Tensor, distance: str) -> torch.Tensor:
    """Squared Euclidean distance from a distance value (cosine: on unit vectors, 2·(1 − cos))."""
    if distance == "l2":
        return d * d
    if distance == "cosine":
        return 2.0 * d
    return d


class _TripletBase(PairLoss):
    """Shared checks, mined-indices path and bookkeeping of the triplet losses.

    ``forward`` (:class:`~marginkit.losses.pair_loss.PairLoss`): triplets mined here from
    ``labels`` (against the references, by default the batch itself), or the given
    ``indices`` (anchor, positive, negative) of a miner.
    """

    hyperparameters = (("margin", nonnegative),)
    smooth_loss: bool = False
    margin: float
    distance: str
    normalize: bool
    last_counts: torch.Tensor | None

    def _pair_loss(self, batch: PairBatch, indices: Any) -> torch.Tensor:
        margin = float(self.margin)  # checked by _check_hyperparameters
        if indices is not None:
            return self._indices_forward(batch, indices, margin, self._indices_average())
        if batch.y.shape[0] == 0:
            return empty_reference_loss(self, batch, self.reduction)
        return self._mined(batch, margin)

    def _indices_average(self) -> str:
        return "valid"

    def _mined(self, batch: PairBatch, margin: float) -> torch.Tensor:
        raise NotImplementedError

    def _embed(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch.x, batch.y
        if self.normalize:
            x = unit_rows(x)
            y = x if batch.self_ref else unit_rows(y)
        return x, y

    def _hinge(self, t: torch.Tensor) -> torch.Tensor:
        return _softplus(t) if self.smooth_loss else F.relu(t)

    def _scale(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | float:
        return 1.0 if (self.normalize or self.distance == "cosine") else max_sq_norm(x, y)

    def _underflow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Raw Euclidean distances of embeddings too small for their squares (:func:`underflow_flag`)."""
        if self.normalize or self.distance == "cosine":
            return torch.zeros((), dtype=torch.bool, device=x.device)
        return underflow_flag(x, y)

    def _finish(
        self,
        per_unit: torch.Tensor,
        counts: torch.Tensor,
        active: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """Reduce per-anchor (or per-triplet) sums; ``counts`` are the units in the mean."""
        self.last_counts = counts.detach()
        self.last_active_fraction = (active.sum() / valid.sum().clamp_min(1)).to(per_unit.dtype).detach()
        if self.reduction == "none":
            out = per_unit
        elif self.reduction == "sum":
            out = per_unit.sum()
        else:
            out = per_unit.sum() / counts.sum().clamp_min(1).to(per_unit.dtype)
        return out

    def _indices_forward(self, batch: PairBatch, indices: Any, margin: float, average: str) -> torch.Tensor:
        x, y = self._embed(batch)
        (a, p, n), out_of_range = check_indices(indices, x.shape[0], y.shape[0], x.device)
        if self.validate:  # compute on clamped indices, check everything in one sync below
            a, p, n = a.clamp(0, x.shape[0] - 1), p.clamp(0, y.shape[0] - 1), n.clamp(0, y.shape[0] - 1)
        xa = x[a]
        d_ap = rowwise_distance(xa, y[p], self.distance)
        d_an = rowwise_distance(xa, y[n], self.distance)
        loss = self._hinge(d_ap - d_an + margin)
        if self.validate:
            collapsed = torch.zeros((), dtype=torch.bool, device=x.device)
            if a.numel():
                sq = torch.maximum(
                    _sq_dist(d_ap.detach(), self.distance), _sq_dist(d_an.detach(), self.distance)
                )
                collapsed = collapsed_flag(sq[None], self._scale(x, y), False)
            nonfinite, bad, collapsed_, small = read_flags(
                nonfinite_flag(batch.x, batch.y), out_of_range, collapsed, self._underflow(x, y)
            )
            if small and not nonfinite:
                raise too_small_error(x, y, self.distance)
            if bad:
                raise ValueError(
                    f"indices out of range: anchors must lie in [0, {x.shape[0]}) and positives/negatives "
                    f"in [0, {y.shape[0]})"
                )
            report_checks(self, type(self).__name__, nonfinite, None, collapsed_)
        active = loss.detach() > 0
        valid = torch.ones_like(active)
        counts = active if average == "active" else valid
        return self._finish(loss, counts.to(loss.dtype), active, valid)

    def _matrix_checks(
        self,
        batch: PairBatch,
        x: torch.Tensor,
        y: torch.Tensor,
        dist: torch.Tensor,
        pos: torch.Tensor,
        *extra: torch.Tensor,
    ) -> list[int]:
        """The one host sync of a forward: NaN check, warnings, and ``extra`` integers."""
        if not self.validate:
            return read_flags(*extra) if extra else []
        nonfinite, overflow, small, no_pos, collapsed, *rest = read_flags(
            nonfinite_flag(batch.x, batch.y),
            nonfinite_flag(dist),
            self._underflow(x, y),
            ~pos.any(),
            collapsed_flag(_sq_dist(dist.detach(), self.distance), self._scale(x, y), batch.self_ref),
            *extra,
        )
        if small and not nonfinite:
            raise too_small_error(x, y, self.distance)
        report_checks(self, type(self).__name__, nonfinite, no_pos, collapsed)
        if overflow:  # finite embeddings whose squared distances exceed the dtype (|e| ≳ 1e19 in float32)
            self._overflow_error(batch, dist.dtype)
        return rest

    def _overflow_error(self, batch: PairBatch, dtype: torch.dtype) -> None:
        top = float(torch.maximum(batch.x.detach().abs().max(), batch.y.detach().abs().max()))
        raise ValueError(
            f"embeddings are too large: their {self.distance} distances overflow {dtype} "
            f"(largest |entry| {top:.3g}); scale them down or set normalize=True"
        )


class LocalMarginTripletLoss(_TripletBase):
    """Local-margin triplet loss for K-NN classification (Thammasorn et al., arXiv:1911.07940).

    With squared Euclidean distances ``d`` between (by default L2-normalised) embeddings, for
    each anchor ``a`` with ``n_a >= 1`` positives and at least one negative:

    .. math::

        b_a = d(a, p_{(\\min(k, n_a))}), \\qquad
        L_a = \\big[\\, b_a - \\min_{n \\in N(a)} d(a, n) + \\text{margin} \\,\\big]_+

    where ``p_(j)`` is the j-th nearest positive: the local positive bound is the radius
    of the anchor's ``k`` nearest same-class neighbours (``k`` = the downstream K-NN's K),
    and the nearest negative must lie outside it by the margin — exactly what a k-NN vote
    needs. ``"mean"`` averages over the anchors that have a positive and a negative; other
    anchors are skipped (0 in ``"none"``).

    Fully vectorised: one ``[B, R]`` distance matrix, one ``topk`` of distinct keys for the
    k-th positive (the rank of a stable sort: ties in index order), one masked ``min`` (on the
    CPU with numba, one compiled pass over the same keys: the same bits); the
    gradient flows through the two selected distances of each anchor only, identical to the
    per-anchor formulation, by a hand-written backward (``O((B + R)·D)``; first derivatives
    only: ``create_graph=True`` is refused).

    Normalisation: the paper's text is not available offline here; its brief's code is not
    either. We default to ``normalize=True`` (FaceNet's convention for triplet embeddings)
    so that ``margin`` has a fixed scale (``d ∈ [0, 4]``); ``normalize=False`` uses the raw
    embeddings.

    Args:
        k: the K of the downstream K-NN classifier (``>= 1``; capped per anchor by the number
            of positives).
        margin: ``>= 0``, in squared-distance units.
        normalize: L2-normalise the embeddings (and references) first.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (per anchor, or per triplet with
            ``indices=``).
        validate: NaN/inf check and once-per-instance warnings (no positive pair, collapsed
            embeddings), all read in ONE host synchronisation per forward; ``False`` makes
            forward sync-free.

    Attributes (tensors set by forward, no host sync):
        last_active_fraction: active anchors (positive loss) / anchors that count.
        last_counts: per anchor (or triplet) 1 if it counts in the mean, else 0.

    Shape:
        embeddings ``[B, D]``, labels ``[B]``; optional ``ref_embeddings [R, D]`` and
        ``ref_labels [R]`` (a memory bank or another modality; self-pairs are excluded only
        when the references are the batch itself). ``indices=(a, p, n)`` (e.g. from
        :func:`marginkit.mining.local_triplets`) computes the hinge on those triplets only.

    Example:
        >>> import torch
        >>> from marginkit.losses import LocalMarginTripletLoss
        >>> emb = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
        >>> LocalMarginTripletLoss(k=3)(emb, torch.arange(12) % 3).shape
        torch.Size([])
    """

    distance = "squared_l2"
    hyperparameters = (("k", positive_int), *_TripletBase.hyperparameters)
    repr_options = ("normalize", "reduction")

    def __init__(
        self,
        k: int = 5,
        margin: float = 0.2,
        *,
        normalize: bool = True,
        reduction: str = "mean",
        validate: bool = True,
    ) -> None:
        super().__init__()
        self._set(k=k, margin=margin)
        self.normalize = bool(normalize)
        self.reduction = choice(reduction, "reduction", REDUCTIONS)
        self.validate = bool(validate)
        self.last_active_fraction = None
        self.last_counts = None

    def _mined(self, batch: PairBatch, margin: float) -> torch.Tensor:
        out, counted, stats = _LocalMarginTriplets.apply(
            batch.x,
            batch.y,
            batch.labels,
            batch.ref_labels,
            batch.self_ref,
            int(self.k),
            margin,
            self.normalize,
            self.reduction,
            self.validate,
        )
        if self.validate:
            self._report(batch, stats[2:])
        self.last_counts = counted
        self.last_active_fraction = stats[1]
        return out

    def _report(self, batch: PairBatch, stats: torch.Tensor) -> None:
        """:meth:`_TripletBase._matrix_checks` from a few numbers read in its one host sync.

        ``stats``: the number of anchors with a positive over that of the valid ones (> 0 iff
        any), the inputs' largest magnitude (finite iff every entry is; it also decides
        :func:`marginkit.ops.pairs.underflow_flag`), ``max d`` (``d >= 0``, NaN and ``inf``
        propagate: finite iff every distance is; it decides
        :func:`marginkit.ops.pairs.collapsed_flag`) and, without ``normalize``, the collapse
        scale (else 1). The comparisons round their bounds to the dtype, as the tensor ops do.
        """
        n_pos, top, top_d, *rest = stats.tolist()
        scale = rest[0] if rest else 1.0
        any_pos = n_pos > 0
        dtype = batch.x.dtype
        nonfinite, overflow = not math.isfinite(top), not math.isfinite(top_d)
        info = torch.finfo(dtype)
        small = not self.normalize and 0 < top < _rounded(math.sqrt(info.tiny / info.eps), dtype)
        single = batch.self_ref and batch.x.shape[0] * batch.y.shape[0] <= 1
        collapsed = not single and top_d <= _rounded(_rounded(COLLAPSE_TOL**2, dtype) * scale, dtype)
        if small and not nonfinite:
            raise too_small_error(batch.x, batch.y, self.distance)
        report_checks(self, type(self).__name__, nonfinite, not any_pos, collapsed)
        if overflow:
            self._overflow_error(batch, dtype)


class TripletMarginLoss(_TripletBase):
    """Triplet margin loss ``[d(a, p) − d(a, n) + margin]_+`` with in-batch mining.

    Mining (``"mean"`` denominators in brackets; ``average`` switches between counting every
    valid unit and only the active ones, those with a positive hinge):

    - ``"batch_hard"`` (Hermans et al. 2017): per anchor, the farthest positive and the
      nearest negative. Units: anchors with a positive and a negative [default ``"valid"``].
      ``"none"``: one value per anchor.
    - ``"batch_all"``: every valid triplet ``(a, p, n)``. Units: triplets [default
      ``"active"``, i.e. the mean over triplets with a non-zero loss — Hermans' "BA≠0" and
      pytorch-metric-learning's ``TripletMarginLoss`` with its default ``AvgNonZeroReducer``].
      ``"none"``: per anchor, the SUM over its triplets (``last_counts`` holds its number of
      counted triplets, so ``mean == none.sum() / last_counts.sum()``).
    - ``"semi_hard"`` (FaceNet; TF ``triplet_semihard_loss``): per anchor-positive pair, the
      nearest negative farther than the positive, else the farthest negative. Units:
      anchor-positive pairs [default ``"valid"``, as TF]. ``"none"``: per-anchor sums.
    - ``indices=(a, p, n)``: the given (mined) triplets; units: triplets [default ``"valid"``];
      ``"none"``: one value per triplet. ``mining`` is not used then.

    Distances: ``"squared_l2"``, ``"l2"`` (through a safe square root: the gradient is finite,
    0, when two embeddings coincide), ``"cosine"`` (``1 − cos``). With ``normalize=True``
    (default, as pytorch-metric-learning's default distance) the embeddings are L2-normalised
    first.

    Memory: batch-all never stores the ``[B, R, R]`` triplet tensor. A custom autograd
    function walks blocks of anchors (``BLOCK_ELEMENTS`` entries of ``anchors × max positives
    × references``) and keeps, for backward, only the per-pair counts of active triplets; it
    needs the largest number of positives per anchor, read in the forward's single host sync.

    Defaults: ``TripletMarginLoss()`` keeps batch-hard mining (Hermans et al. 2017).
    ``marginkit train`` trains ``--loss triplet`` with ``margin=0.2, mining=batch_all`` and
    ``--loss smooth_triplet`` with ``margin=0.2, mining=batch_all, smooth_loss=True``, for the
    command line's small data sets (``marginkit losses`` lists both sets; why:
    ``docs/defaults.md``).

    Args:
        margin: ``>= 0``.
        mining: ``"batch_hard"`` | ``"batch_all"`` | ``"semi_hard"``.
        distance: ``"squared_l2"`` | ``"l2"`` | ``"cosine"``.
        normalize: L2-normalise embeddings first.
        average: ``None`` (the per-mining default above), ``"valid"`` or ``"active"``.
        smooth_loss: use ``log(1 + e^t)`` instead of ``[t]_+`` on ``t = d(a, p) − d(a, n) +
            margin`` (pytorch-metric-learning's ``smooth_loss``): every valid triplet keeps a
            gradient ``sigmoid(t)``, and every one is "active" (the loss is positive).
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        validate: NaN/inf check and once-per-instance warnings in one host sync per forward.

    Attributes (tensors set by forward, no host sync):
        last_active_fraction: active units / valid units (triplets for batch-all).
        last_counts: per anchor (triplet with ``indices``) the number of units in the mean.

    Example:
        >>> import torch
        >>> from marginkit.losses import TripletMarginLoss
        >>> emb = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
        >>> TripletMarginLoss(mining="batch_all")(emb, torch.arange(12) % 3).shape
        torch.Size([])
    """

    repr_options = ("mining", "distance", "normalize", "average", "smooth_loss", "reduction")

    def __init__(
        self,
        margin: float = 0.2,
        mining: str = "batch_hard",
        distance: str = "squared_l2",
        *,
        normalize: bool = True,
        average: str | None = None,
        smooth_loss: bool = False,
        reduction: str = "mean",
        validate: bool = True,
    ) -> None:
        super().__init__()
        self._set(margin=margin)
        self.smooth_loss = bool(smooth_loss)
        self.mining = choice(mining, "mining", MINING)
        self.distance = choice(distance, "distance", DISTANCES)
        self.normalize = bool(normalize)
        self.average = None if average is None else choice(average, "average", AVERAGES)
        self.reduction = choice(reduction, "reduction", REDUCTIONS)
        self.validate = bool(validate)
        self.last_active_fraction = None
        self.last_counts = None

    def _indices_average(self) -> str:
        return self.average or "valid"

    def _mined(self, batch: PairBatch, margin: float) -> torch.Tensor:
        mining = self.mining
        average = self.average or ("active" if mining == "batch_all" else "valid")
        x, y = self._embed(batch)
        dist = distance_matrix(x, y, self.distance)
        pos, neg = label_masks(batch.labels, batch.ref_labels, batch.self_ref)
        if mining == "batch_hard":
            self._matrix_checks(batch, x, y, dist, pos)
            p_idx, n_idx, valid = _batch_hard_select(dist, pos, neg)
            d_ap = dist.gather(1, p_idx[:, None]).squeeze(1)
            d_an = dist.gather(1, n_idx[:, None]).squeeze(1)
            loss = torch.where(valid, self._hinge(d_ap - d_an + margin), 0.0)
            active = valid & (loss.detach() > 0)
            counts = active if average == "active" else valid
            return self._finish(loss, counts.to(loss.dtype), active, valid)
        if mining == "semi_hard":
            self._matrix_checks(batch, x, y, dist, pos)
            n_idx, valid = _semi_hard_select(dist, pos, neg)
            loss = torch.where(valid, self._hinge(dist - dist.gather(1, n_idx) + margin), 0.0)
            active = valid & (loss.detach() > 0)
            counts = (active if average == "active" else valid).sum(1)
            return self._finish(loss.sum(1), counts.to(loss.dtype), active, valid)
        # batch_all
        npos = pos.sum(1)
        (max_pos,) = self._matrix_checks(batch, x, y, dist, pos, npos.max())
        nneg = neg.sum(1)
        n_valid = npos * nneg
        if max_pos == 0:
            sums = dist.sum(1) * 0.0
            active = torch.zeros_like(npos)
        else:
            # columns holding every positive of each row (any order; padding where pos is False)
            pos_idx = torch.topk(pos.to(dist.dtype), max_pos, dim=1).indices
            pos_valid = pos.gather(1, pos_idx)
            block = max(1, BLOCK_ELEMENTS // (max_pos * dist.shape[1]))
            sums, active = _BatchAllTriplets.apply(
                dist, pos_idx, pos_valid, neg, margin, block, self.smooth_loss
            )
        counts = active if average == "active" else n_valid
        return self._finish(sums, counts.to(sums.dtype), active, n_valid)
