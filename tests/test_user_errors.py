"""Hostile and tiny inputs through the command line: one-line user errors (exit 2), never an
"internal error" — options out of range, too little data for K, nothing to predict, damaged files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from marginkit.cli import main

TINY = ["--model", "mlp", "--set", "model_options.hidden=[16]", "--embedding-dim", "4", "--batch-size", "16",
        "--num-threads", "1", "--epochs", "1", "--quiet"]  # fmt: skip


def _blobs(path: Path, per_class: int) -> Path:
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(2), per_class)
    np.savez(path, x=(rng.normal(size=(y.size, 4)) + 3 * y[:, None]).astype(np.float32), y=y)
    return path


def _user_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "internal error" not in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("epochs=1e10", "epochs must be <= 100000"),
        ("loss.scale=1e30", "loss_options.scale must be <= 1000"),
        ("loss.margin=-1", "loss_options.margin must be >= 0"),
        (f"seed={2**64}", "seed must be <="),
        ("k=100000", "k must be <= 10000"),
        ("num_threads=1000000", "num_threads must be <= 1024"),
        ("embedding_dim=10000000", "embedding_dim must be <= 65536"),
        ("model_options.hidden=[100000000]", "model_options.hidden must be a list"),
        ("device=cuda:abc", "device must be"),
    ],
)
def test_out_of_range_options_are_one_line_errors(tmp_path, capsys, assignment, message):
    data = _blobs(tmp_path / "d.npz", 10)
    err = _user_error(
        capsys, "train", "--data", f"features:{data}", "--loss", "cosface", *TINY, "--set", assignment,
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert message in err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_pair_loss_with_one_class_per_batch_is_refused(tmp_path, capsys):
    data = _blobs(tmp_path / "d.npz", 10)
    err = _user_error(
        capsys, "train", "--data", f"features:{data}", "--loss", "triplet", *TINY,
        "--set", "classes_per_batch=1", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert "classes_per_batch must be >= 2 for pair losses" in err


def test_too_little_data_for_k_is_refused_before_training_with_advice(tmp_path, capsys):
    data = _blobs(tmp_path / "d.npz", 5)  # 8 training samples after the test split
    err = _user_error(
        capsys, "train", "--data", f"features:{data}", "--loss", "softmax", *TINY, "--k", "30",
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert "k=30 needs at least 30 training samples" in err and "lower --k (at most 8)" in err
    assert not (tmp_path / "run" / "last.pt").exists()  # refused before the first epoch


def test_tiny_test_split_trains_and_evaluates(tmp_path, capsys):
    # 1 test sample per class: retrieval has no relevant reference; it is left out, not a crash.
    data = _blobs(tmp_path / "d.npz", 5)
    run = tmp_path / "run"
    code = main(["train", "--data", f"features:{data}", "--loss", "softmax", *TINY, "--k", "3",
                 "--set", "val_fraction=0", "--out", str(run)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["num_test"] == 2 and "precision_at_1" not in metrics and metrics["knn_accuracy"] >= 0
    capsys.readouterr()
    err = _user_error(capsys, "eval", str(run), "--k", "20")
    assert "k=20 needs at least 20 training samples" in err
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 4), np.float32))
    err = _user_error(capsys, "predict", str(run), str(tmp_path / "empty.npz"))
    assert "'x' holds no samples" in err and "nothing to predict" in err
    index = run / "knn_index.npz"
    with np.load(index) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(index, **{**arrays, "labels": arrays["labels"] - 5})  # a damaged index
    np.savez(tmp_path / "x.npz", x=np.zeros((3, 4), np.float32))
    err = _user_error(capsys, "predict", str(run), str(tmp_path / "x.npz"))
    assert "knn_index.npz: 'labels' must lie in" in err
