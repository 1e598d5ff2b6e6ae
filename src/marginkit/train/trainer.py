"""The training loop: data → backbone (+ cosine head) → loss, with checkpoints and evaluation.

:func:`train` runs one experiment into a run directory (files and crash safety:
:mod:`marginkit.train.rundir`) in four named steps: :func:`_restore` (build the run, fresh or
from its last checkpoint), :func:`_one_epoch`, :func:`_end_epoch` (validation, model selection,
the epoch's commit) and :func:`_final_evaluation` (test metrics of the best checkpoint).

Class-level losses get a :class:`~marginkit.heads.CosineHead`; pair losses draw P×K batches
from a :class:`~marginkit.data.PKSampler`. Everything random is seeded from ``config.seed``:
the global torch/numpy/python RNGs at the start, the per-epoch batch order from
``(seed, epoch)``; checkpoints hold the RNG, optimiser and scheduler states, so a resumed
run reproduces the uninterrupted run's weights exactly (same device and thread count; the
thread count is recorded in the run's config).

    >>> from marginkit.train import TrainConfig, train            # doctest: +SKIP
    >>> cfg = TrainConfig(data="digits", loss="cosface", epochs=5)  # doctest: +SKIP
    >>> result = train(cfg, "runs/digits-cosface")                  # doctest: +SKIP
    >>> result.metrics["knn_accuracy"]                              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from marginkit.data.device import prefetched, to_model_input
from marginkit.data.loading import (
    FixedBatches,
    Loader,
    ShuffledBatches,
    epoch_seed,
    evaluation_loader,
    worker_failure,
)
from marginkit.models.base import is_frozen
from marginkit.train import _ddp
from marginkit.train import runtime as _runtime
from marginkit.train.components import (
    LRSchedule,
    build_components,
    build_optimizer,
    data_facts,
    for_own_model,
    load_splits,
    lr_scheduler,
    resolve_device,
    resolve_model_name,
)
from marginkit.train.config import CUSTOM_MODEL, RUNTIME_KEYS, TrainConfig
from marginkit.train.errors import CheckpointError, ConfigError, RunDirError, TrainingError
from marginkit.train.evaluate import (
    check_k_fits,
    check_selection,
    check_trials,
    data_note,
    evaluate_checkpoint,
    selection_note,
    validation_metrics,
)
from marginkit.train.progress import ProgressBar, StepMeter
from marginkit.train.registry import LOSSES
from marginkit.train.rundir import (
    RunDir,
    checkpoint_payload,
    config_differences,
    load_last,
    load_run,
    scaler_state,
    stored_config,
)
from marginkit.train.runtime import capture_rng, choose_threads, restore_rng, runtime, seed_everything
from marginkit.train.small_data import resolve_epochs

__all__ = [
    "LRSchedule",
    "RunDirError",
    "RunResult",
    "TrainingError",
    "build_components",
    "load_run",
    "load_splits",
    "recalibrate_batchnorm",
    "resolve_device",
    "resolve_model_name",
    "train",
]
from marginkit.train.sources import register_sources

register_sources()  # audio: (above data/, which may not import it)


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


# ---------------------------------------------------------------------- batches
_epoch_seed = epoch_seed  # the batch plans live in marginkit.data.loading
_ShuffledBatches = ShuffledBatches


def _batches(config: TrainConfig, labels: torch.Tensor) -> Any:
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
    model: nn.Module,
    x: Any,
    *,
    batch_size: int,
    max_samples: int,
    seed: int,
    device: torch.device,
    workers: int | None = None,
) -> None:
    """Set every batch-norm layer's running statistics to exact averages over training data.

    "Precise BN": the running mean / variance become the average of the per-batch
    statistics of up to ``max_samples`` training samples ``x`` (a tensor in its source's dtype, or
    a streamed split's lazy source; a fixed seeded subset, batches of ``batch_size``), instead of
    an exponential average that lags the weights. Only the
    batch-norm layers run in training mode (dropout stays off), so no RNG is consumed. Layers
    of a frozen part of the model (``freeze``) keep their statistics.
    """
    bns = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and not is_frozen(m)
    ]
    if not bns or max_samples <= 0:
        return
    n = len(x)
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
    labels = torch.zeros(n, dtype=torch.long)
    if getattr(x, "kind", None) == "audio":
        # utterances of any length: the rows as training reads them (seeded crops of one length)
        loader = Loader(
            x, labels, FixedBatches(idx, size, drop_last=True), device=device, workers=workers, seed=seed
        )
    else:
        loader = evaluation_loader(x, labels, batch_size=size, device=device, workers=workers, rows=idx,
                                   drop_last=True)  # fmt: skip
    try:
        for batch in loader.epoch():
            model(to_model_input(batch.x, device))
    finally:
        loader.close()
        for m, mom in zip(bns, momenta, strict=True):
            m.momentum = mom
        model.train(was_training)


# ---------------------------------------------------------------------- the run's state
@dataclass
class _Run:
    """What a training run holds between its steps (one per process; rank 0 owns ``rundir``)."""

    ctx: Any
    config: TrainConfig
    splits: Any
    facts: dict[str, Any]
    device: torch.device
    model: nn.Module
    head: nn.Module | None  # the module the optimiser updates (sharded under DDP)
    par: Any  # the data-parallel wrappers (_ddp.Parallel)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batches: Any
    loader: Loader
    rundir: RunDir | None
    run_dir: Path
    log: Callable[[str], None]
    epoch: int = 0  # completed (= committed) epochs
    global_step: int = 0
    best_metric: float = -math.inf
    best_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    scaler: Any = None  # fp16's torch.amp.GradScaler (built at the first epoch of this process)
    augment: Any = None  # marginkit.data.augment.BatchAugment of the training batches, or None
    margin: Any = None  # large_margin's HyperparameterScheduler of the loss's margin, or None
    tracker: Any = None  # marginkit.train.tracking.Tracker (rank 0, opt-in), or None
    compiled: Any = None  # torch.compile of par.model (config.compile), built at the first step

    @property
    def spec_norms(self) -> bool:
        """Does the loss read the embedding norms (``head(e, with_norms=True)``)?"""
        return LOSSES[self.config.loss].norms

    def checkpoint(self) -> dict[str, Any]:
        """The checkpoint of the completed epochs (collective when the head is sharded)."""
        head_sd = _ddp.head_state(self.head, self.par.sharded)
        optimizer_sd = _ddp.optimizer_state(self.optimizer, self.head, self.par.sharded)
        from marginkit.knn import model_fingerprint

        return checkpoint_payload(
            config=self.config, facts=self.facts, model_state=self.model.state_dict(), head_state=head_sd,
            optimizer_state=optimizer_sd, scheduler_state=self.scheduler.state_dict(), rng=capture_rng(),
            epoch=self.epoch, global_step=self.global_step, best_metric=self.best_metric,
            best_epoch=self.best_epoch, history=self.history, fingerprint=model_fingerprint(self.model),
            scaler_state=self.scaler.state_dict() if self.scaler is not None else None,
        )  # fmt: skip


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
    model: nn.Module | None = None,
) -> RunResult:
    """Train (or resume) a run in ``run_dir``, then evaluate its best checkpoint.

    Under ``torchrun --nproc_per_node N`` (or ``marginkit train --nproc N``), or inside an
    initialised process group, every rank calls this with the same arguments: the ranks train
    the one-process optimisation data-parallel (:mod:`marginkit.train._ddp`, ``docs/distributed.md``)
    and rank 0 writes the run directory. A rank that stalls or dies ends the others' run with a
    :class:`TrainingError` within ``collective_timeout`` seconds.

    Args:
        config: the run's options; with ``resume`` it may be ``None`` (taken from the
            checkpoint) or must agree with the checkpoint's except for runtime keys.
        run_dir: output directory (created; locked while the run writes it).
        resume: continue from ``run_dir/last.pt``.
        stop_after: stop after this many completed epochs (as if interrupted; no final
            evaluation) — used to test resumption and to train in slices.
        overwrite: replace an existing run in ``run_dir``.
        quiet: no progress bar and no log lines.
        splits: an already loaded ``DatasetSplits`` for ``config`` (else loaded here).
        log: where log lines go (default: stderr unless ``quiet``).
        report: write ``report.html`` at the end.
        model: your own embedding model instead of a built-in backbone: any ``nn.Module`` that
            maps ``[B, *input_shape]`` (the data set's) to ``[B, D]``. It is trained in place
            (it holds the last epoch's weights afterwards; ``best.pt`` the chosen epoch's), and
            the run records ``model: custom``, the module's class, and ``embedding_dim = D`` and
            ``normalize`` as its output shows. Resuming such a run, and :func:`load_run`,
            :func:`~marginkit.train.evaluate_run` and :func:`~marginkit.export.export_model` on
            it, take a new instance of the same class as ``model=`` (the command line cannot
            rebuild it). Seed torch before building the module for a reproducible run: its
            initial weights are yours.
    """
    ctx = _ddp.init_distributed(config)
    try:
        result = _train(
            ctx, config, Path(run_dir), resume=resume, stop_after=stop_after, overwrite=overwrite,
            quiet=quiet, splits=splits, log=log, report=report, model=model,
        )  # fmt: skip
    except BaseException as exc:
        ctx.close(clean=False)
        died = worker_failure(exc)
        if died is not None:
            raise TrainingError(
                f"{died}; the run stopped, its last.pt (the last completed epoch) is intact: "
                "continue with --resume"
            ) from None
        failure = _ddp.peer_failure(ctx, exc)
        if failure is not None:
            raise TrainingError(
                f"{failure}; the run stopped, its last.pt (the last completed epoch) is intact: "
                "continue with --resume"
            ) from None
        raise
    ctx.close()
    return result


def _train(
    ctx: Any,
    config: TrainConfig | None,
    run_dir: Path,
    *,
    resume: bool,
    stop_after: int | None,
    overwrite: bool,
    quiet: bool,
    splits: Any,
    log: Callable[[str], None] | None,
    report: bool,
    model: nn.Module | None = None,
) -> RunResult:
    t_start = time.perf_counter()
    quiet = quiet or not ctx.is_main  # one rank talks and writes the run directory
    if log is None:
        log = (lambda _msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if config is not None:  # an unavailable device fails like a typo: before anything is read or written
        resolve_device(config.validate().device)
    if config is not None and model is not None:  # the caller's module: its class and output size
        splits = splits if splits is not None else load_splits(config)
        config = for_own_model(config, model, splits.train.x)  # a module that fails, before writing
    rundir = RunDir.for_training(run_dir, resume=resume, overwrite=overwrite) if ctx.is_main else None
    tracker = None
    try:
        ctx.barrier()
        ckpt = None
        if resume:  # rank 0 repairs what a crash left behind; the others only read last.pt
            ckpt = rundir.restore() if rundir is not None else load_last(run_dir)
        if config is not None and config.epochs is None:  # auto: from the training set's size
            splits = splits if splits is not None else load_splits(config)
            config = resolve_epochs(config, len(splits.train))
        config = _run_config(config, ckpt, run_dir)
        if stop_after is not None and stop_after < 0:
            raise ConfigError(f"stop_after must be >= 0, got {stop_after}")
        jobs = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world))
        threads = choose_threads(jobs, config.num_threads)
        cores = _runtime.available_cores()
        how = "num_threads" if config.num_threads else f"{cores} cores / {jobs} process(es)"
        config = dataclasses.replace(config, num_threads=threads)  # recorded in config.yaml
        log(f"{run_dir}: {threads} torch thread(s) per process ({how})")
        with runtime(threads, deterministic=config.deterministic):
            run = _restore(ctx, config, splits, ckpt, rundir, run_dir, log, model)
            if rundir is not None and config.tracking:
                from marginkit.train.tracking import open_tracker

                run.tracker = tracker = open_tracker(config, run_dir, start_epoch=run.epoch)
            end_epoch = config.epochs if stop_after is None else min(config.epochs, stop_after)
            try:
                _epochs(run, end_epoch, quiet=quiet)
            finally:
                run.loader.close()
            result = RunResult(run_dir, config, end_epoch, end_epoch >= config.epochs, history=run.history)
            if result.finished:
                result.metrics = _final_evaluation(run, report=report)
                if run.tracker is not None:
                    run.tracker.finish(result.metrics, run.epoch)
            else:
                log(f"stopped after epoch {end_epoch}/{config.epochs}; continue with --resume")
            if run.tracker is not None:
                run.tracker.close()
    except BaseException:
        if tracker is not None:
            tracker.close(failed=True)
        raise
    finally:
        if rundir is not None:
            rundir.close()
    result.seconds = time.perf_counter() - t_start
    return result


def _run_config(config: TrainConfig | None, ckpt: dict[str, Any] | None, run_dir: Path) -> TrainConfig:
    """The config to train with: ``config``, or (resuming) the checkpoint's, which ``config``
    may change only in runtime keys."""
    if ckpt is None:
        if config is None:
            raise ConfigError("a config is required unless resuming")
        return config.validate()
    stored = stored_config(ckpt, run_dir / "last.pt")
    if config is None:
        return stored
    diff = config_differences(stored, config)
    if diff:
        raise ConfigError("cannot resume with different options: " + ", ".join(diff))
    given = config.to_dict()
    return TrainConfig(**{**stored.to_dict(), **{k: given[k] for k in RUNTIME_KEYS}}).validate()


def _restore(
    ctx: Any,
    config: TrainConfig,
    splits: Any,
    ckpt: dict[str, Any] | None,
    rundir: RunDir | None,
    run_dir: Path,
    log: Callable[[str], None],
    own_model: nn.Module | None = None,
) -> _Run:
    """Build the run's components and restore them from ``ckpt`` (resuming); a fresh run commits
    its epoch-0 checkpoint, so that it can be resumed from its first step on."""
    seed_everything(config.seed)
    device = _ddp.run_device(resolve_device(config.device), ctx)
    if splits is None:
        splits = load_splits(config)
    facts = data_facts(splits)
    check_k_fits(config, splits)
    check_selection(config, splits)
    check_trials(config, splits)  # a trial list's file and paths, before any training
    log(data_note(splits))
    log(selection_note(config, splits))
    model, head, loss_fn = build_components(config, facts, device, own_model)
    if ckpt is None:  # a fresh run: its starting weights (a resumed one has them in last.pt)
        from marginkit.train.starting import apply_starting_weights

        note = apply_starting_weights(config, model)
        if note:
            log(f"starting weights: {note}")
    par, head = _ddp.parallelize(ctx, model, head, loss_fn, device)
    optimizer = build_optimizer(config, model, head)
    if splits.train.y.numel() == 0:
        raise ConfigError(f"data set {config.data!r} has no training examples")
    batches = _batches(config, splits.train.y)
    if ctx.active:
        global_batch = batches.size if isinstance(batches, _ShuffledBatches) else batches.batch_size
        if global_batch // ctx.world < 2:
            raise ConfigError(
                f"a batch of {global_batch} split over {ctx.world} processes leaves fewer than 2 "
                "samples per process; raise batch_size or use fewer processes"
            )
    scheduler = lr_scheduler(config, optimizer, len(batches))
    augment = _augmenter(config, splits, model, log)
    loader = Loader(
        splits.train.data, splits.train.y, batches, device=device, workers=config.workers, seed=config.seed,
        # with augment every rank reads the global batch and augments it as one process would
        share=ctx.share if ctx.active and augment is None else None,
        on_bad_sample=getattr(splits, "on_bad_sample", "raise"),
    )  # fmt: skip
    log(_loader_note(splits, loader, config))
    run = _Run(ctx, config, splits, facts, device, model, head, par, optimizer, scheduler, batches, loader,
               rundir, run_dir, log)  # fmt: skip
    from marginkit.train.finetune import large_margin_scheduler

    run.margin = large_margin_scheduler(config, loss_fn, len(batches))
    if run.margin is not None:
        lm = config.large_margin
        log(
            f"large-margin phase: margin {run.margin.values()['margin']:g} -> {lm['margin']:g} over the "
            f"last {lm['epochs']} epoch(s) (ramp {lm['ramp_epochs']})"
        )
    run.augment = augment
    if run.augment is not None:
        shown = ", ".join(f"{k} {v:g}" for k, v in run.augment.options.items())
        log(f"augmentation of the training batches ({run.augment.kind}s): {shown}; none at evaluation")
    if ckpt is None:
        payload = run.checkpoint()
        if rundir is not None:
            rundir.commit_epoch(payload, improved=False)
            rundir.write_config(config)
        return run
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
    state = scaler_state(ckpt, run_dir / "last.pt")
    if config.amp == "fp16" and state is not None:  # else (bf16/off, or an older checkpoint): fresh
        _, run.scaler = mixed_precision(config.amp, device, sharded=par.sharded)
        run.scaler.load_state_dict(state)
    run.epoch, run.global_step = int(ckpt["epoch"]), int(ckpt["global_step"])
    if run.margin is not None:  # the margin of the step the run stopped at
        run.margin.load_state_dict({"step": run.global_step, "names": ["margin"]})
    run.best_metric, run.best_epoch = float(ckpt["best_metric"]), int(ckpt["best_epoch"])
    run.history = [r for r in ckpt["history"] if r.get("epoch", 0) <= run.epoch]
    if rundir is not None:
        rundir.write_config(config)
    log(f"resuming {run_dir} after epoch {run.epoch}/{config.epochs}")
    return run


def _loader_note(splits: Any, loader: Loader, config: TrainConfig) -> str:
    """The log's line on how the training data is read."""
    how = splits.info.get("pipeline") if isinstance(getattr(splits, "info", None), dict) else None
    if loader.lazy:
        chosen = "--workers" if config.workers is not None else "the default: the available cores but one"
        where = f"streamed from its files by {loader.workers} worker process(es) ({chosen})"
    else:
        where = f"held in memory as {splits.train.data.dtype}".replace("torch.", "")
    return f"training data {where}; {how}" if how else f"training data {where}"


def _augmenter(config: TrainConfig, splits: Any, model: Any = None, log: Any = print) -> Any:
    """The run's :class:`~marginkit.data.augment.BatchAugment` (``None`` without ``augment``):
    image transforms for images, time shifts and masks for the sequences of ``cnn1d``; audio
    is augmented where its crops are read (:func:`marginkit.audio.augment.attach`)."""
    if not config.augment:
        return None
    from marginkit.data.augment import BatchAugment

    if splits.kind == "audio":
        from marginkit.audio.augment import attach

        try:
            note = attach(splits.train.data, model, config.augment, config.data_options)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        log(f"audio augmentation of the training crops: {note}; none at evaluation")
        return None

    model = resolve_model_name(config, tuple(splits.input_shape), str(splits.name))
    if splits.kind == "image":
        kind = "image"
    elif model == "cnn1d":
        kind = "sequence"
    else:
        raise ConfigError(
            f"augment applies to images and to sequences (model cnn1d); {splits.name!r} has feature "
            f"vectors of shape {tuple(splits.input_shape)} for model {model!r}: drop augment"
        )
    try:
        return BatchAugment(config.augment, kind)
    except (ValueError, ImportError) as exc:
        raise ConfigError(str(exc)) from None


def _epochs(run: _Run, end_epoch: int, *, quiet: bool) -> None:
    """Train epochs ``run.epoch + 1 .. end_epoch`` with a progress bar per epoch."""
    steps = len(run.batches)
    total = steps * run.config.epochs
    while run.epoch < end_epoch:
        bar = ProgressBar(total, enabled=not quiet, initial=run.epoch * steps)
        try:
            stats = _one_epoch(run, bar)
        finally:
            bar.close(clear=True)  # the epoch's log line replaces its bar
        row = _end_epoch(run, stats, end_epoch)
        run.log(_epoch_line(row, run.config.epochs))
        if run.tracker is not None:
            run.tracker.log_epoch(row)


def mixed_precision(
    amp: str, device: torch.device, *, sharded: bool = False
) -> tuple[contextlib.AbstractContextManager[Any], torch.amp.GradScaler | None]:
    """The autocast context and gradient scaler of ``amp`` (:data:`~marginkit.train.config.AMP_MODES`).

    ``fp16`` is float16 autocast with a ``torch.amp.GradScaler`` (float16's range needs the loss
    scaled up; the run's checkpoints hold the scaler's state, so a resumed run continues with
    the same scale; a checkpoint without it, written before, resumes with a fresh scaler).
    The heads compute cosines in float32 either way. A device without float16 (or bfloat16)
    autocast is refused here. With a class-sharded head (``sharded``) the ranks hold different
    head gradients, so an overflow seen by one rank must skip the step on all of them: the
    scaler is torch's ``ShardedGradScaler``, which all-reduces the overflow flags.
    """
    if amp == "off":
        return contextlib.nullcontext(), None
    dtype = torch.float16 if amp == "fp16" else torch.bfloat16
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns and disables autocast for an unsupported dtype
            context = torch.autocast(device_type=device.type, dtype=dtype)
    except (RuntimeError, UserWarning) as exc:
        raise ConfigError(f"amp {amp!r} is not supported on device {device.type!r}: {exc}") from None
    if amp != "fp16":
        return context, None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return context, ShardedGradScaler(device.type)
    return context, torch.amp.GradScaler(device.type)


def _deferred_checks() -> contextlib.AbstractContextManager[Any]:
    """The losses' input checks that need a host read, turned into on-device flags
    (:func:`marginkit._validation.deferred_checks`) read at the meter's read points."""
    from marginkit import _validation

    make = getattr(_validation, "deferred_checks", None)
    return make() if make is not None else contextlib.nullcontext(None)


def _read_point(run: _Run, meter: StepMeter, checks: Any, bar: ProgressBar, epoch: int) -> float:
    """Read the step meter back (one copy, one collective under DDP) and fail fast on what the
    steps since the last read saw; returns the epoch's loss sum so far."""
    ctx = run.ctx
    reading = meter.read(ctx.gather_rows if ctx.active else None, ctx.rank)
    if reading.first_bad is not None:
        step = reading.first_bad + 1
        if reading.what == "embeddings":
            raise TrainingError(
                f"embeddings became non-finite at epoch {epoch + 1}, step {step} "
                "(the weights diverged); lower lr or set grad_clip"
            )
        raise TrainingError(
            f"loss became {reading.value} at epoch {epoch + 1}, step {step}; lower lr or set grad_clip"
        )
    if checks is not None:
        checks.raise_if_failed()
    if reading.window_steps:
        bar.show_loss(reading.window_sum / reading.window_steps)
    return reading.loss_sum


def _step_model(run: _Run) -> Any:
    """The module the training step calls: the (data-parallel) model, compiled with ``compile``."""
    if not run.config.compile:
        return run.par.model
    if run.compiled is None:
        run.compiled = torch.compile(run.par.model)
    return run.compiled


def _one_epoch(run: _Run, bar: ProgressBar) -> dict[str, Any]:
    """One pass over the training batches; returns the epoch's loss sum, steps, samples, lr, time.

    The step never reads the device back: the loss and the non-finite checks accumulate in a
    :class:`~marginkit.train.progress.StepMeter`, read every ``sync_every`` steps and at the end
    (with fp16, torch's ``GradScaler`` reads its overflow flag every step; bf16 has no scaler).
    """
    ctx, config, par, optimizer = run.ctx, run.config, run.par, run.optimizer
    epoch = run.epoch
    run.model.train()
    if run.head is not None:
        run.head.train()
    autocast, scaler = mixed_precision(config.amp, run.device, sharded=par.sharded)
    if scaler is not None:  # one scaler for the run: its scale carries over between epochs
        run.scaler = scaler = run.scaler or scaler
    params = [p for g in optimizer.param_groups for p in g["params"]]
    shards = list(run.head.parameters()) if par.sharded else []
    others = [p for p in params if not any(p is q for q in shards)]
    model = _step_model(run)
    t0 = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]  # the rate of the epoch's first step
    margin = {"margin": run.margin.values()["margin"]} if run.margin is not None else {}
    meter = StepMeter(run.device)
    n_steps, n_samples = 0, 0
    device = run.device
    reads_global = ctx.active and run.augment is not None  # the loader did not take this rank's share

    def move(batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        return to_model_input(batch.x, device), batch.y.to(device, non_blocking=True), batch.total

    with _deferred_checks() as checks:
        for xb, yb, batch_samples in prefetched(run.loader.epoch(epoch), move):
            if run.augment is not None:  # the global batch, as one process would: N ranks train as one
                xb = run.augment(xb, seed=config.seed, epoch=epoch, step=n_steps)
            if reads_global:
                share = ctx.share(batch_samples)
                xb, yb = xb[share], yb[share]
            with autocast:
                emb = model(xb)
                if par.head is None:
                    out = emb
                else:  # a norm-adaptive loss (AdaFace) gets the embedding norms along
                    out = par.head(emb, with_norms=True) if run.spec_norms else par.head(emb)
            loss = par.loss(out.float() if isinstance(out, torch.Tensor) else out, yb)
            meter.add(loss, emb)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
            else:  # fp16: scaled backward; a step with inf/NaN gradients is skipped, the scale lowered
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
            if config.grad_clip is not None:
                _ddp.clip_grad_norm(ctx, others, shards, config.grad_clip)
            if scaler is None:
                optimizer.step()
                run.scheduler.step()
            else:
                scaler.step(optimizer)
                scaler.update()
                with warnings.catch_warnings():  # the schedule counts iterations, skipped fp16 steps too
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler", UserWarning)
                    run.scheduler.step()
            if run.margin is not None:
                run.margin.step()
            run.global_step += 1
            n_steps += 1
            n_samples += batch_samples
            bar.update(samples=batch_samples, prefix=f"epoch {epoch + 1}/{config.epochs}")
            if n_steps % config.sync_every == 0:
                _read_point(run, meter, checks, bar, epoch)
        loss_sum = _read_point(run, meter, checks, bar, epoch)
    seconds = time.perf_counter() - t0
    return {
        "loss_sum": loss_sum, "steps": n_steps, "samples": n_samples, "lr": lr, "seconds": seconds,
        "skipped": len(run.loader.skipped), **margin,
    }  # fmt: skip


def _end_epoch(run: _Run, stats: dict[str, Any], end_epoch: int) -> dict[str, Any]:
    """Validate (every ``eval_every`` epochs and after the last), select, and commit the epoch
    (every ``checkpoint_every`` epochs, at ``end_epoch`` and when ``best.pt`` improved)."""
    ctx, config = run.ctx, run.config
    epoch = run.epoch + 1
    validate = epoch % config.eval_every == 0 or epoch == config.epochs
    if validate:
        # The batch-norm pass and validation read through loaders of their own: the training
        # loader's (persistent) workers stop first, so that the two sets of workers never hold
        # memory at once; its next epoch starts them again, with the same draws.
        run.loader.close()
    if validate and ctx.is_main:  # DDP copies rank 0's buffers to the others
        recalibrate_batchnorm(
            run.model, run.splits.train.data, batch_size=config.batch_size, max_samples=config.precise_bn,
            seed=config.seed, device=run.device, workers=config.workers,
        )  # fmt: skip
    head_sd = _ddp.head_state(run.head, run.par.sharded)  # collective when sharded
    val: dict[str, Any] = {}
    if validate and ctx.is_main:
        val_head = _ddp.evaluation_head(run.head, run.par.sharded, head_sd)
        val = validation_metrics(run.model, val_head, run.splits, config, run.device)
    val = ctx.broadcast(val)
    seconds = stats["seconds"]
    row: dict[str, Any] = {
        "epoch": epoch,
        "train_loss": stats["loss_sum"] / max(1, stats["steps"]),
        "lr": stats["lr"],
        **({"margin": stats["margin"]} if "margin" in stats else {}),
        **val,
        "epoch_seconds": round(seconds, 4),
        "samples_per_second": round(stats["samples"] / max(seconds, 1e-9), 1),
    }
    selection = val.get("val_selection")
    improved = validate and (selection is None or selection > run.best_metric)
    if improved:
        run.best_metric = selection if selection is not None else -math.inf
        run.best_epoch = epoch
    row["best"] = improved
    run.history.append(row)
    run.epoch = epoch
    if improved or epoch == end_epoch or epoch % config.checkpoint_every == 0:  # the same on every rank
        payload = run.checkpoint()  # collective when sharded
        if run.rundir is not None:
            run.rundir.commit_epoch(payload, improved=improved)
    return row


def _final_evaluation(run: _Run, *, report: bool) -> dict[str, Any]:
    """Test metrics of the best checkpoint, once (rank 0, full evaluation sets), to every rank."""
    metrics: dict[str, Any] = {}
    if run.rundir is not None:
        own = copy.deepcopy(run.model) if run.config.model == CUSTOM_MODEL else None  # best.pt goes into it
        metrics, arrays, knn, _ = evaluate_checkpoint(
            run.run_dir,
            splits=run.splits,
            device=run.device,
            model=own,
            trials=run.config.trials,
            trials_norm=run.config.trials_norm or "none",
            trials_top_k=run.config.trials_top_k,
        )
        skipped = sorted(set(run.splits.info.get("skipped_samples", [])) | set(run.loader.skipped))
        if skipped or run.splits.on_bad_sample == "skip":  # never silently: counted, the first named
            metrics["skipped_samples"] = len(skipped)
            metrics["skipped_examples"] = skipped[:20]
            if skipped:
                run.log(f"skipped {len(skipped)} bad sample(s) (on_bad_sample=skip), e.g. {skipped[0]}")
        run.rundir.write_results(metrics, arrays, knn, report=report)
    return run.ctx.broadcast(metrics)


def _epoch_line(row: dict[str, Any], epochs: int) -> str:
    parts = [f"epoch {row['epoch']:>3}/{epochs}", f"loss {row['train_loss']:.4f}"]
    for key in ("val_knn_accuracy", "val_precision_at_1", "val_eer", "val_head_accuracy"):
        if key in row and row[key] is not None:
            parts.append(f"{key} {row[key]:.4f}")
    parts.append(f"{row['samples_per_second']:.0f} samples/s")
    if row.get("best"):
        parts.append("*")
    return "  ".join(parts)
