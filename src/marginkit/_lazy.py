"""Lazy re-export of public names from private implementation modules (PEP 562).

Each package ``__init__`` lists ``name -> module`` once; the module is imported on first
attribute access, so ``import marginkit`` stays cheap and optional dependencies are only
imported by the features that need them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def attach(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """Return ``(__getattr__, __dir__, __all__)`` for ``package``.

    ``exports`` maps each public name to the submodule (relative to ``package``) defining it.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        globals_of_package = importlib.import_module(package).__dict__
        globals_of_package[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__, sorted(exports)
