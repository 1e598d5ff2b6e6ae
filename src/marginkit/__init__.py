"""marginkit: margin-based representation learning on PyTorch.

Sub-packages (imported lazily):

- :mod:`marginkit.ops` — pure functions (margin-enforcing projection, alpha-softargmax, ...).
- :mod:`marginkit.losses` — thin ``nn.Module`` losses over the ops.
- :mod:`marginkit.heads` — classifier heads (cosine class centres).
- :mod:`marginkit.mining`, :mod:`marginkit.data`, :mod:`marginkit.schedules`.
- :mod:`marginkit.knn`, :mod:`marginkit.metrics` — K-NN classification and evaluation.
- :mod:`marginkit.export`, :mod:`marginkit.gallery`, :mod:`marginkit.serve` — deployment.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0.dev0"

_SUBMODULES = {
    "ops",
    "losses",
    "heads",
    "mining",
    "data",
    "schedules",
    "knn",
    "metrics",
    "models",
    "distributed",
    "cli",
    "train",
    "report",
    "study",
    "export",
    "gallery",
    "serve",
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"marginkit.{name}")
    raise AttributeError(f"module 'marginkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_SUBMODULES | {"__version__"})
