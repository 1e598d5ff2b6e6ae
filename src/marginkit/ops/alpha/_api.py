"""The public alpha ops (argument handling, the softargmax, the loss) and the Q-Margin entry point."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from marginkit._validation import check_flag, compute_dtype, float_tensor, positive_int, real
from marginkit.ops.alpha._autograd import _LossFunction, _OnAxis, _SoftargmaxFunction
from marginkit.ops.alpha._candidates import (
    _F64_MAX_EXPONENT,
    _Blocks,
    _label_bounds,
    _label_maxima,
    _logits,
    _offset_overflows,
    _widened_for_measure,
)
from marginkit.ops.alpha._memory import _serial
from marginkit.ops.alpha._static import _BETA_FLOOR, beta_rows, lean_eligible
from marginkit.ops.classes import ClassBlock, class_block
from marginkit.ops.softmax import ScaledLogits, check_scores, class_cross_entropy

__all__ = ["alpha_divergence_loss", "alpha_softargmax", "qmargin_loss"]


def _checked_blocks(x2d: Tensor, name: str) -> _Blocks:
    """Block maxima of logits, validating them on the way (one reduction instead of two full checks).

    ``amax`` propagates NaN and +inf, so a non-finite row maximum means NaN, +inf or an all
    ``-inf`` row; :func:`float_tensor` then produces the error message for the first two.
    """
    blocks = _Blocks(x2d)
    if blocks.rowmax.numel():
        top = blocks.rowmax.detach()
        nan_or_inf = (torch.isnan(top) | (top == math.inf)).any()

        def text(nan_or_posinf: float) -> str:
            if nan_or_posinf:
                return f"{name} contains NaN or +inf values (only -inf is allowed, for masked entries)"
            return f"{name} has a row whose entries are all -inf; at least one class must be finite"

        check_flag(f"{name} values", ~torch.isfinite(top).all(), text, nan_or_inf)
    return blocks


_ALPHA_BELOW_ONE = (
    "alpha < 1 is not supported (the alpha-divergence softargmax is then dense and heavy-tailed); "
    "a learnable alpha can be kept >= 1 as alpha = 1 + softplus(raw)"
)


def _alpha_rows(
    alpha: Any,
    batch_shape: torch.Size | tuple[int, ...],
    cdt: torch.dtype,
    device: torch.device,
    scalar_rows: bool = True,
) -> tuple[Tensor | None, float | None]:
    """``beta = alpha − 1`` per row ``[N]`` (floored at ``_BETA_FLOOR``), and ``alpha`` if a fixed scalar.

    An ``alpha`` tensor that requires grad gives a ``beta`` in its graph (the floor passes the
    gradient straight through) and no scalar: the solver then computes the gradient w.r.t. β.
    ``scalar_rows=False``: no ``beta`` tensor for a fixed scalar (``None``; :func:`beta_rows` makes
    it when a solver needs it).
    """
    n_rows = math.prod(batch_shape)
    if isinstance(alpha, Tensor):
        if alpha.dtype == torch.bool or torch.is_complex(alpha):
            raise TypeError(f"alpha must be a real tensor, got dtype {alpha.dtype}")
        learnable = alpha.requires_grad and torch.is_grad_enabled()
        if alpha.numel() == 1 and not learnable:
            return _alpha_rows(float(alpha), batch_shape, cdt, device, scalar_rows)
        a = alpha.detach()
        if bool(torch.isnan(a).any()) or not bool(torch.isfinite(a).all()):
            raise ValueError("alpha must be finite everywhere, got NaN or infinite values")
        if bool((a < 1).any()):
            raise ValueError(
                f"alpha must be >= 1 everywhere, got a minimum of {float(a.min()):.6g}: {_ALPHA_BELOW_ONE}"
            )
        src = alpha if learnable else a
        try:
            rows = torch.broadcast_to(src.reshape(()) if src.numel() == 1 else src, batch_shape)
        except RuntimeError:
            raise ValueError(
                f"alpha must be a float or a tensor broadcastable to the batch shape {tuple(batch_shape)}, "
                f"got shape {tuple(alpha.shape)}"
            ) from None
        beta = rows.reshape(n_rows).to(device=device, dtype=cdt) - 1
        floor = (_BETA_FLOOR - beta.detach()).clamp_min(0.0)
        return beta + floor, None  # max(β, floor) in value, gradient 1
    a = checked_alpha(alpha)
    return (beta_rows(a - 1.0, n_rows, cdt, device) if scalar_rows else None), a


def checked_alpha(alpha: Any) -> float:
    """A scalar ``alpha >= 1`` as a float (a clear error otherwise, alpha < 1 included)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"alpha must be a real number or a tensor, got {type(alpha).__name__}")
    if math.isfinite(alpha) and alpha < 1:
        raise ValueError(f"alpha must be >= 1, got {alpha}: {_ALPHA_BELOW_ONE}")
    return real(alpha, "alpha", low=1)


def _alpha_batch(alpha: Any, logits: Tensor, dim: int) -> Any:
    """Accept the entmax-style keepdim form of a per-row alpha (size 1 along ``dim``)."""
    if (
        isinstance(alpha, Tensor)
        and alpha.dim() == logits.dim()
        and alpha.dim() > 0
        and alpha.shape[dim] == 1
    ):
        return alpha.squeeze(dim)
    return alpha


def _log_reference(q: Any, logits: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    r"""Validated ``log q`` broadcast to ``logits``' shape (a view where possible).

    In ``dtype`` (default: ``compute_dtype`` of ``q``'s and the logits' dtypes). When the solve
    is widened to float64, :func:`_widened_for_measure` takes it again in float64: the loss is as
    sensitive to :math:`\log q_y` as :math:`q_y^{-\beta}/\alpha` (a float32 ``log`` of an exact
    ``q = 2^{-40}`` put a relative error of 1e-6 into a float64 loss).
    """
    float_tensor(q, "q", min_dim=0, allow_empty=True)
    if q.numel() and not bool((q > 0).all()):
        raise ValueError("q must be strictly positive (a reference measure), got values <= 0")
    try:
        shape = torch.broadcast_shapes(q.shape, logits.shape)
    except RuntimeError:
        shape = None
    if shape != logits.shape:
        raise ValueError(
            f"q must be broadcastable to the logits shape {tuple(logits.shape)}, got shape {tuple(q.shape)}"
        )
    dtype = dtype or compute_dtype(torch.promote_types(q.dtype, logits.dtype))
    return q.to(dtype).log().expand(logits.shape)


def _topk_count(topk: Any, n: int) -> int | None:
    if topk is None:
        return None
    if isinstance(topk, bool):
        raise TypeError(f"topk must be None, an int or a float fraction, got {type(topk).__name__}")
    if isinstance(topk, int):
        if topk < 1 or topk > n:
            raise ValueError(f"topk must lie in [1, {n}] (the number of classes), got {topk}")
        return positive_int(topk, "topk")
    if isinstance(topk, float):
        if not 0.0 < topk <= 1.0:
            raise ValueError(f"topk as a fraction must lie in (0, 1], got {topk}")
        return max(1, min(n, math.ceil(topk * n)))
    raise TypeError(f"topk must be None, an int or a float fraction, got {type(topk).__name__}")


def alpha_softargmax(
    logits: Tensor,
    alpha: float | Tensor = 1.5,
    q: Tensor | None = None,
    dim: int = -1,
    topk: int | float | None = None,
    *,
    candidates: bool = True,
) -> Tensor:
    r"""Alpha-divergence softargmax (entmax with a reference measure ``q``).

    .. math::

        p_j = q_j\,[1 + (\alpha - 1)(\theta_j - \tau)]_+^{1/(\alpha - 1)}, \qquad \sum_j p_j = 1,

    the maximiser of :math:`\langle p, \theta\rangle - D_f(p, q)` over the simplex for the
    alpha-divergence generator :math:`f(t) = (t^\alpha - 1 - \alpha(t-1))/(\alpha(\alpha-1))`;
    :math:`\alpha = 1` gives :math:`\mathrm{softmax}(\theta + \log q)`, :math:`q \equiv 1` gives
    ``entmax_bisect(θ, α)`` (1.5: entmax15, 2: sparsemax). Classes with
    :math:`\theta_j \le \tau - 1/(\alpha-1)` get exactly zero probability.

    :math:`\tau` is found to floating-point precision by a safeguarded Newton method on the
    candidate set :math:`\theta_j > \tau_{lo} - 1/(\alpha-1)` only (see the module docstring and
    ``docs/qmargin.md``). The result is exact whatever ``topk`` is.

    Args:
        logits: ``[..., n, ...]`` scores; ``-inf`` marks masked classes (probability exactly 0);
            NaN and ``+inf`` are rejected, and so is a row that is entirely ``-inf``.
        alpha: ``>= 1``; a float or a tensor broadcastable to the batch shape (``logits`` without
            ``dim``) or of ``logits``' shape with size 1 along ``dim`` (per-row alpha). A tensor
            that requires grad is learnable: its gradient is implicit (``docs/qmargin.md``; for
            ``q ≡ 1`` that of ``entmax_bisect``). ``alpha < 1`` is refused.
        q: positive reference measure broadcastable to ``logits`` (``None``: all ones). Gradients
            flow to ``q``.
        dim: the class dimension.
        topk: ``None``, an int K or a fraction in ``(0, 1]`` of the classes: a cap on the root
            finder's work per row. When the exact candidates of every row number at most K they
            are a subset of its top K and are solved directly; otherwise the solve runs on the K
            largest logits and keeps the answer for rows that pass the integrity check (the
            smallest kept logit is inactive); other rows are recomputed exactly.
        candidates: keyword-only; ``False`` disables the candidate filter and solves on the full
            rows (slower; for benchmarks and cross-checks).

    Returns:
        Probabilities of ``logits``' shape and dtype (computed in float32, or float64 for
        float64 input).

    Example:
        >>> import torch
        >>> from marginkit.ops import alpha_softargmax
        >>> p = alpha_softargmax(torch.tensor([[2.0, 1.0, -1.0]]), alpha=2.0)
        >>> p
        tensor([[1., 0., 0.]])
        >>> alpha_softargmax(torch.tensor([0.5, 0.0, -1.0]), alpha=1.5).sum()
        tensor(1.)

    References:
        Roulet et al., "Loss Functions and Operators Generated by f-Divergences", ICML 2025;
        Peters, Niculae, Martins, "Sparse Sequence-to-Sequence Models", ACL 2019.
    """
    float_tensor(logits, "logits", check_values=False)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -logits.dim() <= dim < logits.dim():
        raise ValueError(f"dim must index a dimension of logits (ndim {logits.dim()}), got {dim}")
    dim = dim % logits.dim()
    logq = None if q is None else _log_reference(q, logits)
    x = logits.movedim(dim, -1)
    batch_shape, n = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, n).contiguous()
    k = _topk_count(topk, n)
    cdt = compute_dtype(logits.dtype)
    beta, scalar_alpha = _alpha_rows(_alpha_batch(alpha, logits, dim), batch_shape, cdt, logits.device)
    blocks = _checked_blocks(x2d, "logits")
    lq2d = None if logq is None else logq.movedim(dim, -1).reshape(-1, n)
    if scalar_alpha == 1.0:
        z = x2d.to(cdt) if lq2d is None else x2d.to(cdt) + lq2d
        p2d = torch.softmax(z, dim=-1).to(logits.dtype)
    elif x2d.shape[0] == 0:
        p2d = x2d.clone()
    else:

        def relog() -> Tensor:
            return _log_reference(q, logits, torch.float64).movedim(dim, -1).reshape(-1, n)

        x2d, lq2d, beta, blocks, _ = _widened_for_measure(cdt, x2d, lq2d, beta, blocks, relog)
        beta_scalar = None if scalar_alpha is None else max(scalar_alpha - 1.0, _BETA_FLOOR)
        p2d = _SoftargmaxFunction.apply(x2d, lq2d, blocks, beta, beta_scalar, k, bool(candidates))
    return p2d.reshape(x.shape).movedim(-1, dim).to(logits.dtype)


def alpha_divergence_loss(
    logits: Tensor,
    labels: Tensor,
    alpha: float | Tensor,
    q: Tensor | None = None,
    topk: int | float | None = None,
    *,
    candidates: bool = True,
) -> Tensor:
    r"""Fenchel–Young loss of the alpha-divergence softargmax, one value per example.

    .. math::

        \ell(\theta, y; q) = \langle p, \theta\rangle - D_f(p, q) + D_f(e_y, q) - \theta_y
        = (1 - \tfrac1\alpha)\langle p, \theta - \theta_y\rangle
          + \tfrac1\alpha\big(\tau - \theta_y + \tfrac{q_y^{1-\alpha} - 1}{\alpha - 1}\big),

    with :math:`p` = :func:`alpha_softargmax` ``(θ, α, q)``. The right-hand form (derived in
    ``docs/qmargin.md``) uses the support only: the :math:`\sum_{j\,\mathrm{inactive}} q_j/\alpha`
    terms of both divergences cancel analytically and are never formed, so the value keeps its
    precision at a million classes in float32. :math:`\ell \ge 0`, :math:`\ell = 0` iff
    :math:`p = e_y`, and :math:`\nabla_\theta \ell = p - e_y` exactly (custom backward).
    :math:`\alpha = 1` is the cross-entropy of :math:`\theta + \log q`.

    Args:
        logits: ``[..., n]`` scores (class dimension last); ``-inf`` allowed except at the label.
        labels: integer class ids of shape ``logits.shape[:-1]``.
        alpha: ``>= 1``, float or per-row tensor (broadcastable to ``logits.shape[:-1]``),
            learnable when it requires grad (as in :func:`alpha_softargmax`).
        q: positive reference measure broadcastable to ``logits`` (``None``: all ones);
            gradients flow to ``q``.
        topk: as in :func:`alpha_softargmax` (the value is exact whatever it is).
        candidates: keyword-only; ``False`` solves on the full rows.

    Returns:
        Loss per example, shape ``logits.shape[:-1]``, float32 (float64 for float64 logits, and
        when :math:`(\alpha-1)\log(1/q_{min}) > 80`: the divergence terms then overflow float32, or
        when the logits rescaled by :math:`(\max q)^{\alpha-1}` pass :math:`e^{80}`; beyond float64's
        range an error names them; ``log q`` is then taken in float64 too).

    Example:
        >>> import torch
        >>> from marginkit.ops import alpha_divergence_loss
        >>> logits = torch.tensor([[3.0, 0.0, -1.0], [0.2, 0.1, 0.0]])
        >>> alpha_divergence_loss(logits, torch.tensor([0, 2]), alpha=1.5)
        tensor([0.0000, 0.6693])

    References:
        Roulet et al., ICML 2025 (arXiv 2501.18537); Blondel, Martins, Niculae, "Learning with
        Fenchel-Young Losses", JMLR 2020.
    """
    if not isinstance(logits, Tensor):  # a sharded head's output: alpha_divergence_loss is one-process
        float_tensor(logits, "logits")
    block = class_block(logits, labels, name="logits", batch_dims=True)
    x2d, y = block.scores.contiguous(), block.labels
    n = x2d.shape[1]
    logq = None if q is None else _log_reference(q, logits)
    k = _topk_count(topk, n)
    cdt = compute_dtype(logits.dtype)
    beta, scalar_alpha = _alpha_rows(alpha, logits.shape[:-1], cdt, logits.device)
    blocks = _checked_blocks(x2d, "logits")
    if y.numel():
        check_flag(
            "logits at labels",
            ~torch.isfinite(x2d.detach().gather(1, y.unsqueeze(1))).all(),
            lambda: "logits must be finite at the labels (a label points at a class masked with -inf)",
        )
    lq2d = None if logq is None else logq.reshape(-1, n)
    if scalar_alpha == 1.0:
        z = x2d.to(cdt) if lq2d is None else x2d.to(cdt) + lq2d
        loss = F.cross_entropy(z, y, reduction="none")
    elif x2d.shape[0] == 0:
        loss = x2d.to(cdt).sum(-1)  # empty, but connected to the graph
    else:

        def relog_loss() -> Tensor:
            return _log_reference(q, logits, torch.float64).reshape(-1, n)

        x2d, lq2d, beta, blocks, log_c = _widened_for_measure(cdt, x2d, lq2d, beta, blocks, relog_loss)
        beta_scalar = None if scalar_alpha is None else max(scalar_alpha - 1.0, _BETA_FLOOR)
        loss, _ = _LossFunction.apply(x2d, lq2d, y, blocks, beta, beta_scalar, 1.0, None, k, bool(candidates))
        if log_c is not None:  # ℓ(θ; c·q̃) = c^{−β} ℓ(c^β θ; q̃)
            loss = loss * torch.exp(-beta * log_c).to(loss.dtype)
    return loss.reshape(logits.shape[:-1])


def qmargin_loss(
    block: ClassBlock,
    alpha: float | Tensor,
    scale: float,
    margin: float,
    *,
    topk: int | float | None = None,
    candidates: bool = True,
    sparse_grad: bool = False,
    name: str = "cosines",
    cosines: bool = True,
) -> tuple[Tensor, Tensor]:
    r"""Q-Margin family loss per example on a class block: :math:`\theta = s\,c`, :math:`q_y = e^{-sm}`.

    .. math::

        \ell(c, y) = \langle p, \theta\rangle - D_f(p, q) + D_f(e_y, q) - \theta_y,\qquad
        \theta = s\,c,\quad q_j = 1\ (j \ne y),\ q_y = e^{-s m},

    the alpha-divergence Fenchel–Young loss (:func:`alpha_divergence_loss`) with the margin in the
    reference measure (``margin = 0``: entmax / sparsemax losses on ``s·c``); ``α = 1`` is CosFace,
    :math:`-\log\mathrm{softmax}(s(c - m e_y))_y` (:func:`marginkit.ops.softmax.class_cross_entropy`).
    ``q`` is never materialised. Every reduction over the classes runs on ``block.axis``: one
    MAX (the bounds, the label's cosine and the input check), then one SUM per Newton
    evaluation; on a sharded head every rank solves for the same global τ.

    Args:
        block: cosines in ``[-1, 1]`` (rounding up to 1e-3 outside is accepted), labels, axis
            (:func:`marginkit.ops.classes.class_block`).
        alpha: ``α >= 1``: a float, or a tensor (0-d, or broadcastable to ``block.batch_shape``:
            per row) that may require grad (the gradient w.r.t. α is implicit, as in
            ``entmax_bisect``); scale: ``s > 0``; margin: ``m >= 0`` (validated by the caller).
            :math:`(\alpha - 1)sm > 700` is refused: the loss exceeds float64's range.
        topk: ``None``, an int or a fraction in ``(0, 1]``: exact top-K truncation when some row
            has more candidates (one process only; ignored on a partitioned axis).
        candidates: ``False`` solves on the full rows.
        sparse_grad: hand the gradient of ``block.scores`` back as a sparse COO tensor when the
            solution is compact (only for a producer that accepts one:
            :func:`marginkit.heads.cosine.accepts_sparse_grad`).
        name: the cosines' name in error messages.
        cosines: ``True``: the scores must be cosines in ``[-1, 1]``; ``False``: any finite
            scores (raw logits).

    Returns:
        ``(loss [B], support size [B])``: float32 (float64 for float64 cosines, and when
        :math:`(\alpha-1)sm > 80`: the divergence terms then overflow float32) and int64.

    Example:
        >>> import torch
        >>> from marginkit.ops.classes import class_block
        >>> cos = torch.tensor([[0.9, 0.1, -0.2], [0.3, 0.35, 0.0]])
        >>> loss, support = qmargin_loss(class_block(cos, torch.tensor([0, 1])), 1.25, 35.0, 0.2)
        >>> support
        tensor([1, 2])
    """
    axis, x2d = block.axis, block.scores
    n_rows, n = x2d.shape
    cdt = compute_dtype(x2d.dtype)
    if n_rows == 0:  # empty, but connected to the graph
        return x2d.to(cdt).sum(-1), torch.zeros(0, dtype=torch.long, device=x2d.device)
    beta, scalar_alpha = _alpha_rows(alpha, block.batch_shape, cdt, x2d.device, scalar_rows=False)
    if scalar_alpha == 1.0:  # softmax(θ + log q): CosFace
        loss = class_cross_entropy(
            block, lambda c: scale * c - scale * margin, ScaledLogits(scale), name=name, cosines=cosines
        )
        return loss, torch.full_like(block.labels, axis.num_classes)
    beta_max = float(beta.detach().max()) if scalar_alpha is None else scalar_alpha - 1.0
    alpha = 1.0 + beta_max  # (for the messages)
    log_q_label = -scale * margin
    if (alpha - 1.0) * scale * margin > _F64_MAX_EXPONENT:
        # D_f(e_y, q) contains (q_y^{-β} − 1)/(αβ) = (e^{βsm} − 1)/(αβ), and p_y = 0: the loss itself
        raise ValueError(
            f"the Q-Margin loss exceeds float64's range: (alpha - 1) * scale * margin = "
            f"{(alpha - 1.0) * scale * margin:.4g} > {_F64_MAX_EXPONENT:g} "
            f"(alpha={alpha:g}, scale={scale:g}, "
            f"margin={margin:g}; the label's weight q_y = exp(-scale * margin) enters the loss as "
            "(q_y^(1 - alpha) - 1) / (alpha (alpha - 1))): lower the scale, the margin or alpha"
        )
    x2d = x2d.contiguous()
    if _offset_overflows(cdt, beta_max, log_q_label):  # e.g. α = 3, s·m ≥ 40: loss beyond float32
        x2d, cdt, beta = x2d.double(), torch.float64, None if beta is None else beta.double()
    sparse_grad = sparse_grad and x2d is block.scores
    k = None if axis.partitioned else _topk_count(topk, n)
    override = log_q_label != 0.0
    column, owned = block.column, block.owned
    beta_scalar = None if scalar_alpha is None else scalar_alpha - 1.0
    lean = owned is None and lean_eligible(n_rows, n, k, beta_scalar, bool(candidates), axis.partitioned)
    if beta is None and not lean:  # (the lean solver takes β as a number)
        assert beta_scalar is not None
        beta = beta_rows(beta_scalar, n_rows, cdt, x2d.device)
    with torch.no_grad():  # (the bounds and checks carry no gradient)
        blocks = _Blocks(x2d)
        lo_c = x2d.amin()
    with _serial(blocks.bmax.numel(), x2d.device), torch.no_grad():
        # (the lean solver takes the label's weight as a number: logq_value)
        full = override and not lean
        logq_y = torch.full((n_rows,), log_q_label, dtype=cdt, device=x2d.device) if full else None
        if lean:  # the lean solver bounds τ itself; the frame is the row maximum
            x_y = x2d[torch.arange(n_rows, device=x2d.device), column]
            (x_y,) = check_scores(block, lo_c, blocks.rowmax.amax(), name, x_y, cosines=cosines)
            shift = blocks.rowmax
            theta_y = _logits(x_y, shift, scale, cdt)
            bounds: tuple[Tensor, Tensor] | None = None
        else:
            others, x_y = _label_maxima(x2d, blocks, column, owned, override)
            others, x_y = check_scores(block, lo_c, blocks.rowmax.amax(), name, others, x_y, cosines=cosines)
            shift = torch.maximum(others, x_y)  # the row maximum over every class: the solver's frame
            lo, hi, theta_y = _label_bounds(others, x_y, scale, beta, cdt, logq_y, axis.num_classes, shift)
            bounds = (lo, hi)
        # the label's weight on the entries of this block: q = 1 (no override) on rows it does not own
        logq_label = logq_y if logq_y is None or owned is None else torch.where(owned, logq_y, 0.0)
    logq_value = log_q_label if override else None
    on = _OnAxis(axis, bounds, theta_y, logq_y, owned, shift, min(0.0, log_q_label), logq_value)
    return _LossFunction.apply(
        x2d, None, column, blocks, beta, beta_scalar, scale, logq_label, k, candidates, sparse_grad, on
    )
