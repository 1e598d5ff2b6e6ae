"""The base of every embedding backbone: :class:`EmbeddingModel`, and what fine-tuning needs of it
(stages to freeze, frozen modules kept in eval mode, stages run under gradient checkpointing)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EmbeddingModel", "frozen_modules", "is_frozen", "run_stages"]


def is_frozen(module: nn.Module) -> bool:
    """Whether ``module`` belongs to a part of a model that :meth:`EmbeddingModel.freeze` froze."""
    return bool(getattr(module, "_marginkit_frozen", False))


def frozen_modules(model: EmbeddingModel, spec: str | int) -> list[nn.Module]:
    """The modules ``freeze: spec`` stops training (see :meth:`EmbeddingModel.freeze`)."""
    if isinstance(spec, str) and spec.strip().isdigit():
        spec = int(spec)
    if spec in ("none", 0):
        return []
    if spec == "trunk":
        return model.trunk_modules()
    if isinstance(spec, int) and not isinstance(spec, bool) and spec > 0:
        stages = model.stage_modules()
        if spec > len(stages):
            raise ValueError(
                f"freeze={spec} asks for more stages than model {model.name!r} has ({len(stages)}); "
                f"use 1..{len(stages)} or 'trunk'"
            )
        return stages[:spec]
    raise ValueError(f"freeze must be 'none', 'trunk' or a number of stages >= 1, got {spec!r}")


@contextlib.contextmanager
def _batchnorm_kept(module: nn.Module) -> Iterator[None]:
    """Restore the batch-norm buffers of ``module`` on exit: a checkpointed stage's recomputation
    must not count its batch twice in the running statistics."""
    saved = [
        (m, [b.clone() for b in m.buffers(recurse=False)])
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in saved:
                for b, old in zip(m.buffers(recurse=False), buffers, strict=True):
                    b.copy_(old)


def run_stages(stages: Sequence[nn.Module], x: torch.Tensor, checkpointing: bool) -> torch.Tensor:
    """``x`` through ``stages`` in order, each under ``torch.utils.checkpoint`` when ``checkpointing``."""
    if not checkpointing:
        for stage in stages:
            x = stage(x)
        return x
    from torch.utils.checkpoint import checkpoint

    for stage in stages:
        x = checkpoint(
            stage, x, use_reentrant=False,
            context_fn=lambda stage=stage: (contextlib.nullcontext(), _batchnorm_kept(stage)),
        )  # fmt: skip
    return x


class EmbeddingModel(nn.Module):
    """Base class: shape check, trunk features, linear projection, optional L2 normalisation.

    Attributes:
        name: backbone name (a key of :data:`MODELS`).
        input_shape: the per-sample input shape the model was built for.
        embedding_dim: output size.
        normalize: whether outputs are L2-normalised.
        config: keyword arguments that rebuild the same architecture with :func:`build_model`.
    """

    name = ""

    def __init__(self, input_shape: tuple[int, ...], embedding_dim: int, normalize: bool) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.embedding_dim = embedding_dim
        self.normalize = normalize
        self.config: dict[str, Any] = {}

    def features(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------------ fine-tuning
    def stage_modules(self) -> list[nn.Module]:
        """The trunk's stages in forward order (what ``freeze: N`` counts; the stem, if any, first)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def trunk_modules(self) -> list[nn.Module]:
        """Every direct submodule but the projection: what ``freeze: trunk`` and ``weights`` cover."""
        return [m for name, m in self.named_children() if name != "projection"]

    def freeze(self, spec: str | int) -> None:
        """Stop training part of the trunk: ``"none"``, ``"trunk"`` (all but the projection) or
        ``N`` (the first ``N`` of :meth:`stage_modules`).

        Frozen parameters get ``requires_grad=False`` (the optimiser leaves them out) and frozen
        modules stay in eval mode when the model trains, so their batch-norm statistics are kept
        too (:func:`is_frozen` tells; precise-BN recalibration skips them).
        """
        modules = frozen_modules(self, spec)
        for module in modules:
            for sub in module.modules():
                sub._marginkit_frozen = True
                for p in sub.parameters(recurse=False):
                    p.requires_grad_(False)
        self.train(self.training)

    def train(self, mode: bool = True) -> EmbeddingModel:
        super().train(mode)
        if mode:
            for m in self.modules():
                if is_frozen(m):
                    m.eval()
        return self

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each stage's activations in the backward pass instead of storing them
        (``torch.utils.checkpoint``, non-reentrant): less memory, one more forward per step.
        The gradients are those of the plain forward; batch-norm running statistics are updated
        once per step, as without it (the recomputation restores them)."""
        self.grad_checkpointing = bool(enable)

    def _checkpointing(self) -> bool:
        return getattr(self, "grad_checkpointing", False) and self.training and torch.is_grad_enabled()

    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not torch.is_floating_point(x):
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        if tuple(x.shape[1:]) != self.input_shape or x.dim() != len(self.input_shape) + 1:
            raise ValueError(
                f"{self.name} model expects x of shape [B, {', '.join(map(str, self.input_shape))}], "
                f"got {list(x.shape)}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, *input_shape]`` -> ``[B, embedding_dim]`` (unit rows when ``normalize``)."""
        self.check_input(x)
        z = self.projection(self.features(x))
        if self.normalize:
            z = F.normalize(z.float() if z.dtype in (torch.float16, torch.bfloat16) else z, dim=1).to(z.dtype)
        return z

    def extra_repr(self) -> str:
        return (
            f"input_shape={self.input_shape}, embedding_dim={self.embedding_dim}, normalize={self.normalize}"
        )
