"""Experiment tracking: TensorBoard event files and MLflow runs, read back with their own readers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from marginkit.cli import main
from marginkit.train.config import ConfigError, TrainConfig, apply_overrides
from marginkit.train.trainer import train


def config(**over: object) -> TrainConfig:
    base = {
        "data": "digits", "model": "mlp", "model_options": {"hidden": [16]}, "embedding_dim": 8, "epochs": 3,
        "batch_size": 64, "k": 3, "loss": "cosface", "num_threads": 1, "train_per_class": 30,
    }  # fmt: skip
    base.update(over)
    return apply_overrides(TrainConfig(), base)


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_every_epochs_metrics_and_the_test_metrics(tmp_path):
    result = train(config(tracking={"tensorboard": True}), tmp_path / "run", quiet=True, report=False)
    got = scalars(tmp_path / "run" / "tensorboard")
    for key in ("train_loss", "lr", "val_knn_accuracy", "epoch_seconds"):
        assert [step for step, _ in got[f"train/{key}"]] == [1, 2, 3], key
        assert [v for _, v in got[f"train/{key}"]] == pytest.approx([r[key] for r in result.history]), key
    assert got["test/knn_accuracy"] == [(3, pytest.approx(result.metrics["knn_accuracy"]))]
    assert got["test/verification/eer"][0][1] == pytest.approx(result.metrics["verification"]["eer"])


def test_tensorboard_of_a_resumed_run_shows_each_epoch_once(tmp_path):
    cfg = config(tracking={"tensorboard": str(tmp_path / "tb")})
    train(cfg, tmp_path / "run", quiet=True, report=False, stop_after=2)
    train(None, tmp_path / "run", quiet=True, report=False, resume=True)  # tracking: from the checkpoint
    steps = [step for step, _ in scalars(tmp_path / "tb")["train/train_loss"]]
    assert steps == [1, 2, 3]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    pytest.importorskip("mlflow")
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def test_mlflow_run_holds_params_metrics_and_the_report(tmp_path, store):
    from mlflow import MlflowClient

    cfg = config(tracking={"mlflow": store, "experiment": "tests", "run_name": "one"})
    train(cfg, tmp_path / "run", quiet=True, report=False, stop_after=1)
    run_id = json.loads((tmp_path / "run" / "tracking.json").read_text())["mlflow_run_id"]
    result = train(None, tmp_path / "run", quiet=True, resume=True)  # continues the same MLflow run
    client = MlflowClient(store)
    run = client.get_run(run_id)
    assert run.info.run_name == "one" and run.info.status == "FINISHED"
    assert run.data.params["loss"] == "cosface" and run.data.params["model_options.hidden"] == "[16]"
    assert run.data.params["epochs"] == "3" and "tracking" not in run.data.params
    history = client.get_metric_history(run_id, "train_loss")
    assert sorted({m.step for m in history}) == [1, 2, 3]
    last = {m.step: m.value for m in history}
    assert [last[e] for e in (1, 2, 3)] == pytest.approx([r["train_loss"] for r in result.history])
    assert run.data.metrics["test.knn_accuracy"] == pytest.approx(result.metrics["knn_accuracy"])
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"report.html", "metrics.json", "config.yaml"} <= names
    experiment = client.get_experiment_by_name("tests")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]


def test_compare_logs_one_mlflow_run_per_loss_and_seed(tmp_path, capsys):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    out = tmp_path / "cmp"
    code = main([
        "compare", "--data", "digits", "--losses", "cosface,softmax", "--seeds", "2", "--epochs", "1",
        "--model", "mlp", "--set", "model_options.hidden=[8]", "--train-per-class", "10", "--k", "3",
        "--out", str(out), "--mlflow", "--tensorboard", "--no-baselines", "-q",
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("cmp")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == [
        "cosface-seed0", "cosface-seed1", "softmax-seed0", "softmax-seed1",
    ]  # fmt: skip
    for r in runs:
        loss, seed = r.info.run_name.split("-seed")
        assert r.data.params["loss"] == loss and r.data.params["seed"] == seed
        assert "test.knn_accuracy" in r.data.metrics and r.info.status == "FINISHED"
    assert (out / "runs" / "softmax" / "seed1" / "tensorboard").is_dir()


def test_trackers_are_imported_only_when_asked(tmp_path):
    code = (
        "import sys\n"
        "from marginkit.train import TrainConfig, train\n"
        f"train(TrainConfig(data='digits', model='mlp', epochs=1, num_threads=1, train_per_class=10, k=3), "
        f"{str(tmp_path / 'run')!r}, quiet=True, report=False)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'tensorboard') "
        "or m == 'torch.utils.tensorboard'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip() == "[]"


def test_a_missing_tracker_package_says_what_to_install(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def absent(name, *args, **kwargs):
        if name.split(".")[0] == "mlflow" or name == "torch.utils.tensorboard":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", absent)
    for key in ("mlflow", "tensorboard"):
        with pytest.raises(ImportError, match=rf"tracking.{key} needs .*marginkit\[tracking\]"):
            train(config(tracking={key: True}), tmp_path / key, quiet=True, report=False)


def test_unusable_stores_and_directories_fail_before_training(tmp_path):
    pytest.importorskip("mlflow")
    with pytest.raises(ConfigError, match="tracking.mlflow 'file:.*not a usable MLflow store"):
        train(config(tracking={"mlflow": f"file:{tmp_path / 'mlruns'}"}), tmp_path / "a", quiet=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="tracking .*tensorboard"):
        train(config(tracking={"tensorboard": str(tmp_path / "file" / "tb")}), tmp_path / "b", quiet=True)
