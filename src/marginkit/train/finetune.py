"""Fine-tuning options of a run: their checks, and the large-margin phase as a margin schedule.

``large_margin`` is wespeaker's large-margin fine-tuning (Thienpondt, Desplanques & Demuynck,
"The IDLAB VoxSRC-20 submission", 2020; wespeaker's ``*_lm.yaml`` recipes), written as one
schedule of the loss's ``margin`` inside the run instead of a second training stage: the margin
keeps its value for the first ``epochs - L`` epochs, rises linearly over ``ramp_epochs`` and
holds ``margin`` for the rest of the last ``L`` epochs (``L = large_margin.epochs``)::

    margin(t) = m0                                         t < T - L·S
              = m0 + (m1 - m0) · (t - (T - L·S)) / (R·S)   during the ramp (R = ramp_epochs)
              = m1                                         after it

with ``t`` the optimiser step, ``S`` steps per epoch and ``T = epochs · S``. The schedule is a
:class:`~marginkit.schedules.Join` applied by a :class:`~marginkit.schedules.HyperparameterScheduler`
whose step is the run's global step, so a resumed run applies the same margins.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from torch import nn

from marginkit.train.errors import ConfigError, suggest

__all__ = [
    "FREEZE_HELP",
    "LARGE_MARGIN_KEYS",
    "TRACKING_KEYS",
    "check_finetune",
    "check_large_margin",
    "check_tracking",
    "large_margin_scheduler",
    "margin_target",
]

FREEZE_HELP = "'none', 'trunk' or a number of leading stages N >= 1"
LARGE_MARGIN_KEYS = ("margin", "epochs", "ramp_epochs")
TRACKING_KEYS = ("tensorboard", "mlflow", "experiment", "run_name")


def _builtin(model: str) -> bool:
    return ":" not in model


def check_finetune(config: Any) -> str:
    """Check ``weights``, ``pretrained``, ``init_from`` and ``freeze`` together; returns the
    canonical ``freeze`` (``"none"``, ``"trunk"`` or ``"N"``). Files are looked at when the run
    starts, not here: a stored config stays valid when its starting weights are gone."""
    freeze = str(config.freeze).strip().lower()
    if freeze.isdigit() and int(freeze) >= 1:
        freeze = str(int(freeze))
    elif freeze not in ("none", "trunk"):
        raise ConfigError(f"freeze must be {FREEZE_HELP}, got {config.freeze!r}")
    for key in ("weights", "init_from"):
        value = getattr(config, key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{key} must be a path, got {value!r}")
    if config.init_from is not None and (config.weights is not None or config.pretrained):
        raise ConfigError(
            "init_from starts the trunk and projection from a run; drop weights / pretrained "
            "(they would start the same trunk twice)"
        )
    if config.pretrained and config.weights is not None:
        raise ConfigError("give either pretrained: true (the library's weights) or weights: PATH, not both")
    if config.pretrained and str(config.model).startswith("onnx:"):
        raise ConfigError(
            "pretrained: true takes a timm / torchvision model's published weights; an onnx: backbone "
            "starts from the file's own weights already: drop pretrained"
        )
    if config.pretrained and _builtin(config.model):
        raise ConfigError(
            f"pretrained: true takes the weights of a timm / torchvision model; model {config.model!r} "
            "is built in and has none: use weights: PATH (a state dict, .safetensors file or run "
            "directory) or init_from: RUN"
        )
    return freeze


def margin_target(loss: nn.Module) -> nn.Module | None:
    """The module whose numeric ``margin`` attribute the loss reads (the loss, or the loss an
    adapter wraps), or ``None``."""
    for module in (loss, getattr(loss, "loss", None)):
        value = getattr(module, "margin", None) if module is not None else None
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return module
    return None


def check_large_margin(
    value: Any, loss: str, loss_options: Mapping[str, Any], epochs: int | None
) -> dict[str, Any]:
    """``large_margin`` checked and completed (``ramp_epochs`` 0); ``{}`` means off."""
    if not value:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"large_margin must be a mapping such as {{margin: 0.5, epochs: 2}}, got {value!r}")
    for key in value:
        if key not in LARGE_MARGIN_KEYS:
            raise ValueError(
                f"unknown large_margin key {key!r}{suggest(str(key), LARGE_MARGIN_KEYS)}; "
                f"valid: {', '.join(LARGE_MARGIN_KEYS)}"
            )
    for key in ("margin", "epochs"):
        if key not in value:
            raise ValueError(f"large_margin needs {key} (e.g. {{margin: 0.5, epochs: 2}})")
    from marginkit.train.ranges import Interval, check_value, loss_option_ranges
    from marginkit.train.registry import build_loss

    built = build_loss(loss, loss_options)
    if margin_target(built) is None:
        raise ValueError(f"large_margin raises the loss's margin; loss {loss!r} has no margin option")
    margin_range = loss_option_ranges(loss).get("margin", Interval(0, 1e3))
    out = {
        "margin": float(check_value(value["margin"], margin_range, "large_margin.margin")),
        "epochs": check_value(value["epochs"], Interval(1, 100_000, integer=True), "large_margin.epochs"),
        "ramp_epochs": check_value(
            value.get("ramp_epochs", 0), Interval(0, 100_000, integer=True), "large_margin.ramp_epochs"
        ),
    }
    if out["ramp_epochs"] > out["epochs"]:
        raise ValueError(
            f"large_margin.ramp_epochs ({out['ramp_epochs']}) must not exceed large_margin.epochs "
            f"({out['epochs']}): the ramp is part of the last phase"
        )
    if epochs is not None and out["epochs"] > epochs:
        raise ValueError(f"large_margin.epochs ({out['epochs']}) must not exceed epochs ({epochs})")
    return out


def large_margin_scheduler(config: Any, loss: nn.Module, steps_per_epoch: int) -> Any:
    """The run's margin scheduler (module doc), at step 0; ``None`` without ``large_margin``."""
    if not config.large_margin:
        return None
    from marginkit.schedules import Constant, HyperparameterScheduler, Join, LinearWarmup

    target = margin_target(loss)
    if target is None:  # checked with the config; a loss built otherwise
        raise ConfigError(f"loss {config.loss!r} has no margin for large_margin to raise")
    base, top = float(target.margin), float(config.large_margin["margin"])
    start = (config.epochs - config.large_margin["epochs"]) * steps_per_epoch
    ramp = config.large_margin["ramp_epochs"] * steps_per_epoch
    phase: Any = LinearWarmup(base, top, ramp) if ramp > 0 else Constant(top)
    schedule = Join([Constant(base), phase], [start]) if start > 0 else phase
    return HyperparameterScheduler(target, {"margin": schedule})


def check_tracking(value: Any) -> dict[str, Any]:
    """``tracking`` checked: ``tensorboard`` (true or a directory), ``mlflow`` (true or a
    tracking URI), ``experiment`` and ``run_name`` (names); false or empty entries dropped."""
    if not value:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"tracking must be a mapping such as {{tensorboard: true}}, got {value!r}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key not in TRACKING_KEYS:
            raise ConfigError(
                f"unknown tracking key {key!r}{suggest(str(key), TRACKING_KEYS)}; "
                f"valid: {', '.join(TRACKING_KEYS)}"
            )
        if item is None or item is False or item == "":
            continue
        if key in ("tensorboard", "mlflow") and not (item is True or isinstance(item, str)):
            where = "a directory" if key == "tensorboard" else "a tracking URI"
            raise ConfigError(f"tracking.{key} must be true or {where}, got {item!r}")
        if key in ("experiment", "run_name") and not isinstance(item, str):
            raise ConfigError(f"tracking.{key} must be a name, got {item!r}")
        out[key] = item
    return out
