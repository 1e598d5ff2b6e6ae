"""Contrastive loss (Hadsell, Chopra, LeCun, CVPR 2006) on in-batch pairs.

The maths lives in :func:`marginkit.ops.contrastive_loss`.
"""

from __future__ import annotations

import torch

from marginkit._validation import choice, real, reduce
from marginkit.losses.pair_matrix import PairMatrix, PairMatrixLoss
from marginkit.ops.contrastive import _contrastive, _count
from marginkit.ops.pairs import DISTANCES

__all__ = ["ContrastiveLoss"]

AVERAGES = ("active", "valid")


class ContrastiveLoss(PairMatrixLoss):
    """Contrastive loss on the pairs of a batch, positives pulled in and negatives pushed out.

    With distances ``d`` between (by default L2-normalised) embeddings:

    .. math::

        L = \\underset{(i,j)\\in P}{\\operatorname{mean}}\\,[d_{ij} - m_+]_+
          + \\underset{(i,j)\\in N}{\\operatorname{mean}}\\,[m_- - d_{ij}]_+

    (Hadsell, Chopra, LeCun, CVPR 2006, with a positive margin ``m_+``; their ``½ d²`` form
    is ``distance="squared_l2"`` up to the factor). Each mean runs over the pairs with a
    non-zero loss by default (``average="active"``, pytorch-metric-learning's
    ``ContrastiveLoss`` with its ``AvgNonZeroReducer``), or over all its pairs
    (``average="valid"``). ``"sum"``: the sum over all pairs; ``"none"``: per anchor, the
    sum over its pairs.

    Args:
        pos_margin: ``m_+`` (PML: 0).
        neg_margin: ``m_-`` (PML: 1; in the units of ``distance``).
        distance: ``"l2"`` (default, as PML's ``LpDistance``) | ``"squared_l2"`` | ``"cosine"``
            (``1 − cos``).
        normalize: L2-normalise the embeddings first (as PML's default distance).
        average: ``"active"`` | ``"valid"``, as above.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        validate: NaN/inf check and once-per-instance warnings in one host sync per forward.

    Attributes (tensors set by forward, no host sync):
        last_active_fraction: pairs with a non-zero loss / all pairs.

    Shape: as :meth:`forward`; mined pairs count with multiplicity (as in PML).

    Example:
        >>> import torch
        >>> from marginkit.losses import ContrastiveLoss
        >>> e = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])  # the first two alike
        >>> loss = ContrastiveLoss(neg_margin=1.5)
        >>> round(float(loss(e, torch.tensor([0, 0, 1]))), 4)
        1.3711
    """

    multiplicities = True
    hyperparameters = (("pos_margin", real), ("neg_margin", real))
    repr_options = ("distance", "normalize", "average", "reduction")

    def __init__(
        self,
        pos_margin: float = 0.0,
        neg_margin: float = 1.0,
        distance: str = "l2",
        *,
        normalize: bool = True,
        average: str = "active",
        reduction: str = "mean",
        validate: bool = True,
    ) -> None:
        super().__init__(reduction, validate)
        self._set(pos_margin=pos_margin, neg_margin=neg_margin)
        self.distance = choice(distance, "distance", DISTANCES)
        self.normalize = bool(normalize)
        self.average = choice(average, "average", AVERAGES)

    def _loss(self, pm: PairMatrix) -> torch.Tensor:
        sums = _contrastive(pm.matrix, pm.pos, pm.neg, self.pos_margin, self.neg_margin)
        pos_sum, neg_sum, pos_active, neg_active = sums
        n_active = pos_active.sum() + neg_active.sum()
        self.last_active_fraction = (n_active / (_count(pm.pos) + _count(pm.neg)).clamp_min(1)).detach()
        if self.reduction == "mean":
            if self.average == "active":
                pos_units, neg_units = pos_active.sum(), neg_active.sum()
            else:
                pos_units, neg_units = _count(pm.pos), _count(pm.neg)
            return pos_sum.sum() / pos_units.clamp_min(1) + neg_sum.sum() / neg_units.clamp_min(1)
        return reduce(pos_sum + neg_sum, self.reduction)
