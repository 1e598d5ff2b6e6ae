"""Data-parallel training: ``train()`` on 2 gloo ranks equals one process on the global batch.

One spawn of 2 processes trains, for a sharded class loss (CosFace, with gradient clipping on the
global norm), an alpha loss (Q-Margin), a replicated-head class loss (MEP) and a pair loss with
P×K batches (circle), one epoch of 4 SGD-momentum steps each (BN-free, dropout-free MLP) and
stops; it also trains one run to the end (evaluation once, on rank 0, over the full test set).
The parent trains the same runs in one process and compares the checkpoints (model, full head
weight, optimiser state), then resumes the 2-rank checkpoints in one process and compares the
finished runs with the uninterrupted one-process runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from marginkit.train.checkpoint import load_checkpoint
from marginkit.train.config import TrainConfig, apply_overrides
from marginkit.train.trainer import train
from proc_utils import CLI, alive, descendants, hook_env, wait_until

LOSSES = {
    "cosface": {"grad_clip": 0.5},
    "qmargin": {},
    "mep": {},
    "circle": {"samples_per_class": 4},
}


def blobs(path: Path) -> Path:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(5, 12)) * 1.5
    y = np.repeat(np.arange(5), 36)
    x = centres[y] + rng.normal(size=(y.size, 12))
    np.savez(path, x=x.astype(np.float32), y=y)
    return path


def config(data: str, loss: str, **over: object) -> TrainConfig:
    base = {
        "data": data, "loss": loss, "model": "mlp", "model_options": {"hidden": [32], "norm": "none"},
        "embedding_dim": 8, "epochs": 2, "batch_size": 36, "optimizer": "sgd", "lr": 0.05,
        "momentum": 0.9, "eval_every": 2, "k": 3, "num_threads": 1, "seed": 4, **LOSSES[loss],
        "train_per_class": 26,  # 130 training rows, as before the tiny-data rule dropped the val split
    }  # fmt: skip
    base.update(over)
    return apply_overrides(TrainConfig(), base)


def tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = load_checkpoint(run_dir / "last.pt")
    out = {f"model.{k}": v for k, v in ckpt["model"].items()}
    out.update({f"head.{k}": v for k, v in ckpt["head"].items()})
    for pid, state in ckpt["optimizer"]["state"].items():
        out.update({f"opt.{pid}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def assert_runs_close(a: Path, b: Path, tol: float = 2e-5) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert ta[key].shape == tb[key].shape, key
        excess = (ta[key].double() - tb[key].double()).abs() - tol * (1 + tb[key].double().abs())
        assert float(excess.max()) <= 0, f"{key}: {float(excess.max()):.3g} over tolerance"


def _worker(me, world, data, root):
    for loss in LOSSES:
        result = train(config(data, loss), Path(root) / f"{loss}-2", stop_after=1, quiet=True, report=False)
        assert result.epochs_completed == 1 and not result.finished
    done = train(config(data, "cosface", epochs=1), Path(root) / "full-2", quiet=True, report=False)
    assert done.finished
    return_path = Path(root) / f"metrics-rank{me}.json"
    return_path.write_text(json.dumps(done.metrics, sort_keys=True, default=str))


@pytest.mark.distributed
def test_two_rank_training_equals_one_process_and_resumes_on_one(tmp_path):
    data = "features:" + str(blobs(tmp_path / "blobs.npz"))
    run_distributed(_worker, 2, data, str(tmp_path), timeout_s=300.0)

    # metrics: computed once (rank 0), on the full test set, broadcast to every rank
    m0, m1 = (json.loads((tmp_path / f"metrics-rank{r}.json").read_text()) for r in (0, 1))
    written = json.loads((tmp_path / "full-2" / "metrics.json").read_text())
    assert m0 == m1 and m0["num_test"] == written["num_test"]
    single_full = train(config(data, "cosface", epochs=1), tmp_path / "full-1", quiet=True, report=False)
    assert m0["num_test"] == single_full.metrics["num_test"]
    assert_runs_close(tmp_path / "full-2", tmp_path / "full-1")

    for loss in LOSSES:
        two, one = tmp_path / f"{loss}-2", tmp_path / f"{loss}-1"
        train(config(data, loss), one, stop_after=1, quiet=True, report=False)
        assert_runs_close(two, one)  # 4 data-parallel steps == 4 one-process steps
        # the 2-rank checkpoint (full head, full optimiser state) resumes in one process
        train(None, two, resume=True, quiet=True, report=False)
        train(None, one, resume=True, quiet=True, report=False)
        assert_runs_close(two, one)


def test_batch_too_small_for_the_processes_is_a_clear_error(tmp_path, monkeypatch):
    from marginkit.train import _ddp
    from marginkit.train.config import ConfigError

    # pretend to be rank 0 of 40 (no process group: the check fires before any collective)
    monkeypatch.setattr(_ddp, "init_distributed", lambda device: _ddp.DistContext(0, 40, False))
    monkeypatch.setattr(_ddp.DistContext, "barrier", lambda self: None)

    def local(ctx, model, head, loss, device):
        return _ddp.Parallel(model, head, False, loss), head

    monkeypatch.setattr(_ddp, "parallelize", local)
    data = "features:" + str(blobs(tmp_path / "blobs.npz"))
    with pytest.raises(ConfigError, match="a batch of 36 split over 40 processes leaves fewer than 2"):
        train(config(data, "cosface"), tmp_path / "run", quiet=True, report=False)


def test_share_of_a_global_batch_is_balanced_and_contiguous():
    from marginkit.train._ddp import DistContext

    for n, world in [(10, 3), (7, 7), (36, 2), (5, 4)]:
        shares = [DistContext(r, world).share(n) for r in range(world)]
        sizes = [s.stop - s.start for s in shares]
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
        assert [s.start for s in shares] == [0, *[s.stop for s in shares[:-1]]]


@pytest.mark.slow
@pytest.mark.distributed
def test_cli_train_nproc_launches_torchrun(tmp_path, capsys):
    from marginkit.cli import main

    data = "features:" + str(blobs(tmp_path / "blobs.npz"))
    argv = ["train", "--nproc", "2", "--data", data, "--loss", "cosface", "--model", "mlp", "--epochs", "1"]
    argv += ["--batch-size", "36", "--embedding-dim", "8", "--num-threads", "1", "--no-report", "-q"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["num_test"] > 0 and (tmp_path / "run" / "best.pt").is_file()
    bad = ["train", "--nproc", "0", "--data", data, "--loss", "cosface", "--out", str(tmp_path / "x")]
    assert main(bad) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err


def _launch(tmp_path: Path, data: str, env: dict[str, str], *extra: str) -> subprocess.Popen:
    argv = ["train", "--nproc", "2", "--data", data, "--loss", "cosface", "--model", "mlp", "--epochs", "3",
            "--batch-size", "36", "--embedding-dim", "8", "--num-threads", "1", "--no-report", "-q",
            "--out", str(tmp_path / "run"), *extra]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-c", CLI, *argv], env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _end(launcher: subprocess.Popen, processes: list[int]) -> None:
    """Whatever happened in the test: nothing of the run outlives it (torchrun puts each rank in
    a process group of its own)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launcher.pid, signal.SIGKILL)
    for pid in processes:  # still ours: alive and running this run (a pid may have been reused)
        with contextlib.suppress(OSError):
            if alive(pid) and str(tmp_run(launcher)) in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
    launcher.wait()


def tmp_run(launcher: subprocess.Popen) -> str:
    """The ``--out`` of a launched run."""
    return launcher.args[launcher.args.index("--out") + 1]


def _resumes_in_one_process(run_dir: Path) -> None:
    assert load_checkpoint(run_dir / "last.pt")["epoch"] == 1  # the last checkpoint is intact
    assert train(None, run_dir, resume=True, quiet=True, report=False).finished


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_cli_ranks_stop_with_their_launcher(tmp_path, sig):
    data = "features:" + str(blobs(tmp_path / "blobs.npz"))
    env, marks = hook_env(tmp_path, hang_after_epoch=1)  # rank 0 hangs after committing epoch 1
    launcher = _launch(tmp_path, data, env)
    below: list[int] = []
    try:
        wait_until(lambda: any(marks.iterdir()) or launcher.poll() is not None, 300, "epoch 1 committed")
        below = descendants(launcher.pid)  # the torchrun agent and the two ranks
        assert len(below) >= 3, below
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=120)
        if sig == signal.SIGTERM:
            assert launcher.returncode == 130 and "continue with: marginkit train --resume" in err, err
        wait_until(lambda: not any(alive(p) for p in below), 60, "the agent and the ranks end")
    finally:
        _end(launcher, below)
    _resumes_in_one_process(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stopped_rank_ends_the_run_with_a_clear_error_within_the_collective_timeout(tmp_path):
    data = "features:" + str(blobs(tmp_path / "blobs.npz"))
    env, marks = hook_env(tmp_path, stop_rank_at_epoch=2)  # rank 1 SIGSTOPs itself before epoch 2
    launcher = _launch(tmp_path, data, env, "--set", "collective_timeout=5")
    below: list[int] = []
    try:
        wait_until(lambda: any(marks.iterdir()) or launcher.poll() is not None, 300, "rank 1 stopped")
        stopped = time.monotonic()
        below = descendants(launcher.pid)
        # rank 0 gives up after 5 s; torchrun then waits 30 s for the stopped rank before SIGKILL
        _, err = launcher.communicate(timeout=5 + 30 + 60)
        assert time.monotonic() - stopped < 5 + 30 + 60
    finally:
        _end(launcher, below)
    assert launcher.returncode == 1
    assert (
        "marginkit: error: rank 0: a peer process did not answer within the collective timeout "
        "(it stalled, was stopped or is much slower; see collective_timeout); the run stopped, its last.pt"
    ) in err
    _resumes_in_one_process(tmp_path / "run")


def test_collective_timeout_is_a_runtime_option_checked_up_front():
    from marginkit.train.config import RUNTIME_KEYS, ConfigError

    assert "collective_timeout" in RUNTIME_KEYS and TrainConfig().collective_timeout == 600
    with pytest.raises(ConfigError, match="collective_timeout must be > 0 seconds"):
        apply_overrides(TrainConfig(), {"collective_timeout": 0})


def _fp16_overflow_worker(me, world, sharded):
    from marginkit.train.trainer import mixed_precision

    _, scaler = mixed_precision("fp16", torch.device("cpu"), sharded=sharded)
    shared, shard = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([shared, shard], lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        scaler.scale(shared.sum() + shard.sum()).backward()
        if step == 0 and me == 0:
            shard.grad[0] = float("inf")  # only rank 0's head shard overflows
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        stepped = not torch.equal(shared.detach(), torch.full((3,), 1.0 - 0.1 * step))
        if step == 0:
            if sharded:  # the overflow skips the step on every rank, and every scale is halved
                assert not stepped and scaler.get_scale() == 2.0**15, (me, stepped, scaler.get_scale())
            else:  # one scaler per rank: rank 1 steps, rank 0 skips, the backbones drift apart
                assert stepped == (me == 1), (me, stepped)
        else:  # a clean step everywhere
            expected = 0.9 if sharded or me == 0 else 0.8
            assert torch.allclose(shared.detach(), torch.full((3,), expected)), (me, shared)


@pytest.mark.distributed
@pytest.mark.parametrize("sharded", [True, False])
def test_fp16_overflow_on_one_head_shard_skips_the_step_on_every_rank(sharded):
    run_distributed(_fp16_overflow_worker, 2, sharded, timeout_s=120.0)


def _fp16_sharded_worker(me, world, data, root):
    from marginkit.train.checkpoint import load_checkpoint

    done = train(config(data, "cosface", amp="fp16"), Path(root) / "fp16-2", quiet=True, report=False)
    assert done.finished and math.isfinite(done.metrics["knn_accuracy"])
    if me == 0:
        assert load_checkpoint(Path(root) / "fp16-2" / "last.pt")["scaler"]["scale"] > 0


@pytest.mark.distributed
def test_fp16_training_with_a_sharded_head_runs_on_two_ranks(tmp_path):
    data = "features:" + str(blobs(tmp_path / "blobs.npz"))
    run_distributed(_fp16_sharded_worker, 2, data, str(tmp_path), timeout_s=300.0)


def _shard_worker(me, world, data, root):
    from marginkit.data import load_dataset
    from marginkit.data.loading import Loader, ShuffledBatches
    from marginkit.distributed import balanced_slices

    def share(n):
        start, size = balanced_slices(n, world)[me]
        return slice(start, start + size)

    train_split = load_dataset(data, val_fraction=0.0).train
    loader = Loader(
        train_split.data, train_split.y, ShuffledBatches(len(train_split), 36, 4), share=share, workers=1
    )
    batches = {epoch: [b.y.tolist() for b in loader.epoch(epoch)] for epoch in (0, 1)}
    loader.close()
    result = train(
        config(data, "cosface", epochs=2, workers=1), Path(root) / "wds-2", quiet=True, report=False
    )
    assert result.finished and len(result.history) == 2
    Path(root, f"wds-rank{me}.json").write_text(
        json.dumps({"batches": batches, "len": len(loader), "rows": len(train_split)})
    )


@pytest.mark.distributed
def test_two_ranks_train_from_shards_with_equal_steps(tmp_path):
    """``wds:`` under data parallelism: each rank reads its deal of the shards (its share of each
    global batch), and every rank takes the same number of steps (else the run would hang at a
    collective); the run ends on both ranks."""
    from marginkit.data.datasets import read_source
    from marginkit.data.shards import write_shards

    write_shards(read_source("features:" + str(blobs(tmp_path / "blobs.npz"))), tmp_path / "shards",
                 samples_per_shard=11, progress=False)  # fmt: skip
    run_distributed(_shard_worker, 2, f"wds:{tmp_path / 'shards'}", str(tmp_path), timeout_s=300.0)
    r0, r1 = (json.loads((tmp_path / f"wds-rank{r}.json").read_text()) for r in (0, 1))
    for epoch in ("0", "1"):
        a, b = r0["batches"][epoch], r1["batches"][epoch]
        assert len(a) == len(b) == r0["len"] == r1["len"] == r0["rows"] // 36  # equal steps on every rank
        assert all(len(x) == len(y) == 18 for x, y in zip(a, b, strict=True))  # each its half of 36
    assert (tmp_path / "wds-2" / "metrics.json").is_file()
