"""Child processes that end with their parent: worker pools (``compare --jobs``) and ranks.

A child calls :func:`die_with_parent` first thing: on Linux the kernel then sends it SIGKILL
when its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere a watchdog thread polls the
parent's pid. Either way a killed parent (SIGKILL included, which no handler sees) leaves no
child running. :func:`run_in_workers` runs tasks on such children: they ignore SIGINT (the
parent alone decides), and when the parent stops for any reason (an error, Ctrl-C, SIGTERM)
it kills them before it returns. Work they leave half done is resumed by running again
(runs resume from their last checkpoint).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["WorkerDied", "die_with_parent", "parent_death_signal", "run_in_workers", "sigterm_as_interrupt"]

_PR_SET_PDEATHSIG = 1


class WorkerDied(RuntimeError):
    """A worker process ended without reporting its task's result."""


def parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False if unsupported.

    Also usable as ``subprocess.Popen(preexec_fn=...)`` (the setting survives ``exec``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, interval: float) -> None:
    while True:
        time.sleep(interval)
        if os.getppid() != parent:  # re-parented: the parent is gone
            os._exit(1)


def die_with_parent(parent: int | None = None, *, interval: float = 1.0) -> None:
    """End this process (SIGKILL) when its parent ``parent`` (default: the current parent) dies.

    Linux: ``PR_SET_PDEATHSIG``; elsewhere a daemon thread checks the parent every ``interval``
    seconds. A parent that died before the call is noticed at once.
    """
    parent = os.getppid() if parent is None else int(parent)
    if not parent_death_signal(getattr(signal, "SIGKILL", 9)):
        threading.Thread(target=_watch_parent, args=(parent, interval), daemon=True).start()
    if os.getppid() != parent:
        os._exit(1)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt`` (so cleanup runs as for Ctrl-C)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(conn: Connection, parent: int, fn: Callable[..., Any]) -> None:
    """A worker: run ``fn(*args)`` for each ``(index, args)`` received until ``None`` or EOF."""
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent closed its end
            return
        if task is None:
            return
        index, args = task
        try:
            reply = (index, True, fn(*args))
        except Exception as exc:  # sent back and re-raised in the parent
            reply = (index, False, exc)
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result or error
            conn.send((index, False, RuntimeError(f"{type(exc).__name__}: {exc}")))


def run_in_workers(
    fn: Callable[..., Any], tasks: Sequence[tuple[Any, ...]], jobs: int
) -> Iterator[tuple[int, Any]]:
    """Run ``fn(*task)`` for every task on ``jobs`` spawned processes; yield ``(index, result)``
    in the order they finish. A task's exception is re-raised here.

    ``fn`` must be importable by name (module level). The workers die with this process; if
    the caller stops iterating early or anything raises here (``KeyboardInterrupt`` too), they
    are killed before the exception propagates.
    """
    ctx = multiprocessing.get_context("spawn")
    workers: dict[Connection, Any] = {}
    todo = list(enumerate(tasks))[::-1]
    busy: dict[Connection, int] = {}
    try:
        for _ in range(min(max(1, jobs), len(todo))):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, os.getpid(), fn), daemon=True)
            proc.start()
            theirs.close()
            workers[mine] = proc
        idle = list(workers)
        while todo or busy:
            while todo and idle:
                conn = idle.pop()
                index, args = todo.pop()
                conn.send((index, args))
                busy[conn] = index
            ready = wait([*busy, *(workers[c].sentinel for c in busy)])
            for conn in list(busy):
                if conn not in ready and workers[conn].sentinel not in ready:
                    continue
                try:
                    index, ok, value = conn.recv()
                except (EOFError, OSError):  # the worker's end closed: it died
                    proc = workers[conn]
                    proc.join()
                    raise WorkerDied(
                        f"a worker process died (exit code {proc.exitcode}) while running task "
                        f"{busy[conn] + 1} of {len(tasks)}"
                    ) from None
                del busy[conn]
                idle.append(conn)
                if not ok:
                    raise value
                yield index, value
        for conn in workers:
            conn.send(None)
    finally:
        for conn, proc in workers.items():
            conn.close()
            if busy or todo:  # stopped early: the unfinished work is resumed by the next run
                proc.kill()
        for proc in workers.values():
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
