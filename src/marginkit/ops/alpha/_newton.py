r"""The Newton solver of the alpha softargmax: a compact problem, its bounds and the root finder.

A :class:`_Problem` holds the entries that can be active (logits, ``log q``, ``β``); its mass
:math:`M(\tau) = \sum_j q_j[1 + \beta(\theta_j - \tau)]_+^{1/\beta}` is decreasing in τ and
:func:`_find_tau` solves :math:`M(\tau) = 1` per row by a safeguarded Newton method. The row
sums it needs are reductions over a :class:`~marginkit.ops.classes.ClassAxis` (the classes of
one process, or of every rank of a sharded head).
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch
from torch import Tensor

from marginkit.ops.alpha._candidates import _bound_slack, _Entries, _offset
from marginkit.ops.classes import ONE_PROCESS, ClassAxis

# Convergence: |Newton step| <= _TOL_ULPS * eps * (1 + |tau|) (or a bracket that narrow).
_TOL_ULPS = 4.0
# Host syncs in the solver: the first convergence check after _FIRST_CHECK iterations, then one
# every _CHECK_EVERY iterations (from the block-maxima bound, three iterations are typical).
_FIRST_CHECK = 3
_CHECK_EVERY = 1


# The flat candidate set is re-filtered when that keeps at most this fraction of it.
_SHRINK_FRACTION = 0.7


# Floor of the exponent in _Problem.support: the log of e x the smallest normal number per
# compute dtype (exp at exactly log(tiny) can round to a subnormal: the slow path again).
_LOG_TINY = {dtype: math.log(torch.finfo(dtype).tiny) + 1.0 for dtype in (torch.float32, torch.float64)}
# q enters the product form of _Problem.support when log q >= _LOG_TINY + this (1/q stays finite
# with room to spare: 1/q <= e^{77} in float32, whose largest number is e^{88.7}).
_Q_HEADROOM = 10.0


# 1/β up to this integer is evaluated by products (square-and-multiply).
_MAX_INT_POWER = 16


def _integer_power(beta: float | None) -> int | None:
    """``1/beta`` when it is an integer in ``[1, _MAX_INT_POWER]`` (to rounding), else ``None``."""
    if beta is None or beta <= 0:
        return None
    r = 1.0 / beta
    k = round(r)
    return k if 1 <= k <= _MAX_INT_POWER and abs(r - k) <= 1e-12 * k else None


def _int_pow(u: Tensor, k: int) -> Tensor:
    """``u ** k`` for an integer ``k >= 1`` by square-and-multiply (a new tensor unless ``k == 1``)."""
    result: Tensor | None = None
    base = u
    while True:
        if k & 1:
            if result is None:
                result = base
            elif result is u:
                result = result * base
            else:
                result.mul_(base)
        k >>= 1
        if not k:
            assert result is not None
            return result
        base = base * base


class _Problem:
    r"""A compact problem: logits, ``log q`` (``None``: q ≡ 1) and ``β = α − 1`` of its entries.

    ``beta`` is per row ``[N]``; ``beta_scalar`` is its common value when ``α`` is a scalar (the
    entry-wise arithmetic then uses a Python float). ``logq_min``: a known lower bound of ``logq``
    (``None``: unknown); when it keeps :math:`1/q` far from overflow, an integer :math:`1/\beta`
    evaluates :math:`p = q u^{1/\beta}` by products even with a measure (see :meth:`support`).
    """

    def __init__(
        self,
        entries: _Entries,
        theta: Tensor,
        logq: Tensor | None,
        beta: Tensor,
        beta_scalar: float | None,
        logq_min: float | None = None,
    ) -> None:
        self.entries, self.theta, self.logq = entries, theta, logq
        self.beta, self.beta_scalar = beta, beta_scalar
        self.beta_e: Tensor | float = beta_scalar if beta_scalar is not None else entries.per_entry(beta)
        self.r_e: Tensor | float = 1.0 / self.beta_e
        self.btheta = theta * self.beta_e
        self.int_power = _integer_power(beta_scalar)
        self.q: Tensor | None = None
        if logq is not None and self.int_power is not None:
            if logq_min is not None and logq_min >= _LOG_TINY[logq.dtype] + _Q_HEADROOM:
                self.q = logq.exp()
            else:
                self.int_power = None

    def _t(self, tau: Tensor) -> Tensor:
        return self.btheta - self.entries.per_entry(self.beta * tau)

    def active(self, tau: Tensor) -> Tensor:
        r"""Per entry: :math:`1 + \beta(\theta_j - \tau) > 0` (the same arithmetic as :meth:`support`)."""
        return self._t(tau) > -1

    def support(self, tau: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        r"""Unnormalised probabilities, support weights and ``u`` at ``tau`` (``[N]``).

        :math:`u_j = [1 + \beta(\theta_j - \tau)]_+`, :math:`p_j = q_j u_j^{1/\beta}`,
        :math:`w_j = q_j u_j^{1/\beta - 1} = q_j^{\beta} p_j^{1-\beta} = -\partial p_j/\partial\tau`;
        all three are exactly zero off the support (``-inf`` logits included).

        With an integer :math:`1/\beta` (α = 1.25, 1.5, 2, ...) the powers are products, and
        :math:`q` a factor when ``logq_min`` guarantees no overflow: every iterate τ lies at or above
        :math:`\theta_j - E(q_j)` (the lower bound), where :math:`p_j \le 1`, i.e.
        :math:`u_j^{1/\beta} \le 1/q_j \le e^{-\text{logq\_min}}`.
        Otherwise :math:`p = \exp(\log q + \log(u)/\beta)` with the exponent floored near the log of
        the smallest normal number: ``exp`` is several times slower on inputs whose result is
        subnormal or zero (most entries of a wide problem); the floor changes an active
        :math:`p_j` by less than that number, and inactive entries are set to exactly 0.
        """
        t = self._t(tau).clamp_min_(-1.0)
        power = self.int_power
        if power is not None:
            u = t.add_(1.0)
            w = (u > 0).to(u.dtype) if power == 1 else _int_pow(u, power - 1)  # w is u when power == 2
            if self.q is not None:
                w = w * self.q
            return w * u, w, u
        e = torch.log1p(t).mul_(self.r_e)
        if self.logq is not None:
            e += self.logq
        p = e.clamp_min_(_LOG_TINY[e.dtype]).exp_().masked_fill_(t == -1.0, 0.0)
        u = t.add_(1.0)
        w = torch.div(p, u).nan_to_num_(nan=0.0, posinf=math.inf)
        return p, w, u

    def mass_slope(self, tau: Tensor) -> tuple[Tensor, Tensor]:
        r"""Mass :math:`M(\tau) = \sum_j p_j` and slope :math:`-M'(\tau) = \sum_j w_j` per row."""
        p, w, _ = self.support(tau)
        return self.entries.rowsum(p), self.entries.rowsum(w)

    def loss_terms(self, tau: Tensor, theta_y: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        r"""Mass, slope, :math:`\sum_j p_j(\theta_j - \theta_y)` and the support size per row.

        With the unnormalised p; the inner sum divided by the mass is the normalised one.
        """
        p, w, _ = self.support(tau)
        on = p > 0
        spread = torch.where(on, self.theta - self.entries.per_entry(theta_y), 0.0)
        rowsum = self.entries.rowsum
        return rowsum(p), rowsum(w), rowsum(p * spread), rowsum(on.to(p.dtype))

    def to(self, dtype: torch.dtype) -> _Problem:
        """The same problem with its arithmetic in ``dtype`` (the entry layout shared)."""
        logq = None if self.logq is None else self.logq.to(dtype)
        return _Problem(self.entries, self.theta.to(dtype), logq, self.beta.to(dtype), self.beta_scalar)

    def select(self, keep: Tensor) -> _Problem:
        """The flat problem restricted to the entries where ``keep`` holds."""
        idx = keep.nonzero().squeeze(1)
        new = copy.copy(self)
        new.entries = self.entries.select(idx)
        new.theta, new.btheta = self.theta.index_select(0, idx), self.btheta.index_select(0, idx)
        if self.logq is not None:
            new.logq = self.logq.index_select(0, idx)
        if self.q is not None:
            new.q = self.q.index_select(0, idx)
        if isinstance(self.beta_e, Tensor) and isinstance(self.r_e, Tensor):
            new.beta_e, new.r_e = self.beta_e.index_select(0, idx), self.r_e.index_select(0, idx)
        return new

    def shrunk(self, tau: Tensor) -> tuple[_Problem, Tensor | None]:
        """Entries active at ``tau`` (hence at every larger τ); ``(self, None)`` if that saves little."""
        if not self.entries.is_flat:
            return self, None
        keep = self.active(tau)
        if int(keep.sum()) > _SHRINK_FRACTION * keep.numel():
            return self, None
        return self.select(keep), keep


def _lower_bound(problem: _Problem, axis: ClassAxis = ONE_PROCESS) -> Tensor:
    r"""Per-row :math:`\tau_{lo} = \max_j[\theta_j - E(q_j)]`: every :math:`p_j \le 1`, mass :math:`\ge 1`."""
    bound = problem.theta
    if problem.logq is not None:  # (−inf logits: −inf − inf = −inf)
        slack = _bound_slack(bound.abs(), problem.logq, problem.beta_e)
        bound = bound - _offset(problem.logq, problem.beta_e) - slack
    (lo,) = axis.max_(problem.entries.rowmax(bound))
    return lo


def _upper_bound(problem: _Problem, axis: ClassAxis = ONE_PROCESS) -> Tensor:
    r"""Per-row :math:`\tau_{hi} = \max_j\theta_j - E(\sum_j q_j)` over finite logits (mass :math:`\le 1`).

    Any total measure at least :math:`\sum_j q_j` gives a valid bound.
    """
    entries, theta = problem.entries, problem.theta
    finite = theta > -math.inf
    (top_theta,) = axis.max_(entries.rowmax(theta))
    if problem.logq is None:
        (total,) = axis.sum_(entries.rowsum(finite.to(theta.dtype)))
        log_total = total.log()
    else:
        logq = problem.logq.masked_fill(~finite, -math.inf)
        (top,) = axis.max_(entries.rowmax(logq))
        (total,) = axis.sum_(entries.rowsum((logq - entries.per_entry(top)).exp()))
        log_total = top + total.log()
        hi = top_theta - _offset(log_total, problem.beta)
        return hi + _bound_slack(top_theta.abs(), log_total, problem.beta)
    return top_theta - _offset(log_total, problem.beta)


def _newton_step(mass: Tensor, slope: Tensor, beta: Tensor) -> Tensor:
    r"""Newton step for :math:`h(\tau) = (M^\beta - 1)/\beta`: :math:`M(1 - M^{-\beta}) / (\beta \sum w)`."""
    return mass * (-torch.expm1(-beta * mass.log()) / beta) / slope


class _Stats(NamedTuple):
    r"""Row sums at an iterate, over every class of the axis.

    ``inner`` (:math:`\sum_j p_j(\theta_j - \theta_y)`, unnormalised p) and ``support`` (the
    number of active entries) are there only when the Newton evaluations carried the loss terms.
    """

    mass: Tensor
    slope: Tensor
    inner: Tensor | None = None
    support: Tensor | None = None


def _find_tau(
    problem: _Problem,
    lo: Tensor,
    hi: Tensor,
    *,
    hybrid: bool,
    max_iter: int | None = None,
    trace: list[Tensor] | None = None,
    axis: ClassAxis = ONE_PROCESS,
    theta_y: Tensor | None = None,
) -> tuple[Tensor, _Problem, Tensor, _Stats]:
    r"""Safeguarded Newton for :math:`M(\tau) = 1` per row, started at the lower bound ``lo``.

    Newton on :math:`h = (M^\beta - 1)/\beta` inside the bracket ``[lo, hi]`` (updated from the
    sign of :math:`M - 1` at every iterate); a point outside the bracket is replaced by the
    midpoint. For α ≤ 2 that never happens in exact arithmetic (h is convex and decreasing, the
    iterates rise monotonically to the root). ``hybrid`` (some row has ``α > 2``, where h is only
    piecewise concave) adds the progress test of Numerical Recipes' ``rtsafe`` for those rows:
    bisect when the Newton step is not below half the step before last. Converged rows freeze.

    Flat candidate sets shrink as the lower end of the bracket rises: entries inactive at a
    τ with mass ≥ 1 stay inactive at the root. For α ≤ 2 the first Newton iterate is a lower
    bound (convexity), so the set is filtered there *before* evaluating it, and the filter is
    kept for the rows where the evaluation confirms mass ≥ 1 (others get their entries back).

    Each evaluation of the mass and slope is one SUM reduction over the class ``axis``. On a
    partitioned axis it also carries the number of unconverged rows (every process leaves the
    loop at the same iteration) and, with ``theta_y``, the loss terms :class:`_Stats` ``inner``
    and ``support`` (the loss then needs no further reduction); every decision that changes
    which reductions follow depends on reduced values only.

    Host syncs: the shrink decisions and the scheduled convergence checks, not every iteration.
    ``trace`` (a list) receives the per-row "converged" flags after every iteration. Returns the
    root, the (possibly shrunk) problem, the final lower bracket (mass ≥ 1 verified there) and
    the row sums at the root.
    """
    beta = problem.beta
    eps = torch.finfo(lo.dtype).eps
    if max_iter is None:
        max_iter = 100 if lo.dtype != torch.float64 else 200
    tol = _TOL_ULPS * eps
    slow_rows = beta > 1
    partitioned = axis.partitioned

    def evaluate(problem: _Problem, x: Tensor, done: Tensor) -> tuple[_Stats, Tensor | None]:
        parts = problem.mass_slope(x) if theta_y is None else problem.loss_terms(x, theta_y)
        if not partitioned:
            return _Stats(*parts), None
        *parts, pending = axis.sum_(*parts, (~done).sum().to(parts[0].dtype).reshape(1))
        return _Stats(*parts), pending

    x = lo
    done = torch.zeros_like(lo, dtype=torch.bool)
    stats, pending = evaluate(problem, x, done)
    dx = dx_old = hi - lo  # the last two steps (rtsafe's progress test)
    for it in range(1, max_iter + 1):
        step = _newton_step(stats.mass, stats.slope, beta)
        proposal = x + step
        bisect = ~((proposal >= lo) & (proposal <= hi))
        if hybrid:
            bisect |= slow_rows & (step.abs() > 0.5 * dx_old)
        proposal = torch.where(bisect, 0.5 * (lo + hi), proposal)
        scale = 1.0 + x.abs()
        converged = ((step.abs() <= tol * scale) & ~bisect) | (hi - lo <= tol * scale)
        done = done | converged
        if hybrid:
            dx_old, dx = dx, torch.where(done, dx, (proposal - x).abs())
        x = torch.where(done, x, proposal)
        if it == 1 and not hybrid:
            full = problem
            problem, keep = full.shrunk(x)
            stats, pending = evaluate(problem, x, done)
            if keep is not None or partitioned:  # (every process evaluates again, or none)
                unconfirmed = (stats.mass < 1) & ~done
                if bool(unconfirmed.any()):
                    if keep is not None:
                        problem = full.select(keep | full.entries.per_entry(unconfirmed))
                    stats, pending = evaluate(problem, x, done)
        else:
            if it == 2 or (hybrid and it == 3):
                problem, _ = problem.shrunk(lo)
            stats, pending = evaluate(problem, x, done)
        above = stats.mass >= 1
        lo = torch.where(above & ~done, x, lo)
        hi = torch.where(~above & ~done, x, hi)
        if trace is not None:
            trace.append(done.clone())
        check = it >= _FIRST_CHECK and (it - _FIRST_CHECK) % _CHECK_EVERY == 0
        if check and (float(pending) == 0 if pending is not None else bool(done.all())):
            break
    return x, problem, lo, stats
