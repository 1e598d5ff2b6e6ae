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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marginkit.data.augment import augment_options
from marginkit.train.errors import ConfigError, suggest
from marginkit.train.ranges import (
    DEVICE_PATTERN,
    FIELD_RANGES,
    MODEL_OPTION_RANGES,
    check_value,
    loss_option_ranges,
)

__all__ = [
    "CUSTOM_MODEL",
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

#: ``ecapa_tdnn`` and ``speaker_resnet34`` are the speaker backbones of :mod:`marginkit.audio`
#: (waveform crops in, the Kaldi fbank inside the model).
MODEL_NAMES = ("auto", "mlp", "cnn1d", "cnn2d", "resnet", "ecapa_tdnn", "speaker_resnet34")
#: ``model`` of a run that trained the caller's own module (``train(config, run_dir, model=module)``);
#: ``model_options["class"]`` names its class. Only Python can rebuild it (``model=`` again).
CUSTOM_MODEL = "custom"
OPTIMIZERS = ("adamw", "sgd")
SCHEDULERS = ("cosine", "step", "none")
KNN_METRICS = ("cosine", "l2")
KNN_WEIGHTS = ("uniform", "distance")
SELECTIONS = ("auto", "knn_accuracy", "precision_at_1", "eer")
# Keys that change how a run executes but not what it computes: they may differ on --resume.
RUNTIME_KEYS = frozenset(
    {"device", "num_threads", "eval_batch_size", "collective_timeout", "checkpoint_every", "tracking"}
    | {"workers", "sync_every", "trials", "trials_norm", "trials_top_k"}
)


@dataclass
class TrainConfig:
    """All options of a training run (defaults in parentheses are the field defaults).

    Data
        ``data`` — data set spec for :func:`marginkit.data.load_dataset` (``mnist1d``,
        ``digits``, ``npz:PATH``, ...); ``train_per_class`` — keep N training examples per
        class (stratified, seeded); ``val_fraction`` — share of training data held out for
        validation (model selection); ``data_options`` — extra keyword arguments, among them
        the class-disjoint splits of every source (``split``, ``test_classes``, ``val_classes``,
        ``folds``/``fold``, ``split_seed``: :mod:`marginkit.data.class_splits`); ``augment`` —
        opt-in training augmentation (``{flip: 0.5, crop: 0.1}``, or ``flip,crop``:
        :mod:`marginkit.data.augment`), never applied at evaluation.
    Model
        ``model`` — backbone name (``auto`` picks ``cnn1d`` for mnist1d, ``cnn2d`` for
        images, ``mlp`` otherwise; ``custom``: your own module, ``train(..., model=module)``;
        ``timm:NAME`` / ``torchvision:NAME`` for those libraries' image models, ``onnx:FILE`` for an
        ONNX image model); ``embedding_dim``;
        ``normalize`` — L2-normalised output; ``model_options`` — extra keyword arguments for the
        backbone.
    Fine-tuning (:mod:`marginkit.train.starting`, ``docs/finetune.md``)
        ``weights`` — starting weights of the trunk: a state dict ``.pt``, a ``.safetensors``
        file or a marginkit run directory; ``pretrained`` — the library's own pretrained weights
        (timm / torchvision); ``init_from`` — a run directory whose trunk *and* projection start
        this run (a new head for this run's classes); ``freeze`` — ``none``, ``trunk`` or the
        number of leading stages kept fixed; ``backbone_lr_mult`` — the trunk's learning rate is
        ``lr`` times this; ``large_margin`` — raise the loss's margin in a last short phase
        (``{margin: 0.5, epochs: 2, ramp_epochs: 0}``, wespeaker's large-margin fine-tuning);
        ``grad_checkpointing`` — recompute activations in the backward pass.
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
        ``max_impostors`` — cap on impostor pairs for verification metrics;
        ``selection`` — what chooses ``best.pt`` on the validation split: ``auto`` (K-NN accuracy
        against the training embeddings when the validation classes are training classes,
        leave-one-out precision@1 within validation when they are disjoint), ``knn_accuracy``,
        ``precision_at_1`` or ``eer`` (of the validation pairs, lower is better);
        ``trials`` — a speaker-verification trial list (VoxCeleb format, paths relative to the
        ``audio:`` data root) scored after training into ``metrics.json`` ``trials``
        (:mod:`marginkit.audio.trials`); it changes no training, so it may differ on ``--resume``;
        ``trials_norm`` — ``as-norm``: the trial scores adaptive-S-normalised against a cohort of
        the training speakers (the mean unit embedding of 3 utterances each), keeping the
        ``trials_top_k`` (300) largest cohort scores of each side; default none.
    Runtime
        ``seed``, ``device`` (cpu | cuda | auto), ``num_threads`` (default: the available cores
        divided by the processes sharing them), ``deterministic``
        (``torch.use_deterministic_algorithms``), ``eval_batch_size``, ``collective_timeout``
        (seconds a data-parallel rank waits for its peers before the run ends with an error;
        must exceed the longest validation or evaluation, which rank 0 runs alone);
        ``checkpoint_every`` — commit ``last.pt`` (and ``metrics.jsonl``) every N epochs: the
        last epoch, a ``stop_after`` epoch and every epoch that improved ``best.pt`` are always
        committed, so ``--resume`` repeats at most N − 1 epochs, bit-identically;
        ``tracking`` — opt-in experiment tracking (``{tensorboard: true, mlflow: true}``:
        :mod:`marginkit.train.tracking`); ``workers`` — data-loading worker processes of a streamed
        source (default: :func:`marginkit.data.loading.default_workers`, the cores but one; an
        in-memory source needs none); ``sync_every`` — read the device back every N training
        steps (the loss for the progress bar, the non-finite checks: a divergence is reported
        with the epoch and step of its first bad value at the next read, or at the epoch's end);
        ``compile`` — ``torch.compile`` the model for the training step (off by default).
    Data options of every source (``data_options``)
        ``stream`` — ``true`` reads the training data from its files batch by batch in worker
        processes, ``false`` holds it in memory, unset decides by ``memory_budget`` (bytes, or a
        number with a unit: ``8GB``; default a share of the machine's memory); ``rec:`` and
        ``wds:`` always stream; ``on_bad_sample`` — ``raise`` (default) or ``skip`` (counted and
        reported in the log and ``metrics.json``).
    """

    data: str = "mnist1d"
    model: str = "auto"
    loss: str = "softmax"
    seed: int = 0
    train_per_class: int | None = None
    val_fraction: float = 0.1
    data_options: dict[str, Any] = field(default_factory=dict)
    augment: dict[str, Any] = field(default_factory=dict)
    embedding_dim: int = 64
    normalize: bool = True
    model_options: dict[str, Any] = field(default_factory=dict)
    weights: str | None = None
    pretrained: bool = False
    init_from: str | None = None
    freeze: str = "none"
    backbone_lr_mult: float = 1.0
    large_margin: dict[str, Any] = field(default_factory=dict)
    grad_checkpointing: bool = False
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
    selection: str = "auto"
    trials: str | None = None
    trials_norm: str | None = None
    trials_top_k: int = 300
    device: str = "cpu"
    num_threads: int | None = None
    deterministic: bool = True
    eval_batch_size: int = 1024
    workers: int | None = None
    sync_every: int = 50
    compile: bool = False
    collective_timeout: float = 600.0
    checkpoint_every: int = 1
    tracking: dict[str, Any] = field(default_factory=dict)

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
        except RecursionError:
            raise ConfigError("stored config is nested too deeply") from None
        return config_from_dict(raw)

    def to_yaml(self) -> str:
        """The config as YAML (every key), e.g. to write ``RUN_DIR/config.yaml``."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def validate(self) -> TrainConfig:
        """Check every value's type and range; raise :class:`ConfigError` naming the key.

        Types are coerced first (from YAML or command-line strings), then every field is
        checked against :data:`marginkit.train.ranges.FIELD_RANGES` and its choices, the
        loss and backbone options against their ranges, the cross-field rules in
        :data:`_RULES`, and finally the loss is built once, so that everything the loss
        itself checks fails here too, before any data is loaded.
        """
        self.amp = amp_mode(self.amp)
        try:
            self.augment = augment_options(self.augment)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), _field_types()[f.name]))
        if not self.data or not isinstance(self.data, str):
            raise ConfigError("data must be a non-empty data set spec such as 'mnist1d' or 'npz:PATH'")
        from marginkit.train.registry import LOSSES, check_loss_options

        for name, choices in {**_CHOICES, "loss": tuple(LOSSES)}.items():
            if name == "model" and self.model.split(":", 1)[0] in ("timm", "torchvision", "onnx"):
                self.model = _external_name(self.model)
                continue
            _choice(getattr(self, name), name, choices)
        for name, spec in FIELD_RANGES.items():
            if getattr(self, name) is not None:
                _in_range(getattr(self, name), spec, name)
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"device must be 'cpu', 'cuda', 'cuda:N', 'mps' or 'auto', got {self.device!r}")
        for rule in _RULES:
            problem = rule(self, LOSSES[self.loss].kind)
            if problem:
                raise ConfigError(problem)
        check_loss_options(self.loss, self.loss_options)
        _ranged_options(self.loss_options, loss_option_ranges(self.loss), "loss_options")
        _ranged_options(self.model_options, MODEL_OPTION_RANGES, "model_options")
        _no_top_level_keys(self.data_options)
        from marginkit.train.finetune import check_finetune, check_tracking

        self.freeze = check_finetune(self)
        self.large_margin = _large_margin(self)
        self.tracking = check_tracking(self.tracking)
        _build_loss_once(self)
        return self


# load_dataset's own keyword arguments: the trainer passes them from the top-level fields
_DATASET_ARGUMENTS = ("seed", "train_per_class", "val_fraction", "min_val_per_class")


def _no_top_level_keys(data_options: dict[str, Any]) -> None:
    for key in _DATASET_ARGUMENTS:
        if key in data_options:
            where = (
                f"set it as a top-level option ('--set {key}=...')"
                if key != "min_val_per_class"
                else "the trainer sets it (marginkit.train.small_data.MIN_VAL_PER_CLASS)"
            )
            raise ConfigError(f"data_options.{key} is not a data option: {where}")


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


_CHOICES = {
    "model": (*MODEL_NAMES, CUSTOM_MODEL),
    "optimizer": OPTIMIZERS,
    "scheduler": SCHEDULERS,
    "knn_metric": KNN_METRICS,
    "knn_weights": KNN_WEIGHTS,
    "selection": SELECTIONS,
}


def _in_range(value: Any, spec: Any, name: str) -> None:
    try:
        check_value(value, spec, name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _ranged_options(options: Mapping[str, Any], ranges: Mapping[str, Any], prefix: str) -> None:
    for key, value in options.items():
        if key in ranges:
            _in_range(value, ranges[key], f"{prefix}.{key}")


def _external_name(name: str) -> str:
    from marginkit.models.external import canonical_name

    try:
        return canonical_name(name)  # an onnx: file's path made absolute
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _large_margin(config: TrainConfig) -> dict[str, Any]:
    from marginkit.train.finetune import check_large_margin

    try:
        return check_large_margin(config.large_margin, config.loss, config.loss_options, config.epochs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _build_loss_once(config: TrainConfig) -> None:
    from marginkit.train.registry import build_loss

    try:
        build_loss(config.loss, config.loss_options, k=config.k)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"loss {config.loss!r}: {str(exc).splitlines()[0]}") from None


def _warmup_within_epochs(c: TrainConfig, kind: str) -> str | None:
    if c.epochs is not None and c.warmup_epochs > c.epochs:  # epochs None: chosen from the data
        return f"warmup_epochs ({c.warmup_epochs}) must not exceed epochs ({c.epochs})"
    return None


def _pair_batches_have_positives(c: TrainConfig, kind: str) -> str | None:
    if kind == "pair" and c.samples_per_class < 2:
        return "samples_per_class must be >= 2 for pair losses (each anchor needs a positive)"
    return None


def _pair_batches_have_negatives(c: TrainConfig, kind: str) -> str | None:
    if kind == "pair" and c.classes_per_batch is not None and c.classes_per_batch < 2:
        return (
            f"classes_per_batch must be >= 2 for pair losses (each anchor needs a negative from "
            f"another class), got {c.classes_per_batch}"
        )
    return None


def _norm_adaptive_loss_sees_norms(c: TrainConfig, kind: str) -> str | None:
    from marginkit.train.registry import LOSSES

    if LOSSES[c.loss].norms and c.normalize:
        return (
            f"loss {c.loss!r} adapts its margin to the embedding norms, which normalize: true makes "
            "all 1: set normalize: false (--set normalize=false)"
        )
    return None


def _batches_of_two(c: TrainConfig, kind: str) -> str | None:
    if kind == "class" and c.batch_size < 2 and c.model_options.get("norm", "batch") != "none":
        return (
            f"batch_size must be >= 2: batch norm needs two samples per training batch "
            f"(model_options.norm=none removes it), got {c.batch_size}"
        )
    return None


def _own_model_named(c: TrainConfig, kind: str) -> str | None:
    if c.model == CUSTOM_MODEL and not isinstance(c.model_options.get("class"), str):
        return (
            f"model {CUSTOM_MODEL!r} is your own nn.Module, given in Python as "
            "train(config, run_dir, model=module); the built-in models: " + ", ".join(MODEL_NAMES)
        )
    return None


def _trials_need_audio(c: TrainConfig, kind: str) -> str | None:
    if c.trials is not None and not c.data.startswith("audio:"):
        return (
            f"trials (--trials) scores a speaker-verification trial list over the utterances of an audio "
            f"source: --data must be audio:DIR or audio:wav.scp, got {c.data!r}"
        )
    return None


def _trials_norm_of_a_list(c: TrainConfig, kind: str) -> str | None:
    if c.trials_norm not in (None, "as-norm"):
        return f"unknown trials_norm {c.trials_norm!r} (--norm); valid: as-norm, none"
    if c.trials_norm is not None and c.trials is None:
        return "trials_norm (--norm) normalises the scores of a trial list: set trials (--trials) too"
    return None


#: Rules between fields: each returns the error message, or None. (Single values: ranges.py.)
_RULES: tuple[Callable[[TrainConfig, str], str | None], ...] = (
    _own_model_named,
    _warmup_within_epochs,
    _norm_adaptive_loss_sees_norms,
    _batches_of_two,
    _pair_batches_have_positives,
    _pair_batches_have_negatives,
    _trials_need_audio,
    _trials_norm_of_a_list,
)


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
_DICT_KEYS = ("data_options", "model_options", "loss_options", "augment", "large_margin", "tracking")
_DICT_ALIASES = {"data": "data_options", "model": "model_options", "loss": "loss_options"}  # loss.scale=30


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
            head = _DICT_ALIASES.get(head, head)
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
            if key == "augment" and not isinstance(parsed, Mapping):  # names: "flip,crop" replaces
                raw[key] = parsed
                continue
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


_YAML_MAX_DEPTH = 32  # a config is flat: a key, an option dictionary, a list inside it
_YAML_MAX_BYTES = 1 << 20


def _strict_loader() -> type:
    """PyYAML's safe loader, refusing duplicate keys, aliases and nesting deeper than 32."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        _depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise ConfigError(f"line {mark.line + 1}: YAML aliases (*name) are not supported in configs")
            self._depth += 1
            try:
                if self._depth > _YAML_MAX_DEPTH:
                    mark = self.peek_event().start_mark
                    raise ConfigError(f"line {mark.line + 1}: nested deeper than {_YAML_MAX_DEPTH} levels")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise ConfigError(f"duplicate key {key!r} (lines {seen[key]} and {line})")
                    seen[key] = line
                except TypeError:  # an unhashable key: the base class reports it
                    break
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _load_yaml(text: str) -> Any:
    """``text`` as YAML (see :func:`_strict_loader`): ConfigError for what it refuses."""
    import yaml

    try:
        return yaml.load(text, Loader=_strict_loader())
    except RecursionError:
        raise ConfigError("nested too deeply") from None


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a mapping (validated later, after overrides).

    Duplicate keys, YAML aliases, nesting deeper than 32 levels and files over 1 MB are
    refused: a config is a small flat mapping, and with a duplicate key the later value would
    silently win.
    """
    path = Path(path)
    where = f"config file {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where} does not exist")
    if path.stat().st_size > _YAML_MAX_BYTES:
        raise ConfigError(f"{where} is larger than 1 MB; a config holds a few keys")
    import yaml

    try:
        raw = _load_yaml(path.read_text(encoding="utf-8"))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{where} is not valid YAML: {first}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text") from None
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must hold a mapping of keys, got {type(raw).__name__}")
    valid = TrainConfig.keys()
    for key in raw:
        if str(key).replace("-", "_") not in valid:
            raise ConfigError(f"{path.name}: unknown config key {str(key)!r}{suggest(str(key), valid)}")
    return dict(raw)


def _parse_scalar(text: str) -> Any:
    import yaml

    try:
        value = _load_yaml(text)
    except yaml.YAMLError:
        return text  # not YAML: the plain string
    except ConfigError as exc:
        raise ConfigError(f"value {text[:40]!r}: {exc}") from None
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
