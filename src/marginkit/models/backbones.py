"""Small embedding backbones: ``mlp``, ``cnn1d``, ``cnn2d``, ``resnet``, built by :func:`build_model`.

Every backbone maps a batch ``[B, *input_shape]`` to embeddings ``[B, embedding_dim]``:
a trunk, a linear projection, and (``normalize=True``) L2 normalisation
:math:`z / \\max(\\lVert z \\rVert_2, 10^{-12})` computed in float32 or better. They carry no
classifier: class-level losses put their own head (e.g. a cosine head) on top.

All are sized for CPUs and small data: the default ``cnn1d`` on mnist1d has 68 k parameters
(one plain softmax run: ~97 % test accuracy after 10 epochs, ~5 s of single-thread CPU
time), the default ``resnet`` ~1.2 M. No augmentation, dropout off by default. Batch norm is the
default normalisation (``norm="none"`` removes it), so training batches need >= 2 samples.

``timm:NAME`` and ``torchvision:NAME`` wrap those libraries' image models the same way
(:mod:`marginkit.models.external`). For fine-tuning every backbone can freeze its trunk or its
first stages (:meth:`EmbeddingModel.freeze`) and recompute activations in the backward pass
(:meth:`EmbeddingModel.set_grad_checkpointing`).
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from marginkit._validation import choice, positive_float, positive_int
from marginkit.models.base import EmbeddingModel, frozen_modules, is_frozen, run_stages

__all__ = [
    "MODELS",
    "CNN1d",
    "CNN2d",
    "EmbeddingModel",
    "MLPEmbedding",
    "SmallResNet",
    "build_model",
    "frozen_modules",
    "is_frozen",
    "register_model",
    "run_stages",
]

#: Backbone names accepted by :func:`build_model`.
MODELS: tuple[str, ...] = ("mlp", "cnn1d", "cnn2d", "resnet")

_NORMS = ("batch", "none")


def _ints(value: Any, name: str, *, minimum: int = 1) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) == 0:
        raise TypeError(f"{name} must be a non-empty sequence of ints, got {value!r}")
    return tuple(positive_int(v, name, minimum=minimum) for v in value)


def _norm1d(kind: str, channels: int) -> nn.Module:
    if kind == "none":
        return nn.Identity()
    return nn.BatchNorm1d(channels)


def _slices(trunk: nn.Sequential, ends: Sequence[int]) -> list[nn.Module]:
    starts = [0, *ends[:-1]]
    return [trunk[a:b] for a, b in zip(starts, ends, strict=True)]


class MLPEmbedding(EmbeddingModel):
    """Flatten, then ``Linear -> BatchNorm -> GELU`` per hidden layer, then the projection.

    Accepts any ``input_shape`` (images are flattened).
    """

    name = "mlp"

    def __init__(
        self,
        input_shape: tuple[int, ...],
        embedding_dim: int,
        normalize: bool,
        *,
        hidden: Sequence[int] = (256, 256),
        dropout: float = 0.0,
        norm: str = "batch",
    ) -> None:
        super().__init__(input_shape, embedding_dim, normalize)
        hidden = _ints(hidden, "hidden")
        dropout = positive_float(dropout, "dropout", allow_zero=True)
        if dropout >= 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        norm = choice(norm, "norm", _NORMS)
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(self.input_shape)
        self._ends: list[int] = []
        for h in hidden:
            layers += [nn.Linear(width, h), _norm1d(norm, h), nn.GELU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            self._ends.append(len(layers))
            width = h
        self.trunk = nn.Sequential(*layers)
        self.projection = nn.Linear(width, embedding_dim)
        self.config = {"hidden": list(hidden), "dropout": dropout, "norm": norm}

    def stage_modules(self) -> list[nn.Module]:
        """One stage per hidden layer."""
        return _slices(self.trunk, self._ends)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self._checkpointing():
            return run_stages(self.stage_modules(), x, True)
        return self.trunk(x)


class CNN1d(EmbeddingModel):
    """1-D CNN for sequences such as MNIST-1D: ``input_shape`` ``(L,)`` or ``(C, L)``.

    One stage per entry of ``channels``: ``convs_per_stage`` blocks ``Conv1d(k) -> BN -> GELU``,
    the first convolution of every stage after the first with stride 2 (``L`` halves per stage).
    Then global average and max pooling, concatenated (translation-invariant features, which
    suits MNIST-1D's randomly shifted digits), and the projection.
    """

    name = "cnn1d"

    def __init__(
        self,
        input_shape: tuple[int, ...],
        embedding_dim: int,
        normalize: bool,
        *,
        channels: Sequence[int] = (32, 64, 128),
        kernel_size: int = 5,
        convs_per_stage: int = 1,
        norm: str = "batch",
    ) -> None:
        super().__init__(input_shape, embedding_dim, normalize)
        if len(self.input_shape) not in (1, 2):
            raise ValueError(
                f"cnn1d expects input_shape (L,) or (C, L) for sequences, got {self.input_shape}; "
                "use cnn2d or resnet for images, mlp for anything"
            )
        in_ch, length = (1, self.input_shape[0]) if len(self.input_shape) == 1 else self.input_shape
        if length < 4:
            raise ValueError(f"cnn1d needs sequences of length >= 4, got input_shape {self.input_shape}")
        channels = _ints(channels, "channels")
        kernel_size = positive_int(kernel_size, "kernel_size")
        convs_per_stage = positive_int(convs_per_stage, "convs_per_stage")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (same padding), got {kernel_size}")
        norm = choice(norm, "norm", _NORMS)
        layers: list[nn.Module] = []
        self._ends: list[int] = []
        for i, out_ch in enumerate(channels):
            layers += _conv_stage(1, in_ch, out_ch, kernel_size, 1 if i == 0 else 2, convs_per_stage, norm)
            self._ends.append(len(layers))
            in_ch = out_ch
        self.trunk = nn.Sequential(*layers)
        self.projection = nn.Linear(2 * in_ch, embedding_dim)
        self.config = {
            "channels": list(channels), "kernel_size": kernel_size, "convs_per_stage": convs_per_stage,
            "norm": norm,
        }  # fmt: skip

    def stage_modules(self) -> list[nn.Module]:
        """One stage per entry of ``channels``."""
        return _slices(self.trunk, self._ends)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            x = x.unsqueeze(1)
        h = run_stages(self.stage_modules(), x, True) if self._checkpointing() else self.trunk(x)
        return torch.cat([h.mean(dim=2), h.amax(dim=2)], dim=1)


def _image_shape(input_shape: tuple[int, ...], name: str, min_side: int) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(
            f"{name} expects input_shape (C, H, W) for images, got {input_shape}; "
            "use cnn1d for sequences, mlp for vectors"
        )
    c, h, w = input_shape
    if c < 1 or min(h, w) < min_side:
        raise ValueError(
            f"{name} needs images of at least {min_side}x{min_side} px, got input_shape {input_shape}"
        )
    return c, h, w


def _norm2d(kind: str, channels: int) -> nn.Module:
    return nn.Identity() if kind == "none" else nn.BatchNorm2d(channels)


def _channels_last(model: nn.Module) -> None:
    # oneDNN (CPU) and cuDNN pick their NHWC kernels when a weight is channels-last; on CPU
    # they train a small CNN markedly faster than NCHW. The values are unchanged; only the
    # summation order inside a convolution can differ.
    model.to(memory_format=torch.channels_last)


def _conv_stage(
    dims: int, in_ch: int, out_ch: int, kernel: int, stride: int, convs: int, norm: str
) -> list[nn.Module]:
    """``convs`` blocks ``Conv{dims}d(kernel, same padding) -> norm -> GELU``, the first with
    ``stride`` (no conv bias in front of a norm)."""
    conv = nn.Conv1d if dims == 1 else nn.Conv2d
    bn = _norm1d if dims == 1 else _norm2d
    layers: list[nn.Module] = []
    for j in range(convs):
        layers += [
            conv(in_ch if j == 0 else out_ch, out_ch, kernel, stride=stride if j == 0 else 1,
                 padding=kernel // 2, bias=norm == "none"),
            bn(norm, out_ch),
            nn.GELU(),
        ]  # fmt: skip
    return layers


class CNN2d(EmbeddingModel):
    """A small VGG-style CNN for small images (8–64 px): ``input_shape`` ``(C, H, W)``.

    One stage per entry of ``channels``: ``convs_per_stage`` blocks ``Conv3x3 -> BN -> GELU``
    (default 2), then 2x2 max pooling while both sides are still >= 4 px; global average
    pooling and the projection.
    """

    name = "cnn2d"

    def __init__(
        self,
        input_shape: tuple[int, ...],
        embedding_dim: int,
        normalize: bool,
        *,
        channels: Sequence[int] = (32, 64, 128),
        convs_per_stage: int = 2,
        norm: str = "batch",
    ) -> None:
        super().__init__(input_shape, embedding_dim, normalize)
        in_ch, h, w = _image_shape(self.input_shape, "cnn2d", 4)
        channels = _ints(channels, "channels")
        convs_per_stage = positive_int(convs_per_stage, "convs_per_stage")
        norm = choice(norm, "norm", _NORMS)
        layers: list[nn.Module] = []
        self._ends: list[int] = []
        for out_ch in channels:
            layers += _conv_stage(2, in_ch, out_ch, 3, 1, convs_per_stage, norm)
            in_ch = out_ch
            if min(h, w) >= 4:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            self._ends.append(len(layers))
        self.trunk = nn.Sequential(*layers)
        self.projection = nn.Linear(in_ch, embedding_dim)
        self.config = {"channels": list(channels), "convs_per_stage": convs_per_stage, "norm": norm}
        _channels_last(self)

    def stage_modules(self) -> list[nn.Module]:
        """One stage per entry of ``channels`` (its convolutions and pooling)."""
        return _slices(self.trunk, self._ends)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = run_stages(self.stage_modules(), x, True) if self._checkpointing() else self.trunk(x)
        return h.mean(dim=(2, 3))


class BasicBlock(nn.Module):
    """He et al. (2016) basic residual block: two 3x3 convolutions, projection shortcut on change."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=norm == "none")
        self.bn1 = _norm2d(norm, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=norm == "none")
        self.bn2 = _norm2d(norm, out_ch)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=norm == "none"), _norm2d(norm, out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class SmallResNet(EmbeddingModel):
    """A small ResNet (He et al., "Deep Residual Learning", CVPR 2016) for 28–64 px images.

    3x3 stem (stride 2 when ``stem_stride="auto"`` and the shorter side is >= 48 px, else 1),
    then one stage per entry of ``blocks`` with widths ``width * 2**i`` and stride 2 from the
    second stage on, global average pooling and the projection. Default: 4 stages of one
    basic block, widths 32–256 (~1.2 M parameters). Works from 8 px up.
    """

    name = "resnet"

    def __init__(
        self,
        input_shape: tuple[int, ...],
        embedding_dim: int,
        normalize: bool,
        *,
        width: int = 32,
        blocks: Sequence[int] = (1, 1, 1, 1),
        stem_stride: int | str = "auto",
        norm: str = "batch",
    ) -> None:
        super().__init__(input_shape, embedding_dim, normalize)
        in_ch, h, w = _image_shape(self.input_shape, "resnet", 8)
        width = positive_int(width, "width")
        blocks = _ints(blocks, "blocks")
        norm = choice(norm, "norm", _NORMS)
        if stem_stride == "auto":
            stride0 = 2 if min(h, w) >= 48 else 1
        elif stem_stride in (1, 2) and not isinstance(stem_stride, bool):
            stride0 = int(stem_stride)
        else:
            raise ValueError(f"stem_stride must be 1, 2 or 'auto', got {stem_stride!r}")
        self.stem = nn.Sequential(
            nn.Conv2d(in_ch, width, 3, stride=stride0, padding=1, bias=norm == "none"),
            _norm2d(norm, width),
            nn.ReLU(),
        )
        stages: list[nn.Module] = []
        self._ends: list[int] = []
        ch = width
        for i, n in enumerate(blocks):
            out_ch = width * 2**i
            for j in range(n):
                stages.append(BasicBlock(ch, out_ch, 2 if (i > 0 and j == 0) else 1, norm))
                ch = out_ch
            self._ends.append(len(stages))
        self.stages = nn.Sequential(*stages)
        self.projection = nn.Linear(ch, embedding_dim)
        self.config = {"width": width, "blocks": list(blocks), "stem_stride": stem_stride, "norm": norm}
        _channels_last(self)

    def stage_modules(self) -> list[nn.Module]:
        """The stem, then one stage per entry of ``blocks``."""
        return [self.stem, *_slices(self.stages, self._ends)]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self._checkpointing():
            return run_stages(self.stage_modules(), x, True).mean(dim=(2, 3))
        return self.stages(self.stem(x)).mean(dim=(2, 3))


_BUILDERS: dict[str, Callable[..., EmbeddingModel]] = {
    "mlp": MLPEmbedding,
    "cnn1d": CNN1d,
    "cnn2d": CNN2d,
    "resnet": SmallResNet,
}

#: Backbones defined in a higher layer, and the package whose import registers them
#: (:func:`register_model`); ``build_model`` names that package when it was not imported.
_REGISTERED_BY = {"ecapa_tdnn": "marginkit.audio", "speaker_resnet34": "marginkit.audio"}


def register_model(name: str, builder: Callable[..., EmbeddingModel]) -> None:
    """Make ``build_model(name, input_shape, embedding_dim, normalize, **options)`` call
    ``builder(shape, embedding_dim, normalize, **options)`` (its keyword-only parameters are the
    model's options). For backbones of higher layers, which ``models`` cannot import:
    ``marginkit.audio`` registers ``ecapa_tdnn`` and ``speaker_resnet34`` when imported."""
    global MODELS
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a model name must be a non-empty str without ':', got {name!r}")
    _BUILDERS[name] = builder
    if name not in MODELS:
        MODELS = (*MODELS, name)


def _unregistered(name: object) -> ValueError | None:
    package = _REGISTERED_BY.get(name) if isinstance(name, str) else None
    if package is None or name in _BUILDERS:
        return None
    return ValueError(f"model {name!r} is defined in {package}: import {package} first (the CLI does)")


def model_options(name: str) -> tuple[str, ...]:
    """Backbone-specific ``**options`` of :func:`build_model` for ``name``."""
    from marginkit.models.external import is_external

    if is_external(name):
        return ("image_size", "mean", "std") if name.startswith("onnx:") else ("image_size",)
    if name not in _BUILDERS:
        raise _unregistered(name) or ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    params = inspect.signature(_BUILDERS[name]).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def build_model(
    name: str,
    input_shape: Sequence[int],
    embedding_dim: int = 64,
    normalize: bool = True,
    **options: Any,
) -> EmbeddingModel:
    """Build an embedding backbone mapping ``[B, *input_shape]`` to ``[B, embedding_dim]``.

    Args:
        name: ``"mlp"`` (any input), ``"cnn1d"`` (sequences ``(L,)`` / ``(C, L)``, e.g. mnist1d),
            ``"cnn2d"`` (images ``(C, H, W)``, 4 px and up), ``"resnet"`` (images, meant for 28–64 px),
            or an image model of timm / torchvision, ``"timm:NAME"`` / ``"torchvision:NAME"``
            (:mod:`marginkit.models.external`; option ``image_size``).
        input_shape: per-sample input shape, e.g. ``DatasetSplits.input_shape``.
        embedding_dim: output size.
        normalize: L2-normalise the outputs (unit rows).
        **options: backbone-specific (see :func:`model_options`): ``mlp``: ``hidden``,
            ``dropout``, ``norm``; ``cnn1d``: ``channels``, ``kernel_size``, ``convs_per_stage``, ``norm``;
            ``cnn2d``: ``channels``, ``convs_per_stage``, ``norm``; ``resnet``: ``width``, ``blocks``,
            ``stem_stride``, ``norm``.

    Returns:
        An :class:`EmbeddingModel` with attributes ``embedding_dim``, ``input_shape``,
        ``normalize`` and ``config`` (``build_model(**model.config)`` rebuilds it).

    Example:
        >>> model = build_model("cnn1d", (40,), embedding_dim=32)
        >>> model(torch.zeros(5, 40)).shape
        torch.Size([5, 32])
    """
    from marginkit.models.external import is_external

    if is_external(name):
        return _build(name, input_shape, embedding_dim, normalize, options)
    if not isinstance(name, str) or name not in _BUILDERS:
        unregistered = _unregistered(name)
        if unregistered is not None:
            raise unregistered
        guess = difflib.get_close_matches(str(name), MODELS, n=1)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        raise ValueError(f"unknown model {name!r}{hint}; valid: {', '.join(MODELS)}")
    return _build(name, input_shape, embedding_dim, normalize, options)


def _build(
    name: str, input_shape: Sequence[int], embedding_dim: int, normalize: bool, options: dict[str, Any]
) -> EmbeddingModel:
    if isinstance(input_shape, torch.Size):
        input_shape = tuple(input_shape)
    if not isinstance(input_shape, Sequence) or isinstance(input_shape, str) or len(input_shape) == 0:
        raise TypeError(
            f"input_shape must be a non-empty tuple of ints (per-sample shape), got {input_shape!r}"
        )
    shape = tuple(positive_int(s, "input_shape") for s in input_shape)
    embedding_dim = positive_int(embedding_dim, "embedding_dim")
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    from marginkit.models.external import build_external, is_external, split_name

    if is_external(name) and split_name(name)[0] == "onnx":
        from marginkit.models.onnx_backbone import build_onnx_backbone

        model: EmbeddingModel = build_onnx_backbone(
            split_name(name)[1], shape, embedding_dim, normalize, **options
        )
    elif is_external(name):
        model = build_external(name, shape, embedding_dim, normalize, **options)
    else:
        allowed = model_options(name)
        for key in options:
            if key not in allowed:
                guess = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {guess[0]!r}?)" if guess else ""
                raise ValueError(
                    f"unknown option {key!r} for model {name!r}{hint}; valid options: {', '.join(allowed)}"
                )
        model = _BUILDERS[name](shape, embedding_dim, normalize, **options)
    model.config = {
        "name": name, "input_shape": list(shape), "embedding_dim": embedding_dim, "normalize": normalize,
        **model.config,
    }  # fmt: skip
    return model
