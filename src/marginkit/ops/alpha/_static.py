r"""The alpha solver with shapes fixed by the input's shape: no host read, a data-independent op count.

For a measure that is 1 except at the label (``q ≡ 1``: entmax / sparsemax; Q-Margin's
:math:`q_y = e^{-sm}`), every row is solved as follows (SPEC §2; issue 36):

1. **Candidates with fixed-size outputs.** The exact filter :math:`\theta_j > \tau_{lo} - 1/\beta` is
   applied to the 64-column block maxima, then to the values of the selected blocks, each time
   with ``torch.nonzero_static``: the positions come out sorted in a buffer of a size fixed in
   advance (a *budget* over the whole batch, so rows with many candidates borrow from rows with
   few), the unused tail marked as padding (an inactive :math:`-\infty` logit). When the budget
   would cover the whole matrix the rows are solved in full instead.
2. **A fixed number of Newton steps** from :math:`\tau_{lo}` (mass :math:`\ge 1`): for
   :math:`1 < \alpha \le 2` the mass is convex and decreasing in τ, so Newton on
   :math:`h = (M^\beta - 1)/\beta` rises monotonically to the root and converges quadratically
   near it; ``_ITERATIONS`` is measured per dtype and band of α with margin. For α > 2 (or a
   per-row α, which may be) the safeguarded Newton–bisection of
   :func:`marginkit.ops.alpha._newton._find_tau` runs a fixed number of rounds, and in float32 a
   float64 refinement follows.
3. **Exactness verified on the device**: the result is exact when the candidates fitted their
   budgets (then they contain the support) and the Newton step at the final iterate is within a
   few ulps (the root converged in the working precision). :func:`_solve_static` returns that
   flag (0-d, ``True`` = not exact); the caller reads it now (a library call: the exact
   host-driven solver then redoes the batch) or defers it (:func:`marginkit._validation.deferred_checks`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from marginkit._validation import active_checks, compute_dtype
from marginkit.ops.alpha._candidates import (
    _BLOCK,
    _BLOCK_BITS,
    _Blocks,
    _Entries,
    _entry_logq,
    _logits,
    _row_bounds,
    _threshold,
)
from marginkit.ops.alpha._memory import _serial
from marginkit.ops.alpha._newton import _int_pow, _integer_power, _newton_step, _Problem, _Stats
from marginkit.ops.alpha._solve import _Solution
from marginkit.ops.classes import ONE_PROCESS, ClassAxis

# Candidate entries per row of the batch, on average (the budget is shared by the rows): ROW_BUDGET;
# inside deferred_checks(), where an overflow cannot be redone, also 1/ROW_FRACTION of the classes
# beyond 512·256 classes. The live classes of a row grow with the class count (measured on 10^6
# classes, D = 512, α = 1.25 and 1.5: up to 1,460 candidates per row on average at a random start,
# 1,760 at 2·10^6, where 512 overflowed); a library call redoes an overflowing batch exactly and keeps
# the smaller budget, cheaper where it suffices (at 10^6 classes and D = 128 on the CPU the wider one
# cost 20-25 % more per call).
ROW_BUDGET = 512
ROW_FRACTION = 256
# Candidate blocks (of _BLOCK columns) per row, on average (candidates of a row scatter: one block each).
BLOCK_BUDGET = 512
# Newton steps from τ_lo for 1 < α <= 2 on full rows (no candidate filter: a budget that would cover
# the matrix, C <= 512 by default), by band of β = α − 1 as the lean solver's (_lean_iterations).
# Measured worst cases (benchmarks/_lean_iterations.py --full-rows: 60 random batches per band, 64 rows
# of 10 to 500 classes, and 60 more with embeddings of 8 to 128 dimensions), float32 /
# float64: α < 1.5: 5 / 6; α <= 1.75: 6 / 8; α <= 1.9: 6 / 8; α < 2: 9 / 10. The table: that + 1, at
# least the former 6 / 8 (it gave every α those: the batches near α = 2 that needed more stopped a
# training run); sparsemax's steps above 1.9.
_ITERATIONS = {torch.float32: (6, 7, 7), torch.float64: (8, 9, 9)}  # β < 0.5, β <= 0.75, β <= 0.9
# α = 2 (sparsemax): the mass is piecewise linear, Newton crosses one kink per step (9 measured
# for 2·10^4 near-equal logits in float32).
_SPARSEMAX_ITERATIONS = {torch.float32: 12, torch.float64: 14}
# Safeguarded rounds for α > 2 or a per-row α (measured worst: 20 / 30 at α = 4).
_HYBRID_ITERATIONS = {torch.float32: 32, torch.float64: 48}
# Rounds of the float64 refinement of an α > 2 float32 root (a bracket of 128 float32 ulps).
_REFINE_ITERATIONS = 40
# The root is converged when the next Newton step is at most this many ulps of (1 + |τ|).
_CONVERGED_ULPS = 16.0


def budgets(n_rows: int, n: int, k: int | None) -> tuple[int, int]:
    """``(candidate entries, candidate blocks)`` of a batch of ``n`` classes: per row ``k``, by default
    ``ROW_BUDGET`` entries — ``max(ROW_BUDGET, ⌈n / ROW_FRACTION⌉)`` inside
    :func:`~marginkit._validation.deferred_checks` — and as many blocks (at least ``BLOCK_BUDGET``)."""
    if k is None:
        wide = active_checks() is not None
        per_row = min(n, max(ROW_BUDGET, -(-n // ROW_FRACTION)) if wide else ROW_BUDGET)
        blocks_per_row = max(BLOCK_BUDGET, per_row)
    else:
        per_row, blocks_per_row = min(n, k), max(1, k)
    n_blocks = -(-n // _BLOCK)
    return n_rows * per_row, n_rows * min(n_blocks, blocks_per_row)


def _candidates(
    x: Tensor,
    blocks: _Blocks,
    thr: Tensor,
    shift: Tensor | None,
    scale: float,
    cdt: torch.dtype,
    k: int | None,
) -> tuple[_Entries, Tensor, Tensor] | None:
    """Entries ``x[i, j] > thr[i]`` in fixed-size buffers: ``(entries, θ, overflow)``, or ``None``
    when the budget would hold every entry (the caller solves the full rows).

    Padding entries sit at the last position of the matrix with a ``-inf`` logit (sorted order
    kept); ``overflow`` (0-d bool) is true when some candidate did not fit.
    """
    n_rows, n = x.shape
    size, block_size = budgets(n_rows, n, k)
    if size >= x.numel():
        return None
    last = x.numel() - 1
    if block_size * _BLOCK >= x.numel():  # the blocks would be the whole matrix: filter it directly
        mask = (x > thr.unsqueeze(1)).view(-1)
        overflow = mask.sum() > size
        pos = torch.nonzero_static(mask, size=size, fill_value=-1).squeeze(1)
        valid = pos >= 0
        flat = torch.where(valid, pos, last)
    else:
        bmax = blocks.bmax
        n_blocks = bmax.shape[1]
        selected = (bmax > thr.unsqueeze(1)).view(-1)
        picked = torch.nonzero_static(selected, size=block_size, fill_value=-1).squeeze(1)
        real_block = picked >= 0
        picked = picked.clamp_min(0)
        bi = torch.div(picked, n_blocks, rounding_mode="floor")
        bj = picked - bi * n_blocks
        values = blocks._values(bi, bj)
        thr_b = torch.where(real_block, thr.index_select(0, bi), math.inf)
        mask = (values > thr_b.unsqueeze(1)).view(-1)
        overflow = (selected.sum() > block_size) | (mask.sum() > size)
        pos = torch.nonzero_static(mask, size=size, fill_value=-1).squeeze(1)
        valid = pos >= 0
        block = torch.bitwise_right_shift(pos.clamp_min(0), _BLOCK_BITS)
        start = bi.index_select(0, block) * n + bj.index_select(0, block) * _BLOCK
        flat = torch.where(valid, start + torch.bitwise_and(pos, _BLOCK - 1), last)
    entries = _Entries(n_rows, n, flat=flat)
    theta = _logits(
        x.view(-1).index_select(0, flat), None if shift is None else entries.per_entry(shift), scale, cdt
    )
    return entries, theta.masked_fill_(~valid, -math.inf), overflow


# Newton steps of the block-maxima lower bound (see _subset_bound).
_SUBSET_ITERATIONS = 2


def _subset_bound(
    blocks: _Blocks,
    x: Tensor,
    scale: float,
    beta: Tensor,
    beta_scalar: float | None,
    label: Tensor | None,
    logq_label: Tensor | None,
    lo: Tensor,
    hi: Tensor,
    shift: Tensor | None,
    logq_label_min: float,
) -> Tensor:
    r"""A tighter lower bound on τ for 1 < α <= 2: Newton on the problem restricted to the block maxima.

    The block maxima (with the label override: the label out of its block, plus the label as
    one more entry with its own :math:`q_y`) are a subset of the row with the same weights, so
    their mass is at most the full mass at every τ and their root is at most the full root;
    Newton from ``lo`` rises monotonically towards it. The last iterate is kept where its mass
    was verified :math:`\ge 1` (``lo`` elsewhere). It is close to the full root when the support
    is spread over many blocks, exactly when :math:`\tau_{lo}` is loose (the start of training).
    (:func:`marginkit.ops.alpha._solve._block_subset_bound` is the host-driven solver's version.)
    """
    n_rows = x.shape[0]
    cdt = compute_dtype(x.dtype)
    row_shift = None if shift is None else shift.unsqueeze(1)
    with_label = label is not None and logq_label is not None
    if with_label:
        assert label is not None and logq_label is not None
        bmax = getattr(blocks, "bmax_excluding", None)
        if bmax is None:
            blocks.max_excluding(label)
            bmax = blocks.bmax_excluding
    else:
        bmax = blocks.bmax
    logq = None
    if with_label:  # the label as one more column, with its own q
        assert label is not None and logq_label is not None
        bmax = torch.cat([bmax, x.gather(1, label.unsqueeze(1))], 1)
        logq = torch.cat([torch.zeros_like(bmax[:, 1:], dtype=cdt), logq_label.to(cdt).unsqueeze(1)], 1)
    del hi
    assert beta_scalar is not None
    theta = _logits(bmax, row_shift, scale, cdt)
    base = _Problem(_Entries(n_rows, bmax.shape[1]), theta, logq, beta, beta_scalar, logq_label_min)
    tau, mass, _, _, _ = _lean_newton(_Lean(base), lo, beta_scalar, _SUBSET_ITERATIONS)
    return torch.where(mass >= 1, tau, lo)


class _Lean:
    r"""The evaluations of a compact problem for a scalar β, in the scaled variable :math:`z = \beta\tau`.

    :math:`u_j = [a_j - z]_+` with :math:`a_j = 1 + \beta\theta_j` precomputed: per evaluation
    one broadcast, one subtraction and a clamp before the powers (a Newton step of
    :func:`_newton_static` costs about fourteen ops).
    """

    def __init__(self, problem: _Problem) -> None:
        assert problem.beta_scalar is not None
        self.problem, self.entries = problem, problem.entries
        self.a = problem.btheta + 1.0

    def support(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(p, w, u)`` per entry at ``z`` (unnormalised p; as :meth:`_Problem.support`)."""
        pr = self.problem
        u = (self.a - self.entries.per_entry(z)).clamp_min_(0.0)
        power = pr.int_power
        if power is not None:
            w = (u > 0).to(u.dtype) if power == 1 else _int_pow(u, power - 1)
            if pr.q is not None:
                w = w * pr.q
            return w * u, w, u
        return pr.support(z / pr.beta_scalar)  # (general powers: the exp/log form)


def _lean_newton(
    lean: _Lean, lo: Tensor, beta: float, iterations: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Plain Newton steps for 1 < α <= 2 and a scalar β from ``lo``.

    Returns ``(τ, mass, slope, converged, (p, w, u))``, the last at τ (unnormalised p).
    """
    tol = _CONVERGED_ULPS * torch.finfo(lo.dtype).eps
    rowsum = lean.entries.rowsum

    def step(mass: Tensor, slope: Tensor) -> Tensor:  # β·(Newton step of h = (M^β − 1)/β)
        return torch.expm1(mass.log().mul_(-beta)).mul_(mass).div_(slope)

    z = lo * beta
    for it in range(iterations + 1):
        support = lean.support(z)
        mass, slope = rowsum(support[0]), rowsum(support[1])
        if it < iterations:
            z = z - step(mass, slope)
    tau = z / beta
    converged = step(mass, slope).abs_() <= (tau.abs() + 1.0).mul_(tol * beta)
    return tau, mass, slope, converged, support


def _newton_static(
    problem: _Problem,
    lo: Tensor,
    hi: Tensor,
    *,
    hybrid: bool,
    iterations: int,
    axis: ClassAxis,
    theta_y: Tensor | None,
) -> tuple[Tensor, _Stats, Tensor]:
    r"""``iterations`` Newton steps from ``lo`` (safeguarded rounds when ``hybrid``); no host read.

    Returns the root, the row sums there (one SUM over ``axis`` per evaluation; with ``theta_y``
    they carry the loss terms) and the per-row "converged" flag: the next Newton step is within
    ``_CONVERGED_ULPS`` ulps of :math:`1 + |\tau|` (or, safeguarded, the bracket is that narrow).
    """
    beta = problem.beta
    tol = _CONVERGED_ULPS * torch.finfo(lo.dtype).eps

    def evaluate(x: Tensor) -> _Stats:
        parts = problem.mass_slope(x) if theta_y is None else problem.loss_terms(x, theta_y)
        return _Stats(*axis.sum_(*parts))

    x = lo
    stats = evaluate(x)
    if not hybrid:  # monotone from the left (1 < α <= 2): plain steps
        for _ in range(iterations):
            x = x + _newton_step(stats.mass, stats.slope, beta)
            stats = evaluate(x)
        step = _newton_step(stats.mass, stats.slope, beta)
        return x, stats, step.abs() <= tol * (1.0 + x.abs())
    slow_rows = beta > 1
    dx = dx_old = hi - lo  # the last two steps (rtsafe's progress test)
    done = torch.zeros_like(lo, dtype=torch.bool)
    for _ in range(iterations):  # (_find_tau's rounds, converged rows frozen, without its reads)
        step = _newton_step(stats.mass, stats.slope, beta)
        proposal = x + step
        bisect = ~((proposal >= lo) & (proposal <= hi)) | (slow_rows & (step.abs() > 0.5 * dx_old))
        proposal = torch.where(bisect, 0.5 * (lo + hi), proposal)
        width = tol * (1.0 + x.abs())
        done = done | ((step.abs() <= width) & ~bisect) | (hi - lo <= width)
        dx_old, dx = dx, torch.where(done, dx, (proposal - x).abs())
        x = torch.where(done, x, proposal)
        stats = evaluate(x)
        above = stats.mass >= 1
        lo = torch.where(above & ~done, x, lo)
        hi = torch.where(~above & ~done, x, hi)
    return x, stats, done


# The lean solver (1 < α <= 2, a scalar α, one process, the candidate filter): Newton steps on the
# candidates from one Newton step past the verified block-maxima bound, by band of β = α − 1 (the steps
# grow as the mass turns piecewise linear towards α = 2). Worst cases measured, float32 / float64:
# random batches (benchmarks/_lean_iterations.py: 50 per band, 64 rows of 10^3 to 10^5 classes, s in
# [4, 64], margins 0 to 0.4, near-uniform to one dominant class) α < 1.5: 3 / 5; α <= 1.75: 4 / 6;
# α <= 1.9: 5 / 6; α < 2: 5 / 7; rows of staircase logits x_j = −(d·j)^p, p in [1/4, 0.7], s from 3 to
# 32 (s = 2 in brackets): α <= 1.45: 4 (5) / 6 (7); α in [1.5, 1.75]: 5 (5) / 6 (7); α in [1.8, 2): 5 (6)
# / 6 (7). The table is the worst case at s >= 3 + 1, and covers s = 2 with a step to spare above
# α = 1.5; sparsemax's steps above 1.9. Sparsemax (α = 2: the mass is piecewise linear, Newton crosses
# one kink per step) keeps the margin of the near-tie cases.
_LEAN_ITERATIONS = {torch.float32: (5, 6, 7), torch.float64: (7, 8, 8)}  # β < 0.5, β <= 0.75, β <= 0.9
_LEAN_SPARSEMAX_ITERATIONS = {torch.float32: 10, torch.float64: 12}


def _band_steps(beta: float, dtype: torch.dtype, table: dict, sparsemax: dict) -> int:
    """Newton steps for ``β = α − 1 <= 1`` in ``dtype`` from a table by band of β (a number: no read)."""
    band = 0 if beta < 0.5 else 1 if beta <= 0.75 else 2 if beta <= 0.9 else None
    return sparsemax[dtype] if band is None else table[dtype][band]


def _lean_iterations(beta: float, dtype: torch.dtype) -> int:
    """The lean solver's Newton steps for ``β = α − 1`` in ``dtype``."""
    return _band_steps(beta, dtype, _LEAN_ITERATIONS, _LEAN_SPARSEMAX_ITERATIONS)


def _iterations(beta: float, dtype: torch.dtype) -> int:
    """The full-row (and partitioned) solver's Newton steps for ``β = α − 1 <= 1`` in ``dtype``."""
    return _band_steps(beta, dtype, _ITERATIONS, _SPARSEMAX_ITERATIONS)


# alpha == 1 rows of a per-row alpha tensor run through the same formulas with beta floored
# here: every beta-dependent expression is then softmax's up to a relative O(beta) = 1e-12.
_BETA_FLOOR = 1e-12


def beta_rows(beta: float, n_rows: int, cdt: torch.dtype, device: torch.device) -> Tensor:
    """A fixed ``beta`` as the per-row ``[N]`` tensor the solvers take (floored at ``_BETA_FLOOR``)."""
    return torch.full((n_rows,), max(beta, _BETA_FLOOR), dtype=cdt, device=device)


def lean_eligible(
    n_rows: int, n: int, k: int | None, beta_scalar: float | None, candidates: bool, partitioned: bool
) -> bool:
    """Does :func:`_solve_static` run the lean solver (:func:`_solve_lean`) on these rows?"""
    return (
        candidates
        and not partitioned
        and beta_scalar is not None
        and beta_scalar <= 1
        and 0 < n_rows <= n
        and budgets(n_rows, n, k)[0] < n_rows * n
    )


def _weights(u: Tensor, power: int | None, beta: float) -> Tensor:
    r""":math:`u^{1/\beta - 1}` for :math:`u \ge 0` (0 where u is 0; a new tensor unless it is ``u``)."""
    if power == 1:
        return torch.sign(u)
    if power == 2:
        return u
    if power is not None:
        return torch.pow(u, power - 1) if power <= 4 else _int_pow(u, power - 1)
    return torch.pow(u, 1.0 / beta - 1.0)


def _masses(
    a: Tensor, z_e: Tensor, q: Tensor | None, power: int | None, beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    r"""``(p, w, u)`` per entry at :math:`z = \beta\tau`.

    :math:`u = [a - z]_+`, :math:`w = q u^{1/\beta - 1}`, :math:`p = w u` (``q`` ``None``: 1).
    """
    u = (a - z_e).clamp_min_(0.0)
    w = _weights(u, power, beta)
    if q is not None:
        w = w * q if w is u else w.mul_(q)
    return w * u, w, u


def _cheap_step(z: Tensor, mass: Tensor, slope: Tensor, beta: float) -> Tensor:
    r"""The Newton iterate :math:`z + (M - M^{1-\beta})/\sum w` on :math:`h = (M^\beta - 1)/\beta`, z = βτ.

    The same step as :func:`_newton_step` with an absolute rounding error of about
    :math:`\varepsilon M / \sum w` (the subtraction cancels near the root): used where the next
    Newton step corrects it.
    """
    return torch.addcdiv(z, mass - mass.pow(1.0 - beta), slope)


def _solve_lean(
    x: Tensor,
    blocks: _Blocks,
    *,
    scale: float,
    beta_scalar: float,
    label: Tensor | None,
    logq_value: float | None,
    k: int | None,
    shift: Tensor,
    theta_y: Tensor | None,
) -> tuple[_Solution, Tensor]:
    r"""The fixed-shape solver with the fewest ops: q ≡ 1 except :math:`q_y = e^{\text{logq\_value}}`.

    In the frame of ``shift`` (the row maxima) and the variable :math:`z = \beta\tau - 1`, with
    :math:`a_j = \beta\theta_j`, :math:`u_j = [a_j - z]_+ = [1 + \beta(\theta_j - \tau)]_+`,
    :math:`p_j = q_j u_j^{1/\beta}` (the 1 moved into z: one op less per evaluation):

    1. The block maxima (the label's block left out, the label added with its :math:`q_y`) are a
       subset of the row: from their lower bound :math:`\max_j(a_j - q_j^{-\beta})` two Newton
       steps, the iterate kept where its mass is verified :math:`\ge 1` (a lower bound of the
       row's root, as :func:`_subset_bound`); one more step gives the start of step 3.
    2. The candidates :math:`\theta_j > \tau_{lo} - 1/\beta` of the whole matrix (lowered by a
       few ulps) in a buffer of the batch's budget (``torch.nonzero_static``), the unused tail a
       padding entry of a very negative logit (inactive at every τ, in the last row).
    3. :func:`_lean_iterations` Newton steps on the candidates (row sums: one segment sum each).
       The result is exact when the candidates fitted the budget and the last Newton step is
       within ``_CONVERGED_ULPS`` ulps of :math:`1 + |\tau|` once :math:`|M - 1|` is past the
       rounding of the row sum, :math:`\varepsilon k M` for k live terms (the returned 0-d flag
       is then false).

    With ``theta_y`` (and a label), the solution's ``stats`` carry the loss terms
    :math:`\sum_j p_j(\theta_j - \theta_y)` (unnormalised p) and the support size, and its ``p`` is
    left unnormalised (``p_mass`` set).
    """
    n_rows, n = x.shape
    cdt = compute_dtype(x.dtype)
    b = beta_scalar
    power = _integer_power(b)
    size = budgets(n_rows, n, k)[0]
    override = label is not None and logq_value is not None and logq_value != 0.0
    with _serial(blocks.bmax.numel(), x.device):
        shift1 = shift.unsqueeze(1)
        bmax = blocks.bmax
        if override:
            assert label is not None and logq_value is not None and theta_y is not None
            bmax = bmax.scatter(1, torch.bitwise_right_shift(label.unsqueeze(1), _BLOCK_BITS), -math.inf)
        theta_s = _logits(bmax, shift1, scale, cdt)
        q_s = None
        if override:
            assert logq_value is not None and theta_y is not None
            theta_s = torch.cat([theta_s, theta_y.to(cdt).unsqueeze(1)], 1)
            q_s = F.pad(theta_s.new_ones(theta_s.shape[1] - 1), (0, 1), value=math.exp(logq_value))
        a_s = theta_s.mul_(b)
        # every p_j <= 1 there (θ = 0 is the row maximum, with q = 1 when nothing is overridden)
        z0 = (a_s - q_s.pow(-b)).amax(1, keepdim=True) if q_s is not None else a_s.new_full((n_rows, 1), -1.0)
        z = z0
        for it in range(_SUBSET_ITERATIONS + 1):
            p, w, _ = _masses(a_s, z, q_s, power, b)
            mass, slope = p.sum(1, keepdim=True), w.sum(1, keepdim=True)
            if it < _SUBSET_ITERATIONS:
                z = _cheap_step(z, mass, slope, b)
        lo = torch.where(mass >= 1, z, z0)
        start = _cheap_step(z, mass, slope, b).squeeze(1)
        # candidate threshold in the units of x: t = shift + (τ_lo − 1/β)/s = shift + z_lo/(βs), lowered
        # by 8 ulps of the parts of shift + τ_lo/s (at most |t| + 1/(βs)) and 16 ulps of 1/(βs)
        t = torch.add(shift1, lo, alpha=1.0 / (b * scale))
        eps = torch.finfo(cdt).eps
        thr = torch.add(t, t.abs(), alpha=-8.0 * eps).sub_(24.0 * eps / (b * scale))
    mask = x > thr
    count = mask.sum()
    row, col = torch.nonzero_static(mask, size=size, fill_value=n_rows - 1).unbind(1)
    with _serial(size, x.device):
        overflow = count > size
        padding = torch.arange(size, device=x.device) >= count
        theta = _logits(x[row, col], shift.index_select(0, row), scale, cdt)
        theta = theta.masked_fill_(padding, -torch.finfo(cdt).max / 4)
        flat = torch.add(col, row, alpha=n)
        offsets = torch.searchsorted(flat, torch.arange(0, (n_rows + 1) * n, n, device=x.device))
        entries = _Entries(n_rows, n, flat=flat, row=row, offsets=offsets, cols=col)
        a = theta.mul(b)
        q = None
        if override:
            assert label is not None and logq_value is not None
            q = torch.ones_like(a).masked_fill_(col == label.index_select(0, row), math.exp(logq_value))
        iterations = _lean_iterations(b, cdt)
        tol = _CONVERGED_ULPS * eps
        z = start
        for it in range(iterations + 1):
            p, w, u = _masses(a, entries.per_entry(z), q, power, b)
            mass, slope = entries.rowsum(p), entries.rowsum(w)
            if it < iterations:
                z = _cheap_step(z, mass, slope, b)
        tau = torch.add(z, 1.0).div_(b)
        # the verdict: the next Newton step at the last iterate, M(1 − M^{−β})/Σw = β(M − 1)/Σw to
        # first order in M − 1, within tol·β·(1 + |τ|), once |M − 1| is past the rounding of M itself:
        # a recursive sum of k positive terms is off by up to (k − 1)·ε/2·M, and each term by a few
        # ulps, so ε·k·M (k: the active terms) is what no step can resolve — at hundreds of live
        # classes more than the 16 ulps. (|M − 1| − ε k M)/(tol Σw) > 1 + |τ|
        live = entries.rowsum(torch.sign(p))
        beyond = torch.addcmul((mass - 1.0).abs_(), live, mass, value=-eps)
        not_converged = torch.addcdiv(tau.abs(), beyond, slope, value=-1.0 / tol) < -1.0
        inner = support = None
        if theta_y is not None:
            inner = entries.rowsum(p * (theta - entries.per_entry(theta_y.to(cdt))))
            support = live.long()
        # a loss (theta_y) takes p unnormalised and divides by the mass where it uses p (its backward)
        p_mass = None if theta_y is None else mass
        if p_mass is None:
            p = p / entries.per_entry(mass)
        not_exact = not_converged.any() | overflow
    sol = _Solution(tau, p, w, u, theta, entries, _Stats(mass, None, inner, support), shift, p_mass)
    return sol, not_exact


def _solve_static(
    x: Tensor,
    blocks: _Blocks,
    *,
    scale: float,
    beta: Tensor,
    beta_scalar: float | None,
    label: Tensor | None = None,
    logq_label: Tensor | None = None,
    logq_label_min: float = 0.0,
    k: int | None = None,
    candidates: bool = True,
    bounds: tuple[Tensor, Tensor] | None = None,
    axis: ClassAxis = ONE_PROCESS,
    theta_y: Tensor | None = None,
    shift: Tensor | None = None,
    logq_value: float | None = None,
) -> tuple[_Solution, Tensor]:
    """Solve every row of ``x`` (``[N, n]``, θ = scale·(x − shift), q = 1 but the label override).

    The arguments are :func:`marginkit.ops.alpha._solve._solve`'s (no general measure);
    ``logq_label_min``: a lower bound of ``logq_label`` (a Python float: no read);
    ``logq_value``: the label's ``log q`` when it is this one number on every row. Returns the
    solution and its 0-d "not exact" flag (over every process of ``axis``). Rows that
    :func:`lean_eligible` accepts (with ``shift`` the row maxima, and the label override, if
    any, given by ``logq_value``) are solved by :func:`_solve_lean`.
    """
    n_rows, n = x.shape
    cdt = compute_dtype(x.dtype)
    uniform = logq_label is None or logq_value is not None
    lean = lean_eligible(n_rows, n, k, beta_scalar, candidates, axis.partitioned)
    if uniform and shift is not None and lean:
        assert beta_scalar is not None
        return _solve_lean(
            x, blocks, scale=scale, beta_scalar=beta_scalar, label=label,
            logq_value=logq_value, k=k, shift=shift, theta_y=theta_y,
        )  # fmt: skip
    if bounds is None:
        lo, hi = _row_bounds(x, blocks, scale, beta, cdt, None, label, logq_label, shift)
        assert hi is not None
    else:
        lo, hi = bounds
    hi = torch.maximum(hi, lo)
    hybrid = beta_scalar is None or beta_scalar > 1
    picked = None
    if candidates and budgets(n_rows, n, k)[0] < x.numel():
        with _serial(blocks.bmax.numel(), x.device):
            if not hybrid:
                lo = _subset_bound(
                    blocks,
                    x,
                    scale,
                    beta,
                    beta_scalar,
                    label,
                    logq_label,
                    lo,
                    hi,
                    shift,
                    min(0.0, logq_label_min),
                )
                if axis.partitioned:
                    # each process's block maxima are a subset of the whole row: its bound is one; the
                    # largest (one MAX) is the same on every process, as the collective Newton needs
                    (lo,) = axis.max_(lo)
            picked = _candidates(x, blocks, _threshold(lo, beta, scale, shift), shift, scale, cdt, k)
    if picked is None:
        entries = _Entries(n_rows, n)
        theta = _logits(x, None if shift is None else shift.unsqueeze(1), scale, cdt)
        overflow = None
    else:
        entries, theta, overflow = picked
    with _serial(theta.numel(), x.device):
        lq = _entry_logq(entries, cdt, None, label, logq_label)
        problem = _Problem(entries, theta, lq, beta, beta_scalar, min(0.0, logq_label_min))
        steps = _HYBRID_ITERATIONS[cdt] if hybrid or beta_scalar is None else _iterations(beta_scalar, cdt)
        fused = theta_y if axis.partitioned else None
        lean = None
        if not hybrid and not axis.partitioned:
            assert beta_scalar is not None
            tau, mass, slope, converged, lean = _lean_newton(_Lean(problem), lo, beta_scalar, steps)
            stats = _Stats(mass, slope)
        else:
            tau, stats, converged = _newton_static(
                problem, lo, hi, hybrid=hybrid, iterations=steps, axis=axis, theta_y=fused
            )
        if hybrid and cdt != torch.float64:  # (docs: _solve._refined)
            eps = torch.finfo(cdt).eps
            width = 64.0 * eps * (1.0 + tau.abs())
            lo64 = torch.maximum(lo, tau - width).double()
            hi64 = torch.maximum(torch.minimum(hi, tau + width), tau).double()
            problem64 = problem.to(torch.float64)
            tau64, stats, converged64 = _newton_static(
                problem64, lo64, hi64, hybrid=True, iterations=_REFINE_ITERATIONS, axis=axis,
                theta_y=None if fused is None else fused.double(),
            )  # fmt: skip
            converged = converged & converged64
            p, w, u = problem64.support(tau64)
            p = p / entries.per_entry(stats.mass)
            p, w, u, tau = p.to(cdt), w.to(cdt), u.to(cdt), tau64.to(cdt)
            stats = _Stats(*(None if v is None else v.to(cdt) for v in stats))
        else:
            p, w, u = problem.support(tau) if lean is None else lean
            p = p / entries.per_entry(stats.mass)
        not_exact = ~converged.all()
        if overflow is not None:
            not_exact = not_exact | overflow
        if axis.partitioned:  # the same verdict on every process (one MAX of one number)
            (flag,) = axis.max_(not_exact.to(cdt).reshape(1))
            not_exact = flag.reshape(()) > 0
    return _Solution(tau, p, w, u, problem.theta, entries, stats, shift), not_exact
