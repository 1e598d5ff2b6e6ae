r"""Sparse alpha-divergence losses on cosine logits: Q-Margin, entmax and sparsemax.

All three are the Fenchel–Young loss of the alpha-divergence softargmax
(:func:`marginkit.ops.alpha_divergence_loss`) on :math:`\theta = s\,c` (``c`` the cosines between
the embeddings and the class centres, e.g. from :class:`marginkit.heads.CosineHead`):

- :class:`QMarginLoss`: reference measure :math:`q_j = 1` except :math:`q_y = e^{-s m}` (the
  margin enters through the measure). As :math:`\alpha \to 1` it is CosFace,
  :math:`-\log\mathrm{softmax}(s(c - m e_y))_y`, in value and gradient.
- :class:`EntmaxLoss`: :math:`q \equiv 1`, default :math:`\alpha = 1.25`.
- :class:`SparsemaxLoss`: :math:`q \equiv 1`, :math:`\alpha = 2`.

With :math:`q \equiv 1` the loss is zero once :math:`c_y - c_j \ge 1/((\alpha - 1)s)` for every
:math:`j \ne y`: this intrinsic separation margin fixes the default scales (``docs/qmargin.md``):
``EntmaxLoss(alpha=1.25, scale=32)`` and ``SparsemaxLoss(scale=8)`` both have a cosine margin
of 0.125. Q-Margin adds the measure margin: zero loss needs
:math:`c_y - c_j \ge ((e^{(\alpha-1)sm} - 1)/(\alpha - 1) + 1/(\alpha - 1))/s`.

Source: the Q-Margin paper as summarised in our brief ("Sparsity-Inducing Divergence Losses for
Biometric Verification"); Roulet et al., ICML 2025 (arXiv 2501.18537).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from marginkit._validation import REDUCTIONS, choice, positive_float, reduce_kept
from marginkit.heads.cosine import accepts_sparse_grad
from marginkit.ops.alpha import qmargin_loss
from marginkit.ops.alpha._api import checked_alpha
from marginkit.ops.classes import class_block

__all__ = ["EntmaxLoss", "QMarginLoss", "SparsemaxLoss"]


class _AlphaCosineLoss(nn.Module):
    """Shared forward of the alpha losses on cosine logits (hyper-parameters are plain attributes)."""

    alpha: float | Tensor
    scale: float
    margin: float
    reads_class_blocks: ClassVar[bool] = True  # accepts a ShardedCosineHead's output

    def __init__(
        self,
        alpha: float | Tensor,
        scale: float,
        margin: float,
        topk: int | float | None,
        reduction: str,
        candidates: bool,
        ignore_index: int | None = None,
        logits: bool = False,
    ) -> None:
        super().__init__()
        self.alpha = alpha  # an nn.Parameter registers itself (a learnable alpha)
        self.scale = scale
        self.margin = margin
        self.topk = topk
        self.reduction = choice(reduction, "reduction", REDUCTIONS)
        self.candidates = candidates
        self.ignore_index = ignore_index
        if not isinstance(logits, bool):
            raise TypeError(f"logits must be a bool, got {type(logits).__name__}")
        self.logits = logits
        self._check_hyper()
        self.last_support_size: Tensor | None = None

    def _check_hyper(self) -> tuple[float | Tensor, float, float]:
        # a tensor alpha (per row, or learnable) is checked by the op, without a host sync here
        alpha = self.alpha if isinstance(self.alpha, Tensor) else checked_alpha(self.alpha)
        return (
            alpha,
            positive_float(self.scale, "scale"),
            positive_float(self.margin, "margin", allow_zero=True),
        )

    def forward(self, cosines: Any, labels: Tensor) -> Tensor:
        """Loss of ``cosines`` ``[..., C]`` (in ``[-1, 1]``; any finite scores with ``logits=True``)
        against integer ``labels`` ``[...]``.

        Returns the reduced loss (``"none"``: one value per example, float32 or float64) and
        stores the number of active classes per example in ``last_support_size`` (a tensor,
        no host synchronisation). A :class:`~marginkit.heads.ShardedCosineHead`'s output (with
        this rank's labels) gives the same loss over every rank's classes (a global τ;
        ``docs/distributed.md``). Rows labelled ``ignore_index`` count as in ``F.cross_entropy``
        (0 in ``"none"``, left out of ``"sum"`` and ``"mean"``; a mean over no row is NaN).
        """
        alpha, scale, margin = self._check_hyper()
        name = "logits" if self.logits else "cosines"
        block = class_block(cosines, labels, name=name, batch_dims=True, ignore_index=self.ignore_index)
        loss, support = qmargin_loss(
            block,
            alpha,
            scale,
            margin,
            topk=self.topk,
            candidates=bool(self.candidates),
            sparse_grad=accepts_sparse_grad(block.scores),
            name=name,
            cosines=not self.logits,
        )
        shape = block.batch_shape
        self.last_support_size = support if support.shape == shape else support.reshape(shape)
        keep = None if block.keep is None else block.keep.reshape(shape)
        return reduce_kept(loss if loss.shape == shape else loss.reshape(shape), keep, self.reduction)

    def extra_repr(self) -> str:
        topk = "" if self.topk is None else f", topk={self.topk}"
        alpha = "<tensor>" if isinstance(self.alpha, Tensor) else self.alpha
        hyper = f"alpha={alpha}, scale={self.scale}, margin={self.margin}"
        extra = "" if self.ignore_index is None else f", ignore_index={self.ignore_index}"
        extra += ", logits=True" if self.logits else ""
        return f"{hyper}{topk}, reduction={self.reduction!r}{extra}"


class QMarginLoss(_AlphaCosineLoss):
    r"""Q-Margin: the alpha-divergence Fenchel–Young loss with the margin in the reference measure.

    .. math::

        \theta = s\,c,\quad q_j = 1\ (j \ne y),\ q_y = e^{-s m},\qquad
        \ell = \langle p, \theta\rangle - D_f(p, q) + D_f(e_y, q) - \theta_y,

    :math:`p` the alpha-divergence softargmax of :math:`\theta` with reference :math:`q`
    (:func:`marginkit.ops.alpha_softargmax`); :math:`\partial\ell/\partial c = s(p - e_y)`.
    :math:`\alpha = 1` is exactly CosFace :math:`-\log\mathrm{softmax}(s(c - m e_y))_y`. The
    posterior is sparse: only the classes with :math:`\theta_j > \tau - 1/(\alpha - 1)` are active
    (their count per example is ``last_support_size``). ``q`` is never materialised and the root
    finder only sees the provable candidates, so the cost at large ``C`` is two bandwidth-bound
    passes over the cosines plus the gradient write. Fed directly from a
    :class:`~marginkit.heads.CosineHead`, the gradient goes to the head as a sparse tensor (the
    support and the labels), and the head skips its two dense gradient products.

    Defaults: ``QMarginLoss()`` keeps the paper's face-recognition setting, ``α = 1.25``,
    ``s = 35``, ``m = 0.2``. ``marginkit train --loss qmargin`` trains with
    ``alpha=1.25, scale=16.0, margin=0.2``, for the command line's small data sets
    (``marginkit losses`` lists both sets; why: ``docs/defaults.md``).

    Args:
        alpha: ``>= 1`` (paper: 1.25 for faces, 1.5–1.75 for speakers): a float, or a tensor
            (0-d: shared; or of the batch shape: per example), learnable when it requires grad
            (e.g. an ``nn.Parameter``, which the loss then registers; keep it ``>= 1``, e.g.
            ``1 + softplus(raw)``: alpha < 1 is refused). The gradient w.r.t. alpha is implicit
            (the closed form, as ``entmax_bisect``'s). ``(alpha − 1)·scale·margin > 700`` is
            refused: the loss would exceed float64's range.
        scale: ``s > 0`` (paper: 32–35 for faces at α = 1.25; best s falls as α rises).
        margin: ``m >= 0``.
        topk: ``None``, an int or a fraction in ``(0, 1]``: exact top-K truncation, run only
            when some row has more than K candidates (rows failing the integrity check are
            recomputed exactly).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        ignore_index: ``None`` or a label value whose rows do not count, as in
            ``F.cross_entropy`` (0 in ``"none"``; ``"mean"`` over the other rows, NaN if none).
        candidates: keyword-only; ``False`` disables the candidate filter (the root finder then
            runs on all ``C`` classes; for benchmarks).

    ``alpha``, ``scale``, ``margin`` and ``topk`` are plain attributes (a schedule may change them
    between steps); they are validated at every call.

    Shape:
        cosines ``[B, C]`` (any leading dimensions), labels ``[B]``; output scalar or ``[B]``.

    Example:
        >>> import torch
        >>> from marginkit.losses import QMarginLoss
        >>> cos = torch.tensor([[0.9, 0.1, -0.2], [0.3, 0.35, 0.0]], requires_grad=True)
        >>> loss_fn = QMarginLoss(alpha=1.25, scale=35.0, margin=0.2)
        >>> loss = loss_fn(cos, torch.tensor([0, 1]))
        >>> loss.backward()
        >>> loss_fn.last_support_size
        tensor([1, 2])
    """

    def __init__(
        self,
        alpha: float | Tensor = 1.25,
        scale: float = 35.0,
        margin: float = 0.2,
        topk: int | float | None = None,
        reduction: str = "mean",
        ignore_index: int | None = None,
        *,
        candidates: bool = True,
    ) -> None:
        super().__init__(alpha, scale, margin, topk, reduction, candidates, ignore_index)


class EntmaxLoss(_AlphaCosineLoss):
    r"""Entmax (alpha-divergence Fenchel–Young) loss on scaled cosines, :math:`q \equiv 1`.

    .. math:: \ell = \langle p, s c\rangle + H^T_\alpha(p) - s c_y,\qquad p = \mathrm{entmax}_\alpha(s c),

    (Tsallis entropy :math:`H^T_\alpha`; the same loss as ``entmax.EntmaxBisectLoss`` on
    ``s·c``), gradient :math:`s(p - e_y)`. The default ``scale=32`` gives the intrinsic cosine
    margin :math:`1/((\alpha-1)s) = 0.125` at α = 1.25; when changing ``alpha``, keeping
    :math:`(\alpha-1)s` fixed keeps that margin (the paper: the best s falls as α rises).

    With ``logits=True`` the input is any finite scores (raw logits, no cosine head) instead of
    cosines, and ``scale`` defaults to 1: the loss is then ``entmax.EntmaxBisectLoss`` on the
    logits.

    Defaults: ``EntmaxLoss()`` keeps the ``s = 32`` above. ``marginkit train --loss entmax``
    trains with ``alpha=1.25, scale=16.0``, for the command line's small data sets
    (``marginkit losses`` lists both sets; why: ``docs/defaults.md``).

    Args:
        alpha: ``>= 1``, float or tensor (learnable), as in :class:`QMarginLoss`.
        scale: ``s > 0`` (default 32 on cosines, 1 with ``logits=True``).
        topk, reduction, ignore_index, candidates: as in :class:`QMarginLoss`.
        logits: keyword-only; ``True`` accepts raw logits (only finiteness is checked).

    Example:
        >>> import torch
        >>> from marginkit.losses import EntmaxLoss
        >>> EntmaxLoss()(torch.tensor([[0.9, 0.1, -0.2]]), torch.tensor([0]))
        tensor(0.)
    """

    def __init__(
        self,
        alpha: float | Tensor = 1.25,
        scale: float | None = None,
        topk: int | float | None = None,
        reduction: str = "mean",
        ignore_index: int | None = None,
        *,
        candidates: bool = True,
        logits: bool = False,
    ) -> None:
        scale = (1.0 if logits else 32.0) if scale is None else scale
        super().__init__(alpha, scale, 0.0, topk, reduction, candidates, ignore_index, logits)


class SparsemaxLoss(_AlphaCosineLoss):
    r"""Sparsemax loss on scaled cosines: the alpha loss with :math:`\alpha = 2`, :math:`q \equiv 1`.

    .. math::

        \ell = \langle p, s c\rangle - \tfrac12\|p\|^2 + \tfrac12 - s c_y,\qquad
        p = \mathrm{sparsemax}(s c).

    Zero once :math:`c_y - c_j \ge 1/s` for every :math:`j \ne y`; the default ``scale=8`` gives the
    same 0.125 cosine margin as :class:`EntmaxLoss`'s defaults.

    Defaults: ``SparsemaxLoss()`` keeps the ``s = 8`` above. ``marginkit train --loss sparsemax``
    trains with ``scale=16.0``, for the command line's small data sets (``marginkit losses`` lists
    both sets; why: ``docs/defaults.md``).

    Args:
        scale: ``s > 0`` (default 8 on cosines, 1 with ``logits=True``).
        topk, reduction, ignore_index, candidates: as in :class:`QMarginLoss`.
        logits: keyword-only; ``True`` accepts raw logits (only finiteness is checked): the loss
            is then ``entmax.SparsemaxLoss`` on the logits.

    Example:
        >>> import torch
        >>> from marginkit.losses import SparsemaxLoss
        >>> SparsemaxLoss(reduction="none")(torch.tensor([[0.9, 0.85, -0.2]]), torch.tensor([0]))
        tensor([0.0900])
    """

    def __init__(
        self,
        scale: float | None = None,
        topk: int | float | None = None,
        reduction: str = "mean",
        ignore_index: int | None = None,
        *,
        candidates: bool = True,
        logits: bool = False,
    ) -> None:
        scale = (1.0 if logits else 8.0) if scale is None else scale
        super().__init__(2.0, scale, 0.0, topk, reduction, candidates, ignore_index, logits)
