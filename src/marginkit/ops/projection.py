"""Margin-Enforcing Projection (MEP) and the margin diagnostic.

Source: Su Jianlin, "Margin-Enforcing Projection" (blog post, 2026-06-19); the derivation
and the O(n log n) algorithm used here are written up in ``docs/mep.md`` and SPEC §1.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from marginkit._validation import choice, compute_dtype, float_tensor, label_tensor

__all__ = ["margin_gap", "mep"]

NORMS = ("l1", "l2")


# --------------------------------------------------------------------------- validation
def _positive_mask(
    positives: Any, scores: torch.Tensor, name: str = "positives"
) -> tuple[torch.Tensor, bool]:
    """Return ``(mask, one_per_row)``: a bool mask shaped like ``scores``.

    ``positives`` is either a bool mask of ``scores.shape`` or integer class ids of
    ``scores.shape[:-1]`` (one positive per row; ``one_per_row`` is then ``True``).
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
        return positives.to(scores.device), False
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
    label_tensor(positives, name, shape=scores.shape[:-1], num_classes=n)
    labels = positives.to(device=scores.device, dtype=torch.long)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, labels.unsqueeze(-1), True)
    return mask, True


def _margin_tensor(margin: Any, batch_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Any:
    """Check ``margin`` (float > 0, or a tensor > 0 broadcastable to ``batch_shape``).

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
        if value.numel() and not bool((torch.isfinite(value) & (value > 0)).all()):
            raise ValueError(f"margin must be finite and > 0 (in {dtype}) in every entry")
        return value.expand(batch_shape).unsqueeze(-1)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"margin must be a real number or a tensor, got {type(margin).__name__}")
    value = float(margin)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"margin must be a finite number > 0, got {value}")
    cast = float(torch.tensor(value, dtype=dtype))
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
    inf = torch.tensor(math.inf, dtype=x.dtype, device=x.device)
    lo_pos = torch.where(mask, x, inf).amin(-1)
    hi_neg = torch.where(mask, -inf, x).amax(-1)
    return (lo_pos - hi_neg).to(scores.dtype)


def mep(
    scores: torch.Tensor, positives: torch.Tensor, margin: float | torch.Tensor, norm: str = "l2"
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
    needed (``u_{(n-1)}`` is a top-2). Works in float32 or float64 (float64 input) and
    returns the input dtype. Differentiable: the map is piecewise linear and autograd gives
    its Jacobian on the current piece (active entries share the mean of their gradients).

    Args:
        scores: floating tensor ``[..., n]`` (finite; float16/bfloat16/float32/float64).
        positives: bool mask ``[..., n]`` (any number of positives per row, different per
            row) or integer class ids ``[...]`` (one positive per row).
        margin: float ``> 0`` or a tensor ``> 0`` broadcastable to ``scores.shape[:-1]``.
        norm: ``"l2"`` (Euclidean projection, unique) or ``"l1"``.

    Returns:
        The projected scores, same shape and dtype as ``scores``.

    Example:
        >>> import torch
        >>> from marginkit.ops import mep
        >>> mep(torch.tensor([[2.0, 1.5, 0.0]]), torch.tensor([0]), margin=1.0)
        tensor([[2.2500, 1.2500, 0.0000]])

    Reference: Su Jianlin, "Margin-Enforcing Projection", 2026 (blog post).
    """
    return project(scores, positives, margin, norm)


def project(
    scores: torch.Tensor,
    positives: torch.Tensor,
    margin: float | torch.Tensor,
    norm: str = "l2",
    *,
    positives_name: str = "positives",
) -> torch.Tensor:
    """:func:`mep` with the name used for ``positives`` in error messages (``MEPLoss``: ``target``)."""
    float_tensor(scores, "scores")
    choice(norm, "norm", NORMS)
    mask, one_per_row = _positive_mask(positives, scores, positives_name)
    wd = compute_dtype(scores.dtype)
    m = _margin_tensor(margin, scores.shape[:-1], wd, scores.device)
    x = scores.to(wd)
    n = x.shape[-1]

    # Breakpoints: x_i for positives, x_j + m for negatives.
    b = torch.where(mask, x, x + m)
    inf = torch.tensor(math.inf, dtype=wd, device=x.device)
    lo_pos = torch.where(mask, x, inf).amin(-1, keepdim=True).detach()
    hi_neg = torch.where(mask, -inf, b).amax(-1, keepdim=True).detach()
    # Feasible (incl. no positive: lo=+inf, or no negative: hi=-inf) rows are returned as is.
    feasible = hi_neg <= lo_pos

    if norm == "l2":
        # Centre each infeasible row on its bracket [min x_P, max b_N] for float accuracy.
        centre = torch.where(feasible, 0.0, 0.5 * (lo_pos + hi_neg))
        level = centre + _l2_level(b - centre, mask, n - mask.sum(-1, keepdim=True))
    else:
        if one_per_row and n >= 2:
            # |N| = n - 1 in every row: u_(n-1) is the second largest breakpoint, no sort.
            level = torch.topk(b, 2, dim=-1).values[..., 1:]
        else:
            n_neg = n - mask.sum(-1, keepdim=True)
            u = torch.sort(b, dim=-1).values
            level = u.gather(-1, (n_neg - 1).clamp_(0, n - 1))
    top_neg = _below_margin(level, m)
    z = torch.where(mask, torch.where(x < level, level, x), torch.where(x > top_neg, top_neg, x))
    out = z.to(scores.dtype)
    return torch.where(feasible, scores, out)


def _l2_level(b: torch.Tensor, mask: torch.Tensor, n_neg: torch.Tensor) -> torch.Tensor:
    r"""Root ``ℓ`` of ``Σ_P (ℓ − u)_+ − Σ_N (u − ℓ)_+`` for breakpoints ``b`` (``[..., n]`` → ``[..., 1]``).

    After sorting ``u`` ascending with signs ``s_k = +1`` (positive) / ``−1`` (negative), and
    prefix sums ``C_k = Σ_{j≤k} s_j``, ``S_k = Σ_{j≤k} s_j u_j``, ``T = Σ_N u``, the
    derivative at breakpoint ``k`` is ``h_k = (C_k + |N|) u_k − (S_k + T)`` (positives at or
    below ``u_k`` pull up, negatives above push down). ``h`` is non-decreasing; with ``K`` the
    number of ``h_k < 0`` the root lies in ``[u_{K-1}, u_K]`` where ``h`` is linear, so
    ``ℓ = (S_{K−1} + T) / (C_{K−1} + |N|)`` — the mean of the active breakpoints (positives
    at or below, negatives above), i.e. linear interpolation inside the bracket.

    Only called meaningfully on infeasible rows, where the denominator is ``≥ 1``; other
    rows get a finite value that the caller discards.
    """
    u, order = torch.sort(b, dim=-1)
    pos = mask.gather(-1, order)
    sign = torch.where(pos, 1.0, -1.0).to(u.dtype)
    cnt = sign.cumsum(-1) + n_neg.to(u.dtype)  # (#P ≤ k) + (#N > k)
    s = torch.where(pos, u, -u)
    tot_neg = (u.sum(-1, keepdim=True) - s.sum(-1, keepdim=True)) * 0.5  # Σ_N u
    acc = s.cumsum(-1) + tot_neg  # Σ_{P ≤ k} u + Σ_{N > k} u
    h = cnt * u - acc
    k = ((h < 0).sum(-1, keepdim=True) - 1).clamp_(min=0)
    return acc.gather(-1, k) / cnt.gather(-1, k).clamp(min=1.0)


def _below_margin(level: torch.Tensor, m: Any) -> torch.Tensor:
    """``t = level − m`` rounded down if needed so that ``t + m <= level`` holds in floating point.

    This makes every projected row keep the margin exactly in the working precision (the
    feasibility test of :func:`mep`), hence ``mep`` is exactly idempotent. The correction
    (one ulp at most) carries no gradient.
    """
    t = level - m
    with torch.no_grad():
        td = t.detach()
        down = torch.where(td + m > level, torch.nextafter(td, torch.full_like(td, -math.inf)), td)
        step = down - td
    return t + step
