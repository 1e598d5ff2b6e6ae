"""AdaFace: a margin that adapts to the feature norm (Kim, Jain, Liu, CVPR 2022).

The norm ``‖z‖`` of an embedding (before normalisation) is a proxy of the sample's image
quality. AdaFace normalises it with running batch statistics, ``ẑ = clip(h·(‖z‖ − μ)/(σ + ε),
−1, 1)``, and gives each row the target logit ``s·(cos(θ_y + g_angle) − g_add)`` with
``g_angle = −m·ẑ`` and ``g_add = m·ẑ + m`` (:func:`marginkit.ops.margins.adaface_target`):
hard, low-quality rows (small norm) are emphasised less. The cross-entropy is
:func:`marginkit.ops.softmax.class_cross_entropy` on the class axis of the input, so a
:class:`~marginkit.heads.ShardedCosineHead`'s output gives the loss over every rank's classes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from marginkit._validation import REDUCTIONS, choice, float_tensor, positive_float, real, reduce
from marginkit.ops.classes import class_block
from marginkit.ops.margins import adaface_norm_scores, adaface_target
from marginkit.ops.softmax import ScaledLogits, class_cross_entropy

__all__ = ["AdaFaceLoss"]

#: The authors' clip of the norms before their statistics (for stability).
NORM_RANGE = (1e-3, 100.0)


class AdaFaceLoss(nn.Module):
    r"""AdaFace: margin-softmax whose margin depends on each embedding's norm.

    .. math::

        \hat z = \operatorname{clip}\Big(h\,\frac{\lVert z\rVert - \mu}{\sigma + \varepsilon}, -1, 1\Big),
        \qquad f(c_y) = \cos\big(\operatorname{clip}(\theta_y - m\hat z, 0, \pi)\big) - (m\hat z + m),

        \ell = -\log \frac{e^{s f(c_y)}}{e^{s f(c_y)} + \sum_{j\ne y} e^{s c_j}}

    Kim, Jain, Liu, "AdaFace: Quality Adaptive Margin for Face Recognition", CVPR 2022
    (arXiv 2204.00964), eqs. 8–10; defaults as the paper's (``m = 0.4``, ``h = 0.333``,
    ``s = 64``, EMA momentum ``t_alpha = 0.01``). ``μ, σ`` are running means (buffers
    ``batch_mean``/``batch_std``, initialised to 20 and 100 as the authors' code) of the batch
    mean and standard deviation of the norms (clipped to ``[1e-3, 100]``), updated in training
    mode before they are used; the norms are detached (no gradient through the margin's
    statistics), as in the authors' code.

    The norms come with the input: ``CosineHead(...)(e, with_norms=True)`` (a
    :class:`~marginkit.heads.NormedCosines`), or a :class:`~marginkit.heads.ShardedCosineHead`'s
    output (the norms of the global batch: every rank computes the same statistics), or the
    ``norms`` argument. The embeddings must not be normalised before the head.

    Defaults: ``AdaFaceLoss()`` keeps the authors' face-recognition setting, ``s = 64``,
    ``m = 0.4``. ``marginkit train --loss adaface`` trains with ``scale=16.0, margin=0.4``, for
    the command line's small data sets (``marginkit losses`` lists both sets; why:
    ``docs/defaults.md``).

    Args:
        scale: ``s > 0``; margin: ``m ≥ 0``; h: ``h > 0``; t_alpha: EMA momentum in ``(0, 1]``
            (1: this batch's statistics only); eps: ``ε > 0`` added to ``σ``.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.

    Shape: cosines ``[B, C]`` (or a head output carrying norms), labels ``[B]``, norms ``[B]``
    → scalar (``[B]`` with ``"none"``), float32 (float64 for float64 cosines).

    Example:
        >>> import torch
        >>> from marginkit.losses import AdaFaceLoss
        >>> cos = torch.tensor([[0.9, 0.1, -0.2], [0.0, 0.5, 0.4]])
        >>> loss = AdaFaceLoss(scale=10.0, t_alpha=1.0, reduction="none")
        >>> loss(cos, torch.tensor([0, 1]), norms=torch.tensor([20.0, 5.0]))  # or head(e, with_norms=True)
        tensor([0.0335, 2.9658])
    """

    reads_class_blocks: ClassVar[bool] = True  # accepts a ShardedCosineHead's output
    batch_mean: Tensor
    batch_std: Tensor

    def __init__(
        self,
        scale: float = 64.0,
        margin: float = 0.4,
        h: float = 0.333,
        t_alpha: float = 0.01,
        eps: float = 1e-3,
        reduction: str = "mean",
    ) -> None:
        super().__init__()
        self.scale = positive_float(scale, "scale")
        self.margin = positive_float(margin, "margin", allow_zero=True)
        self.h = positive_float(h, "h")
        self.t_alpha = real(t_alpha, "t_alpha", low=0, high=1, open_low=True)
        self.eps = positive_float(eps, "eps")
        self.reduction = choice(reduction, "reduction", REDUCTIONS)
        self.register_buffer("batch_mean", torch.tensor(20.0, dtype=torch.float64))
        self.register_buffer("batch_std", torch.tensor(100.0, dtype=torch.float64))

    def extra_repr(self) -> str:
        return (
            f"scale={self.scale}, margin={self.margin}, h={self.h}, t_alpha={self.t_alpha}, "
            f"eps={self.eps}, reduction={self.reduction!r}"
        )

    def norm_scores(self, norms: Tensor) -> Tensor:
        """``ẑ`` of these norms ``[B]``; in training mode the running statistics are updated first."""
        safe = norms.detach().clamp(*NORM_RANGE)
        mean = self.batch_mean.to(safe.dtype)
        std = self.batch_std.to(safe.dtype)
        if self.training and safe.numel():
            with torch.no_grad():
                spread = safe.std() if safe.numel() > 1 else torch.zeros((), dtype=safe.dtype)
                mean = self.t_alpha * safe.mean() + (1 - self.t_alpha) * mean
                std = self.t_alpha * spread + (1 - self.t_alpha) * std
                self.batch_mean.copy_(mean)
                self.batch_std.copy_(std)
        return adaface_norm_scores(safe, mean, std, self.h, self.eps)

    def forward(self, cosines: Any, labels: Tensor, norms: Tensor | None = None) -> Tensor:
        """Loss of a head's output (cosines ``[B, C]`` and the embedding norms) and labels ``[B]``."""
        scale = positive_float(self.scale, "scale")
        margin = positive_float(self.margin, "margin", allow_zero=True)
        if norms is None:
            norms = getattr(cosines, "norms", None)
            if norms is None:
                raise ValueError(
                    "AdaFaceLoss needs the embedding norms: pass head(e, with_norms=True) (a CosineHead's "
                    "NormedCosines), a ShardedCosineHead's output, or norms=[B] explicitly"
                )
        block = class_block(cosines, labels)
        float_tensor(norms, "norms", min_dim=1, allow_empty=True)
        if tuple(norms.shape) != (block.scores.shape[0],):
            raise ValueError(
                f"norms must have shape ({block.scores.shape[0]},) (one per row of the batch), "
                f"got shape {tuple(norms.shape)}"
            )
        if bool((norms < 0).any()):
            raise ValueError("norms must be non-negative (the norms of the embeddings)")
        scores = self.norm_scores(norms.to(block.scores.device))
        loss = class_cross_entropy(
            block, lambda c: scale * adaface_target(c, margin, scores), ScaledLogits(scale)
        )
        return reduce(loss, self.reduction)
