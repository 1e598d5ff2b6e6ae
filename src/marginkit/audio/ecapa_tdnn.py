"""ECAPA-TDNN (Desplanques, Thienpondt, Demuynck, "ECAPA-TDNN: Emphasized Channel Attention,
Propagation and Aggregation in TDNN Based Speaker Verification", Interspeech 2020), as wespeaker
defines it (``wespeaker/models/ecapa_tdnn.py``, the ``ECAPA_TDNN_GLOB_c512`` / ``_c1024`` models).

``[B, T, F]`` fbank -> a conv (kernel 5) -> three SE-Res2Net blocks (dilations 2, 3, 4; Res2Net
scale 8; squeeze-excitation bottleneck 128) -> multi-layer feature aggregation (the three blocks'
outputs concatenated, a 1x1 conv to 1536 channels, ReLU) -> attentive statistics pooling with
global context (:class:`~marginkit.audio.pooling.AttentiveStatisticsPooling`) -> batch norm ->
linear embedding. Each conv is followed by ReLU then batch norm, as in wespeaker.

Parameters (80 mel bins, 192-dim embedding): 6,190,720 at ``channels=512``, 14,657,088 at
``channels=1024`` — wespeaker's counts exactly (``tests/test_audio_models.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from marginkit._validation import positive_int
from marginkit.audio.pooling import AttentiveStatisticsPooling
from marginkit.audio.speaker import SpeakerModel
from marginkit.models.base import run_stages

__all__ = ["ECAPATDNN"]


class _ConvReluBn(nn.Module):
    """Conv1d, ReLU, BatchNorm1d (wespeaker's order)."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int = 1, dilation: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(
            c_in, c_out, kernel_size, padding=dilation * (kernel_size - 1) // 2, dilation=dilation
        )
        self.bn = nn.BatchNorm1d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(F.relu(self.conv(x)))


class _Res2Conv(nn.Module):
    """Res2Net's hierarchical conv: ``scale`` channel groups; group ``i < scale - 1`` gets a conv of its
    input plus the previous group's output, the last group passes through unchanged."""

    def __init__(self, channels: int, kernel_size: int, dilation: int, scale: int) -> None:
        super().__init__()
        if channels % scale:
            raise ValueError(f"channels ({channels}) must be a multiple of the Res2Net scale ({scale})")
        self.width = channels // scale
        self.branches = nn.ModuleList(
            _ConvReluBn(self.width, self.width, kernel_size, dilation) for _ in range(scale - 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = torch.split(x, self.width, dim=1)
        outputs = []
        y = groups[0]
        for i, branch in enumerate(self.branches):
            y = branch(y if i == 0 else y + groups[i])
            outputs.append(y)
        outputs.append(groups[-1])
        return torch.cat(outputs, dim=1)


class _SqueezeExcite(nn.Module):
    """Channel gates from the time-averaged features: ``x * sigmoid(W2 relu(W1 mean_t(x)))``."""

    def __init__(self, channels: int, bottleneck: int = 128) -> None:
        super().__init__()
        self.squeeze = nn.Linear(channels, bottleneck)
        self.excite = nn.Linear(bottleneck, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.excite(F.relu(self.squeeze(x.mean(dim=2)))))
        return x * gate.unsqueeze(2)


class _SERes2Block(nn.Module):
    """``x + SE(conv1x1(Res2(conv1x1(x))))``."""

    def __init__(self, channels: int, dilation: int, scale: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _ConvReluBn(channels, channels),
            _Res2Conv(channels, kernel_size=3, dilation=dilation, scale=scale),
            _ConvReluBn(channels, channels),
            _SqueezeExcite(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class _Aggregation(nn.Module):
    """Multi-layer feature aggregation, attentive statistics pooling and batch norm."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size=1)
        self.pool = AttentiveStatisticsPooling(c_out, bottleneck=128, global_context=True)
        self.bn = nn.BatchNorm1d(self.pool.out_dim)
        self.out_dim = self.pool.out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.pool(F.relu(self.conv(x))))


class ECAPATDNN(SpeakerModel):
    """ECAPA-TDNN speaker embedding model (``ecapa_tdnn``).

    Args:
        input_shape, embedding_dim, normalize, frontend, sample_rate, num_bins, window, dither:
            see :class:`~marginkit.audio.speaker.SpeakerModel` (192-dim embeddings in the paper).
        channels: ``C``, the blocks' width (512 or 1024 in the paper; a multiple of 8).
        aggregation_channels: the MFA conv's output (1536, wespeaker's for both widths).
    """

    name = "ecapa_tdnn"

    def __init__(
        self,
        input_shape: tuple[int, ...],
        embedding_dim: int,
        normalize: bool,
        *,
        channels: int = 512,
        aggregation_channels: int = 1536,
        **frontend: object,
    ) -> None:
        super().__init__(input_shape, embedding_dim, normalize, **frontend)  # type: ignore[arg-type]
        channels = positive_int(channels, "channels")
        aggregation_channels = positive_int(aggregation_channels, "aggregation_channels")
        self.stem = _ConvReluBn(self.num_bins, channels, kernel_size=5)
        self.block1 = _SERes2Block(channels, dilation=2)
        self.block2 = _SERes2Block(channels, dilation=3)
        self.block3 = _SERes2Block(channels, dilation=4)
        self.aggregation = _Aggregation(3 * channels, aggregation_channels)
        self.projection = nn.Linear(self.aggregation.out_dim, embedding_dim)
        self.config = {
            **self.speaker_config,
            "channels": channels,
            "aggregation_channels": aggregation_channels,
        }

    def stage_modules(self) -> list[nn.Module]:
        return [self.stem, self.block1, self.block2, self.block3, self.aggregation]

    def encode(self, feats: torch.Tensor) -> torch.Tensor:
        ckpt = self._checkpointing()
        x = run_stages([self.stem], feats.transpose(1, 2), ckpt)
        out1 = run_stages([self.block1], x, ckpt)
        out2 = run_stages([self.block2], out1, ckpt)
        out3 = run_stages([self.block3], out2, ckpt)
        return run_stages([self.aggregation], torch.cat([out1, out2, out3], dim=1), ckpt)
