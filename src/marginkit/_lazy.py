"""Lazy imports: public names re-exported from private modules (PEP 562), and optional dependencies.

Each package ``__init__`` lists ``name -> module`` once; the module is imported on first
attribute access, so ``import marginkit`` stays cheap and optional dependencies are only
imported by the features that need them. Those features import them with :func:`require`,
which raises :class:`MissingExtraError` naming the extra of ``pyproject.toml`` to install.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "DISTRIBUTIONS",
    "EXTRAS",
    "MissingExtraError",
    "attach",
    "install_hint",
    "missing_extra",
    "require",
]


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


# ---------------------------------------------------------------------- optional dependencies
#: The extra of ``pyproject.toml`` that installs each optional top-level module (where two extras
#: install it, the one whose feature needs it most often). ``tests/test_clear_errors_issue39.py``
#: checks every entry against ``[project.optional-dependencies]``.
EXTRAS: dict[str, str] = {
    **dict.fromkeys(("yaml", "matplotlib", "sklearn", "mnist1d", "PIL", "tqdm"), "cli"),
    "kornia": "augment",
    "faiss": "faiss",
    "numba": "fast",  # (the compiled CPU kernels; without it the torch / numpy paths run, nothing fails)
    **dict.fromkeys(("optuna", "mlxtend", "aeon"), "study"),
    **dict.fromkeys(("onnx", "onnxruntime", "onnxscript"), "export"),
    **dict.fromkeys(
        ("fastapi", "uvicorn", "multipart", "python_multipart", "orjson", "fastapi_offline"), "serve"
    ),
    **dict.fromkeys(("pymilvus", "milvus_lite"), "milvus"),
    "safetensors": "weights",
    **dict.fromkeys(("tensorboard", "mlflow"), "tracking"),
    **dict.fromkeys(("timm", "torchvision", "onnx2torch"), "vision"),
    **dict.fromkeys(("soundfile", "soxr", "kaldi_native_fbank"), "audio"),
    "webdataset": "stream",
}

#: The distribution (what pip installs) of the modules whose import name differs from it.
DISTRIBUTIONS: dict[str, str] = {
    "yaml": "pyyaml",
    "sklearn": "scikit-learn",
    "PIL": "pillow",
    "faiss": "faiss-cpu",
    "multipart": "python-multipart",
    "python_multipart": "python-multipart",
    "fastapi_offline": "fastapi-offline",
    "milvus_lite": "milvus-lite",
    "kaldi_native_fbank": "kaldi-native-fbank",
}


def install_hint(extra: str) -> str:
    """``pip install 'marginkit[EXTRA]'``."""
    return f"pip install 'marginkit[{extra}]'"


class MissingExtraError(ImportError):
    """An optional dependency is not installed (or does not load): the message names the
    feature that needs it, the package and the extra that installs it.

    ``extra``: the extra's name (``"export"``, ...); ``module``: the module that failed to import.
    The command line reports it as a usage error (exit status 2), never as an internal error.
    """

    def __init__(self, message: str, *, extra: str = "", module: str = "") -> None:
        super().__init__(message, name=module or None)
        self.extra, self.module = extra, module

    @classmethod
    def of(
        cls, module: str, purpose: str, extra: str | None = None, cause: BaseException | None = None
    ) -> MissingExtraError:
        """The error for ``module`` (a top-level name of :data:`EXTRAS` unless ``extra`` is given)
        that ``purpose`` needs; ``cause``: the import's own failure, when it is not a plain
        "not installed" (an installed package that does not load)."""
        top = module.split(".")[0]
        extra = extra or EXTRAS[top]
        package = DISTRIBUTIONS.get(top, top)
        if cause is None:
            why = "which is not installed"
        else:
            first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
            why = f"which is installed but does not load ({type(cause).__name__}: {first})"
        return cls(f"{purpose} needs {package!r}, {why}: {install_hint(extra)}", extra=extra, module=top)


def _not_found(exc: BaseException) -> str | None:
    """The top-level module a ``ModuleNotFoundError`` says is missing, else ``None``."""
    name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    return name.split(".")[0] if name else None


def require(module: str, *, purpose: str, extra: str | None = None, package: str | None = None) -> ModuleType:
    """Import ``module`` (e.g. ``"soundfile"``) and return it, or raise :class:`MissingExtraError`.

    ``purpose`` says what needs it (``"reading audio"``), ``extra`` which extra installs it
    (default: :data:`EXTRAS` of ``package``), ``package`` the top-level module whose
    distribution the message names (default: ``module``'s own; ``"tensorboard"`` for
    ``torch.utils.tensorboard``). When the import fails because another optional package it
    imports is missing, that package is named instead::

        sf = require("soundfile", purpose="reading audio")  # extra "audio" from EXTRAS
    """
    top = package or module.split(".")[0]
    try:
        __import__(module)  # through builtins.__import__, so import hooks that patch it apply
        return sys.modules[module]
    except Exception as exc:  # soundfile raises OSError without libsndfile, torchvision RuntimeError
        missing = _not_found(exc)
        if missing in (top, module.split(".")[0]):
            raise MissingExtraError.of(top, purpose, extra) from exc
        if missing in EXTRAS:  # a dependency of the module, itself optional: install the module's extra
            raise MissingExtraError.of(missing, purpose, extra or EXTRAS.get(top)) from exc
        raise MissingExtraError.of(top, purpose, extra, cause=exc) from exc


def missing_extra(exc: BaseException, purpose: str = "this feature") -> MissingExtraError | None:
    """The missing optional dependency behind ``exc``, or ``None``.

    ``exc`` itself or an exception it was raised from (``raise ... from``): a
    :class:`MissingExtraError`, or a ``ModuleNotFoundError`` for a module of :data:`EXTRAS`
    (an import not routed through :func:`require`), turned into one whose message is ``exc``'s
    when that already names the extra, else says that ``purpose`` needs the package.
    """
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, MissingExtraError):
            return seen
        name = _not_found(seen)
        if name in EXTRAS:
            extra = EXTRAS[name]
            text = (str(exc).strip().splitlines() or [""])[0]
            if isinstance(exc, ImportError) and f"marginkit[{extra}]" in text:
                return MissingExtraError(text, extra=extra, module=name)
            return MissingExtraError.of(name, purpose, extra)
        seen = seen.__cause__
    return None
