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
from marginkit.ops._compiled import CompiledKernel
from marginkit.ops.selection import fast_path, sort_values, sort_with_flags, stable_sort, values_at_ranks

__all__ = ["margin_gap", "mep"]

NORMS = ("l1", "l2")

#: MEP of float32 CPU rows (L2; L1 with a mask) runs the compiled kernel (:mod:`marginkit.ops._mep_kernel`)
#: when numba is installed; tests switch it off to run the numpy path.
COMPILED = True
KERNEL = CompiledKernel("_mep_kernel", "MEP's compiled kernel")


# --------------------------------------------------------------------------- validation
def _positive_mask(
    positives: Any,
    scores: torch.Tensor,
    name: str = "positives",
    validate: bool = True,
    need_mask: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return ``(mask, labels)``: a bool mask shaped like ``scores``, and ``[..., 1]`` labels or ``None``.

    ``positives`` is either a bool mask of ``scores.shape`` or integer class ids of
    ``scores.shape[:-1]`` (one positive per row; ``labels`` is then not ``None``, and the mask is
    built only with ``need_mask``, else ``None``). ``validate=False`` skips the label range check
    (a host read).
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
    if not need_mask:
        return None, labels
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
    (numpy's sort on the CPU when no gradient is needed; ``torch.sort`` elsewhere). With numba
    installed (``pip install marginkit[fast]``), float32 CPU rows without a gradient take a
    compiled kernel (:mod:`marginkit.ops._mep_kernel`): ``"l2"`` without a sort where the row's
    float64 sums are exact in any order, the mask ``"l1"`` level picked from a values-only sort;
    the same bits, other rows as above. Works in
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

    The device-agnostic path (any device, or a gradient needed) is a fixed sequence of batched
    torch ops; a float32/float64 CPU call without gradient (:func:`marginkit.ops.selection.fast_path`)
    runs the same IEEE operations on the same operands in numpy (:func:`_project_numpy`), so both
    give the same bits.
    """
    float_tensor(scores, "scores", check_values=validate)
    choice(norm, "norm", NORMS)
    mask, labels = _positive_mask(positives, scores, positives_name, validate, need_mask=False)
    wd = compute_dtype(scores.dtype)
    m = _margin_tensor(margin, scores.shape[:-1], wd, scores.device, validate)
    x = scores.to(wd)
    n = x.shape[-1]
    if n == 1:  # one class: no row has both a positive and a negative
        return scores.clone()
    grad = torch.is_grad_enabled() and (x.requires_grad or (isinstance(m, torch.Tensor) and m.requires_grad))
    if not grad and fast_path(x):
        # (non-finite scores under validate=False: NaN and inf propagate silently, as in torch)
        with np.errstate(all="ignore"):
            return _project_cpu(x, mask, labels, m, norm).to(scores.dtype)

    # Breakpoints u: x_i for positives, x_j + m for negatives.
    xm = x + m
    if labels is None:
        b = torch.where(mask, x, xm)
        x_pos = None
    else:  # (L2: the negatives' breakpoints alone, the positive's place -inf)
        x_pos = x.gather(-1, labels)
        b = xm.scatter(-1, labels, -math.inf if norm == "l2" else x_pos)
    if norm == "l2":
        level, top = _l2_level(b, mask, grad) if labels is None else _l2_level_labels(b, x_pos, grad)
        t = (level - m).to(wd)  # the negatives' value ℓ − m, rounded once from float64
    else:
        level, top = _l1_level(b, mask, labels, grad)
        t = level - m
    # ℓ = fl(t + m): then fl(t + m) <= ℓ holds exactly, so every projected row keeps the margin in
    # the working precision (x_j + m <= x_i for every pair) and mep is exactly idempotent.
    level = t + m
    if labels is None:
        # The level is clamped into [min_P u, max_N u] (the order of the bounds matters: a feasible
        # row, max_N u <= min_P u, gets ℓ = max_N u, which keeps every entry); an infeasible row's
        # root lies inside already. fmax / fmin: a NaN level of a feasible row gives way.
        hi = b.masked_fill(mask, -math.inf).amax(-1, keepdim=True)
        lo = torch.where(mask, b, hi).amin(-1, keepdim=True)
        level = torch.fmin(torch.fmax(level, lo), hi)
        # a positive below ℓ moves up to ℓ; a negative whose breakpoint lies above ℓ moves down to t
        # (where, not clamp / maximum: those return either zero on a tie of -0.0 and +0.0)
        z = torch.where(mask, torch.where(x < level, level, x), torch.where(b <= level, x, t))
    else:
        # top: max u (L1), max_N u (L2); a feasible row (max_N u <= x_pos) keeps every entry either way
        level = torch.fmin(torch.fmax(level, x_pos), top)
        z = torch.where(xm <= level, x, t).scatter(-1, labels, torch.where(x_pos < level, level, x_pos))
    return z.to(scores.dtype)


def _l2_level(b: torch.Tensor, mask: torch.Tensor, grad: bool) -> tuple[torch.Tensor, None]:
    r"""Root ``ℓ`` of ``h(ℓ) = Σ_P (ℓ − u_i)_+ − Σ_N (u_j − ℓ)_+`` per row (``[..., 1]``, float64).

    Positives given by a mask (one per row: :func:`_l2_level_labels`).

    ``b`` holds the breakpoints (``x_i`` on the positives, ``x_j + m`` elsewhere). After one stable
    sort, ``u`` ascending with signs ``s_k = +1`` (positive) / ``−1`` (negative):

        A_k = Σ_{j≤k} s_j u_j + Σ_N u  = Σ_{P at or below k} u + Σ_{N above k} u,
        C_k = 2 #{P at or below k} + (n − 1 − k) − |P| = #{P at or below k} + #{N above k},

    so ``h(u_k) = C_k u_k − A_k`` and, on the piece right of ``u_k``, the root of the linear ``h``
    is ``M_k = A_k / C_k`` (the mean of the active breakpoints). ``h`` is non-decreasing, so
    ``h(u_k) < 0`` ⟺ ``u_k < M_k`` holds for the breakpoints left of the root:
    ``ℓ = M_idx`` with ``idx = #{k ≥ 1 : u_k < M_k}`` (linear interpolation inside the bracketing
    interval, exact, no iteration; ``k = 0`` is left of the root in every infeasible row).

    Prefix sums and ``Σ_N u`` are accumulated in float64 (``Σ_N u`` by ``torch.sum``, in index
    order), counts are exact integers, ``M_k`` is one float64 division. Rows that keep the margin
    get some finite or infinite value that :func:`project` clamps away.
    """
    n = b.shape[-1]
    if grad:  # the values through a gather, so that autograd sees them (as torch.sort's backward)
        order = torch.sort(b.detach(), dim=-1, stable=True).indices
        u = b.gather(-1, order)
    else:
        u, order = torch.sort(b, dim=-1, stable=True)
    pos = mask.gather(-1, order)
    s = torch.where(pos, u, -u)
    a = torch.cumsum(s, -1, dtype=torch.float64) + b.masked_fill(mask, 0.0).sum(
        -1, keepdim=True, dtype=torch.float64
    )
    cp = torch.cumsum(pos, -1)
    c = torch.add(torch.arange(n - 1, -1, -1, device=b.device) - cp[..., -1:], cp, alpha=2)
    if grad:
        with torch.no_grad():
            idx = (u < a / c)[..., 1:].sum(-1, keepdim=True)
        # no 0/0 on the backward of unused entries: divide the gathered pair only
        return a.gather(-1, idx) / c.gather(-1, idx).clamp(min=1), None
    means = a / c
    idx = (u < means)[..., 1:].sum(-1, keepdim=True)
    return means.gather(-1, idx), None


def _l2_level_labels(b: torch.Tensor, x_pos: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The L2 level with one positive per row: ``(ℓ, max_N u)`` (``[..., 1]``; ℓ in float64).

    ``b`` holds the negatives' breakpoints ``x_j + m`` and ``-inf`` at the positive. With ``v``
    their stable descending sort and :math:`S_k = \sum_{j \le k} v_j` (float64), the root of
    :math:`h(\ell) = (\ell - x_p)_+ - \sum_N (v_j - \ell)_+` for ``K`` active negatives is the
    mean :math:`\ell_{K-1} = (x_p + S_{K-1}) / (K + 1)`, and ``v_k > ℓ_k`` holds exactly for the
    active ones, ``k < K`` (as in the projection onto the simplex). So ``ℓ = ℓ_idx`` with ``idx``
    the first ``k ≥ 1`` where it fails, minus one: the first failure, not a count, so that a
    rounded comparison past the root cannot move it (and the CPU path may stop at the first
    failure). A feasible row (``v_0 <= x_p``) gets some value that :func:`project` clamps away;
    the positive's ``-inf`` sorts last, so every row has a failure.
    """
    n = b.shape[-1]
    if grad:  # the values through a gather, so that autograd sees them (as torch.sort's backward)
        v = b.gather(-1, torch.sort(b.detach(), dim=-1, descending=True, stable=True).indices)
    else:
        v = torch.sort(b, dim=-1, descending=True, stable=True).values
    steps = torch.arange(2, n + 2, dtype=torch.float64, device=b.device)
    means = (torch.cumsum(v, -1, dtype=torch.float64) + x_pos) / steps
    with torch.no_grad():
        idx = (v > means)[..., 1:].to(torch.uint8).argmin(-1, keepdim=True)
    top = v[..., :1]
    return means.gather(-1, idx), top.detach() if grad else top


def _l1_level(
    b: torch.Tensor, mask: torch.Tensor | None, labels: torch.Tensor | None, grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ℓ = u_(|N|)`` per row (the source's choice among the L1 optima), and the largest breakpoint
    with labels (``[..., 1]`` each; ``None`` with a mask)."""
    n = b.shape[-1]
    if labels is not None:
        # |N| = n − 1 in every row: u_(n-1) is the second largest breakpoint, no sort needed.
        top2 = torch.topk(b, 2, dim=-1).values
        return top2[..., 1:], top2[..., :1].detach() if grad else top2[..., :1]
    index = (n - 1 - mask.sum(-1, keepdim=True)).clamp_(min=0)
    if grad:  # values through a gather of the sorted order, as torch.sort's backward
        return b.gather(-1, torch.sort(b.detach(), dim=-1, stable=True).indices.gather(-1, index)), None
    return torch.sort(b, dim=-1, stable=True).values.gather(-1, index), None


def _project_cpu(
    x: torch.Tensor, mask: torch.Tensor | None, labels: torch.Tensor | None, m: Any, norm: str
) -> torch.Tensor:
    """:func:`project` on the CPU without a gradient: float32 rows (L2, and L1 with a mask) by the
    compiled kernel when numba is installed (:mod:`marginkit.ops._mep_kernel`: the same bits, L2
    without a sort), the rows it leaves and every other call by :func:`_project_numpy`."""
    kernel = COMPILED and x.dtype == torch.float32 and (norm == "l2" or labels is None)
    if not kernel or KERNEL.get() is None:
        return _project_numpy(x, mask, labels, m, norm)
    n = x.shape[-1]
    xa = x.detach().contiguous().numpy().reshape(-1, n)
    mv = m if not isinstance(m, torch.Tensor) else m.detach().contiguous().numpy().reshape(-1, 1)
    ma = None if mask is None else mask.contiguous().numpy().reshape(-1, n)
    lab = None if labels is None else labels.contiguous().numpy().reshape(-1, 1)
    if norm == "l2":
        out = KERNEL.run("project_l2", xa, ma, lab, mv)
    else:
        out = KERNEL.run("project_l1_mask", xa, ma, mv)
    if out is None:  # numba could not compile it (said once)
        return _project_numpy(x, mask, labels, m, norm)
    z, redo = out
    if redo.any():
        r = np.flatnonzero(redo)
        rest = _project_numpy(
            torch.from_numpy(xa[r]),
            None if ma is None else torch.from_numpy(ma[r]),
            None if lab is None else torch.from_numpy(lab[r]),
            torch.from_numpy(mv[r]) if isinstance(mv, np.ndarray) else mv,
            norm,
        )
        z[r] = rest.numpy()
    return torch.from_numpy(z).reshape(x.shape)


def _project_numpy(
    x: torch.Tensor, mask: torch.Tensor | None, labels: torch.Tensor | None, m: Any, norm: str
) -> torch.Tensor:
    """:func:`project` on the CPU without a gradient, in numpy: the same IEEE operations on the
    same operands in the same order, hence the same bits.

    The sort is :mod:`marginkit.ops.selection`'s (numpy's vectorised sort): with a mask, one
    sort of packed ``(value, column, flag)`` keys gives the sorted values and their signs; with
    labels the negatives' breakpoints are sorted alone, and the level's prefix sums are taken over
    the first columns only, as far as each row's first failing comparison (a prefix of the
    sequential float64 scan has the bits of the whole scan's). The two reductions whose order is
    torch's own (``Σ_N u`` and the float64 prefix sums) are torch's, called on the same values.
    ``torch.where`` on the mask becomes a select on the bit patterns (exact, and branch-free on a
    random mask), and with labels a masked copy of the few entries that move; ``min_P u`` and
    ``max_N u`` are read off the sorted rows (L2), or computed on the rows whose clamp can change
    a bit (L1 with a mask: :func:`_l1_clamp`), whose level is one order statistic, numpy's sort
    and a pick (:func:`~marginkit.ops.selection.values_at_ranks`).

    (:func:`_project_cpu` sends float32 rows to the compiled kernel first, when numba is installed.)
    """
    shape = x.shape
    n = shape[-1]
    xa = x.detach().contiguous().numpy().reshape(-1, n)
    ui = np.uint32 if xa.dtype == np.float32 else np.uint64
    mv = m if not isinstance(m, torch.Tensor) else m.detach().contiguous().numpy().reshape(-1, 1)
    rows = np.arange(xa.shape[0])[:, None]
    xm = None  # x + m in the working dtype with m rounded to it first, as torch's x + m
    if labels is None:
        xm = xa + mv
        ma = mask.contiguous().numpy().reshape(-1, n)
        bits = _all_ones(ma, ui)  # all ones on the positives
        b = _select(bits, xa, xm)
        lab = x_pos = None
    else:  # (few full-size temporaries: each is fresh memory, and its pages cost more than its pass)
        ma = bits = None
        lab = labels.contiguous().numpy().reshape(-1, 1)
        x_pos = xa[rows, lab]
        b = np.add(xa, mv)
        b[rows, lab] = -np.inf if norm == "l2" else x_pos
    bounds = None
    if norm == "l2":
        if lab is None:
            level, bounds = _l2_level_numpy(b, xm, ma, bits, shape)
        else:
            level, bounds = _l2_level_labels_numpy(
                b,
                x_pos,
                lambda r: _labels_breakpoints(xa[r], mv[r] if isinstance(mv, np.ndarray) else mv, lab[r]),
            )
        t = (level - mv).astype(xa.dtype)
    elif lab is not None:  # the two largest breakpoints (as torch.topk's values), b overwritten
        first = b.argmax(-1)[:, None]
        bounds = np.take_along_axis(b, first, -1)
        b[rows, first] = -np.inf
        level = b.max(-1, keepdims=True)
        t = level - mv
    else:
        n_pos = np.count_nonzero(ma, axis=-1).reshape(-1, 1)
        # (xm is dead here but as scratch: b holds its values on the negatives; it takes the sort)
        level, unsure = values_at_ranks(b, np.maximum(n - 1 - n_pos, 0), work=xm)
        unsure |= n_pos == n  # no negative: the clamp gives -inf
        t = level - mv
    unrounded = level
    level = t + mv
    if lab is None:
        if bounds is not None:
            level = np.fmin(np.fmax(level, bounds[0]), bounds[1])
        else:  # L1: only rows the clamp can change compute its bounds (see _l1_clamp)
            _l1_clamp(level, unrounded, unsure, bits, xa, b)
        # np.where(mask, np.where(x < level, level, x), np.where(b <= level, x, t)) as selects on
        # the bits (a masked copy costs more than a select beyond a few percent of the entries).
        # The bits, b and xm are dead here: their buffers take the temporaries and the output,
        # whose fresh arrays' first touch would cost more than their passes.
        if (level == 0).any():  # the negatives whose breakpoint is not <= the level, the positives below it
            down = np.less_equal(b, level)
            down |= ma
            np.logical_not(down, out=down)
            z = _select(_all_ones(down, ui, out=bits), t, xa, out=b.view(ui))
            up = np.less(xa, level, out=down)
            up &= ma
            z = _select_in_place(_all_ones(up, ui, out=bits), level, z, scratch=xm.view(ui))
        else:
            # One comparison: on the positives b is x, and x <= level differs from x < level only
            # where x == level, a nonzero value, so level has x's bits there. Hence z = x where
            # (b <= level) != mask, else level on the positives and t on the negatives.
            kept = np.less_equal(b, level)
            np.not_equal(kept, ma, out=kept)
            tb = np.ascontiguousarray(t, dtype=xa.dtype).view(ui)
            if norm == "l2":  # _l2_level_numpy took the bits as scratch
                _all_ones(ma, ui, out=bits)
            target = np.bitwise_and(bits, level.view(ui) ^ tb, out=bits)
            target ^= tb
            z = _select(_all_ones(kept, ui, out=xm.view(ui)), xa, target.view(xa.dtype), out=b.view(ui))
    else:
        level = np.fmin(np.fmax(level, x_pos), bounds)
        # np.where(xm <= level, xa, t) as a copy of the few entries that move; L2's b is xm but at
        # the labels, whose entries are written last. The output is written into b's buffer: a
        # fresh array's first touch (page faults) costs more than the pass that fills it.
        moves = np.less_equal(b if norm == "l2" else np.add(xa, mv, out=b), level)
        np.logical_not(moves, out=moves)
        z = b
        np.copyto(z, xa)
        np.copyto(z, t, where=moves)
        z[rows, lab] = np.where(x_pos < level, level, x_pos)
    return torch.from_numpy(z).reshape(shape)


def _l1_clamp(
    level: np.ndarray,
    unrounded: np.ndarray,
    unsure: np.ndarray,
    bits: np.ndarray,
    xa: np.ndarray,
    b: np.ndarray,
) -> None:
    """``level = fmin(fmax(level, lo), hi)`` in place for the mask L1 level, ``lo = min(min_P u, hi)``,
    ``hi = max_N u``, with the bounds computed on the rows where the clamp can change a bit only.

    In a row with a negative and no NaN, the unrounded level ``u_(|N|)`` lies in ``[lo, hi]``:
    ``hi`` is the largest of ``|N|`` breakpoints, hence at least the ``|N|``-th smallest; a row
    whose positives all lie above ``u_(|N|)`` keeps the margin, and there ``lo = hi = u_(|N|)``;
    otherwise some positive lies at or below it. So where ``fl(fl(ℓ − m) + m)`` gives ``ℓ`` back
    bit for bit and ``ℓ`` is not a zero (whose sign ``fmax`` / ``fmin`` may swap for an equal
    bound), the clamp returns ``ℓ``. ``unsure`` marks the other rows (a NaN, no negative); ``b``
    holds the breakpoints, ``bits`` the positives as all-ones.
    """
    ui = bits.dtype
    keep = (level.view(ui) == unrounded.view(ui)) & (level != 0) & ~unsure
    if keep.all():
        return
    r = np.flatnonzero(~keep)
    inf = np.full(1, np.inf, xa.dtype)
    hi = _select(bits[r], -inf, b[r]).max(-1, keepdims=True)
    lo = np.minimum(_select(bits[r], xa[r], inf).min(-1, keepdims=True), hi)
    level[r] = np.fmin(np.fmax(level[r], lo), hi)


def _all_ones(flags: np.ndarray, ui: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Bool ``flags`` as the unsigned integer ``ui`` with all bits set where true (for :func:`_select`)."""
    return np.negative(flags.view(np.uint8), dtype=ui, out=out)


def _select(bits: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``np.where(bits != 0, a, b)`` for float arrays (broadcast), with ``bits`` all ones or all
    zeros in an unsigned integer of the floats' width: exact bit patterns, no branches. ``out``
    (that unsigned type, the full shape) must not share memory with ``a`` or ``b``."""
    ui = bits.dtype
    ub = np.ascontiguousarray(b).view(ui)
    out = np.bitwise_xor(np.ascontiguousarray(a).view(ui), ub, out=out)
    out &= bits
    out ^= ub
    return out.view(a.dtype)


def _select_in_place(bits: np.ndarray, a: np.ndarray, b: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """:func:`_select` written into ``b`` (``b ^= (a ^ b) & bits``); ``scratch`` as ``out`` there."""
    ub = b.view(bits.dtype)
    diff = np.bitwise_xor(np.ascontiguousarray(a).view(bits.dtype), ub, out=scratch)
    diff &= bits
    ub ^= diff
    return b


def _l2_level_numpy(
    b: np.ndarray, xm: np.ndarray, ma: np.ndarray, bits: np.ndarray, shape: torch.Size
) -> tuple[np.ndarray, Any]:
    """:func:`_l2_level` on ``[rows, n]`` numpy breakpoints (see :func:`_project_numpy`).

    Returns the float64 level and ``(min(min_P u, max_N u), max_N u)`` (the sorted rows' first
    positive and last negative, ``±inf`` when absent). ``xm`` and ``bits`` are overwritten
    (scratch).
    """
    rows, n = b.shape
    ui = np.uint32 if b.dtype == np.float32 else np.uint64
    if b.dtype == np.float32:
        u, pos = sort_with_flags(torch.from_numpy(b), torch.from_numpy(ma))
    else:
        u, order = (t.numpy() for t in stable_sort(torch.from_numpy(b)))
        pos = np.take_along_axis(ma, order, -1)
    # (xm and the bits are scratch from here: others and flip are written into their buffers)
    np.invert(bits, out=bits)
    others = np.bitwise_and(xm.view(ui), bits, out=xm.view(ui)).view(b.dtype)  # +0.0 on the positives
    flip = np.subtract(1, pos.view(np.uint8), dtype=ui, out=bits)
    flip <<= ui(8 * b.itemsize - 1)
    s = np.bitwise_xor(u.view(ui), flip, out=flip).view(b.dtype)  # -u on the negatives: sign flipped
    cp = torch.cumsum(torch.from_numpy(pos), -1, dtype=torch.int32).numpy()
    # c = (n - 1 - k) - |P| + 2 cp, exact integers, in cp's buffer
    c = cp
    total_pos = cp[:, -1:].copy()
    c *= 2
    c += np.arange(n - 1, -1, -1, dtype=np.int32)
    c -= total_pos
    at = np.arange(rows)
    first_pos = pos.argmax(-1)
    last_neg = n - 1 - pos[:, ::-1].argmin(-1)
    hi = np.where(pos[at, last_neg], -np.inf, u[at, last_neg]).astype(b.dtype)[:, None]
    lo = np.where(pos[at, first_pos], u[at, first_pos], np.inf).astype(b.dtype)[:, None]
    total = torch.from_numpy(others).reshape(shape).sum(-1, keepdim=True, dtype=torch.float64)
    a = torch.cumsum(torch.from_numpy(s), -1, dtype=torch.float64).numpy()  # torch's is the faster scan
    a += total.numpy().reshape(-1, 1)
    means = np.divide(a, c, out=a)
    idx = np.count_nonzero(u[:, 1:] < means[:, 1:], axis=-1).reshape(-1, 1)
    return np.take_along_axis(means, idx, -1), (np.minimum(lo, hi), hi)


# Columns of the labels' level tried first (a row's active negatives are usually few); then 8x.
_LEVEL_WINDOW = 64
# Rows at least this long try the labels' candidate selection first; shorter rows are sorted whole.
# The selection costs about four passes over the rows plus a scattered gather whatever the sort
# costs, and numpy's vectorised sort of a row of a few thousand float32 values costs less than
# that: measured on (256, 1000) ... (256, 2000) rows, random, near-tied and dominant labels alike,
# the whole sort took 0.46-0.80x the selection's time; from 3000 columns on, rows with a dominant
# label (a trained model's) are cheaper by the selection (docs/mep.md). (At least _LEVEL_WINDOW.)
_CANDIDATE_MIN_COLUMNS = 2048


def _labels_breakpoints(x: np.ndarray, m: Any, lab: np.ndarray) -> np.ndarray:
    """The negatives' breakpoints ``x + m`` of ``[rows, n]`` scores, ``-inf`` at the labels."""
    b = np.add(x, m)
    b[np.arange(len(x))[:, None], lab] = -np.inf
    return b


def _l2_level_labels_numpy(b: np.ndarray, x_pos: np.ndarray, unsorted: Any) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_l2_level_labels` on ``[rows, n]`` numpy breakpoints: ``(ℓ, max_N u)`` (``b`` kept).

    Most rows need no sort of the whole row. The candidate levels rise while the comparisons
    hold (``ℓ_k = ((k + 1) ℓ_{k-1} + v_k) / (k + 2) > ℓ_{k-1}`` iff ``v_k > ℓ_{k-1}``), so the
    active negatives lie above ``ℓ_0 = (x_p + max_N u) / 2``: the breakpoints at or above a
    threshold a little below ``ℓ_0`` (one pass) are the first columns of the descending order,
    exactly (ties included), and only they are sorted. A row whose first failing comparison lies
    among them, or on the next column (the largest other breakpoint, compared as the whole row's
    scan compares it), has the whole sort's prefix sums, comparisons and level there, bit for
    bit; the other rows (every candidate active, a zero among them, candidates in more than a quarter of
    the row) take :func:`_l2_level_labels_sorted`, and so does every row of a batch with a NaN,
    and every row shorter than ``_CANDIDATE_MIN_COLUMNS`` (whose whole sort costs less).
    """
    rows, n = b.shape
    if n < _CANDIDATE_MIN_COLUMNS:
        return _l2_level_labels_sorted(b.copy(), x_pos, unsorted)
    top = b.max(-1, keepdims=True)
    level = np.empty((rows, 1))
    todo = np.arange(rows)
    if not np.isnan(top).any():
        half = (top.astype(np.float64) + x_pos) / 2  # ℓ_0 as the sorted path computes it
        # a relative slack far above the rounding of the comparisons (and of the float32 threshold)
        threshold = (half - (np.abs(half) * 2.0**-16 + 2.0**-60)).astype(b.dtype)
        cand = b >= threshold
        counts = np.count_nonzero(cand, axis=-1)
        wide = counts > n // 4  # such rows take the sorted path
        if wide.any():
            cand &= ~wide[:, None]
            counts[wide] = 0
        width = int(counts.max()) + 1
        # a row that keeps the margin (max_N u <= x_p): project clamps any level to max_N u
        found = top[:, 0] <= x_pos[:, 0]
        level[found, 0] = x_pos[found, 0]
        if width > 1:
            flat = np.flatnonzero(cand)  # row-major: each row's candidates in turn
            r = flat // n
            first = np.cumsum(counts) - counts
            part = np.full((rows, width), -np.inf, b.dtype)
            part[r, np.arange(r.size) - first[r]] = b.reshape(-1)[flat]
            part.sort(axis=-1)
            part = np.ascontiguousarray(part[:, ::-1])  # descending; -inf fills each row's tail
            sums = torch.cumsum(torch.from_numpy(part), -1, dtype=torch.float64).numpy()
            means = sums + x_pos
            means /= np.arange(2, width + 2, dtype=np.float64)
            holds = part[:, 1:] > means[:, 1:]
            idx = holds.argmin(-1) + 1  # the first failing column (or the first of the -inf fill)
            at = np.arange(rows)
            ok = (idx <= counts) & ~(part == 0).any(-1) & (top[:, 0] != 0) & ~found
            # every candidate holds: the sorted order's next column is the largest other breakpoint,
            # below ℓ_0 <= ℓ; its comparison is made as the whole sort's scan makes it
            last = ok & (idx == counts)
            if last.any():
                rl, k = at[last], counts[last]
                nxt = np.where(cand[rl], -np.inf, b[rl]).max(-1)
                mean = (sums[rl, k - 1] + nxt.astype(np.float64) + x_pos[rl, 0]) / (k + 2)
                ok[rl[(nxt > mean) | (nxt == 0)]] = False
            level[ok, 0] = means[at[ok], idx[ok] - 1]
            found |= ok
        todo = todo[~found]
    if todo.size:
        sub = b[todo] if todo.size < rows else b.copy()
        level[todo], top[todo] = _l2_level_labels_sorted(sub, x_pos[todo], lambda r: unsorted(todo[r]))
    return level, top


def _l2_level_labels_sorted(b: np.ndarray, x_pos: np.ndarray, unsorted: Any) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_l2_level_labels` on ``[rows, n]`` numpy breakpoints: ``(ℓ, max_N u)``.

    The float64 prefix sums, means and comparisons are computed on the first ``_LEVEL_WINDOW``
    sorted columns, and on wider windows only for the rows whose first failing comparison lies
    beyond them: the same values at the same places as the whole rows', hence the same ``ℓ``.
    The descending order is read backwards off numpy's ascending sort of the values (window by
    window); a window holding a zero or a NaN, whose signs and payloads the stable order places
    by index, takes :func:`~marginkit.ops.selection.sort_values` of the rows as ``unsorted(rows)``
    gives them (``b`` is sorted in place).
    """
    rows, n = b.shape
    b.sort(axis=-1)
    ascending = b

    def head(todo: np.ndarray, width: int) -> np.ndarray:  # the first `width` descending values
        part = ascending[:, n - width :] if todo.size == rows else ascending[todo, n - width :]
        part = np.ascontiguousarray(part[:, ::-1])
        if (part == 0).any() or np.isnan(part).any():
            part = sort_values(torch.from_numpy(unsorted(todo)), descending=True).numpy()[:, :width]
        return part

    level, top = np.empty((rows, 1)), None
    todo = np.arange(rows)
    width = min(n, _LEVEL_WINDOW)
    while todo.size:
        part = head(todo, width)
        top = part[:, :1].copy() if top is None else top
        means = torch.cumsum(torch.from_numpy(part), -1, dtype=torch.float64).numpy()
        means += x_pos[todo]
        means /= np.arange(2, width + 2, dtype=np.float64)
        holds = part[:, 1:] > means[:, 1:]
        idx = holds.argmin(-1)
        found = ~holds[np.arange(todo.size), idx] | (width == n)
        level[todo[found], 0] = means[found, idx[found]]
        todo, width = todo[~found], min(n, 8 * width)
    return level, top
