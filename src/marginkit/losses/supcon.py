"""Supervised contrastive (SupCon) and NT-Xent / InfoNCE losses on in-batch pairs.

Sources: Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020; Chen, Kornblith,
Norouzi, Hinton, "A Simple Framework for Contrastive Learning of Visual Representations"
(SimCLR), ICML 2020. The maths lives in :func:`marginkit.ops.supcon_loss` and
:func:`marginkit.ops.ntxent_loss`.
"""

from __future__ import annotations

import torch

from marginkit._validation import positive_float, reduce
from marginkit.losses.pair_matrix import PairMatrix, PairMatrixLoss
from marginkit.ops.contrastive import _count, _keep, _ntxent, _supcon

__all__ = ["NTXentLoss", "SupConLoss"]


class _TemperatureLoss(PairMatrixLoss):
    """A pair-matrix loss on cosine similarities scaled by ``1 / temperature``."""

    hyperparameters = (("temperature", positive_float),)

    def __init__(self, temperature: float, reduction: str, validate: bool) -> None:
        super().__init__(reduction, validate)
        self._set(temperature=temperature)


class SupConLoss(_TemperatureLoss):
    """Supervised contrastive loss ``L^sup_out`` (Khosla et al., NeurIPS 2020, eq. 2).

    With ``s = cos`` between the batch and its references, temperature ``τ``, and for anchor
    ``i`` its positives ``P_i`` (same label, itself excluded) and candidates
    ``A_i = P_i ∪ N_i`` (every reference but itself):

    .. math::

        L_i = -\\frac{1}{|P_i|}\\sum_{p\\in P_i}
              \\log\\frac{e^{s_{ip}/\\tau}}{\\sum_{a\\in A_i} e^{s_{ia}/\\tau}}

    ``"mean"`` averages over the anchors whose loss is not identically 0: those with a
    positive and at least two candidates (an anchor whose only candidate is its single
    positive has ``L_i ≡ 0``). pytorch-metric-learning's ``SupConLoss`` averages over the
    anchors with a non-zero loss instead — the same anchors unless a loss underflows to
    exactly 0 — and returns 0 for a batch without any negative pair, where this loss keeps
    the paper's value.

    Args:
        temperature: ``τ > 0`` (paper and PML: 0.1).
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (one value per anchor).
        validate: NaN/inf check and once-per-instance warnings in one host sync per forward.

    Attributes (tensors set by forward, no host sync):
        last_active_fraction: fraction of anchors that count in the mean.

    Shape: as :meth:`forward`; mined pairs count as a set (``A_i`` is then the anchor's listed pairs).

    Example:
        >>> import torch
        >>> from marginkit.losses import SupConLoss
        >>> g = torch.Generator().manual_seed(0)
        >>> batch, bank = torch.randn(4, 8, generator=g), torch.randn(32, 8, generator=g)
        >>> loss = SupConLoss(temperature=0.1, reduction="none")  # against a memory bank:
        >>> loss(batch, torch.arange(4) % 2, ref_embeddings=bank, ref_labels=torch.arange(32) % 2).shape
        torch.Size([4])
    """

    def __init__(self, temperature: float = 0.1, *, reduction: str = "mean", validate: bool = True) -> None:
        super().__init__(temperature, reduction, validate)

    def _loss(self, pm: PairMatrix) -> torch.Tensor:
        loss, counts = _supcon(pm.matrix, pm.pos, pm.neg, self.temperature)
        counts = counts.to(loss.dtype)
        self.last_active_fraction = counts.mean().detach()
        return reduce(loss, self.reduction, counts)


class NTXentLoss(_TemperatureLoss):
    """NT-Xent / InfoNCE loss over the positive pairs of a batch (SimCLR, ICML 2020, eq. 1).

    For every positive pair ``(i, p)`` (same label, ``p ≠ i``) with ``s = cos``:

    .. math::

        \\ell_{ip} = -\\log\\frac{e^{s_{ip}/\\tau}}{e^{s_{ip}/\\tau} + \\sum_{n\\in N_i} e^{s_{in}/\\tau}}

    and ``"mean"`` averages over the positive pairs (pytorch-metric-learning's
    ``NTXentLoss``). For SimCLR, give the two views of each image the same label: every
    anchor then has one positive and the loss is the paper's. ``"none"``: per anchor, the
    SUM over its positive pairs (``last_counts`` holds their number, so
    ``mean == none.sum() / last_counts.sum()``).

    Args:
        temperature: ``τ > 0`` (PML: 0.07; SimCLR tunes 0.1–1).
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        validate: NaN/inf check and once-per-instance warnings in one host sync per forward.

    Attributes (tensors set by forward, no host sync):
        last_active_fraction: fraction of anchors with a positive pair.
        last_counts: positive pairs per anchor.

    Shape: as :meth:`forward`; mined pairs count with multiplicity (as in PML).

    Example:
        >>> import torch
        >>> from marginkit.losses import NTXentLoss
        >>> views = torch.cat([torch.eye(3), torch.eye(3) + 0.1])  # two views of three images
        >>> round(float(NTXentLoss(temperature=0.5)(views, torch.arange(3).repeat(2))), 4)
        0.5103
    """

    multiplicities = True

    def __init__(self, temperature: float = 0.07, *, reduction: str = "mean", validate: bool = True) -> None:
        super().__init__(temperature, reduction, validate)
        self.last_counts: torch.Tensor | None = None

    def _loss(self, pm: PairMatrix) -> torch.Tensor:
        per_pair = _ntxent(pm.matrix, pm.pos, pm.neg, self.temperature)  # 0 off the positives
        per_anchor = (per_pair if pm.pos.dtype == torch.bool else per_pair * pm.pos.to(per_pair.dtype)).sum(1)
        counts = _count(pm.pos, 1).to(per_pair.dtype)
        self.last_counts = counts.detach()
        self.last_active_fraction = _keep(pm.pos).any(1).to(per_pair.dtype).mean().detach()
        if self.reduction == "mean":
            return per_anchor.sum() / counts.sum().clamp_min(1)
        return reduce(per_anchor, self.reduction)
