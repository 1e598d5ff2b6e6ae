"""Fault injection for run-directory tests: kill a run (``os._exit``, no cleanup) before write step N.

A run's write steps are the ``_sync`` (a temporary file made durable) and ``_rename`` (moved
into place) calls of :mod:`marginkit.train.rundir`, counted from 0. Importable by name, so a
``multiprocessing`` forkserver can preload it (with torch) and fork one cheap child per kill:
it also imports what a run's first steps import lazily (seconds of torch's Dynamo and
Inductor), so that each child does not import them again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Imported once in the forkserver, not again in each child: torch's Dynamo and Inductor (the
# first optimiser and torch.use_deterministic_algorithms import them) and marginkit's modules
# that a run imports as it needs them.
import torch._dynamo
import torch._inductor.config  # noqa: F401

import marginkit.data.datasets
import marginkit.heads.cosine
import marginkit.knn.classifier
import marginkit.metrics.retrieval
import marginkit.metrics.verification
import marginkit.models.backbones  # noqa: F401
from marginkit.train import rundir
from marginkit.train.config import TrainConfig
from marginkit.train.trainer import train

KILLED = 137


def kill_at(step: int, config_json: str, run_dir: str) -> None:
    """Train ``config_json`` into ``run_dir`` and die at once before write step ``step``."""
    count = [0]

    def counted(fn: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            if count[0] == step:
                os._exit(KILLED)  # killed: no cleanup of any kind
            count[0] += 1
            return fn(*args)

        return wrapped

    rundir._sync, rundir._rename = counted(rundir._sync), counted(rundir._rename)
    train(TrainConfig.from_json(config_json), Path(run_dir), quiet=True, report=False)
    os._exit(3)  # never reached when the step is inside the run
