"""Proxy-Anchor loss module (Kim et al., CVPR 2020); the maths is :mod:`marginkit.ops.proxy_anchor`."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from marginkit._validation import positive_float
from marginkit.ops.classes import class_block
from marginkit.ops.proxy_anchor import proxy_anchor_loss

__all__ = ["ProxyAnchorLoss"]


class ProxyAnchorLoss(nn.Module):
    r"""Proxy-Anchor loss: each class centre (proxy) pulls its batch positives and pushes the rest.

    .. math::

        \ell = \frac{1}{|P^+|}\sum_{p\in P^+}\log\Big(1 + \sum_{x\in X_p^+} e^{-\alpha(c_{xp} - \delta)}\Big)
             + \frac{1}{|P|}\sum_{p \in P} \log\Big(1 + \sum_{x \in X_p^-} e^{\alpha(c_{xp} + \delta)}\Big)

    Kim, Kim, Cho, Kwak, "Proxy Anchor Loss for Deep Metric Learning", CVPR 2020
    (arXiv 2003.13911), eq. 4, with ``α = 32``, ``δ = 0.1`` (the paper's). The proxies are a
    :class:`~marginkit.heads.CosineHead`'s centres: ``loss(head(e), labels)`` (the head is its own
    module: save it and give it an optimizer group, the paper uses a 100× learning rate for the
    proxies). A :class:`~marginkit.heads.ShardedCosineHead`'s output gives the loss over every
    rank's proxies. The loss is a property of the batch (one value: no ``reduction``);
    pytorch-metric-learning's ``ProxyAnchorLoss`` is the same.

    Args:
        alpha: ``α > 0`` (plain attribute); margin: ``δ ≥ 0``.

    Shape: cosines ``[B, C]`` in ``[-1, 1]``, labels ``[B]`` → scalar, float32 (float64 for float64).

    Example:
        >>> import torch
        >>> from marginkit.losses import ProxyAnchorLoss
        >>> cos = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.1, 0.7]])  # 3 embeddings, 2 proxies
        >>> labels = torch.tensor([0, 0, 1])
        >>> round(float(ProxyAnchorLoss()(cos, labels)), 4)
        8.0208
    """

    reads_class_blocks: ClassVar[bool] = True  # accepts a ShardedCosineHead's output

    def __init__(self, alpha: float = 32.0, margin: float = 0.1) -> None:
        super().__init__()
        self.alpha = positive_float(alpha, "alpha")
        self.margin = positive_float(margin, "margin", allow_zero=True)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, margin={self.margin}"

    def forward(self, cosines: Any, labels: torch.Tensor) -> torch.Tensor:
        alpha = positive_float(self.alpha, "alpha")
        margin = positive_float(self.margin, "margin", allow_zero=True)
        return proxy_anchor_loss(class_block(cosines, labels), alpha, margin)
