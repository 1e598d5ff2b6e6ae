"""The source schemes above ``data``: ``audio:`` (:mod:`marginkit.audio.sources`).

``marginkit.data`` may not import ``marginkit.audio`` (the layers in ``pyproject.toml``), so the
``audio:`` scheme of :func:`marginkit.data.load_dataset` is registered from here, by the trainer
and the evaluation, which sit above both; every other scheme is ``data``'s own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register_sources"]


def _audio(
    rest: str, *, sample_rate: int = 16000, crop_seconds: float | None = 2.0, channel: int | str = 0,
    resample: bool = True, test_fraction: float = 0.2, split_seed: int = 0, noise_dir: str | None = None,
    rir_dir: str | None = None,
) -> Any:  # fmt: skip
    """``noise_dir`` / ``rir_dir`` are read by ``--augment noise`` / ``reverb`` (the trainer's
    :func:`marginkit.audio.augment.attach`), not by the source."""
    from marginkit.audio.sources import read_audio_source

    if not rest:
        raise ValueError(
            "dataset spec 'audio:' needs a folder, a wav.scp or a CSV manifest after the colon: "
            "'audio:/data/vox'"
        )
    return read_audio_source(
        rest, sample_rate=sample_rate, crop_seconds=crop_seconds, channel=channel, resample=resample,
        test_fraction=test_fraction, split_seed=split_seed,
    )  # fmt: skip


def register_sources() -> None:
    """Register ``audio:DIR`` / ``audio:wav.scp`` / ``audio:FILE.csv`` with
    :func:`marginkit.data.load_dataset` (idempotent)."""
    from marginkit.data.datasets import register_source

    what = (
        "speech: DIR/<speaker>/**/*.wav|.flac, a Kaldi wav.scp (+ utt2spk) or a CSV manifest (path, label, "
        "split); always streamed"
    )
    register_source("audio", _audio, what)
