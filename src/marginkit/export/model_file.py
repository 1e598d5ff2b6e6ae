"""The embedding model as a file outside PyTorch: ONNX (run by onnxruntime) or TorchScript.

ONNX is written by ``torch.onnx.export(..., dynamo=True)``, the ``torch.export``-based
exporter (it needs ``onnxscript``; the TorchScript-based exporter, ``dynamo=False``, is
deprecated in torch 2.13 and announced for removal). Both run offline. The graph has one
input ``x`` ``[batch, *input_shape]`` (float32) and one output ``embedding``
``[batch, dim]``; the batch axis is dynamic, and so are the module's ``variable_axes`` (the
time axis of a speaker model's waveform, at least its ``min_input_length`` long).

TorchScript is written by ``torch.jit.trace`` (batch axis free, since the backbones have no
shape-dependent control flow); torch 2.13 deprecates ``torch.jit.load`` in favour of
``torch.export``, so prefer ONNX. Loading TorchScript deserialises code that PyTorch runs:
load only bundles you trust. ONNX files hold a graph of standard operators, no code.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from marginkit._lazy import require

__all__ = [
    "FORMATS",
    "INPUT_NAME",
    "MODEL_FILES",
    "OUTPUT_NAME",
    "load_model_file",
    "require_runtime",
    "write_model_file",
]

FORMATS = ("onnx", "torchscript")
MODEL_FILES = {"onnx": "model.onnx", "torchscript": "model.ts"}
INPUT_NAME, OUTPUT_NAME = "x", "embedding"

Embedder = Callable[[np.ndarray], np.ndarray]


def _import(name: str) -> Any:
    return require(name, extra="export", purpose="the ONNX format (export and inference)")


def require_runtime(fmt: str) -> None:
    """Raise :class:`~marginkit._lazy.MissingExtraError` now, before any work, when writing and
    checking a ``fmt`` model file needs a package that is not installed (ONNX: onnx, onnxscript
    and onnxruntime, the ``export`` extra)."""
    if fmt == "onnx":
        for name in ("onnx", "onnxscript", "onnxruntime"):
            _import(name)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's progress lines and its notes about absent torchvision ops."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def write_model_file(
    module: nn.Module, input_shape: tuple[int, ...], path: str | os.PathLike[str], fmt: str
) -> None:
    """Write ``module`` (an embedding model ``[B, *input_shape] -> [B, D]``) as ``fmt`` to ``path``.

    The module is copied to CPU float32 in eval mode first; the caller's module is untouched.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    model = copy.deepcopy(module).to("cpu", torch.float32).eval()
    example = torch.zeros(2, *input_shape)
    dims: dict[int, Any] = {0: torch.export.Dim("batch", min=1)}
    for axis in getattr(model, "variable_axes", ()):  # e.g. a waveform's length
        dims[int(axis)] = torch.export.Dim(f"axis{axis}", min=int(getattr(model, "min_input_length", 1)))
    path = Path(path)
    with torch.no_grad(), _quiet_exporter():
        if fmt == "onnx":
            _import("onnxscript")
            program = torch.onnx.export(
                model,
                (example,),
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_shapes={"x": dims},
                dynamo=True,
                verbose=False,
            )
            assert program is not None
            program.save(path, external_data=False)
        else:
            traced = torch.jit.trace(model, (example,), check_trace=False)
            torch.jit.save(traced, str(path))


def load_model_file(path: str | os.PathLike[str], fmt: str, *, threads: int = 0) -> Embedder:
    """A function ``x [B, *input_shape] float32 -> embeddings [B, D] float32`` (NumPy arrays).

    ``threads``: intra-op threads of the runtime (0: its default). TorchScript executes
    code from the file: load only trusted files.
    """
    if fmt == "onnx":
        ort = _import("onnxruntime")
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(threads)
        options.log_severity_level = 3
        session = ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])

        def run_onnx(x: np.ndarray) -> np.ndarray:
            return session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(x, dtype=np.float32)})[0]

        return run_onnx
    if fmt == "torchscript":
        with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript (docs/deploy.md)
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.load(os.fspath(path), map_location="cpu").eval()

        def run_torchscript(x: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return scripted(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()

        return run_torchscript
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
