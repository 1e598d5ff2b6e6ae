"""What a run is built from: its device, data, model, head, loss, optimiser and learning-rate schedule.

Both the trainer and the evaluation (which rebuilds a run's model from its checkpoint) build
them here, from a :class:`~marginkit.train.config.TrainConfig` and the data facts stored in the
checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from torch import nn

from marginkit._files import _mb
from marginkit.schedules import Constant, CosineDecay, Join, LinearWarmup
from marginkit.train.config import CUSTOM_MODEL, TrainConfig
from marginkit.train.errors import ConfigError
from marginkit.train.registry import LOSSES, build_loss
from marginkit.train.small_data import MIN_VAL_PER_CLASS

__all__ = [
    "LRSchedule",
    "build_components",
    "build_optimizer",
    "data_facts",
    "for_own_model",
    "load_splits",
    "resolve_device",
    "resolve_model_name",
]


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA if available, else MPS if available, else CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; use device=cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r} requested but there are {torch.cuda.device_count()} CUDA devices")
    mps = getattr(torch.backends, "mps", None)
    if dev.type == "mps" and not (mps is not None and mps.is_available()):
        raise ConfigError(f"device {name!r} requested but MPS (Apple GPU) is not available; use device=cpu")
    return dev


def resolve_model_name(config: TrainConfig, input_shape: tuple[int, ...], data_name: str = "") -> str:
    """The backbone for ``model: auto``: ``cnn1d`` for mnist1d / ``(C, L)`` inputs, ``cnn2d``
    for ``(C, H, W)`` images, ``mlp`` for feature vectors."""
    if config.model != "auto":
        return config.model
    if len(input_shape) >= 3:
        return "cnn2d"
    if len(input_shape) == 2 or data_name == "mnist1d" or config.data == "mnist1d":
        return "cnn1d"
    return "mlp"


_SPLIT_CACHE: dict[tuple, Any] = {}


def load_splits(config: TrainConfig, *, cache: bool = False) -> Any:
    """Load the data set of ``config`` (``DatasetSplits``); ``cache`` memoises in-process
    (``compare`` trains several losses on the same data)."""
    from marginkit.data import load_dataset

    key = (
        config.data,
        config.seed,
        config.train_per_class,
        config.val_fraction,
        json.dumps(config.data_options, sort_keys=True),
    )
    if cache and key in _SPLIT_CACHE:
        return _SPLIT_CACHE[key]
    splits = load_dataset(
        config.data,
        seed=config.seed,
        train_per_class=config.train_per_class,
        val_fraction=config.val_fraction,
        min_val_per_class=MIN_VAL_PER_CLASS,
        **config.data_options,
    )
    if cache:
        _SPLIT_CACHE.clear()
        _SPLIT_CACHE[key] = splits
    return splits


def data_facts(splits: Any) -> dict[str, Any]:
    """The facts about a data set that a checkpoint needs to rebuild the model."""
    return {
        "name": str(getattr(splits, "name", "")),
        "num_classes": int(splits.num_classes),
        "input_shape": [int(s) for s in splits.input_shape],
        "open_set": bool(getattr(splits, "open_set", False)),
        # the head's (and the K-NN index's) classes; an open split's other classes are in info
        "class_names": [str(c) for c in (getattr(splits, "class_names", None) or [])][
            : int(splits.num_classes)
        ],
        "kind": str(getattr(splits, "kind", "vector")),
        "mean": getattr(splits, "mean", None),
        "std": getattr(splits, "std", None),
    }


def own_model_class(model: nn.Module) -> str:
    """``module.QualName`` of the caller's model, as a run records it."""
    return f"{type(model).__module__}.{type(model).__qualname__}"


def for_own_model(config: TrainConfig, model: nn.Module, x: torch.Tensor) -> TrainConfig:
    """``config`` for a run of the caller's ``model``: ``model: custom``, the module's class in
    ``model_options["class"]``, and the ``embedding_dim`` and ``normalize`` that its output on
    two inputs ``x`` (eval mode, no gradient) shows — the head and the exported bundle follow
    them. The module must map ``[B, *input_shape]`` to ``[B, D]``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    probe = x[:2]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(probe.to(device))
    except Exception as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"model ({own_model_class(model)}) failed on inputs of shape {list(probe.shape)}, the data "
            f"set's [B, *input_shape]: {type(exc).__name__}: {first}"
        ) from exc
    finally:
        model.train(training)
    if not (isinstance(out, torch.Tensor) and out.is_floating_point() and out.shape[:1] == probe.shape[:1]
            and out.dim() == 2):  # fmt: skip
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"model ({own_model_class(model)}) must map inputs [B, *input_shape] to floating-point "
            f"embeddings [B, D]; on inputs {list(probe.shape)} it returned {got}"
        )
    unit = bool(torch.allclose(out.float().norm(dim=1), torch.ones(len(out), device=out.device), atol=1e-4))
    return dataclasses.replace(
        config, model=CUSTOM_MODEL, model_options={"class": own_model_class(model)},
        embedding_dim=int(out.shape[1]), normalize=unit,
    ).validate()  # fmt: skip


def _own_model(config: TrainConfig, model: nn.Module | None) -> nn.Module:
    if model is None:
        cls = config.model_options["class"]
        raise ConfigError(
            f"this run trained its own model ({cls}, passed as train(config, run_dir, model=...)), which "
            "only Python can rebuild: pass a new instance of that class as model= to load_run, "
            "evaluate_run or export_model (its weights are replaced by the checkpoint's)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if config.model != CUSTOM_MODEL:
        raise ConfigError(
            f"this run trained the built-in model {config.model!r}, not one passed as model=; "
            "load it without model="
        )
    return model


def build_components(
    config: TrainConfig, facts: dict[str, Any], device: torch.device, model: nn.Module | None = None
) -> tuple[nn.Module, nn.Module | None, nn.Module]:
    """``(model, head or None, loss)`` for ``config`` on data with ``facts``; a run of the
    caller's own module (``model: custom``) takes that module as ``model``."""
    spec = LOSSES[config.loss]
    input_shape = tuple(facts["input_shape"])
    model_name = resolve_model_name(config, input_shape, facts.get("name", ""))
    options = dict(embedding_dim=config.embedding_dim, normalize=config.normalize, **config.model_options)
    if config.model == CUSTOM_MODEL or model is not None:
        if config.freeze != "none" or config.grad_checkpointing:
            raise ConfigError(
                "freeze and grad_checkpointing act on marginkit's backbones (their stages); for your own "
                "module, set requires_grad / checkpointing on it before train(..., model=module)"
            )
        model = _own_model(config, model).to(device)
    else:
        model = _built_model(config, model_name, input_shape, options, facts, device)
        if config.freeze != "none":
            model.freeze(config.freeze)
        if config.grad_checkpointing:
            model.set_grad_checkpointing(True)
    loss = build_loss(config.loss, config.loss_options, k=config.k).to(device)
    head = None
    if spec.kind == "class":
        from marginkit.heads import CosineHead

        sub_centers = getattr(loss, "sub_centers", 1)  # SubCenterArcFaceLoss's K is the head's
        head = CosineHead(facts["num_classes"], config.embedding_dim, sub_centers=sub_centers).to(device)
    return model, head, loss


def _built_model(
    config: TrainConfig, name: str, input_shape: tuple[int, ...], options: dict[str, Any],
    facts: dict[str, Any], device: torch.device,
) -> nn.Module:  # fmt: skip
    """A built-in backbone, refused before allocation when it cannot fit on ``device``."""
    from marginkit.models import build_model

    if name in ("ecapa_tdnn", "speaker_resnet34"):
        import marginkit.audio  # noqa: F401  (registers the speaker backbones with build_model)

    try:
        with torch.device("meta"):  # shapes only: what the model costs, before allocating it
            skeleton = build_model(name, input_shape, **options)
        head_size = facts["num_classes"] * config.embedding_dim if LOSSES[config.loss].kind == "class" else 0
        _check_model_fits(config, name, skeleton, head_size, device)
        return build_model(name, input_shape, **options).to(device)
    except ImportError as exc:  # timm / torchvision not installed (or not importable beside this torch)
        raise ConfigError(f"cannot build model {name!r}: {exc}") from None
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"cannot build model {name!r} for input shape {input_shape}: {first}") from None


#: Bytes of training state per parameter: the float32 weight, its gradient and the optimiser's
#: state (AdamW's two moments, SGD's momentum).
_BYTES_PER_PARAMETER = {"adamw": 16, "sgd": 12}


def _device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` (physical RAM for the CPU), or ``None`` where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "mps":
        recommended = getattr(getattr(torch, "mps", None), "recommended_max_memory", None)
        return int(recommended()) if recommended is not None else None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        return None


def _check_model_fits(
    config: TrainConfig, name: str, skeleton: nn.Module, head_size: int, device: torch.device
) -> None:
    """Refuse a model whose training state alone exceeds the device's memory (a width typo,
    ``hidden=[65536, 65536, 65536]``), before it is allocated; activations come on top."""
    n = sum(p.numel() for p in skeleton.parameters()) + head_size
    need, total = n * _BYTES_PER_PARAMETER[config.optimizer], _device_memory_bytes(device)
    if total is not None and need > total:
        raise ConfigError(
            f"model {name!r} (embedding_dim={config.embedding_dim}, model_options={config.model_options}) "
            f"has {n:,} parameters: training it needs {_mb(need)} for weights, gradients and "
            f"{config.optimizer} state, more than the {_mb(total)} of {device}; "
            "lower the widths in model_options or embedding_dim"
        )


def _decay_groups(params: list[nn.Parameter], weight_decay: float, **extra: Any) -> list[dict[str, Any]]:
    """Weight matrices and kernels with ``weight_decay``, then (if any) biases and norms without."""
    decay = [p for p in params if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in params if p.requires_grad and p.ndim <= 1]
    groups: list[dict[str, Any]] = [{"params": decay, "weight_decay": weight_decay, **extra}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, **extra})
    return groups


def _param_groups(config: TrainConfig, model: nn.Module, head: nn.Module | None) -> list[dict[str, Any]]:
    projection = getattr(model, "projection", None)
    if config.backbone_lr_mult == 1.0 or projection is None:
        groups = _decay_groups(list(model.parameters()), config.weight_decay)
    else:  # the trunk at lr · backbone_lr_mult, the projection at lr
        own = {id(p) for p in projection.parameters()}
        trunk = [p for p in model.parameters() if id(p) not in own]
        groups = [
            g
            for g in (
                *_decay_groups(trunk, config.weight_decay, lr=config.lr * config.backbone_lr_mult),
                *_decay_groups(list(projection.parameters()), config.weight_decay),
            )
            if g["params"]  # a frozen trunk has none
        ]
    if head is not None:
        groups.append(
            {"params": list(head.parameters()), "weight_decay": 0.0, "lr": config.head_lr or config.lr}
        )
    return groups


def build_optimizer(config: TrainConfig, model: nn.Module, head: nn.Module | None) -> torch.optim.Optimizer:
    """AdamW or SGD (momentum) over the model and head; no weight decay on biases, norms and centres."""
    groups = _param_groups(config, model, head)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    return torch.optim.AdamW(groups, lr=config.lr)


class LRSchedule(Join):
    r"""The learning-rate factor of step ``t`` (one per iteration): a :class:`~marginkit.schedules.Join`.

    Linear warm-up over the first ``W = warmup_steps`` steps, :math:`f(t) = (t + 1) / W`, then

    - ``cosine``: :math:`\tfrac12 (1 + \cos(\pi \min(1, (t - W) / (T - W))))` down to 0 at the
      last step ``T = total_steps`` (SGDR's annealing without restarts);
    - ``step``: :math:`\gamma^{\lfloor t / (S \cdot E) \rfloor}` with ``S = steps_per_epoch``
      and ``E = step_epochs`` (the decay counts from step 0, warm-up included);
    - ``none``: 1.
    """

    def __init__(
        self,
        kind: str,
        total_steps: int,
        warmup_steps: int,
        steps_per_epoch: int,
        step_epochs: int,
        gamma: float,
    ) -> None:
        total, warm = int(total_steps), int(warmup_steps)
        pieces: list[Any] = []
        bounds: list[int] = []
        if warm >= 1:  # f(t) = (t + 1) / W: from 1/W at step 0 to 1 at step W - 1
            pieces.append(LinearWarmup(1.0 / warm, 1.0, warm - 1) if warm > 1 else Constant(1.0))
            bounds.append(warm)
        if kind == "cosine":
            pieces.append(CosineDecay(1.0, 0.0, max(1, total - warm)))
        elif kind == "step":
            period = int(steps_per_epoch) * int(step_epochs)
            pieces.append(Constant(float(gamma) ** (warm // period)))
            for k in range(warm // period + 1, total // period + 1):
                pieces.append(Constant(float(gamma) ** k))
                bounds.append(k * period)
        else:
            pieces.append(Constant(1.0))
        super().__init__(pieces, bounds)


def lr_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> Any:
    """``LambdaLR`` stepping :class:`LRSchedule` once per iteration.

    The factor is handed over as a plain function, so ``state_dict()`` holds only the step
    counter (a callable object's attributes would be pickled into every checkpoint).
    """
    schedule = LRSchedule(
        config.scheduler,
        steps_per_epoch * config.epochs,
        round(config.warmup_epochs * steps_per_epoch),
        steps_per_epoch,
        config.step_epochs,
        config.step_gamma,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step))
