"""Training target built on the Margin-Enforcing Projection (SPEC §1)."""

from __future__ import annotations

import torch
from torch import nn

from marginkit._validation import REDUCTIONS, choice, compute_dtype, float_tensor, positive_float, reduce
from marginkit.ops.projection import NORMS, project

__all__ = ["MEPLoss"]


class MEPLoss(nn.Module):
    r"""Squared distance from the scores to their margin-enforcing projection.

    .. math::
        L(x) = \big\lVert x - \operatorname{sg}\!\big(\mathrm{MEP}_d(x)\big) \big\rVert_2^2
             = \sum_{c} \big(x_c - \mathrm{MEP}_d(x)_c\big)^2,
        \qquad \nabla_x L = 2\,\big(x - \mathrm{MEP}_d(x)\big),

    with :math:`\operatorname{sg}` the stop-gradient and :func:`marginkit.ops.mep` the
    projection onto :math:`\{z : \min_{i\in P} z_i - \max_{j\in N} z_j \ge m\}`. For ``"l2"``
    this is the squared Euclidean distance to a convex set. The gradient is exactly zero on
    rows that already keep the margin (and on rows with no positive or no negative): the
    loss "brakes" once the target is reached instead of pushing scores apart forever as
    cross-entropy does.

    Defaults: ``MEPLoss()`` keeps ``margin = 1`` on whatever scores it is given.
    ``marginkit train --loss mep`` trains with ``scale=16.0, margin=4.0`` (scores ``16·cos``: the
    margin is 0.25 in cosine units), for the command line's small data sets (``marginkit losses``
    lists both sets; why: ``docs/defaults.md``).

    Args:
        margin: required gap ``m > 0`` between the smallest positive and the largest negative.
        norm: ``"l2"`` (default) or ``"l1"``: which projection gives the target.
        reduction: ``"mean"`` (over rows), ``"sum"`` or ``"none"`` (one value per row).

    Shape:
        - scores: ``(B, C)`` floating (any leading dimensions ``(..., C)`` also work).
        - target: integer labels ``(B,)`` (one positive per row) or a bool mask ``(B, C)``
          (multi-label; any number of positives per row).
        - output: scalar, or ``(B,)`` with ``reduction="none"``; float32 (float64 for
          float64 scores) whatever the input precision. A value beyond that range (scores of
          1e19 in float32) is refused with a ``ValueError``, never returned as ``inf``.

    Example:
        >>> import torch
        >>> from marginkit.losses import MEPLoss
        >>> scores = torch.tensor([[2.0, 1.5, 0.0], [3.0, 0.0, 1.0]], requires_grad=True)
        >>> loss = MEPLoss(margin=1.0)(scores, torch.tensor([0, 0]))
        >>> loss.backward()
        >>> scores.grad  # 2 (x - mep(x)) / B; the second row already keeps the margin
        tensor([[-0.2500,  0.2500,  0.0000],
                [ 0.0000,  0.0000,  0.0000]])

    Reference: Su Jianlin, "Margin-Enforcing Projection", 2026 (blog post).
    """

    def __init__(self, margin: float = 1.0, norm: str = "l2", reduction: str = "mean") -> None:
        super().__init__()
        self.margin = positive_float(margin, "margin")
        self.norm = choice(norm, "norm", NORMS)
        self.reduction = choice(reduction, "reduction", REDUCTIONS)

    def forward(self, scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not isinstance(scores, torch.Tensor) and hasattr(scores, "class_block"):
            raise TypeError(
                "MEPLoss does not support a ShardedCosineHead's output: the projection needs every "
                "class of a row in one process (use a CosineHead)"
            )
        float_tensor(scores, "scores")
        x = scores.to(compute_dtype(scores.dtype))
        with torch.no_grad():
            # the target in the working precision (float16 inputs are not rounded twice)
            projected = project(x.detach(), target, self.margin, self.norm, positives_name="target")
        per_row = (x - projected).square().sum(-1)
        if per_row.numel() and not bool(torch.isfinite(per_row.detach()).all()):
            top = float(x.detach().abs().max())
            raise ValueError(
                f"MEPLoss overflows {str(x.dtype).removeprefix('torch.')}: the squared distance of the "
                f"scores (|value| up to {top:.3g}) to their projection exceeds its range; scale the "
                "scores and the margin down, or pass float64 scores"
            )
        return reduce(per_row, self.reduction)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, norm={self.norm!r}, reduction={self.reduction!r}"
