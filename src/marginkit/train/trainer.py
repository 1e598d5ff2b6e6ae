"""The training loop: data → backbone (+ cosine head) → loss, with checkpoints and evaluation.

:func:`train` runs one experiment into a run directory::

    RUN_DIR/config.yaml     every option of the run
    RUN_DIR/metrics.jsonl   one JSON row per epoch (train loss, lr, validation K-NN accuracy, ...)
    RUN_DIR/last.pt         checkpoint after the latest epoch (exact-resume state)
    RUN_DIR/best.pt         checkpoint with the best validation K-NN accuracy
    RUN_DIR/metrics.json    final test metrics of the best checkpoint
    RUN_DIR/knn_index.npz   K-NN reference index (training embeddings + model fingerprint)
    RUN_DIR/eval.npz        arrays behind the report (confusion matrix, projection, ...)
    RUN_DIR/report.html     self-contained HTML report

Class-level losses get a :class:`~marginkit.heads.CosineHead`; pair losses draw P×K batches
from a :class:`~marginkit.data.PKSampler`. Everything random is seeded from ``config.seed``:
the global torch/numpy/python RNGs at the start, the per-epoch batch order from
``(seed, epoch)``; checkpoints hold the RNG, optimiser and scheduler states, so a resumed
run reproduces the uninterrupted run's weights exactly (same device and thread count).

    >>> from marginkit.train import TrainConfig, train            # doctest: +SKIP
    >>> cfg = TrainConfig(data="digits", loss="cosface", epochs=5)  # doctest: +SKIP
    >>> result = train(cfg, "runs/digits-cosface")                  # doctest: +SKIP
    >>> result.metrics["knn_accuracy"]                              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from marginkit.train.checkpoint import (
    FORMAT,
    VERSION,
    CheckpointError,
    atomic_save,
    atomic_write_text,
    capture_rng,
    load_checkpoint,
    restore_rng,
)
from marginkit.train.config import RUNTIME_KEYS, ConfigError, TrainConfig
from marginkit.train.progress import ProgressBar
from marginkit.train.registry import LOSSES, build_loss
from marginkit.train.small_data import MIN_VAL_PER_CLASS, resolve_epochs

__all__ = [
    "RunDirError",
    "RunResult",
    "TrainingError",
    "build_components",
    "load_run",
    "load_splits",
    "resolve_device",
    "resolve_model_name",
    "train",
]


class RunDirError(ValueError):
    """The run directory cannot be used (not writable, already holds a run, holds no checkpoint)."""


class TrainingError(RuntimeError):
    """Training diverged (non-finite loss) or cannot proceed."""


@dataclass
class RunResult:
    """What :func:`train` returns."""

    run_dir: Path
    config: TrainConfig
    epochs_completed: int
    finished: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


# ---------------------------------------------------------------------- components
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
        "class_names": [str(c) for c in (getattr(splits, "class_names", None) or [])],
        "kind": str(getattr(splits, "kind", "vector")),
        "mean": getattr(splits, "mean", None),
        "std": getattr(splits, "std", None),
    }


def build_components(
    config: TrainConfig, facts: dict[str, Any], device: torch.device
) -> tuple[nn.Module, nn.Module | None, nn.Module]:
    """``(model, head or None, loss)`` for ``config`` on data with ``facts``."""
    from marginkit.models import build_model

    spec = LOSSES[config.loss]
    input_shape = tuple(facts["input_shape"])
    model_name = resolve_model_name(config, input_shape, facts.get("name", ""))
    try:
        model = build_model(
            model_name,
            input_shape,
            embedding_dim=config.embedding_dim,
            normalize=config.normalize,
            **config.model_options,
        ).to(device)
    except (ValueError, TypeError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"cannot build model {model_name!r} for input shape {input_shape}: {first}"
        ) from None
    head = None
    if spec.kind == "class":
        from marginkit.heads import CosineHead

        head = CosineHead(facts["num_classes"], config.embedding_dim).to(device)
    loss = build_loss(config.loss, config.loss_options, k=config.k).to(device)
    return model, head, loss


def _param_groups(config: TrainConfig, model: nn.Module, head: nn.Module | None) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups: list[dict[str, Any]] = [{"params": decay, "weight_decay": config.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if head is not None:
        groups.append(
            {"params": list(head.parameters()), "weight_decay": 0.0, "lr": config.head_lr or config.lr}
        )
    return groups


def _optimizer(config: TrainConfig, model: nn.Module, head: nn.Module | None) -> torch.optim.Optimizer:
    groups = _param_groups(config, model, head)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    return torch.optim.AdamW(groups, lr=config.lr)


class LRSchedule:
    """Per-iteration learning-rate factor: linear warm-up, then cosine decay to 0, a step
    decay every ``step_epochs`` epochs, or constant. A plain object (not a closure), so
    ``LambdaLR.state_dict`` stores its settings."""

    def __init__(
        self,
        kind: str,
        total_steps: int,
        warmup_steps: int,
        steps_per_epoch: int,
        step_epochs: int,
        gamma: float,
    ) -> None:
        self.kind = kind
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.steps_per_epoch = int(steps_per_epoch)
        self.step_epochs = int(step_epochs)
        self.gamma = float(gamma)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.kind == "step":
            return self.gamma ** ((step // self.steps_per_epoch) // self.step_epochs)
        return 1.0


# ---------------------------------------------------------------------- batches
def _epoch_seed(seed: int, epoch: int) -> int:
    return int(np.random.SeedSequence([int(seed), int(epoch), 0x6D6B]).generate_state(1)[0])


class _ShuffledBatches:
    """Seeded shuffled mini-batches (drop-last, so BatchNorm never sees a batch of one)."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch = 0
        self.size = min(batch_size, n)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return max(1, self.n // self.size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
        perm = torch.randperm(self.n, generator=g)
        for i in range(len(self)):
            yield perm[i * self.size : (i + 1) * self.size]


def _batches(config: TrainConfig, labels: torch.Tensor, num_classes: int) -> Any:
    if LOSSES[config.loss].kind == "class":
        return _ShuffledBatches(labels.numel(), config.batch_size, config.seed)
    from marginkit.data import PKSampler

    present = int(torch.unique(labels).numel())
    if present < 2:
        raise ConfigError(
            f"pair loss {config.loss!r} needs at least 2 classes in the training data, got {present}"
        )
    p = config.classes_per_batch or max(2, config.batch_size // config.samples_per_class)
    p = min(p, present)
    return PKSampler(
        labels, classes_per_batch=p, samples_per_class=config.samples_per_class, seed=config.seed
    )


@torch.no_grad()
def recalibrate_batchnorm(
    model: nn.Module, x: torch.Tensor, *, batch_size: int, max_samples: int, seed: int, device: torch.device
) -> None:
    """Set every batch-norm layer's running statistics to exact averages over training data.

    "Precise BN": the running mean / variance become the average of the per-batch
    statistics of up to ``max_samples`` training samples (a fixed seeded subset, batches of
    ``batch_size``), instead of an exponential average that lags the weights. Only the
    batch-norm layers run in training mode (dropout stays off), so no RNG is consumed.
    """
    bns = [
        m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    if not bns or max_samples <= 0:
        return
    n = x.shape[0]
    g = torch.Generator().manual_seed(_epoch_seed(seed, 2**31 - 1))
    idx = torch.randperm(n, generator=g)[: min(n, max_samples)]
    size = min(batch_size, idx.numel())
    if size < 2:
        return
    was_training = model.training
    momenta = [m.momentum for m in bns]
    model.eval()
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
        m.train()
    try:
        for i in range(0, idx.numel() - size + 1, size):
            model(x[idx[i : i + size]].to(device))
    finally:
        for m, mom in zip(bns, momenta, strict=True):
            m.momentum = mom
        model.train(was_training)


# ---------------------------------------------------------------------- runtime context
@contextlib.contextmanager
def runtime(config: TrainConfig) -> Iterator[None]:
    """Thread count and deterministic algorithms for the duration of a run (restored after)."""
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        yield
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)


def seed_everything(seed: int) -> None:
    """Seed the global torch, numpy and python RNGs (third-party code may use them)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 (third-party code may use it)
    random.seed(seed)


# ---------------------------------------------------------------------- run directory
def prepare_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool) -> Path:
    """Create ``run_dir`` and check it is writable; refuse to clobber an existing run."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".marginkit-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise RunDirError(
            f"cannot write to output directory {str(run_dir)!r}: {exc.strerror or exc}"
        ) from None
    if not resume and (run_dir / "last.pt").exists():
        if not overwrite:
            raise RunDirError(
                f"{str(run_dir)!r} already holds a run (last.pt); use --resume to continue it, "
                "--overwrite to replace it, or another --out"
            )
        for name in (
            "last.pt",
            "best.pt",
            "metrics.jsonl",
            "metrics.json",
            "knn_index.npz",
            "eval.npz",
            "report.html",
        ):
            with contextlib.suppress(FileNotFoundError):
                (run_dir / name).unlink()
    return run_dir


def load_run(run_dir: str | Path, which: str = "best", device: str | torch.device = "cpu") -> dict[str, Any]:
    """Load ``RUN_DIR/{which}.pt`` (``best`` falls back to ``last``) and rebuild the model.

    Returns a dict with ``config``, ``facts``, ``model``, ``head``, ``checkpoint``,
    ``fingerprint`` and ``path``.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"run directory {str(run_dir)!r} does not exist")
    path = run_dir / f"{which}.pt"
    if not path.is_file() and which == "best":
        path = run_dir / "last.pt"
    if not path.is_file():
        raise RunDirError(
            f"{str(run_dir)!r} holds no checkpoint (no best.pt or last.pt); train a model into it first"
        )
    ckpt = load_checkpoint(path)
    try:
        config = TrainConfig.from_json(ckpt["config"])
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} holds an invalid config: {exc}") from None
    facts = dict(ckpt["data"])
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    model, head, _ = build_components(config, facts, dev)
    try:
        model.load_state_dict(ckpt["model"])
        if head is not None:
            head.load_state_dict(ckpt["head"])
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise CheckpointError(f"checkpoint {str(path)!r} does not match its model: {first}") from None
    model.eval()
    if head is not None:
        head.eval()
    return {
        "config": config,
        "facts": facts,
        "model": model,
        "head": head,
        "checkpoint": ckpt,
        "fingerprint": model_fingerprint(model),  # of the weights actually loaded
        "path": path,
    }


def _read_history(path: Path, upto: int | None = None) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line from a crash
        if upto is None or row.get("epoch", 0) <= upto:
            rows.append(row)
    return rows


# ---------------------------------------------------------------------- training
def train(
    config: TrainConfig | None,
    run_dir: str | Path,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    overwrite: bool = False,
    quiet: bool = False,
    splits: Any = None,
    log: Callable[[str], None] | None = None,
    report: bool = True,
) -> RunResult:
    """Train (or resume) a run in ``run_dir``, then evaluate its best checkpoint.

    Under ``torchrun --nproc_per_node N`` (or ``marginkit train --nproc N``), or inside an
    initialised process group, every rank calls this with the same arguments: the ranks train
    the one-process optimisation data-parallel (:mod:`marginkit.train._ddp`, ``docs/distributed.md``)
    and rank 0 writes the run directory.

    Args:
        config: the run's options; with ``resume`` it may be ``None`` (taken from the
            checkpoint) or must agree with the checkpoint's except for runtime keys.
        run_dir: output directory (created).
        resume: continue from ``run_dir/last.pt``.
        stop_after: stop after this many completed epochs (as if interrupted; no final
            evaluation) — used to test resumption and to train in slices.
        overwrite: replace an existing run in ``run_dir``.
        quiet: no progress bar and no log lines.
        splits: an already loaded ``DatasetSplits`` for ``config`` (else loaded here).
        log: where log lines go (default: stderr unless ``quiet``).
        report: write ``report.html`` at the end.
    """
    from marginkit.train._ddp import init_distributed

    if config is not None and config.epochs is None:  # auto: from the training set's size
        splits = splits if splits is not None else load_splits(config)
        config = resolve_epochs(config, len(splits.train))
    ctx = init_distributed(config.device if config is not None else "cpu")
    try:
        result = _train(
            ctx, config, run_dir, resume=resume, stop_after=stop_after, overwrite=overwrite,
            quiet=quiet, splits=splits, log=log, report=report,
        )  # fmt: skip
    except BaseException:
        ctx.close(clean=False)
        raise
    ctx.close()
    return result


def _train(
    ctx: Any,
    config: TrainConfig | None,
    run_dir: str | Path,
    *,
    resume: bool,
    stop_after: int | None,
    overwrite: bool,
    quiet: bool,
    splits: Any,
    log: Callable[[str], None] | None,
    report: bool,
) -> RunResult:
    from marginkit.train import _ddp

    t_start = time.perf_counter()
    quiet = quiet or not ctx.is_main  # one rank talks and writes the run directory
    if log is None:
        log = (lambda _msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if ctx.is_main:
        run_dir = prepare_run_dir(run_dir, resume=resume, overwrite=overwrite)
    ctx.barrier()
    run_dir = Path(run_dir)
    ckpt = None
    if resume:
        last = run_dir / "last.pt"
        if not last.is_file():
            raise RunDirError(f"cannot resume: {str(run_dir)!r} holds no last.pt checkpoint")
        ckpt = load_checkpoint(last)
        stored = TrainConfig.from_json(ckpt["config"])
        if config is None:
            config = stored
        else:
            a, b = stored.to_dict(), config.to_dict()
            diff = sorted(k for k in a if k not in RUNTIME_KEYS and a[k] != b[k])
            if diff:
                raise ConfigError(
                    "cannot resume with different options: "
                    + ", ".join(f"{k} (run: {a[k]!r}, given: {b[k]!r})" for k in diff)
                )
            config = TrainConfig(**{**a, **{k: b[k] for k in RUNTIME_KEYS}}).validate()
    elif config is None:
        raise ConfigError("a config is required unless resuming")
    config.validate()
    if stop_after is not None and stop_after < 0:
        raise ConfigError(f"stop_after must be >= 0, got {stop_after}")

    with runtime(config):
        seed_everything(config.seed)
        device = _ddp.run_device(resolve_device(config.device), ctx)
        if splits is None:
            splits = load_splits(config)
        facts = data_facts(splits)
        if len(splits.val) == 0:
            why = splits.info.get("val_split", "val_fraction=0")
            log(f"no validation split ({why}): best.pt is the last epoch's checkpoint")
        model, head, loss_fn = build_components(config, facts, device)
        par, head = _ddp.parallelize(ctx, model, head, loss_fn, device)
        optimizer = _optimizer(config, model, head)
        train_x, train_y = splits.train.x, splits.train.y
        if train_y.numel() == 0:
            raise ConfigError(f"data set {config.data!r} has no training examples")
        batches = _batches(config, train_y, facts["num_classes"])
        if ctx.active:
            global_batch = batches.size if isinstance(batches, _ShuffledBatches) else batches.batch_size
            if global_batch // ctx.world < 2:
                raise ConfigError(
                    f"a batch of {global_batch} split over {ctx.world} processes leaves fewer than 2 "
                    "samples per process; raise batch_size or use fewer processes"
                )
        steps_per_epoch = len(batches)
        total_steps = steps_per_epoch * config.epochs
        warmup = round(config.warmup_epochs * steps_per_epoch)
        schedule = LRSchedule(
            config.scheduler, total_steps, warmup, steps_per_epoch, config.step_epochs, config.step_gamma
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

        start_epoch, global_step = 0, 0
        best_metric, best_epoch = -math.inf, 0
        history_path = run_dir / "metrics.jsonl"
        if ckpt is not None:
            if (
                list(ckpt["data"]["input_shape"]) != facts["input_shape"]
                or ckpt["data"]["num_classes"] != facts["num_classes"]
            ):
                raise CheckpointError("the checkpoint was trained on differently shaped data; cannot resume")
            model.load_state_dict(ckpt["model"])
            if head is not None:
                head.load_state_dict(ckpt["head"])
            _ddp.load_optimizer_state(optimizer, ckpt["optimizer"], head, par.sharded)
            scheduler.load_state_dict(ckpt["scheduler"])
            restore_rng(ckpt["rng"])
            start_epoch, global_step = int(ckpt["epoch"]), int(ckpt["global_step"])
            best_metric, best_epoch = float(ckpt["best_metric"]), int(ckpt["best_epoch"])
            history = _read_history(history_path, upto=start_epoch)
            if ctx.is_main:
                atomic_write_text("".join(json.dumps(r) + "\n" for r in history), history_path)
            log(f"resuming {run_dir} after epoch {start_epoch}/{config.epochs}")
        else:
            history = []
            if ctx.is_main:
                atomic_write_text("", history_path)
                atomic_write_text(config.to_yaml(), run_dir / "config.yaml")

        end_epoch = config.epochs if stop_after is None else min(config.epochs, stop_after)
        bar = ProgressBar(total_steps, enabled=not quiet, initial=start_epoch * steps_per_epoch)
        autocast = (
            torch.autocast(device_type=device.type, dtype=torch.bfloat16)
            if config.amp
            else contextlib.nullcontext()
        )
        params = [p for g in optimizer.param_groups for p in g["params"]]
        spec = LOSSES[config.loss]
        try:
            for epoch in range(start_epoch, end_epoch):
                model.train()
                if head is not None:
                    head.train()
                batches.set_epoch(epoch)
                t0 = time.perf_counter()
                epoch_lr = optimizer.param_groups[0]["lr"]  # the rate of the epoch's first step
                loss_sum = torch.zeros((), dtype=torch.float64)
                n_steps, n_samples = 0, 0
                for idx in batches:
                    idx = torch.as_tensor(idx, dtype=torch.long)
                    batch_samples = int(idx.numel())
                    if ctx.active:  # this rank's share of the global batch
                        idx = idx[ctx.share(batch_samples)]
                    xb = train_x[idx].to(device, non_blocking=True)
                    yb = train_y[idx].to(device, non_blocking=True)
                    with autocast:
                        emb = par.model(xb)
                        if ctx.any(not bool(torch.isfinite(emb).all()), device):
                            raise TrainingError(
                                f"embeddings became non-finite at epoch {epoch + 1}, step {n_steps + 1} "
                                "(the weights diverged); lower lr or set grad_clip"
                            )
                        out = par.head(emb) if par.head is not None else emb
                    loss = par.loss(out.float() if isinstance(out, torch.Tensor) else out, yb)
                    if not torch.isfinite(loss):
                        raise TrainingError(
                            f"loss became {loss.item()} at epoch {epoch + 1}, step {n_steps + 1}; "
                            "lower lr or set grad_clip"
                        )
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if config.grad_clip is not None:
                        shards = list(head.parameters()) if par.sharded else []
                        others = [p for p in params if not any(p is q for q in shards)]
                        _ddp.clip_grad_norm(ctx, others, shards, config.grad_clip)
                    optimizer.step()
                    scheduler.step()
                    global_step += 1
                    n_steps += 1
                    n_samples += batch_samples
                    value = float(loss.detach())
                    loss_sum += value
                    bar.update(samples=batch_samples, loss=value, prefix=f"epoch {epoch + 1}/{config.epochs}")
                validate = (epoch + 1) % config.eval_every == 0 or epoch + 1 == config.epochs
                if validate and ctx.is_main:  # DDP copies rank 0's buffers to the others
                    recalibrate_batchnorm(
                        model, train_x, batch_size=config.batch_size, max_samples=config.precise_bn,
                        seed=config.seed, device=device,
                    )  # fmt: skip
                seconds = time.perf_counter() - t0
                from marginkit.train.evaluate import validation_metrics

                head_sd = _ddp.head_state(head, par.sharded)  # collective when sharded
                val = {}
                if validate and ctx.is_main:
                    val_head = _ddp.evaluation_head(head, par.sharded, head_sd)
                    val = validation_metrics(model, val_head, splits, config, device)
                val = ctx.broadcast(val)
                row: dict[str, Any] = {
                    "epoch": epoch + 1,
                    "train_loss": float(loss_sum) / max(1, n_steps),
                    "lr": epoch_lr,
                    **val,
                    "epoch_seconds": round(seconds, 4),
                    "samples_per_second": round(n_samples / max(seconds, 1e-9), 1),
                }
                selection = val.get("val_selection")
                improved = validate and (selection is None or selection > best_metric)
                if improved:
                    best_metric = selection if selection is not None else -math.inf
                    best_epoch = epoch + 1
                row["best"] = improved
                history.append(row)
                if ctx.is_main:
                    with history_path.open("a", encoding="utf-8") as fh:
                        fh.write(json.dumps(row) + "\n")
                optimizer_sd = _ddp.optimizer_state(optimizer, head, par.sharded)  # collective when sharded
                payload = _payload(
                    config,
                    facts,
                    model,
                    head,
                    optimizer,
                    scheduler,
                    epoch + 1,
                    global_step,
                    best_metric,
                    best_epoch,
                    head_state=head_sd,
                    optimizer_state=optimizer_sd,
                )
                if ctx.is_main:
                    atomic_save(payload, run_dir / "last.pt")
                if improved and ctx.is_main:
                    tmp = run_dir / ".best.pt.tmp"
                    shutil.copyfile(run_dir / "last.pt", tmp)
                    os.replace(tmp, run_dir / "best.pt")
                if bar.active:  # the epoch's log line replaces its bar
                    bar.close(clear=True)
                    bar = ProgressBar(total_steps, enabled=not quiet, initial=(epoch + 1) * steps_per_epoch)
                log(_epoch_line(row, config.epochs))
        finally:
            bar.close(clear=True)

        finished = end_epoch >= config.epochs
        result = RunResult(run_dir, config, end_epoch, finished, history=history)
        if not finished:
            result.seconds = time.perf_counter() - t_start
            log(f"stopped after epoch {end_epoch}/{config.epochs}; continue with --resume")
            return result
        from marginkit.train.evaluate import evaluate_run

        metrics = {}
        if ctx.is_main:  # once, on the full evaluation sets
            metrics = evaluate_run(run_dir, splits=splits, device=device, report=report, spec=spec)
        result.metrics = ctx.broadcast(metrics)
        result.seconds = time.perf_counter() - t_start
        return result


def _epoch_line(row: dict[str, Any], epochs: int) -> str:
    parts = [f"epoch {row['epoch']:>3}/{epochs}", f"loss {row['train_loss']:.4f}"]
    for key in ("val_knn_accuracy", "val_precision_at_1", "val_head_accuracy"):
        if key in row and row[key] is not None:
            parts.append(f"{key} {row[key]:.4f}")
    parts.append(f"{row['samples_per_second']:.0f} samples/s")
    if row.get("best"):
        parts.append("*")
    return "  ".join(parts)


def model_fingerprint(model: nn.Module) -> str:
    """The embedding model's fingerprint (:func:`marginkit.knn.model_fingerprint`)."""
    from marginkit.knn import model_fingerprint as fingerprint

    return fingerprint(model)


def _payload(
    config: TrainConfig,
    facts: dict[str, Any],
    model: nn.Module,
    head: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    epoch: int,
    global_step: int,
    best_metric: float,
    best_epoch: int,
    *,
    head_state: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    model_sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if head_state is None:
        head_state = head.state_dict() if head is not None else {}
    head_sd = {k: v.detach().cpu() for k, v in head_state.items()}
    return {
        "format": FORMAT,
        "version": VERSION,
        "epoch": int(epoch),
        "global_step": int(global_step),
        "config": config.to_json(),
        "data": facts,
        "model": model_sd,
        "head": head_sd,
        "optimizer": optimizer.state_dict() if optimizer_state is None else optimizer_state,
        "scheduler": scheduler.state_dict(),
        "rng": capture_rng(),
        "best_metric": float(best_metric),
        "best_epoch": int(best_epoch),
        "fingerprint": model_fingerprint(model),
        "torch_version": str(torch.__version__),
    }
