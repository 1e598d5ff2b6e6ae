"""``marginkit compare`` and ``marginkit demo``: several losses, same data, backbone and budget.

Each (loss, seed) pair is trained into ``OUT/runs/LOSS/seedS`` with the same options except
the loss (and its registry defaults); the summary aggregates the test metrics as mean ± std
over seeds into ``OUT/summary.json`` (a list of rows, one per loss), ``OUT/summary.md``,
``OUT/summary.csv``, ``OUT/comparison.png`` and ``OUT/report.html``.

Rerunning a comparison into the same directory reuses finished runs with identical options
and resumes interrupted ones (``--overwrite`` starts afresh).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from marginkit.cli.errors import UserError, user_errors

__all__ = ["DEMO_LOSSES", "DEMO_OPTIONS", "aggregate", "markdown_table", "run_compare", "run_demo"]

#: Headline metrics of the comparison table, in order.
TABLE_METRICS = ("knn_accuracy", "head_accuracy", "precision_at_1", "r_precision", "map_at_r")

#: ``--protocol`` results in a comparison's rows: metrics.json key -> column prefix.
PROTOCOL_COLUMNS = {"verification": "ver", "verification_normalized": "ver_norm", "templates": "tpl",
                    "templates_normalized": "tpl_norm", "identification": "id"}  # fmt: skip
PROTOCOL_SCORES = (
    "eer", "tar_at_far", "auc", "min_dcf", "cllr", "min_cllr", "actual_dcf", "cmc", "dir_at_fpir",
)  # fmt: skip
#: ``--trials`` results in a comparison's rows, as ``trials_<key>`` (``trials_min_dcf_0.01``, ...).
TRIAL_SCORES = ("eer", "min_dcf_0.01", "min_dcf_0.05", "tar_at_far", "auc", "num_trials")

#: The demo: eight losses on mnist1d with the cnn1d backbone.
DEMO_LOSSES = ("softmax", "cosface", "arcface", "qmargin", "mep", "circle", "triplet", "local_triplet")

#: The demo's shared budget (every loss: same backbone, epochs, batch size, embedding size).
DEMO_OPTIONS: dict[str, Any] = {
    "data": "mnist1d",
    "model": "cnn1d",
    "embedding_dim": 64,
    "epochs": 8,
    "batch_size": 128,
    "samples_per_class": 12,  # pair losses: 10 classes x 12 = 120 samples per batch
    "lr": 3e-3,
    "weight_decay": 5e-4,
    "scheduler": "cosine",
    "warmup_epochs": 1,
    "k": 5,
    "num_threads": 1,  # one thread per run, runs in parallel processes (--jobs)
}

#: Per-loss adjustments of the demo (learning rate / loss options only; budget unchanged).
DEMO_PER_LOSS: dict[str, dict[str, Any]] = {}


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _loss_pairs_for(loss: str, pairs: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Drop loss options that ``loss`` does not take (a comparison mixes losses)."""
    from marginkit.train.registry import LOSSES, _accepted

    names, var_kw = _accepted(LOSSES[loss])
    out: list[tuple[str, Any]] = []
    for key, value in pairs:
        k = str(key)
        if k.startswith("loss_options."):
            if var_kw or k.split(".", 1)[1] in names:
                out.append((key, value))
        elif k.replace("-", "_") == "loss_options" and isinstance(value, dict):
            out.append((key, {a: b for a, b in value.items() if var_kw or a in names}))
        elif k.replace("-", "_") == "loss":
            continue
        else:
            out.append((key, value))
    return out


def _check_losses(losses: Sequence[str]) -> None:
    from marginkit.train.config import suggest
    from marginkit.train.registry import LOSSES

    for loss in losses:
        if loss not in LOSSES:
            raise UserError(f"unknown loss {loss!r}{suggest(loss, LOSSES)}; valid: {', '.join(LOSSES)}")
    if len(set(losses)) != len(losses):
        raise UserError("--losses lists a loss twice")


def _check_loss_options(losses: Sequence[str], pairs: Sequence[tuple[str, Any]]) -> None:
    """Every loss option must be taken by at least one of the compared losses."""
    from marginkit.train.config import suggest
    from marginkit.train.registry import LOSSES, _accepted

    accepted: set[str] = set()
    for loss in losses:
        names, var_kw = _accepted(LOSSES[loss])
        if var_kw:
            return
        accepted |= names
    keys: list[str] = []
    for key, value in pairs:
        k = str(key)
        if k.startswith("loss_options."):
            keys.append(k.split(".", 1)[1])
        elif k.replace("-", "_") == "loss_options" and isinstance(value, dict):
            keys.extend(str(a) for a in value)
    for key in keys:
        if key not in accepted:
            raise UserError(
                f"no loss of {', '.join(losses)} has option {key!r}{suggest(key, sorted(accepted))}; "
                f"their options: {', '.join(sorted(accepted))}"
            )


def base_config(losses: Sequence[str], pairs: Sequence[tuple[str, Any]]) -> Any:
    """The shared options of a comparison (validated with the first loss)."""
    from marginkit.train.config import ConfigError, TrainConfig, apply_overrides

    _check_losses(losses)
    _check_loss_options(losses, pairs)
    try:
        return apply_overrides(TrainConfig(), [*_loss_pairs_for(losses[0], pairs), ("loss", losses[0])])
    except ConfigError as exc:
        raise UserError(str(exc)) from exc


def _flat_numbers(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat_numbers(f"{prefix}_{k}" if prefix else str(k), v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = float(value)


def _row_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    row: dict[str, float] = {}
    for key in TABLE_METRICS:
        v = metrics.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            row[key] = float(v)
    if isinstance(metrics.get("verification"), dict):  # every number, as before `--protocol`
        skip = ("calibration", "confidence_intervals")  # each run's metrics.json holds them
        ver = {k: v for k, v in metrics["verification"].items() if k not in skip}
        _flat_numbers("ver", ver, row)
    for key, prefix in PROTOCOL_COLUMNS.items():  # `--protocol`: the scores only, not the bookkeeping
        block = metrics.get(key)
        if isinstance(block, dict) and key != "verification":
            _flat_numbers(prefix, {k: v for k, v in block.items() if k in PROTOCOL_SCORES}, row)
    if isinstance(metrics.get("trials"), dict):
        _flat_numbers("trials", {k: v for k, v in metrics["trials"].items() if k in TRIAL_SCORES}, row)
    return row


def aggregate(loss: str, per_seed: list[dict[str, float]]) -> dict[str, Any]:
    """Mean and sample standard deviation (``None`` for one seed) of each metric."""
    keys: list[str] = []
    for m in per_seed:
        keys.extend(k for k in m if k not in keys)
    row: dict[str, Any] = {"loss": loss, "n_seeds": len(per_seed)}
    for key in keys:
        vals = [m[key] for m in per_seed if key in m and m[key] is not None and math.isfinite(m[key])]
        if not vals:
            row[key], row[f"{key}_std"] = None, None
            continue
        mean = sum(vals) / len(vals)
        row[key] = mean
        row[f"{key}_std"] = (
            math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
        )
    return row


def summary_row(
    loss: str, per_seed: list[dict[str, Any]], seconds: Sequence[float | None], runs: Sequence[str | Path]
) -> dict[str, Any]:
    """One row of ``summary.json`` from the ``metrics.json`` of each seed's run of ``loss``:
    the headline and ``--protocol`` figures (mean and ``_std``), ``kind``, ``seconds``, ``runs``."""
    from marginkit.train.registry import LOSSES

    row = aggregate(loss, [_row_metrics(m) for m in per_seed])
    row["kind"] = LOSSES[loss].kind
    row["open_set"] = any(bool(m.get("open_set")) for m in per_seed)
    row["protocol"] = next((m["protocol"] for m in per_seed if m.get("protocol")), None)
    known = [t for t in seconds if t is not None]
    row["seconds"] = sum(known) / len(known) if known else None
    row["runs"] = [str(p) for p in runs]
    return row


def baseline_rows(configs: Sequence[Any], *, protocol: Any = None) -> list[dict[str, Any]]:
    """Rows of the baselines (:mod:`marginkit.train.baselines`) on the data of each seed's config,
    aggregated over the seeds as the losses' rows are (``kind: "baseline"``)."""
    from marginkit.train.baselines import BASELINES, evaluate_baselines
    from marginkit.train.components import load_splits

    per_seed: dict[str, list[dict[str, Any]]] = {}
    for config in configs:
        with user_errors("baselines: "):
            results = evaluate_baselines(load_splits(config, cache=True), config, protocol=protocol)
        for name, metrics in results.items():
            per_seed.setdefault(name, []).append(metrics)
    rows = []
    for name, found in per_seed.items():
        row = aggregate(name, [_row_metrics(m) for m in found])
        row.update(kind="baseline", description=BASELINES[name], seconds=None, runs=[])
        row["open_set"] = any(bool(m.get("open_set")) for m in found)
        rows.append(row)
    return rows


def write_run_summary(run_dir: str | Path, metrics: dict[str, Any], loss: str) -> Path:
    """Write ``RUN/summary.json`` of one run (atomically, under the run directory's lock): a list
    of one row, as the rows of a comparison's ``summary.json`` (one seed: each ``_std`` null)."""
    from marginkit.train.errors import RunDirError
    from marginkit.train.rundir import RunDir, atomic_write_text

    seconds = metrics.get("train_seconds")
    row = summary_row(
        loss, [metrics], [float(seconds) if isinstance(seconds, (int, float)) else None], [run_dir]
    )
    path = Path(run_dir) / "summary.json"
    try:
        with RunDir(run_dir, create=False):
            atomic_write_text(json.dumps([row], indent=2) + "\n", path)
    except RunDirError as exc:
        raise UserError(str(exc)) from None
    return path


def _cell(row: dict[str, Any], key: str) -> str:
    v, s = row.get(key), row.get(f"{key}_std")
    if v is None:
        return "—"
    if key == "seconds":
        return f"{v:.1f}"
    return f"{v:.4f}" + (f" ± {s:.4f}" if s is not None else "")


def markdown_table(summary: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    """The comparison as a Markdown table (mean ± std when several seeds)."""
    head = "| loss | " + " | ".join(metrics) + " |"
    sep = "|---|" + "|".join("---:" for _ in metrics) + "|"
    lines = [head, sep]
    for row in summary:
        label = f"{row['loss']} (baseline)" if row.get("kind") == "baseline" else row["loss"]
        lines.append(f"| {label} | " + " | ".join(_cell(row, m) for m in metrics) + " |")
    return "\n".join(lines)


_NOT_COLUMNS = ("loss", "kind", "n_seeds", "runs", "seconds", "description", "open_set", "protocol")


#: Columns of the printed tables: the headline metrics and the protocols' scores (verification of
#: closed-set runs only in the report); the rest of a row (thresholds, cost parameters, pair
#: counts) stays in summary.json.
_TABLE_COLUMN = re.compile(
    rf"({'|'.join(TABLE_METRICS)}"
    r"|(ver|ver_norm|tpl|tpl_norm)_(eer|auc|min_dcf|cllr|min_cllr|actual_dcf|tar_at_far_.+)"
    r"|id_(cmc|dir_at_fpir)_.+"
    r"|trials_(eer|min_dcf_0\.01|min_dcf_0\.05|tar_at_far_.+))"
)


def _columns(summary: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for row in summary:
        for key in row:
            if key.endswith("_std") or key in _NOT_COLUMNS or key in cols or not _TABLE_COLUMN.fullmatch(key):
                continue
            if key.startswith("ver_") and not (row.get("open_set") or row.get("protocol")):
                continue  # a closed-set run's test pairs, unasked: in summary.json and the report
            cols.append(key)
    order = {k: i for i, k in enumerate(TABLE_METRICS)}
    first_seen = {k: i for i, k in enumerate(cols)}
    cols = sorted(cols, key=lambda k: (order.get(k, len(order)), first_seen[k]))
    return [*cols, "seconds"]  # mean training time per run (epochs only, not evaluation)


def _trials_scored_as(metrics: dict[str, Any], config: Any) -> bool:
    """Whether ``metrics["trials"]`` scored ``config.trials`` normalised as ``config`` asks."""
    got = metrics.get("trials") or {}
    if got.get("source") != config.trials:
        return False
    norm = str(got.get("norm", "none"))
    if config.trials_norm != "as-norm":
        return norm == "none"
    kept = re.fullmatch(r"as-norm \(top (\d+) of (\d+) cohort rows\)", norm)
    return kept is not None and int(kept[1]) == min(config.trials_top_k, int(kept[2]))


def _run_one(
    config: Any, run_dir: Path, *, splits: Any, overwrite: bool, protocol: Any = None
) -> dict[str, Any]:
    """Train one run of the comparison, or reuse it (finished) or resume it (interrupted);
    then evaluate ``protocol`` on it unless its metrics.json holds that protocol already."""
    res = _train_one(config, run_dir, splits=splits, overwrite=overwrite)
    # a reused run evaluated with another protocol (or with one, when none is asked), or without
    # this comparison's trial list and its normalisation, is re-evaluated
    if res["metrics"].get("protocol") != (protocol.as_dict() if protocol is not None else None) or (
        config.trials and not _trials_scored_as(res["metrics"], config)
    ):
        from marginkit.train.evaluate import evaluate_run

        with user_errors(f"{run_dir}: "):
            res["metrics"] = evaluate_run(
                run_dir, splits=splits, protocol=protocol, trials=config.trials,
                trials_norm=config.trials_norm or "none", trials_top_k=config.trials_top_k,
            )  # fmt: skip
    return res


def _train_one(config: Any, run_dir: Path, *, splits: Any, overwrite: bool) -> dict[str, Any]:
    from marginkit.train.errors import CheckpointError, ConfigError, RunDirError
    from marginkit.train.rundir import config_differences, load_checkpoint, run_is_complete, stored_config
    from marginkit.train.small_data import resolve_epochs
    from marginkit.train.trainer import train

    config = resolve_epochs(config, len(splits.train))  # epochs: null -> from the data's size
    last = run_dir / "last.pt"
    resume = False
    try:
        if last.is_file() and not overwrite:
            diff = config_differences(stored_config(load_checkpoint(last), last), config)
            if diff:
                raise UserError(
                    f"{str(run_dir)!r} holds a run with other options ({', '.join(diff)}); "
                    "use --overwrite or another --out"
                )
            if run_is_complete(run_dir, config.epochs):
                return {
                    "metrics": json.loads((run_dir / "metrics.json").read_text()),
                    "seconds": 0.0,
                    "reused": True,
                }
            resume = True
        result = train(config, run_dir, resume=resume, overwrite=overwrite, quiet=True, splits=splits)
    except (ConfigError, RunDirError, CheckpointError) as exc:
        raise UserError(str(exc)) from exc
    return {"metrics": result.metrics, "seconds": result.seconds, "reused": False}


def _worker(config_json: str, run_dir: str, overwrite: bool, protocol: Any = None) -> dict[str, Any]:
    """One run in a worker process of ``compare --jobs N``."""
    from marginkit.train.components import load_splits
    from marginkit.train.config import TrainConfig

    config = TrainConfig.from_json(config_json)
    with user_errors():
        splits = load_splits(config, cache=True)
    return _run_one(config, Path(run_dir), splits=splits, overwrite=overwrite, protocol=protocol)


def _write_summaries(out: Path, summary: list[dict[str, Any]], table: str, cols: Sequence[str]) -> None:
    from marginkit.train.errors import RunDirError
    from marginkit.train.rundir import atomic_write_text

    text = io.StringIO(newline="")
    w = csv.writer(text)
    header = ["loss", "kind", "n_seeds"]
    for c in cols:
        header += [c, f"{c}_std"] if c != "seconds" else [c]
    w.writerow(header)
    for row in summary:
        w.writerow([row.get(h) if row.get(h) is not None else "" for h in header])
    try:
        atomic_write_text(table + "\n", out / "summary.md")
        atomic_write_text(json.dumps(summary, indent=2) + "\n", out / "summary.json")
        atomic_write_text(text.getvalue(), out / "summary.csv")
    except RunDirError as exc:
        raise UserError(str(exc)) from None


def run_compare(
    base: Any,
    losses: Sequence[str],
    *,
    seeds: int,
    out: str | Path,
    quiet: bool = False,
    overwrite: bool = False,
    file_pairs: Sequence[tuple[str, Any]] = (),
    cli_pairs: Sequence[tuple[str, Any]] = (),
    per_loss: dict[str, dict[str, Any]] | None = None,
    title: str = "marginkit comparison",
    jobs: int = 1,
    protocol: Any = None,
    baselines: bool = True,
) -> tuple[str, Path]:
    """Train every loss for ``seeds`` seeds and write the summary files; returns the
    Markdown table and the report's path.

    ``baselines``: add the rows of :mod:`marginkit.train.baselines` (raw-input 1-NN and logistic
    regression on closed-set data, raw inputs and whitened PCA on open-set data), scored on the
    same splits by the same evaluation (``kind: "baseline"`` in ``summary.json``).

    ``protocol`` (:class:`marginkit.train.protocols.ProtocolOptions`): evaluate it on every
    run after training (its scores join the rows; see :data:`PROTOCOL_COLUMNS`).

    ``jobs > 1`` trains that many runs at once in separate processes (spawned; each run
    keeps its own seed and thread count, so the results equal a sequential comparison). Each
    run uses ``cores // jobs`` threads unless ``num_threads`` is set. The workers die with this
    process; interrupted, a comparison continues where it stopped when run again (finished runs
    are reused, the others resumed from their last epoch). ``out`` is locked meanwhile.
    """
    from marginkit.train.errors import RunDirError
    from marginkit.train.rundir import RunDir

    _check_losses(losses)
    _check_loss_options(losses, [*file_pairs, *cli_pairs])
    if seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {seeds}")
    try:
        lock = RunDir(out)
    except RunDirError as exc:
        raise UserError(str(exc)) from None
    with lock:
        return _compare_into(
            base, losses, seeds=seeds, out=lock.path, quiet=quiet, overwrite=overwrite,
            pairs=[*file_pairs, *cli_pairs], per_loss=per_loss, title=title, jobs=jobs, protocol=protocol,
            baselines=baselines,
        )  # fmt: skip


def run_configs(
    base: Any,
    losses: Sequence[str],
    *,
    seeds: int,
    pairs: Sequence[tuple[str, Any]],
    per_loss: dict[str, dict[str, Any]] | None,
    jobs: int,
) -> dict[tuple[str, int], Any]:
    """The config of every ``(loss, seed index)`` run; ``num_threads`` defaults to ``cores // jobs``."""
    from marginkit.train.components import resolve_device
    from marginkit.train.config import ConfigError, TrainConfig, apply_overrides
    from marginkit.train.runtime import choose_threads

    try:
        resolve_device(base.device)  # an unavailable device fails like a typo, before the data loads
    except ConfigError as exc:
        raise UserError(str(exc)) from exc
    configs: dict[tuple[str, int], Any] = {}
    for loss in losses:
        loss_pairs = _loss_pairs_for(loss, pairs)
        extra = list((per_loss or {}).get(loss, {}).items())
        for s in range(seeds):
            try:
                cfg = apply_overrides(
                    TrainConfig(), [*loss_pairs, *extra, ("loss", loss), ("seed", base.seed + s)]
                )
            except ConfigError as exc:
                raise UserError(f"{loss}: {exc}") from exc
            configs[(loss, s)] = dataclasses.replace(cfg, num_threads=choose_threads(jobs, cfg.num_threads))
    return configs


def _tracked(
    configs: dict[tuple[str, int], Any], tracking: dict[str, Any], out: Path, *, seed0: int
) -> dict[tuple[str, int], Any]:
    """Tracking of a comparison: TensorBoard in each run's directory (point TensorBoard at OUT),
    one MLflow run per loss and seed, named ``LOSS-seedS``, in one experiment (OUT's name) of one
    store (``OUT/mlflow.db`` unless a URI is given), created here before any run starts."""
    settings = dict(tracking)
    if settings.get("mlflow"):
        from marginkit.train.tracking import prepare_mlflow

        if settings["mlflow"] is True:
            settings["mlflow"] = f"sqlite:///{out.resolve() / 'mlflow.db'}"
        settings.setdefault("experiment", out.resolve().name)
        with user_errors():
            prepare_mlflow(settings["mlflow"], settings["experiment"])
    return {
        (loss, s): dataclasses.replace(cfg, tracking={**settings, "run_name": f"{loss}-seed{seed0 + s}"})
        for (loss, s), cfg in configs.items()
    }


def _compare_into(
    base: Any,
    losses: Sequence[str],
    *,
    seeds: int,
    out: Path,
    quiet: bool,
    overwrite: bool,
    pairs: Sequence[tuple[str, Any]],
    per_loss: dict[str, dict[str, Any]] | None,
    title: str,
    jobs: int,
    protocol: Any = None,
    baselines: bool = True,
) -> tuple[str, Path]:
    from marginkit.report import compare_plot, write_compare_report
    from marginkit.train.components import load_splits
    from marginkit.train.evaluate import data_note, selection_note
    from marginkit.train.processes import run_in_workers, sigterm_as_interrupt
    from marginkit.train.progress import RunsProgress
    from marginkit.train.runtime import available_cores
    from marginkit.train.small_data import resolve_epochs

    jobs = max(1, min(jobs, seeds * len(losses)))
    configs = run_configs(base, losses, seeds=seeds, pairs=pairs, per_loss=per_loss, jobs=jobs)
    if base.tracking:
        configs = _tracked(configs, base.tracking, out, seed0=base.seed)
    for key in sorted(configs, key=lambda k: k[1]):  # seed-major: each seed's data is loaded once
        cfg = configs[key]
        if cfg.epochs is None:  # null: from the data's size (the progress bar counts epochs)
            with user_errors():
                configs[key] = resolve_epochs(cfg, len(load_splits(cfg, cache=True).train))
    total = len(configs)
    threads = sorted({c.num_threads for c in configs.values()})
    first = configs[(losses[0], 0)]
    with user_errors():
        splits = load_splits(first, cache=True)
    _log(data_note(splits), quiet)  # the seeds share the data's classes and test split
    _log(selection_note(first, splits), quiet)
    _log(
        f"{total} run(s), {jobs} at a time, {'/'.join(map(str, threads))} torch thread(s) each "
        f"({available_cores()} cores available)",
        quiet,
    )
    per_seed: dict[str, dict[int, dict[str, Any]]] = {loss: {} for loss in losses}
    seconds: dict[str, list[float]] = {loss: [] for loss in losses}
    runs: dict[str, list[Path]] = {loss: [out / "runs" / loss / f"seed{base.seed + s}" for s in range(seeds)]
                                   for loss in losses}  # fmt: skip
    order = [(loss, s) for s in range(seeds) for loss in losses]
    t0 = time.perf_counter()
    progress = RunsProgress(
        {key: (configs[key].epochs, runs[key[0]][key[1]] / "metrics.jsonl") for key in order},
        desc=f"{total} runs", enabled=not quiet,
    )  # fmt: skip

    reused: list[float] = []  # training seconds of the runs reused from an earlier invocation
    reused_of: dict[str, int] = dict.fromkeys(losses, 0)

    def record(loss: str, s: int, res: dict[str, Any]) -> None:
        per_seed[loss][s] = res["metrics"]
        if res["reused"]:
            reused.append(float(res["metrics"].get("train_seconds") or 0.0))
            reused_of[loss] += 1
        row = _row_metrics(res["metrics"])
        seconds[loss].append(float(res["metrics"].get("train_seconds", res["seconds"])))
        tag = " (reused)" if res["reused"] else f" ({res['seconds']:.1f} s)"
        progress.finish(
            (loss, s),
            f"{loss:<14} seed {base.seed + s}: "
            + "  ".join(f"{k} {row[k]:.4f}" for k in ("knn_accuracy", "map_at_r") if k in row)
            + tag,
            reused=res["reused"],
        )

    with sigterm_as_interrupt():  # a terminated comparison stops like an interrupted one
        if jobs <= 1:
            for loss, s in progress.wrap(order):
                cfg = configs[(loss, s)]
                with user_errors():
                    splits = load_splits(cfg, cache=True)
                res = _run_one(cfg, runs[loss][s], splits=splits, overwrite=overwrite, protocol=protocol)
                record(loss, s, res)
        else:
            tasks = [
                (configs[key].to_json(), str(runs[key[0]][key[1]]), overwrite, protocol) for key in order
            ]
            for index, res in progress.wrap(run_in_workers(_worker, tasks, jobs)):
                record(*order[index], res)
    summary = [
        {
            **summary_row(loss, [per_seed[loss][s] for s in range(seeds)], seconds[loss], runs[loss]),
            "reused_runs": reused_of[loss],
        }
        for loss in losses
    ]
    if baselines:
        summary.extend(baseline_rows([configs[(losses[0], s)] for s in range(seeds)], protocol=protocol))
    cols = _columns(summary)
    table = markdown_table(summary, cols)
    _write_summaries(out, summary, table, cols)
    plot_metrics = [m for m in ("knn_accuracy", "map_at_r", "precision_at_1") if m in cols]
    compare_plot(summary, plot_metrics, out / "comparison.png")
    report = write_compare_report(
        out,
        summary,
        runs,
        title=title,
        metrics=plot_metrics,
        notes=_time_note(reused, time.perf_counter() - t0),
    )
    return table, report


def _time_note(reused: Sequence[float], wall: float) -> str:
    """What this invocation took; runs reused from an earlier one are counted apart, with the
    training time they took then (a rerun that trains nothing is not a fast comparison)."""
    note = f"This invocation: {wall:.0f} s"
    if reused:
        note += (f", {len(reused)} run(s) reused from an earlier invocation into the same directory "
                 f"(their training took {sum(reused):.0f} s then)")  # fmt: skip
    return note + "."


def demo_jobs() -> int:
    """The demo's default ``--jobs``: min(2, the CPU cores this process may use). Its runs take
    one torch thread each (:data:`DEMO_OPTIONS`), so two of them use two cores."""
    from marginkit.train.runtime import available_cores

    return min(2, available_cores())


def run_demo(
    out: str | Path = "demo_out",
    *,
    seeds: int = 1,
    epochs: int | None = None,
    losses: Sequence[str] | None = None,
    quiet: bool = False,
    device: str = "cpu",
    jobs: int | None = None,
    overwrite: bool = False,
) -> tuple[str, Path, float]:
    """The README's main job: :data:`DEMO_LOSSES` on mnist1d with :data:`DEMO_OPTIONS`."""
    t0 = time.perf_counter()
    options = dict(DEMO_OPTIONS)
    if epochs is not None:
        options["epochs"] = epochs
    options["device"] = device
    chosen = list(losses) if losses else list(DEMO_LOSSES)
    pairs = list(options.items())
    base = base_config(chosen, pairs)
    _log(
        f"marginkit demo: {len(chosen)} losses on mnist1d, {options['epochs']} epochs each, "
        f"{seeds} seed(s) → {out}",
        quiet,
    )
    if jobs is None:
        jobs = demo_jobs()
    table, report = run_compare(
        base, chosen, seeds=seeds, out=out, quiet=quiet, cli_pairs=pairs, per_loss=DEMO_PER_LOSS,
        title="marginkit demo — margin losses on MNIST-1D", jobs=jobs, overwrite=overwrite,
    )  # fmt: skip
    return table, report, time.perf_counter() - t0
