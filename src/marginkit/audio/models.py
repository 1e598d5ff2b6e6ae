"""The speaker backbones as :func:`marginkit.models.build_model` names: ``ecapa_tdnn`` and
``speaker_resnet34`` (registered when :mod:`marginkit.audio` is imported).

Both take the data set's rows, waveform crops ``[B, samples]`` at ``sample_rate``, and compute
the Kaldi fbank inside the model (``frontend="fbank"``), so an exported ONNX graph is waveform in,
embedding out, with the front-end in the graph; ``frontend="none"`` makes a model whose input is
the fbank ``[B, frames, num_bins]`` instead.
"""

from __future__ import annotations

from marginkit.audio.ecapa_tdnn import ECAPATDNN
from marginkit.audio.resnet import SpeakerResNet

__all__ = ["SPEAKER_MODELS", "build_ecapa_tdnn", "build_speaker_resnet34", "register"]


def build_ecapa_tdnn(
    input_shape: tuple[int, ...],
    embedding_dim: int,
    normalize: bool,
    *,
    channels: int = 512,
    aggregation_channels: int = 1536,
    frontend: str = "fbank",
    sample_rate: int = 16000,
    num_bins: int = 80,
    window: str = "hamming",
    dither: float = 1.0,
) -> ECAPATDNN:
    """ECAPA-TDNN (:class:`~marginkit.audio.ecapa_tdnn.ECAPATDNN`); ``channels`` 512 or 1024."""
    return ECAPATDNN(
        input_shape, embedding_dim, normalize, channels=channels, aggregation_channels=aggregation_channels,
        frontend=frontend, sample_rate=sample_rate, num_bins=num_bins, window=window, dither=dither,
    )  # fmt: skip


def build_speaker_resnet34(
    input_shape: tuple[int, ...],
    embedding_dim: int,
    normalize: bool,
    *,
    width: int = 32,
    blocks: tuple[int, ...] = (3, 4, 6, 3),
    frontend: str = "fbank",
    sample_rate: int = 16000,
    num_bins: int = 80,
    window: str = "hamming",
    dither: float = 1.0,
) -> SpeakerResNet:
    """wespeaker's ResNet34 (:class:`~marginkit.audio.resnet.SpeakerResNet`)."""
    return SpeakerResNet(
        input_shape, embedding_dim, normalize, width=width, blocks=tuple(blocks), frontend=frontend,
        sample_rate=sample_rate, num_bins=num_bins, window=window, dither=dither,
    )  # fmt: skip


SPEAKER_MODELS = {"ecapa_tdnn": build_ecapa_tdnn, "speaker_resnet34": build_speaker_resnet34}


def register() -> None:
    """Register :data:`SPEAKER_MODELS` with :func:`marginkit.models.build_model`."""
    from marginkit.models.backbones import register_model

    for name, builder in SPEAKER_MODELS.items():
        register_model(name, builder)
