"""The base of the speaker backbones: :class:`SpeakerModel`, an :class:`EmbeddingModel` whose input is
a waveform batch ``[B, N]`` (the front-end, :class:`~marginkit.audio.fbank.KaldiFbank`, inside the
model: ``frontend="fbank"``, the default) or a filterbank batch ``[B, T, F]`` (``frontend="none"``).

With the front-end inside, an exported ONNX graph takes the waveform (float32 in [-1, 1] at
``sample_rate``) and holds the fbank; batches are moved to the device as waveforms and the
features computed there. Utterances may have any length (the time axis is free); training feeds
equal-length crops, evaluation whole utterances one length at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from marginkit._validation import choice, positive_int
from marginkit.audio.fbank import WINDOWS, KaldiFbank
from marginkit.models.base import EmbeddingModel

__all__ = ["FRONTENDS", "SpeakerModel"]

#: ``frontend`` choices: the waveform in (fbank inside the model), or the fbank in.
FRONTENDS = ("fbank", "none")


class SpeakerModel(EmbeddingModel):
    """Front-end, frame-level trunk (:meth:`encode`), pooled statistics, linear embedding.

    Args:
        input_shape: ``(N,)`` (a nominal crop length in samples) with ``frontend="fbank"``, or
            ``(T, num_bins)`` with ``frontend="none"``; only the feature axis is checked at run time.
        embedding_dim, normalize: as :class:`EmbeddingModel`.
        frontend: ``"fbank"`` (default) or ``"none"``.
        sample_rate, num_bins, window, dither: the front-end's (:class:`KaldiFbank`; 16000, 80,
            ``"hamming"``, 1.0 in training only).
    """

    #: Fewest fbank frames the trunk accepts (subclasses raise it where pooling needs more).
    min_frames = 2
    #: Axes of the batched input besides the batch whose size is free (the time axis): an exporter
    #: makes them dynamic, with :attr:`min_input_length` as their minimum.
    variable_axes = (1,)

    def __init__(
        self,
        input_shape: tuple[int, ...],
        embedding_dim: int,
        normalize: bool,
        *,
        frontend: str = "fbank",
        sample_rate: int = 16000,
        num_bins: int = 80,
        window: str = "hamming",
        dither: float = 1.0,
    ) -> None:
        super().__init__(input_shape, embedding_dim, normalize)
        self.frontend_kind = choice(frontend, "frontend", FRONTENDS)
        self.num_bins = positive_int(num_bins, "num_bins")
        window = choice(window, "window", WINDOWS)
        if frontend == "fbank":
            if len(self.input_shape) != 1:
                raise ValueError(
                    f"frontend='fbank' takes waveforms: input_shape must be (samples,), "
                    f"got {self.input_shape}"
                )
            self.frontend: nn.Module = KaldiFbank(
                sample_rate=positive_int(sample_rate, "sample_rate"), num_bins=num_bins, window=window,
                dither=dither,
            )  # fmt: skip
        else:
            if len(self.input_shape) != 2 or self.input_shape[1] != num_bins:
                raise ValueError(
                    f"frontend='none' takes fbank features: input_shape must be (frames, {num_bins}), "
                    f"got {self.input_shape}"
                )
            self.frontend = nn.Identity()
        self.sample_rate = sample_rate
        #: SpecAugment's probability per utterance in training mode (``--augment spec_mask``;
        #: :func:`marginkit.audio.augment.spec_mask`); never in eval mode, so never exported.
        self.spec_augment = 0.0
        self.speaker_config: dict[str, Any] = {
            "frontend": frontend, "sample_rate": sample_rate, "num_bins": num_bins, "window": window,
            "dither": float(dither),
        }  # fmt: skip

    @property
    def min_samples(self) -> int:
        """The shortest waveform the model embeds (``min_frames`` fbank frames)."""
        if isinstance(self.frontend, KaldiFbank):
            return self.frontend.frame_length + (self.min_frames - 1) * self.frontend.frame_shift
        return self.min_frames

    @property
    def min_input_length(self) -> int:
        """The shortest input along the time axis: :attr:`min_samples` or :attr:`min_frames`."""
        return self.min_samples if isinstance(self.frontend, KaldiFbank) else self.min_frames

    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not torch.is_floating_point(x):
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        if isinstance(self.frontend, KaldiFbank):
            if x.dim() != 2:
                raise ValueError(f"{self.name} model expects waveforms [B, samples], got {list(x.shape)}")
            if x.shape[1] < self.min_samples:
                raise ValueError(
                    f"{self.name} model needs >= {self.min_samples} samples per utterance "
                    f"({self.min_samples / self.sample_rate:.3f} s at {self.sample_rate} Hz), "
                    f"got {x.shape[1]}"
                )
            return
        if x.dim() != 3 or x.shape[2] != self.num_bins:
            raise ValueError(
                f"{self.name} model expects fbank features [B, frames, {self.num_bins}], got {list(x.shape)}"
            )
        if x.shape[1] < self.min_frames:
            raise ValueError(f"{self.name} model needs >= {self.min_frames} frames, got {x.shape[1]}")

    def encode(self, feats: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """``[B, T, F]`` fbank -> ``[B, pooled]`` utterance statistics (before the linear embedding)."""
        raise NotImplementedError

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.frontend, KaldiFbank) and torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):  # the log-mel energies need float32
                feats = self.frontend(x.float())
        else:
            feats = self.frontend(x)
        if self.training and self.spec_augment > 0:
            from marginkit.audio.augment import spec_mask

            feats = spec_mask(feats, self.spec_augment)
        return self.encode(feats)
