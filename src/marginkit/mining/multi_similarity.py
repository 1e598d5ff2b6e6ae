"""Multi-similarity pair mining (Wang et al., CVPR 2019, §4.2, eqs. 7–8), as index tensors."""

from __future__ import annotations

import math

import torch

from marginkit._validation import float_tensor, real
from marginkit.ops.pairs import PairIndices, cosine_similarity_matrix, label_masks, prepare_pairs

__all__ = ["multi_similarity_pairs"]


@torch.no_grad()
def _ms_select(
    sim: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, R]`` masks of the mined positive and negative pairs (eqs. 7–8 below)."""
    if sim.shape[1] == 0:
        return pos, neg
    s = sim.detach()
    # cosines lie in [-1, 1]: shifting the other entries by 4 keeps them out of the max / min
    # (float arithmetic; a masked_fill on a float tensor with a bool mask is far slower on CPU)
    hardest_neg = (s - 4.0 * (~neg).to(s.dtype)).amax(1, keepdim=True)
    hardest_pos = (s + 4.0 * (~pos).to(s.dtype)).amin(1, keepdim=True)
    hardest_neg = torch.where(hardest_neg < -2.0, -math.inf, hardest_neg)  # no negative at all
    hardest_pos = torch.where(hardest_pos > 2.0, math.inf, hardest_pos)  # no positive at all
    return pos & (s - epsilon < hardest_neg), neg & (s + epsilon > hardest_pos)


@torch.no_grad()
def multi_similarity_pairs(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    epsilon: float = 0.1,
    *,
    ref_embeddings: torch.Tensor | None = None,
    ref_labels: torch.Tensor | None = None,
) -> PairIndices:
    """The informative pairs of the multi-similarity loss (Wang et al., CVPR 2019, eqs. 7–8).

    With cosine similarities ``S``, for each anchor ``i`` a negative pair is kept when it is
    harder than the anchor's hardest positive, and a positive pair when it is harder than
    the anchor's hardest negative, each relaxed by ``ε``:

    .. math::

        S_{in} > \\min_{p \\in P_i} S_{ip} - \\epsilon, \\qquad
        S_{ip} < \\max_{n \\in N_i} S_{in} + \\epsilon .

    An anchor without negatives keeps no positive, one without positives keeps no negative.
    The rule and its strict inequalities are those of pytorch-metric-learning's
    ``MultiSimilarityMiner`` (default ``epsilon=0.1``).

    Args:
        embeddings: ``[B, D]`` float tensor (normalised here).
        labels: ``[B]`` integer labels.
        epsilon: the relaxation ``ε`` (may be negative: stricter).
        ref_embeddings, ref_labels: optional reference set (a memory bank): ``p`` and ``n``
            index it, and no self-pair is excluded unless it is ``embeddings`` itself.

    Returns:
        ``(anchor1, positive, anchor2, negative)``: 1-D ``int64`` index tensors, the positive
        pairs ``(anchor1[t], positive[t])`` and negative pairs ``(anchor2[t], negative[t])``
        in row-major order; pass them to a pair loss as ``indices=``.

    Example:
        >>> import torch
        >>> from marginkit.mining import multi_similarity_pairs
        >>> emb = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        >>> a1, p, a2, n = multi_similarity_pairs(emb, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
        >>> bool((a1 != p).all())
        True
    """
    epsilon = real(epsilon, "epsilon")
    batch = prepare_pairs(embeddings, labels, ref_embeddings, ref_labels)
    float_tensor(batch.x, "embeddings")
    if not batch.self_ref and batch.y.shape[0]:
        float_tensor(batch.y, "ref_embeddings")
    sim = cosine_similarity_matrix(batch.x, batch.y)
    pos, neg = label_masks(batch.labels, batch.ref_labels, batch.self_ref)
    hard_pos, hard_neg = _ms_select(sim, pos, neg, epsilon)
    a1, p = hard_pos.nonzero(as_tuple=True)
    a2, n = hard_neg.nonzero(as_tuple=True)
    return a1, p, a2, n
