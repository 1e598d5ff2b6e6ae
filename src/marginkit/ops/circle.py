"""Circle loss (Sun et al., CVPR 2020): pair-wise form on explicit similarity sets.

For one anchor with within-class similarities ``s_p^i`` (K of them) and between-class
similarities ``s_n^j`` (L of them):

.. math::

    L = \\log\\Big[1 + \\sum_j e^{\\gamma \\alpha_n^j (s_n^j - \\Delta_n)}
                      \\sum_i e^{-\\gamma \\alpha_p^i (s_p^i - \\Delta_p)}\\Big]
      = \\operatorname{softplus}\\big(\\mathrm{LSE}_j[\\gamma\\alpha_n^j(s_n^j-\\Delta_n)]
                                  + \\mathrm{LSE}_i[-\\gamma\\alpha_p^i(s_p^i-\\Delta_p)]\\big),

with ``α_p = [1 + m − s_p]_+``, ``α_n = [s_n + m]_+`` (detached: constants for the gradient,
as in the paper), ``Δ_p = 1 − m``, ``Δ_n = m``.

Source: Y. Sun, C. Cheng, Y. Zhang, C. Zhang, L. Zheng, Z. Wang, Y. Wei, "Circle Loss: A
Unified Perspective of Pair Similarity Optimization", CVPR 2020, arXiv:2002.10857, eqs. 4–6.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from marginkit._validation import float_tensor, mask_tensor, positive_float
from marginkit.ops.classes import ClassBlock
from marginkit.ops.softmax import class_cross_entropy


def _circle_loss(
    sp: torch.Tensor,
    sn: torch.Tensor,
    margin: float,
    gamma: float,
    pos_mask: torch.Tensor | None,
    neg_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unchecked circle loss in the dtype of ``sp``/``sn``; returns (loss, anchor counts).

    Masked entries become ``-inf`` logits; rows without any valid positive (or negative) are
    filled with zeros before the log-sum-exp so that neither value nor gradient sees a NaN,
    and their loss is set to 0 (they "contribute nothing").
    """
    alpha_p = (1.0 + margin - sp.detach()).clamp_min(0.0)
    alpha_n = (sn.detach() + margin).clamp_min(0.0)
    logit_p = -gamma * alpha_p * (sp - (1.0 - margin))
    logit_n = gamma * alpha_n * (sn - margin)
    has_p = logit_p.new_full(logit_p.shape[:-1], logit_p.shape[-1] > 0, dtype=torch.bool)
    has_n = logit_n.new_full(logit_n.shape[:-1], logit_n.shape[-1] > 0, dtype=torch.bool)
    if pos_mask is not None:
        pos_mask = pos_mask.expand_as(logit_p)
        has_p = pos_mask.any(-1)
        logit_p = logit_p.masked_fill(~(pos_mask | ~has_p[..., None]), -math.inf)
    if neg_mask is not None:
        neg_mask = neg_mask.expand_as(logit_n)
        has_n = neg_mask.any(-1)
        logit_n = logit_n.masked_fill(~(neg_mask | ~has_n[..., None]), -math.inf)
    counts = has_p & has_n
    if logit_p.shape[-1] == 0 or logit_n.shape[-1] == 0:
        zero = (sp.sum(-1) + sn.sum(-1)) * 0.0  # keeps the graph connected
        return zero, counts
    lse = torch.logsumexp(logit_p, dim=-1) + torch.logsumexp(logit_n, dim=-1)
    # exact softplus (F.softplus is linear above 20: an absolute error up to 2e-9)
    loss = torch.where(counts, torch.logaddexp(lse, torch.zeros_like(lse)), 0.0)
    return loss, counts


def circle_loss(
    sp: torch.Tensor,
    sn: torch.Tensor,
    margin: float = 0.25,
    gamma: float = 256.0,
    pos_mask: torch.Tensor | None = None,
    neg_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Circle loss per anchor from explicit within-/between-class similarity sets.

    .. math::

        L = \\operatorname{softplus}\\big(\\mathrm{LSE}_j[\\gamma[s_n^j+m]_+(s_n^j-m)]
            + \\mathrm{LSE}_i[-\\gamma[1+m-s_p^i]_+(s_p^i-1+m)]\\big)

    with the weights ``[·]_+`` detached (Sun et al., CVPR 2020, arXiv:2002.10857). Computed
    with log-sum-exp and softplus in float32 or better, so it stays finite at ``γ = 1024``.

    Args:
        sp: ``[..., K]`` within-class (positive) similarities, cosines in ``[-1, 1]``.
        sn: ``[..., L]`` between-class (negative) similarities, same leading shape.
        margin: relaxation ``m >= 0`` (``Δ_p = 1 − m``, ``Δ_n = m``, optima ``1 + m``, ``−m``).
        gamma: scale ``γ > 0``.
        pos_mask: optional bool mask broadcastable to ``sp``: which positives exist.
        neg_mask: optional bool mask broadcastable to ``sn``: which negatives exist.

    Returns:
        ``[...]`` one loss per anchor, float32 (float64 for float64 inputs) whatever the input
        precision; 0 for anchors without any (unmasked) positive or negative.

    Example:
        >>> import torch
        >>> from marginkit.ops import circle_loss
        >>> sp = torch.tensor([[0.9, 0.7]]); sn = torch.tensor([[0.1, -0.2, 0.3]])
        >>> circle_loss(sp, sn, margin=0.25, gamma=32.0).shape
        torch.Size([1])
    """
    margin = positive_float(margin, "margin", allow_zero=True)
    gamma = positive_float(gamma, "gamma")
    for name, s in (("sp", sp), ("sn", sn)):
        float_tensor(s, name, min_dim=1, allow_empty=True)
        if s.numel() and bool((s.abs() > 1 + 1e-3).any()):
            raise ValueError(
                f"{name} must be cosine similarities in [-1, 1], got |value| up to {float(s.abs().max()):.4g}"
            )
    if sp.shape[:-1] != sn.shape[:-1]:
        raise ValueError(
            f"sp and sn must share their leading (anchor) shape, got {tuple(sp.shape)} and {tuple(sn.shape)}"
        )
    for name, mask, s, s_name in (("pos_mask", pos_mask, sp, "sp"), ("neg_mask", neg_mask, sn, "sn")):
        if mask is not None:
            mask_tensor(mask, name, s, s_name)
    out_dtype = torch.promote_types(sp.dtype, sn.dtype)
    work = torch.float64 if out_dtype == torch.float64 else torch.float32
    loss, _ = _circle_loss(
        sp.to(work).clamp(-1, 1), sn.to(work).clamp(-1, 1), margin, gamma, pos_mask, neg_mask
    )
    return loss


def _class_circle_logits(
    cosines: torch.Tensor, labels: torch.Tensor, margin: float, gamma: float
) -> torch.Tensor:
    """Class-level circle logits (one positive per row, the label's class).

    ``z_y = γ [1 + m − s_y]_+ (s_y − (1 − m))`` and ``z_j = γ [s_j + m]_+ (s_j − m)`` for
    ``j ≠ y`` (weights detached). Cross-entropy on ``z`` is the circle loss with ``K = 1``:
    ``log(1 + Σ_j e^{z_j} e^{−z_y}) = LSE(z) − z_y``. The loss itself is
    :func:`class_circle_loss` (the same logits inside a fused cross-entropy).
    """
    target = torch.zeros_like(cosines, dtype=torch.bool).scatter_(-1, labels[..., None], True)
    s = cosines
    sd = s.detach()
    z_pos = gamma * (1.0 + margin - sd).clamp_min(0.0) * (s - (1.0 - margin))
    z_neg = gamma * (sd + margin).clamp_min(0.0) * (s - margin)
    return torch.where(target, z_pos, z_neg)


class CircleNegatives:
    """Circle logits of the negatives: ``z = γ·[ĉ + m]_+·(ĉ − m)``, ``ĉ = clamp(c, −1, 1)``.

    The weight ``[·]_+`` is a constant for the gradient (Sun et al.).
    """

    def __init__(self, gamma: float, margin: float) -> None:
        self.gamma, self.margin = gamma, margin

    def values(self, cos: Tensor) -> Tensor:
        c = cos.clamp(-1.0, 1.0)
        return (c + self.margin).clamp_min_(0.0).mul_(c - self.margin).mul_(self.gamma)

    def slope(self, cos: Tensor) -> Tensor:
        # the clamp passes the gradient on [-1, 1] only (as torch.clamp's backward)
        weight = (cos.clamp(-1.0, 1.0) + self.margin).clamp_min_(0.0).mul_(self.gamma)
        return weight.masked_fill_(cos.abs() > 1.0, 0.0)

    def extremes(self, cos: Tensor, rest_max: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        lo, hi = torch.aminmax(cos)
        return lo, hi


def class_circle_loss(block: ClassBlock, margin: float, gamma: float, *, name: str = "cosines") -> Tensor:
    r"""Class-level circle loss per example on the class axis of ``block``, ``[B]``.

    Cross-entropy on :math:`z_y = \gamma[1+m-s_y]_+(s_y-(1-m))` and
    :math:`z_j = \gamma[s_j+m]_+(s_j-m)` (:math:`j \ne y`, weights detached, cosines clamped to
    ``[-1, 1]``): the circle loss with one positive, the label's class (Sun et al., CVPR 2020,
    §3.3). Values in float32 (float64 for float64 scores).
    """

    def target(c: Tensor) -> Tensor:
        c = c.clamp(-1.0, 1.0)
        return gamma * (1.0 + margin - c.detach()).clamp_min(0.0) * (c - (1.0 - margin))

    return class_cross_entropy(block, target, CircleNegatives(gamma, margin), name=name)
