"""Child processes end with their parent: ``compare --jobs`` workers, and the worker pool itself.

Faults are injected, not timed (:mod:`proc_utils`): every run hangs right after committing
epoch 1, so the signal reaches the comparison while both workers are certainly mid-run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pool_tasks
from marginkit.cli import main
from marginkit.train.processes import WorkerDied, run_in_workers
from proc_utils import CLI, alive, hook_env, live_children, parent_of, wait_until
from test_trainer import blobs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


# ---------------------------------------------------------------------- the pool
def test_run_in_workers_returns_every_result_and_leaves_no_process():
    results = dict(run_in_workers(pool_tasks.square, [(i,) for i in range(5)], jobs=2))
    assert results == {i: i * i for i in range(5)}
    assert not live_children()


def test_a_failing_task_stops_the_pool_and_kills_the_busy_workers():
    start = time.monotonic()
    with pytest.raises(ValueError, match="task 2 failed"):
        list(run_in_workers(pool_tasks.fail_second, [(3,), (2,)], jobs=2))  # task 3 would run for 10 minutes
    assert time.monotonic() - start < 120
    assert not live_children()
    with pytest.raises(WorkerDied, match=r"a worker process died \(exit code 7\) while running task 1 of 1"):
        list(run_in_workers(pool_tasks.die, [(0,)], jobs=1))


# ---------------------------------------------------------------------- compare --jobs
@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> str:
    return "features:" + str(blobs(tmp_path_factory.mktemp("data") / "blobs.npz", classes=3, per_class=30))


def compare_argv(features: str, out: Path, jobs: int) -> list[str]:
    return ["compare", "--data", features, "--losses", "softmax,circle", "--epochs", "3", "--model", "mlp",
            "--set", "model_options.hidden=[16]", "--embedding-dim", "8", "--batch-size", "32", "--k", "3",
            "--num-threads", "1", "--jobs", str(jobs), "--quiet", "--out", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(features: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compare") / "reference"
    assert main(compare_argv(features, out, jobs=1)) == 0
    return out


def _without_seconds(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in ("seconds", "runs")} for row in summary]


def assert_same_comparison(got: Path, want: Path) -> None:
    assert _without_seconds(json.loads((got / "summary.json").read_text())) == _without_seconds(
        json.loads((want / "summary.json").read_text())
    )
    for run in ("softmax/seed0", "circle/seed0"):
        for name in ("last.pt", "best.pt"):
            a = torch.load(got / "runs" / run / name, weights_only=True)
            b = torch.load(want / "runs" / run / name, weights_only=True)
            assert a["epoch"] == b["epoch"] and (name == "best.pt" or a["epoch"] == 3)
            for part in ("model", "head"):
                assert a[part].keys() == b[part].keys()
                assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), (run, name, part)


@pytest.mark.parametrize(
    ("sig", "to_group"),
    [
        (signal.SIGKILL, False),
        (signal.SIGINT, True),  # Ctrl-C on a terminal: the whole process group
        pytest.param(signal.SIGTERM, False, marks=pytest.mark.slow),
    ],
)
def test_compare_workers_die_with_their_parent_and_the_comparison_resumes(
    sig, to_group, features, uninterrupted, tmp_path, capsys
):
    env, marks = hook_env(tmp_path, hang_after_epoch=1)
    out = tmp_path / "c"
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI, *compare_argv(features, out, jobs=2)], env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: len(list(marks.iterdir())) == 2 or proc.poll() is not None, 300, "both runs hang")
        workers = [int(p.name) for p in marks.iterdir()]
        assert len(workers) == 2 and all(parent_of(w) == proc.pid for w in workers)
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
        if sig == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
        else:
            assert proc.returncode == 130, err
            assert "interrupted; run the same command again to reuse finished runs" in err
        wait_until(lambda: not any(alive(w) for w in workers), 30, "the workers end with their parent")
    finally:  # whatever happened: nothing of the comparison outlives the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for run in ("softmax/seed0", "circle/seed0"):  # each stopped after its epoch 1
        assert torch.load(out / "runs" / run / "last.pt", weights_only=True)["epoch"] == 1
    assert main(compare_argv(features, out, jobs=1)) == 0  # run again: resumes both
    capsys.readouterr()
    assert_same_comparison(out, uninterrupted)


def test_compare_chooses_threads_so_that_jobs_times_threads_fit_the_cores(features, monkeypatch):
    from marginkit.cli.compare import base_config, run_configs
    from marginkit.train import runtime

    monkeypatch.setattr(runtime, "available_cores", lambda: 5)
    pairs = [("data", features), ("model", "mlp")]
    base = base_config(["softmax", "circle"], pairs)
    for jobs, threads in ((1, 5), (2, 2), (3, 1), (8, 1)):
        configs = run_configs(base, ["softmax", "circle"], seeds=2, pairs=pairs, per_loss=None, jobs=jobs)
        assert {c.num_threads for c in configs.values()} == {threads}, jobs
    given = run_configs(base, ["softmax"], seeds=1, pairs=[*pairs, ("num_threads", 3)], per_loss=None, jobs=2)
    assert given[("softmax", 0)].num_threads == 3  # overridable


def test_train_uses_the_available_cores_by_default_and_says_so(features, tmp_path, monkeypatch):
    from marginkit.train import runtime
    from marginkit.train.config import TrainConfig, apply_overrides
    from marginkit.train.trainer import train

    monkeypatch.setattr(runtime, "available_cores", lambda: 3)
    seen: list[int] = []
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    before = torch.get_num_threads()
    lines: list[str] = []
    cfg = apply_overrides(
        TrainConfig(),
        {"data": features, "model": "mlp", "model_options": {"hidden": [16]}, "embedding_dim": 8, "epochs": 1,
         "batch_size": 32, "loss": "softmax"},
    )  # fmt: skip
    assert cfg.num_threads is None
    result = train(cfg, tmp_path / "r", log=lines.append, report=False)
    assert set(seen) == {3} and torch.get_num_threads() == before
    assert result.config.num_threads == 3 and "num_threads: 3" in (tmp_path / "r" / "config.yaml").read_text()
    assert any("3 torch thread(s) per process (3 cores / 1 process(es))" in line for line in lines)
