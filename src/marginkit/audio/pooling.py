"""Temporal pooling of frame-level features ``[B, C, T]`` into one vector per utterance.

* :class:`StatisticsPooling` — mean and standard deviation over time (x-vector's "statistics
  pooling", wespeaker's ``TSTP``): :math:`[\\mu, \\sqrt{\\sigma^2 + 10^{-8}}]` with the unbiased
  variance :math:`\\sigma^2 = \\frac{1}{T-1}\\sum_t (x_t - \\mu)^2`.
* :class:`AttentiveStatisticsPooling` — channel- and context-dependent attentive statistics
  pooling of ECAPA-TDNN (Desplanques, Thienpondt, Demuynck, Interspeech 2020, eq. 6-9): attention
  logits :math:`e_{t,c} = v_c^\\top \\tanh(W [x_t; \\mu; \\sigma] + b) + k_c` from each frame and
  the utterance's (unweighted) mean and deviation, :math:`\\alpha = \\mathrm{softmax}_t(e)`, then
  :math:`\\tilde\\mu_c = \\sum_t \\alpha_{t,c} x_{t,c}` and
  :math:`\\tilde\\sigma_c = \\sqrt{\\max(\\sum_t \\alpha_{t,c} x_{t,c}^2 - \\tilde\\mu_c^2, 10^{-10})}`
  (the clamp keeps rounding from a negative variance). Output ``[\\tilde\\mu; \\tilde\\sigma]``.

Both report their output size (:attr:`out_dim`), as wespeaker's pooling layers do.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["AttentiveStatisticsPooling", "StatisticsPooling"]


def _sqrt_plus(var: torch.Tensor, eps: float) -> torch.Tensor:
    """:math:`\\sqrt{v + \\epsilon}` computed as :math:`\\sqrt{\\epsilon}\\sqrt{v/\\epsilon + 1}`.

    torch.onnx's graph optimiser (onnxscript) drops an ``Add`` of a constant within 1e-8 of zero as
    an identity, which would make the exported graph compute :math:`\\sqrt{v}`.
    """
    return torch.sqrt(var * (1.0 / eps) + 1.0) * eps**0.5


class StatisticsPooling(nn.Module):
    """Mean and standard deviation over the last axis: ``[B, C, T]`` (T >= 2) -> ``[B, 2C]``."""

    def __init__(self, in_dim: int) -> None:
        super().__init__()
        self.in_dim = in_dim
        self.out_dim = 2 * in_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x, dim=-1)
        return torch.cat([mean, _sqrt_plus(var, 1e-8)], dim=1)


class AttentiveStatisticsPooling(nn.Module):
    """ECAPA-TDNN's attentive statistics pooling with global context: ``[B, C, T]`` -> ``[B, 2C]``.

    Args:
        in_dim: channels ``C``.
        bottleneck: the attention's hidden size (128).
        global_context: feed the utterance's mean and deviation to the attention beside each frame
            (the paper's context-dependent variant; True).
    """

    def __init__(self, in_dim: int, bottleneck: int = 128, global_context: bool = True) -> None:
        super().__init__()
        self.in_dim = in_dim
        self.out_dim = 2 * in_dim
        self.global_context = global_context
        self.attention_hidden = nn.Conv1d(in_dim * (3 if global_context else 1), bottleneck, kernel_size=1)
        self.attention_out = nn.Conv1d(bottleneck, in_dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = x
        if self.global_context:
            var, mean = torch.var_mean(x, dim=-1, keepdim=True)
            std = _sqrt_plus(var, 1e-10)
            context = torch.cat([x, mean.expand_as(x), std.expand_as(x)], dim=1)
        alpha = torch.softmax(self.attention_out(torch.tanh(self.attention_hidden(context))), dim=2)
        mean = torch.sum(alpha * x, dim=2)
        var = torch.sum(alpha * x.square(), dim=2) - mean.square()
        return torch.cat([mean, torch.sqrt(var.clamp(min=1e-10))], dim=1)
