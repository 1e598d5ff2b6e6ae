r"""Autograd functions of the alpha softargmax and its Fenchel–Young loss: closed-form backward passes.

With :math:`w_j = q_j^{\beta} p_j^{1-\beta}` on the support, the softargmax's Jacobian is
:math:`J = \mathrm{diag}(w) - w w^\top / \sum w`, and the loss's gradient is exactly
:math:`p - e_y`: neither differentiates through the solver. The derivative with respect to
:math:`\beta = \alpha - 1` (a learnable alpha) is implicit too (:func:`_beta_partials`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from marginkit._validation import active_checks, compute_dtype
from marginkit.ops.alpha._candidates import _Blocks, _Entries, _logits, _offset
from marginkit.ops.alpha._memory import _serial
from marginkit.ops.alpha._solve import _Solution, _solve
from marginkit.ops.alpha._static import _solve_static, beta_rows, budgets
from marginkit.ops.classes import ONE_PROCESS, ClassAxis

# Below this |v| the series of v + log(1 − v) is summed (the direct form cancels).
_SERIES_BELOW = 0.1
_SERIES_TERMS = 18


def _v_plus_log1m(v: Tensor) -> Tensor:
    r""":math:`v + \log(1 - v) = -\sum_{k \ge 2} v^k / k` for :math:`v < 1`, accurate near 0."""
    direct = v + torch.log1p(-v.clamp_max(1.0 - torch.finfo(v.dtype).eps))
    small = v.abs() < _SERIES_BELOW
    vs = torch.where(small, v, 0.0)
    series = torch.zeros_like(vs)
    power = vs * vs
    for k in range(2, _SERIES_TERMS + 1):
        series = series - power / k
        power = power * vs
    return torch.where(small, series, direct)


def _beta_partials(p: Tensor, u: Tensor, theta: Tensor, tau_e: Tensor, beta_e: Tensor) -> Tensor:
    r"""Per entry :math:`a_j = \partial p_j/\partial\beta` at fixed τ (float64; 0 off the support).

    From :math:`\log p_j = \log q_j + \log(u_j)/\beta`, :math:`u_j = 1 + \beta(\theta_j - \tau)`:
    :math:`a_j = p_j\,(1 - 1/u_j - \log u_j)/\beta^2 = p_j\,\phi(v_j)/\beta^2` with
    :math:`v_j = 1 - 1/u_j` and :math:`\phi(v) = v + \log(1 - v)`, summed as a series near 0 so
    that the :math:`1/\beta^2` of entmax's form (Correia et al., 2019) cancels analytically as
    :math:`\alpha \to 1` (:math:`a_j \to -p_j(\theta_j - \tau)^2/2`). With
    :math:`d\tau/d\beta = \sum a/\sum w`, :math:`dp_j/d\beta = a_j - w_j \sum a / \sum w`:
    for :math:`q \equiv 1` exactly ``entmax_bisect``'s gradient w.r.t. alpha.
    """
    f64 = torch.float64
    b = beta_e.to(f64)
    eps_ = (theta.to(f64) - tau_e.to(f64)) * b  # u − 1, without the rounding of u
    on = (p > 0) & (u > 0)
    v = torch.where(on, eps_ / (1.0 + eps_).clamp_min(torch.finfo(f64).tiny), 0.0)
    return torch.where(on, p.to(f64) * _v_plus_log1m(v) / (b * b), 0.0)


def _centred(entries: _Entries, w: Tensor, g: Tensor) -> Tensor:
    r""":math:`g_j - \langle w, g\rangle / \sum w` per entry, without cancellation when one weight dominates.

    Computed relative to the ``g`` of the entry of largest weight ``a`` per row,
    :math:`(g_j - g_a) - \sum_k w_k (g_k - g_a) / \sum w`: the dominant term drops out of the sum
    exactly. With a measure spanning many orders of magnitude one weight can exceed the others by
    1e15 and the direct form would lose :math:`\partial p_a/\partial\theta_a` entirely.
    """
    wmax = entries.per_entry(entries.rowmax(w))
    ref = entries.rowmax(torch.where(w == wmax, g, -math.inf))
    d = g - entries.per_entry(ref)
    return d - entries.per_entry(entries.rowsum(w * d) / entries.rowsum(w))


class _SoftargmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        logq: Tensor | None,
        blocks: _Blocks,
        beta: Tensor,
        beta_scalar: float | None,
        k: int | None,
        candidates: bool,
    ) -> Tensor:
        kw: dict[str, Any] = {"scale": 1.0, "beta": beta, "beta_scalar": beta_scalar, "k": k}
        kw.update(candidates=candidates, shift=blocks.rowmax)
        sol = _solve(x, blocks, logq=logq, **kw) if logq is not None else _exact(x, blocks, **kw)
        ctx.shape = x.shape
        ctx.dtypes = (x.dtype, None if logq is None else logq.dtype)
        ctx.save_for_backward(sol.p, sol.w, *sol.entries.saved())
        ctx.beta_terms = (sol.u, sol.theta, sol.tau, beta) if ctx.needs_input_grad[3] else None
        return sol.entries.scatter(sol.p, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        p, w, *saved = ctx.saved_tensors
        entries = _Entries.restore(ctx.shape[0], ctx.shape[1], tuple(saved))
        on = w > 0
        g = entries.gather(grad).to(p.dtype).masked_fill(~on, 0.0)
        centred = _centred(entries, w, g)
        x_dtype, q_dtype = ctx.dtypes
        grad_x = grad_logq = None
        if ctx.needs_input_grad[0]:
            grad_x = entries.scatter((w * centred).masked_fill_(~on, 0.0), x_dtype, gradient=True)
        if ctx.needs_input_grad[1]:
            grad_logq = entries.scatter((p * centred).masked_fill_(~on, 0.0), q_dtype, gradient=True)
        grad_beta = None
        if ctx.beta_terms is not None:  # Σ_j g_j dp_j/dβ = Σ_j a_j (g_j − ⟨w, g⟩/Σw)
            u, theta, tau, beta = ctx.beta_terms
            a = _beta_partials(p, u, theta, entries.per_entry(tau), entries.per_entry(beta))
            grad_beta = entries.rowsum(a * centred.to(a.dtype)).to(beta.dtype)
        return grad_x, grad_logq, None, grad_beta, None, None, None


def _exact(
    x: Tensor,
    blocks: _Blocks | None,
    *,
    logq_label_min: float = 0.0,
    logq_value: float | None = None,
    **kw: Any,
) -> _Solution:
    """The solution of every row (q ≡ 1 but the label): the fixed-shape solver, verified on the device.

    When its flag says "not exact" (a candidate budget overflowed, or the root did not converge
    in the fixed iterations): in a library call the flag is read now and the exact host-driven
    solver (:func:`marginkit.ops.alpha._solve._solve`) redoes the batch; inside
    :func:`marginkit._validation.deferred_checks` (the trainer) nothing is read: the flag is
    recorded and the error raised at the next read point (an on-device fallback for every step
    would cost what the candidate filter saves).
    """
    blocks = _Blocks(x) if blocks is None else blocks
    sol, not_exact = _solve_static(x, blocks, logq_label_min=logq_label_min, logq_value=logq_value, **kw)
    checks = active_checks()
    if checks is None:
        if bool(not_exact):
            if kw.get("beta") is None:  # (the lean solver's callers pass β as a number only)
                kw["beta"] = beta_rows(kw["beta_scalar"], x.shape[0], compute_dtype(x.dtype), x.device)
            if logq_value is not None and kw.get("label") is not None and kw.get("logq_label") is None:
                kw["logq_label"] = torch.full_like(kw["beta"], logq_value)
            return _solve(x, blocks, **kw)
        return sol
    size, n_blocks = budgets(x.shape[0], x.shape[1], kw.get("k"))
    checks.record("alpha solver", not_exact, lambda: _NOT_EXACT.format(size=size, blocks=n_blocks))
    return sol


_NOT_EXACT = (
    "the alpha-divergence solver (Q-Margin, entmax, sparsemax losses) was not exact for a batch: more "
    "candidate classes than its fixed budget ({size} entries, {blocks} blocks of 64 classes over the batch) "
    "or a threshold not converged in its fixed iterations, so that step's loss and gradient were wrong; "
    "pass topk=K (the budget per row) above the number of active classes per row, or run the loss outside "
    "deferred_checks(), where the exact solver redoes such a batch"
)


# A sparse gradient goes to the head only when its entries are at most this fraction of the scores.
_SPARSE_FRACTION = 64


class _OnAxis(NamedTuple):
    """What a loss on a class axis computed before the solve (over every class of the axis).

    ``bounds``: ``(τ_lo, τ_hi)``; ``theta_y``/``logq_y``: the label's logit and ``log q`` per row;
    ``owned``: the label's column is in this block (``None``: every row's); ``shift``: the row
    maximum of the scores over every class (the solver's frame; bounds and ``theta_y`` are in it).
    """

    axis: ClassAxis
    bounds: tuple[Tensor, Tensor] | None  # None: the solver computes them
    theta_y: Tensor
    logq_y: Tensor | None
    owned: Tensor | None
    shift: Tensor
    logq_min: float = 0.0  # a lower bound of logq_y (a Python float: the solver reads nothing)
    logq_value: float | None = None  # logq_y when it is this one number on every row


def _loss_value(
    sol: _Solution,
    theta_y: Tensor,
    logq_y: Tensor | None,
    beta: Tensor,
    label: Tensor | None = None,
    beta_scalar: float | None = None,
    logq_value: float | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Fenchel–Young loss and support size per row, from the support only (no inactive terms).

    With :math:`\sum p = 1` and :math:`p_j^\alpha q_j^{-\beta} = p_j u_j` on the support,
    :math:`D_f(e_y, q) - D_f(p, q) = (E(q_y) - \langle p, \theta\rangle + \tau)/\alpha`, so
    :math:`\ell = (1 - 1/\alpha)\langle p, \theta - \theta_y\rangle + (\tau - \theta_y + E(q_y))/\alpha`.
    Rounding can make an exact zero slightly negative; the value is clamped at 0. The inner
    product and the support size come with the Newton evaluations when those carried them (a
    partitioned axis), else from the solution's entries; there, with ``label``, a row whose only
    active entry is the label has :math:`p = e_y` and its loss is exactly 0 (τ itself is only
    known to rounding). ``beta_scalar`` (and ``logq_value``, the one value of ``logq_y``) turn
    the per-row constants into Python numbers.
    """
    stats = sol.stats
    mass = None
    if stats is not None and stats.inner is not None and stats.support is not None:
        inner, mass, support = stats.inner, stats.mass, stats.support  # (with the unnormalised p)
    else:
        entries = sol.entries
        spread = torch.where(sol.p > 0, sol.theta - entries.per_entry(theta_y), 0.0)
        inner = entries.rowsum(sol.p * spread)
        support = entries.rowsum((sol.p > 0).to(sol.p.dtype))
    if beta_scalar is not None and (logq_y is None or logq_value is not None):
        b = beta_scalar
        rest = sol.tau - theta_y  # α ℓ = β I + τ − θ_y + E(q_y)
        if logq_value:
            rest = rest + math.expm1(-b * logq_value) / b
        if mass is None:
            loss = torch.add(rest, inner, alpha=b).mul_(1.0 / (1.0 + b))
        else:
            loss = torch.addcdiv(rest, inner, mass, value=b).mul_(1.0 / (1.0 + b))
    else:
        inv_alpha = 1.0 / (1.0 + beta)
        e_y = torch.zeros_like(theta_y) if logq_y is None else _offset(logq_y, beta)
        inner = inner if mass is None else inner / mass
        loss = (1.0 - inv_alpha) * inner + (sol.tau - theta_y + e_y) * inv_alpha
    if label is not None:
        at_label = sol.entries.is_column(label) & (sol.p > 0)
        only_label = (support == 1) & (sol.entries.rowsum(at_label.to(sol.p.dtype)) > 0)
        loss = loss.masked_fill_(only_label, 0.0)
    return loss.clamp_min_(0.0), support if support.dtype == torch.long else support.round().long()


def _expm1_slope(z: Tensor) -> Tensor:
    r""":math:`h(z) = (z e^z - (e^z - 1))/z^2` (:math:`\to 1/2` at 0; a series there)."""
    small = z.abs() < _SERIES_BELOW
    zs = torch.where(small, z, 0.0)
    series, power, fact = torch.zeros_like(zs), torch.ones_like(zs), 2.0
    for n in range(2, _SERIES_TERMS + 2):
        series = series + power * ((n - 1) / fact)
        power = power * zs
        fact *= n + 1
    zd = torch.where(small, 1.0, z)
    return torch.where(small, series, (zd * torch.exp(zd) - torch.expm1(zd)) / (zd * zd))


def _loss_beta_derivative(
    p: Tensor,
    u: Tensor,
    entries: _Entries,
    beta: Tensor,
    logq_y: Tensor | None,
    theta: Tensor,
    tau: Tensor,
    theta_y: Tensor,
    loss: Tensor,
    axis: ClassAxis,
) -> Tensor:
    r""":math:`d\ell/d\beta` per row of the Fenchel–Young loss (float64), from its support-only form.

    :math:`\ell = (\beta I + R)/\alpha` with :math:`I = \langle p, \theta - \theta_y\rangle` and
    :math:`R = \tau - \theta_y + E(q_y) = \alpha\ell - \beta I`, so
    :math:`d\ell/d\beta = (I - R)/\alpha^2 + (\beta\,dI + d\tau + dE)/\alpha` with
    :math:`dI = \sum_j (a_j - w_j\,d\tau)(\theta_j - \theta_y)`, :math:`d\tau = \sum a / \sum w`
    (:func:`_beta_partials`) and :math:`dE/d\beta = (\log q_y)^2 h(-\beta\log q_y)`. The four row
    sums run on the class ``axis`` (one SUM on a partitioned one).
    """
    f64 = torch.float64
    b = beta.to(f64)
    a = _beta_partials(p, u, theta, entries.per_entry(tau), entries.per_entry(beta))
    on = (p > 0) & (u > 0)
    pf = p.to(f64)
    w = torch.where(on, pf / torch.where(on, u.to(f64), 1.0), 0.0)
    spread = torch.where(on, theta.to(f64) - entries.per_entry(theta_y.to(f64)), 0.0)
    sums = axis.sum_(torch.stack([entries.rowsum(t) for t in (a, w, a * spread, w * spread, pf * spread)]))[0]
    s_a, s_w, s_as, s_ws, inner = sums.unbind(0)
    d_tau = s_a / s_w
    d_inner = s_as - d_tau * s_ws
    alpha = 1.0 + b
    d_e = torch.zeros_like(b) if logq_y is None else logq_y.to(f64) ** 2 * _expm1_slope(-b * logq_y.to(f64))
    rest = loss.to(f64) * alpha - b * inner  # = τ − θ_y + E(q_y)
    return (inner - rest) / alpha**2 + (b * d_inner + d_tau + d_e) / alpha


class _LossFunction(torch.autograd.Function):
    """Alpha Fenchel–Young loss and support size per row; ``on``: the loss runs on a class axis."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        logq: Tensor | None,
        label: Tensor,
        blocks: _Blocks | None,
        beta: Tensor,
        beta_scalar: float | None,
        scale: float,
        logq_label: Tensor | None,
        k: int | None,
        candidates: bool,
        sparse_grad: bool = False,
        on: _OnAxis | None = None,
    ) -> tuple[Tensor, Tensor]:
        cdt = compute_dtype(x.dtype)
        logq_value = None
        if on is None:  # the label entries are in x
            bounds, axis, owned, theta_y = None, ONE_PROCESS, None, None
            shift = x.amax(1) if blocks is None else blocks.rowmax
            if logq is not None:
                logq_y = logq.gather(1, label.unsqueeze(1)).squeeze(1).to(cdt)
            else:
                logq_y = None if logq_label is None else logq_label.to(cdt)
                # (q ≡ 1 but the label: the frame is the row maximum, θ_y known before the solve)
                theta_y = _logits(x.gather(1, label.unsqueeze(1)).squeeze(1), shift, scale, cdt)
        else:
            axis, bounds, theta_y, logq_y, owned, shift, _, logq_value = on
        kw: dict[str, Any] = {"scale": scale, "beta": beta, "beta_scalar": beta_scalar, "k": k}
        kw.update(label=label, logq_label=logq_label, candidates=candidates, bounds=bounds)
        kw.update(axis=axis, theta_y=theta_y, shift=shift)
        if logq is not None:
            sol = _solve(x, blocks, logq=logq, **kw)
        else:
            logq_min = 0.0 if on is None else on.logq_min
            sol = _exact(x, blocks, logq_label_min=logq_min, logq_value=logq_value, **kw)
        if theta_y is None:  # in the frame the solve settled on (per row)
            theta_y = _logits(x.gather(1, label.unsqueeze(1)).squeeze(1), sol.shift, scale, cdt)
        with _serial(sol.p.numel(), sol.p.device):
            loss, support = _loss_value(
                sol, theta_y, logq_y, beta, label if on is None else None, beta_scalar, logq_value
            )
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(support)
        ctx.shape, ctx.scale, ctx.sparse_grad = x.shape, scale, sparse_grad
        ctx.dtypes = (x.dtype, None if logq is None else logq.dtype)
        ctx.save_for_backward(sol.p, sol.u, label, owned, beta, logq_y, sol.p_mass, *sol.entries.saved())
        ctx.beta_terms = (sol.theta, sol.tau, theta_y, loss, axis) if ctx.needs_input_grad[4] else None
        return loss, support

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, _grad_support: Tensor | None) -> tuple[Tensor | None, ...]:
        if grad is None:  # (the loss itself is not in the graph)
            return (None,) * 12
        p, u, label, owned, beta, logq_y, p_mass, *saved = ctx.saved_tensors
        entries = _Entries.restore(ctx.shape[0], ctx.shape[1], tuple(saved))
        x_dtype, q_dtype = ctx.dtypes
        if p_mass is not None and (ctx.needs_input_grad[1] or ctx.beta_terms is not None):
            p, p_mass = p / entries.per_entry(p_mass), None
        g = grad.to(p.dtype)
        grad_x = grad_logq = None
        if ctx.needs_input_grad[0]:
            gs = g * ctx.scale
            at_label = -gs if owned is None else torch.where(owned, -gs, 0.0)  # −s·g·e_y on its owner
            with _serial(p.numel(), p.device):  # (an unnormalised p: its row's mass divides s·g)
                values = (p * entries.per_entry(gs if p_mass is None else gs / p_mass)).to(x_dtype)
            # the head gathers a row of D per entry (padding included): worth it only for few entries
            few = p.numel() * _SPARSE_FRACTION <= ctx.shape[0] * ctx.shape[1]
            if ctx.sparse_grad and few and (entries.is_flat or entries.col is not None):
                with _serial(p.numel(), p.device):
                    grad_x = entries.sparse(values, label, at_label.to(x_dtype))
            else:
                grad_x = entries.scatter(values, x_dtype, gradient=True)
                with _serial(p.numel(), p.device):
                    grad_x.scatter_add_(1, label.unsqueeze(1), at_label.unsqueeze(1).to(x_dtype))
        if ctx.needs_input_grad[1]:
            # ∂ℓ/∂log q_k = [p_k u_k − δ_ky q_y^{−β}] / α
            ga = g / (1.0 + beta)
            grad_logq = entries.scatter(p * u * entries.per_entry(ga), q_dtype, gradient=True)
            at_y = -torch.exp(-beta * logq_y) * ga
            grad_logq.scatter_add_(1, label.unsqueeze(1), at_y.unsqueeze(1).to(q_dtype))
        grad_beta = None
        if ctx.beta_terms is not None:
            grad_beta = (g * _loss_beta_derivative(p, u, entries, beta, logq_y, *ctx.beta_terms)).to(
                beta.dtype
            )
        return grad_x, grad_logq, None, None, grad_beta, None, None, None, None, None, None, None
