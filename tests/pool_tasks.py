"""Tasks for the worker-pool tests: stdlib only, so a spawned worker starts fast."""

from __future__ import annotations

import os
import time


def square(x: int) -> int:
    return x * x


def fail_second(x: int) -> int:
    """Task 2 raises; task 3 would run for ten minutes."""
    if x == 2:
        raise ValueError(f"task {x} failed")
    time.sleep(600 if x == 3 else 0)
    return x


def die(x: int) -> int:
    os._exit(7)
