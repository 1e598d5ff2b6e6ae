"""Helpers for tests that start a real torch.distributed group (gloo, CPU, loopback only).

Usage, from any test module (the ``tests`` directory is on ``sys.path`` under pytest)::

    from dist_utils import run_distributed

    def _worker(rank, world, arg):          # module level: it is pickled by name
        ...                                 # the default group is initialised (gloo)

    @pytest.mark.distributed
    def test_something():
        run_distributed(_worker, 2, arg)    # raises the first failing rank's error

Each call starts ``world`` fresh processes (``torch.multiprocessing.spawn``), joins them, and
terminates the rest as soon as one fails; ports are picked free and a stolen one is retried.
Spawning costs seconds, so run several checks per spawn rather than one spawn per check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from marginkit.distributed import _spawn_for_test


def run_distributed(fn: Callable[..., None], world: int, *args: Any, timeout_s: float = 60.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; see the module docstring."""
    _spawn_for_test(fn, world, *args, timeout_s=timeout_s)
