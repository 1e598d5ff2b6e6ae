"""Image models of timm and torchvision as embedding backbones: ``timm:NAME`` and ``torchvision:NAME``
(and the naming of ``onnx:FILE``, an ONNX graph converted by :mod:`marginkit.models.onnx_backbone`).

The library's model, without its classifier, is the trunk (``net``); marginkit's linear
projection and L2 normalisation go on top, as for the built-in backbones. The input is adapted
inside the module, so that export and serving see the data set's own input shape:

1. grey images (1 channel) are repeated to the model's channels;
2. images are resized (bilinear) to the model's input size — that of its pretrained config, or
   ``image_size`` (a smaller size trains far faster on a CPU);
3. the result is normalised with the mean / std of the model's pretrained config: timm's
   ``timm.data.resolve_data_config`` and torchvision's ``weights.transforms()``.

Both libraries are imported only when such a model is built. timm imports torchvision, and
torchvision's compiled operators work only beside the torch build they were made for: the
project pins the pair (torch 2.14.1 with torchvision 0.29.1, ``constraints.txt``); where no
matching torchvision is installed, neither library works (the error says so). Nothing here
downloads weights: the trainer loads starting weights (``weights``, ``pretrained``;
:mod:`marginkit.train.starting`).
"""

from __future__ import annotations

import difflib
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from marginkit._lazy import MissingExtraError
from marginkit.models.base import EmbeddingModel

__all__ = [
    "LIBRARIES",
    "ExternalBackbone",
    "adapt_images",
    "canonical_name",
    "image_size_option",
    "import_library",
    "is_external",
    "split_name",
]

#: Libraries whose models ``LIBRARY:NAME`` names (``onnx:FILE``: a file, not a library's model).
LIBRARIES = ("timm", "torchvision", "onnx")
_NAME = re.compile(r"^(timm|torchvision):([A-Za-z0-9][A-Za-z0-9_.\-]{0,127})$")
INSTALL_HINT = (
    "pip install 'marginkit[vision]' with a torch that this torchvision was built for "
    "(torchvision's compiled operators load only beside their own torch build; see docs/finetune.md)"
)


def is_external(name: Any) -> bool:
    """Whether ``name`` names a library model (``timm:NAME``, ``torchvision:NAME``) or an ONNX
    file (``onnx:FILE``)."""
    return isinstance(name, str) and name.split(":", 1)[0] in LIBRARIES and ":" in name


def split_name(name: str) -> tuple[str, str]:
    """``"timm:resnet18"`` -> ``("timm", "resnet18")``, ``"onnx:r50.onnx"`` -> ``("onnx", "r50.onnx")``;
    ValueError for a malformed name."""
    if isinstance(name, str) and name.startswith("onnx:"):
        path = name[len("onnx:") :]
        if not path.strip() or "\x00" in path or len(path) > 4096:
            raise ValueError(
                f"model {name!r}: an ONNX backbone is named onnx:FILE, e.g. onnx:models/w600k_r50.onnx"
            )
        return "onnx", path
    match = _NAME.match(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(
            f"model {name!r}: a library model is named timm:NAME or torchvision:NAME "
            "(letters, digits, '._-'), e.g. timm:resnet18, torchvision:mobilenet_v3_small; "
            "an ONNX file is onnx:FILE"
        )
    return match.group(1), match.group(2)


def canonical_name(name: str) -> str:
    """``name`` checked; an ``onnx:`` file's path made absolute (a run must find it again from
    any directory)."""
    library, arch = split_name(name)
    if library == "onnx":
        return f"onnx:{Path(arch).expanduser().absolute()}"
    return name


def import_library(library: str) -> Any:
    """Import ``timm`` or ``torchvision``; a :class:`~marginkit._lazy.MissingExtraError` that says why
    and what to install."""
    try:
        if library == "timm":
            import timm
            import timm.data

            return timm
        if library in ("onnx", "onnx2torch"):  # onnx: backbones (onnx_backbone)
            import onnx
            import onnx2torch

            return onnx if library == "onnx" else onnx2torch
        import torchvision

        return torchvision
    except Exception as exc:  # torchvision raises RuntimeError when its operators do not load
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise MissingExtraError(
            f"{library} models need {library}, which cannot be imported here "
            f"({type(exc).__name__}: {first}; torch {torch.__version__}): {INSTALL_HINT}",
            extra="vision",
            module=library,
        ) from None


def _unknown(library: str, arch: str, known: Sequence[str]) -> ValueError:
    guess = difflib.get_close_matches(arch, known, n=3)
    hint = f" (did you mean {', '.join(guess)}?)" if guess else ""
    return ValueError(f"{library} has no model {arch!r}{hint}")


def _timm_net(arch: str) -> tuple[nn.Module, dict[str, Any], int, list[str]]:
    """timm's model without classifier, its data config, feature size and classifier names."""
    timm = import_library("timm")
    if not timm.is_model(arch):
        raise _unknown("timm", arch, timm.list_models())
    net = timm.create_model(arch, pretrained=False, num_classes=0)
    data = timm.data.resolve_data_config({}, model=net)
    dim = int(getattr(net, "head_hidden_size", None) or net.num_features)
    classifier = net.pretrained_cfg.get("classifier") or []
    return net, data, dim, [classifier] if isinstance(classifier, str) else list(classifier)


def _last_linear(net: nn.Module) -> tuple[str, nn.Linear]:
    found = [(name, m) for name, m in net.named_modules() if isinstance(m, nn.Linear)]
    if not found:
        raise ValueError("the torchvision model has no linear classifier to remove")
    return found[-1]


def _torchvision_net(arch: str) -> tuple[nn.Module, dict[str, Any], int, list[str]]:
    """torchvision's model with its last linear layer (the classifier) replaced by the identity."""
    tv = import_library("torchvision")
    if arch not in tv.models.list_models():
        raise _unknown("torchvision", arch, tv.models.list_models())
    net = tv.models.get_model(arch, weights=None)
    weights = tv.models.get_model_weights(arch).DEFAULT
    preset = weights.transforms()  # the preprocessing its weights were trained with
    name, linear = _last_linear(net)
    parent, _, leaf = name.rpartition(".")
    setattr(net.get_submodule(parent) if parent else net, leaf, nn.Identity())
    size = list(preset.crop_size)
    data = {"input_size": (3, size[0], size[-1]), "mean": tuple(preset.mean), "std": tuple(preset.std)}
    return net, data, int(linear.in_features), [name]


def image_size_option(value: Any, default: tuple[int, int]) -> tuple[int, int]:
    """``model_options.image_size`` (an int or ``[H, W]`` in 8..1024) as ``(H, W)``; ``default`` if None."""
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value, value]
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or not 8 <= v <= 1024 for v in value)
    ):
        raise ValueError(f"image_size must be an integer or [height, width] in 8..1024, got {value!r}")
    return int(value[0]), int(value[1])


def adapt_images(
    x: torch.Tensor, channels: int, size: tuple[int, int], mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """Images ``[B, c, h, w]`` -> ``[B, channels, H, W]``: grey repeated to ``channels``, resized
    (bilinear, no antialiasing) to ``size``, then ``(x - mean) / std`` (``[1, channels, 1, 1]``)."""
    if x.shape[1] != channels:
        x = x.expand(-1, channels, -1, -1)
    if tuple(x.shape[2:]) != tuple(size):
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return (x - mean.to(x.dtype)) / std.to(x.dtype)


class ExternalBackbone(EmbeddingModel):
    """A timm or torchvision image model as the trunk of an embedding model (module doc).

    Attributes:
        library, arch: which model (``name`` is ``"library:arch"``).
        net: the library's model without its classifier, ``[B, 3, H, W] -> [B, F]``.
        image_size: ``(H, W)`` the images are resized to; ``mean``, ``std``: buffers (per channel).
        classifier_keys: state-dict prefixes of the removed classifier (ignored in weight files).
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        embedding_dim: int,
        normalize: bool,
        *,
        library: str,
        arch: str,
        image_size: int | Sequence[int] | None = None,
    ) -> None:
        super().__init__(input_shape, embedding_dim, normalize)
        self.library, self.arch = library, arch
        self.name = f"{library}:{arch}"
        if len(self.input_shape) != 3:
            raise ValueError(
                f"{self.name} expects images, input_shape (C, H, W); got {self.input_shape} "
                "(use cnn1d for sequences, mlp for vectors)"
            )
        net, data, dim, classifier = (_timm_net if library == "timm" else _torchvision_net)(arch)
        channels, height, width = (int(v) for v in data["input_size"])
        if self.input_shape[0] not in (1, channels):
            raise ValueError(
                f"{self.name} takes {channels}-channel images (grey ones are repeated); the data have "
                f"{self.input_shape[0]} channels"
            )
        self.channels = channels
        self.image_size = image_size_option(image_size, (height, width))
        self.net = net
        self.classifier_keys = classifier
        self.register_buffer("mean", torch.tensor(data["mean"], dtype=torch.float32).view(1, -1, 1, 1), False)
        self.register_buffer("std", torch.tensor(data["std"], dtype=torch.float32).view(1, -1, 1, 1), False)
        self.projection = nn.Linear(dim, embedding_dim)
        self.config = {"image_size": list(self.image_size) if image_size is not None else None}

    def adapt(self, x: torch.Tensor) -> torch.Tensor:
        """Data-set images ``[B, C, h, w]`` in [0, 1] -> the library model's input ``[B, 3, H, W]``."""
        return adapt_images(x, self.channels, self.image_size, self.mean, self.std)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.adapt(x))

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """As :meth:`torch.nn.Module.load_state_dict`; a plain dict (a checkpoint's, without the
        per-module ``_metadata`` of ``state_dict()``) is read with this model's own module versions:
        torchvision's MNASNet refuses a state dict that does not say its version."""
        if getattr(state_dict, "_metadata", None) is None:
            state_dict = OrderedDict(state_dict)
            state_dict._metadata = getattr(self.state_dict(), "_metadata", None)  # type: ignore[attr-defined]
        return super().load_state_dict(state_dict, strict, assign)

    def trunk_modules(self) -> list[nn.Module]:
        return [self.net]

    def stage_modules(self) -> list[nn.Module]:
        """timm: the coarse groups of the model's ``group_matcher`` in order (the stem first; a
        final norm is a group of its own); torchvision: the top-level children that hold
        parameters (MobileNet / EfficientNet / ConvNeXt: each block of ``features``)."""
        if self.library == "timm":
            from timm.models import group_modules

            groups = group_modules(self.net, self.net.group_matcher(coarse=True))
            return [nn.ModuleList([self.net.get_submodule(n) for n in groups[k]]) for k in sorted(groups)]
        children = list(self.net.named_children())
        if len(children) and children[0][0] == "features" and isinstance(children[0][1], nn.Sequential):
            children = list(children[0][1].named_children()) + children[1:]
        return [m for _, m in children if any(True for _ in m.parameters())]

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's own ``set_grad_checkpointing`` (which recomputes batch-norm updates too);
        torchvision models have none."""
        if self.library != "timm":
            if enable:
                raise ValueError(
                    f"{self.name}: torchvision models offer no gradient checkpointing; "
                    "use a timm model or a built-in backbone"
                )
            return
        self.net.set_grad_checkpointing(enable)
        self.grad_checkpointing = bool(enable)


def build_external(
    name: str, input_shape: tuple[int, ...], embedding_dim: int, normalize: bool, **options: Any
) -> EmbeddingModel:
    """:class:`ExternalBackbone` for ``name`` (``timm:NAME`` / ``torchvision:NAME``); ``onnx:FILE``
    is built by :func:`marginkit.models.onnx_backbone.build_onnx_backbone` (which imports this module)."""
    library, arch = split_name(name)
    if library == "onnx":
        raise ValueError(f"model {name!r}: onnx:FILE is built by build_onnx_backbone, not build_external")
    unknown = [k for k in options if k != "image_size"]
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} for model {name!r}; valid options: image_size")
    return ExternalBackbone(input_shape, embedding_dim, normalize, library=library, arch=arch, **options)
