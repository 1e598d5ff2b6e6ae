"""The one table of admissible values: every :class:`~marginkit.train.config.TrainConfig` field,
every backbone option and every loss option, checked before a run starts.

Defaults live elsewhere (the dataclass fields, the loss registry); this module only says what
is *sensible*, so that a typo in magnitude (``epochs=1e10``, ``loss.scale=1e30``,
``channels=[100000]``) is refused at once, with the same one-line error as an unknown key,
instead of hanging, training nonsense or allocating hundreds of GB. The bounds are generous:
each is far beyond any value that trains a useful model on one machine.

    >>> check_value(0.5, FIELD_RANGES["momentum"], "momentum")
    0.5
    >>> check_value(10**10, FIELD_RANGES["epochs"], "epochs")
    Traceback (most recent call last):
    ...
    ValueError: epochs must be <= 100000, got 10000000000
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEVICE_PATTERN",
    "FIELD_RANGES",
    "LOSS_OPTION_RANGES",
    "MODEL_OPTION_RANGES",
    "IntList",
    "Interval",
    "TopK",
    "check_value",
    "loss_option_ranges",
]


@dataclass(frozen=True)
class Interval:
    """Numbers in ``[lo, hi]``; ``open_lo``/``open_hi`` exclude an end; ``integer`` admits ints only."""

    lo: float
    hi: float
    integer: bool = False
    open_lo: bool = False
    open_hi: bool = False
    unit: str = ""  # said after the bounds ("seconds")

    def describe(self) -> str:
        left, right = "(" if self.open_lo else "[", ")" if self.open_hi else "]"
        what = "an integer" if self.integer else "a number"
        unit = f" {self.unit}" if self.unit else ""
        return f"{what} in {left}{_fmt(self.lo, self.integer)}, {_fmt(self.hi, self.integer)}{right}{unit}"

    def admits(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.lo if self.open_lo else value >= self.lo
        below = value < self.hi if self.open_hi else value <= self.hi
        return above and below


@dataclass(frozen=True)
class IntList:
    """A non-empty list of at most ``max_len`` integers, each in ``item`` (backbone widths)."""

    item: Interval
    max_len: int

    def describe(self) -> str:
        return (
            f"a list of 1 to {self.max_len} integers, each {self.item.describe().removeprefix('an integer ')}"
        )

    def admits(self, value: Any) -> bool:
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= self.max_len:
            return False
        return all(self.item.admits(v) for v in value)


@dataclass(frozen=True)
class TopK:
    """``null``, a number of classes in ``[1, 10**7]`` or a fraction in ``(0, 1]``."""

    def describe(self) -> str:
        return "null, an integer in [1, 10000000] or a fraction in (0, 1]"

    def admits(self, value: Any) -> bool:
        if value is None:
            return True
        if isinstance(value, int) and not isinstance(value, bool):
            return 1 <= value <= 10**7
        return Interval(0, 1, open_lo=True).admits(value)


Spec = Interval | IntList | TopK


def _int(lo: int, hi: int) -> Interval:
    return Interval(lo, hi, integer=True)


def _real(lo: float, hi: float, *, open_lo: bool = False, open_hi: bool = False, unit: str = "") -> Interval:
    return Interval(lo, hi, open_lo=open_lo, open_hi=open_hi, unit=unit)


#: Numeric fields of TrainConfig (``None`` is admitted separately where the field is optional).
FIELD_RANGES: dict[str, Spec] = {
    "seed": _int(0, 2**63 - 1),
    "train_per_class": _int(1, 10**9),
    "val_fraction": _real(0, 1, open_hi=True),
    "embedding_dim": _int(1, 65_536),
    "epochs": _int(1, 100_000),
    "batch_size": _int(1, 1_000_000),
    "lr": _real(0, 10, open_lo=True),
    "head_lr": _real(0, 10, open_lo=True),
    "weight_decay": _real(0, 10),
    "momentum": _real(0, 1, open_hi=True),
    "warmup_epochs": _real(0, 100_000),
    "step_epochs": _int(1, 100_000),
    "step_gamma": _real(0, 1, open_lo=True),
    "grad_clip": _real(0, 1e6, open_lo=True),
    "precise_bn": _int(0, 10**8),
    "samples_per_class": _int(1, 10_000),
    "classes_per_batch": _int(1, 1_000_000),
    "k": _int(1, 10_000),
    "eval_every": _int(1, 100_000),
    "checkpoint_every": _int(1, 100_000),
    "max_impostors": _int(1, 10**8),  # impostor scores are held in memory (8 bytes each)
    "num_threads": _int(1, 1024),
    "eval_batch_size": _int(1, 10**7),
    "workers": _int(0, 256),
    "sync_every": _int(1, 10**6),
    "trials_top_k": _int(1, 10**6),  # cohort scores kept by AS-norm (at most the cohort's size)
    "collective_timeout": _real(0, 7 * 86_400, open_lo=True, unit="seconds"),  # a stalled peer ends the run
    "backbone_lr_mult": _real(0, 100),  # 0: the trunk does not move (as freeze: trunk, but in the optimiser)
}

#: ``cpu``, ``auto``, ``mps``, ``cuda`` or ``cuda:N`` (availability is checked when the run starts).
DEVICE_PATTERN = re.compile(r"cpu|auto|mps|cuda(:[0-9]{1,4})?")

#: Backbone options (``model_options``), whichever backbone takes them.
MODEL_OPTION_RANGES: dict[str, Spec] = {
    "hidden": IntList(_int(1, 65_536), 64),
    "channels": IntList(_int(1, 4096), 16),
    "blocks": IntList(_int(1, 64), 16),
    "width": _int(1, 1024),
    "kernel_size": _int(1, 1025),
    "convs_per_stage": _int(1, 64),
    "dropout": _real(0, 1, open_hi=True),
    "image_size": IntList(_int(8, 1024), 2),  # timm / torchvision: the size images are resized to
}

_COSINE_MARGIN = _real(0, 1)  # subtracted from a cosine (CosFace, Q-Margin) or Circle's relaxation
#: Loss options: ``"*"`` for every loss taking the option, then per-loss bounds of the margin,
#: whose unit differs by family (a cosine, an angle, a score gap, a distance).
LOSS_OPTION_RANGES: dict[str, dict[str, Spec]] = {
    "*": {
        "scale": _real(0, 1e3, open_lo=True),
        "alpha": _real(1, 100, open_lo=True),
        "gamma": _real(0, 1e4, open_lo=True),
        "k": _int(1, 10_000),
        "topk": TopK(),
    },
    "cosface": {"margin": _COSINE_MARGIN},
    "qmargin": {"margin": _COSINE_MARGIN},
    "circle": {"margin": _COSINE_MARGIN},
    "class_circle": {"margin": _COSINE_MARGIN},
    "arcface": {"margin": _real(0, math.pi / 2)},  # an angle in radians
    "mep": {"margin": _real(0, 2e3, open_lo=True)},  # a gap between scaled cosines (|s c| <= 1e3)
    "triplet": {"margin": _real(0, 1e3)},  # a (squared) distance
    "local_triplet": {"margin": _real(0, 1e3)},
    "smooth_triplet": {"margin": _real(0, 1e3)},
    # cos(m1 θ + m2) - m3: m1 a factor on the angle, m2 an angle (radians), m3 a cosine offset
    "combined_margin": {"m1": _real(0, 2, open_lo=True), "m2": _real(0, math.pi / 2), "m3": _COSINE_MARGIN},
    "subcenter_arcface": {"margin": _real(0, math.pi / 2), "sub_centers": _int(1, 100)},
    "adaface": {
        "margin": _real(0, math.pi / 2),
        "h": _real(0, 1, open_lo=True),  # the share of the norm distribution the margin spans
        "t_alpha": _real(0, 1),  # momentum of the norm statistics
        "eps": _real(0, 1, open_lo=True),
    },
    "proxy_anchor": {"margin": _COSINE_MARGIN},
    # alpha, beta scale a cosine gap (as `scale` does); base and epsilon are cosines
    "multi_similarity": {
        "alpha": _real(0, 1e3, open_lo=True),
        "beta": _real(0, 1e3, open_lo=True),
        "base": _real(-1, 1),
        "epsilon": _real(0, 2),
    },
    "supcon": {"temperature": _real(1e-3, 100)},  # cosines / temperature: |scale| <= 1e3, as `scale`
    "ntxent": {"temperature": _real(1e-3, 100)},
    "contrastive": {"pos_margin": _real(0, 1e3), "neg_margin": _real(0, 1e3)},
}


def loss_option_ranges(loss: str) -> dict[str, Spec]:
    """The ranges of ``loss``'s numeric options (the common ones, then its own)."""
    return {**LOSS_OPTION_RANGES["*"], **LOSS_OPTION_RANGES.get(loss, {})}


def check_value(value: Any, spec: Spec, name: str) -> Any:
    """Return ``value`` if ``spec`` admits it, else raise ``ValueError`` naming ``name`` and the range.

    A number of the right kind outside an :class:`Interval` is told the bound it crosses
    (``epochs must be <= 100000, got 10000000000``); anything else, the whole range.
    """
    if spec.admits(value):
        return value
    right_kind = isinstance(value, int) or not getattr(spec, "integer", True)
    if isinstance(spec, Interval) and _number(value) and right_kind:
        if value <= spec.lo if spec.open_lo else value < spec.lo:
            bound = f"{'>' if spec.open_lo else '>='} {_fmt(spec.lo, spec.integer)}"
        else:
            bound = f"{'<' if spec.open_hi else '<='} {_fmt(spec.hi, spec.integer)}"
        unit = f" {spec.unit}" if spec.unit else ""
        raise ValueError(f"{name} must be {bound}{unit}, got {value!r}")
    raise ValueError(f"{name} must be {spec.describe()}, got {value!r}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fmt(v: float, integer: bool) -> str:
    return str(int(v)) if integer or (float(v).is_integer() and abs(v) < 1e15) else f"{v:g}"
