"""Trainer: exact resume, determinism, checkpoints, evaluation files, schedules, precise BN."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from marginkit.train.checkpoint import CheckpointError, atomic_save, load_checkpoint
from marginkit.train.config import ConfigError, TrainConfig, apply_overrides
from marginkit.train.trainer import (
    LRSchedule,
    RunDirError,
    load_run,
    load_splits,
    recalibrate_batchnorm,
    train,
)


def blobs(path: Path, *, classes: int = 4, per_class: int = 40, dim: int = 12, seed: int = 0) -> Path:
    """A small features npz: Gaussian blobs, separable but not trivially."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)) * 1.5
    y = np.repeat(np.arange(classes), per_class)
    x = centres[y] + rng.normal(size=(y.size, dim))
    np.savez(path, x=x.astype(np.float32), y=y)
    return path


@pytest.fixture(scope="module")
def data_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    return "features:" + str(blobs(tmp_path_factory.mktemp("data") / "blobs.npz"))


def small_config(data: str, **over: object) -> TrainConfig:
    base = {
        "data": data, "model": "mlp", "model_options": {"hidden": [32]}, "embedding_dim": 8, "epochs": 3,
        "batch_size": 32, "lr": 3e-3, "k": 3, "loss": "softmax", "samples_per_class": 4, "warmup_epochs": 0.5,
        "num_threads": 1,
    }  # fmt: skip
    base.update(over)
    return apply_overrides(TrainConfig(), base)


def state_tensors(run_dir: Path, name: str = "last.pt") -> dict[str, torch.Tensor]:
    ckpt = load_checkpoint(run_dir / name)
    out = {f"model.{k}": v for k, v in ckpt["model"].items()}
    out.update({f"head.{k}": v for k, v in ckpt["head"].items()})
    for pid, st in ckpt["optimizer"]["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{pid}.{k}"] = v
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("loss", ["softmax", "circle"])
def test_resume_after_interruption_equals_uninterrupted(tmp_path, data_spec, loss):
    cfg = small_config(data_spec, loss=loss)
    full = train(cfg, tmp_path / "full", quiet=True, report=False)
    assert full.finished and full.epochs_completed == 3
    part = train(cfg, tmp_path / "part", quiet=True, stop_after=1, report=False)
    assert not part.finished and part.epochs_completed == 1
    assert load_checkpoint(tmp_path / "part" / "last.pt")["epoch"] == 1
    # a fresh process state would differ: scramble the global RNG before resuming
    torch.manual_seed(12345)
    resumed = train(None, tmp_path / "part", resume=True, quiet=True, report=False)
    assert resumed.finished
    assert_same(state_tensors(tmp_path / "full"), state_tensors(tmp_path / "part"))
    assert_same(state_tensors(tmp_path / "full", "best.pt"), state_tensors(tmp_path / "part", "best.pt"))
    rows_full = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    rows_part = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows_part] == [1, 2, 3]
    assert [r["train_loss"] for r in rows_part] == [r["train_loss"] for r in rows_full]
    assert resumed.metrics["knn_accuracy"] == full.metrics["knn_accuracy"]


def test_same_seed_same_weights_other_seed_differs(tmp_path, data_spec):
    cfg = small_config(data_spec, epochs=2)
    train(cfg, tmp_path / "a", quiet=True, report=False)
    train(cfg, tmp_path / "b", quiet=True, report=False)
    assert_same(state_tensors(tmp_path / "a"), state_tensors(tmp_path / "b"))
    train(apply_overrides(cfg, {"seed": 1}), tmp_path / "c", quiet=True, report=False)
    a, c = state_tensors(tmp_path / "a"), state_tensors(tmp_path / "c")
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_resume_refuses_changed_options_and_missing_checkpoint(tmp_path, data_spec):
    cfg = small_config(data_spec, epochs=2)
    train(cfg, tmp_path / "r", quiet=True, stop_after=1, report=False)
    with pytest.raises(ConfigError, match=r"lr \(run: 0.003, given: 0.1\)"):
        train(apply_overrides(cfg, {"lr": 0.1}), tmp_path / "r", resume=True, quiet=True)
    with pytest.raises(RunDirError, match="no last.pt"):
        train(cfg, tmp_path / "empty", resume=True, quiet=True)
    with pytest.raises(RunDirError, match="already holds a run"):
        train(cfg, tmp_path / "r", quiet=True)


def test_checkpoint_contents_and_files(tmp_path, data_spec):
    cfg = small_config(data_spec, epochs=2)
    result = train(cfg, tmp_path / "r", quiet=True, report=False)
    run = tmp_path / "r"
    names = {p.name for p in run.iterdir()}
    assert {
        "config.yaml",
        "metrics.jsonl",
        "last.pt",
        "best.pt",
        "metrics.json",
        "knn_index.npz",
        "eval.npz",
    } <= names
    assert not [n for n in names if n.endswith(".tmp")]
    raw = torch.load(run / "last.pt", weights_only=True)  # loads without unpickling code
    assert TrainConfig.from_json(raw["config"]) == cfg
    assert raw["epoch"] == 2 and raw["global_step"] == 2 * (raw["global_step"] // 2)
    for key in ("optimizer", "scheduler", "rng"):
        assert raw[key]
    metrics = json.loads((run / "metrics.json").read_text())
    for key in (
        "knn_accuracy",
        "head_accuracy",
        "precision_at_1",
        "r_precision",
        "map_at_r",
        "per_class_recall",
    ):
        assert key in metrics
    assert 0.5 < metrics["knn_accuracy"] <= 1.0  # separable blobs: well above chance (0.25)
    best = torch.load(run / "best.pt", weights_only=True)
    assert metrics["fingerprint"] == best["fingerprint"] and metrics["epoch"] == best["epoch"]
    from marginkit.knn import KNNClassifier

    KNNClassifier.load(run / "knn_index.npz", expected_fingerprint=best["fingerprint"])
    with pytest.raises(ValueError, match="fingerprint"):
        KNNClassifier.load(run / "knn_index.npz", expected_fingerprint="sha256:" + "0" * 64)
    assert result.metrics["knn_accuracy"] == metrics["knn_accuracy"]
    with np.load(run / "eval.npz") as z:
        assert z["confusion"].sum() == metrics["num_test"]
        assert z["projection"].shape == (metrics["num_test"], 2)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_corrupted_and_foreign_checkpoints_are_clear_errors(tmp_path, data_spec):
    run = tmp_path / "r"
    train(small_config(data_spec, epochs=1), run, quiet=True, report=False)
    data = (run / "last.pt").read_bytes()
    (run / "last.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(run / "last.pt")
    with pytest.raises(CheckpointError, match="corrupted"):
        train(None, run, resume=True, quiet=True)
    (run / "last.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(run / "last.pt")

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (run / "evil.pt").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError):
        load_checkpoint(run / "evil.pt")
    atomic_save({"weights": torch.zeros(2)}, run / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a marginkit checkpoint"):
        load_checkpoint(run / "foreign.pt")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(run / "missing.pt")
    (run / "best.pt").unlink()
    (run / "last.pt").unlink()
    with pytest.raises(RunDirError, match="holds no checkpoint"):
        load_run(run)


def test_unwritable_output_directory(tmp_path, data_spec):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match="cannot write to output directory"):
        train(small_config(data_spec, epochs=1), blocker / "run", quiet=True)


def test_open_set_run_reports_verification(tmp_path):
    cfg = apply_overrides(
        TrainConfig(),
        {
            "data": "identities", "model": "mlp", "model_options": {"hidden": [32]}, "embedding_dim": 16,
            "epochs": 1, "batch_size": 64, "loss": "cosface", "k": 3, "num_threads": 1,
            "data_options": {"num_train_identities": 20, "train_samples_per_identity": 6,
                             "num_val_identities": 8, "num_test_identities": 10,
                             "test_samples_per_identity": 5, "dim": 16, "hidden_dim": 16},
        },
    )  # fmt: skip
    result = train(cfg, tmp_path / "r", quiet=True, report=False)
    m = result.metrics
    assert m["open_set"] and "leave-one-out" in m["knn_protocol"]
    ver = m["verification"]
    assert 0 <= ver["eer"] <= 1 and ver["num_genuine"] == 10 * (5 * 4 // 2)
    assert "head_accuracy" not in m  # test identities are not training classes
    with np.load(tmp_path / "r" / "eval.npz") as z:
        far, tar = z["roc_far"], z["roc_tar"]
        assert far[0] == 0 and far[-1] == 1 and tar[-1] == 1 and np.all(np.diff(far) >= 0)
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert "val_precision_at_1" in rows[0]


def test_bf16_autocast_and_sgd_step_schedule_run(tmp_path, data_spec):
    cfg = small_config(
        data_spec, epochs=2, amp=True, optimizer="sgd", scheduler="step", step_epochs=1, grad_clip=1.0
    )
    result = train(cfg, tmp_path / "r", quiet=True, report=False)
    assert result.finished and math.isfinite(result.history[-1]["train_loss"])
    assert result.history[1]["lr"] == pytest.approx(cfg.lr * cfg.step_gamma)


def test_fp16_autocast_with_gradient_scaler_runs(tmp_path, data_spec):
    from marginkit.train.trainer import mixed_precision

    cfg = small_config(data_spec, epochs=2, amp="fp16", grad_clip=1.0, loss="arcface")
    result = train(cfg, tmp_path / "r", quiet=True, report=False)
    assert result.finished and all(math.isfinite(row["train_loss"]) for row in result.history)
    assert cfg.amp == "fp16" and small_config(data_spec, amp=True).amp == "bf16"
    assert small_config(data_spec, amp="false").amp == "off"
    with pytest.raises(ConfigError, match="amp must be one of off, bf16, fp16"):
        small_config(data_spec, amp="fp8")
    context, scaler = mixed_precision("fp16", torch.device("cpu"))
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    with context:
        assert torch.nn.Linear(3, 2)(torch.ones(1, 3)).dtype == torch.float16
    assert mixed_precision("bf16", torch.device("cpu"))[1] is None


def test_norm_adaptive_loss_needs_unnormalised_embeddings(tmp_path, data_spec):
    with pytest.raises(ConfigError, match="set normalize: false"):
        small_config(data_spec, loss="adaface")
    cfg = small_config(data_spec, loss="adaface", normalize=False, epochs=1)
    assert train(cfg, tmp_path / "r", quiet=True, report=False).finished


def test_lr_schedule_warmup_cosine_step():
    s = LRSchedule("cosine", total_steps=10, warmup_steps=2, steps_per_epoch=5, step_epochs=1, gamma=0.5)
    assert [s(0), s(1)] == [0.5, 1.0]
    assert s(2) == pytest.approx(1.0) and s(10) == pytest.approx(0.0)
    assert s(6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    step = LRSchedule("step", total_steps=20, warmup_steps=0, steps_per_epoch=5, step_epochs=2, gamma=0.1)
    assert [step(0), step(9), step(10), step(19)] == [1.0, 1.0, pytest.approx(0.1), pytest.approx(0.1)]
    assert LRSchedule("none", 10, 0, 5, 1, 0.1)(7) == 1.0


def test_precise_bn_sets_exact_batch_averages(gen):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    x = torch.randn(40, 3, generator=gen) * 3 + 1
    rng_before = torch.get_rng_state()
    recalibrate_batchnorm(model, x, batch_size=10, max_samples=40, seed=0, device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng_before)  # no dropout, no RNG consumed
    assert model.training and model[1].momentum == 0.1
    with torch.no_grad():
        h = model[0](x)
    # the subset order is a permutation of all rows: the mean of batch means is the full mean
    assert torch.allclose(model[1].running_mean, h.mean(0), atol=1e-5)
    # and the running variance the mean of the (unbiased) batch variances, near the full variance
    assert torch.allclose(model[1].running_var, h.var(0), rtol=0.35)


def test_non_finite_loss_is_a_clear_error(tmp_path, data_spec, monkeypatch):
    from marginkit.train import components
    from marginkit.train.trainer import TrainingError

    class Exploding(torch.nn.Module):  # lr=1e30 would be refused up front by the option ranges
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return self.inner(*args) * math.inf

    build = components.build_loss
    monkeypatch.setattr(components, "build_loss", lambda *a, **kw: Exploding(build(*a, **kw)))
    cfg = small_config(data_spec, epochs=1, scheduler="none", warmup_epochs=0)
    with pytest.raises(TrainingError, match="(loss|embeddings) became"):
        train(cfg, tmp_path / "r", quiet=True, report=False)


def test_load_splits_cache_returns_same_object(data_spec):
    cfg = small_config(data_spec)
    assert load_splits(cfg, cache=True) is load_splits(cfg, cache=True)


@pytest.mark.parametrize("loss", sorted(__import__("marginkit.train.registry", fromlist=["LOSSES"]).LOSSES))
def test_every_registered_loss_trains_and_evaluates(tmp_path, data_spec, loss):
    from marginkit.train.registry import LOSSES

    cfg = small_config(data_spec, loss=loss, epochs=1, normalize=not LOSSES[loss].norms)
    result = train(cfg, tmp_path / "r", quiet=True, report=False)
    m = result.metrics
    assert math.isfinite(result.history[0]["train_loss"]) and 0 <= m["knn_accuracy"] <= 1
    assert ("head_accuracy" in m) == (LOSSES[loss].kind == "class")
    assert ("support_size_mean" in m) == LOSSES[loss].alpha
    if LOSSES[loss].alpha:
        with np.load(tmp_path / "r" / "eval.npz") as z:
            sizes = z["support_size"]
            assert sizes.min() >= 1 and sizes.max() <= 4  # 4 classes in the blobs


def test_progress_bar_draws_only_on_a_terminal():
    import io

    from marginkit.train.progress import ProgressBar, format_duration

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    bar = ProgressBar(4, stream=stream, min_interval=0.0)
    for _ in range(4):
        bar.update(samples=32, loss=0.5, prefix="epoch 1/2")
    bar.close()
    text = stream.getvalue()
    assert "epoch 1/2" in text and "loss 0.5000" in text and "samples/s" in text and "ETA" in text
    assert "100.0%" in text and text.endswith("\n")
    plain = io.StringIO()
    quiet = ProgressBar(4, stream=plain)
    quiet.update(samples=1, loss=1.0)
    quiet.close()
    off = ProgressBar(4, stream=stream, enabled=False)
    assert not quiet.active and not off.active and plain.getvalue() == ""
    assert format_duration(75.3) == "1:15" and format_duration(3725) == "1:02:05"
    assert format_duration(float("nan")) == "?:??"


def test_checkpoint_every_commits_fewer_epochs_and_resumes_bit_identically(tmp_path, data_spec, monkeypatch):
    from marginkit.train.rundir import RunDir

    every = small_config(data_spec, epochs=7, eval_every=7, checkpoint_every=3)
    full = train(small_config(data_spec, epochs=7, eval_every=7), tmp_path / "full", quiet=True, report=False)
    committed: list[int] = []
    real_commit = RunDir.commit_epoch

    def record(self, payload, *, improved):
        committed.append(int(payload["epoch"]))
        if int(payload["epoch"]) == 6 and len(committed) == 3:  # the crash: epoch 6 trained, not committed
            raise RuntimeError("injected fault at the epoch-6 commit")
        real_commit(self, payload, improved=improved)

    monkeypatch.setattr(RunDir, "commit_epoch", record)
    with pytest.raises(RuntimeError, match="injected"):
        train(every, tmp_path / "every", quiet=True, report=False)
    assert committed == [0, 3, 6]
    assert load_checkpoint(tmp_path / "every" / "last.pt")["epoch"] == 3
    torch.manual_seed(12345)
    resumed = train(None, tmp_path / "every", resume=True, quiet=True, report=False)
    assert committed == [0, 3, 6, 6, 7]  # the last epoch is always committed
    assert resumed.finished
    assert_same(state_tensors(tmp_path / "full"), state_tensors(tmp_path / "every"))
    assert_same(state_tensors(tmp_path / "full", "best.pt"), state_tensors(tmp_path / "every", "best.pt"))
    rows = [json.loads(x) for x in (tmp_path / "every" / "metrics.jsonl").read_text().splitlines()]
    rows_full = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, 8))
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in rows_full]
    assert resumed.metrics["knn_accuracy"] == full.metrics["knn_accuracy"]

    committed.clear()  # a stop_after epoch and every improved (validated) epoch are committed too
    train(small_config(data_spec, epochs=7, eval_every=2, checkpoint_every=5), tmp_path / "stop", quiet=True,
          stop_after=3, report=False)  # fmt: skip
    assert committed == [0, 2, 3]
    assert load_checkpoint(tmp_path / "stop" / "last.pt")["epoch"] == 3


def test_checkpoint_every_is_a_runtime_key_and_checked():
    with pytest.raises(ConfigError, match="checkpoint_every"):
        apply_overrides(TrainConfig(), {"checkpoint_every": 0}).validate()
    from marginkit.train.config import RUNTIME_KEYS

    assert "checkpoint_every" in RUNTIME_KEYS
