"""Crash-consistent run directories, by fault injection at every write step.

A run's files are written in steps (:mod:`marginkit.train.rundir`): each file is synced to a
temporary file (``_sync``) and renamed into place (``_rename``). The tests stop a run before
step ``i`` — a kill (``os._exit`` in a subprocess: nothing is cleaned up) or a write error
(``ENOSPC`` raised in-process) — resume it, and require the resumed run to end bit-identical to
the uninterrupted one: the same model, head and optimiser state in ``last.pt`` and ``best.pt``,
the same history rows and test metrics (timings aside), no temporary file left behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import faults
from marginkit.train import rundir
from marginkit.train.errors import RunDirError
from marginkit.train.rundir import RunDir, load_checkpoint, load_run
from marginkit.train.trainer import train
from test_trainer import blobs, small_config

TIMINGS = {"epoch_seconds", "samples_per_second", "train_seconds"}


@pytest.fixture(scope="module")
def data_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Overlapping blobs: validation accuracy improves at epochs 1 and 2, not at 3 (with
    ``val_fraction=0.3``: a validation split of >= 10 per class, so the trainer selects on it)."""
    path = tmp_path_factory.mktemp("data") / "blobs.npz"
    return "features:" + str(blobs(path, classes=6, per_class=60, dim=3))


def _without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _checkpoint_state(path: Path) -> dict[str, Any]:
    ckpt = load_checkpoint(path)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        else:
            flat[prefix] = value

    for key in ("model", "head", "optimizer", "scheduler", "rng", "epoch", "global_step", "best_epoch",
                "best_metric", "fingerprint", "config", "scaler"):  # fmt: skip
        walk(key, ckpt[key])
    flat["history"] = _without_timings(json.loads(ckpt["history"]))
    return flat


def assert_same_run(got: Path, want: Path) -> None:
    """Bit-identical state dicts, history and test metrics; no temporary file left."""
    assert not sorted(p.name for p in got.glob(".*.tmp"))
    for name in ("last.pt", "best.pt"):
        a, b = _checkpoint_state(got / name), _checkpoint_state(want / name)
        assert a.keys() == b.keys(), name
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), f"{name}: {key}"
            else:
                assert a[key] == b[key], f"{name}: {key}"
    rows = [[_without_timings(json.loads(x)) for x in (d / "metrics.jsonl").read_text().splitlines()]
            for d in (got, want)]  # fmt: skip
    assert rows[0] == rows[1]
    metrics = [_without_timings(json.loads((d / "metrics.json").read_text())) for d in (got, want)]
    assert metrics[0] == metrics[1]
    for name in ("eval.npz", "knn_index.npz"):
        with np.load(got / name) as a, np.load(want / name) as b:
            assert a.files == b.files
            for key in a.files:
                assert np.array_equal(a[key], b[key]), f"{name}: {key}"
    assert (got / "config.yaml").read_text() == (want / "config.yaml").read_text()


def _write_steps(cfg: Any, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Train ``cfg`` into ``run_dir`` and list its write steps (``sync NAME`` / ``rename NAME``)."""
    steps: list[str] = []
    sync, rename = rundir._sync, rundir._rename

    def logged_sync(fh: Any, target: Path) -> None:
        steps.append(f"sync {target.name}")
        sync(fh, target)

    def logged_rename(src: str, dst: Path) -> None:
        steps.append(f"rename {dst.name}")
        rename(src, dst)

    monkeypatch.setattr(rundir, "_sync", logged_sync)
    monkeypatch.setattr(rundir, "_rename", logged_rename)
    train(cfg, run_dir, quiet=True, report=False)
    monkeypatch.undo()
    return steps


def _finish(cfg: Any, run_dir: Path) -> None:
    """What a user does after the fault: ``--resume`` (or, if nothing was committed, start again)."""
    if (run_dir / "last.pt").is_file():
        train(None, run_dir, resume=True, quiet=True, report=False)
    else:
        with pytest.raises(RunDirError, match="holds no last.pt checkpoint.*without --resume"):
            train(None, run_dir, resume=True, quiet=True, report=False)
        train(cfg, run_dir, quiet=True, report=False)


@pytest.fixture(scope="module")
def reference(data_spec: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, list[str]]:
    """An uninterrupted 3-epoch run whose second epoch improves, and its write steps."""
    cfg = small_config(data_spec, epochs=3, val_fraction=0.3)
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    with pytest.MonkeyPatch.context() as mp:
        steps = _write_steps(cfg, run_dir, mp)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["best"] for r in rows] == [True, True, False]  # the bug's case: an improving epoch 2
    return cfg, run_dir, steps


def test_write_steps_of_a_run(reference):
    _, _, steps = reference
    epoch = ["sync last.pt", "rename last.pt", "sync best.pt", "rename best.pt", "sync metrics.jsonl",
             "rename metrics.jsonl"]  # fmt: skip
    start = ["sync last.pt", "rename last.pt", "sync metrics.jsonl", "rename metrics.jsonl",
             "sync config.yaml", "rename config.yaml"]  # fmt: skip
    end = ["sync eval.npz", "rename eval.npz", "sync knn_index.npz", "rename knn_index.npz",
           "sync metrics.json", "rename metrics.json"]  # fmt: skip
    plain = [s for s in epoch if "best" not in s]  # epoch 3 does not improve: no best.pt
    assert steps == start + epoch * 2 + plain + end


def test_disk_full_at_any_write_step_keeps_the_last_checkpoint_and_resumes_identically(
    reference, tmp_path, monkeypatch
):
    cfg, want, steps = reference
    files = [step.split()[1] for step in steps if step.startswith("sync")]
    sync = rundir._sync
    for k, name in enumerate(files):  # the disk fills up while the k-th file is written
        run_dir = tmp_path / f"full-{k}"

        def full(fh, target, k=k, calls=[0]):  # noqa: B006 - one counter per file k
            calls[0] += 1
            if calls[0] == k + 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            sync(fh, target)

        monkeypatch.setattr(rundir, "_sync", full)
        message = rf"^cannot write '.*/{name}': no space left on the device \(.* free"
        with pytest.raises(RunDirError, match=message):
            train(cfg, run_dir, quiet=True, report=False)
        monkeypatch.undo()
        assert not list(run_dir.glob(".*.tmp")), name  # cleaned up at once
        if (run_dir / "last.pt").is_file():
            load_checkpoint(run_dir / "last.pt")  # the last good checkpoint is intact
        _finish(cfg, run_dir)
        assert_same_run(run_dir, want)


@pytest.fixture(scope="module")
def killer() -> Iterator[Any]:
    """Start a killed run in a child forked from a server that has torch and marginkit loaded."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["faults"])
    # Python 3.11's forkserver ignores the sys.path it is handed: without tests/ on PYTHONPATH its
    # preload of `faults` fails silently and every child imports torch and marginkit again.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "PYTHONPATH",
            os.pathsep.join(filter(None, [str(Path(faults.__file__).parent), os.environ.get("PYTHONPATH")])),
        )
        multiprocessing.forkserver.ensure_running()

    def kill_at(step: int, cfg: Any, run_dir: Path) -> None:
        proc = ctx.Process(target=faults.kill_at, args=(step, cfg.to_json(), str(run_dir)))
        proc.start()
        proc.join(timeout=300)
        assert proc.exitcode == faults.KILLED, (step, proc.exitcode)

    yield kill_at
    # The server outlives the fixture otherwise, and later tests count live child processes.
    multiprocessing.forkserver._forkserver._stop()


def _kill_loop(reference: tuple[Any, Path, list[str]], killer: Any, tmp_path: Path, steps: range) -> None:
    cfg, want, _ = reference
    for i in steps:
        run_dir = tmp_path / f"kill-{i}"
        killer(i, cfg, run_dir)
        _finish(cfg, run_dir)
        assert_same_run(run_dir, want)


def test_killed_at_every_write_step_of_an_improving_epoch_resumes_identically(reference, killer, tmp_path):
    # epoch 2: last.pt, best.pt, metrics.jsonl (steps 12-17), and the step after it
    _kill_loop(reference, killer, tmp_path, range(12, 19))


@pytest.mark.slow
def test_killed_at_every_other_write_step_of_a_run_resumes_identically(reference, killer, tmp_path):
    # the start (epoch-0 commit, config), epoch 1, the non-improving epoch 3, the final evaluation
    _kill_loop(reference, killer, tmp_path, [i for i in range(len(reference[2])) if not 12 <= i < 19])


@pytest.fixture(scope="module")
def fp16_reference(data_spec: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, list[str]]:
    """An uninterrupted 3-epoch ``amp: fp16`` run whose gradient scaler backs off in epoch 1."""
    cfg = small_config(data_spec, epochs=3, val_fraction=0.3, amp="fp16", loss="arcface")
    run_dir = tmp_path_factory.mktemp("fp16") / "run"
    with pytest.MonkeyPatch.context() as mp:
        steps = _write_steps(cfg, run_dir, mp)
    return cfg, run_dir, steps


def test_fp16_killed_at_an_epoch_boundary_resumes_with_the_same_scaler(fp16_reference, killer, tmp_path):
    cfg, want, steps = fp16_reference
    first = load_checkpoint(want / "best.pt")["scaler"]
    # the scale fell below torch's initial 2**16 in the first epoch: a fresh scaler would skip
    # other steps after resuming, and the weights would differ
    assert 0 < load_checkpoint(want / "last.pt")["scaler"]["scale"] < 2.0**16 and first
    commits = [i for i, step in enumerate(steps) if step == "sync last.pt"]  # epochs 0, 1, 2, 3
    assert len(commits) == 4
    for i in commits[2:]:  # killed as epoch 2 (3) is being written: resumed after epoch 1 (2)
        run_dir = tmp_path / f"kill-{i}"
        killer(i, cfg, run_dir)
        resumed_from = load_checkpoint(run_dir / "last.pt")
        assert resumed_from["epoch"] == commits.index(i) - 1 and resumed_from["scaler"]["_growth_tracker"] > 0
        _finish(cfg, run_dir)
        assert_same_run(run_dir, want)


def test_fp16_resume_from_a_checkpoint_without_scaler_state_starts_a_fresh_scaler(fp16_reference, tmp_path):
    cfg, want, _ = fp16_reference
    run_dir = tmp_path / "old"
    train(cfg, run_dir, quiet=True, stop_after=1, report=False)
    ckpt = load_checkpoint(run_dir / "last.pt")
    steps_per_epoch = ckpt["global_step"]
    for state, match in (
        ({"scale": "big"}, "invalid gradient-scaler state"),
        ({**ckpt["scaler"], "scale": -1.0}, "invalid gradient-scaler state"),
    ):
        torch.save({**ckpt, "scaler": state}, run_dir / "last.pt")
        with pytest.raises(rundir.CheckpointError, match=match):
            train(None, run_dir, resume=True, quiet=True, report=False)
    del ckpt["scaler"]  # as written before the scaler was checkpointed
    torch.save(ckpt, run_dir / "last.pt")
    train(None, run_dir, resume=True, quiet=True, report=False)
    end = load_checkpoint(run_dir / "last.pt")
    assert end["epoch"] == 3
    # fresh: torch's initial scale, backed off again, and counting only the two resumed epochs
    assert end["scaler"]["_growth_tracker"] <= 2 * steps_per_epoch
    assert end["scaler"] != load_checkpoint(want / "last.pt")["scaler"]


def test_temporary_files_of_dead_writers_are_removed_on_the_next_start(data_spec, tmp_path):
    run_dir = tmp_path / "run"
    train(small_config(data_spec, epochs=1), run_dir, quiet=True, stop_after=0, report=False)
    stale = [run_dir / ".last.pt.k3j2.tmp", run_dir / ".best.pt.tmp", run_dir / ".report.html.tmp"]
    for path in stale:
        path.write_bytes(b"x" * 1000)
    keep = run_dir / "notes.tmp"  # not a marginkit temporary file
    keep.write_text("mine")
    train(None, run_dir, resume=True, quiet=True, report=False)
    assert not any(p.exists() for p in stale) and keep.read_text() == "mine"


def test_a_second_process_on_the_same_run_directory_fails_at_once(data_spec, tmp_path):
    run_dir = tmp_path / "run"
    cfg = small_config(data_spec, epochs=2)
    train(cfg, run_dir, quiet=True, stop_after=1, report=False)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    with RunDir(run_dir):  # another writer holds the directory
        busy = rf"is in use by another marginkit process \(pid {os.getpid()}\)"
        for kwargs in ({"resume": True}, {"overwrite": True}, {}):
            with pytest.raises(RunDirError, match=busy):
                train(cfg, run_dir, quiet=True, report=False, **kwargs)
        with pytest.raises(RunDirError, match="in use by another marginkit process"):
            from marginkit.train.evaluate import evaluate_run

            evaluate_run(run_dir)
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    train(None, run_dir, resume=True, quiet=True, report=False)  # released: usable again


def test_two_cli_processes_on_one_out_the_second_fails_with_a_clear_message(data_spec, tmp_path):
    run_dir = tmp_path / "run"
    cfg = small_config(data_spec, epochs=2, val_fraction=0.3)
    train(cfg, run_dir, quiet=True, stop_after=1, report=False)
    fd = os.open(run_dir / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `marginkit train` holds it
    os.pwrite(fd, b"4242\n", 0)
    try:
        for extra in (["--resume"], ["--data", data_spec, "--loss", "softmax", "--set", "val_fraction=0.3"]):
            proc = subprocess.run(
                [sys.executable, "-m", "marginkit.cli", "train", "--out", str(run_dir), "-q", *extra],
                capture_output=True, text=True, timeout=300, check=False,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )  # fmt: skip
            assert proc.returncode == 2, proc.stderr
            assert proc.stderr.strip() == (
                f"marginkit: error: {str(run_dir)!r} is in use by another marginkit process (pid 4242); "
                "wait for it to finish, or use another --out"
            )
    finally:
        os.close(fd)
    assert load_checkpoint(run_dir / "last.pt")["epoch"] == 1


def test_stored_config_does_not_choose_where_evaluation_writes(data_spec, tmp_path, monkeypatch, capsys):
    import marginkit.data
    from marginkit.cli import main

    run_dir = tmp_path / "run"
    cfg = small_config(data_spec, epochs=1)
    train(cfg, run_dir, quiet=True, report=False)
    evil = tmp_path / "elsewhere"
    for name in ("best.pt", "last.pt"):  # a run directory whose checkpoints name a cache directory
        ckpt = torch.load(run_dir / name, weights_only=True)
        stored = json.loads(ckpt["config"])
        stored["data_options"] = {"cache_dir": str(evil)}
        ckpt["config"] = json.dumps(stored)
        torch.save(ckpt, run_dir / name)
    assert "cache_dir" not in load_run(run_dir)["config"].data_options
    seen: list[dict[str, Any]] = []
    real = marginkit.data.load_dataset

    def spy(spec, **options):
        seen.append(options)
        return real(spec, **options)

    monkeypatch.setattr(marginkit.data, "load_dataset", spy)
    assert main(["eval", str(run_dir)]) == 0
    train(cfg, run_dir, resume=True, quiet=True, report=False)  # resuming, the given config decides
    train(None, run_dir, resume=True, quiet=True, report=False)
    assert seen and all("cache_dir" not in options for options in seen)
    assert not evil.exists()
    capsys.readouterr()


def test_a_full_disk_is_a_one_line_cli_error_that_keeps_the_last_checkpoint(
    data_spec, tmp_path, monkeypatch, capsys
):
    from marginkit.cli import main

    sync = rundir._sync

    def full_at_best(fh, target):
        if target.name == "best.pt" and load_checkpoint(target.parent / "last.pt")["epoch"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        sync(fh, target)

    monkeypatch.setattr(rundir, "_sync", full_at_best)
    out = tmp_path / "run"
    argv = ["train", "--data", data_spec, "--loss", "softmax", "--model", "mlp", "--epochs", "3",
            "--k", "3", "--embedding-dim", "8", "--batch-size", "32", "--num-threads", "1", "-q",
            "--no-report", "--set", "val_fraction=0.3"]  # fmt: skip
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    best = str(out / "best.pt")
    assert err.startswith(f"marginkit: error: cannot write {best!r}: no space left on the device (")
    assert err.endswith("; epoch 2 is saved in last.pt and --resume completes the rest")
    assert "internal error" not in err and len(err.splitlines()) == 1
    assert not list(out.glob(".*.tmp")) and load_checkpoint(out / "best.pt")["epoch"] == 1
    monkeypatch.undo()
    assert main(["train", "--resume", "--out", str(out), "-q", "--no-report"]) == 0
    assert load_checkpoint(out / "best.pt")["epoch"] == 2  # repaired, then kept by epoch 3 (no gain)
