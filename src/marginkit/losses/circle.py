"""Circle loss modules: the pair-wise form on a batch and the class-level form on cosine logits.

Source: Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity Optimization",
CVPR 2020 (arXiv:2002.10857). The maths lives in :func:`marginkit.ops.circle_loss`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from marginkit._validation import REDUCTIONS, choice, cosine_tensor, label_tensor, positive_float, reduce
from marginkit.ops.circle import _circle_loss, _class_circle_logits, class_circle_loss
from marginkit.ops.classes import class_block
from marginkit.ops.pairs import (
    collapsed_flag,
    cosine_similarity_matrix,
    empty_reference_loss,
    label_masks,
    nonfinite_flag,
    prepare_pairs,
    read_flags,
    report_checks,
)


class CircleLoss(nn.Module):
    """Pair-wise circle loss on the cosine similarities of a batch (Sun et al., CVPR 2020).

    For every anchor ``i``, the positives are the other samples with its label and the
    negatives the samples with another label (or, with ``ref_embeddings``, the references
    with / without its label), ``s = cos(e_i, e_j)``:

    .. math::

        L_i = \\operatorname{softplus}\\big(\\mathrm{LSE}_{j\\in N(i)}[\\gamma[s_{ij}+m]_+(s_{ij}-m)]
              + \\mathrm{LSE}_{j\\in P(i)}[-\\gamma[1+m-s_{ij}]_+(s_{ij}-1+m)]\\big)

    with detached weights ``[·]_+``. Anchors without a positive or a negative contribute 0 and
    are not counted: ``"mean"`` averages over the anchors that have both (the same convention
    as pytorch-metric-learning's ``CircleLoss`` with its ``AvgNonZeroReducer``).

    Defaults: ``CircleLoss()`` keeps the paper's face-recognition setting, ``m = 0.25``,
    ``γ = 256``. ``marginkit train --loss circle`` trains with ``margin=0.25, gamma=64.0``, for
    the command line's small data sets (``marginkit losses`` lists both sets; why:
    ``docs/defaults.md``).

    Args:
        margin: relaxation ``m >= 0`` (paper: 0.25 for faces and re-ID, 0.4 fine-grained).
        gamma: scale ``γ > 0`` (paper: 256 faces, 128 re-ID, 80 fine-grained). Finite at 1024.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (one value per anchor).
        validate: check for NaN/inf embeddings and warn (once per instance) when the batch has
            no positive pair or the embeddings have collapsed. All three checks share ONE host
            synchronisation per forward; ``validate=False`` makes forward sync-free.

    Attributes (tensors, set by forward, no host sync):
        last_active_fraction: fraction of anchors that count (have a positive and a negative).

    Shape:
        embeddings ``[B, D]``, labels ``[B]`` (integers); optional ``ref_embeddings [R, D]``,
        ``ref_labels [R]``: queries against another set (a memory bank, another modality).
        Self-pairs are excluded only when the references are the batch itself
        (``ref_embeddings`` omitted or the same tensor object). Output: scalar or ``[B]``,
        float32 (float64 for float64 embeddings) whatever the input precision.

    Example:
        >>> import torch
        >>> from marginkit.losses import CircleLoss
        >>> emb = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        >>> labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> CircleLoss(margin=0.25, gamma=64.0)(emb, labels).shape
        torch.Size([])
    """

    def __init__(
        self, margin: float = 0.25, gamma: float = 256.0, reduction: str = "mean", validate: bool = True
    ) -> None:
        super().__init__()
        self.margin = positive_float(margin, "margin", allow_zero=True)
        self.gamma = positive_float(gamma, "gamma")
        self.reduction = choice(reduction, "reduction", REDUCTIONS)
        self.validate = bool(validate)
        self.last_active_fraction: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"margin={self.margin}, gamma={self.gamma}, reduction={self.reduction!r}"

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        margin = positive_float(self.margin, "margin", allow_zero=True)
        gamma = positive_float(self.gamma, "gamma")
        batch = prepare_pairs(embeddings, labels, ref_embeddings, ref_labels)
        if batch.y.shape[0] == 0:
            return empty_reference_loss(self, batch, self.reduction)
        sim = cosine_similarity_matrix(batch.x, batch.y)
        pos, neg = label_masks(batch.labels, batch.ref_labels, batch.self_ref)
        if self.validate:
            nonfinite, no_pos, collapsed = read_flags(
                nonfinite_flag(batch.x, batch.y),
                ~pos.any(),
                collapsed_flag(2.0 - 2.0 * sim.detach(), 1.0, batch.self_ref),
            )
            report_checks(self, type(self).__name__, nonfinite, no_pos, collapsed)
        loss, counts = _circle_loss(sim, sim, margin, gamma, pos, neg)
        counts_f = counts.to(loss.dtype)
        self.last_active_fraction = counts_f.mean().detach()
        return reduce(loss, self.reduction, counts_f)


class ClassCircleLoss(nn.Module):
    """Class-level circle loss on cosine logits (one positive class centre per sample).

    With ``s_j = cos(e, w_j)`` from a cosine head and the label ``y``, this is the circle loss
    with ``K = 1`` positive and the other classes as negatives, i.e. cross-entropy on

    .. math::

        z_y = \\gamma[1+m-s_y]_+(s_y-(1-m)), \\qquad z_j = \\gamma[s_j+m]_+(s_j-m)\\ (j\\ne y)

    with the weights detached (Sun et al., CVPR 2020, arXiv:2002.10857, §3.3 / eq. 6).

    Defaults: ``ClassCircleLoss()`` keeps the paper's face-recognition setting, ``m = 0.25``,
    ``γ = 256``. ``marginkit train --loss class_circle`` trains with ``margin=0.25, gamma=64.0``,
    for the command line's small data sets (``marginkit losses`` lists both sets; why:
    ``docs/defaults.md``).

    Args:
        margin: relaxation ``m >= 0``.
        gamma: scale ``γ > 0``.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.

    Shape:
        cosines ``[B, C]`` in ``[-1, 1]`` (a ``CosineHead``'s output, or a ``ShardedCosineHead``'s
        with this rank's labels), labels ``[B]`` in ``[0, C)``. Output: scalar or ``[B]``,
        float32 (float64 for float64 cosines).

    Example:
        >>> import torch
        >>> from marginkit.losses import ClassCircleLoss
        >>> cos = torch.tensor([[0.8, 0.1, -0.3], [0.2, 0.4, 0.0]])
        >>> ClassCircleLoss(gamma=32.0)(cos, torch.tensor([0, 1])).shape
        torch.Size([])
    """

    reads_class_blocks: ClassVar[bool] = True  # accepts a ShardedCosineHead's output

    def __init__(self, margin: float = 0.25, gamma: float = 256.0, reduction: str = "mean") -> None:
        super().__init__()
        self.margin = positive_float(margin, "margin", allow_zero=True)
        self.gamma = positive_float(gamma, "gamma")
        self.reduction = choice(reduction, "reduction", REDUCTIONS)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, gamma={self.gamma}, reduction={self.reduction!r}"

    def logits(self, cosines: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The modified logits ``z`` (float32 or better) whose cross-entropy is the loss."""
        margin = positive_float(self.margin, "margin", allow_zero=True)
        gamma = positive_float(self.gamma, "gamma")
        cosine_tensor(cosines, "cosines")
        if cosines.dim() != 2:
            raise ValueError(f"cosines must be 2-D [batch, classes], got shape {tuple(cosines.shape)}")
        label_tensor(labels, "labels", shape=cosines.shape[:1], num_classes=cosines.shape[1])
        work = torch.float64 if cosines.dtype == torch.float64 else torch.float32
        return _class_circle_logits(cosines.to(work).clamp(-1.0, 1.0), labels, margin, gamma)

    def forward(self, cosines: Any, labels: torch.Tensor) -> torch.Tensor:
        margin = positive_float(self.margin, "margin", allow_zero=True)
        gamma = positive_float(self.gamma, "gamma")
        loss = class_circle_loss(class_block(cosines, labels), margin, gamma)
        return reduce(loss, self.reduction)
