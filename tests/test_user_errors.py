"""Hostile and tiny inputs through the command line: one-line user errors (exit 2), never an
"internal error" — options out of range, too little data for K, nothing to predict, damaged files."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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
        ("batch_size=1", "batch_size must be >= 2"),
        ("data.test_fraction=2", "test_fraction must be in [0, 1), got 2.0"),
        pytest.param(
            "device=mps",
            "device 'mps' requested but MPS (Apple GPU) is not available",
            marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is available"),
        ),
        pytest.param(
            "device=cuda:7",
            "device 'cuda:7' requested but",
            marks=pytest.mark.skipif(torch.cuda.device_count() > 7, reason="8 CUDA devices"),
        ),
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


def _limited_cli(tmp_path: Path, *argv: str, limit_gb: int = 6) -> subprocess.CompletedProcess[str]:
    """The CLI in a process whose address space is capped: a check that regressed fails the
    test with an allocation error instead of exhausting the machine's memory."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_gb << 30, limit_gb << 30))

    return subprocess.run(
        [sys.executable, "-m", "marginkit.cli", *argv], capture_output=True, text=True, timeout=300,
        preexec_fn=cap, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("model", "options"),
    [
        ("mlp", ["model_options.hidden=[65536, 65536, 65536]"]),  # 8.6e9 parameters, each width in range
        ("cnn1d", ["model_options.channels=[4096, 4096, 4096]", "model_options.kernel_size=1025"]),
    ],
)
def test_a_model_too_big_for_the_machine_is_refused_before_allocating(tmp_path, model, options):
    data = _blobs(tmp_path / "d.npz", 10)
    sets = [a for o in options for a in ("--set", o)]
    proc = _limited_cli(
        tmp_path, "train", "--data", f"features:{data}", "--loss", "cosface", *TINY[4:], "--model", model,
        *sets, "--out", str(tmp_path / "run"),
    )  # fmt: skip
    err = [line for line in proc.stderr.splitlines() if "warning" not in line]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert f"marginkit: error: model {model!r}" in err[0] and "parameters: training it needs" in err[0]
    assert "MB of cpu; lower the widths in model_options or embedding_dim" in err[0]
    assert not (tmp_path / "run" / "last.pt").exists()


def test_the_model_size_check_counts_the_head_and_the_optimizer(tmp_path, capsys, monkeypatch):
    from marginkit.train import components

    data = _blobs(tmp_path / "d.npz", 10)
    # mlp 4 -> 4096 -> 4: 4*4096 + 4096 + 2*4096 (batch norm) + 4096*4 + 4 weights; the cosine head 2 x 4
    n = 4 * 4096 + 4096 + 2 * 4096 + 4096 * 4 + 4 + 2 * 4
    argv = ["train", "--data", f"features:{data}", "--loss", "cosface", *TINY, "--set", "model.hidden=[4096]",
            "--set", "val_fraction=0"]  # fmt: skip
    monkeypatch.setattr(components, "_device_memory_bytes", lambda device: n * 16 - 1)
    err = _user_error(capsys, *argv, "--out", str(tmp_path / "a"))
    assert f"has {n:,} parameters: training it needs 0.7 MB for weights, gradients and adamw state" in err
    assert "more than the 0.7 MB of cpu" in err
    monkeypatch.setattr(components, "_device_memory_bytes", lambda device: n * 16)
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    monkeypatch.setattr(components, "_device_memory_bytes", lambda device: n * 12)
    assert main([*argv, "--optimizer", "sgd", "--out", str(tmp_path / "c")]) == 0


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


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is available")
def test_compare_refuses_an_unavailable_device_before_loading_data(tmp_path, capsys):
    data = _blobs(tmp_path / "d.npz", 10)
    err = _user_error(
        capsys, "compare", "--data", f"features:{data}", "--losses", "softmax,triplet", "--epochs", "1",
        "--quiet", "--device", "mps", "--out", str(tmp_path / "cmp"),
    )  # fmt: skip
    assert err == (
        "marginkit: error: device 'mps' requested but MPS (Apple GPU) is not available; use device=cpu"
    )
