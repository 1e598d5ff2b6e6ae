"""Helpers for tests that signal real processes: /proc lookups and fault-injection hooks.

Faults are injected, not timed: :func:`hook_env` puts a ``sitecustomize`` on the children's
``PYTHONPATH`` that makes a run hang right after committing an epoch, or a data-parallel rank
stop itself (SIGSTOP) before an epoch, each dropping a marker file named by its pid, so a test
acts on a process in a known state.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

HOOKS = """
import os
import signal
import time

_marks = os.environ.get("MARGINKIT_TEST_MARKS", "")


def _mark():
    open(os.path.join(_marks, str(os.getpid())), "w").close()


if os.environ.get("MARGINKIT_TEST_HANG_AFTER_EPOCH"):
    import marginkit.train.rundir as _rundir

    _after = int(os.environ["MARGINKIT_TEST_HANG_AFTER_EPOCH"])
    _commit = _rundir.RunDir.commit_epoch

    def _commit_then_hang(self, payload, *, improved):
        _commit(self, payload, improved=improved)
        if payload["epoch"] >= _after:
            _mark()
            while True:
                time.sleep(3600)

    _rundir.RunDir.commit_epoch = _commit_then_hang

if os.environ.get("MARGINKIT_TEST_STOP_RANK_AT_EPOCH") and os.environ.get("RANK") == "1":
    import marginkit.train.trainer as _trainer

    _at = int(os.environ["MARGINKIT_TEST_STOP_RANK_AT_EPOCH"])
    _one_epoch = _trainer._one_epoch

    def _stop_then_train(run, bar):
        if run.epoch + 1 == _at:
            _mark()
            os.kill(os.getpid(), signal.SIGSTOP)
        return _one_epoch(run, bar)

    _trainer._one_epoch = _stop_then_train
"""

#: The CLI with Python's own Ctrl-C handling even when started with SIGINT ignored (as a
#: background job of a non-interactive shell is).
CLI = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from marginkit.cli import main; sys.exit(main(sys.argv[1:]))"
)


def hook_env(tmp_path: Path, **faults: Any) -> tuple[dict[str, str], Path]:
    """The environment for a child with the hooks on (``hang_after_epoch=N``, ``stop_rank_at_epoch=N``)
    and the folder its markers go to."""
    hooks, marks = tmp_path / "hooks", tmp_path / "marks"
    hooks.mkdir()
    marks.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOKS)
    path = os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "MARGINKIT_TEST_MARKS": str(marks), "PYTHONWARNINGS": "ignore"}
    env.update({f"MARGINKIT_TEST_{k.upper()}": str(v) for k, v in faults.items()})
    return env, marks


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def parent_of(pid: int) -> int:
    return int(_stat(pid)[1])


def descendants(pid: int) -> list[int]:
    """The running processes below ``pid`` (children, grandchildren, ...)."""
    parents: dict[int, int] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if alive(int(proc.name)):
                parents[int(proc.name)] = parent_of(int(proc.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    found, frontier = [], [pid]
    while frontier:
        below = [p for p, parent in parents.items() if parent in frontier]
        found.extend(below)
        frontier = below
    return found


def live_children() -> list[str]:
    """Command lines of this process's running children (multiprocessing's resource tracker aside)."""
    found = []
    for child in descendants(os.getpid()):
        try:
            if parent_of(child) == os.getpid():
                cmdline = Path(f"/proc/{child}/cmdline").read_text().replace("\0", " ")
                if "resource_tracker" not in cmdline:
                    found.append(cmdline)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def wait_until(condition: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.1)


def acks_then_kill(child: Any, count: int, seconds: float = 300) -> list[str]:
    """The first ``count`` lines ``child`` prints (its acknowledgements), then SIGKILL: a crash
    injected at a known point of its work, not after a delay."""
    import signal

    acknowledged: list[str] = []
    try:
        deadline = time.monotonic() + seconds
        while len(acknowledged) < count and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            acknowledged.append(line.strip())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    return acknowledged
