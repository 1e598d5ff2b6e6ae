"""ONNX image models as trainable embedding backbones: ``onnx:FILE``.

The form in which face models are usually shared is an ONNX file (insightface's model zoo: the
ArcFace ResNet-50 / ResNet-100 of its ``buffalo_l`` and ``antelopev2`` packs). ``onnx:FILE``
converts such a graph into PyTorch modules with `onnx2torch <https://github.com/ENOT-AutoDL/onnx2torch>`_
and puts marginkit's linear projection and L2 normalisation on top, as for the other backbones;
the converted graph is the trunk (``net``), to fine-tune with any loss, freeze, export and serve.

Why onnx2torch: it is maintained and on PyPI, and it turns each ONNX node into a plain torch
module (``Conv`` into ``nn.Conv2d``, ``Gemm`` into ``nn.Linear``, ``BatchNormalization`` into
``nn.BatchNorm2d`` / ``1d``, ...) inside one ``torch.fx.GraphModule``: the result has ordinary
parameters and autograd, trains on any device, exports again with ``torch.onnx``, and needs
neither onnxruntime nor the original framework at run time. (onnxruntime's training API needs
its own training artefacts; ``onnx-tf`` / ``onnx2keras`` target other frameworks.) The
converter covers the standard operators up to about opset 17; a graph using anything else is
refused before conversion, naming each missing operator.

What becomes trainable: every floating-point initializer of the graph — weights, biases,
PReLU slopes, constants a graph may fold in — is a parameter; batch-norm running statistics
stay buffers and follow the data in training mode, as in the framework the model came from.

The file is validated before it is trusted (it comes from outside): at most
:data:`MAX_ONNX_BYTES` (protobuf's own limit) before it is read; read without following
external-data references (a graph that keeps its weights in other files is refused);
``onnx.checker``; exactly one float input ``[N, C, H, W]`` with a fixed channel count and one
output ``[N, F]`` (``[N, F, 1, ..., 1]`` is flattened).

**Inputs.** The data set's images ``[B, C, h, w]`` in ``[0, 1]`` are adapted inside the module,
so export and serving take the data set's own images:

1. grey images are repeated to the model's channels;
2. they are resized (bilinear) to the model's own input size, read from the file; a file whose
   height and width are symbolic needs ``image_size`` (``image_size`` must equal a fixed size);
3. they are normalised ``(x - mean) / std``. A model's expected normalisation cannot be read
   from an ONNX file, so it is an option, ``mean`` / ``std`` in the ``[0, 1]`` pixel scale
   (a number or one per channel). The default is insightface's convention, RGB
   ``(p - 127.5) / 127.5`` on 0-255 pixels, i.e. ``mean = std = 0.5``; a model trained with
   ImageNet's statistics wants ``mean = [0.485, 0.456, 0.406]``, ``std = [0.229, 0.224, 0.225]``.
   Channels are taken in the data set's order (RGB for colour images).

Freezing: ``freeze: trunk`` freezes the whole converted graph; ``freeze: N`` the first ``N``
of its parameterised operators in the order the graph runs them (each ``Conv``, its batch norm,
each PReLU, ...: one stage each). The run refers to the file: it is read again to rebuild the
graph (the weights come from the run's checkpoint) for export, evaluation and ``--resume``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from marginkit.models.base import EmbeddingModel
from marginkit.models.external import adapt_images, image_size_option, import_library

__all__ = ["MAX_ONNX_BYTES", "OnnxBackbone", "build_onnx_backbone", "read_onnx"]

#: A file larger than this is refused before it is read: protobuf cannot parse a message over
#: 2 GiB, so no self-contained ONNX model is larger.
MAX_ONNX_BYTES = 2**31 - 1
_FLOAT_TYPES = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}  # onnx.TensorProto codes
_OPTIONS = ("image_size", "mean", "std")
#: insightface's (p - 127.5) / 127.5 on 0-255 pixels, in the [0, 1] scale of marginkit's images.
INSIGHTFACE_MEAN, INSIGHTFACE_STD = 0.5, 0.5


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _unsupported_ops(model: Any, onnx2torch: Any) -> list[str]:
    """``"Det (opset 11)"``, ... for every node type of the graph that onnx2torch cannot convert."""
    from onnx2torch.node_converters.registry import get_converter

    opsets = {o.domain or "": int(o.version) for o in model.opset_import}
    missing: dict[str, None] = {}
    for node in model.graph.node:
        domain = node.domain or ""
        label = node.op_type if domain in ("", "ai.onnx") else f"{domain}.{node.op_type}"
        if domain not in opsets and domain != "ai.onnx":
            missing[f"{label} (its domain {domain!r} is not imported)"] = None
            continue
        try:
            get_converter(
                operation_type=node.op_type, version=opsets.get(domain, opsets.get("", 0)), domain=domain
            )
        except NotImplementedError:
            missing[f"{label} (opset {opsets.get(domain, opsets.get('', 0))})"] = None
    return list(missing)


def _inline_identity_constants(model: Any) -> None:
    """Replace ``Identity`` nodes of an initializer by a copy of it (torch's exporter shares
    equal constants that way): each operator then sees its own weights, as a module."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    keep = []
    for node in model.graph.node:
        if node.op_type == "Identity" and len(node.input) == 1 and node.input[0] in inits:
            copy = numpy_helper.from_array(numpy_helper.to_array(inits[node.input[0]]), node.output[0])
            model.graph.initializer.append(copy)
            inits[copy.name] = copy
        else:
            keep.append(node)
    if len(keep) != len(model.graph.node):
        del model.graph.node[:]
        model.graph.node.extend(keep)


def _dims(value_info: Any) -> list[int | str | None]:
    """A graph value's shape: ints for fixed axes, names for symbolic ones, None for unknown."""
    out: list[int | str | None] = []
    for d in value_info.type.tensor_type.shape.dim:
        kind = d.WhichOneof("value")
        out.append(int(d.dim_value) if kind == "dim_value" else d.dim_param if kind == "dim_param" else None)
    return out


def read_onnx(path: str | os.PathLike[str]) -> tuple[Any, dict[str, Any]]:
    """Read and check the ONNX file at ``path``; returns the model (``onnx.ModelProto``) and its
    interface ``{"input": name, "channels": C, "size": (H, W) or None, "features": F or None}``.

    Raises ValueError naming the file and what is wrong; ImportError without onnx / onnx2torch.
    """
    onnx = import_library("onnx")
    onnx2torch = import_library("onnx2torch")
    p = Path(path).expanduser()
    where = f"ONNX model {str(p)!r}"
    if not p.is_file():
        raise ValueError(f"{where} does not exist" if not p.exists() else f"{where} is not a file")
    size = p.stat().st_size
    if size > MAX_ONNX_BYTES:
        raise ValueError(
            f"{where} is {size / 2**20:.0f} MiB, more than an ONNX file can hold (2 GiB); "
            "weights kept in external data files are not read"
        )
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ValueError(f"{where} is not an ONNX model ({type(exc).__name__}: {_first_line(exc)})") from None
    external = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise ValueError(
            f"{where} keeps {len(external)} weight tensor(s) in external data files (e.g. {external[0]!r}); "
            "save it as one self-contained file (onnx.save(model, path, save_as_external_data=False))"
        )
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ValueError(f"{where} is not a valid ONNX model: {_first_line(exc)}") from None
    missing = _unsupported_ops(model, onnx2torch)
    if missing:
        raise ValueError(
            f"{where} uses operator(s) that onnx2torch cannot convert to PyTorch: {', '.join(missing)}; "
            "export the model again without them (or at an opset onnx2torch supports, 9-17)"
        )
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    if len(inputs) != 1 or len(model.graph.output) != 1:
        raise ValueError(
            f"{where} has {len(inputs)} input(s) and {len(model.graph.output)} output(s); an embedding "
            "backbone takes one image batch [N, C, H, W] and gives one [N, F]"
        )
    dims, elem = _dims(inputs[0]), inputs[0].type.tensor_type.elem_type
    if elem != onnx.TensorProto.FLOAT or len(dims) != 4 or not isinstance(dims[1], int) or dims[1] < 1:
        shown = "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"
        raise ValueError(
            f"{where}: input {inputs[0].name!r} is {_FLOAT_TYPES.get(elem, f'type {elem}')} {shown}; "
            "expected float32 images [N, C, H, W] with a fixed channel count C"
        )
    spatial = dims[2:]
    fixed = tuple(int(d) for d in spatial) if all(isinstance(d, int) and d > 0 for d in spatial) else None
    out_dims = _dims(model.graph.output[0])
    features = None
    if len(out_dims) >= 2 and all(d == 1 for d in out_dims[2:]) and isinstance(out_dims[1], int):
        features = int(out_dims[1]) if out_dims[1] > 0 else None
    if out_dims and (len(out_dims) < 2 or any(d != 1 for d in out_dims[2:] if isinstance(d, int))):
        raise ValueError(
            f"{where}: output {model.graph.output[0].name!r} has shape {out_dims}; expected [N, F] features"
        )
    return model, {"input": inputs[0].name, "channels": int(dims[1]), "size": fixed, "features": features}


def _convert(model: Any, where: str) -> nn.Module:
    """onnx2torch's GraphModule of ``model``, every floating-point initializer a parameter."""
    from onnx2torch import convert

    _inline_identity_constants(model)
    try:
        net = convert(model)
    except Exception as exc:  # a converter's own refusal of an attribute or a shape
        raise ValueError(
            f"{where} could not be converted to PyTorch by onnx2torch "
            f"({type(exc).__name__}: {_first_line(exc)})"
        ) from None
    container = getattr(net, "initializers", None)  # absent when no operator reads an initializer
    if container is None:
        return net
    statistics = set()  # running mean / var of a functional batch norm stay buffers
    for node in net.graph.nodes:
        if node.op == "call_module" and type(net.get_submodule(node.target)).__name__ == "OnnxBatchNorm":
            statistics.update(a.target for a in node.args[3:5] if getattr(a, "op", None) == "get_attr")
    for name, value in list(container.named_buffers(recurse=False)):
        if value.is_floating_point() and f"initializers.{name}" not in statistics:
            delattr(container, name)
            container.register_parameter(name, nn.Parameter(value.clone(), requires_grad=True))
    return net


class OnnxBackbone(EmbeddingModel):
    """An ONNX image model, converted by onnx2torch, as the trunk of an embedding model (module doc).

    Attributes:
        path: the ONNX file (absolute); ``name`` is ``"onnx:" + path``.
        net: the converted graph (``torch.fx.GraphModule``), ``[B, C, H, W] -> [B, F]``.
        image_size: ``(H, W)`` the images are resized to; ``mean``, ``std``: buffers (per channel).
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        embedding_dim: int,
        normalize: bool,
        *,
        path: str | os.PathLike[str],
        image_size: int | Sequence[int] | None = None,
        mean: float | Sequence[float] = INSIGHTFACE_MEAN,
        std: float | Sequence[float] = INSIGHTFACE_STD,
    ) -> None:
        super().__init__(input_shape, embedding_dim, normalize)
        self.path = str(Path(path).expanduser().absolute())
        self.name = f"onnx:{self.path}"
        if len(self.input_shape) != 3:
            raise ValueError(
                f"{self.name} expects images, input_shape (C, H, W); got {self.input_shape} "
                "(ONNX backbones take image batches [N, C, H, W])"
            )
        with torch.device("cpu"):  # read and converted on the CPU; moved with the model
            model, facts = read_onnx(self.path)
            net = _convert(model, f"ONNX model {self.path!r}")
        self.channels = facts["channels"]
        if self.input_shape[0] not in (1, self.channels):
            raise ValueError(
                f"{self.name} takes {self.channels}-channel images (grey ones are repeated); the data have "
                f"{self.input_shape[0]} channels"
            )
        if facts["size"] is None and image_size is None:
            raise ValueError(
                f"{self.name}: the file leaves its input's height and width open; "
                "set model_options.image_size (the size the model was trained at, e.g. 112)"
            )
        self.image_size = image_size_option(image_size, facts["size"] or (0, 0))
        if facts["size"] is not None and self.image_size != facts["size"]:
            raise ValueError(
                f"{self.name} fixes its input at {facts['size'][0]}x{facts['size'][1]}; "
                "model_options.image_size "
                f"must be that size or unset, got {list(self.image_size)}"
            )
        mean_t, std_t = _statistic(mean, "mean", self.channels), _statistic(std, "std", self.channels)
        dim = facts["features"] or _probe_features(net, self.channels, self.image_size)
        self.net = net.to(torch.get_default_device())  # the meta device when only shapes are wanted
        self.register_buffer("mean", mean_t.view(1, -1, 1, 1), False)
        self.register_buffer("std", std_t.view(1, -1, 1, 1), False)
        self.projection = nn.Linear(dim, embedding_dim)
        self.config = {
            "image_size": list(self.image_size) if image_size is not None else None,
            "mean": mean,
            "std": std,
        }

    def adapt(self, x: torch.Tensor) -> torch.Tensor:
        """Data-set images ``[B, C, h, w]`` in [0, 1] -> the model's input ``[B, C', H, W]``."""
        return adapt_images(x, self.channels, self.image_size, self.mean, self.std)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.adapt(x)).flatten(1)

    def stage_modules(self) -> list[nn.Module]:
        """The graph's parameterised operators in the order it runs them, each with the
        initializers it reads (module doc)."""
        params = dict(self.net.named_parameters())
        stages: list[nn.Module] = []
        for node in self.net.graph.nodes:
            if node.op != "call_module":
                continue
            module = self.net.get_submodule(node.target)
            read = [
                params[a.target]
                for a in node.args
                if getattr(a, "op", None) == "get_attr" and a.target in params
            ]
            if not read and not any(True for _ in module.parameters()):
                continue
            stage = nn.Module()
            stage.add_module("op", module)
            for i, p in enumerate(read):
                stage.register_parameter(f"input{i}", p)
            stages.append(stage)
        return stages

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        if enable:
            raise ValueError(f"{self.name}: ONNX backbones offer no gradient checkpointing")
        self.grad_checkpointing = False


def _probe_features(net: nn.Module, channels: int, size: tuple[int, int]) -> int:
    """F of a graph whose output width shape inference leaves open: one forward pass on the CPU."""
    with torch.no_grad(), torch.device("cpu"):
        out = net.eval()(torch.zeros(1, channels, *size))
    net.train()
    return int(out.flatten(1).shape[1])


def _statistic(value: Any, name: str, channels: int) -> torch.Tensor:
    """``model_options.mean`` / ``std``: a number or one per channel, as a ``[channels]`` tensor."""
    values = [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    ok = isinstance(values, (list, tuple)) and len(values) in (1, channels)
    ok = ok and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
    )
    if not ok or (name == "std" and min(values) <= 0):
        want = "positive numbers" if name == "std" else "finite numbers"
        raise ValueError(
            f"model_options.{name} must be a number or {channels} {want} (one per channel, images in "
            f"[0, 1]), got {value!r}"
        )
    return torch.tensor([float(v) for v in values] * (channels // len(values)), dtype=torch.float32)


def build_onnx_backbone(
    path: str, input_shape: tuple[int, ...], embedding_dim: int, normalize: bool, **options: Any
) -> OnnxBackbone:
    """:class:`OnnxBackbone` for the file ``path`` (``onnx:PATH``)."""
    unknown = [k for k in options if k not in _OPTIONS]
    if unknown:
        raise ValueError(
            f"unknown option {unknown[0]!r} for model 'onnx:'; valid options: {', '.join(_OPTIONS)}"
        )
    return OnnxBackbone(input_shape, embedding_dim, normalize, path=path, **options)
