"""Margin-Enforcing Projection (MEP) and the margin diagnostic.

Source: Su Jianlin, "Margin-Enforcing Projection" (blog post, 2026-06-19); the derivation
and the O(n log n) algorithm used here are written up in ``docs/mep.md`` and SPEC §1.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from marginkit._validation import choice, compute_dtype, float_tensor, label_tensor, real
from marginkit.ops.selection import fast_path, sort_values, sort_with_flags, stable_sort

__all__ = ["margin_gap", "mep"]

NORMS = ("l1", "l2")


# --------------------------------------------------------------------------- validation
def _positive_mask(
    positives: Any, scores: torch.Tensor, name: str = "positives", validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(mask, labels)``: a bool mask shaped like ``scores``, and ``[..., 1]`` labels or ``None``.

    ``positives`` is either a bool mask of ``scores.shape`` or integer class ids of
    ``scores.shape[:-1]`` (one positive per row; ``labels`` is then not ``None``).
    ``validate=False`` skips the label range check (a host read).
    """
    if not isinstance(positives, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor: a bool mask shaped like scores or integer labels "
            f"of shape scores.shape[:-1], got {type(positives).__name__}"
        )
    n = scores.shape[-1]
    if positives.dtype == torch.bool:
        if positives.shape != scores.shape:
            raise ValueError(
                f"{name} (bool mask) must have the shape of scores {tuple(scores.shape)}, "
                f"got {tuple(positives.shape)}"
            )
        return positives.to(scores.device), None
    if torch.is_floating_point(positives) or torch.is_complex(positives):
        raise TypeError(
            f"{name} must be a bool mask (dtype torch.bool) shaped like scores or integer labels "
            f"of shape scores.shape[:-1], got dtype {positives.dtype}"
        )
    if positives.shape == scores.shape:
        raise TypeError(
            f"{name} has the shape of scores {tuple(scores.shape)} but dtype {positives.dtype}: "
            "a mask must have dtype torch.bool (integer labels have shape scores.shape[:-1])"
        )
    label_tensor(positives, name, shape=scores.shape[:-1], num_classes=n if validate else None)
    labels = positives.to(device=scores.device, dtype=torch.long).unsqueeze(-1)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, labels, True)
    return mask, labels


def _margin_tensor(
    margin: Any, batch_shape: torch.Size, dtype: torch.dtype, device: torch.device, validate: bool = True
) -> Any:
    """Check ``margin`` (float > 0, or a tensor > 0 broadcastable to ``batch_shape``).

    ``validate=False`` skips the value check of a margin tensor (a host read).

    Returns a Python float, or a tensor of shape ``batch_shape + (1,)`` in ``dtype``.
    """
    if isinstance(margin, torch.Tensor):
        if margin.dtype == torch.bool or torch.is_complex(margin):
            raise TypeError(f"margin must be a real number or a real tensor, got dtype {margin.dtype}")
        try:
            shape = torch.broadcast_shapes(margin.shape, batch_shape)
        except RuntimeError:
            shape = None
        if shape != batch_shape:
            raise ValueError(
                f"margin tensor must be broadcastable to scores.shape[:-1] = {tuple(batch_shape)}, "
                f"got shape {tuple(margin.shape)}"
            )
        value = margin.to(device=device, dtype=dtype)
        if validate and value.numel() and not bool((torch.isfinite(value) & (value > 0)).all()):
            raise ValueError(f"margin must be finite and > 0 (in {dtype}) in every entry")
        return value.expand(batch_shape).unsqueeze(-1)
    value = real(margin, "margin", low=0, open_low=True)
    cast = float(np.float64(value) if dtype == torch.float64 else np.float32(value))  # no tensor: no read
    if not math.isfinite(cast) or cast <= 0:
        raise ValueError(f"margin {value} is not a finite number > 0 in {dtype}")
    return value


# --------------------------------------------------------------------------- the ops
def margin_gap(scores: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    r"""Per-row margin: smallest positive score minus largest negative score.

    .. math::
        \operatorname{gap}(x) = \min_{i \in P} x_i - \max_{j \in N} x_j ,

    with ``N`` the complement of ``P``. A row keeps margin ``m`` when ``gap >= m``. A row
    without a positive or without a negative has no constraint to violate: its gap is
    ``+inf`` ("vacuously satisfied"), which is also what the empty min / max give.

    Args:
        scores: floating tensor ``[..., n]``, finite.
        positives: bool mask ``[..., n]`` (any number of positives per row) or integer class
            ids ``[...]`` (one positive per row).

    Returns:
        Tensor ``[...]`` (``scores.shape[:-1]``) in the dtype of ``scores`` (computed in
        float32 or better); differentiable (the gradient reaches the arg-min positive and the
        arg-max negative).

    Example:
        >>> import torch
        >>> from marginkit.ops import margin_gap
        >>> margin_gap(torch.tensor([[3.0, 1.0, 0.5]]), torch.tensor([0]))
        tensor([2.])
    """
    float_tensor(scores, "scores")
    mask, _ = _positive_mask(positives, scores)
    x = scores.to(compute_dtype(scores.dtype))
    lo_pos = torch.where(mask, x, math.inf).amin(-1)
    hi_neg = torch.where(mask, -math.inf, x).amax(-1)
    return (lo_pos - hi_neg).to(scores.dtype)


def mep(
    scores: torch.Tensor,
    positives: torch.Tensor,
    margin: float | torch.Tensor,
    norm: str = "l2",
    *,
    validate: bool = True,
) -> torch.Tensor:
    r"""Margin-Enforcing Projection: nearest scores keeping every positive ``margin`` above every negative.

    For each row ``x`` (last dimension) with positive set ``P`` and negatives ``N``:

    .. math::
        \mathrm{MEP}_d(x) = \arg\min_z\, d(z, x)
        \quad \text{s.t.}\quad \min_{i\in P} z_i - \max_{j \in N} z_j \ge m,
        \qquad d \in \{\ell_1, \ell_2\}.

    The optimum has the form :math:`z_P = \max(x_P, \ell)`, :math:`z_N = \min(x_N, \ell - m)`
    for a level :math:`\ell`; with the breakpoints :math:`u = \{x_i\}_{i\in P} \cup
    \{x_j + m\}_{j \in N}`:

    * ``"l2"``: :math:`\ell` is the root of the increasing piecewise-linear
      :math:`\tfrac12 f'(\ell) = \sum_P (\ell - x_i)_+ - \sum_N (x_j + m - \ell)_+`, found
      exactly after one sort of ``u`` with prefix sums (no iteration, no tolerance):
      :math:`\ell` is the mean of the active breakpoints of the bracketing interval.
    * ``"l1"``: any :math:`\ell \in [u_{(|N|)}, u_{(|N|+1)}]` is optimal; we return
      :math:`\ell = u_{(|N|)}` (the source's choice). The L1 minimiser is not unique.

    Rows that already keep the margin (:math:`x_j + m \le x_i` for every pair, evaluated in
    the working precision) and rows with no positive or no negative are returned
    bit-identical. In float32/float64 the output keeps the margin exactly in that sense
    (so ``mep`` is exactly idempotent); half-precision outputs are rounded once at the end.

    Cost: one sort per row (``O(n log n)``) plus ``O(n)`` prefix sums, batched over all
    leading dimensions without Python loops. For integer labels with ``"l1"`` no sort is
    needed (``u_{(n-1)}`` is a top-2); the mask ``"l1"`` level is an order statistic (values
    only). The sort is stable (ties in index order), through :mod:`marginkit.ops.selection`
    (numpy's sort on the CPU when no gradient is needed; ``torch.sort`` elsewhere). Works in
    float32 or float64 (float64 input) and returns the input dtype. Differentiable: the map is
    piecewise linear and autograd gives its Jacobian on the current piece (active entries share
    the mean of their gradients).

    Args:
        scores: floating tensor ``[..., n]`` (finite; float16/bfloat16/float32/float64).
        positives: bool mask ``[..., n]`` (any number of positives per row, different per
            row) or integer class ids ``[...]`` (one positive per row).
        margin: float ``> 0`` or a tensor ``> 0`` broadcastable to ``scores.shape[:-1]``.
        norm: ``"l2"`` (Euclidean projection, unique) or ``"l1"``.
        validate: check the values (finite scores, labels in range, margin tensor > 0), which
            reads them back to the host; ``False`` skips those reads (types and shapes are
            still checked).

    Returns:
        The projected scores, same shape and dtype as ``scores``.

    Example:
        >>> import torch
        >>> from marginkit.ops import mep
        >>> mep(torch.tensor([[2.0, 1.5, 0.0]]), torch.tensor([0]), margin=1.0)
        tensor([[2.2500, 1.2500, 0.0000]])

    Reference: Su Jianlin, "Margin-Enforcing Projection", 2026 (blog post).
    """
    return project(scores, positives, margin, norm, validate=validate)


def project(
    scores: torch.Tensor,
    positives: torch.Tensor,
    margin: float | torch.Tensor,
    norm: str = "l2",
    *,
    positives_name: str = "positives",
    validate: bool = True,
) -> torch.Tensor:
    """:func:`mep` with the name used for ``positives`` in error messages (``MEPLoss``: ``target``).

    ``validate=False`` skips the checks that read values (finite scores, label range, margin
    tensor > 0): no host read, for callers that validate elsewhere or defer it.
    """
    float_tensor(scores, "scores", check_values=validate)
    choice(norm, "norm", NORMS)
    mask, labels = _positive_mask(positives, scores, positives_name, validate)
    wd = compute_dtype(scores.dtype)
    m = _margin_tensor(margin, scores.shape[:-1], wd, scores.device, validate)
    x = scores.to(wd)
    n = x.shape[-1]
    if n == 1:  # one class: no row has both a positive and a negative
        return scores.clone()
    grad = torch.is_grad_enabled() and (x.requires_grad or (isinstance(m, torch.Tensor) and m.requires_grad))

    # Breakpoints: x_i for positives, x_j + m for negatives.
    if labels is None:
        negatives = ~mask
        b = torch.where(mask, x, x + m)
        n_neg = negatives.sum(-1, keepdim=True)
    else:
        x_pos = x.gather(-1, labels)
        b = (x + m).scatter_(-1, labels, x_pos)
        n_neg = torch.full_like(labels, n - 1)

    # level ℓ (= min z_P), plus min_P x and max_N b when they come for free. With one positive
    # per row, "max_N b <= x_pos" is the same test as "max b <= x_pos" (b_pos = x_pos itself).
    lo_pos = hi_neg = None
    if norm == "l2":
        level, b_max, extremes = _l2_level(b, mask, n_neg, labels, grad)
        if labels is not None:
            lo_pos, hi_neg = x_pos, b_max
        elif extremes is not None:
            lo_pos, hi_neg = extremes
    elif labels is not None:
        # |N| = n - 1 in every row: u_(n-1) is the second largest breakpoint, no sort needed.
        top2 = torch.topk(b, 2, dim=-1).values
        level = top2[..., 1:]
        lo_pos, hi_neg = x_pos, top2[..., :1]
    else:
        index = (n_neg - 1).clamp_(0, n - 1)
        if grad:  # values through a gather of the sorted order, as torch.sort's backward
            level = b.gather(-1, stable_sort(b.detach())[1].gather(-1, index))
        else:  # values only: the u_(|N|) of the stable order (numpy's sort on the CPU)
            level = sort_values(b).gather(-1, index)
    if lo_pos is None:
        lo_pos = x.masked_fill(negatives, math.inf).amin(-1, keepdim=True)
        hi_neg = b.masked_fill(mask, -math.inf).amax(-1, keepdim=True)
    # Feasible rows (incl. no positive: lo = +inf, or no negative: hi = -inf) keep their scores:
    # clamping at ±inf gives z = x exactly, with the identity as Jacobian.
    feasible = hi_neg <= lo_pos
    if grad:
        feasible = feasible.detach()
    top_neg = _below_margin(level, m, grad).masked_fill(feasible, math.inf)
    level = level.masked_fill(feasible, -math.inf)
    if labels is None:
        z = torch.where(mask, torch.clamp(x, min=level), torch.clamp(x, max=top_neg))
    else:
        z = torch.minimum(x, top_neg).scatter(-1, labels, torch.maximum(x_pos, level))
    return z.to(scores.dtype)


def _l2_level(
    b: torch.Tensor, mask: torch.Tensor, n_neg: torch.Tensor, labels: torch.Tensor | None, grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    r"""Root ``ℓ`` of ``h(ℓ) = Σ_P (ℓ − u_i)_+ − Σ_N (u_j − ℓ)_+`` per row (``[..., n]`` → ``[..., 1]``).

    ``b`` holds the breakpoints (``x_i`` on ``mask``, ``x_j + m`` elsewhere). After one sort,
    ``u`` ascending with signs ``s_k = +1`` (positive) / ``−1`` (negative), the prefix sums

        cnt_k = Σ_{j≤k} s_j + |N| = #{P at or below k} + #{N above k},
        acc_k = Σ_{j≤k} s_j u_j + Σ_N u = Σ_{P at or below k} u + Σ_{N above k} u,

    give ``h(u_k) = cnt_k u_k − acc_k`` at every breakpoint. ``h`` is non-decreasing, so with
    ``K = #{k : h(u_k) < 0}`` the root lies in ``[u_{K−1}, u_K]``, where ``h`` is linear
    with the active set of index ``K − 1``; hence ``ℓ = acc_{K−1} / cnt_{K−1}`` (the mean of
    the active breakpoints — linear interpolation inside the bracket, exact, no iteration).

    The sort is stable (ties in index order, :func:`marginkit.ops.selection.stable_sort`: numpy
    on the CPU), so the order of the prefix sums — hence every rounding — is defined.

    Accuracy: values are centred on the row's L1 level ``u_(|N|)`` (inside the bracket of an
    infeasible row) and ``acc`` is accumulated in float64, so the prefix sums do not lose
    digits to far-away negatives cancelling against ``Σ_N u``; counts are exact integers.
    Infeasible rows have ``cnt_{K−1} ≥ 1``; other rows get a finite value that the caller
    discards. Also returns the largest breakpoint ``max b`` (the last sorted entry), and, on the
    numpy path with a mask, ``(min_P b, max_N b)`` read off the sorted rows (else ``None``).
    """
    n = b.shape[-1]
    if not grad and fast_path(b):
        return _l2_level_numpy(b, mask, n_neg, labels)
    if grad:  # the values through a gather, so that autograd sees them (as torch.sort's backward)
        order = stable_sort(b.detach())[1]
        u = b.gather(-1, order)
    else:
        u, order = stable_sort(b)
    pos = mask.gather(-1, order) if labels is None else order == labels
    centre = u.gather(-1, (n_neg - 1).clamp_(0, n - 1))
    if grad:
        centre = centre.detach()
    uc = u - centre
    sign = torch.where(pos, 1.0, -1.0).to(torch.float32 if n < 2**24 else torch.float64)
    cum = torch.cumsum(uc * sign, -1, dtype=torch.float64)  # Σ_{j≤k} s_j u_j
    # −Σ_N u (the negated total spares negating cum: fl(a − b) = −fl(b − a))
    neg_tot = 0.5 * (cum[..., -1:] - uc.sum(-1, keepdim=True, dtype=torch.float64))
    cnt = sign.cumsum(-1).add_(n_neg)
    with torch.no_grad():  # h(u_k) < Σ_N u  <=>  cum_k − cnt_k u_k > −Σ_N u (the product is exact)
        k = (torch.addcmul(cum, cnt, uc, value=-1) > neg_tot).sum(-1, keepdim=True).sub_(1).clamp_(min=0)
    level = (centre + (cum.gather(-1, k) - neg_tot) / cnt.gather(-1, k).clamp(min=1.0)).to(b.dtype)
    top = u[..., -1:]
    return level, top.detach() if grad else top, None


def _l2_level_numpy(
    b: torch.Tensor, mask: torch.Tensor, n_neg: torch.Tensor, labels: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`_l2_level` on the CPU without a gradient, in numpy, with the same roundings.

    Every step is the same IEEE operation on the same operands in the same order (float32
    ``uc``, sequential float64 prefix sums, exact integer counts, one float64 product and one
    rounded difference per breakpoint, the level rounded once from float64); the one reduction
    whose order is torch's own (``Σ uc``) is torch's. With one positive per row, the stable
    order needs no permutation: the values are sorted alone and the positive's place is counted
    (entries below it, plus entries equal to it at a smaller index). Returns ``(level, max b,
    None)`` with labels, ``(level, None, (min_P b, max_N b))`` with a mask (from the sorted rows).
    """
    shape = b.shape
    n = shape[-1]
    bn = b.detach().contiguous().numpy().reshape(-1, n)
    nn = n_neg.numpy().reshape(-1, 1)
    if labels is None and b.dtype == torch.float32:
        u, pos = sort_with_flags(b, mask)
    elif labels is None:
        u, order = (t.numpy().reshape(-1, n) for t in stable_sort(b))
        pos = np.take_along_axis(mask.numpy().reshape(-1, n), order, -1)
    else:
        u = sort_values(b).numpy().reshape(-1, n)
        lab = labels.numpy().reshape(-1, 1)
        xp = np.take_along_axis(bn, lab, -1)
        place = (bn < xp).sum(-1, keepdims=True)
        equal = bn == xp
        tied = np.flatnonzero(equal.sum(-1) > 1)  # rows where another entry equals the positive
        if tied.size:  # ... and precedes it when its index is smaller
            place[tied] += (equal[tied] & (np.arange(n) < lab[tied])).sum(-1, keepdims=True)
        pos = None
    centre = np.take_along_axis(u, np.clip(nn - 1, 0, n - 1), -1)
    uc = u - centre
    if pos is None:  # one positive per row, at `place`
        rows = np.arange(u.shape[0])[:, None]
        signed = np.negative(uc)
        signed[rows, place] = uc[rows, place]
        signed = torch.from_numpy(signed)
    else:
        signed = torch.from_numpy(np.where(pos, uc, -uc))
    cum = torch.cumsum(signed, -1, dtype=torch.float64).numpy()  # torch's is the faster scan
    total = torch.from_numpy(uc).reshape(shape).sum(-1, keepdim=True, dtype=torch.float64).numpy()
    neg_tot = 0.5 * (cum[:, -1:] - total.reshape(-1, 1))
    if labels is None:
        cnt = np.cumsum(pos, -1, dtype=np.int32)  # Σ_{j≤k} s_j = 2 #P − (k + 1)
        cnt *= 2
    else:
        cnt = 2 * (np.arange(n, dtype=np.int32) >= place).astype(np.int32)
    cnt -= np.arange(1, n + 1, dtype=np.int32)
    cnt += nn.astype(np.int32)
    h = np.multiply(cnt, uc, dtype=np.float64)  # exact: a count times a float32
    np.subtract(cum, h, out=h)
    k = np.maximum((h > neg_tot).sum(-1, keepdims=True) - 1, 0)
    level = centre + (np.take_along_axis(cum, k, -1) - neg_tot) / np.maximum(
        np.take_along_axis(cnt, k, -1), 1
    )
    level = torch.from_numpy(level.astype(bn.dtype)).reshape(*shape[:-1], 1)
    if labels is not None:
        return level, torch.from_numpy(u[:, -1:].copy()).reshape(*shape[:-1], 1), None
    # min_P b and max_N b from the sorted rows: the first positive, the last negative (±inf if none)
    rows = np.arange(u.shape[0])
    first_pos, last_neg = pos.argmax(-1), n - 1 - (~pos)[:, ::-1].argmax(-1)
    inf = bn.dtype.type(np.inf)
    lo_pos = np.where(pos[rows, first_pos], u[rows, first_pos], inf)
    hi_neg = np.where(pos[rows, last_neg], -inf, u[rows, last_neg])
    extremes = (torch.from_numpy(v).reshape(*shape[:-1], 1) for v in (lo_pos, hi_neg))
    return level, None, tuple(extremes)


def _below_margin(level: torch.Tensor, m: Any, grad: bool = True) -> torch.Tensor:
    """``t = level − m`` rounded down if needed so that ``t + m <= level`` holds in floating point.

    This makes every projected row keep the margin exactly in the working precision (the
    feasibility test of :func:`mep`), hence ``mep`` is exactly idempotent. The correction
    (one ulp at most) carries no gradient.
    """
    t = level - m
    if not grad:
        return torch.where(t + m > level, torch.nextafter(t, t.new_full((), -math.inf)), t)
    with torch.no_grad():
        td = t.detach()
        down = torch.where(td + m > level, torch.nextafter(td, torch.full_like(td, -math.inf)), td)
        step = down - td
    return t + step
