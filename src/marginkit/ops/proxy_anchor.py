r"""Proxy-Anchor loss on a class axis: every class centre (proxy) is an anchor over the batch.

.. math::

    \ell = \frac{1}{|P^+|}\sum_{p \in P^+} \log\Big(1 + \sum_{x \in X_p^+} e^{-\alpha(c(x, p) - \delta)}\Big)
         + \frac{1}{|P|}\sum_{p \in P} \log\Big(1 + \sum_{x \in X_p^-} e^{\alpha(c(x, p) + \delta)}\Big)

(Kim, Kim, Cho, Kwak, "Proxy Anchor Loss for Deep Metric Learning", CVPR 2020, eq. 4): ``P``
the proxies (a cosine head's centres), ``P⁺`` those with a positive in the batch, ``X_p^±``
the batch embeddings with / without label ``p``, ``c`` the cosine.

The inner sums run over the batch, i.e. down each class column of the ``[B, C_b]`` block, so
they are local to whichever process holds the class; the outer sums (and the counts ``|P⁺|``,
``|P|``) are one SUM over the class axis (:class:`~marginkit.ops.classes.ClassAxis`): a
:class:`~marginkit.heads.ShardedCosineHead` needs one all-reduce of 4 numbers (plus the input
check's MAX). The positives are the label entries only, so the positive terms are ``[B]``-sized
(a scatter over the classes); the negative terms use one ``[B, C_b]`` buffer, which the
backward pass turns into the gradient in place (as :mod:`marginkit.ops.softmax`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from marginkit._validation import compute_dtype
from marginkit.ops.classes import ClassBlock, target_entry, write_target
from marginkit.ops.softmax import check_scores

__all__ = ["proxy_anchor_loss"]


def _negative_exponentials(
    cos: Tensor, column: Tensor, owned: Tensor | None, alpha: float, margin: float
) -> tuple[Tensor, Tensor]:
    """``exp(α(c + δ) − M_j)`` with the label entries 0, and the column shifts ``M_j ≥ 0``."""
    buf = torch.add(cos, margin).mul_(alpha)
    write_target(buf, column, owned, -math.inf)  # a row's own class: a positive, not a negative
    shift = buf.amax(dim=0).clamp_min_(0.0)  # the "1 +" term is e^0
    return buf.sub_(shift).exp_(), shift


class _ProxyAnchor(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, cos: Tensor, block: ClassBlock, alpha: float, margin: float, name: str
    ) -> Tensor:
        column, owned = block.column, block.owned
        num_local = cos.shape[1]
        lo, hi = cos.amin(), cos.amax()
        check_scores(block, lo, hi, name, hi.reshape(1))
        # negatives: per column, log(e^{-M} + Σ_b e^{α(c+δ) − M}) + M
        buf, neg_shift = _negative_exponentials(cos, column, owned, alpha, margin)
        neg_total = buf.sum(dim=0).add_(torch.exp(-neg_shift))
        neg = neg_total.log() + neg_shift
        # positives: the label entries, scattered to their classes (this block's rows only)
        c_y = target_entry(cos, column, owned)
        mine = torch.isfinite(c_y)
        u = torch.where(mine, -alpha * (c_y - margin), -math.inf)
        pos_shift = cos.new_zeros(num_local).scatter_reduce_(0, column, u, "amax")  # ≥ 0: the "1 +"
        e_pos = torch.exp(u - pos_shift[column])  # 0 on rows of other blocks
        pos_total = torch.exp(-pos_shift).index_add_(0, column, e_pos)
        count = cos.new_zeros(num_local).index_add_(0, column, mine.to(cos.dtype))
        has_pos = count > 0
        pos = torch.where(has_pos, pos_total.log() + pos_shift, 0.0)
        parts = torch.stack([pos.sum(), has_pos.sum().to(cos.dtype), neg.sum(), cos.new_tensor(num_local)])
        (parts,) = block.axis.sum_(parts)
        pos_sum, n_pos, neg_sum, n_all = parts.unbind()
        loss = pos_sum / n_pos + neg_sum / n_all
        ctx.save_for_backward(cos, column, owned, n_pos, n_all, neg_total, e_pos, pos_total)
        ctx.alpha, ctx.margin = alpha, margin
        # the forward buffer becomes the gradient in place (first backward only)
        ctx.buf = buf if ctx.needs_input_grad[0] else None
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        cos, column, owned, n_pos, n_all, neg_total, e_pos, pos_total = ctx.saved_tensors
        alpha = ctx.alpha
        buf, ctx.buf = ctx.buf, None
        if buf is None:  # a second backward (retain_graph=True): the forward's ops again
            buf, _ = _negative_exponentials(cos, column, owned, alpha, ctx.margin)
        grad = grad.to(buf.dtype)
        # ∂/∂c_bj of the negative term: (α/|P|)·e^{α(c+δ)−M_j} / total_j
        grad_cos = buf.mul_((grad * alpha / n_all) / neg_total)
        # ∂/∂c_{b,y_b} of the positive term: −(α/|P⁺|)·e^{u_b − M_y} / total_y
        d_pos = -(grad * alpha / n_pos) * e_pos / pos_total[column]
        write_target(grad_cos, column, owned, d_pos)
        return grad_cos, None, None, None, None


def proxy_anchor_loss(
    block: ClassBlock, alpha: float = 32.0, margin: float = 0.1, *, name: str = "cosines"
) -> Tensor:
    r"""The Proxy-Anchor loss of a batch, a scalar (see the module docstring for the formula).

    Args:
        block: the cosines ``[B, C_b]`` of the batch against the proxies (a cosine head's
            centres), labels and class axis (:func:`marginkit.ops.classes.class_block`).
        alpha: ``α > 0`` (paper: 32); margin: ``δ ≥ 0`` (paper: 0.1).
        name: the scores' name in error messages.

    Returns:
        A 0-d tensor, float32 (float64 for float64 scores), the same on every process of a
        sharded axis; 0 for an empty batch.
    """
    cos = block.scores.to(compute_dtype(block.scores.dtype))
    if cos.shape[0] == 0:
        return cos.sum()  # empty, connected to the graph
    return _ProxyAnchor.apply(cos, block, alpha, margin, name)
