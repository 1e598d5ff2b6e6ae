r"""Class cosines of a sub-centre head: the best of each class's ``K`` centres, in one autograd function.

.. math::

    c_{bj} = \max_{k < K} \frac{e_b \cdot w_{jk}}{\max(\lVert e_b\rVert, \varepsilon)\,
                                               \max(\lVert w_{jk}\rVert, \varepsilon)},
    \qquad a_{bj} = \operatorname*{arg\,max}_k (\dots)

(Deng, Guo, Liu, Zafeiriou, "Sub-center ArcFace", ECCV 2020). The gradient of a class cosine
goes to its best sub-centre only: with ``G_k = g ⊙ [a = k] / ‖w_{·k}‖`` (the ``[B, C]`` upstream
gradient kept where sub-centre ``k`` won),

.. math::

    \frac{\partial L}{\partial w_{jk}} = \sum_b G_{k,bj}\,\hat e_b
        - \Big(\sum_b G_{k,bj}\,c_{bj}\Big)\hat w_{jk},
    \qquad
    \frac{\partial L}{\partial \hat e_b} = \sum_{j,k} G_{k,bj}\, w_{jk},

the normalisation Jacobians of :class:`marginkit.heads.CosineHead` (the radial term of
``w_jk`` needs the cosine only where ``k`` won, i.e. the class cosine ``c_bj`` itself).

Why one function instead of ``cosines(e, W.reshape(C·K, D)).unflatten(...).max(-1)``: autograd
would keep the ``[B, C·K]`` cosines for the centre gradient and the int64 argmax ``[B, C]`` for
the max, and the backward pass would build ``[B, C, K]`` gradients. Here the forward pass runs
one sub-centre at a time (a ``[B, C]`` product each, the running maximum updated in place) and
saves the class cosines and the winning index as ``uint8`` (``K ≤ 256``); the backward pass again
runs one ``[B, C]`` slice at a time. The same matrix products are computed, in ``K`` pieces.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from marginkit.ops.norms import robust_norm, row_norms

__all__ = ["subcenter_cosines"]


def _index_dtype(k: int) -> torch.dtype:
    return torch.uint8 if k <= 256 else torch.int32


class _SubCenterCosines(torch.autograd.Function):
    # Masks by same-dtype arithmetic: comparisons written straight into a float (uint8) buffer,
    # then multiplied; the index as a running maximum. masked_fill_ / where with a bool mask are
    # several times slower on CPU than a plain elementwise pass.
    @staticmethod
    def forward(ctx: FunctionCtx, e: Tensor, w: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        ctx.lead_shape = e.shape
        e = e.reshape(-1, e.shape[-1])
        e_norm = robust_norm(e)
        e_inv = e_norm.clamp_min(eps).reciprocal()
        e_hat = e * e_inv
        w_norm = row_norms(w)  # [C, K]
        w_inv = w_norm.clamp_min(eps).reciprocal()
        best = torch.matmul(e_hat, w[:, 0].t()).mul_(w_inv[:, 0])
        arg = torch.zeros(best.shape, dtype=_index_dtype(w.shape[1]), device=best.device)
        if w.shape[1] > 1:
            cos, won = torch.empty_like(best), torch.empty_like(arg)
        for k in range(1, w.shape[1]):  # K sub-centres, not rows or classes
            torch.matmul(e_hat, w[:, k].t(), out=cos).mul_(w_inv[:, k])
            torch.gt(cos, best, out=won)  # 0/1; strictly greater: ties keep the lowest k
            torch.maximum(arg, won.mul_(k), out=arg)  # k exceeds every earlier index
            torch.maximum(best, cos, out=best)  # NaN propagates, as torch.max
        ctx.save_for_backward(e_hat, e_inv, e_norm > eps, w, w_inv, w_norm > eps, best, arg)
        return best.reshape(*ctx.lead_shape[:-1], best.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        e_hat, e_inv, e_live, w, w_inv, w_live, best, arg = ctx.saved_tensors
        grad = grad.reshape(best.shape).to(best.dtype)
        want_e, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hat = torch.zeros_like(e_hat) if want_e else None
        grad_w = torch.empty_like(w) if want_w else None
        radial = torch.empty_like(w_inv)  # [C, K]: Σ_b G_k,bj c_bj
        g_k = torch.empty_like(grad)
        for k in range(w.shape[1]):
            torch.eq(arg, k, out=g_k).mul_(grad).mul_(w_inv[:, k])  # G_k = g·[a = k]/‖w_·k‖
            if d_hat is not None:
                d_hat.addmm_(g_k, w[:, k])
            if grad_w is not None:
                torch.mm(g_k.t(), e_hat, out=grad_w[:, k])  # Σ_b G_k,bj ê_b
                radial[:, k] = g_k.mul_(best).sum(dim=0)
        if grad_w is not None:  # minus (Σ_b G_k,bj c_bj) ŵ_jk
            grad_w.addcmul_(w, radial.mul_(w_inv).mul_(w_live).unsqueeze(-1), value=-1)
        grad_e = None
        if d_hat is not None:
            radial = (d_hat * e_hat).sum(dim=-1, keepdim=True) * e_live
            grad_e = ((d_hat - radial * e_hat) * e_inv).reshape(ctx.lead_shape)
        return grad_e, grad_w, None


def subcenter_cosines(embeddings: Tensor, weight: Tensor, eps: float = 1e-12) -> Tensor:
    """Class cosines ``max_k cos(e, w_jk)`` ``[..., C]`` of embeddings ``[..., D]``, centres ``[C, K, D]``.

    Norms are computed without overflow at any scale and floored at ``eps`` (as
    ``F.normalize``: a vector of norm below ``eps`` is divided by ``eps``, zero vectors give
    cosine 0); the gradient goes to the winning
    sub-centre (the lowest ``k`` on ties). Both inputs must share one floating dtype (the caller
    chooses it: :class:`~marginkit.heads.CosineHead` computes in float32 or float64). Memory kept
    for the backward pass: the class cosines and a ``uint8`` index ``[B, C]`` besides the inputs.
    No argument checks beyond the shapes.
    """
    if weight.dim() != 3 or embeddings.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"weight must be [C, K, D] with D = embeddings.shape[-1] = {embeddings.shape[-1]}, "
            f"got {tuple(weight.shape)}"
        )
    return _SubCenterCosines.apply(embeddings, weight, eps)
