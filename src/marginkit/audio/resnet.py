"""wespeaker's ResNet34 speaker model (``wespeaker/models/resnet.py``, ``ResNet34``): a ResNet over the
fbank as a one-channel image ``[B, 1, F, T]`` with a 3x3 stem and no max pooling.

Stem conv 3x3 (``width`` = 32 channels) -> four stages of basic blocks (3, 4, 6, 3 blocks; widths
32, 64, 128, 256; stride 2 at the start of stages 2-4, with a 1x1 conv shortcut) -> temporal statistics
pooling (:class:`~marginkit.audio.pooling.StatisticsPooling` over time of the ``256 x F/8`` channels)
-> linear embedding. Convs have no bias; each is followed by batch norm.

Parameters (80 mel bins, 256-dim embedding): 6,634,336 — wespeaker's count exactly
(``tests/test_audio_models.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from marginkit._validation import positive_int
from marginkit.audio.pooling import StatisticsPooling
from marginkit.audio.speaker import SpeakerModel
from marginkit.models.backbones import _ints
from marginkit.models.base import run_stages

__all__ = ["SpeakerResNet"]


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


class _Stem(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class SpeakerResNet(SpeakerModel):
    """wespeaker's ResNet speaker embedding model (``speaker_resnet34``).

    Args:
        input_shape, embedding_dim, normalize, frontend, sample_rate, num_bins, window, dither:
            see :class:`~marginkit.audio.speaker.SpeakerModel` (256-dim embeddings in wespeaker).
        width: the stem's channels (32); stage ``i`` has ``width * 2**i``.
        blocks: basic blocks per stage ((3, 4, 6, 3): ResNet34).
    """

    name = "speaker_resnet34"

    def __init__(
        self,
        input_shape: tuple[int, ...],
        embedding_dim: int,
        normalize: bool,
        *,
        width: int = 32,
        blocks: tuple[int, ...] = (3, 4, 6, 3),
        **frontend: object,
    ) -> None:
        super().__init__(input_shape, embedding_dim, normalize, **frontend)  # type: ignore[arg-type]
        width = positive_int(width, "width")
        blocks = _ints(blocks, "blocks")
        self.stem = _Stem(width)
        stages, c_in, freq = [], width, self.num_bins
        for i, count in enumerate(blocks):
            c_out, stride = width * 2**i, 1 if i == 0 else 2
            first = _BasicBlock(c_in, c_out, stride)
            stages.append(nn.Sequential(first, *(_BasicBlock(c_out, c_out, 1) for _ in range(count - 1))))
            c_in, freq = c_out, (freq - 1) // stride + 1
        self.stages = nn.ModuleList(stages)
        self.min_frames = 2 ** (len(blocks) - 1) + 1  # the statistics need >= 2 frames after the strides
        self.pool = StatisticsPooling(c_in * freq)
        self.projection = nn.Linear(self.pool.out_dim, embedding_dim)
        self.config = {**self.speaker_config, "width": width, "blocks": list(blocks)}

    def stage_modules(self) -> list[nn.Module]:
        return [self.stem, *self.stages]

    def encode(self, feats: torch.Tensor) -> torch.Tensor:
        x = run_stages(self.stage_modules(), feats.transpose(1, 2).unsqueeze(1), self._checkpointing())
        return self.pool(x.flatten(1, 2))  # [B, C, F', T'] -> [B, C * F', T]
