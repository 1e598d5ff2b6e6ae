"""Cosine classifier head: learnable class centres, cosines between normalised vectors.

.. math::

    c_{bj} = \\frac{e_b \\cdot w_j}
                    {\\max(\\lVert e_b\\rVert, \\varepsilon)\\,\\max(\\lVert w_j\\rVert, \\varepsilon)}

The head owns the centres and is separate from every loss (a loss that owns the classifier
weights is easy to forget when saving a checkpoint or building the optimizer groups), so one
call site serves all margin losses: ``loss(head(e), labels)``.

The forward/backward pair is one autograd function that never materialises the normalised
centre matrix ``[C, D]``: it multiplies the ``[B, C]`` product by the inverse centre norms in
place, and the backward pass uses the closed form of the normalisation Jacobian,

.. math::

    \\frac{\\partial L}{\\partial w_j} = \\frac{1}{\\lVert w_j\\rVert}\\Big(\\sum_b g_{bj}\\,\\hat e_b
        - k_j\\,\\hat w_j\\Big),\\quad k_j = \\sum_b g_{bj} c_{bj},

(``k_j = \\hat w_j \\cdot \\sum_b g_{bj} \\hat e_b``, computed from the ``[B, C]`` side), and
likewise for the embeddings. Zero vectors are safe: with a norm below ``eps`` the vector is
divided by ``eps`` (as :func:`torch.nn.functional.normalize`), giving cosine 0, no NaN.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from marginkit._validation import compute_dtype, float_tensor, positive_int, real
from marginkit.ops.classes import ClassBlock, class_block
from marginkit.ops.norms import robust_norm, row_norms
from marginkit.ops.subcenters import subcenter_cosines

__all__ = [
    "CosineHead",
    "NormedCosines",
    "accepts_sparse_grad",
    "class_cosines",
    "cosine_similarity_matrix",
    "embedding_norms",
]

_EPS = 1e-12  # same as torch.nn.functional.normalize


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Disable autocast for ``device_type`` (no-op for devices without autocast support)."""
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except (RuntimeError, ValueError):  # e.g. "meta"
        return contextlib.nullcontext()


class _CosineFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, e: torch.Tensor, w: torch.Tensor, eps: float
    ) -> torch.Tensor:
        e_norm = robust_norm(e)
        e_inv = e_norm.clamp_min(eps).reciprocal()
        e_hat = e * e_inv
        w_norm = row_norms(w)  # (vector_norm: inf for centres beyond 1.8e19 in float32)
        w_inv = w_norm.clamp_min(eps).reciprocal()
        cos = torch.matmul(e_hat, w.t()).mul_(w_inv)  # [..., C]; no normalised [C, D] copy
        ctx.save_for_backward(e_hat, e_inv, e_norm > eps, w, w_inv, w_norm > eps, cos)
        return cos

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if grad.is_sparse and grad.dim() == 2:
            return _sparse_backward(ctx, grad)
        if grad.is_sparse:
            grad = grad.to_dense()
        e_hat, e_inv, e_live, w, w_inv, w_live, cos = ctx.saved_tensors
        grad = grad.to(cos.dtype)
        grad_e = grad_w = None
        g_scaled = grad * w_inv  # ∂L/∂(ê·w_j) = g_bj / ‖w_j‖: the one [.., C] temporary
        if ctx.needs_input_grad[0]:
            d_hat = torch.matmul(g_scaled, w)  # ∂L/∂ê
            radial = (d_hat * e_hat).sum(dim=-1, keepdim=True) * e_live
            grad_e = (d_hat - radial * e_hat) * e_inv
        if ctx.needs_input_grad[1]:
            g2 = g_scaled.reshape(-1, g_scaled.shape[-1])
            grad_w = torch.matmul(g2.t(), e_hat.reshape(-1, e_hat.shape[-1]))  # Σ_b g_bj ê_b / ‖w_j‖
            # radial part: k_j/‖w_j‖ = Σ_b g_bj c_bj / ‖w_j‖ (= ŵ_j · row j above), reusing g_scaled
            k_scaled = g2.mul_(cos.reshape(-1, cos.shape[-1])).sum(dim=0)
            grad_w.addcmul_(w, (-(w_inv * k_scaled) * w_live).unsqueeze(1))
        return grad_e, grad_w, None


class _Upcast(torch.autograd.Function):
    """``x.to(dtype)`` whose backward saturates the gradient at the input dtype's largest finite value.

    The gradient of a normalisation is ``~1/‖e‖``: for a float16 embedding of norm 1e-6 (or a
    zero one, floored at ``eps``) it exceeds float16's range (65504), and a plain cast back
    would make it ``inf``. NaN stays NaN.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        ctx.dtype = x.dtype
        return x.to(dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        top = torch.finfo(ctx.dtype).max
        return grad.clamp(-top, top).to(ctx.dtype), None


def _upcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``; from a narrower float type with a saturating backward (:class:`_Upcast`)."""
    if x.dtype == dtype or torch.finfo(x.dtype).max >= torch.finfo(dtype).max:
        return x.to(dtype)
    return _Upcast.apply(x, dtype)


def _sparse_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The backward of :class:`_CosineFn` for a sparse COO gradient ``[B, C]`` (possibly uncoalesced).

    A sparse loss (:class:`marginkit.losses.QMarginLoss` and the other alpha losses, see
    :func:`accepts_sparse_grad`) sends only its candidates and the label entries: the embedding
    gradient gathers one centre row per entry (instead of a ``[B, C] × [C, D]`` GEMM) and the
    centre gradient one embedding row per entry (instead of ``[C, B] × [B, D]``). Same formulas
    as the dense path. Entries with a zero value (padding of a fixed-size buffer) are processed
    like the others: no read of which are zero, and a number of ops fixed by the shapes (the
    entries go in chunks of at most ``_SPARSE_CHUNK`` values of ``[chunk, D]``).
    """
    e_hat, e_inv, e_live, w, w_inv, w_live, cos = ctx.saved_tensors
    flat = e_hat.dim() != 2  # (2-D inputs need no reshape)
    e2 = e_hat.reshape(-1, e_hat.shape[-1]) if flat else e_hat
    c2 = cos.reshape(-1, w.shape[0]) if flat else cos
    values = grad._values().to(cos.dtype)
    row, col = grad._indices()
    g_scaled = (values * w_inv.index_select(0, col)).unsqueeze(1)  # g_bj / ‖w_j‖
    chunk = max(1, _SPARSE_CHUNK // max(1, w.shape[1]))
    if len(row) > chunk:
        parts = list(zip(row.split(chunk), col.split(chunk), g_scaled.split(chunk), strict=True))
    else:
        parts = [(row, col, g_scaled)]
    grad_e = grad_w = None
    if ctx.needs_input_grad[0]:
        d_hat = torch.zeros_like(e2)  # ∂L/∂ê
        for r, c, g in parts:
            d_hat.index_add_(0, r, w.index_select(0, c).mul_(g))
        d_hat = d_hat.reshape(e_hat.shape) if flat else d_hat
        radial = (d_hat * e_hat).sum(dim=-1, keepdim=True).mul_(e_live)
        grad_e = torch.addcmul(d_hat, radial, e_hat, value=-1.0).mul_(e_inv)
    if ctx.needs_input_grad[1]:
        # −k_j/‖w_j‖ = −Σ_b g_bj c_bj / ‖w_j‖ (an index_add with alpha −1)
        neg_k = torch.zeros_like(w_inv).index_add_(0, col, g_scaled.squeeze(1) * c2[row, col], alpha=-1.0)
        # the radial part is the one dense [C, D] pass; the entries are added on top of it
        grad_w = w * neg_k.mul_(w_inv).mul_(w_live).unsqueeze(1)
        for r, c, g in parts:
            grad_w.index_add_(0, c, e2.index_select(0, r).mul_(g))
    return grad_e, grad_w, None


# Values per chunk of the sparse backward's [entries, D] temporaries (64 MiB of float32).
_SPARSE_CHUNK = 1 << 24


def accepts_sparse_grad(cosines: torch.Tensor) -> bool:
    """Is ``cosines`` the direct output of a :class:`CosineHead` (whose backward takes a sparse gradient)?

    A loss with a sparse gradient (few active classes per row) may then return it as a sparse
    COO tensor and save the head two dense ``[B, C]``-sized products. Any other producer,
    including a leaf tensor, gets a dense gradient; so do devices other than CPU and CUDA (sparse
    COO support elsewhere is partial).
    """
    return (
        cosines.device.type in ("cpu", "cuda") and getattr(cosines.grad_fn, "_forward_cls", None) is _CosineFn
    )


def head_arguments(num_classes: Any, embedding_dim: Any, eps: Any) -> tuple[int, int, float]:
    """The checked ``(num_classes, embedding_dim, eps)`` of a cosine head."""
    eps = real(eps, "eps", low=0, high=1, open_low=True, open_high=True)
    return positive_int(num_classes, "num_classes"), positive_int(embedding_dim, "embedding_dim"), eps


def cosine_similarity_matrix(
    embeddings: torch.Tensor, centres: torch.Tensor, eps: float = _EPS
) -> torch.Tensor:
    """Cosines ``[..., C]`` between embeddings ``[..., D]`` and centres ``[C, D]``.

    Computed in float32 (float64 if either input is float64), also under ``torch.autocast``
    (which is disabled inside: bfloat16 cosines carry errors of ~4e-3, which a scale of 64
    turns into ~0.25 logits, the size of the margins being learned). Gradients flow to both
    inputs in their own dtypes. No argument checks (see :class:`CosineHead`).
    """
    return _in_compute_dtype(_CosineFn.apply, embeddings, centres, eps)


def _in_compute_dtype(fn: Any, embeddings: torch.Tensor, centres: torch.Tensor, eps: float) -> torch.Tensor:
    """``fn(e, w, eps)`` in float32 (float64 if either input is), autocast off, saturating upcasts."""
    dtype = torch.float64 if torch.float64 in (embeddings.dtype, centres.dtype) else torch.float32
    with _autocast_off(embeddings.device.type):
        return fn(_upcast(embeddings, dtype), _upcast(centres, dtype), eps)


def class_cosines(embeddings: torch.Tensor, weight: torch.Tensor, eps: float = _EPS) -> torch.Tensor:
    """Class cosines ``[..., C]`` for centres ``[C, D]``, or sub-centres ``[C, K, D]`` (max over ``k``).

    With sub-centres the class cosine is its best sub-centre's,
    ``c_bj = max_k cos(e_b, w_jk)`` (Deng et al., "Sub-center ArcFace", ECCV 2020); its gradient
    goes to that sub-centre only (the lowest ``k`` on ties; :func:`marginkit.ops.subcenter_cosines`).
    """
    if weight.dim() == 2:
        return cosine_similarity_matrix(embeddings, weight, eps)
    return _in_compute_dtype(subcenter_cosines, embeddings, weight, eps)


@dataclass(frozen=True)
class NormedCosines:
    """A head's cosines ``[B, C]`` with the norms ``[B]`` of the embeddings (detached, float32/64).

    What ``CosineHead(...)(e, with_norms=True)`` returns, for losses whose margin depends on the
    feature norm (:class:`marginkit.losses.AdaFaceLoss`); every class-level loss accepts it
    (it provides ``class_block``) and reads the cosines only.
    """

    cosines: torch.Tensor
    norms: torch.Tensor

    def class_block(self, labels: Any) -> ClassBlock:
        return class_block(self.cosines, labels)


def embedding_norms(embeddings: torch.Tensor) -> torch.Tensor:
    """Detached norms ``[...]`` of embeddings ``[..., D]`` (float32, float64 for float64), overflow-free."""
    with torch.no_grad():
        return robust_norm(embeddings.detach().to(compute_dtype(embeddings.dtype))).squeeze(-1)


class CosineHead(nn.Module):
    """Cosine classifier: class centres ``weight [C, D]``; ``forward(e)`` → cosines ``[..., C]``.

    .. math:: c_{bj} = \\cos\\angle(e_b, w_j) = \\frac{e_b\\cdot w_j}{\\lVert e_b\\rVert\\,\\lVert w_j\\rVert}

    The normalised-softmax family (NormFace, CosFace, ArcFace, Q-Margin: Wang et al. 2017,
    2018; Deng et al. 2019) scores classes by these cosines; pair the head with any of
    :mod:`marginkit.losses` — ``loss(head(e), labels)`` — and optimise/save the head like any
    module. Centres are initialised uniformly on the unit sphere (normal rows, normalised),
    so the gradients have the scale of unit vectors.

    With ``sub_centers=K > 1`` each class has ``K`` centres, ``weight [C, K, D]``, and its cosine
    is the best one's, :math:`c_{bj} = \\max_k \\cos\\angle(e_b, w_{jk})` (Deng et al.,
    "Sub-center ArcFace", ECCV 2020: noisy samples gather at non-dominant sub-centres).

    Numerics: float32 (float64 if the embeddings or the centres are float64) whatever the input
    dtype, also under autocast; zero embeddings give cosine 0 (norms are clamped at ``eps``);
    embedding norms are computed after dividing each row by its largest entry (no overflow for
    huge embeddings); the gradient returned to float16 embeddings saturates at float16's largest
    value instead of overflowing to ``inf`` (norms of 1e-6 and below).

    Args:
        num_classes: ``C ≥ 1``.
        embedding_dim: ``D ≥ 1``.
        sub_centers: ``K ≥ 1`` centres per class (default 1: ``weight [C, D]``).
        eps: norm floor (default 1e-12, as :func:`torch.nn.functional.normalize`).

    Shape: embeddings ``[..., D]`` → cosines ``[..., C]`` (float32/float64); with
    ``with_norms=True`` a :class:`NormedCosines` that also holds the embedding norms ``[...]``.

    Example:
        >>> import torch
        >>> from marginkit.heads import CosineHead
        >>> from marginkit.losses import CosFaceLoss
        >>> torch.manual_seed(0) and None
        >>> head = CosineHead(num_classes=10, embedding_dim=4)
        >>> e, y = torch.randn(8, 4), torch.randint(0, 10, (8,))
        >>> CosFaceLoss(scale=30.0, margin=0.35)(head(e), y).backward()
        >>> head.weight.grad.shape, head.predict(e).shape
        (torch.Size([10, 4]), torch.Size([8]))
    """

    weight: nn.Parameter

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        *,
        sub_centers: int = 1,
        eps: float = _EPS,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_classes, self.embedding_dim, self.eps = head_arguments(num_classes, embedding_dim, eps)
        self.sub_centers = positive_int(sub_centers, "sub_centers")
        shape = centre_shape(num_classes, self.sub_centers, embedding_dim)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Centres uniform on the unit sphere (standard normal rows, normalised)."""
        with torch.no_grad():
            nn.init.normal_(self.weight)
            self.weight.div_(torch.linalg.vector_norm(self.weight, dim=-1, keepdim=True).clamp_min(self.eps))

    def _check(self, embeddings: Any) -> torch.Tensor:
        float_tensor(embeddings, "embeddings", min_dim=1)
        if embeddings.shape[-1] != self.embedding_dim:
            raise ValueError(
                f"embeddings must have last dimension embedding_dim={self.embedding_dim}, "
                f"got shape {tuple(embeddings.shape)}"
            )
        return embeddings

    def forward(self, embeddings: torch.Tensor, *, with_norms: bool = False) -> torch.Tensor | NormedCosines:
        """Cosines ``[..., C]`` between the embeddings ``[..., D]`` and the class centres.

        ``with_norms=True``: a :class:`NormedCosines` (cosines and the detached embedding norms),
        for :class:`~marginkit.losses.AdaFaceLoss`.
        """
        cosines = class_cosines(self._check(embeddings), self.weight, self.eps)
        return NormedCosines(cosines, embedding_norms(embeddings)) if with_norms else cosines

    def logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Alias of :meth:`forward` (the cosines are the logits before a loss's scale/margin)."""
        return self.forward(embeddings)

    @torch.no_grad()
    def predict(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Class ids ``[...]`` (int64) of the nearest centre by cosine; ties → lowest id."""
        return self.forward(embeddings).argmax(dim=-1)

    def extra_repr(self) -> str:
        k = f", sub_centers={self.sub_centers}" if self.sub_centers > 1 else ""
        return f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}{k}, eps={self.eps:g}"


def centre_shape(num_classes: int, sub_centers: int, embedding_dim: int) -> tuple[int, ...]:
    """``[C, D]``, or ``[C, K, D]`` with ``K > 1`` sub-centres per class."""
    if sub_centers == 1:
        return (num_classes, embedding_dim)
    return (num_classes, sub_centers, embedding_dim)
