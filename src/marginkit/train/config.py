"""Training configuration: one flat dataclass, YAML files, command-line overrides, validation.

Every option of ``marginkit train`` is a field of :class:`TrainConfig`. A YAML file may set
any subset of them; ``--set key=value`` (or a dedicated flag such as ``--lr``) overrides the
file. The three option dictionaries (``data_options``, ``model_options``, ``loss_options``)
are passed as keyword arguments to the data loader, the backbone and the loss; their
entries are addressed with a dotted key (``--set loss_options.scale=30``).

Unknown keys are an error that names the key and suggests the nearest valid one::

    >>> from marginkit.train.config import TrainConfig, apply_overrides
    >>> apply_overrides(TrainConfig(), {"learning_rate": 0.1})
    Traceback (most recent call last):
    ...
    marginkit.train.errors.ConfigError: unknown config key 'learning_rate' (did you mean 'lr'?)
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marginkit.train.errors import ConfigError, suggest

__all__ = [
    "MODEL_NAMES",
    "RUNTIME_KEYS",
    "ConfigError",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "parse_assignment",
    "suggest",
]

MODEL_NAMES = ("auto", "mlp", "cnn1d", "cnn2d", "resnet")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULERS = ("cosine", "step", "none")
KNN_METRICS = ("cosine", "l2")
KNN_WEIGHTS = ("uniform", "distance")
# Keys that change how a run executes but not what it computes: they may differ on --resume.
RUNTIME_KEYS = frozenset({"device", "num_threads", "eval_batch_size", "collective_timeout"})


@dataclass
class TrainConfig:
    """All options of a training run (defaults in parentheses are the field defaults).

    Data
        ``data`` — data set spec for :func:`marginkit.data.load_dataset` (``mnist1d``,
        ``digits``, ``npz:PATH``, ...); ``train_per_class`` — keep N training examples per
        class (stratified, seeded); ``val_fraction`` — share of training data held out for
        validation (model selection); ``data_options`` — extra keyword arguments.
    Model
        ``model`` — backbone name (``auto`` picks ``cnn1d`` for mnist1d, ``cnn2d`` for
        images, ``mlp`` otherwise); ``embedding_dim``; ``normalize`` — L2-normalised output;
        ``model_options`` — extra keyword arguments for the backbone.
    Loss
        ``loss`` — a name from :data:`marginkit.train.registry.LOSSES`; ``loss_options`` —
        keyword arguments overriding the registry's defaults (``scale``, ``margin``, ...).
    Optimisation
        ``epochs`` (``None``: :func:`marginkit.train.small_data.auto_epochs` of the training
        set's size), ``batch_size``, ``optimizer`` (adamw | sgd), ``lr``, ``head_lr`` (the
        class centres' learning rate, default ``lr``), ``weight_decay``, ``momentum`` (sgd),
        ``scheduler`` (cosine | step | none, stepped per iteration), ``warmup_epochs``
        (linear warm-up, may be fractional), ``step_epochs``/``step_gamma`` (step schedule),
        ``grad_clip`` (max global gradient norm, ``None`` = off), ``amp`` (``off`` | ``bf16``
        autocast | ``fp16`` autocast with ``torch.amp.GradScaler``; ``true`` means ``bf16``),
        ``precise_bn`` — after every epoch, recompute batch-norm running statistics as exact
        averages over up to this many training samples (0 = off): with short budgets the
        exponential running averages lag the weights and eval-mode embeddings collapse.
    Pair losses
        ``samples_per_class`` (P×K sampler's K) and ``classes_per_batch`` (P; default
        ``batch_size // samples_per_class``).
    Evaluation
        ``k`` — neighbours of the K-NN classifier; ``eval_every`` — validate (and consider
        for ``best.pt``) every N epochs and after the last; ``knn_metric`` (cosine | l2);
        ``knn_weights`` (uniform | distance);
        ``max_impostors`` — cap on impostor pairs for verification metrics.
    Runtime
        ``seed``, ``device`` (cpu | cuda | auto), ``num_threads`` (default: the available cores
        divided by the processes sharing them), ``deterministic``
        (``torch.use_deterministic_algorithms``), ``eval_batch_size``, ``collective_timeout``
        (seconds a data-parallel rank waits for its peers before the run ends with an error;
        must exceed the longest validation or evaluation, which rank 0 runs alone).
    """

    data: str = "mnist1d"
    model: str = "auto"
    loss: str = "softmax"
    seed: int = 0
    train_per_class: int | None = None
    val_fraction: float = 0.1
    data_options: dict[str, Any] = field(default_factory=dict)
    embedding_dim: int = 64
    normalize: bool = True
    model_options: dict[str, Any] = field(default_factory=dict)
    loss_options: dict[str, Any] = field(default_factory=dict)
    epochs: int | None = None
    batch_size: int = 128
    optimizer: str = "adamw"
    lr: float = 2e-3
    head_lr: float | None = None
    weight_decay: float = 5e-4
    momentum: float = 0.9
    scheduler: str = "cosine"
    warmup_epochs: float = 0.0
    step_epochs: int = 10
    step_gamma: float = 0.1
    grad_clip: float | None = None
    amp: str = "off"
    precise_bn: int = 4096
    samples_per_class: int = 10
    classes_per_batch: int | None = None
    k: int = 5
    eval_every: int = 1
    knn_metric: str = "cosine"
    knn_weights: str = "uniform"
    max_impostors: int | None = 200_000
    device: str = "cpu"
    num_threads: int | None = None
    deterministic: bool = True
    eval_batch_size: int = 1024
    collective_timeout: float = 600.0

    # ------------------------------------------------------------------ helpers
    @classmethod
    def keys(cls) -> list[str]:
        """All valid top-level keys, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (deep copy)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def to_json(self) -> str:
        """Canonical JSON string (sorted keys): stored in checkpoints."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        """Inverse of :meth:`to_json`; validates."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"stored config is not valid JSON: {exc}") from None
        return config_from_dict(raw)

    def to_yaml(self) -> str:
        """The config as YAML (every key), e.g. to write ``RUN_DIR/config.yaml``."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def validate(self) -> TrainConfig:
        """Check every value's type and range; raise :class:`ConfigError` naming the key."""
        self.amp = amp_mode(self.amp)
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), _field_types()[f.name]))
        if not self.data or not isinstance(self.data, str):
            raise ConfigError("data must be a non-empty data set spec such as 'mnist1d' or 'npz:PATH'")
        _choice(self.model, "model", MODEL_NAMES)
        from marginkit.train.registry import LOSSES, check_loss_options

        _choice(self.loss, "loss", tuple(LOSSES))
        check_loss_options(self.loss, self.loss_options)
        _choice(self.optimizer, "optimizer", OPTIMIZERS)
        _choice(self.scheduler, "scheduler", SCHEDULERS)
        _choice(self.knn_metric, "knn_metric", KNN_METRICS)
        _choice(self.knn_weights, "knn_weights", KNN_WEIGHTS)
        for name in (
            "batch_size",
            "embedding_dim",
            "k",
            "samples_per_class",
            "step_epochs",
            "eval_every",
        ):
            _at_least(getattr(self, name), name, 1)
        _at_least(self.seed, "seed", 0)
        for name in ("epochs", "train_per_class", "classes_per_batch", "max_impostors", "num_threads"):
            if getattr(self, name) is not None:
                _at_least(getattr(self, name), name, 1)
        _at_least(self.eval_batch_size, "eval_batch_size", 1)
        _at_least(self.precise_bn, "precise_bn", 0)
        if LOSSES[self.loss].norms and self.normalize:
            raise ConfigError(
                f"loss {self.loss!r} adapts its margin to the embedding norms, which normalize: true makes "
                "all 1: set normalize: false (--set normalize=false)"
            )
        if self.samples_per_class < 2 and LOSSES[self.loss].kind == "pair":
            raise ConfigError("samples_per_class must be >= 2 for pair losses (each anchor needs a positive)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        for name in ("lr",):
            if not self.lr > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.head_lr is not None and not self.head_lr > 0:
            raise ConfigError(f"head_lr must be > 0 or null, got {self.head_lr}")
        for name in ("weight_decay", "momentum", "warmup_epochs"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.step_gamma <= 1:
            raise ConfigError(f"step_gamma must be in (0, 1], got {self.step_gamma}")
        if not self.collective_timeout > 0:
            raise ConfigError(f"collective_timeout must be > 0 seconds, got {self.collective_timeout}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"grad_clip must be > 0 or null, got {self.grad_clip}")
        if self.epochs is not None and self.warmup_epochs > self.epochs:
            raise ConfigError(f"warmup_epochs ({self.warmup_epochs}) must not exceed epochs ({self.epochs})")
        dev = self.device
        if not (dev in ("cpu", "auto", "cuda", "mps") or dev.startswith("cuda:")):
            raise ConfigError(f"device must be 'cpu', 'cuda', 'cuda:N', 'mps' or 'auto', got {dev!r}")
        return self


# ---------------------------------------------------------------------- typing
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _choice(value: Any, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = suggest(str(value), choices)
        raise ConfigError(
            f"unknown {name} {value!r}{hint}; valid: {', '.join(choices)}"
            if hint
            else f"unknown {name} {value!r}; valid: {', '.join(choices)}"
        )


def _at_least(value: int, name: str, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Convert ``value`` to the field type ``tp`` (from YAML or a command-line string)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "~", "")):
            return None
        return _coerce(name, value, inner[0])
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name} must be a mapping of options, got {type(value).__name__}")
        return {str(k): v for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("false", "no", "off", "0"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value.strip())
            except ValueError:
                raise ConfigError(f"{name} must be a number, got {value!r}") from None
        else:
            raise ConfigError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(out):
            raise ConfigError(f"{name} must be finite, got {value!r}")
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


#: ``amp`` values: no autocast, bfloat16 autocast, float16 autocast with a gradient scaler.
AMP_MODES = ("off", "bf16", "fp16")
_AMP_ALIASES = {"true": "bf16", "on": "bf16", "yes": "bf16", "1": "bf16", "bfloat16": "bf16", "false": "off",
                "no": "off", "0": "off", "none": "off", "float16": "fp16", "half": "fp16"}  # fmt: skip


def amp_mode(value: Any) -> str:
    """``amp`` as one of :data:`AMP_MODES` (``True``, from older configs and checkpoints, is ``bf16``)."""
    if isinstance(value, bool) or value is None:
        return "bf16" if value else "off"
    if isinstance(value, str):
        key = value.strip().lower()
        mode = _AMP_ALIASES.get(key, key)
        if mode in AMP_MODES:
            return mode
    raise ConfigError(f"amp must be one of {', '.join(AMP_MODES)} (or true/false), got {value!r}")


def _unknown_key(key: str, valid: Iterable[str], where: str = "config key") -> ConfigError:
    return ConfigError(f"unknown {where} {key!r}{suggest(key, valid)}")


# ---------------------------------------------------------------------- building
_DICT_KEYS = ("data_options", "model_options", "loss_options")


def apply_overrides(
    config: TrainConfig, overrides: Mapping[str, Any] | Iterable[tuple[str, Any]]
) -> TrainConfig:
    """Return a copy of ``config`` with ``overrides`` applied, then validated.

    Keys are field names (``-`` and ``_`` interchangeable) or dotted keys into the option
    dictionaries (``loss_options.scale``). A mapping value for an option dictionary is
    merged into it. Values may be strings (from the command line): they are converted to
    the field's type. ``overrides`` may also be a sequence of ``(key, value)`` pairs, applied
    in order (a YAML file's keys, then the command line's).
    """
    raw = config.to_dict()
    valid = TrainConfig.keys()
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    for key, value in items:
        key = str(key).replace("-", "_") if "." not in str(key) else str(key)
        if "." in key:
            head, _, sub = key.partition(".")
            head = head.replace("-", "_")
            if head not in _DICT_KEYS:
                if head in valid:
                    raise ConfigError(f"config key {head!r} is not a mapping; set it as {head}=VALUE")
                raise _unknown_key(head, valid)
            if not sub:
                raise ConfigError(f"empty option name in {key!r}")
            raw[head] = dict(raw[head])
            raw[head][sub] = _parse_scalar(value) if isinstance(value, str) else value
            continue
        if key not in valid:
            raise _unknown_key(key, valid)
        if key in _DICT_KEYS and isinstance(value, Mapping):
            merged = dict(raw[key])
            merged.update({str(k): v for k, v in value.items()})
            raw[key] = merged
        elif key in _DICT_KEYS and isinstance(value, str):
            parsed = _parse_scalar(value)
            if not isinstance(parsed, Mapping):
                raise ConfigError(f"{key} must be a mapping such as {{scale: 30}}, got {value!r}")
            raw[key] = {**raw[key], **parsed}
        else:
            raw[key] = value
    return config_from_dict(raw)


def config_from_dict(raw: Mapping[str, Any]) -> TrainConfig:
    """Build and validate a :class:`TrainConfig` from a mapping; unknown keys are errors."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping of keys to values, got {type(raw).__name__}")
    valid = TrainConfig.keys()
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        norm = str(key).replace("-", "_")
        if norm not in valid:
            raise _unknown_key(str(key), valid)
        kwargs[norm] = value
    cfg = TrainConfig(**kwargs)
    return cfg.validate()


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a mapping (validated later, after overrides)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {first}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text") from None
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, got {type(raw).__name__}")
    valid = TrainConfig.keys()
    for key in raw:
        if str(key).replace("-", "_") not in valid:
            raise ConfigError(f"{path.name}: unknown config key {str(key)!r}{suggest(str(key), valid)}")
    return dict(raw)


def _parse_scalar(text: str) -> Any:
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    # YAML 1.1 reads "1e-3" as a string; the field coercion handles it for typed fields,
    # for option dictionaries convert here.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def parse_assignment(text: str) -> tuple[str, Any]:
    """Parse ``key=value`` from ``--set``; the value is read as YAML (``1e-3`` as a number)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    return key, _parse_scalar(value.strip())
