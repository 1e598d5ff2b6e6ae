"""Progress output: a tqdm bar on a terminal, plain lines elsewhere (train/progress.py)."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time

import pytest

from marginkit.train.progress import RunsProgress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def log_epoch(path, n: int = 1) -> None:
    with path.open("a") as fh:
        for _ in range(n):
            fh.write(json.dumps({"epoch": 1}) + "\n")


def wait_for(stream: io.StringIO, text: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while text not in stream.getvalue():
        assert time.monotonic() < end, f"{text!r} never drawn; got {stream.getvalue()[-300:]!r}"
        time.sleep(0.02)


def test_terminal_bar_moves_with_epochs_between_finished_runs(tmp_path):
    logs = {k: tmp_path / k / "metrics.jsonl" for k in "abc"}
    for p in logs.values():
        p.parent.mkdir()
    stale = logs["c"]
    log_epoch(stale, 3)  # an earlier run in the same directory: not this run's progress
    old = time.time() - 60
    os.utime(stale, (old, old))
    tty = Tty()
    progress = RunsProgress({k: (4, logs[k]) for k in "abc"}, desc="3 runs", stream=tty, poll_interval=0.01)
    seen = []
    for key in progress.wrap("abc"):
        if key == "a":
            log_epoch(logs["a"], 2)
            wait_for(tty, "2/12 epochs")  # drawn while no run has finished yet
            assert "[1/3]" not in tty.getvalue() and "0/3 runs done" in tty.getvalue()
            assert progress.units_done() == 2  # the stale lines of c are not counted
            log_epoch(logs["a"], 2)
            assert progress.units_done() == 3  # a's last unit is its evaluation, counted at finish
        seen.append(key)
        progress.finish(key, f"{key} finished", reused=key == "b")
    text = tty.getvalue()
    assert seen == ["a", "b", "c"]
    # the reused run b did no work: it leaves the bar's total and the ETA
    assert "8/8 epochs, 3/3 runs done" in text
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d\]", text)  # elapsed < remaining
    for i, k in enumerate("abc", 1):
        assert f"[{i}/3] {k} finished\n" in text
    assert text.endswith("\n") and "\r" in text
    assert progress._thread is not None and not progress._thread.is_alive()


def test_plain_lines_off_a_terminal(tmp_path):
    logs = {k: tmp_path / f"{k}.jsonl" for k in "ab"}
    out = io.StringIO()
    progress = RunsProgress({k: (2, logs[k]) for k in "ab"}, desc="2 runs", stream=out)
    for key in progress.wrap("ab"):
        log_epoch(logs[key], 2)
        progress.finish(key, f"{key} done")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert re.fullmatch(r"\[1/2\] a done · \d+:\d\d elapsed, ETA \d+:\d\d", lines[0])
    assert re.fullmatch(r"\[2/2\] b done · \d+:\d\d elapsed, ETA 0:00", lines[1])
    assert progress._thread is None  # nothing to draw, nothing to watch


def test_quiet_writes_nothing_and_write_callback(tmp_path):
    tty = Tty()
    progress = RunsProgress({"a": (1, None)}, desc="x", stream=tty, enabled=False)
    for key in progress.wrap(["a"]):
        progress.finish(key, "a done")
    assert tty.getvalue() == ""
    got: list[str] = []
    progress = RunsProgress({"a": (1, None)}, desc="x", stream=io.StringIO(), write=got.append)
    for key in progress.wrap(["a"]):
        progress.finish(key, "a done")
    assert len(got) == 1 and got[0].startswith("[1/1] a done · ")


def test_the_bar_closes_when_the_loop_fails(tmp_path):
    tty = Tty()
    progress = RunsProgress({"a": (1, None), "b": (1, None)}, desc="x", stream=tty, poll_interval=0.01)
    with pytest.raises(RuntimeError):
        for _key in progress.wrap("ab"):
            raise RuntimeError("a run failed")
    assert progress._stop.is_set() and not progress._thread.is_alive()


@pytest.mark.parametrize("terminal", [True, False])
def test_compare_shows_progress(tmp_path, monkeypatch, capsys, terminal):
    """`marginkit compare` end to end: the bar on a terminal, plain lines in a log."""
    from marginkit.cli import main

    tty = Tty()
    if terminal:
        monkeypatch.setattr(sys, "stderr", tty)
    args = ["compare", "--data", "digits", "--losses", "softmax,triplet", "--epochs", "2", "--model", "mlp",
            "--train-per-class", "5", "--num-threads", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    err = tty.getvalue() if terminal else capsys.readouterr().err
    if terminal:
        assert "2 runs:" in err and "4/4 epochs, 2/2 runs done" in err and "\r" in err
        line = r"\[1/2\] softmax +seed 0: knn_accuracy \d\.\d{4}  map_at_r \d\.\d{4} \(\d+\.\d s\)\n"
        assert re.search(line, err)
    else:
        assert "\r" not in err
        assert re.search(r"\[2/2\] triplet +seed 0: .* · \d+:\d\d elapsed, ETA 0:00\n", err)


def test_one_unit_per_run_counts_runs_once():
    """The study's jobs: the bar counts jobs, without a second "runs done" count."""
    tty = Tty()
    progress = RunsProgress(dict.fromkeys("abc", (1, None)), desc="study", unit="jobs", stream=tty)
    for key in progress.wrap("abc"):
        progress.finish(key, f"{key} 1.0s")
    text = tty.getvalue()
    assert "study: 100%" in text and "3/3 jobs [" in text and "runs done" not in text
    assert "[3/3] c 1.0s\n" in text


def test_grouped_eta_sums_each_runs_group_mean_and_names_the_untimed():
    """The study's jobs cost orders of magnitude apart: each unfinished job counts the mean of
    the finished jobs of its group (or of the longest prefix timed), divided by the workers."""
    groups = {
        "t1": ("tune", "x"), "t2": ("tune", "x"),
        "k1": ("knn", "d", "l1"), "k2": ("knn", "d", "l1"), "k3": ("knn", "d", "l2"),
        "e": ("e2e",),
    }  # fmt: skip
    lines: list[str] = []
    progress = RunsProgress(
        dict.fromkeys(groups, (1, None)), desc="study", unit="jobs", stream=io.StringIO(),
        write=lines.append, groups=groups, workers=2,
    )  # fmt: skip
    assert progress.grouped_eta() == (None, 6)
    progress.finish("t1", "t1", seconds=100.0)
    # t2: 100 s; the knn jobs and e2e have no timed prefix: not guessed
    assert progress.grouped_eta() == (50.0, 4)
    assert lines[-1].endswith("ETA 0:50 + 4 jobs not timed yet")
    progress.finish("k1", "k1", seconds=10.0)
    # t2 100, k2 10, k3 falls back to ("knn", "d"): 10; e2e still untimed
    assert progress.grouped_eta() == (60.0, 1)
    assert lines[-1].endswith("ETA 1:00 + 1 job not timed yet")
    progress.finish("k2", "k2", reused=True, seconds=30.0)  # timed when it was computed
    assert progress.grouped_eta() == ((100.0 + 20.0) / 2, 1)
    for key in ("t2", "k3", "e"):
        progress.finish(key, key, seconds=1.0)
    assert lines[-1].endswith("ETA 0:00") and progress.grouped_eta() == (0.0, 0)


def test_grouped_eta_on_a_terminal_replaces_the_per_unit_guess():
    tty = Tty()
    groups = {"a": ("tune",), "b": ("knn",)}
    tasks = dict.fromkeys("ab", (1, None))
    progress = RunsProgress(tasks, desc="study", unit="jobs", stream=tty, groups=groups)
    for key in progress.wrap("ab"):
        if key == "a":
            assert "ETA after the first run" in tty.getvalue()
        progress.finish(key, f"{key} done", seconds=5.0)
        if key == "a":
            assert "ETA 0:00 + 1 job not timed yet" in tty.getvalue()
    text = tty.getvalue()
    assert "2/2 jobs" in text and not re.search(r"<\d\d:\d\d\]", text)  # no per-job-average ETA


def test_grouped_eta_needs_groups():
    with pytest.raises(ValueError, match="groups"):
        RunsProgress({"a": (1, None)}, desc="x", stream=io.StringIO()).grouped_eta()
    with pytest.raises(ValueError, match="groups must name a cost group for every task; missing \\['b'\\]"):
        RunsProgress(dict.fromkeys("ab", (1, None)), desc="x", stream=io.StringIO(), groups={"a": ("k",)})


def test_run_bar_draws_nothing_until_it_advances():
    """The trainer makes a new bar after each epoch's log line: creating it must not draw a
    half line that the next log line would be appended to."""
    from marginkit.train.progress import ProgressBar

    tty = Tty()
    bar = ProgressBar(10, stream=tty, initial=5)
    assert bar.active and tty.getvalue() == ""
    bar.close(clear=True)
    assert tty.getvalue() == ""
    bar = ProgressBar(10, stream=tty, min_interval=0.0)
    bar.update(samples=4, loss=1.5, prefix="epoch 1/2")
    assert "epoch 1/2 |" in tty.getvalue() and "loss 1.5000 " in tty.getvalue()
