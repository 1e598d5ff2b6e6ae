"""The optional compiled kernels of :mod:`marginkit.ops` (numba), loaded on first use.

A kernel module imports numba at its top (``pip install marginkit[fast]`` installs it) and computes
the bits of a torch reference path. Without numba, once numba has failed to compile a kernel (said
once, as a ``RuntimeWarning``), or while ``torch.compile`` traces the caller (dynamo cannot trace
into numba's dispatcher), :meth:`CompiledKernel.get` and :meth:`CompiledKernel.run` return ``None``
and the caller runs that reference path; any other exception is a bug and propagates.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Any

import torch

__all__ = ["CompiledKernel"]


class CompiledKernel:
    """The module ``marginkit.ops.<module>``, imported on first use (``None`` when it cannot be).

    ``what`` names it in the warning. :attr:`loaded` is the module, ``False`` when unavailable, or
    ``None`` before the first use (tests set it).
    """

    def __init__(self, module: str, what: str) -> None:
        self.module, self.what = module, what
        self.loaded: ModuleType | bool | None = None

    def get(self) -> ModuleType | None:
        if torch.compiler.is_compiling():
            return None
        if self.loaded is None:
            try:
                self.loaded = importlib.import_module(f"marginkit.ops.{self.module}")
            except ImportError:  # (numba missing, or too old or too new for this numpy)
                self.loaded = False
        return self.loaded or None

    def run(self, function: str, *args: Any) -> Any:
        """``module.function(*args)``, or ``None`` without the module or when numba fails on it."""
        module = self.get()
        if module is None:
            return None
        try:
            return getattr(module, function)(*args)
        except Exception as error:
            if not type(error).__module__.startswith("numba"):
                raise
            self.loaded = False
            warnings.warn(
                f"marginkit: {self.what} is unavailable ({error}); the torch/numpy path runs it",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
