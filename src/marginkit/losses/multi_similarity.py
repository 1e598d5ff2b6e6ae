"""Multi-similarity loss (Wang, Han, Huang, Dong, Scott, CVPR 2019) on in-batch pairs.

The maths lives in :func:`marginkit.ops.multi_similarity_loss`; the paper's pair mining in
:func:`marginkit.mining.multi_similarity_pairs` (also applied inside the loss with
``epsilon=``).
"""

from __future__ import annotations

import torch

from marginkit._validation import optional_real, positive_float, real, reduce
from marginkit.losses.pair_matrix import PairMatrix, PairMatrixLoss
from marginkit.mining.multi_similarity import _ms_select
from marginkit.ops.contrastive import _multi_similarity

__all__ = ["MultiSimilarityLoss"]


class MultiSimilarityLoss(PairMatrixLoss):
    """Multi-similarity loss on the cosine similarities of a batch (Wang et al., CVPR 2019, eq. 10).

    For every anchor ``i`` with positives ``P_i`` (same label, itself excluded) and negatives
    ``N_i`` (another label), ``S = cos``:

    .. math::

        L_i = \\frac{1}{\\alpha}\\log\\Big[1 + \\sum_{k\\in P_i} e^{-\\alpha(S_{ik}-\\lambda)}\\Big]
            + \\frac{1}{\\beta}\\log\\Big[1 + \\sum_{k\\in N_i} e^{\\beta(S_{ik}-\\lambda)}\\Big],
        \\qquad L = \\frac{1}{B}\\sum_i L_i

    with ``λ = base``. ``"mean"`` averages over all ``B`` anchors, as the paper (and
    pytorch-metric-learning's ``MultiSimilarityLoss`` with its ``MeanReducer``) does; an
    anchor without positives (negatives) gets 0 from that term.

    The paper applies the loss to mined pairs (its eqs. 7–8). Either mine with
    :func:`marginkit.mining.multi_similarity_pairs` and pass ``indices=``, or set ``epsilon``
    to mine inside the forward from the same similarity matrix (no extra pass, no host sync).

    Defaults: ``MultiSimilarityLoss()`` keeps ``epsilon=None``: no mining, every pair (or
    ``indices=``). ``marginkit train --loss multi_similarity`` trains with
    ``alpha=2.0, beta=50.0, base=0.5, epsilon=0.1``, for the command line's small data sets
    (``marginkit losses`` lists both sets; why: ``docs/defaults.md``).

    Args:
        alpha: positive scale ``α > 0`` (paper and PML: 2).
        beta: negative scale ``β > 0`` (paper and PML: 50).
        base: the similarity offset ``λ`` (PML and the authors' code: 0.5; the paper's text: 1).
        epsilon: ``None`` (all pairs, or the given ``indices``), or the mining relaxation ``ε``
            (PML's miner default 0.1), applied to the candidate pairs.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (one value per anchor).
        validate: NaN/inf check and once-per-instance warnings (no positive pair, collapsed
            embeddings), all read in ONE host synchronisation per forward.

    Attributes (tensors set by forward, no host sync):
        last_active_fraction: fraction of anchors with at least one (mined) pair.

    Shape: as :meth:`forward`; mined pairs count as a set (listed twice: once, as in PML).

    Example:
        >>> import torch
        >>> from marginkit.losses import MultiSimilarityLoss
        >>> angles = torch.tensor([0.0, 0.3, 1.6, 1.9])
        >>> e = torch.stack([angles.cos(), angles.sin()], dim=1)  # two tight pairs, far apart
        >>> round(float(MultiSimilarityLoss()(e, torch.tensor([0, 0, 1, 1]))), 4)
        0.169
        >>> round(float(MultiSimilarityLoss(epsilon=0.1)(e, torch.tensor([0, 1, 0, 1]))), 4)
        1.1335
    """

    hyperparameters = (
        ("alpha", positive_float), ("beta", positive_float), ("base", real), ("epsilon", optional_real),
    )  # fmt: skip

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        base: float = 0.5,
        *,
        epsilon: float | None = None,
        reduction: str = "mean",
        validate: bool = True,
    ) -> None:
        super().__init__(reduction, validate)
        self._set(alpha=alpha, beta=beta, base=base, epsilon=epsilon)

    def _loss(self, pm: PairMatrix) -> torch.Tensor:
        pos, neg = pm.pos, pm.neg
        if self.epsilon is not None:
            pos, neg = _ms_select(pm.matrix, pos, neg, self.epsilon)
        loss = _multi_similarity(pm.matrix, pos, neg, self.alpha, self.beta, self.base)
        self.last_active_fraction = (pos.any(1) | neg.any(1)).to(loss.dtype).mean().detach()
        return reduce(loss, self.reduction)
