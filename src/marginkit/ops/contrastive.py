"""Contrastive-family pair losses on a similarity (or distance) matrix, one row per anchor.

Each op takes a ``[..., R]`` matrix between anchors and their references (the batch itself
or a memory bank) and masks of the positive / negative references of each anchor. A mask is
a bool tensor, or non-negative integer multiplicities (a mined pair listed twice counts
twice, as pytorch-metric-learning's pair-based losses count it).

- :func:`multi_similarity_loss` — Wang, Han, Huang, Dong, Scott, "Multi-Similarity Loss with
  General Pair Weighting for Deep Metric Learning", CVPR 2019, eq. 10.
- :func:`supcon_loss` — Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020,
  eq. 2 (``L^sup_out``).
- :func:`ntxent_loss` — the NT-Xent / InfoNCE loss of Chen, Kornblith, Norouzi, Hinton,
  "A Simple Framework for Contrastive Learning of Visual Representations" (SimCLR), ICML 2020,
  eq. 1; van den Oord, Li, Vinyals, "Representation Learning with Contrastive Predictive
  Coding", 2018.
- :func:`contrastive_loss` — Hadsell, Chopra, LeCun, "Dimensionality Reduction by Learning an
  Invariant Mapping", CVPR 2006, with a positive margin as in pytorch-metric-learning; a
  custom autograd function with a closed-form backward.

Every log-sum-exp runs over ``-inf``-masked rows; a row with no entry is filled with zeros
before the reduction, so neither value nor gradient meets ``-inf - (-inf)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from marginkit._validation import cosine_tensor, float_tensor, mask_tensor, positive_float, real

__all__ = ["contrastive_loss", "multi_similarity_loss", "ntxent_loss", "supcon_loss"]


def _keep(mask: torch.Tensor) -> torch.Tensor:
    """Bool view of a mask given as bool or multiplicities."""
    return mask if mask.dtype == torch.bool else mask > 0


def _count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Total multiplicity of a mask, over ``dim`` or everything.

    For bool masks, a row count sums the bytes into int32 (``sum``/``count_nonzero`` over a
    dimension first copy the mask to int64, ten times slower on CPU).
    """
    if mask.dtype != torch.bool:
        return mask.sum() if dim is None else mask.sum(dim)
    if dim is None:
        return mask.count_nonzero()
    return mask.view(torch.uint8).sum(dim, dtype=torch.int32)


# The ops below convert each mask to the working dtype once and then use float products and
# sums: an elementwise op between a float and a bool tensor (``x * mask``, ``where``,
# ``masked_fill``) goes through type promotion and is several times slower on CPU.


def masked_logsumexp(
    z: torch.Tensor, mask: torch.Tensor, has: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log Σ_j w_j e^{z_j}`` over the last dimension and whether the row has any entry.

    ``mask`` holds the weights ``w >= 0`` (bool, integer multiplicities or already floats);
    ``has`` (rows with an entry) may be passed when known. Empty rows give ``-inf`` with a
    zero gradient: their weights are replaced by ones before the reduction, so it never sees
    ``-inf - (-inf)``.
    """
    w = mask.to(z.dtype).expand_as(z)
    if has is None:
        has = w.amax(-1) > 0
    log_w = torch.log(w + (~has).to(z.dtype)[..., None])  # -inf off the mask
    lse = torch.logsumexp(z + log_w, dim=-1)
    return torch.where(has, lse, -math.inf), has


def _log1p_sum_exp(z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log(1 + Σ_j w_j e^{z_j})``, exactly 0 (with a zero gradient) for an empty row."""
    lse, _ = masked_logsumexp(z, mask)
    return torch.logaddexp(lse, torch.zeros_like(lse))


def _multi_similarity(
    sim: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, alpha: float, beta: float, base: float
) -> torch.Tensor:
    return (
        _log1p_sum_exp(-alpha * (sim - base), pos) / alpha + _log1p_sum_exp(beta * (sim - base), neg) / beta
    )


def _supcon(
    sim: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor SupCon loss (0 without a positive), and the anchors whose loss is not ≡ 0.

    An anchor counts when it has a positive and at least two candidates: with its single
    positive as the only candidate, ``L_i = 0`` whatever the embeddings.
    """
    z = sim / temperature
    keep_p = _keep(pos).expand_as(z)
    p = keep_p.to(z.dtype)
    candidates = (keep_p | _keep(neg).expand_as(z)).to(z.dtype)
    n_cand = candidates.sum(-1)
    lse, _ = masked_logsumexp(z, candidates, n_cand > 0)
    npos = p.sum(-1)
    mean_pos = (z * p).sum(-1) / npos.clamp_min(1)
    return torch.where(npos > 0, lse - mean_pos, 0.0), (npos > 0) & (n_cand >= 2)


def _ntxent(sim: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, temperature: float) -> torch.Tensor:
    z = sim / temperature
    lse_neg, _ = masked_logsumexp(z, neg)
    return (torch.logaddexp(z, lse_neg[..., None]) - z) * _keep(pos).to(z.dtype)


class _ContrastiveHinges(torch.autograd.Function):
    """Per-anchor sums of the positive and negative hinges and their numbers of active pairs.

    Inputs: distances ``d [..., R]``, masks ``pos``/``neg`` (bool, or multiplicities ``w``),
    the margins. Outputs per anchor: ``S_+ = Σ_j w_j [d_j − m_+]_+``,
    ``S_− = Σ_j w_j [m_− − d_j]_+`` and the multiplicities of the active pairs (not
    differentiable).

    Backward, closed form: ``∂/∂d_j = g_+ w_j [pos active] − g_− w_j [neg active]`` — one
    pass, no ``[..., R]`` graph of ``where``/``clamp`` nodes.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, d: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, pos_margin: float, neg_margin: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out: list[torch.Tensor] = []
        saved: list[torch.Tensor] = []
        for mask, t in ((pos, d - pos_margin), (neg, neg_margin - d)):
            w = mask.to(d.dtype)
            hinge = t.clamp_min_(0.0).mul_(w)
            active = torch.sign(hinge)  # [w_j > 0 and t_j > 0] as a float
            if mask.dtype != torch.bool:
                active.mul_(w)
            out += [hinge.sum(-1), active.sum(-1)]
            saved.append(active)
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(out[1], out[3])
        return out[0], out[2], out[1], out[3]

    @staticmethod
    def backward(ctx: Any, g_pos: torch.Tensor, g_neg: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        w_pos, w_neg = ctx.saved_tensors
        grad = torch.addcmul(w_pos * g_pos[..., None], w_neg, g_neg[..., None], value=-1.0)
        return grad, None, None, None, None


def _contrastive(
    d: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, pos_margin: float, neg_margin: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(S_+, S_−, active_+, active_−)`` per anchor; see :class:`_ContrastiveHinges`."""
    return _ContrastiveHinges.apply(d, pos.expand_as(d), neg.expand_as(d), pos_margin, neg_margin)


# ---------------------------------------------------------------------------- public ops


def _check(matrix: Any, name: str, pos_mask: Any, neg_mask: Any, *, cosines: bool) -> torch.Tensor:
    """Validate the matrix and both masks; return the matrix in float32 or better."""
    if cosines:
        cosine_tensor(matrix, name)
    else:
        float_tensor(matrix, name, min_dim=1, allow_empty=True)
    for mask_name, mask in (("pos_mask", pos_mask), ("neg_mask", neg_mask)):
        mask_tensor(mask, mask_name, matrix, name, counts=True)
    work = torch.float64 if matrix.dtype == torch.float64 else torch.float32
    matrix = matrix.to(work)
    return matrix.clamp(-1.0, 1.0) if cosines else matrix


def multi_similarity_loss(
    sim: torch.Tensor,
    pos_mask: torch.Tensor,
    neg_mask: torch.Tensor,
    alpha: float = 2.0,
    beta: float = 50.0,
    base: float = 0.5,
) -> torch.Tensor:
    """Multi-similarity loss per anchor (Wang et al., CVPR 2019, eq. 10).

    .. math::

        L_i = \\frac{1}{\\alpha}\\log\\Big[1 + \\sum_{k\\in P_i} e^{-\\alpha(S_{ik}-\\lambda)}\\Big]
            + \\frac{1}{\\beta}\\log\\Big[1 + \\sum_{k\\in N_i} e^{\\beta(S_{ik}-\\lambda)}\\Big]

    with ``λ = base``. An anchor without positives (negatives) gets 0 from that term.

    Args:
        sim: ``[..., R]`` cosine similarities between each anchor and its references.
        pos_mask, neg_mask: bool masks broadcastable to ``sim`` (``P_i``, ``N_i``); integer
            multiplicities are accepted and only their support counts (sets, not multisets).
        alpha, beta: ``> 0``, the positive and negative scales.
        base: the similarity offset ``λ``.

    Returns:
        ``[...]`` one loss per anchor, float32 (float64 for float64 input).

    Example:
        >>> import torch
        >>> from marginkit.ops import multi_similarity_loss
        >>> sim = torch.tensor([[0.9, 0.2, -0.1]])
        >>> pos = torch.tensor([[True, False, False]])
        >>> multi_similarity_loss(sim, pos, ~pos)
        tensor([0.1856])
    """
    alpha = positive_float(alpha, "alpha")
    beta = positive_float(beta, "beta")
    base = real(base, "base")
    sim = _check(sim, "sim", pos_mask, neg_mask, cosines=True)
    return _multi_similarity(sim, _keep(pos_mask), _keep(neg_mask), alpha, beta, base)


def supcon_loss(
    sim: torch.Tensor, pos_mask: torch.Tensor, neg_mask: torch.Tensor, temperature: float = 0.1
) -> torch.Tensor:
    """Supervised contrastive loss per anchor (Khosla et al., NeurIPS 2020, eq. 2, ``L^sup_out``).

    .. math::

        L_i = -\\frac{1}{|P_i|}\\sum_{p\\in P_i}
              \\log\\frac{e^{s_{ip}/\\tau}}{\\sum_{a\\in P_i\\cup N_i} e^{s_{ia}/\\tau}}

    The denominator runs over every candidate of the anchor (its positives and negatives;
    the anchor itself is not a candidate). Anchors without a positive get 0.

    Args:
        sim: ``[..., R]`` cosine similarities.
        pos_mask, neg_mask: bool masks broadcastable to ``sim`` (integer multiplicities:
            only their support counts).
        temperature: ``τ > 0``.

    Returns:
        ``[...]`` one loss per anchor, float32 (float64 for float64 input).

    Example:
        >>> import torch
        >>> from marginkit.ops import supcon_loss
        >>> sim = torch.tensor([[0.9, 0.7, -0.1]])  # two positives, then a negative
        >>> supcon_loss(sim, sim > 0, sim < 0, temperature=0.5)
        tensor([0.7909])
    """
    temperature = positive_float(temperature, "temperature")
    sim = _check(sim, "sim", pos_mask, neg_mask, cosines=True)
    return _supcon(sim, _keep(pos_mask), _keep(neg_mask), temperature)[0]


def ntxent_loss(
    sim: torch.Tensor, pos_mask: torch.Tensor, neg_mask: torch.Tensor, temperature: float = 0.07
) -> torch.Tensor:
    """NT-Xent (InfoNCE) loss per positive pair (SimCLR, Chen et al., ICML 2020, eq. 1).

    .. math::

        \\ell_{ip} = -\\log\\frac{e^{s_{ip}/\\tau}}
                     {e^{s_{ip}/\\tau} + \\sum_{n\\in N_i} w_{in} e^{s_{in}/\\tau}}

    for every positive pair ``(i, p)``: each positive is contrasted with the anchor's
    negatives only (other positives are not in its denominator). With one positive per
    anchor this is SupCon, and cross-entropy with the positive as the target.

    Args:
        sim: ``[..., R]`` cosine similarities.
        pos_mask: bool mask (or multiplicities) of the positive pairs, broadcastable to ``sim``.
        neg_mask: bool mask or integer multiplicities ``w_in`` of the negative pairs.
        temperature: ``τ > 0``.

    Returns:
        ``[..., R]`` the loss of each positive pair, 0 elsewhere (float32, or float64 for
        float64 input). Average it with the positive multiplicities as weights.

    Example:
        >>> import torch
        >>> from marginkit.ops import ntxent_loss
        >>> sim = torch.tensor([[0.9, 0.2, -0.1]])
        >>> ntxent_loss(sim, sim > 0.5, sim <= 0.5, temperature=0.5)  # per pair, 0 off the positives
        tensor([[0.3235, 0.0000, 0.0000]])
    """
    temperature = positive_float(temperature, "temperature")
    sim = _check(sim, "sim", pos_mask, neg_mask, cosines=True)
    return _ntxent(sim, pos_mask, neg_mask, temperature)


def contrastive_loss(
    dist: torch.Tensor,
    pos_mask: torch.Tensor,
    neg_mask: torch.Tensor,
    pos_margin: float = 0.0,
    neg_margin: float = 1.0,
) -> torch.Tensor:
    """Contrastive loss per anchor (Hadsell, Chopra, LeCun, CVPR 2006, with a positive margin).

    .. math::

        L_i = \\sum_{j\\in P_i} w_{ij}\\,[d_{ij} - m_+]_+ + \\sum_{j\\in N_i} w_{ij}\\,[m_- - d_{ij}]_+

    (``w = 1`` for bool masks, the multiplicities otherwise). The gradient is closed-form
    (a custom autograd function, checked by ``gradcheck``).

    Args:
        dist: ``[..., R]`` distances (any non-negative dissimilarity).
        pos_mask, neg_mask: bool masks or integer multiplicities, broadcastable to ``dist``.
        pos_margin: ``m_+``: positive pairs closer than it cost nothing.
        neg_margin: ``m_-``: negative pairs farther than it cost nothing.

    Returns:
        ``[...]`` the sum over each anchor's pairs (float32, or float64 for float64 input).

    Example:
        >>> import torch
        >>> from marginkit.ops import contrastive_loss
        >>> d = torch.tensor([[0.3, 0.5, 1.4]])
        >>> pos, neg = torch.tensor([[True, False, False]]), torch.tensor([[False, True, True]])
        >>> contrastive_loss(d, pos, neg, 0.0, 1.0)
        tensor([0.8000])
    """
    pos_margin = real(pos_margin, "pos_margin")
    neg_margin = real(neg_margin, "neg_margin")
    dist = _check(dist, "dist", pos_mask, neg_mask, cosines=False)
    pos_sum, neg_sum, _, _ = _contrastive(dist, pos_mask, neg_mask, pos_margin, neg_margin)
    return pos_sum + neg_sum
