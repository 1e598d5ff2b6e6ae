"""Lazy sources through load_dataset and the trainer: the streamed path equals the in-memory one,
bad samples are skipped and counted, a killed worker ends the run clearly and --resume continues."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from PIL import Image

from marginkit.data import load_dataset
from marginkit.train import TrainConfig, train
from marginkit.train.errors import TrainingError


def _folder(root, classes=6, per_class=12, size=12):
    rng = np.random.default_rng(0)
    for c in range(classes):
        base = rng.integers(0, 256, size=(size, size, 3))
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            noise = rng.integers(-30, 30, size=base.shape)
            Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(root / f"c{c}" / f"{i}.png")
    return root


def _run(tmp_path, name, data, **options):
    cfg = TrainConfig(
        data=f"folder:{data}", loss="cosface", model="cnn2d", epochs=2, batch_size=16, seed=1, num_threads=1,
        val_fraction=0.0, workers=1, data_options={"split": "classes", **options}, embedding_dim=16,
    )  # fmt: skip
    result = train(cfg, tmp_path / name, quiet=True, report=False)
    rows = [
        {k: v for k, v in r.items() if k not in ("epoch_seconds", "samples_per_second")}
        for r in result.history
    ]
    return rows, {k: v for k, v in result.metrics.items() if k != "train_seconds"}


def test_streamed_equals_in_memory_and_the_budget_decides(tmp_path):
    data = _folder(tmp_path / "imgs")
    held = load_dataset(f"folder:{data}", split="classes")
    assert not held.train.streamed and held.train.data.dtype.is_floating_point is False
    assert held.info["pipeline"].startswith("in memory")
    small = load_dataset(f"folder:{data}", split="classes", memory_budget=1000)
    assert small.train.streamed and "exceeds" in small.info["pipeline"]
    np.testing.assert_array_equal(small.train.x.numpy(), held.train.x.numpy())  # same rows, same pixels
    assert _run(tmp_path, "memory", data, stream=False) == _run(tmp_path, "stream", data, stream=True)


def test_bad_samples_are_skipped_and_counted_in_metrics(tmp_path):
    data = _folder(tmp_path / "imgs")
    bad = data / "c0" / "3.png"
    bad.write_bytes(bad.read_bytes()[:60])  # its header intact, its pixels cut off
    with pytest.raises(Exception, match="3.png"):
        _run(tmp_path, "raise", data, stream=True)
    for stream in (True, False):
        _run(tmp_path, f"skip{stream}", data, stream=stream, on_bad_sample="skip")
        metrics = json.loads((tmp_path / f"skip{stream}" / "metrics.json").read_text())
        assert metrics["skipped_samples"] == 1 and metrics["skipped_examples"][0].endswith("3.png")


@pytest.mark.slow
def test_a_killed_worker_ends_the_run_and_resume_continues(tmp_path, monkeypatch):
    from marginkit.data import folder

    data = _folder(tmp_path / "imgs")
    parent, read = os.getpid(), folder.ImageFiles._read_key

    def killing(self, key, rng):
        if os.getpid() != parent and key == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return read(self, key, rng)

    monkeypatch.setattr(folder.ImageFiles, "_read_key", killing)
    t0 = time.monotonic()
    with pytest.raises(TrainingError, match="data-loading worker process died.*last.pt .* is intact"):
        _run(tmp_path, "run", data, stream=True)
    assert time.monotonic() - t0 < 60
    monkeypatch.setattr(folder.ImageFiles, "_read_key", read)
    assert train(None, tmp_path / "run", resume=True, quiet=True, report=False).finished
