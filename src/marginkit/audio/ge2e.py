"""A pretrained speaker encoder a team may already have: Resemblyzer's GE2E LSTM, as a baseline.

Resemblyzer (Resemble AI, Apache-2.0; PyPI ``Resemblyzer`` 0.1.4) ships ``pretrained.pt``, a
speaker encoder trained with the generalized end-to-end loss (Wan et al., "Generalized
End-to-End Loss for Speaker Verification", ICASSP 2018): three LSTM layers of 256 units over
40-band mel power spectra (25 ms Hann windows, 10 ms hop, 16 kHz), the last layer's final hidden
state through a linear layer and a ReLU, L2-normalised. An utterance is embedded as the
L2-normalised mean of the embeddings of its 1.6 s partials (160 frames), taken 1/1.3 s apart;
the last partial is kept when it covers at least 75 % of its frames (zero padding).

:class:`GE2EEncoder` is that model in torch, reading the weights file with
``torch.load(weights_only=True)`` and importing nothing of the package (whose own import needs
librosa and webrtcvad). It reproduces ``VoiceEncoder.embed_utterance`` after Resemblyzer's
volume normalisation (to -30 dBFS, raised only); Resemblyzer's voice-activity trimming
(webrtcvad), which removes long silences before that, is not applied. The mel filterbank is
librosa's default (Slaney's mel scale and area normalisation, ``htk=False``, ``norm="slaney"``;
frames centred with zero padding, as ``librosa.stft`` pads since 0.10).

:func:`find_weights` locates ``pretrained.pt`` in an installed ``Resemblyzer`` distribution
(without importing it), or takes :data:`WEIGHTS_ENV`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SAMPLE_RATE", "WEIGHTS_ENV", "GE2EEncoder", "find_weights", "partial_starts", "slaney_mel_basis"]

#: The encoder's sample rate (Hz); inputs must be at this rate.
SAMPLE_RATE = 16000
#: An environment variable naming a ``pretrained.pt`` (wins over an installed Resemblyzer).
WEIGHTS_ENV = "MARGINKIT_GE2E_WEIGHTS"
_N_FFT, _HOP, _MELS = 400, 160, 40  # 25 ms, 10 ms, 40 bands at 16 kHz
_PARTIAL_FRAMES = 160  # 1.6 s
_RATE, _MIN_COVERAGE = 1.3, 0.75  # partials per second; the last one's minimal coverage
_TARGET_DBFS = -30.0
_INT16_MAX = 2**15 - 1
_HIDDEN = 256
_EXPECTED = {
    **{f"lstm.weight_ih_l{i}": (4 * _HIDDEN, _MELS if i == 0 else _HIDDEN) for i in range(3)},
    **{f"lstm.weight_hh_l{i}": (4 * _HIDDEN, _HIDDEN) for i in range(3)},
    **{f"lstm.bias_ih_l{i}": (4 * _HIDDEN,) for i in range(3)},
    **{f"lstm.bias_hh_l{i}": (4 * _HIDDEN,) for i in range(3)},
    "linear.weight": (_HIDDEN, _HIDDEN),
    "linear.bias": (_HIDDEN,),
}


def find_weights() -> Path | None:
    """``$MARGINKIT_GE2E_WEIGHTS``, else ``resemblyzer/pretrained.pt`` of an installed Resemblyzer
    distribution (found through its metadata, not imported), else None."""
    named = os.environ.get(WEIGHTS_ENV)
    if named:
        return Path(named)
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(str(distribution("Resemblyzer").locate_file("resemblyzer/pretrained.pt")))
    except PackageNotFoundError:
        return None
    return path if path.is_file() else None


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear (200/3 Hz per mel) below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    linear = f / (200.0 / 3)
    log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log, linear)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)), (200.0 / 3) * m)


def slaney_mel_basis(sample_rate: int = SAMPLE_RATE, n_fft: int = _N_FFT, n_mels: int = _MELS) -> np.ndarray:
    """``[n_mels, n_fft // 2 + 1]`` triangular filters between ``n_mels + 2`` points equally spaced
    on Slaney's mel scale from 0 Hz to Nyquist, each scaled to unit area (``2 / (f[i+2] - f[i])``):
    librosa's ``filters.mel`` with its defaults."""
    freqs = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    points = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    widths = np.diff(points)
    ramps = points[:, None] - freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    return weights * (2.0 / (points[2:] - points[:-2]))[:, None]


def partial_starts(num_samples: int) -> np.ndarray:
    """First frame of each 160-frame partial of an utterance of ``num_samples`` (Resemblyzer's
    ``compute_partial_slices`` at rate 1.3 and coverage 0.75): one every 77 frames, the last kept
    when the audio covers at least 75 % of it, and always at least one."""
    if num_samples < 1:
        raise ValueError(f"an utterance needs at least one sample, got {num_samples}")
    frames = math.ceil((num_samples + 1) / _HOP)
    step = round((SAMPLE_RATE / _RATE) / _HOP)
    starts = np.arange(0, max(1, frames - _PARTIAL_FRAMES + step + 1), step)
    coverage = (num_samples - starts[-1] * _HOP) / (_PARTIAL_FRAMES * _HOP)
    if coverage < _MIN_COVERAGE and len(starts) > 1:
        starts = starts[:-1]
    return starts


class GE2EEncoder(nn.Module):
    """Waveforms ``[B, N]`` (float in [-1, 1] at 16 kHz) -> utterance embeddings ``[B, 256]``,
    L2-normalised (see the module doc). ``weights``: a Resemblyzer ``pretrained.pt`` (a dict whose
    ``model_state`` holds the LSTM and linear weights), read with ``weights_only``."""

    def __init__(self, weights: str | os.PathLike[str]) -> None:
        super().__init__()
        self.lstm = nn.LSTM(_MELS, _HIDDEN, 3, batch_first=True)
        self.linear = nn.Linear(_HIDDEN, _HIDDEN)
        self.load_state_dict(_read_state(Path(weights)))
        self.register_buffer("mel_basis", torch.from_numpy(slaney_mel_basis()).float(), persistent=False)
        self.register_buffer("window", torch.hann_window(_N_FFT, periodic=True), persistent=False)
        self.sample_rate = SAMPLE_RATE
        self.embedding_dim = _HIDDEN
        self.eval()

    def mel(self, wav: torch.Tensor) -> torch.Tensor:
        """``[B, N]`` -> mel power spectra ``[B, 1 + N // 160, 40]`` (centred frames, zero padded)."""
        spec = torch.stft(
            wav, _N_FFT, _HOP, window=self.window, center=True, pad_mode="constant", return_complex=True
        )
        return (self.mel_basis @ spec.abs().square()).transpose(1, 2)

    @staticmethod
    def normalize_volume(wav: torch.Tensor) -> torch.Tensor:
        """Each row raised to -30 dBFS (RMS of the int16-scaled signal), never lowered; silence kept."""
        rms = (wav.double() * _INT16_MAX).square().mean(1, keepdim=True).sqrt()
        change = _TARGET_DBFS - 20 * torch.log10(rms.clamp_min(1e-300) / _INT16_MAX)
        gain = torch.where((change > 0) & (rms > 0), 10 ** (change / 20), torch.ones_like(change))
        return (wav.double() * gain).to(wav.dtype)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        if wav.ndim != 2:
            raise ValueError(f"GE2EEncoder takes waveforms [B, N], got shape {tuple(wav.shape)}")
        wav = self.normalize_volume(wav.float())
        starts_host = partial_starts(wav.shape[1])  # from the shape: no read of the device
        starts = torch.from_numpy(starts_host).to(wav.device)
        stop = int(starts_host[-1]) + _PARTIAL_FRAMES
        if stop * _HOP >= wav.shape[1]:  # Resemblyzer pads to the last partial's end
            wav = F.pad(wav, (0, stop * _HOP - wav.shape[1]))
        mel = self.mel(wav)  # [B, T, 40]
        frames = starts[:, None] + torch.arange(_PARTIAL_FRAMES, device=wav.device)
        partials = mel[:, frames].flatten(0, 1)  # [B * P, 160, 40]
        _, (hidden, _) = self.lstm(partials)
        embedded = F.normalize(F.relu(self.linear(hidden[-1])), dim=1)
        mean = embedded.view(wav.shape[0], len(starts), -1).mean(1)
        return F.normalize(mean, dim=1)


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no GE2E weights file here (Resemblyzer's pretrained.pt)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a weights-only load refuses any object it does not know
        raise ValueError(f"{path}: not a weights file torch can read safely ({type(exc).__name__})") from exc
    state = checkpoint.get("model_state") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a dict with 'model_state' (Resemblyzer's pretrained.pt)")
    out: dict[str, torch.Tensor] = {}
    for name, shape in _EXPECTED.items():
        value = state.get(name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{path}: model_state[{name!r}] should be a tensor {shape}, got {got}")
        if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
            raise ValueError(f"{path}: model_state[{name!r}] holds non-finite or non-float values")
        out[name] = value.float()
    return out
