r"""Softmax cross-entropy over a class axis, with its own target logit: the margin-softmax family.

.. math::

    \ell = -\log \frac{e^{t(c_y)}}{e^{t(c_y)} + \sum_{j \ne y} e^{z(c_j)}}
         = \operatorname{softplus}\Big(\log\sum_{j \ne y} e^{z(c_j)} - t(c_y)\Big)

for scores ``c`` (cosines), a logit map ``z`` of the non-target classes (``s·c`` for NormFace /
CosFace / ArcFace, the circle logits for the class-level circle loss) and a target function
``t`` of the label's score (``s·f(c_y)`` with the margin ``f``). One implementation, run on the
:class:`~marginkit.ops.classes.ClassAxis` of a :class:`~marginkit.ops.classes.ClassBlock`:

- one ``[B, C_b]`` buffer: the forward pass writes the non-target logits into it (the label's
  column ``-inf``), takes their row maximum, exponentiates in place and sums; the backward pass
  scales the same buffer in place into the gradient ``p_j·z'(c_j)·g`` and writes the target
  column. ``F.cross_entropy`` on margin-modified logits allocates about five such tensors; on
  CPU each fresh allocation's page faults cost more than the arithmetic (docs/throughput.md);
- two reductions over the classes: one MAX (the largest non-target logit, the label's score
  from the block that holds it, and the per-process input flags) and one SUM (the
  exponentials). On a sharded axis they are the two all-reduces of PartialFC's scheme
  (insightface ``partial_fc_v2.py``, whose third, the target probability, is folded into the
  MAX); the backward pass needs no communication;
- the target function acts on the ``B`` label scores only, and its derivative is taken by
  autograd on that ``[B]`` vector, so the gradient always flows through the margin.
  ``shift = max(rest_max, t)`` is the exact row maximum of all logits, so the normaliser lies in
  ``[1, C]`` whatever the scale and margin.

Numerics run in float32 (float64 for float64 input); float16/bfloat16 scores are upcast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from marginkit._validation import COSINE_ATOL, check_flag, compute_dtype, cosine_range
from marginkit.ops.classes import ClassBlock, target_entry, write_target

__all__ = ["LogitMap", "ScaledLogits", "class_cross_entropy"]

TargetFn = Callable[[Tensor], Tensor]


class LogitMap(Protocol):
    """The logits of the non-target classes as an elementwise map of the scores."""

    def values(self, cos: Tensor) -> Tensor:
        """``z(c)`` as a new tensor (no autograd: used inside the op)."""
        ...

    def slope(self, cos: Tensor) -> Tensor | float:
        """``z'(c)``: a float when it is constant."""
        ...

    def extremes(self, cos: Tensor, rest_max: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """Minimum and maximum of the scores (to check them), from reductions done anyway if possible."""
        ...


class ScaledLogits:
    """``z = s·c`` (NormFace, CosFace, ArcFace)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def values(self, cos: Tensor) -> Tensor:
        return torch.mul(cos, self.scale)

    def slope(self, cos: Tensor) -> float:
        return self.scale

    def extremes(self, cos: Tensor, rest_max: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        # the maximum is recovered from the logits' row maxima: one pass (the minimum) instead of two
        return cos.amin(), torch.maximum(rest_max.max() / self.scale, target.max())


def _outside(lo: Tensor, hi: Tensor, cosines: bool = True) -> Tensor:
    """Are the extremes NaN/inf or (``cosines``) outside ``[-1, 1]`` (up to rounding)? A 0-d bool tensor."""
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    if not cosines:
        return ~finite
    return ~(finite & (lo >= -1 - COSINE_ATOL) & (hi <= 1 + COSINE_ATOL))


def _sharded_message(name: str, cosines: bool = True) -> Callable[[str], str]:
    def message(where: str) -> str:
        if not cosines:
            return f"{name} must be finite{where}: NaN or infinite values"
        return (
            f"{name} must be finite cosines in [-1, 1] (up to rounding){where}: NaN/inf or out-of-range "
            "values (check the embeddings and the class centres)"
        )

    return message


def _finite_range(lo: Tensor, hi: Tensor, name: str) -> None:
    finite = torch.isfinite(lo.detach()) & torch.isfinite(hi.detach())
    check_flag(f"{name} values", ~finite, lambda: f"{name} contains NaN or infinite values")


def check_scores(
    block: ClassBlock, lo: Tensor, hi: Tensor, name: str, *parts: Tensor, cosines: bool = True
) -> tuple[Tensor, ...]:
    """The first MAX reduction of a loss, with the check of the scores folded into it.

    ``lo``/``hi`` are this block's score extremes; ``parts`` are MAX-reduced with the flags and
    returned reduced. Every process raises the same error if any process's scores are not
    cosines (one process: :func:`marginkit._validation.cosine_range`'s detailed error), or, with
    ``cosines=False`` (raw logits), not finite.
    """
    axis = block.axis
    flags = axis.flags(lambda: _outside(lo, hi, cosines), parts[0].dtype)
    if flags is None:
        reduced = axis.max_(*parts)
    else:
        *reduced, flags = axis.max_(*parts, flags)
    local = (lambda: cosine_range(lo, hi, name)) if cosines else (lambda: _finite_range(lo, hi, name))
    axis.raise_flagged(flags, local, _sharded_message(name, cosines))
    return tuple(reduced)


class _CrossEntropy(torch.autograd.Function):
    """Per-example ``-log p_y`` over every class of the axis, ``[B]`` (the same on every process)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        cos: Tensor,
        block: ClassBlock,
        logits: LogitMap,
        target_fn: TargetFn,
        name: str,
        cosines: bool = True,
    ) -> Tensor:
        column, owned = block.column, block.owned
        c_y = target_entry(cos, column, owned)
        buf = logits.values(cos)
        write_target(buf, column, owned, -math.inf)  # the label's column out of the max and the sum
        rest_max = buf.amax(dim=1)
        lo, hi = logits.extremes(cos, rest_max, c_y)
        rest_max, c_y = check_scores(block, lo, hi, name, rest_max, c_y, cosines=cosines)
        with torch.enable_grad():  # the margin's derivative: autograd on the [B] label scores
            leaf = c_y.detach().requires_grad_(True)
            t_val = target_fn(leaf)
            (dt,) = torch.autograd.grad(t_val, leaf, torch.ones_like(t_val))
        t = t_val.detach().to(cos.dtype)
        shift = torch.maximum(rest_max, t)
        buf.sub_(shift.unsqueeze(1)).exp_()  # the label's column is exp(-inf) = 0
        (rest,) = block.axis.sum_(buf.sum(dim=1))
        z = rest.log() + shift - t  # log Σ_{j≠y} e^{z_j} − t  (−inf with one class)
        # −log p_y = log(1 + e^z): exact at both ends (F.softplus returns z itself above its
        # threshold 20, an error of e^−20 relative)
        loss = torch.logaddexp(z, torch.zeros_like(z))
        inv_total = (rest + torch.exp(t - shift)).reciprocal()  # total ∈ [1, C]
        d_target = torch.sigmoid(z) * dt.to(cos.dtype)  # (1 − p_y)·t'(c_y), no cancellation
        ctx.save_for_backward(cos, column, owned, shift, inv_total, d_target)
        ctx.logits = logits
        # the forward buffer becomes the gradient in place (first backward only; a second
        # backward with retain_graph=True recomputes it from the saved scores)
        ctx.buf = buf if ctx.needs_input_grad[0] else None
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        cos, column, owned, shift, inv_total, d_target = ctx.saved_tensors
        logits: LogitMap = ctx.logits
        grad = grad.to(cos.dtype)
        buf, ctx.buf = ctx.buf, None
        if buf is None:  # p_j·total = exp(z_j − shift): the same ops as the forward pass
            buf = logits.values(cos).sub_(shift.unsqueeze(1)).exp_()
        slope = logits.slope(cos)
        if isinstance(slope, float):
            grad_cos = buf.mul_((grad * slope * inv_total).unsqueeze(1))  # p_j·z'·g
        else:
            grad_cos = buf.mul_((grad * inv_total).unsqueeze(1)).mul_(slope)
        write_target(grad_cos, column, owned, -grad * d_target)
        return grad_cos, None, None, None, None, None


def class_cross_entropy(
    block: ClassBlock, target: TargetFn, logits: LogitMap, *, name: str = "cosines", cosines: bool = True
) -> Tensor:
    r"""Per-example softmax cross-entropy with target logit ``target(c_y)``, ``[B]`` (no reduction).

    .. math:: \ell = -\log\frac{e^{t(c_y)}}{e^{t(c_y)} + \sum_{j\ne y} e^{z(c_j)}}

    Args:
        block: the scores (cosines in ``[-1, 1]``; rounding up to 1e-3 outside is accepted),
            labels and class axis (:func:`marginkit.ops.classes.class_block`).
        target: ``t``, elementwise on the ``[B]`` label scores, differentiable by autograd.
        logits: ``z`` of the other classes (:class:`ScaledLogits`,
            :class:`marginkit.ops.circle.CircleNegatives`).
        name: the scores' name in error messages.
        cosines: ``True``: the scores must be cosines in ``[-1, 1]``; ``False``: any finite
            scores (raw logits, e.g. ``NormSoftmaxLoss(logits=True)``).

    Returns:
        ``[B]`` losses in float32 (float64 for float64 scores), the same on every process of a
        sharded axis.

    Example:
        >>> import torch
        >>> from marginkit.ops.classes import class_block
        >>> cos = torch.tensor([[0.9, 0.1, -0.2], [0.0, 0.5, 0.4]])
        >>> block = class_block(cos, torch.tensor([0, 1]))
        >>> class_cross_entropy(block, lambda c: 10.0 * (c - 0.2), ScaledLogits(10.0))
        tensor([0.0026, 1.3266])
    """
    cos = block.scores.to(compute_dtype(block.scores.dtype))
    if cos.shape[0] == 0:
        return cos.sum(dim=1)  # empty, connected to the graph
    return _CrossEntropy.apply(cos, block, logits, target, name, cosines)
