"""Helpers for tests that start a real torch.distributed group (gloo, CPU, loopback only).

Usage, from any test module (the ``tests`` directory is on ``sys.path`` under pytest)::

    from dist_utils import run_distributed

    def _worker(rank, world, arg):          # module level: it is pickled by name
        ...                                 # the default group is initialised (gloo)

    @pytest.mark.distributed
    def test_something():
        run_distributed(_worker, 2, arg)    # raises the first failing rank's error

Each call starts ``world`` fresh processes (``torch.multiprocessing.spawn``), joins them, and
terminates the rest as soon as one fails (:class:`SpawnedRankError` names the rank that failed
first); ports are picked free and a stolen one is retried. ``benchmarks/bench_distributed.py``
uses it too.
Spawning costs seconds, so run several checks per spawn rather than one spawn per check.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from marginkit.distributed import _loopback_interface as loopback_interface
from marginkit.distributed import _prepare_process_group_init, find_free_port

__all__ = ["SpawnedRankError", "run_distributed"]


class SpawnedRankError(RuntimeError):
    """A process started by :func:`run_distributed` raised; ``rank`` is the one that failed first."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def _spawn_worker(
    local_rank: int,
    fn: Callable[..., None],
    world: int,
    port: int,
    timeout_s: float,
    error_dir: str,
    args: tuple[Any, ...],
) -> None:
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        torch.set_num_threads(1)
        _prepare_process_group_init()
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=local_rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        fn(local_rank, world, *args)
    except BaseException:
        # Record when and why, before this process exits and its peers see the lost connection:
        # the parent reports the earliest failure (the cause), not a peer's consequence.
        # Written aside and renamed: the parent terminates the peers of a failed rank, and a peer
        # killed between open and write must leave no empty report behind.
        final = os.path.join(error_dir, f"rank{local_rank}.txt")
        with open(final + ".part", "w") as file:
            file.write(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(final + ".part", final)
        raise
    # Only on success: after a failure the process exits with the group still open.
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


def run_distributed(
    fn: Callable[..., None], world: int, *args: Any, timeout_s: float = 60.0, attempts: int = 3
) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined by a gloo group.

    For tests and benchmarks on one machine: the group meets on a free loopback port; ``fn``
    must be importable (module level) and the arguments picklable. Returns when every process
    has finished. If one raises, the others are terminated and :class:`SpawnedRankError` is
    raised here with the traceback of the rank that failed *first* (peers that merely lost their
    connection to it are listed, not blamed). A collective that hangs fails after ``timeout_s``.
    A rendezvous port taken between choosing and binding it is retried with a new port.
    """
    from torch.multiprocessing.spawn import ProcessException, spawn

    for attempt in range(attempts):
        port = find_free_port()
        error_dir = tempfile.mkdtemp(prefix="marginkit-spawn-")
        try:
            try:
                spawn(
                    _spawn_worker,
                    args=(fn, world, port, timeout_s, error_dir, args),
                    nprocs=world,
                    join=True,
                )
                return
            except ProcessException as error:
                failures = []
                for name in os.listdir(error_dir):
                    if not name.endswith(".txt"):  # a report its writer was killed before renaming
                        continue
                    with open(os.path.join(error_dir, name)) as file:
                        stamp, _, trace = file.read().partition("\n")
                    failures.append((float(stamp), int(name[4:-4]), trace))
                if not failures:  # died without a Python exception (signal, os._exit)
                    raise
                failures.sort()
                _, first, trace = failures[0]
                if "address already in use" in trace.lower() and attempt + 1 < attempts:
                    continue
                others = ", ".join(str(r) for _, r, _ in failures[1:]) or "none"
                raise SpawnedRankError(
                    f"rank {first} of {world} failed first (ranks also failing after it: {others}):\n{trace}",
                    first,
                ) from error
        finally:
            shutil.rmtree(error_dir, ignore_errors=True)
