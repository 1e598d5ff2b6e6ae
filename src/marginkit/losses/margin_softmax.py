"""Margin-softmax losses on cosine logits: NormFace, CosFace and ArcFace (SPEC §3).

All three are cross-entropy on scaled cosines whose *target* column is replaced by a
margin-penalised value ``s·f(c_y)``:

.. math::

    \\ell(c, y) = -\\log \\frac{e^{s f(c_y)}}{e^{s f(c_y)} + \\sum_{j \\ne y} e^{s c_j}}
               = \\operatorname{softplus}\\Big(\\log\\sum_{j \\ne y} e^{s c_j} - s f(c_y)\\Big)

with ``f(c) = c`` (NormFace, Wang et al. 2017), ``f(c) = c - m`` (CosFace, Wang et al. 2018)
and ``f(c) = cos(arccos(c) + m)`` (ArcFace, Deng et al. 2019, extended monotonically past
``θ = π - m``).

Implementation (one fused autograd function shared by the three losses):

- one ``[B, C]`` buffer per call: the forward pass writes the logits into it (``s·c``, the
  target column replaced by ``s·f(c_y)``), takes the exact row max, exponentiates in place
  and sums; the backward pass scales the same buffer in place into the gradient ``s·p_j·g``
  and writes the target column. ``F.cross_entropy`` on margin-modified logits allocates about
  five ``[B, C]`` tensors for the same work; on CPU each fresh allocation's page faults cost
  more than the arithmetic (docs/throughput.md);
- the margin function ``f`` acts on the ``B`` target cosines only, and its derivative is taken
  by autograd on that ``[B]`` vector, so the gradient always flows through the margin;
- the class-dimension reductions are separate small steps (:func:`_target_gather`,
  :func:`_shifted_exp` for the row max, :func:`_rest_sum`): a sharded head (each rank
  owning a slice of classes) only has to all-reduce the row max (MAX) and the rest-sum (SUM)
  and fetch the target cosine from its owner; the backward pass stays local.

Numerics run in float32 (float64 for float64 input); float16/bfloat16 cosines are upcast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from marginkit._sharded import ShardedCosines, sharded_loss
from marginkit._validation import (
    REDUCTIONS,
    choice,
    compute_dtype,
    cosine_range,
    label_tensor,
    positive_float,
    reduce,
    same_batch,
)

__all__ = ["ArcFaceLoss", "CosFaceLoss", "NormSoftmaxLoss", "margin_softmax_loss"]

TargetFn = Callable[[torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------
# Class-dimension steps (kept separate so that a sharded variant can all-reduce each one).
# ----------------------------------------------------------------------------------------
def _check_cosine_layout(cosines: Any, name: str) -> None:
    """Type and shape of a ``[B, C]`` cosine matrix (no pass over the data)."""
    if not isinstance(cosines, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cosines).__name__}")
    if not torch.is_floating_point(cosines):
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {cosines.dtype}")
    if cosines.dim() != 2:
        raise ValueError(f"{name} must have shape [batch, num_classes], got shape {tuple(cosines.shape)}")
    if cosines.shape[1] == 0:
        raise ValueError(f"{name} must have a non-empty class dimension, got shape {tuple(cosines.shape)}")


def _target_gather(cos: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``c_y`` for every row (``index`` is ``labels[:, None]``). Sharded: from the owning rank."""
    return cos.gather(1, index).squeeze(1)


def _shifted_exp(
    cos: torch.Tensor, index: torch.Tensor, scale: float, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``buf = exp(logit - shift)`` with the target column zeroed, and the row max ``shift``.

    The logits are ``s·c_j`` (``j ≠ y``) and ``t = s·f(c_y)`` (``j = y``); ``shift`` is their
    exact row max, so ``buf ≤ 1``, the largest term is 1 and the normaliser lies in ``[1, C]``
    whatever the scale and margin (a shift of ``s·max_j c_j`` would be off by up to
    ``s·(c_y - f(c_y))`` when the target is the row max, enough to underflow every other term
    at large ``s·m``). One ``[B, C]`` buffer, reused in place by the backward pass.
    Sharded: ``shift`` is all-reduced (MAX) before the ``exp``.
    """
    buf = torch.mul(cos, scale)
    buf.scatter_(1, index, target.unsqueeze(1))
    shift = buf.amax(dim=1)
    buf.sub_(shift.unsqueeze(1)).exp_()
    buf.scatter_(1, index, 0.0)  # zeroed, not subtracted later: no cancellation when p_y → 1
    return buf, shift


def _rest_sum(buf: torch.Tensor) -> torch.Tensor:
    """``Σ_{j≠y} exp(s·c_j - shift)``. Sharded: all-reduce (SUM) across the class slices."""
    return buf.sum(dim=1)


class _MarginSoftmaxCE(torch.autograd.Function):
    """Per-example ``-log p_y`` for the logits ``s·c_j`` (``j ≠ y``), ``s·f(c_y)`` (``j = y``).

    Gradient: ``s·p_j`` for ``j ≠ y`` and ``-(1 - p_y)·s·f'(c_y)`` for the target column.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        cos: torch.Tensor,
        labels: torch.Tensor,
        scale: float,
        target_fn: TargetFn,
        name: str,
    ) -> torch.Tensor:
        index = labels.unsqueeze(1)
        cos_y = _target_gather(cos, index)
        # f acts on the B target cosines only; its derivative comes from autograd on that vector.
        with torch.enable_grad():
            c_leaf = cos_y.detach().requires_grad_(True)
            f_y = target_fn(c_leaf)
            (df_y,) = torch.autograd.grad(f_y, c_leaf, torch.ones_like(f_y))
        target = scale * f_y.detach()
        lo = cos.amin()
        buf, shift = _shifted_exp(cos, index, scale, target)
        # the extremes from reductions done anyway plus one amin pass (no full check)
        cosine_range(lo, torch.maximum(shift.max() / scale, cos_y.max()), name)
        rest = _rest_sum(buf)
        inv_total = (rest + torch.exp(target - shift)).reciprocal()  # total ∈ [1, C]
        z = rest.log() + shift - target  # log Σ_{j≠y} e^{logit_j} - t  (-inf if C = 1)
        # -log p_y = log(1 + e^z) = max(z, 0) + log1p(e^-|z|): exact at both ends (F.softplus
        # returns z itself above its threshold 20, an error of e^-20 relative)
        loss = torch.logaddexp(z, torch.zeros_like(z))
        # ∂loss/∂c_y = -(1 - p_y)·s·f'(c_y), with 1 - p_y = sigmoid(z): no cancellation
        d_target = torch.sigmoid(z) * df_y * scale
        ctx.save_for_backward(cos, index, shift, inv_total, d_target)
        ctx.scale = scale
        # The forward buffer becomes the gradient in place (first backward only; a second
        # backward with retain_graph=True recomputes it from the saved cosines).
        ctx.buf = buf if ctx.needs_input_grad[0] else None
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        cos, index, shift, inv_total, d_target = ctx.saved_tensors
        scale = ctx.scale
        grad = grad.to(cos.dtype)
        buf, ctx.buf = ctx.buf, None
        if buf is None:  # p_j·total = exp(s·c_j - shift), the same ops as the forward pass (so
            # bitwise equal); the target column is overwritten below
            buf = torch.mul(cos, scale).sub_(shift.unsqueeze(1)).exp_()
        grad_cos = buf.mul_((grad * scale * inv_total).unsqueeze(1))  # s·p_j·g
        grad_cos.scatter_(1, index, (-grad * d_target).unsqueeze(1))
        return grad_cos, None, None, None, None


def margin_softmax_loss(
    cosines: torch.Tensor,
    labels: torch.Tensor,
    scale: float,
    target_fn: TargetFn,
    *,
    name: str = "cosines",
) -> torch.Tensor:
    """Per-example margin-softmax cross-entropy ``[B]`` (no reduction).

    .. math:: \\ell = -\\log\\frac{e^{s f(c_y)}}{e^{s f(c_y)} + \\sum_{j\\ne y} e^{s c_j}}

    Args:
        cosines: ``[B, C]`` cosines in ``[-1, 1]`` (rounding up to 1e-3 outside is accepted).
        labels: ``[B]`` integer class ids in ``[0, C)``.
        scale: ``s > 0``.
        target_fn: elementwise ``f`` applied to the target cosines (unscaled), differentiable
            by autograd (its derivative is taken on the ``[B]`` target column only).
        name: argument name used in error messages.

    Returns:
        ``[B]`` losses in float32 (float64 for float64 input).
    """
    scale = positive_float(scale, "scale")
    _check_cosine_layout(cosines, name)
    label_tensor(labels, "labels")  # type first, so that a list gets a TypeError
    same_batch(cosines, name, labels, "labels")
    label_tensor(labels, "labels", shape=(cosines.shape[0],), num_classes=cosines.shape[1])
    cos = cosines.to(compute_dtype(cosines.dtype))
    labels = labels.to(device=cos.device, dtype=torch.long)  # gather/scatter need int64
    if cos.shape[0] == 0:
        return cos.sum(dim=1)  # empty, connected to the graph
    return _MarginSoftmaxCE.apply(cos, labels, scale, target_fn, name)


def _identity(c: torch.Tensor) -> torch.Tensor:
    return c


def _wide(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float64 where the device has it (not MPS): for the ``[B]`` target column only."""
    return dtype if device.type == "mps" else torch.float64


def _arcface_target(c: torch.Tensor, margin: float) -> torch.Tensor:
    """``cos(θ + m)`` while ``c > cos(π - m)`` (``θ = arccos c``), else ``c - m·sin(m)``.

    ``cos(θ + m) = c·cos(m) - sin(θ)·sin(m)`` with ``sin(θ) = sqrt((1 - c)(1 + c))``: no
    ``arccos`` (whose derivative is infinite at ``c = ±1``). The radicand is clamped at the
    INPUT dtype's machine epsilon, i.e. ``c = ±1`` is treated, inside the sqrt only, as its
    nearest representable neighbour: the derivative ``cos(m) + c·sin(m)/sin(θ)`` stays finite
    everywhere (at most ``≈ 1 + sin(m)/sqrt(eps)``, 1.4e3 in float32 at m = 0.5), the value
    error is at most ``sqrt(eps)·sin(m)`` (1.7e-4 in float32, where one ulp of ``c`` below 1
    already moves ``θ`` by 3.5e-4). Both branches are finite everywhere, so the unselected
    branch of ``torch.where`` never leaks a NaN into the gradient.

    Evaluated in float64 (B values only) and rounded to the input dtype: rounding is monotone,
    so the float32 target logit is monotone too; a float32 evaluation is not, by an ulp or
    two, near the switch point where the slope is zero.
    """
    eps = torch.finfo(c.dtype).eps
    x = c.to(_wide(c.dtype, c.device))
    sin_theta = ((1 - x) * (1 + x)).clamp_min(eps).sqrt()
    cos_m, sin_m = math.cos(margin), math.sin(margin)
    arc = x * cos_m - sin_theta * sin_m
    return torch.where(x > math.cos(math.pi - margin), arc, x - margin * sin_m).to(c.dtype)


class _MarginSoftmaxBase(nn.Module):
    """Shared ``forward``/validation; subclasses define :meth:`target`."""

    scale: float
    reduction: str

    def __init__(self, scale: float, reduction: str) -> None:
        super().__init__()
        self.scale = positive_float(scale, "scale")
        self.reduction = choice(reduction, "reduction", REDUCTIONS)

    def target(self, cos_y: torch.Tensor) -> torch.Tensor:
        """Unscaled target value ``f(c_y)`` (elementwise)."""
        raise NotImplementedError

    def _check_hyper(self) -> None:
        """Re-validate hyper-parameters (a schedule may have changed them)."""
        positive_float(self.scale, "scale")
        choice(self.reduction, "reduction", REDUCTIONS)

    def forward(self, cosines: torch.Tensor | ShardedCosines, labels: torch.Tensor) -> torch.Tensor:
        """Loss of cosines ``[B, C]`` (e.g. from :class:`marginkit.heads.CosineHead`) and labels ``[B]``.

        Returns a scalar for ``reduction="mean"``/``"sum"``, else ``[B]``; float32 (float64 for
        float64 input) whatever the input dtype. A :class:`~marginkit.heads.ShardedCosineHead`'s
        output runs the class-sharded version of the same loss (``marginkit._sharded``), so one
        call site ``loss(head(e), labels)`` serves both heads.
        """
        if isinstance(cosines, ShardedCosines):
            return sharded_loss(self, cosines, labels)
        self._check_hyper()
        loss = margin_softmax_loss(cosines, labels, float(self.scale), self.target)
        return reduce(loss, self.reduction)

    def extra_repr(self) -> str:
        items = [f"scale={self.scale}"]
        if hasattr(self, "margin"):
            items.append(f"margin={self.margin}")
        items.append(f"reduction={self.reduction!r}")
        return ", ".join(items)


class NormSoftmaxLoss(_MarginSoftmaxBase):
    """NormFace: softmax cross-entropy on scaled cosines, ``CE(s·c, y)``.

    .. math:: \\ell(c, y) = -\\log \\frac{e^{s c_y}}{\\sum_j e^{s c_j}}

    Wang, Xiang, Cheng, Yuille, "NormFace: L2 Hypersphere Embedding for Face Verification",
    ACM MM 2017. The default ``s = 30`` is a common choice for this plain (margin-free) form;
    NormFace shows ``s`` must be large enough for the softmax to saturate (its bound grows
    with ``log C``), so raise it for very many classes.

    Args:
        scale: ``s > 0`` (plain attribute: a schedule may change it between steps).
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.

    Shape: cosines ``[B, C]``, labels ``[B]`` → scalar (``[B]`` with ``"none"``).

    Example:
        >>> import torch
        >>> from marginkit.losses import NormSoftmaxLoss
        >>> cos = torch.tensor([[0.9, 0.1, -0.2], [0.0, 0.5, 0.4]])
        >>> round(float(NormSoftmaxLoss(scale=10.0)(cos, torch.tensor([0, 1]))), 4)
        0.1593
    """

    def __init__(self, scale: float = 30.0, reduction: str = "mean") -> None:
        super().__init__(scale, reduction)

    def target(self, cos_y: torch.Tensor) -> torch.Tensor:
        return _identity(cos_y)


class CosFaceLoss(_MarginSoftmaxBase):
    """CosFace / AM-softmax: additive cosine margin, ``CE(s·(c - m·e_y), y)``.

    .. math:: \\ell(c, y) = -\\log \\frac{e^{s (c_y - m)}}{e^{s (c_y - m)} + \\sum_{j\\ne y} e^{s c_j}}

    Wang et al., "CosFace: Large Margin Cosine Loss for Deep Face Recognition", CVPR 2018
    (arXiv 1801.09414); Wang et al., "Additive Margin Softmax", 2018. Defaults as in
    InsightFace's combined margin (SPEC §3): ``s = 64``, ``m = 0.4``.

    Args:
        scale: ``s > 0``; margin: ``m ≥ 0`` (plain attributes; a schedule may change them).
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.

    Shape: cosines ``[B, C]``, labels ``[B]`` → scalar (``[B]`` with ``"none"``).

    Example:
        >>> import torch
        >>> from marginkit.losses import CosFaceLoss
        >>> cos = torch.tensor([[0.9, 0.1, -0.2], [0.0, 0.5, 0.4]])
        >>> round(float(CosFaceLoss(scale=10.0, margin=0.2)(cos, torch.tensor([0, 1]))), 4)
        0.6646
    """

    margin: float

    def __init__(self, scale: float = 64.0, margin: float = 0.4, reduction: str = "mean") -> None:
        super().__init__(scale, reduction)
        self.margin = positive_float(margin, "margin", allow_zero=True)

    def _check_hyper(self) -> None:
        super()._check_hyper()
        positive_float(self.margin, "margin", allow_zero=True)

    def target(self, cos_y: torch.Tensor) -> torch.Tensor:
        return cos_y - float(self.margin)


class ArcFaceLoss(_MarginSoftmaxBase):
    """ArcFace: additive angular margin, target logit ``s·cos(θ_y + m)``, ``θ_y = arccos(c_y)``.

    .. math::

        f(c_y) = \\begin{cases} \\cos(\\theta_y + m) & c_y > \\cos(\\pi - m)\\\\
                               c_y - m \\sin m & \\text{otherwise} \\end{cases}
        \\qquad \\ell = -\\log \\frac{e^{s f(c_y)}}{e^{s f(c_y)} + \\sum_{j\\ne y} e^{s c_j}}

    Deng, Guo, Xue, Zafeiriou, "ArcFace: Additive Angular Margin Loss for Deep Face
    Recognition", CVPR 2019 (arXiv 1801.07698); the extension past ``θ = π - m`` is the rule
    of the authors' code (InsightFace), SPEC §3. ``f`` is increasing in ``c`` (decreasing in
    ``θ``) on all of ``[-1, 1]``: on the first branch ``cos(θ + m)`` falls from ``cos m`` to
    ``-1``; at the switch it jumps down to ``-cos m - m·sin m ≤ -1`` (``cos m + m·sin m`` is
    increasing on ``[0, π/2]`` from 1), then the second branch is increasing in ``c``. That
    is why ``margin`` is limited to ``[0, π/2]`` (beyond ≈ 2.33 the jump goes the wrong way).

    The margin is inside the gradient (not applied under ``no_grad`` as in one popular
    implementation), and the derivative is finite at ``c = ±1`` and at the switch point: no
    ``arccos`` is used (``cos(θ + m) = c·cos m - sqrt(1 - c²)·sin m``, radicand clamped at
    machine epsilon).

    Args:
        scale: ``s > 0``; margin: ``m`` in radians, ``0 ≤ m ≤ π/2`` (plain attributes).
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.

    Shape: cosines ``[B, C]``, labels ``[B]`` → scalar (``[B]`` with ``"none"``).

    Example:
        >>> import torch
        >>> from marginkit.losses import ArcFaceLoss
        >>> cos = torch.tensor([[0.9, 0.1, -0.2], [0.0, 0.5, 0.4]])
        >>> round(float(ArcFaceLoss(scale=10.0, margin=0.2)(cos, torch.tensor([0, 1]))), 4)
        0.5994
    """

    margin: float

    def __init__(self, scale: float = 64.0, margin: float = 0.5, reduction: str = "mean") -> None:
        super().__init__(scale, reduction)
        self.margin = _arc_margin(margin)

    def _check_hyper(self) -> None:
        super()._check_hyper()
        _arc_margin(self.margin)

    def target(self, cos_y: torch.Tensor) -> torch.Tensor:
        return _arcface_target(cos_y, float(self.margin))


def _arc_margin(margin: Any) -> float:
    margin = positive_float(margin, "margin", allow_zero=True)
    if margin > math.pi / 2:
        raise ValueError(f"margin must be an angle in radians in [0, π/2], got {margin}")
    return margin
