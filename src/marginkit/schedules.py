r"""Step schedules for loss hyper-parameters (margin, scale, gamma, ...).

A *schedule* is a pure function ``step -> value`` (``step = 0, 1, 2, ...``). A
:class:`HyperparameterScheduler` applies several schedules to the attributes of any object, e.g. a
loss module, once per optimiser step — the same contract as ``torch.optim.lr_scheduler``::

    loss = CircleLoss(margin=0.25, gamma=32.0)
    sched = HyperparameterScheduler(loss, {
        "gamma": LinearWarmup(32.0, 64.0, steps=1000),        # warm the scale up ...
        "margin": CosineDecay(0.4, 0.25, steps=5000),          # ... and decay the margin to its base
    })                                                          # applies the step-0 values
    for batch in loader:
        loss(model(batch.x), batch.y).backward(); optimizer.step()
        sched.step()                                            # values for the next step

``sched.state_dict()`` holds the step counter; loading it re-applies the values of that step, so
a resumed run sees exactly the values of an uninterrupted one.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "Constant",
    "CosineDecay",
    "HyperparameterScheduler",
    "Join",
    "LinearWarmup",
    "Schedule",
]


def _real(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _count(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class Schedule:
    """Base class: a pure map from a step (int ``>= 0``) to a float; subclasses define ``_value``.

    Schedules are immutable, compare equal when their parameters are equal and print as their
    constructor call.
    """

    _fields: tuple[str, ...] = ()

    def __call__(self, step: int) -> float:
        return self._value(_count(step, "step", 0))

    def _value(self, step: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _set(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(getattr(self, f) == getattr(other, f) for f in self._fields)

    def __hash__(self) -> int:
        return hash((type(self), *(getattr(self, f) for f in self._fields)))

    def __repr__(self) -> str:
        args = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)
        return f"{type(self).__name__}({args})"


class Constant(Schedule):
    """``v(step) = value``."""

    _fields = ("value",)
    value: float

    def __init__(self, value: float) -> None:
        self._set(value=_real(value, "value"))

    def _value(self, step: int) -> float:
        return self.value


class _Ramp(Schedule):
    """A move from ``start`` to ``end`` over ``steps`` steps (shape given by ``_ramp``), then ``end``."""

    _fields = ("start", "end", "steps")
    start: float
    end: float
    steps: int

    def __init__(self, start: float, end: float, steps: int) -> None:
        self._set(start=_real(start, "start"), end=_real(end, "end"), steps=_count(steps, "steps", 1))

    def _value(self, step: int) -> float:
        if step >= self.steps:
            return self.end
        return self._ramp(step)

    def _ramp(self, step: int) -> float:
        raise NotImplementedError


class LinearWarmup(_Ramp):
    r"""Linear ramp from ``start`` to ``end`` over ``steps`` steps, then ``end``.

    .. math:: v(t) = \text{start} + (\text{end} - \text{start}) \min(t / \text{steps}, 1)

    ``v(0) = start`` and ``v(t) = end`` exactly for ``t >= steps``; ``end < start`` ramps down.
    """

    def _ramp(self, step: int) -> float:
        return self.start + (self.end - self.start) * (step / self.steps)


class CosineDecay(_Ramp):
    r"""Half cosine from ``start`` to ``end`` over ``steps`` steps, then ``end``.

    .. math:: v(t) = \text{end} + \tfrac12 (\text{start} - \text{end})
              \bigl(1 + \cos(\pi \min(t / \text{steps}, 1))\bigr)

    The annealing of SGDR (Loshchilov & Hutter, ICLR 2017) without restarts. ``v(0) = start`` and
    ``v(t) = end`` exactly for ``t >= steps``; ``end > start`` rises instead.
    """

    def _ramp(self, step: int) -> float:
        return self.end + 0.5 * (self.start - self.end) * (1.0 + math.cos(math.pi * step / self.steps))


class Join(Schedule):
    """Run ``schedules[i]`` from ``boundaries[i-1]`` on, restarting its step count there.

    ``len(boundaries) == len(schedules) - 1``, boundaries strictly increasing and ``>= 1``, as in
    ``optax.join_schedules``: with ``Join([LinearWarmup(0, 1, 100), CosineDecay(1, 0, 900)], [100])``
    step 150 evaluates the cosine at its step 50.
    """

    _fields = ("schedules", "boundaries")
    schedules: tuple[Callable[[int], float], ...]
    boundaries: tuple[int, ...]

    def __init__(self, schedules: Sequence[Callable[[int], float]], boundaries: Sequence[int]) -> None:
        schedules = tuple(schedules)
        boundaries = tuple(_count(b, "boundaries", 1) for b in boundaries)
        if not schedules or not all(callable(s) for s in schedules):
            raise TypeError("schedules must be a non-empty sequence of callables step -> value")
        if len(boundaries) != len(schedules) - 1:
            raise ValueError(
                f"boundaries must have len(schedules) - 1 = {len(schedules) - 1} entries, "
                f"got {len(boundaries)}"
            )
        if any(b1 >= b2 for b1, b2 in itertools.pairwise(boundaries)):
            raise ValueError(f"boundaries must be strictly increasing, got {boundaries}")
        self._set(schedules=schedules, boundaries=boundaries)

    def _value(self, step: int) -> float:
        index = bisect.bisect_right(self.boundaries, step)
        start = self.boundaries[index - 1] if index else 0
        return _real(self.schedules[index](step - start), "schedule value")


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and torch.is_floating_point(value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numeric_attributes(target: object) -> list[str]:
    """Public attributes that could be scheduled: numbers, not parameters, not read-only."""
    names = []
    for name in dir(target):
        descriptor = getattr(type(target), name, None)
        if name.startswith("_") or (isinstance(descriptor, property) and descriptor.fset is None):
            continue
        try:
            value = getattr(target, name)
        except Exception:  # a property that fails is simply not listed
            continue
        if _is_number(value) and not isinstance(value, torch.nn.Parameter):
            names.append(name)
    return names


class HyperparameterScheduler:
    """Set attributes of ``target`` from per-attribute schedules, one call to :meth:`step` per step.

    Works with any object whose attributes are plain numbers or one-element tensors (e.g. a loss
    module's ``margin``, ``scale``, ``gamma``). Tensor attributes (buffers) are filled in place, so
    their device and dtype are kept; ``nn.Parameter`` attributes are refused (the optimiser owns
    them). Construction validates every name and immediately applies the step-0 values.

    Args:
        target: the object whose attributes are scheduled.
        schedules: ``{attribute name: schedule}``; a schedule is any callable ``step -> float``,
            e.g. :class:`LinearWarmup`, :class:`CosineDecay`, :class:`Constant`, :class:`Join`.

    Raises:
        AttributeError: ``target`` lacks an attribute (the message lists its numeric attributes).
        TypeError: the attribute is not a number, is a learnable parameter, or is read-only.
    """

    def __init__(self, target: object, schedules: Mapping[str, Callable[[int], float]]) -> None:
        if not isinstance(schedules, Mapping) or not schedules:
            raise TypeError("schedules must be a non-empty mapping {attribute name: schedule}")
        kind = type(target).__name__
        for name, schedule in schedules.items():
            if not isinstance(name, str):
                raise TypeError(f"schedules keys must be attribute names (str), got {name!r}")
            if not callable(schedule):
                raise TypeError(f"schedules[{name!r}] must be callable step -> value, got {schedule!r}")
            if not hasattr(target, name):
                available = ", ".join(_numeric_attributes(target)) or "none"
                raise AttributeError(
                    f"cannot schedule {name!r}: {kind} has no attribute {name!r}; "
                    f"numeric attributes available: {available}"
                )
            current = getattr(target, name)
            if isinstance(current, torch.nn.Parameter):
                raise TypeError(
                    f"cannot schedule {name!r}: it is a learnable nn.Parameter of {kind}; "
                    "the optimiser owns it"
                )
            if not _is_number(current):
                raise TypeError(
                    f"cannot schedule {name!r}: {kind}.{name} is a {type(current).__name__}, not a number"
                )
        self.target = target
        self.schedules = dict(schedules)
        self._step = 0
        self._apply()

    @property
    def last_step(self) -> int:
        """The step whose values are currently applied (0 after construction)."""
        return self._step

    def values(self) -> dict[str, float]:
        """The scheduled values at :attr:`last_step`."""
        return {
            name: _real(schedule(self._step), f"{name} schedule value")
            for name, schedule in self.schedules.items()
        }

    def step(self) -> dict[str, float]:
        """Advance one step, apply and return the new values."""
        self._step += 1
        return self._apply()

    def _apply(self) -> dict[str, float]:
        values = self.values()
        for name, value in values.items():
            current = getattr(self.target, name)
            if isinstance(current, torch.Tensor):
                with torch.no_grad():
                    current.fill_(value)
                continue
            try:
                setattr(self.target, name, value)
            except AttributeError as error:
                raise TypeError(
                    f"cannot schedule {name!r}: {type(self.target).__name__}.{name} is read-only ({error})"
                ) from error
        return values

    def state_dict(self) -> dict[str, Any]:
        """``{"step": int, "names": [scheduled attributes]}`` — the schedules themselves are config."""
        return {"step": self._step, "names": sorted(self.schedules)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the step counter and re-apply that step's values."""
        if "step" not in state_dict:
            raise ValueError("state_dict must contain 'step'")
        names = state_dict.get("names")
        if names is not None and sorted(names) != sorted(self.schedules):
            raise ValueError(
                f"state_dict schedules {sorted(names)} do not match this scheduler's {sorted(self.schedules)}"
            )
        self._step = _count(state_dict["step"], "state_dict['step']", 0)
        self._apply()

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {v!r}" for k, v in self.schedules.items())
        return f"HyperparameterScheduler({type(self.target).__name__}, {{{inner}}}, step={self._step})"
