"""Opt-in audio augmentation of training crops (``--augment speed,noise,reverb,spec_mask``).

Applied where the crop is read — in the loader's workers, from the row's generator seeded by
``(seed, epoch, index)`` — so an augmented batch depends on nothing else: the same for any
worker count and after ``--resume``. Evaluation reads (``rng=None``) are never augmented.

==============  ========  ===========================================================================
name            default   what (the parameter is the probability per training crop)
==============  ========  ===========================================================================
``speed``       2/3       speed perturbation by 0.9 or 1.1 (each half of the time), **as the same
                          speaker** — tempo and pitch change together, as sox's ``speed`` does
``noise``       0.3       add a random crop of a file from ``data_options.noise_dir`` at an SNR
                          drawn uniformly in [0, 15] dB
``reverb``      0.3       convolve with a room impulse response from ``data_options.rir_dir``
                          (normalised to unit energy), rescaled to the crop's peak
``spec_mask``   0.6       SpecAugment (Park et al., Interspeech 2019): one frequency mask of up
                          to 8 bins and one time mask of up to 10 frames on the fbank, in the
                          model's training mode only, batched on the device
==============  ========  ===========================================================================

The defaults are wespeaker's (``speed_perturb`` picks 1.0 / 0.9 / 1.1 uniformly; ``aug_prob``
0.6 split between noise and reverberation; ``spec_aug`` with ``num_t_mask=1, num_f_mask=1,
max_t=10, max_f=8, prob=0.6``). wespeaker counts a sped-up speaker as a *new* speaker (three
times the classes); here it stays the same speaker, so the class count, the head and the
checkpoint's label space do not depend on the augmentation (``--augment`` can be added to a
resumed run's config without changing the head), and every class-level loss and the sharded
head see the speakers they were built for.

Speed perturbation is a resampled read: the crop is read as if the model's rate were
``rate / factor`` (soxr, HQ), so ``crop`` samples cover ``factor`` times the source time. The
noise and RIR folders hold wav / flac files (MUSAN's ``noise/``, ``music/``, ``speech/``, and
the RIR corpus's ``simulated_rirs/``, nested folders allowed); every file's header is checked
when the run starts, and a folder without audio or with a file libsndfile cannot read is an
error naming it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from marginkit.audio.io import audio_info, read_audio, read_crop
from marginkit.data.samples import BadSampleError

__all__ = ["SPEED_FACTORS", "AudioAugment", "audio_folder", "spec_mask"]

SPEED_FACTORS = (0.9, 1.1)
NOISE_SNR_DB = (0.0, 15.0)
SPEC_MAX_BINS, SPEC_MAX_FRAMES = 8, 10
MAX_RIR_SECONDS = 2.0
AUDIO_SUFFIXES = (".wav", ".flac")
WAVE_OPTIONS = ("speed", "noise", "reverb")


def audio_folder(path: str | os.PathLike[str], what: str) -> tuple[str, ...]:
    """Every ``.wav`` / ``.flac`` file under ``path`` (sorted), each header checked: a missing
    folder, one without audio, or a file libsndfile cannot read is a ``ValueError`` naming it."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{what} {str(root)!r} is not a folder")
    files = sorted(str(p) for p in root.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(f"{what} {str(root)!r} holds no .wav or .flac file")
    for f in files:
        try:
            audio_info(f)
        except BadSampleError as exc:
            raise ValueError(f"{what}: {exc}") from None
    return tuple(files)


class AudioAugment:
    """The waveform augmentations of one run (``speed``, ``noise``, ``reverb``), applied to a
    training crop by :meth:`read`; picklable, so workers receive it with the source.

    Args:
        options: ``{name: probability}`` (:func:`marginkit.data.augment.augment_options`).
        noise_dir, rir_dir: folders of wav / flac files (needed by ``noise`` / ``reverb``).
    """

    def __init__(
        self,
        options: Mapping[str, float],
        *,
        noise_dir: str | os.PathLike[str] | None = None,
        rir_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.options = {k: float(v) for k, v in options.items() if k in WAVE_OPTIONS and float(v) > 0}
        for name, folder, key in (("noise", noise_dir, "noise_dir"), ("reverb", rir_dir, "rir_dir")):
            if name in self.options and folder is None:
                raise ValueError(f"augment {name} needs a folder of audio files: data_options.{key}=DIR")
        self.noise_files = (
            audio_folder(noise_dir, "data_options.noise_dir") if "noise" in self.options else ()
        )
        self.rir_files = audio_folder(rir_dir, "data_options.rir_dir") if "reverb" in self.options else ()

    def __bool__(self) -> bool:
        return bool(self.options)

    def __repr__(self) -> str:
        return (
            f"AudioAugment({self.options}, {len(self.noise_files)} noise files, {len(self.rir_files)} RIRs)"
        )

    def read(
        self, path: str, sample_rate: int, crop: int, rng: np.random.Generator, *, channel: int | str = 0,
        resample: bool = True,
    ) -> np.ndarray:  # fmt: skip
        """A training crop of ``path`` (``crop`` samples at ``sample_rate``), augmented; every draw
        comes from ``rng`` in a fixed order (speed, crop, noise, reverb)."""
        o = self.options
        draws = rng.random(3)
        factor = 1.0
        if draws[0] < o.get("speed", 0.0):
            factor = SPEED_FACTORS[int(rng.integers(len(SPEED_FACTORS)))]
        rate = sample_rate if factor == 1.0 else round(sample_rate / factor)
        wave = read_crop(path, rate, crop, rng, channel=channel, resample=resample or factor != 1.0)
        if draws[2] < o.get("reverb", 0.0):
            wave = self._reverb(wave, sample_rate, rng)
        if draws[1] < o.get("noise", 0.0):
            wave = self._noise(wave, sample_rate, rng)
        return wave.astype(np.float32, copy=False)

    def _noise(self, wave: np.ndarray, sample_rate: int, rng: np.random.Generator) -> np.ndarray:
        """``wave + g * noise`` with ``g`` such that ``10 log10(P_wave / P_noise) = snr``."""
        path = self.noise_files[int(rng.integers(len(self.noise_files)))]
        noise = read_crop(path, sample_rate, wave.size, rng)
        snr = rng.uniform(*NOISE_SNR_DB)
        p_wave = float(np.mean(np.square(wave, dtype=np.float64)))
        p_noise = float(np.mean(np.square(noise, dtype=np.float64)))
        if p_noise == 0.0:  # a silent noise file adds nothing
            return wave
        gain = math.sqrt(p_wave / (p_noise * 10.0 ** (snr / 10.0)))
        return wave + np.float32(gain) * noise

    def _reverb(self, wave: np.ndarray, sample_rate: int, rng: np.random.Generator) -> np.ndarray:
        """``(wave * rir)[:n]`` with ``rir / ||rir||``, rescaled to ``wave``'s peak (wespeaker)."""
        path = self.rir_files[int(rng.integers(len(self.rir_files)))]
        rir = read_audio(path, sample_rate, max_seconds=3600.0)[: round(MAX_RIR_SECONDS * sample_rate)]
        energy = float(np.sqrt(np.sum(np.square(rir, dtype=np.float64))))
        if energy == 0.0:
            return wave
        size = wave.size + rir.size - 1
        nfft = 1 << (size - 1).bit_length()
        out = np.fft.irfft(np.fft.rfft(wave, nfft) * np.fft.rfft(rir / energy, nfft), nfft)[: wave.size]
        peak_in, peak_out = float(np.max(np.abs(wave))), float(np.max(np.abs(out)))
        return (out * (peak_in / peak_out) if peak_out > 0 else out).astype(np.float32)


def spec_mask(
    feats: torch.Tensor,
    probability: float,
    *,
    max_bins: int = SPEC_MAX_BINS,
    max_frames: int = SPEC_MAX_FRAMES,
) -> torch.Tensor:
    """SpecAugment's masking of a batch of features ``[B, T, F]`` (Park et al. 2019): with
    probability ``probability`` per utterance, bins ``[f0, f0 + w)`` (``w`` uniform in
    ``0..max_bins``) and frames ``[t0, t0 + v)`` (``v`` in ``0..max_frames``) set to 0 — the
    utterance's mean after mean normalisation. Draws from torch's generator on ``feats``'
    device (as dropout does), with no host synchronisation."""
    b, t, f = feats.shape
    dev = feats.device
    on = torch.rand(b, device=dev) < probability
    width = torch.floor(torch.rand(b, device=dev) * (min(max_bins, f) + 1))
    f0 = torch.floor(torch.rand(b, device=dev) * (f - width + 1))
    span = torch.floor(torch.rand(b, device=dev) * (min(max_frames, t) + 1))
    t0 = torch.floor(torch.rand(b, device=dev) * (t - span + 1))
    bins = torch.arange(f, device=dev)[None]
    frames = torch.arange(t, device=dev)[None]
    fmask = (bins >= f0[:, None]) & (bins < (f0 + width)[:, None])  # [B, F]
    tmask = (frames >= t0[:, None]) & (frames < (t0 + span)[:, None])  # [B, T]
    mask = (fmask[:, None, :] | tmask[:, :, None]) & on[:, None, None]
    return feats.masked_fill(mask, 0.0)


def attach(source: Any, model: Any, options: Mapping[str, float], data_options: Mapping[str, Any]) -> str:
    """Give an ``audio:`` training source its :class:`AudioAugment` and a speaker model its
    SpecAugment probability; returns a note for the log. ``ValueError`` for an option that does
    not apply (e.g. ``flip``) or a bad folder."""
    wrong = [n for n in options if n not in (*WAVE_OPTIONS, "spec_mask")]
    if wrong:
        raise ValueError(
            f"augment: {', '.join(wrong)} do(es) not apply to audio; "
            "for audio: speed, noise, reverb, spec_mask"
        )
    aug = AudioAugment(options, noise_dir=data_options.get("noise_dir"), rir_dir=data_options.get("rir_dir"))
    if aug:
        if not hasattr(source, "augment"):
            raise ValueError(
                f"augment speed / noise / reverb need an audio: source, not {type(source).__name__}"
            )
        source.augment = aug
    if "spec_mask" in options:
        if not hasattr(model, "spec_augment"):
            raise ValueError("augment spec_mask needs a speaker model (ecapa_tdnn, speaker_resnet34)")
        model.spec_augment = float(options["spec_mask"])
    parts = [f"{k} {v:g}" for k, v in options.items()]
    where = []
    if aug.noise_files:
        where.append(f"{len(aug.noise_files)} noise files")
    if aug.rir_files:
        where.append(f"{len(aug.rir_files)} RIRs")
    return ", ".join(parts) + (f" ({', '.join(where)})" if where else "")
