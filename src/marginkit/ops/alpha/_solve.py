"""Solving every row: exact candidates, the block-maxima bound, top-K with its integrity check, full rows."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from marginkit._validation import compute_dtype
from marginkit.ops.alpha._candidates import (
    _Blocks,
    _Entries,
    _entry_logq,
    _label_logq_min,
    _logits,
    _padded,
    _row_bounds,
    _threshold,
)
from marginkit.ops.alpha._frame import _FRAME_LIMIT, _MAX_FRAMES, _frame_errors
from marginkit.ops.alpha._memory import _serial
from marginkit.ops.alpha._newton import _find_tau, _lower_bound, _Problem, _Stats, _upper_bound
from marginkit.ops.classes import ONE_PROCESS, ClassAxis

# A compact candidate problem wider than this fraction of the row is solved on the full row.
_DENSE_FRACTION = 0.5
# Flat candidates are laid out as padded rows when that at most doubles the entries.
_PAD_FACTOR = 2.0


# Newton steps spent on the block-maxima lower bound (see _block_subset_bound).
_SUBSET_ITERATIONS = 3


class _Solution(NamedTuple):
    """A solved problem: τ per row and, per entry, p (normalised), w, u and the logits."""

    tau: Tensor
    p: Tensor
    w: Tensor
    u: Tensor
    theta: Tensor
    entries: _Entries
    stats: _Stats | None = None  # the row sums at τ (over every class of the axis)
    shift: Tensor | None = None  # the frame of τ and θ per row, in the units of x (set by _solve)
    p_mass: Tensor | None = None  # set: p is unnormalised, p / p_mass (per row) is the distribution

    def to_flat(self) -> _Solution:
        """The flat layout; ``-inf`` entries (padding of a padded layout, masked classes) dropped."""
        if self.entries.is_flat:
            return self
        entries = self.entries.to_flat(self.tau.device)
        fields = [f.reshape(-1) for f in (self.p, self.w, self.u, self.theta)]
        keep = fields[3] > -math.inf
        if not bool(keep.all()):
            idx = keep.nonzero().squeeze(1)
            entries = entries.select(idx)
            fields = [f.index_select(0, idx) for f in fields]
        return _Solution(self.tau, *fields, entries)


def _solve_problem(
    problem: _Problem,
    lo: Tensor | None = None,
    hi: Tensor | None = None,
    *,
    axis: ClassAxis = ONE_PROCESS,
    theta_y: Tensor | None = None,
) -> _Solution:
    """Solve a compact problem (bounds computed from it unless given).

    ``theta_y``: the label logits, for a loss; on a partitioned ``axis`` its terms then travel
    with the Newton evaluations (``_Solution.stats``).
    """
    lo = _lower_bound(problem, axis) if lo is None else lo
    hi = torch.maximum(_upper_bound(problem, axis) if hi is None else hi, lo)
    scalar = problem.beta_scalar
    hybrid = scalar > 1 if scalar is not None else bool((problem.beta > 1).any())
    fused = theta_y if axis.partitioned else None
    with _serial(problem.theta.numel(), problem.theta.device):
        tau, problem, _, stats = _find_tau(problem, lo, hi, hybrid=hybrid, axis=axis, theta_y=fused)
        dtype = tau.dtype
        if hybrid and dtype != torch.float64:
            tau, problem, stats = _refined(problem, tau, lo, hi, axis, fused)
        p, w, u = problem.support(tau)
        entries = problem.entries
        p = p / entries.per_entry(stats.mass)  # the mass at τ: the last evaluation's
    if tau.dtype != dtype:
        p, w, u, tau = p.to(dtype), w.to(dtype), u.to(dtype), tau.to(dtype)
        stats = _Stats(*(None if v is None else v.to(dtype) for v in stats))
    return _Solution(tau, p, w, u, problem.theta.to(dtype), entries, stats)


# The float64 refinement of α > 2 searches within this many float32 ulps of the float32 root.
_REFINE_ULPS = 64.0


def _refined(
    problem: _Problem, tau: Tensor, lo: Tensor, hi: Tensor, axis: ClassAxis, theta_y: Tensor | None
) -> tuple[Tensor, _Problem, _Stats]:
    r"""The root again in float64, from the float32 root, on the (shrunk) entries of the float32 solve.

    For α > 2 the probabilities :math:`p_j = q_j u_j^{1/\beta}` are ill-conditioned in τ near the
    edge of the support (:math:`\partial p_j/\partial\tau = -w_j`, :math:`w_j \propto
    u_j^{1/\beta - 1}` unbounded as :math:`u_j \to 0`), although they are well-conditioned in θ:
    a τ accurate to float32's resolution can leave a small active :math:`p_j` wrong in its second
    digit. A few float64 Newton steps on the candidates (the support plus a few) restore it; the
    solution is rounded back to float32. The bracket is the float32 one narrowed to
    ``_REFINE_ULPS`` ulps around the float32 root.
    """
    f64 = torch.float64
    eps = torch.finfo(tau.dtype).eps
    width = _REFINE_ULPS * eps * (1.0 + tau.abs())
    lo64 = torch.maximum(lo, tau - width).to(f64)
    hi64 = torch.maximum(torch.minimum(hi, tau + width), tau).to(f64)
    problem64 = problem.to(f64)
    fused = None if theta_y is None else theta_y.to(f64)
    tau64, problem64, _, stats = _find_tau(problem64, lo64, hi64, hybrid=True, axis=axis, theta_y=fused)
    return tau64, problem64, stats


class _PlusLabel:
    """A dense q ≡ 1 problem plus one entry per row with its own ``log q`` (duck-types ``_Problem``)."""

    def __init__(self, base: _Problem, label: _Problem) -> None:
        self.base, self.label = base, label
        self.beta, self.entries = base.beta, base.entries

    def mass_slope(self, tau: Tensor) -> tuple[Tensor, Tensor]:
        mass, slope = self.base.mass_slope(tau)
        mass_y, slope_y = self.label.mass_slope(tau)
        return mass + mass_y, slope + slope_y

    def shrunk(self, tau: Tensor) -> tuple[_PlusLabel, None]:
        return self, None


def _block_subset_bound(
    blocks: _Blocks,
    x: Tensor,
    scale: float,
    beta: Tensor,
    beta_scalar: float | None,
    label: Tensor | None,
    logq_label: Tensor | None,
    lo: Tensor,
    hi: Tensor | None,
    shift: Tensor | None = None,
) -> Tensor:
    r"""A tighter lower bound on τ: a verified Newton iterate of the problem on the block maxima.

    The block maxima are a subset of the row's logits with :math:`q_j = 1`; with the label
    override, the label is taken out of its block (the block keeps the maximum of its other
    columns) and added as one more entry with its own :math:`q_y`. The restricted mass is at most
    the full mass at every τ, so any τ where it is :math:`\ge 1` is a lower bound of the full
    root; it is close to the root when the support is spread over many blocks (exactly when
    :math:`\tau_{lo}` is loose). A few Newton steps on the dense ``[N, n/_BLOCK]`` maxima from
    ``lo`` (which is also the subset's own lower bound) suffice: the lower end of the bracket only
    moves to iterates whose mass was verified to be :math:`\ge 1`. In the frame of ``shift``.
    """
    if hi is None:
        return lo  # a general label weight: no cheap upper bound to safeguard the steps
    n_rows = x.shape[0]
    with_label = label is not None and logq_label is not None
    bmax = blocks.bmax_excluding if with_label else blocks.bmax
    cdt = compute_dtype(bmax.dtype)
    problem: _Problem | _PlusLabel
    row_shift = None if shift is None else shift.unsqueeze(1)
    problem = _Problem(
        _Entries(n_rows, bmax.shape[1]), _logits(bmax, row_shift, scale, cdt), None, beta, beta_scalar
    )
    if with_label:
        assert label is not None and logq_label is not None
        theta_y = _logits(x.gather(1, label.unsqueeze(1)), row_shift, scale, cdt)
        logq_y = logq_label.to(cdt).unsqueeze(1)
        problem = _PlusLabel(problem, _Problem(_Entries(n_rows, 1), theta_y, logq_y, beta, beta_scalar))
    hybrid = beta_scalar > 1 if beta_scalar is not None else bool((beta > 1).any())
    _, _, verified, _ = _find_tau(
        problem, lo, torch.maximum(hi, lo), hybrid=hybrid, max_iter=_SUBSET_ITERATIONS
    )
    return verified


class _Rows(NamedTuple):
    """The rows to solve: scores ``x`` ``[N, n]`` (θ = scale·(x − shift)), β per row, q (:func:`_solve`)."""

    x: Tensor
    scale: float
    beta: Tensor
    beta_scalar: float | None
    logq: Tensor | None
    label: Tensor | None
    logq_label: Tensor | None
    shift: Tensor | None = None


def _solve_candidates(
    rows: _Rows,
    blocks: _Blocks,
    k: int | None = None,
    *,
    bounds: tuple[Tensor, Tensor | None] | None = None,
    axis: ClassAxis = ONE_PROCESS,
    theta_y: Tensor | None = None,
) -> _Solution | None:
    """Exact solve on the candidates ``θ_j > τ_lo − 1/β`` (flat, or padded rows when compact enough).

    With ``k``: ``None`` (nothing solved) when some row has more than ``k`` candidates, the
    caller then restricts to the top ``k``; otherwise the candidates are already a subset of each
    row's top ``k`` and their solution is the top-``k`` one. ``bounds``: ``(τ_lo, τ_hi)`` over
    every class of ``axis`` (default: :func:`_row_bounds` of one process). The block-maxima
    bound, a per-process decision, is skipped on a partitioned axis.
    """
    x, scale, beta, beta_scalar, logq, label, logq_label, shift = rows
    n_rows, n = x.shape
    cdt = compute_dtype(x.dtype)
    # without a dense measure everything up to the candidate gather acts on [N] or the block maxima
    with _serial(blocks.bmax.numel() if logq is None else x.numel(), x.device):
        lo, hi = (
            _row_bounds(x, blocks, scale, beta, cdt, logq, label, logq_label, shift)
            if bounds is None
            else bounds
        )
        thr = _threshold(lo, beta, scale, shift)
        if logq is None and not axis.partitioned and not blocks.sparse(thr):
            lo = _block_subset_bound(blocks, x, scale, beta, beta_scalar, label, logq_label, lo, hi, shift)
            thr = _threshold(lo, beta, scale, shift)
    flat = blocks.above(thr)
    if flat.numel() > _DENSE_FRACTION * x.numel():
        if k is not None:
            return None
        return _solve_dense(*rows, bounds=(lo, hi), axis=axis, theta_y=theta_y)
    with _serial(flat.numel(), x.device):
        entries = _Entries(n_rows, n, flat=flat)
        assert entries.counts is not None and entries.row is not None
        widest = int(entries.counts.max()) if n_rows else 0
        if k is not None and widest > k:
            return None
        theta = x.reshape(-1).index_select(0, flat).to(cdt)
        if shift is not None:
            theta = theta.sub_(entries.per_entry(shift.to(cdt)))
        if scale != 1.0:
            theta = theta.mul_(scale)
        if n_rows * widest <= _PAD_FACTOR * flat.numel():
            entries, theta = _padded(entries, theta, widest)
        lq = _entry_logq(entries, cdt, logq, label, logq_label)
        problem = _Problem(entries, theta, lq, beta, beta_scalar, _label_logq_min(logq, label, logq_label))
    return _solve_problem(problem, lo, hi, axis=axis, theta_y=theta_y)


def _solve_dense(
    x: Tensor,
    scale: float,
    beta: Tensor,
    beta_scalar: float | None,
    logq: Tensor | None,
    label: Tensor | None,
    logq_label: Tensor | None,
    shift: Tensor | None = None,
    *,
    bounds: tuple[Tensor, Tensor | None] | None = None,
    axis: ClassAxis = ONE_PROCESS,
    theta_y: Tensor | None = None,
) -> _Solution:
    """Solve on the full rows (candidate reduction disabled): every iteration touches ``[N, n]``."""
    cdt = compute_dtype(x.dtype)
    theta = _logits(x, None if shift is None else shift.unsqueeze(1), scale, cdt)
    entries = _Entries(x.shape[0], x.shape[1])
    lq = _entry_logq(entries, cdt, logq, label, logq_label)
    problem = _Problem(entries, theta, lq, beta, beta_scalar, _label_logq_min(logq, label, logq_label))
    lo, hi = (None, None) if bounds is None else bounds
    return _solve_problem(problem, lo, hi, axis=axis, theta_y=theta_y)


def _merge_rows(base: _Solution, rows: Tensor, sub: _Solution) -> _Solution:
    """``base`` with its ``rows`` replaced by the solution ``sub`` of those rows (flat, sorted)."""
    base, sub = base.to_flat(), sub.to_flat()
    b, s = base.entries, sub.entries
    assert b.row is not None and b.flat is not None and s.row is not None and s.flat is not None
    replaced = torch.zeros(base.tau.shape[0], dtype=torch.bool, device=rows.device)
    replaced[rows] = True
    keep = (~replaced.index_select(0, b.row)).nonzero().squeeze(1)
    sub_rows = rows.index_select(0, s.row)
    flat = torch.cat([b.flat.index_select(0, keep), sub_rows * b.n_cols + (s.flat - s.row * s.n_cols)])
    flat, order = flat.sort()
    fields = [
        torch.cat([getattr(base, f).index_select(0, keep), getattr(sub, f)]).index_select(0, order)
        for f in ("p", "w", "u", "theta")
    ]
    tau = base.tau.clone()
    tau[rows] = sub.tau
    return _Solution(tau, *fields, _Entries(b.n_rows, b.n_cols, flat=flat))


def _solve_in_frame(
    x: Tensor,
    blocks: _Blocks | None,
    *,
    scale: float,
    beta: Tensor,
    beta_scalar: float | None,
    logq: Tensor | None = None,
    label: Tensor | None = None,
    logq_label: Tensor | None = None,
    k: int | None = None,
    candidates: bool = True,
    bounds: tuple[Tensor, Tensor | None] | None = None,
    axis: ClassAxis = ONE_PROCESS,
    theta_y: Tensor | None = None,
    shift: Tensor | None = None,
) -> _Solution:
    """Solve every row of ``x`` in the frame ``shift`` (see :func:`_solve`).

    ``shift``: per row, in the units of x (``None``: 0); the row maximum over every class of the
    axis keeps the solve accurate for large logits (:func:`_logits`). ``bounds``, ``theta_y`` and
    the solution's τ are in its frame. ``bounds``, ``axis``, ``theta_y``: as in
    :func:`_solve_candidates`. The top-``k`` restriction decides per process which rows to solve
    again: one process only (``axis`` not partitioned).
    """
    n_rows, n = x.shape
    rows = _Rows(x, scale, beta, beta_scalar, logq, label, logq_label, shift)
    if k is not None and k < n:
        if axis.partitioned:
            raise ValueError("topk needs every class of a row in one process (not a partitioned class axis)")
        if candidates:  # the exact candidates, when no row has more than k, are the answer
            blocks = _Blocks(x) if blocks is None else blocks
            sol = _solve_candidates(rows, blocks, k, bounds=bounds)
            if sol is not None:
                return sol
        cdt = compute_dtype(x.dtype)
        vals, idx = x.topk(k, dim=-1)
        theta = _logits(vals, None if shift is None else shift.unsqueeze(1), scale, cdt)
        entries = _Entries(n_rows, n, col=idx)
        lq = _entry_logq(entries, cdt, logq, label, logq_label)
        problem = _Problem(entries, theta, lq, beta, beta_scalar, _label_logq_min(logq, label, logq_label))
        sol = _solve_problem(problem)
        # Integrity check: the smallest kept logit must be inactive at the kept-set root.
        exact = problem.btheta[:, -1] - beta * sol.tau <= -1
        bad = (~exact).nonzero().squeeze(1)
        if bad.numel() == 0:
            return sol
        sub = _solve_in_frame(
            x[bad],
            None,
            scale=scale,
            beta=beta[bad],
            beta_scalar=beta_scalar,
            logq=None if logq is None else logq[bad],
            label=None if label is None else label[bad],
            logq_label=None if logq_label is None else logq_label[bad],
            candidates=candidates,
            shift=None if shift is None else shift[bad],
        )
        return _merge_rows(sol, bad, sub)
    if candidates:
        blocks = _Blocks(x) if blocks is None else blocks
        sol = _solve_candidates(rows, blocks, bounds=bounds, axis=axis, theta_y=theta_y)
        assert sol is not None
        return sol
    return _solve_dense(*rows, bounds=bounds, axis=axis, theta_y=theta_y)


def _solve(x: Tensor, blocks: _Blocks | None, **kw: Any) -> _Solution:
    """Solve every row of ``x`` (``[N, n]``; θ = scale·(x − shift); q from ``logq`` or the label override).

    ``shift``: per row, in the units of x (``None``: 0), the solver's frame; the row maximum over
    every class of the axis keeps the solve accurate for large logits (:func:`_logits`). ``bounds``,
    ``theta_y`` and the solution's τ are in its frame. ``bounds``, ``axis``, ``theta_y``: as in
    :func:`_solve_candidates`. The top-``k`` restriction decides per process which rows to solve
    again: one process only (``axis`` not partitioned).

    With a general measure ``logq`` (normalised to a row maximum of 0) the rows whose frame
    cannot resolve τ (``_frame``) are solved again in the frame of the logit of their most
    weighted possibly active entry; the solution's ``shift`` is the frame of every row. A row
    still unresolved after ``_MAX_FRAMES`` frames is refused with a clear error. The keyword
    arguments are :func:`_solve_in_frame`'s.
    """
    sol = _solve_in_frame(x, blocks, **kw)
    if kw.get("logq") is None or kw.get("axis", ONE_PROCESS).partitioned or x.shape[0] == 0:
        return sol._replace(shift=kw.get("shift"))
    return _reframed(sol, x, blocks, **kw)


def _reframed(
    sol: _Solution,
    x: Tensor,
    blocks: _Blocks | None,
    *,
    scale: float,
    beta: Tensor,
    beta_scalar: float | None,
    logq: Tensor,
    shift: Tensor | None = None,
    k: int | None = None,
    candidates: bool = True,
    **_: Any,
) -> _Solution:
    """Move the rows whose frame cannot resolve τ to a better one and solve them again (``_frame``)."""
    frame = x.new_zeros(x.shape[0]) if shift is None else shift.to(x.dtype)
    todo: Tensor | None = None  # the rows being moved (None: every row, at the first check)
    sub = sol
    for attempt in range(_MAX_FRAMES + 1):
        if todo is None:
            rows = (x, _Blocks(x) if blocks is None else blocks, beta, logq, frame)
        else:
            xs = x.index_select(0, todo)
            rows = (xs, _Blocks(xs), *(t.index_select(0, todo) for t in (beta, logq, frame)))
        error, anchor = _frame_errors(rows[0], rows[1], scale, *rows[2:], sub.tau)
        bad = (error > _FRAME_LIMIT).nonzero().squeeze(1)
        if bad.numel() == 0:
            return sol._replace(shift=frame)
        if attempt == _MAX_FRAMES:
            break
        todo = bad if todo is None else todo.index_select(0, bad)
        xs = x.index_select(0, todo)
        moved = xs.gather(1, anchor.index_select(0, bad).unsqueeze(1)).squeeze(1)
        sub = _solve_in_frame(
            xs, None, scale=scale, beta=beta.index_select(0, todo), beta_scalar=beta_scalar,
            logq=logq.index_select(0, todo), k=k, candidates=candidates, shift=moved,
        )  # fmt: skip
        sol = _merge_rows(sol, todo, sub)
        frame = frame.index_put((todo,), moved)
    raise ValueError(
        "q spans too many orders of magnitude for the logits' precision: no frame resolves the threshold "
        f"of {bad.numel()} row(s) of alpha_softargmax (largest frame error "
        f"{float(error.max()):.3g} eps/(alpha - 1)); compute in float64 or narrow the range of q"
    )
