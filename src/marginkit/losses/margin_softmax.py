"""Margin-softmax losses on cosine logits: NormFace, CosFace and ArcFace (SPEC §3).

All three are cross-entropy on scaled cosines whose *target* column is replaced by a
margin-penalised value ``s·f(c_y)``:

.. math::

    \\ell(c, y) = -\\log \\frac{e^{s f(c_y)}}{e^{s f(c_y)} + \\sum_{j \\ne y} e^{s c_j}}
               = \\operatorname{softplus}\\Big(\\log\\sum_{j \\ne y} e^{s c_j} - s f(c_y)\\Big)

with ``f(c) = c`` (NormFace, Wang et al. 2017), ``f(c) = c - m`` (CosFace, Wang et al. 2018)
and ``f(c) = cos(arccos(c) + m)`` (ArcFace, Deng et al. 2019, extended monotonically past
``θ = π - m``).

All three run :func:`marginkit.ops.softmax.class_cross_entropy` with the logits ``s·c`` and the
target ``s·f(c_y)``, on the class axis of their input (a ``[B, C]`` tensor, or a
:class:`~marginkit.heads.ShardedCosineHead`'s output: then the same code reduces over every
rank's classes). The margin acts on the ``B`` target cosines only and its derivative comes from
autograd on that vector, so the gradient always flows through the margin.

Numerics run in float32 (float64 for float64 input); float16/bfloat16 cosines are upcast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from marginkit._validation import REDUCTIONS, choice, positive_float, positive_int, reduce_kept
from marginkit.ops.classes import class_block
from marginkit.ops.margins import arcface_target, combined_margin_target
from marginkit.ops.softmax import ScaledLogits, class_cross_entropy

__all__ = [
    "ArcFaceLoss",
    "CombinedMarginLoss",
    "CosFaceLoss",
    "NormSoftmaxLoss",
    "SubCenterArcFaceLoss",
    "margin_softmax_loss",
]

TargetFn = Callable[[torch.Tensor], torch.Tensor]


def margin_softmax_loss(
    cosines: Any,
    labels: torch.Tensor,
    scale: float,
    target_fn: TargetFn,
    *,
    name: str = "cosines",
    ignore_index: int | None = None,
    logits: bool = False,
) -> torch.Tensor:
    """Per-example margin-softmax cross-entropy ``[B]`` (no reduction).

    .. math:: \\ell = -\\log\\frac{e^{s f(c_y)}}{e^{s f(c_y)} + \\sum_{j\\ne y} e^{s c_j}}

    Args:
        cosines: ``[B, C]`` cosines in ``[-1, 1]`` (rounding up to 1e-3 outside is accepted),
            or a :class:`~marginkit.heads.ShardedCosineHead`'s output.
        labels: ``[B]`` integer class ids in ``[0, C)``.
        scale: ``s > 0``.
        target_fn: elementwise ``f`` applied to the target cosines (unscaled), differentiable
            by autograd (its derivative is taken on the ``[B]`` target column only).
        name: argument name used in error messages.
        ignore_index: rows whose label equals it are 0 (``None``: every label must be a class).
        logits: ``True``: any finite scores (raw logits) instead of cosines.

    Returns:
        ``[B]`` losses in float32 (float64 for float64 input).
    """
    loss, keep = _per_example(cosines, labels, scale, target_fn, name, ignore_index, logits)
    return loss if keep is None else loss.masked_fill(~keep, 0.0)


def _per_example(
    cosines: Any,
    labels: torch.Tensor,
    scale: float,
    target_fn: TargetFn,
    name: str,
    ignore_index: int | None,
    logits: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The losses ``[B]`` and the rows that count (``None``: all)."""
    scale = positive_float(scale, "scale")
    block = class_block(cosines, labels, name=name, ignore_index=ignore_index)
    loss = class_cross_entropy(
        block, lambda c: scale * target_fn(c), ScaledLogits(scale), name=name, cosines=not logits
    )
    return loss, block.keep


def _identity(c: torch.Tensor) -> torch.Tensor:
    return c


class _MarginSoftmaxBase(nn.Module):
    """Shared ``forward``/validation; subclasses define :meth:`target`."""

    scale: float
    reduction: str
    reads_class_blocks: ClassVar[bool] = True  # accepts a ShardedCosineHead's output
    logits: bool = False  # raw logits instead of cosines (NormSoftmaxLoss's option)

    def __init__(self, scale: float, reduction: str, ignore_index: int | None = None) -> None:
        super().__init__()
        self.scale = positive_float(scale, "scale")
        self.reduction = choice(reduction, "reduction", REDUCTIONS)
        if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
            raise TypeError(f"ignore_index must be None or an int, got {type(ignore_index).__name__}")
        self.ignore_index = ignore_index

    def target(self, cos_y: torch.Tensor) -> torch.Tensor:
        """Unscaled target value ``f(c_y)`` (elementwise)."""
        raise NotImplementedError

    def _check_hyper(self) -> None:
        """Re-validate hyper-parameters (a schedule may have changed them)."""
        positive_float(self.scale, "scale")
        choice(self.reduction, "reduction", REDUCTIONS)

    def forward(self, cosines: Any, labels: torch.Tensor) -> torch.Tensor:
        """Loss of cosines ``[B, C]`` (e.g. from :class:`marginkit.heads.CosineHead`) and labels ``[B]``.

        Returns a scalar for ``reduction="mean"``/``"sum"``, else ``[B]``; float32 (float64 for
        float64 input) whatever the input dtype. A :class:`~marginkit.heads.ShardedCosineHead`'s
        output (with this rank's labels) gives the same loss over every rank's classes, so one
        call site ``loss(head(e), labels)`` serves both heads. Rows labelled ``ignore_index``
        count as in ``F.cross_entropy`` (0 in ``"none"``, left out of ``"sum"`` and ``"mean"``; a
        mean over no row is NaN).
        """
        self._check_hyper()
        name = "logits" if self.logits else "cosines"
        loss, keep = _per_example(
            cosines, labels, float(self.scale), self.target, name, self.ignore_index, self.logits
        )
        return reduce_kept(loss, keep, self.reduction)

    def extra_repr(self) -> str:
        items = [f"scale={self.scale}"]
        if hasattr(self, "margin"):
            items.append(f"margin={self.margin}")
        items.append(f"reduction={self.reduction!r}")
        if self.ignore_index is not None:
            items.append(f"ignore_index={self.ignore_index}")
        if self.logits:
            items.append("logits=True")
        return ", ".join(items)


class NormSoftmaxLoss(_MarginSoftmaxBase):
    """NormFace: softmax cross-entropy on scaled cosines, ``CE(s·c, y)``.

    .. math:: \\ell(c, y) = -\\log \\frac{e^{s c_y}}{\\sum_j e^{s c_j}}

    Wang, Xiang, Cheng, Yuille, "NormFace: L2 Hypersphere Embedding for Face Verification",
    ACM MM 2017. The default ``s = 30`` is a common choice for this plain (margin-free) form;
    NormFace shows ``s`` must be large enough for the softmax to saturate (its bound grows
    with ``log C``), so raise it for very many classes.

    With ``logits=True`` the input is any finite scores (raw logits, no cosine head) and
    ``scale`` defaults to 1: the loss is then ``F.cross_entropy`` on the logits.

    Defaults: ``NormSoftmaxLoss()`` keeps the ``s = 30`` above. ``marginkit train --loss softmax``
    trains with ``scale=16.0``, for the command line's small data sets (``marginkit losses`` lists
    both sets; why: ``docs/defaults.md``).

    Args:
        scale: ``s > 0`` (plain attribute: a schedule may change it between steps); default 30
            on cosines, 1 with ``logits=True``.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        ignore_index: ``None`` or a label value whose rows do not count, as in
            ``F.cross_entropy`` (0 in ``"none"``; ``"mean"`` over the other rows, NaN if none).
        logits: keyword-only; ``True`` accepts raw logits (only finiteness is checked).

    Shape: cosines ``[B, C]``, labels ``[B]`` → scalar (``[B]`` with ``"none"``).

    Example:
        >>> import torch
        >>> from marginkit.losses import NormSoftmaxLoss
        >>> cos = torch.tensor([[0.9, 0.1, -0.2], [0.0, 0.5, 0.4]])
        >>> round(float(NormSoftmaxLoss(scale=10.0)(cos, torch.tensor([0, 1]))), 4)
        0.1593
    """

    def __init__(
        self,
        scale: float | None = None,
        reduction: str = "mean",
        ignore_index: int | None = None,
        *,
        logits: bool = False,
    ) -> None:
        if not isinstance(logits, bool):
            raise TypeError(f"logits must be a bool, got {type(logits).__name__}")
        super().__init__((1.0 if logits else 30.0) if scale is None else scale, reduction, ignore_index)
        self.logits = logits

    def target(self, cos_y: torch.Tensor) -> torch.Tensor:
        return _identity(cos_y)


class _AdditiveMarginBase(_MarginSoftmaxBase):
    """A margin softmax with one additive margin ``m`` (CosFace's on the cosine, ArcFace's on the
    angle), checked by :meth:`_valid_margin` when set and again in every forward."""

    margin: float

    def __init__(self, scale: float, margin: float, reduction: str, ignore_index: int | None) -> None:
        super().__init__(scale, reduction, ignore_index)
        self.margin = self._valid_margin(margin)

    @staticmethod
    def _valid_margin(margin: Any) -> float:
        return positive_float(margin, "margin", allow_zero=True)

    def _check_hyper(self) -> None:
        super()._check_hyper()
        self._valid_margin(self.margin)


class CosFaceLoss(_AdditiveMarginBase):
    """CosFace / AM-softmax: additive cosine margin, ``CE(s·(c - m·e_y), y)``.

    .. math:: \\ell(c, y) = -\\log \\frac{e^{s (c_y - m)}}{e^{s (c_y - m)} + \\sum_{j\\ne y} e^{s c_j}}

    Wang et al., "CosFace: Large Margin Cosine Loss for Deep Face Recognition", CVPR 2018
    (arXiv 1801.09414); Wang et al., "Additive Margin Softmax", 2018. Defaults as in
    InsightFace's combined margin (SPEC §3): ``s = 64``, ``m = 0.4``.

    Defaults: ``CosFaceLoss()`` keeps InsightFace's face-recognition setting above.
    ``marginkit train --loss cosface`` trains with ``scale=16.0, margin=0.2``, for the command
    line's small data sets (``marginkit losses`` lists both sets; why: ``docs/defaults.md``).

    Args:
        scale: ``s > 0``; margin: ``m ≥ 0`` (plain attributes; a schedule may change them).
        reduction, ignore_index: as in :class:`NormSoftmaxLoss`.

    Shape: cosines ``[B, C]``, labels ``[B]`` → scalar (``[B]`` with ``"none"``).

    Example:
        >>> import torch
        >>> from marginkit.losses import CosFaceLoss
        >>> cos = torch.tensor([[0.9, 0.1, -0.2], [0.0, 0.5, 0.4]])
        >>> round(float(CosFaceLoss(scale=10.0, margin=0.2)(cos, torch.tensor([0, 1]))), 4)
        0.6646
    """

    def __init__(
        self,
        scale: float = 64.0,
        margin: float = 0.4,
        reduction: str = "mean",
        ignore_index: int | None = None,
    ) -> None:
        super().__init__(scale, margin, reduction, ignore_index)

    def target(self, cos_y: torch.Tensor) -> torch.Tensor:
        return cos_y - float(self.margin)


class ArcFaceLoss(_AdditiveMarginBase):
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

    Defaults: ``ArcFaceLoss()`` keeps the paper's face-recognition setting, ``s = 64``,
    ``m = 0.5``. ``marginkit train --loss arcface`` trains with ``scale=16.0, margin=0.2``, for
    the command line's small data sets (``marginkit losses`` lists both sets; why:
    ``docs/defaults.md``).

    Args:
        scale: ``s > 0``; margin: ``m`` in radians, ``0 ≤ m ≤ π/2`` (plain attributes).
        reduction, ignore_index: as in :class:`NormSoftmaxLoss`.

    Shape: as :class:`CosFaceLoss`.

    Example:
        >>> import torch
        >>> from marginkit.losses import ArcFaceLoss
        >>> loss = ArcFaceLoss(scale=10.0, margin=0.2)
        >>> loss.target(torch.tensor([1.0, 0.0, -1.0]))  # f(c): cos(θ + m), then c − m·sin m
        tensor([ 0.9800, -0.1987, -1.0397])
        >>> round(float(loss(torch.tensor([[0.9, 0.1, -0.2], [0.0, 0.5, 0.4]]), torch.tensor([0, 1]))), 4)
        0.5994
    """

    @staticmethod
    def _valid_margin(margin: Any) -> float:
        return _arc_margin(margin)

    def __init__(
        self,
        scale: float = 64.0,
        margin: float = 0.5,
        reduction: str = "mean",
        ignore_index: int | None = None,
    ) -> None:
        super().__init__(scale, margin, reduction, ignore_index)

    def target(self, cos_y: torch.Tensor) -> torch.Tensor:
        return arcface_target(cos_y, float(self.margin))


def _arc_margin(margin: Any) -> float:
    margin = positive_float(margin, "margin", allow_zero=True)
    if margin > math.pi / 2:
        raise ValueError(f"margin must be an angle in radians in [0, π/2], got {margin}")
    return margin


class SubCenterArcFaceLoss(ArcFaceLoss):
    """Sub-center ArcFace: ArcFace on a head with ``K`` sub-centres per class (Deng et al., ECCV 2020).

    .. math:: c_{bj} = \\max_{k < K} \\cos\\angle(e_b, w_{jk}),\\qquad
              \\ell = \\text{ArcFace}(c, y)

    Deng, Guo, Liu, Zafeiriou, "Sub-center ArcFace: Boosting Face Recognition by Large-Scale
    Noisy Web Faces", ECCV 2020. The max over a class's sub-centres is the head's
    (:class:`~marginkit.heads.CosineHead` / :class:`~marginkit.heads.ShardedCosineHead` with
    ``sub_centers=K``: the class cosine is the best sub-centre's, its gradient goes to that
    sub-centre), so this loss is :class:`ArcFaceLoss` on those cosines; ``sub_centers`` is the
    ``K`` the head is built with (the trainer reads it). Any class-level loss runs on a
    sub-centre head; with ``K = 1`` this is ArcFace.

    Defaults: ``SubCenterArcFaceLoss()`` keeps the paper's face-recognition setting, ``s = 64``,
    ``m = 0.5``, ``K = 3``. ``marginkit train --loss subcenter_arcface`` trains with
    ``scale=16.0, margin=0.2, sub_centers=3``, for the command line's small data sets
    (``marginkit losses`` lists both sets; why: ``docs/defaults.md``).

    Args:
        scale: ``s > 0``; margin: ``m`` in radians, ``0 ≤ m ≤ π/2``.
        sub_centers: ``K ≥ 1`` for the head (pytorch-metric-learning's default 3).
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.

    Shape: cosines ``[B, C]`` (the sub-centre head's), labels ``[B]`` → scalar (``[B]`` with ``"none"``).

    Example:
        >>> import torch
        >>> from marginkit.heads import CosineHead
        >>> from marginkit.losses import SubCenterArcFaceLoss
        >>> torch.manual_seed(0) and None
        >>> head = CosineHead(num_classes=10, embedding_dim=4, sub_centers=3)
        >>> e, y = torch.randn(8, 4), torch.randint(0, 10, (8,))
        >>> SubCenterArcFaceLoss(scale=30.0)(head(e), y).backward()
        >>> head.weight.shape
        torch.Size([10, 3, 4])
    """

    def __init__(
        self, scale: float = 64.0, margin: float = 0.5, sub_centers: int = 3, reduction: str = "mean"
    ) -> None:
        super().__init__(scale, margin, reduction)
        self.sub_centers = positive_int(sub_centers, "sub_centers")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sub_centers={self.sub_centers}"


class CombinedMarginLoss(_MarginSoftmaxBase):
    """InsightFace's combined margin: target logit ``s·(cos(m₁·θ_y + m₂) − m₃)``.

    .. math::

        \\ell(c, y) = -\\log \\frac{e^{s f(c_y)}}{e^{s f(c_y)} + \\sum_{j\\ne y} e^{s c_j}},
        \\qquad f(c) = \\cos(m_1 \\arccos c + m_2) - m_3

    (InsightFace / arcface_torch ``CombinedMarginLoss``; SphereFace's multiplicative ``m₁``,
    ArcFace's additive angular ``m₂``, CosFace's additive cosine ``m₃``.) Past the angle where
    ``m₁θ + m₂`` reaches ``π`` the target continues monotonically
    (:func:`marginkit.ops.margins.combined_margin_target`). ``(1, 0, m)`` is exactly
    :class:`CosFaceLoss` with margin ``m``, ``(1, m, 0)`` exactly :class:`ArcFaceLoss`.

    Defaults: ``CombinedMarginLoss()`` keeps ArcFace's face-recognition setting, ``(1, 0.5, 0)``
    at ``s = 64``. ``marginkit train --loss combined_margin`` trains with
    ``m1=1.0, m2=0.3, m3=0.2, scale=16.0``, for the command line's small data sets
    (``marginkit losses`` lists both sets; why: ``docs/defaults.md``).

    Args:
        m1: ``m₁ > 0``; m2: ``0 ≤ m₂ ≤ π/2`` (radians); m3: ``m₃ ≥ 0``; the switch angle
            ``(π − m₂)/m₁`` must be at least ``π/2`` (``m₁ ≤ 2 − 2m₂/π``), so that ``f`` is
            monotone. Plain attributes: a schedule may change them.
        scale: ``s > 0``.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.

    Shape: cosines ``[B, C]``, labels ``[B]`` → scalar (``[B]`` with ``"none"``).

    Example:
        >>> import torch
        >>> from marginkit.losses import CombinedMarginLoss
        >>> cos = torch.tensor([[0.9, 0.1, -0.2], [0.0, 0.5, 0.4]])
        >>> round(float(CombinedMarginLoss(0.9, 0.4, 0.15, scale=10.0)(cos, torch.tensor([0, 1]))), 4)
        1.6526
    """

    m1: float
    m2: float
    m3: float

    def __init__(
        self, m1: float = 1.0, m2: float = 0.5, m3: float = 0.0, scale: float = 64.0, reduction: str = "mean"
    ) -> None:
        super().__init__(scale, reduction)
        self.m1, self.m2, self.m3 = _combined_margins(m1, m2, m3)

    def _check_hyper(self) -> None:
        super()._check_hyper()
        _combined_margins(self.m1, self.m2, self.m3)

    def target(self, cos_y: torch.Tensor) -> torch.Tensor:
        return combined_margin_target(cos_y, float(self.m1), float(self.m2), float(self.m3))

    def extra_repr(self) -> str:
        return f"m1={self.m1}, m2={self.m2}, m3={self.m3}, scale={self.scale}, reduction={self.reduction!r}"


def _combined_margins(m1: Any, m2: Any, m3: Any) -> tuple[float, float, float]:
    m1 = positive_float(m1, "m1")
    m2 = positive_float(m2, "m2", allow_zero=True)
    m3 = positive_float(m3, "m3", allow_zero=True)
    if m2 > math.pi / 2:
        raise ValueError(f"m2 must be an angle in radians in [0, π/2], got {m2}")
    if (math.pi - m2) / m1 < math.pi / 2:
        raise ValueError(
            f"m1 must be at most 2 − 2·m2/π = {2 - 2 * m2 / math.pi:.4g} for m2={m2} (the target "
            f"cos(m1·θ + m2) − m3 must stay monotone in θ: its switch angle (π − m2)/m1 ≥ π/2), got m1={m1}"
        )
    return m1, m2, m3
