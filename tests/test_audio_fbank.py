"""The torch Kaldi filterbank against kaldi-native-fbank (every option set explicitly)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from marginkit.audio.fbank import KaldiFbank, mel_banks, num_frames
from marginkit.audio.synthetic import synthetic_speakers, voiced_utterance

knf = pytest.importorskip("kaldi_native_fbank")

# Measured: max |difference| of the log energies 3e-5 .. 7e-5 on white noise and the voiced signal; on the
# espeak-ng recording 2.3e-4 (hamming) and 2.3e-3 (povey), the largest in bins ~e^-23 below their frame's
# peak, where float32 rounding of the spectrum (on both sides) is a visible fraction of the bin's energy.
TOLERANCE = 5e-4


def reference(wave: np.ndarray, *, window: str = "hamming", rate: int = 16000, bins: int = 80) -> np.ndarray:
    """kaldi-native-fbank with every option set (its defaults differ: dither 3e-5, povey, 23 bins)."""
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = rate
    opts.frame_opts.frame_shift_ms = 10.0
    opts.frame_opts.frame_length_ms = 25.0
    opts.frame_opts.dither = 0.0
    opts.frame_opts.preemph_coeff = 0.97
    opts.frame_opts.remove_dc_offset = True
    opts.frame_opts.window_type = window
    opts.frame_opts.round_to_power_of_two = True
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = bins
    opts.mel_opts.low_freq = 20.0
    opts.mel_opts.high_freq = 0.0
    opts.use_energy = False
    opts.raw_energy = True
    opts.use_log_fbank = True
    opts.use_power = True
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(rate, (wave.astype(np.float64) * 32768.0).tolist())
    fbank.input_finished()
    return np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])


def ours(wave: np.ndarray, **options: object) -> np.ndarray:
    module = KaldiFbank(cmn=False, **options).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        return module(torch.from_numpy(wave)[None])[0].numpy()


def white_noise(n: int = 16000, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def voiced(seconds: float = 1.0, seed: int = 0) -> np.ndarray:
    speaker = synthetic_speakers(3, seed=seed)[1]
    return voiced_utterance(speaker, seconds, np.random.default_rng(seed))


@pytest.mark.parametrize("window", ["hamming", "povey"])
@pytest.mark.parametrize("signal", ["noise", "voiced"])
def test_matches_kaldi_native_fbank(window: str, signal: str) -> None:
    wave = white_noise() if signal == "noise" else voiced()
    expected = reference(wave, window=window)
    got = ours(wave, window=window)
    assert got.shape == expected.shape == (num_frames(wave.size, 400, 160), 80)
    assert np.abs(got - expected).max() < TOLERANCE


def test_other_lengths_rates_and_bins() -> None:
    wave = white_noise(12345, seed=3)
    expected = reference(wave, rate=8000, bins=40)
    got = ours(wave, sample_rate=8000, num_bins=40)
    assert got.shape == expected.shape == (1 + (12345 - 200) // 80, 40)
    assert np.abs(got - expected).max() < TOLERANCE


def test_a_real_espeak_recording() -> None:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng): no real recording to compare on")
    sf = pytest.importorskip("soundfile")
    soxr = pytest.importorskip("soxr")
    import io

    raw = subprocess.run(
        ["espeak-ng", "-v", "en", "-s", "150", "--stdout", "Margins keep speakers apart."],
        capture_output=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    wave, rate = sf.read(io.BytesIO(raw), dtype="float32")
    wave = np.asarray(soxr.resample(wave, rate, 16000), dtype=np.float32)
    assert wave.size > 16000
    for window in ("hamming", "povey"):
        difference = np.abs(ours(wave, window=window) - reference(wave, window=window))
        assert np.quantile(difference, 0.999) < TOLERANCE
        assert difference.max() < 10 * TOLERANCE


def test_batched_mean_normalised_and_dither_in_training_only() -> None:
    waves = np.stack([white_noise(8000, seed=s) for s in range(3)])
    module = KaldiFbank().eval()
    batch = module(torch.from_numpy(waves))
    for i in range(3):
        single = reference(waves[i])
        np.testing.assert_allclose(batch[i].numpy(), single - single.mean(axis=0), atol=2 * TOLERANCE)
    assert batch.mean(dim=1).abs().max() < 1e-4
    module.train()
    torch.manual_seed(0)
    dithered = module(torch.from_numpy(waves))
    assert not torch.equal(dithered, batch)
    torch.manual_seed(0)
    assert torch.equal(module(torch.from_numpy(waves)), dithered)  # seeded by torch's generator


def test_mel_banks_are_kaldi_triangles() -> None:
    banks = mel_banks(80, 512, 16000)
    assert banks.shape == (257, 80)
    assert torch.all(banks[-1] == 0) and torch.all(banks >= 0) and torch.all(banks <= 1)
    # Each filter peaks once and rises then falls.
    peaks = banks.argmax(dim=0)
    assert torch.all(peaks[1:] >= peaks[:-1])


def test_refusals() -> None:
    with pytest.raises(ValueError, match="fewer than one 400-sample frame"):
        KaldiFbank()(torch.zeros(1, 399))
    with pytest.raises(ValueError, match=r"\[batch, samples\]"):
        KaldiFbank()(torch.zeros(400))
    with pytest.raises(ValueError, match="window"):
        KaldiFbank(window="blackmann")
    with pytest.raises(ValueError, match="high_freq"):
        KaldiFbank(low_freq=9000.0)


@pytest.mark.slow
def test_onnx_export_equals_eager(tmp_path) -> None:
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    module = KaldiFbank().eval()
    example = torch.from_numpy(np.stack([white_noise(4000, 1), white_noise(4000, 2)]))
    program = torch.onnx.export(
        module, (example,), input_names=["x"], output_names=["fbank"], dynamo=True, verbose=False,
        dynamic_shapes={"waveform": {0: torch.export.Dim("batch"), 1: torch.export.Dim("samples", min=400)}},
    )  # fmt: skip
    program.save(tmp_path / "fbank.onnx")
    session = ort.InferenceSession(str(tmp_path / "fbank.onnx"), providers=["CPUExecutionProvider"])
    other = white_noise(7000, 5)[None]
    (got,) = session.run(None, {"x": other})
    np.testing.assert_allclose(got, module(torch.from_numpy(other)).detach().numpy(), atol=1e-4)
