"""The pretrained GE2E baseline (marginkit.audio.ge2e): Resemblyzer's encoder re-built in torch.

The golden figures below were printed by Resemblyzer 0.1.4 itself (its ``VoiceEncoder`` on
librosa 0.11.0, 2026-12-05): ``compute_partial_slices(n, 1.3, 0.75)`` and ``embed_utterance`` of
the volume-normalised test tone, so they are an independent oracle of the mel front-end, the
partials and the network. Tests that need the real weights file skip when no Resemblyzer
distribution is installed (``./dev.sh test`` installs it without its dependencies).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from marginkit.audio.ge2e import WEIGHTS_ENV, GE2EEncoder, find_weights, partial_starts, slaney_mel_basis

# Resemblyzer's partial starts (frames) by utterance length (samples).
PARTIALS = {
    1: [0], 100: [0], 16000: [0], 25600: [0], 25601: [0], 30000: [0], 36000: [0, 77],
    48000: [0, 77, 154], 160000: [77 * i for i in range(12)],
}  # fmt: skip
# embed_utterance of _tone() after normalize_volume(-30 dBFS, increase_only): first 12 values,
# the sum, the argmax and the max.
GOLDEN_HEAD = [
    0.12613378,
    0.0,
    0.0,
    0.0,
    0.0,
    0.00629729,
    0.0,
    0.00560959,
    0.0,
    0.05995005,
    0.20597042,
    0.06881038,
]
GOLDEN_SUM, GOLDEN_ARGMAX, GOLDEN_MAX = 8.823259353637695, 209, 0.2936069965362549


def _tone() -> np.ndarray:
    t = np.arange(24000) / 16000
    voiced = 0.1 * np.sin(2 * np.pi * 150 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (voiced + 0.02 * np.sin(2 * np.pi * 1234 * t)).astype(np.float32)


def _state() -> dict[str, torch.Tensor]:
    lstm, linear = torch.nn.LSTM(40, 256, 3, batch_first=True), torch.nn.Linear(256, 256)
    state = {f"lstm.{k}": v for k, v in lstm.state_dict().items()}
    state.update({f"linear.{k}": v for k, v in linear.state_dict().items()})
    return state


@pytest.fixture
def random_weights(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "pretrained.pt"
    torch.save({"step": 1, "model_state": {**_state(), "similarity_weight": torch.ones(1)}}, path)
    return path


@pytest.mark.parametrize("n", sorted(PARTIALS))
def test_partials_are_resemblyzers(n):
    assert partial_starts(n).tolist() == PARTIALS[n]


def test_mel_basis_is_a_set_of_unit_area_triangles():
    basis = slaney_mel_basis()
    assert basis.shape == (40, 201) and (basis >= 0).all()
    freqs = np.linspace(0, 8000, 201)
    peaks = freqs[basis.argmax(1)]
    assert np.all(np.diff(peaks) > 0)  # ordered bands
    assert np.all(peaks[:10] < 1000) and peaks[-1] > 6000  # dense below 1 kHz, Slaney's linear part


def test_real_weights_reproduce_resemblyzer():
    weights = find_weights()
    if weights is None:
        pytest.skip("no Resemblyzer distribution installed (pip install --no-deps resemblyzer)")
    encoder = GE2EEncoder(weights)
    emb = encoder(torch.from_numpy(_tone())[None])[0].detach().numpy()
    assert emb[:12] == pytest.approx(GOLDEN_HEAD, abs=2e-6)
    assert float(emb.sum()) == pytest.approx(GOLDEN_SUM, abs=1e-4)
    assert int(emb.argmax()) == GOLDEN_ARGMAX and float(emb.max()) == pytest.approx(GOLDEN_MAX, abs=2e-6)
    # a batch embeds each row as alone; quieter copies (below -30 dBFS) are raised to one level
    batch = torch.from_numpy(np.stack([_tone(), 0.1 * _tone(), 0.01 * _tone()]))
    rows = encoder(batch).detach().numpy()
    assert np.abs(rows[0] - emb).max() < 1e-5
    assert np.abs(rows[1] - rows[2]).max() < 1e-5 and np.abs(rows[1] - emb).max() > 1e-3


def test_env_names_the_weights(random_weights, monkeypatch):
    monkeypatch.setenv(WEIGHTS_ENV, str(random_weights))
    assert find_weights() == random_weights
    out = GE2EEncoder(find_weights())(torch.zeros(2, 20000))  # silence: finite, unit or zero rows
    assert out.shape == (2, 256) and torch.isfinite(out).all()


def test_bad_weight_files_are_refused_naming_the_file(tmp_path, random_weights):
    with pytest.raises(FileNotFoundError, match="no GE2E weights file"):
        GE2EEncoder(tmp_path / "absent.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match="junk.pt: not a weights file"):
        GE2EEncoder(junk)
    evil = tmp_path / "evil.pt"

    class Payload:
        def __reduce__(self):
            return (print, ("executed",))

    with open(evil, "wb") as fh:
        pickle.dump({"model_state": Payload()}, fh)
    with pytest.raises(ValueError, match="evil.pt: not a weights file"):
        GE2EEncoder(evil)
    wrong = tmp_path / "wrong.pt"
    state = _state()
    state["linear.weight"] = torch.zeros(128, 256)
    torch.save({"model_state": state}, wrong)
    with pytest.raises(ValueError, match=r"model_state\['linear.weight'\] should be a tensor \(256, 256\)"):
        GE2EEncoder(wrong)
    torch.save([1, 2], wrong)
    with pytest.raises(ValueError, match="expected a dict with 'model_state'"):
        GE2EEncoder(wrong)
    state = _state()
    state["lstm.bias_ih_l0"][0] = float("nan")
    torch.save({"model_state": state}, wrong)
    with pytest.raises(ValueError, match="non-finite"):
        GE2EEncoder(wrong)


def test_input_shape_is_checked(random_weights):
    with pytest.raises(ValueError, match=r"waveforms \[B, N\]"):
        GE2EEncoder(random_weights)(torch.zeros(16000))
