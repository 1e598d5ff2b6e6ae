r"""The solver's frame for a general reference measure: where :math:`\tau` must be resolved.

The solver works with :math:`\theta' = \theta - F` and :math:`\tau' = \tau - F` for a per-row
frame :math:`F` (the row maximum by default), and computes :math:`u_j = 1 + \beta(\theta'_j - \tau')`
with an absolute error of about :math:`\varepsilon(1 + \beta|\theta'_j| + \beta|\tau'|)`. An active
entry has :math:`p_j = q_j u_j^{1/\beta} \le 1`, i.e. :math:`u_j \le q_j^{-\beta}` (``q`` normalised
to a row maximum of 1): the entries with the largest ``q`` need :math:`u_j` to an absolute
precision of :math:`\varepsilon`, so :math:`\tau'` must be small. With ``q ≡ 1`` (or the label
override of Q-Margin, ``q ≤ 1`` on bounded logits) the row maximum is such a frame. With a
measure spanning many orders of magnitude it is not: ``q = [1, 1e30, 1, 1, 1]`` at α = 1.5 moves
:math:`\tau` to within :math:`10^{-15}` of :math:`\theta_1 + 2`, a resolution no floating-point
type has around the row maximum (float64 included).

The frame error of a row is :math:`\max_j q_j^{\beta}(1 + \beta|\theta'_j| + \beta|\tau'|)` over
the entries that may be active (within their rounding error). In units of :math:`\varepsilon/\beta`
it bounds the error of every probability (for α ≤ 2; :math:`q_j u_j^{1/\beta - 1} \le q_j^\beta`
on the support). The frame at the logit of the entry with the largest ``q`` among those that may
be active keeps it below about 6: :math:`\tau` then lies within :math:`q_a^{-\beta}/\beta` of it
(active: :math:`\tau < \theta_a + 1/\beta`; and :math:`\tau \ge \tau_{lo} \ge \theta_a - E(q_a)`).
:func:`marginkit.ops.alpha._solve._solve` moves the rows whose error exceeds ``_FRAME_LIMIT`` to
that frame and solves them again, until every row passes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from marginkit.ops.alpha._candidates import _Blocks, _Entries, _logits, _threshold

# A row is solved again in a better frame when its frame error exceeds this (in eps/β).
_FRAME_LIMIT = 32.0
# Entries within this many rounding errors of the support edge count as possibly active.
_EDGE_SLACK_ULPS = 16.0
# Frames tried per row before the measure is refused (each reduces the error by a factor of
# about eps: two suffice for a measure spanning float32's whole range).
_MAX_FRAMES = 4


def _frame_errors(
    x: Tensor, blocks: _Blocks, scale: float, beta: Tensor, logq: Tensor, shift: Tensor, tau: Tensor
) -> tuple[Tensor, Tensor]:
    r"""Per row: the frame error (see the module docstring) and the column of a better frame.

    ``x`` ``[N, n]`` in its units (θ = scale·(x − shift)) with its ``blocks``; ``logq`` the
    normalised ``log q`` (row maximum 0) ``[N, n]``; ``tau`` in the frame. An entry may be active
    when :math:`\beta(\theta'_j - \tau') > -1 - s(1 + \beta|\theta'_j| + \beta|\tau'|)`
    (``s`` = ``_EDGE_SLACK_ULPS`` ulps), which implies
    :math:`\theta'_j > \tau' - (1 + s(1 + 2\beta|\tau'|)) / (\beta(1 - s))`: only the entries above
    that are gathered (the blocks' pre-filter). The better frame is the column of the entry with
    the largest ``q`` among those that may be active (ties: the last).
    """
    cdt = tau.dtype
    n_rows, n = x.shape
    s = torch.finfo(cdt).eps * _EDGE_SLACK_ULPS
    b = beta.to(cdt)
    reach = (1.0 + s * (1.0 + 2.0 * b * tau.abs())) / (b * (1.0 - s))
    flat = blocks.above(_threshold(tau - reach + 1.0 / b, b, scale, shift))
    entries = _Entries(n_rows, n, flat=flat)
    theta = _logits(x.reshape(-1).index_select(0, flat), entries.per_entry(shift), scale, cdt)
    be, te = entries.per_entry(b), entries.per_entry(tau)
    spread = (theta.abs() + te.abs()).mul_(be).add_(1.0)
    possible = (theta - te).mul_(be) > spread.mul(s).add_(1.0).neg_()
    lq = torch.where(possible, logq.reshape(-1).index_select(0, flat).to(cdt), -math.inf)
    error = entries.rowmax(torch.where(possible, (be * lq).exp_().mul_(spread), 0.0)).clamp_min_(0.0)
    top = entries.rowmax(lq)
    at_top = possible & (lq == entries.per_entry(top))
    last = entries.rowmax(torch.where(at_top, flat.to(cdt), -1.0)).clamp_min_(0.0)
    anchor = last.long() - torch.arange(n_rows, device=x.device) * n
    return error, anchor.clamp_(0, n - 1)
