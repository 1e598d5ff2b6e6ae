"""Synthetic "speakers" for tests and demos: voiced sounds with a speaker's pitch and vocal-tract size.

A simulation, not speech. Each speaker has a mean pitch ``f0`` (Hz) and a formant scale (a longer
vocal tract lowers every formant); each utterance strings a few vowels (formants of /a/, /i/, /u/,
/e/, /o/ after Peterson & Barney 1952, scaled by the speaker's factor), with a slow pitch contour.
The waveform is a sum of the harmonics ``k f0(t)`` below Nyquist, each weighted by the spectral
envelope of the current vowel's formants (resonances of bandwidth 80-120 Hz) and a -12 dB/octave
glottal tilt, plus faint noise:

.. math::
    x(t) = \\sum_k A(k f_0(t), t)\\, \\sin\\big(2\\pi k \\textstyle\\int_0^t f_0\\big) + \\epsilon(t)

Speakers differ by ``f0`` and formant scale, utterances by vowels, contour and phase: enough for a
speaker model to learn from in seconds, and for a trial list with a measurable EER.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["SyntheticSpeaker", "synthetic_speakers", "voiced_utterance", "write_speaker_folder"]

# Formants F1-F3 (Hz) of five vowels, an adult male average (Peterson & Barney 1952).
_VOWELS = np.array(
    [[730, 1090, 2440], [270, 2290, 3010], [300, 870, 2240], [530, 1840, 2480], [570, 840, 2410]],
    dtype=np.float64,
)
_BANDWIDTHS = np.array([80.0, 100.0, 120.0])


@dataclass(frozen=True)
class SyntheticSpeaker:
    """A simulated speaker: mean pitch (Hz) and formant scale (1.0: the table's adult male)."""

    name: str
    f0: float
    formant_scale: float


def synthetic_speakers(count: int, seed: int = 0) -> list[SyntheticSpeaker]:
    """``count`` speakers with pitches spread over 85-255 Hz and formant scales over 0.85-1.25."""
    rng = np.random.default_rng(seed)
    f0 = np.exp(rng.uniform(np.log(85.0), np.log(255.0), count))
    scale = rng.uniform(0.85, 1.25, count)
    return [SyntheticSpeaker(f"spk{i:03d}", float(f0[i]), float(scale[i])) for i in range(count)]


def voiced_utterance(
    speaker: SyntheticSpeaker, seconds: float, rng: np.random.Generator, sample_rate: int = 16000
) -> np.ndarray:
    """A float32 waveform in [-1, 1] of ``seconds`` for ``speaker`` (random vowels, contour, phase)."""
    n = round(seconds * sample_rate)
    if n < 1:
        raise ValueError(f"seconds must give at least one sample at {sample_rate} Hz, got {seconds}")
    t = np.arange(n) / sample_rate
    contour = 1.0 + 0.06 * np.sin(2 * np.pi * rng.uniform(0.3, 1.5) * t + rng.uniform(0, 2 * np.pi))
    f0 = speaker.f0 * rng.uniform(0.95, 1.05) * contour
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    # Vowel per segment (~0.25 s each), formants scaled by the speaker, crossfaded per sample.
    segments = max(1, int(np.ceil(seconds / 0.25)))
    chosen = _VOWELS[rng.integers(0, len(_VOWELS), segments)] / speaker.formant_scale
    position = np.minimum(t / 0.25, segments - 1)
    lo = np.floor(position).astype(int)
    hi = np.minimum(lo + 1, segments - 1)
    w = (position - lo)[:, None]
    formants = (1 - w) * chosen[lo] + w * chosen[hi]  # [n, 3]
    harmonics = np.arange(1, int(0.5 * sample_rate / (speaker.f0 * 0.9)) + 1)
    out = np.zeros(n)
    for k in harmonics:  # one pass per harmonic (tens), each vectorised over samples
        freq = k * f0
        envelope = np.sum(1.0 / (1.0 + ((freq[:, None] - formants) / _BANDWIDTHS) ** 2), axis=1)
        amplitude = envelope * (speaker.f0 / freq) ** 2 * (freq < 0.5 * sample_rate)
        out += amplitude * np.sin(k * phase + rng.uniform(0, 2 * np.pi))
    out += 0.002 * rng.standard_normal(n) * np.abs(out).max()
    return (0.5 * out / np.abs(out).max()).astype(np.float32)


def write_speaker_folder(
    root: str | os.PathLike[str],
    speakers: list[SyntheticSpeaker],
    utterances: int,
    *,
    seconds: tuple[float, float] = (1.0, 3.0),
    sample_rate: int = 16000,
    sessions: int = 2,
    seed: int = 0,
    subtype: str = "PCM_16",
    fmt: str = "WAV",
) -> list[str]:
    """Write ``utterances`` files per speaker as ``root/<speaker>/<session>/<nnnnn>.wav`` (VoxCeleb's layout).

    Returns the written paths relative to ``root`` (sorted). Needs soundfile.
    """
    from marginkit.audio.io import soundfile_module

    sf = soundfile_module()
    rng = np.random.default_rng(seed)
    suffix = ".flac" if fmt.upper() == "FLAC" else ".wav"
    written = []
    for speaker in speakers:
        for u in range(utterances):
            rel = f"{speaker.name}/sess{u % sessions}/{u:05d}{suffix}"
            path = Path(root, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            wave = voiced_utterance(speaker, float(rng.uniform(*seconds)), rng, sample_rate)
            sf.write(path, wave, sample_rate, subtype=subtype, format=fmt)
            written.append(rel)
    return sorted(written)
