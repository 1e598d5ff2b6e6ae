"""Bounds and candidate layout of the alpha solver: block maxima, entry layouts, τ bounds, thresholds.

For logits ``θ = s·x`` and a reference measure ``q``, the threshold ``τ`` of the alpha
softargmax lies in ``[τ_lo, τ_hi]`` (mass ≥ 1 at ``τ_lo``, ≤ 1 at ``τ_hi``), and only the
entries with ``θ_j > τ_lo − 1/β`` can be active (SPEC §2). This module finds the bounds and the
candidates without a ``[N, n]`` temporary (block maxima), and holds the layouts of a compact
problem's entries (padded rows or a flat row-sorted list).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from marginkit.ops.alpha._memory import _serial, _sparse_nonzero, _sparse_target_zeros

# Columns per block of the block maxima; blocks are compared element-wise only when they may
# hold a candidate, unless more than this fraction of the logits would be compared anyway.
_BLOCK = 64
_BLOCK_BITS = 6  # log2(_BLOCK)
_BLOCK_FRACTION = 0.25


class _Blocks:
    """Maxima of blocks of ``_BLOCK`` consecutive columns of ``x`` ``[N, n]`` (one bandwidth-bound pass).

    They give the row maxima, the largest logit outside a given column (the label) and a
    block-level pre-filter for the candidates, so that only blocks holding a candidate are
    compared element by element. The last, partial block is padded with ``-inf``.
    """

    def __init__(self, x: Tensor) -> None:
        n_rows, n = x.shape
        if x.stride(-1) != 1:
            x = x.contiguous()
        self.x, self.n = x, n
        self.nb = n // _BLOCK
        self.main = x[:, : self.nb * _BLOCK].view(n_rows, self.nb, _BLOCK)
        parts = [self.main.amax(2)]
        self._tail: Tensor | None = None
        with _serial(parts[0].numel(), x.device):
            if n > self.nb * _BLOCK:
                parts.append(x[:, self.nb * _BLOCK :].amax(1, keepdim=True))
            self.bmax = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
            self.rowmax = self.bmax.amax(1)

    @property
    def tail(self) -> Tensor | None:
        """The last, partial block, padded with ``-inf`` to ``[N, _BLOCK]`` (``None``: none)."""
        n_rows, n, start = self.x.shape[0], self.n, self.nb * _BLOCK
        if self._tail is None and n > start:
            self._tail = self.x.new_full((n_rows, _BLOCK), -math.inf)
            self._tail[:, : n - start] = self.x[:, start:]
        return self._tail

    def _values(self, bi: Tensor, bj: Tensor) -> Tensor:
        """The ``_BLOCK`` values of the blocks ``(bi, bj)``, ``[k, _BLOCK]``.

        Gathered as rows of the (overlapping) view of every ``_BLOCK``-wide window of the flat
        logits: ``index_select`` copies whole rows, several times faster than indexing
        ``main[bi, bj]`` element by element.
        """
        if self.nb == 0:
            assert self.tail is not None
            return self.tail.index_select(0, bi)
        total = self.x.numel()
        windows = self.x.view(-1).as_strided((total - _BLOCK + 1, _BLOCK), (1, 1))
        with _serial(bi.numel(), bi.device):  # index arithmetic on [k]; the copy below runs parallel
            offsets = bi * self.n + bj * _BLOCK
            if self.tail is not None:
                offsets = offsets.clamp_(max=total - _BLOCK)
        values = windows.index_select(0, offsets)
        if self.tail is None:
            return values
        with _serial(bi.numel(), bi.device):  # (a where over [k, _BLOCK]: no read of which are tails)
            return torch.where((bj == self.nb).unsqueeze(1), self.tail.index_select(0, bi), values)

    def max_excluding(self, column: Tensor) -> Tensor:
        """Per row, the largest value outside ``column[row]`` (``-inf`` if there is none).

        Also keeps ``bmax_excluding``: the block maxima with ``column`` left out of its block.
        """
        rows = torch.arange(self.x.shape[0], device=column.device)
        bj = column // _BLOCK
        neg_inf = torch.tensor(-math.inf, dtype=self.bmax.dtype)
        inside = self._values(rows, bj).index_put((rows, column - bj * _BLOCK), neg_inf).amax(1)
        self.bmax_excluding = self.bmax.index_put((rows, bj), inside)
        return self.bmax_excluding.amax(1)

    def sparse(self, thr: Tensor) -> bool:
        """Do the blocks that may hold an entry above ``thr`` make a small part of the logits?"""
        with _serial(self.bmax.numel(), self.x.device):
            n_selected = int((self.bmax > thr.unsqueeze(1)).sum())
        return n_selected * _BLOCK <= _BLOCK_FRACTION * self.x.numel()

    def above(self, thr: Tensor) -> Tensor:
        """Sorted row-major flat indices of the entries ``x[i, j] > thr[i]``."""
        with _serial(self.bmax.numel(), self.x.device):
            selected = self.bmax > thr.unsqueeze(1)
            n_selected = int(selected.sum())
            dense = n_selected * _BLOCK > _BLOCK_FRACTION * self.x.numel()
            if not dense:  # (a sixth or so of the blocks: the word trick would not pay here)
                bi, bj = selected.nonzero().unbind(1)
                thr_b = thr.index_select(0, bi).unsqueeze(1)
        if dense:
            mask = (self.x > thr.unsqueeze(1)).view(-1)
            with _serial(mask.numel() // 8, self.x.device):
                return _sparse_nonzero(mask)
        mask = self._values(bi, bj) > thr_b
        with _serial(mask.numel() // 8, self.x.device):
            f = _sparse_nonzero(mask.view(-1))
            k, g = f >> _BLOCK_BITS, f & (_BLOCK - 1)
            return (bi.index_select(0, k) * self.n + bj.index_select(0, k) * _BLOCK).add_(g)


class _Entries:
    """Where the entries of a compact problem sit in the full ``[N, n]`` logits.

    Padded layout (``flat is None``): per-entry tensors are ``[N, K]`` and ``col`` is ``[N, K]``
    (``None``: all ``n`` columns in order). Flat layout: per-entry tensors are ``[m]``, sorted by
    their row-major ``flat`` index ``row * n + column``; ``counts[i]`` entries belong to row ``i``
    (no padding however unequal the rows), so row sums are segment sums. ``offsets`` (``[N + 1]``,
    instead of ``counts``) delimit the rows' entries (those past ``offsets[-1]`` belong to none);
    ``cols``: the column of each flat entry, when known.
    """

    def __init__(
        self,
        n_rows: int,
        n_cols: int,
        *,
        flat: Tensor | None = None,
        row: Tensor | None = None,
        counts: Tensor | None = None,
        col: Tensor | None = None,
        offsets: Tensor | None = None,
        cols: Tensor | None = None,
    ) -> None:
        self.n_rows, self.n_cols, self.flat, self.col = n_rows, n_cols, flat, col
        self.offsets, self.cols = offsets, cols
        if flat is not None and counts is None and offsets is None:
            starts = torch.arange(n_rows + 1, device=flat.device) * n_cols
            counts = torch.searchsorted(flat, starts).diff()
        if flat is not None and row is None:
            assert counts is not None
            row = torch.repeat_interleave(
                torch.arange(n_rows, device=flat.device), counts, output_size=len(flat)
            )
        self.row, self.counts = row, counts

    @property
    def is_flat(self) -> bool:
        return self.flat is not None

    def per_entry(self, v: Tensor) -> Tensor:
        """Broadcast a per-row ``[N]`` tensor to the entries."""
        return v.index_select(0, self.row) if self.row is not None else v.unsqueeze(-1)

    def rowsum(self, e: Tensor) -> Tensor:
        if self.offsets is not None:
            return torch.segment_reduce(e, "sum", offsets=self.offsets)
        if self.counts is None:
            return e.sum(-1)
        return torch.segment_reduce(e, "sum", lengths=self.counts)

    def rowmax(self, e: Tensor) -> Tensor:
        if self.row is None:
            return e.amax(-1)
        return e.new_full((self.n_rows,), -math.inf).scatter_reduce_(0, self.row, e, "amax")

    def is_column(self, label: Tensor) -> Tensor:
        """Per entry: does it sit in column ``label[row]``?"""
        if self.flat is not None:
            first = torch.arange(self.n_rows, device=label.device) * self.n_cols
            return self.flat == self.per_entry(first + label)
        cols = torch.arange(self.n_cols, device=label.device).unsqueeze(0) if self.col is None else self.col
        return cols == label.unsqueeze(-1)

    def select(self, idx: Tensor) -> _Entries:
        """The flat entries at the (increasing) positions ``idx``."""
        assert self.flat is not None and self.row is not None
        flat = self.flat.index_select(0, idx)
        return _Entries(self.n_rows, self.n_cols, flat=flat, row=self.row.index_select(0, idx))

    def to_flat(self, device: torch.device) -> _Entries:
        if self.flat is not None:
            return self
        k = self.n_cols if self.col is None else self.col.shape[1]
        row = torch.arange(self.n_rows, device=device).repeat_interleave(k)
        col = torch.arange(self.n_cols, device=device).repeat(self.n_rows) if self.col is None else self.col
        return _Entries(self.n_rows, self.n_cols, flat=row * self.n_cols + col.reshape(-1), row=row)

    def scatter(self, e: Tensor, dtype: torch.dtype, *, gradient: bool = False) -> Tensor:
        """Dense ``[N, n]`` tensor of ``dtype`` with the entries' values, zeros elsewhere.

        ``gradient``: the result is a gradient handed to autograd; a large one starts from calloc'd
        zeros (:func:`_sparse_target_zeros`). User-facing outputs use ``torch.zeros`` (a numpy-backed
        tensor cannot be resized).
        """
        if self.flat is None and self.col is None:
            return e.to(dtype)
        shape = (self.n_rows, self.n_cols)
        out = (
            _sparse_target_zeros(shape, dtype, e.device)
            if gradient
            else torch.zeros(shape, dtype=dtype, device=e.device)
        )
        if self.flat is not None:  # (add: the padding of a fixed-size layout repeats a position, with 0)
            with _serial(e.numel(), e.device):
                out.view(-1).index_add_(0, self.flat, e.to(dtype))
            return out
        # add, not assign: the padding of a padded candidate layout repeats a column with value 0
        with _serial(e.numel(), e.device):
            return out.scatter_add_(1, self.col, e.to(dtype))

    def sparse(self, e: Tensor, label: Tensor, at_label: Tensor) -> Tensor:
        """Sparse COO ``[N, n]`` (uncoalesced): the entries' values plus ``at_label`` at ``(i, label[i])``."""
        assert self.flat is not None or self.col is not None
        rows = torch.arange(self.n_rows, device=e.device)
        if self.flat is not None:
            assert self.row is not None
            row = self.row
            col = self.flat - self.row * self.n_cols if self.cols is None else self.cols
        else:
            assert self.col is not None
            row, col = rows.repeat_interleave(self.col.shape[1]), self.col.reshape(-1)
        index = torch.stack([torch.cat([row, rows]), torch.cat([col, label])])
        values = torch.cat([e if e.dim() == 1 else e.reshape(-1), at_label])
        return torch.sparse_coo_tensor(index, values, (self.n_rows, self.n_cols), check_invariants=False)

    def gather(self, dense: Tensor) -> Tensor:
        """The entries' values in a dense ``[N, n]`` tensor."""
        if self.flat is not None:
            return dense.reshape(-1).index_select(0, self.flat)
        return dense if self.col is None else dense.gather(1, self.col)

    def saved(self) -> tuple[Tensor | None, ...]:
        return self.flat, self.row, self.counts, self.col, self.offsets, self.cols

    @classmethod
    def restore(cls, n_rows: int, n_cols: int, saved: tuple[Tensor | None, ...]) -> _Entries:
        flat, row, counts, col, offsets, cols = saved
        return cls(n_rows, n_cols, flat=flat, row=row, counts=counts, col=col, offsets=offsets, cols=cols)


def _offset(logq: Tensor, beta: Tensor | float) -> Tensor:
    r"""``E(q) = (q^{-β} − 1)/β`` computed stably from ``log q`` (``−log q`` as ``β → 0``).

    :math:`\theta_j - E(q_j)` is the value of :math:`\tau` at which :math:`p_j = 1`.
    """
    return torch.expm1(-beta * logq) / beta


# Rounding slack of the bounds of a general measure, in ulps of their parts (see _bound_slack).
_BOUND_SLACK_ULPS = 16.0


def _bound_slack(theta_abs: Tensor, logq: Tensor, beta: Tensor | float) -> Tensor:
    r"""How far rounding can move a bound term :math:`\theta - E(q)` of a general measure.

    With a measure spanning many orders of magnitude both terms can be huge (1e15 for
    :math:`q = 10^{-30}`, β = 1/2) while :math:`\tau` must be resolved to :math:`1/\beta`: the
    computed difference can land on the wrong side of the root. ``E(q)`` carries a relative
    error of about :math:`(1 + |\beta\log q|)\,\varepsilon` (``expm1`` of a rounded argument),
    θ one of :math:`\varepsilon`: ``_BOUND_SLACK_ULPS`` times
    :math:`|\theta| + E(q)(1 + \beta|\log q|)`. A lower bound moves down by it, an upper one
    up; a bound looser by that costs the solver a Newton step at most. Element-wise.
    """
    e = _offset(logq, beta)
    eps = torch.finfo(e.dtype).eps
    return (theta_abs + e.abs() * (1.0 + (beta * logq).abs())) * (_BOUND_SLACK_ULPS * eps)


# E(q) = (q^{-β} − 1)/β overflows float32 once β·(−log q) passes ~88.7: beyond this exponent the
# solver computes in float64 (the loss itself can then exceed float32's range).
_F32_MAX_OFFSET_EXPONENT = 80.0


def _offset_overflows(cdt: torch.dtype, beta_max: float, logq_min: float) -> bool:
    """Would ``E(q) = (q^{-β} − 1)/β`` overflow float32 for the largest β and the smallest q?"""
    return cdt == torch.float32 and beta_max * -min(0.0, logq_min) > _F32_MAX_OFFSET_EXPONENT


# c^β (c the largest q of a row) beyond e^this overflows float64: the measure is refused.
_F64_MAX_EXPONENT = 700.0


def _widened_for_measure(
    cdt: torch.dtype,
    x2d: Tensor,
    lq2d: Tensor | None,
    beta: Tensor,
    blocks: _Blocks,
    relog: Callable[[], Tensor] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, _Blocks, Tensor | None]:
    r"""The op's inputs with a general measure normalised per row, in float64 if float32 would overflow.

    With :math:`c = \max_j q_j` per row and :math:`q = c\,\tilde q`,
    :math:`c\,\tilde q_j u_j^{1/\beta} = \tilde q_j (c^\beta u_j)^{1/\beta}` gives
    :math:`p(\theta; q) = p(c^\beta\theta; \tilde q)` and, for the Fenchel–Young loss (the
    divergence scales as :math:`D_f(p, c\tilde q) = c^{-\beta} D_f(p, \tilde q) + K(c, \tilde q)`),
    :math:`\ell(\theta; q) = c^{-\beta}\ell(c^\beta\theta; \tilde q)`. With :math:`\tilde q \le 1`
    the bounds hold in floating point whatever the scale of ``q`` (a measure of 1e30 would
    otherwise leave :math:`u_j \approx q_j^{-\beta}` below the resolution of
    :math:`1 + \beta(\theta_j - \tau)`).
    ``c`` is a constant of the identity (no gradient needed through it). Returns
    ``(x, log q̃, β, blocks, log c)``; ``log c`` is ``None`` when every row's largest ``q`` is 1.
    ``relog``: ``log q`` again in float64, taken when the solve is widened to float64 (a float32
    logarithm would carry its rounding into a float64 solve).
    """
    if lq2d is None:
        return x2d, lq2d, beta, blocks, None
    log_c: Tensor | None = lq2d.detach().amax(-1)
    assert log_c is not None
    growth = float((beta.detach() * log_c).max()) if log_c.numel() else 0.0
    if growth > _F64_MAX_EXPONENT:
        raise ValueError(
            f"q is too large for alpha: (alpha - 1) * log(max q) reaches {growth:.4g} "
            f"> {_F64_MAX_EXPONENT:g}; "
            "alpha_softargmax(θ, α, c·q) = alpha_softargmax(c^(α-1)·θ, α, q) would need logits beyond "
            "float64's range: divide q by a constant (or lower alpha)"
        )
    if not bool((log_c != 0).any()):
        log_c = None
    reach = 0.0  # log of the largest rescaled logit |c^β·θ|: it decides the working precision too
    if log_c is not None:
        low, high = torch.aminmax(x2d.detach(), dim=-1)
        top = torch.maximum(high.abs(), low.abs()).to(log_c.dtype).clamp_min(torch.finfo(log_c.dtype).tiny)
        reach = float((beta.detach().to(log_c.dtype) * log_c + top.log()).max())
    if reach > _F64_MAX_EXPONENT:
        raise ValueError(
            f"the logits are too large for this q and alpha: |logits| * max(q)^(alpha - 1) reaches "
            f"e^{reach:.4g}, beyond float64's range (alpha_softargmax(θ, α, c·q) is computed as "
            "alpha_softargmax(c^(α-1)·θ, α, q)): divide q by a constant, or scale the logits down"
        )
    wide = max(growth, reach) > _F32_MAX_OFFSET_EXPONENT or _offset_overflows(
        cdt,
        float(beta.detach().max()),
        float(lq2d.detach().min()) - (0.0 if log_c is None else float(log_c.max())),
    )
    if wide and cdt == torch.float32:
        x2d, beta = x2d.double(), beta.double()
        lq2d = relog() if relog is not None and lq2d.dtype != torch.float64 else lq2d.double()
        if log_c is not None:  # (the row maxima of the float64 log q)
            log_c = lq2d.detach().amax(-1)
    if log_c is not None:  # (in the compute dtype: c^β·θ can overflow a half-precision type)
        dt = x2d.dtype if x2d.dtype == torch.float64 else cdt
        x2d = x2d.to(dt) * torch.exp(beta * log_c).unsqueeze(1).to(dt)
        lq2d = lq2d - log_c.unsqueeze(1).to(lq2d.dtype)
    if wide or log_c is not None:
        blocks = _Blocks(x2d.detach() if x2d.requires_grad else x2d)
    return x2d, lq2d, beta, blocks, log_c


def _entry_logq(
    entries: _Entries,
    cdt: torch.dtype,
    logq: Tensor | None,
    label: Tensor | None,
    logq_label: Tensor | None,
) -> Tensor | None:
    """``log q`` of the entries (``None`` when q ≡ 1); the label override never builds ``[N, n]``."""
    if logq is not None:
        return entries.gather(logq).to(cdt)
    if label is not None and logq_label is not None:
        return torch.where(entries.is_column(label), entries.per_entry(logq_label.to(cdt)), 0.0)
    return None


def _label_maxima(
    x: Tensor, blocks: _Blocks, column: Tensor, owned: Tensor | None, override: bool
) -> tuple[Tensor, Tensor]:
    """Per row, this block's largest logit off the label and the label's logit (``-inf`` if not owned).

    In the units and dtype of ``x``. Without a label override (``q ≡ 1``) the first is the row
    maximum (the label needs no exclusion); with one it also leaves ``blocks.bmax_excluding``.
    """
    x_y = x.gather(1, column.unsqueeze(1)).squeeze(1)
    others = blocks.max_excluding(column) if override else blocks.rowmax
    if owned is not None:
        x_y = torch.where(owned, x_y, -math.inf)
        if override:
            others = torch.where(owned, others, blocks.rowmax)
    return others, x_y


def _label_bounds(
    others: Tensor,
    x_y: Tensor,
    scale: float,
    beta: Tensor,
    cdt: torch.dtype,
    logq_label: Tensor | None,
    num_classes: int,
    shift: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""``(τ_lo, τ_hi, θ_y)`` of rows with ``q_j = 1`` except ``q_y`` (``logq_label``; ``None``: 1).

    From the row's largest logit off the label and the label's logit (over every class):
    :math:`\tau_{lo} = \max(\max_{j\ne y}\theta_j, \theta_y - E(q_y))` (every :math:`p_j \le 1`) and
    :math:`\tau_{hi} = \max_j\theta_j - E(n)` with ``n = num_classes`` (a total measure at least
    :math:`\sum_j q_j` while :math:`q_y \le 1`). In the frame of ``shift`` (:func:`_logits`).
    """
    theta_y = _logits(x_y, shift, scale, cdt)
    theta_others = _logits(others, shift, scale, cdt)
    top = torch.maximum(theta_others, theta_y)
    log_n = torch.tensor(float(num_classes), dtype=cdt, device=top.device).log()
    hi = top - _offset(log_n, beta)
    if logq_label is None:
        return top, hi, theta_y
    return torch.maximum(theta_others, theta_y - _offset(logq_label.to(cdt), beta)), hi, theta_y


def _row_bounds(
    x: Tensor,
    blocks: _Blocks,
    scale: float,
    beta: Tensor,
    cdt: torch.dtype,
    logq: Tensor | None,
    label: Tensor | None,
    logq_label: Tensor | None,
    shift: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(τ_lo, τ_hi)`` of the full rows of one process, ``[N]`` each (``τ_hi`` ``None`` for a general q).

    No ``[N, n]`` temporary unless ``q`` is a general dense measure: with ``q ≤ 1`` (q ≡ 1 or
    the label override with a margin ≥ 0) the total measure is at most ``n``. In the frame of
    ``shift`` (:func:`_logits`).
    """
    if logq is not None:
        theta = _logits(x, None if shift is None else shift.unsqueeze(-1), scale, cdt)
        lq = logq.to(cdt)
        lo, at = (theta - _offset(lq, beta.unsqueeze(-1))).max(-1)
        # a valid floor: the attaining term less its own slack (max_j of (term − slack) is above it)
        at = at.unsqueeze(-1)
        slack = _bound_slack(theta.gather(-1, at).abs(), lq.gather(-1, at), beta.unsqueeze(-1))
        return lo - slack.squeeze(-1), None
    if label is None or logq_label is None:
        top = _logits(blocks.rowmax, shift, scale, cdt)
        log_n = torch.tensor(float(x.shape[1]), dtype=cdt, device=x.device).log()
        return top, top - _offset(log_n, beta)
    others, x_y = _label_maxima(x, blocks, label, None, override=True)
    lo, hi, _ = _label_bounds(others, x_y, scale, beta, cdt, logq_label, x.shape[1], shift)
    return lo, hi if bool((logq_label <= 0).all()) else None


def _logits(x: Tensor, shift: Tensor | None, scale: float, cdt: torch.dtype) -> Tensor:
    r"""The logits :math:`\theta = s\,(x - \text{shift})` in ``cdt`` (a new tensor).

    The solver works in the frame of a per-row ``shift`` (the row maximum of ``x``, over every
    class of the axis): the softargmax depends on :math:`\theta_j - \tau` only, and
    :math:`x - \max x` is exact in floating point for the entries that matter (Sterbenz), so
    large logits lose no accuracy in :math:`1 + \beta(\theta_j - \tau)`. ``shift`` broadcasts
    against ``x`` (``[N]`` for ``[N]`` values, ``[N, 1]`` for rows, per entry for flat entries).
    """
    if shift is None:
        return torch.mul(x.to(cdt), scale)
    theta = x.to(cdt) - shift.to(cdt)
    return theta.mul_(scale) if scale != 1.0 else theta


def _threshold(lo: Tensor, beta: Tensor, scale: float, shift: Tensor | None = None) -> Tensor:
    """Candidate threshold ``(τ_lo − 1/β)/scale + shift`` in the units of x, lowered by a few ulps
    so that rounding never drops an entry that the solver's arithmetic would find active."""
    thr = (lo - 1.0 / beta) / scale
    if shift is not None:
        thr = thr + shift.to(thr.dtype)
    return thr - 8 * torch.finfo(lo.dtype).eps * (thr.abs() + 1.0 / (beta * scale))


def _padded(entries: _Entries, theta: Tensor, width: int) -> tuple[_Entries, Tensor]:
    """The flat candidates as ``[N, width]`` rows, padded with ``-inf`` logits at column 0.

    Row sums and per-row broadcasts are then plain reductions and broadcasts instead of segment
    sums and gathers, several times cheaper per Newton step. Padding is inactive at every τ
    (probability, weight and gradient exactly 0).
    """
    assert entries.flat is not None and entries.row is not None and entries.counts is not None
    n_rows, n_cols, row = entries.n_rows, entries.n_cols, entries.row
    starts = entries.counts.cumsum(0).sub_(entries.counts)
    pos = torch.arange(row.numel(), device=row.device).sub_(starts.index_select(0, row))
    col = torch.zeros(n_rows, width, dtype=torch.long, device=row.device)
    col.index_put_((row, pos), entries.flat - row * n_cols)
    padded = theta.new_full((n_rows, width), -math.inf).index_put_((row, pos), theta)
    return _Entries(n_rows, n_cols, col=col), padded


def _label_logq_min(logq: Tensor | None, label: Tensor | None, logq_label: Tensor | None) -> float | None:
    """The smallest ``log q`` of the label override (q is 1 elsewhere); ``None`` for a dense measure."""
    if logq is None and label is not None and logq_label is not None:
        return min(0.0, float(logq_label.min()))
    return None if logq is not None else 0.0
