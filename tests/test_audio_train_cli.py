"""`marginkit train --data audio:DIR` end to end: seeded crops in training, whole utterances of any
length in evaluation (one per forward pass), speaker-disjoint open-set metrics that equal a
brute-force computation from `marginkit embed`, and the pretrained GE2E baseline scored alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from marginkit.audio.synthetic import synthetic_speakers, write_speaker_folder
from marginkit.cli import main
from test_audio_end_to_end import brute_eer

pytest.importorskip("soundfile")

TINY = ["--set", "model_options.channels=16", "--set", "model_options.aggregation_channels=24",
        "--set", "model_options.num_bins=24", "--set", "data_options.crop_seconds=0.5"]  # fmt: skip


@pytest.fixture(scope="module")
def speakers(tmp_path_factory):
    root = tmp_path_factory.mktemp("speakers")
    write_speaker_folder(root, synthetic_speakers(8, seed=4), 4, seconds=(0.6, 1.2), seed=5)
    return root


@pytest.fixture(scope="module")
def run(speakers, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "ecapa"
    code = main(["train", "--data", f"audio:{speakers}", "--model", "ecapa_tdnn", "--loss", "cosface",
                 "--epochs", "1", "--batch-size", "8", "--workers", "0", *TINY, "--out", str(out),
                 "--no-report", "-q"])  # fmt: skip
    assert code == 0
    return out


def test_an_audio_run_is_open_set_and_its_metrics_equal_brute_force_from_embed(run, tmp_path):
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["open_set"] is True and metrics["num_test"] == 8
    assert main(["embed", str(run), "--out", str(tmp_path / "e.npz"), "--split", "test"]) == 0
    arrays = np.load(tmp_path / "e.npz")
    emb, labels, paths = arrays["test_embeddings"], arrays["test_labels"], arrays["test_paths"]
    assert len(emb) == len(labels) == len(paths) == 8  # 2 unseen speakers x 4 utterances, each once
    assert all(p.endswith(".wav") and not p.startswith("/") for p in paths.tolist())
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    i, j = np.triu_indices(len(unit), 1)
    scores, genuine = np.sum(unit[i] * unit[j], axis=1), labels[i] == labels[j]
    assert genuine.sum() == metrics["verification"]["num_genuine"] == 12
    assert metrics["verification"]["eer"] == pytest.approx(brute_eer(scores, genuine), abs=1e-6)


def test_evaluation_embeds_whole_utterances_of_any_length(speakers):
    from marginkit.train.evaluate import embed_rows
    from marginkit.train.sources import register_sources

    register_sources()
    from marginkit.data import load_dataset

    splits = load_dataset(f"audio:{speakers}", crop_seconds=0.5)
    assert splits.input_shape == (8000,)  # the model's nominal input: one training crop
    from marginkit.audio.ecapa_tdnn import ECAPATDNN

    net = ECAPATDNN((8000,), 16, True, channels=16, aggregation_channels=24, num_bins=24)
    emb, rows = embed_rows(net, splits.test.data, batch_size=64, device="cpu", workers=0)
    assert rows.tolist() == list(range(len(splits.test)))
    net.eval()
    with torch.no_grad():  # one by one, whole: the same embeddings
        alone = torch.cat([net(torch.from_numpy(splits.test.data.read(i))[None]) for i in range(len(rows))])
    assert torch.allclose(emb, alone, atol=1e-6)


def test_audio_baseline_is_the_pretrained_encoder_or_a_warning(speakers, tmp_path, monkeypatch):
    from marginkit.audio.ge2e import WEIGHTS_ENV
    from marginkit.data import load_dataset
    from marginkit.train.baselines import evaluate_baselines
    from marginkit.train.config import TrainConfig
    from marginkit.train.sources import register_sources
    from test_audio_ge2e import _state

    register_sources()
    splits = load_dataset(f"audio:{speakers}")
    config = TrainConfig(data=f"audio:{speakers}", workers=0)
    torch.save({"model_state": _state()}, tmp_path / "pretrained.pt")
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path / "pretrained.pt"))
    rows = evaluate_baselines(splits, config)
    assert list(rows) == ["pretrained_ge2e"]
    assert (
        rows["pretrained_ge2e"]["num_test"] == 8 and 0 <= rows["pretrained_ge2e"]["verification"]["eer"] <= 1
    )
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path / "absent.pt"))
    with pytest.raises(FileNotFoundError, match="absent.pt"):
        evaluate_baselines(splits, config)
    slow = load_dataset(f"audio:{speakers}", sample_rate=8000)
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path / "pretrained.pt"))
    with pytest.warns(UserWarning, match="rate is 8000 Hz"):
        assert evaluate_baselines(slow, config) == {}
