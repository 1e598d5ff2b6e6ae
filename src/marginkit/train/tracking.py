"""Opt-in experiment tracking: TensorBoard event files and MLflow runs (``tracking`` in the config).

``tracking: {tensorboard: true}`` writes the run's metrics with ``torch.utils.tensorboard``
(it needs the ``tensorboard`` package) into ``RUN_DIR/tensorboard`` (or the directory given);
``tracking: {mlflow: true}`` logs an MLflow run into the local store ``RUN_DIR/mlflow.db``
(SQLite, artefacts beside it in ``RUN_DIR/mlartifacts``) or into the tracking URI given
(``sqlite:///PATH``, ``http://HOST:PORT``, ...), under ``experiment`` (default ``marginkit``)
and ``run_name`` (default: the run directory's name). Neither library is imported unless asked.

What is logged:

- every epoch's row of ``metrics.jsonl`` (loss, learning rate, validation scores, speed) as
  scalars at step = epoch;
- the config: MLflow parameters (nested options as dotted keys), TensorBoard text;
- at the end, the test metrics (numbers, nested keys joined by ``/``) and, in MLflow, the
  report (``report.html``, ``metrics.json``, ``config.yaml``) as artefacts.

A resumed run continues its MLflow run (its id is kept in ``RUN_DIR/tracking.json``) and
writes TensorBoard events with ``purge_step`` at the resumed epoch, so epochs that a crash made
the run repeat are shown once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from marginkit._lazy import MissingExtraError, require
from marginkit.train.errors import ConfigError

__all__ = ["Tracker", "flat_numbers", "flat_params", "open_tracker", "prepare_mlflow", "resolve_tracking"]

TRACKING_FILE = "tracking.json"
DEFAULT_EXPERIMENT = "marginkit"


def flat_numbers(value: Any, prefix: str = "", sep: str = "/") -> dict[str, float]:
    """Finite numbers of a nested mapping (booleans and lists left out), keys joined by ``sep``."""
    out: dict[str, float] = {}
    if isinstance(value, Mapping):
        for key, item in value.items():
            out.update(flat_numbers(item, f"{prefix}{sep}{key}" if prefix else str(key), sep))
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        out[prefix] = float(value)
    return out


def flat_params(config: Mapping[str, Any]) -> dict[str, str]:
    """The config as MLflow parameters: nested options as dotted keys, values as text."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update({f"{key}.{k}": v for k, v in flat_params(value).items()})
        else:
            out[str(key)] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


def resolve_tracking(tracking: Mapping[str, Any], run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``tracking`` with its defaults made explicit for ``run_dir`` (absolute paths, names)."""
    run_dir = Path(run_dir).resolve()
    out: dict[str, Any] = {}
    if tracking.get("tensorboard"):
        value = tracking["tensorboard"]
        out["tensorboard"] = str(
            run_dir / "tensorboard" if value is True else Path(value).expanduser().resolve()
        )
    if tracking.get("mlflow"):
        value = tracking["mlflow"]
        out["mlflow"] = f"sqlite:///{run_dir / 'mlflow.db'}" if value is True else str(value)
        out["experiment"] = str(tracking.get("experiment") or DEFAULT_EXPERIMENT)
        out["run_name"] = str(tracking.get("run_name") or run_dir.name)
    return out


def _mlflow_client(uri: str) -> Any:
    require("mlflow", extra="tracking", purpose="tracking.mlflow")
    import logging

    from mlflow import MlflowClient

    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # its table-creation notes
    try:
        return MlflowClient(tracking_uri=uri)
    except Exception as exc:
        raise _store_error(uri, exc) from None


def _artifact_root(uri: str) -> str | None:
    """A local SQLite store keeps its artefacts beside the database file (MLflow's default is
    the working directory)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").resolve().as_uri()
    return None


def prepare_mlflow(uri: str, experiment: str) -> str:
    """The id of ``experiment`` in the store at ``uri``, created if needed (concurrent runs of a
    comparison call this first, once, so they never race to create it)."""
    client = _mlflow_client(uri)
    try:
        found = client.get_experiment_by_name(experiment)
    except Exception as exc:
        raise _store_error(uri, exc) from None
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(experiment, artifact_location=_artifact_root(uri)))
    except Exception:  # created meanwhile by another process
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise
        return str(found.experiment_id)


class Tracker:
    """The run's TensorBoard writer and MLflow run (either may be absent)."""

    def __init__(self, settings: Mapping[str, Any], run_dir: Path, config: Any, *, start_epoch: int) -> None:
        self.run_dir = Path(run_dir)
        self.writer: Any = None
        self.client: Any = None
        self.run_id: str | None = None
        if "tensorboard" in settings:
            require(
                "torch.utils.tensorboard",
                package="tensorboard",
                extra="tracking",
                purpose="tracking.tensorboard",
            )
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(settings["tensorboard"], purge_step=start_epoch + 1)
            if start_epoch == 0:
                self.writer.add_text("config", "```\n" + config.to_yaml() + "```", 0)
        if "mlflow" in settings:
            self._start_mlflow(settings, config, resume=start_epoch > 0)

    def _start_mlflow(self, settings: Mapping[str, Any], config: Any, *, resume: bool) -> None:
        self.client = _mlflow_client(settings["mlflow"])
        record = self.run_dir / TRACKING_FILE
        if resume and record.is_file():
            try:
                previous = json.loads(record.read_text(encoding="utf-8")).get("mlflow_run_id")
                self.client.get_run(previous)
                self.run_id = str(previous)
                self.client.update_run(self.run_id, status="RUNNING")
                return
            except Exception:  # gone from the store, or another store: a new MLflow run
                self.run_id = None
        experiment = prepare_mlflow(settings["mlflow"], settings["experiment"])
        run = self.client.create_run(experiment, run_name=settings["run_name"])
        self.run_id = run.info.run_id
        params = flat_params({k: v for k, v in config.to_dict().items() if k != "tracking"})
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        from marginkit.train.rundir import atomic_write_text

        atomic_write_text(
            json.dumps({"mlflow_run_id": self.run_id, "tracking_uri": settings["mlflow"]}), record
        )

    def _scalars(self, values: Mapping[str, float], step: int, *, tensorboard: str, mlflow: str) -> None:
        """``values`` at ``step``: TensorBoard tags ``tensorboard/KEY``, MLflow keys ``mlflowKEY``
        (``/`` as ``.``), in batches of MLflow's limit."""
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(f"{tensorboard}/{key}", value, step)
            self.writer.flush()
        if self.client is not None:
            from mlflow.entities import Metric

            stamp = _now_ms()
            items = [Metric(mlflow + k.replace("/", "."), v, stamp, step) for k, v in sorted(values.items())]
            for i in range(0, len(items), 500):
                self.client.log_batch(self.run_id, metrics=items[i : i + 500])

    def log_epoch(self, row: Mapping[str, Any]) -> None:
        """One epoch's row (``metrics.jsonl``) at step = epoch."""
        values = {k: v for k, v in flat_numbers(row).items() if k != "epoch"}
        self._scalars(values, int(row["epoch"]), tensorboard="train", mlflow="")

    def finish(self, metrics: Mapping[str, Any], epoch: int) -> None:
        """The test metrics at the last epoch, and (MLflow) the report's files as artefacts."""
        values = flat_numbers({k: v for k, v in metrics.items() if k not in ("epoch", "best_epoch")})
        self._scalars(values, epoch, tensorboard="test", mlflow="test.")
        if self.client is not None:
            for name in ("report.html", "metrics.json", "config.yaml"):
                if (self.run_dir / name).is_file():
                    self.client.log_artifact(self.run_id, str(self.run_dir / name))
            self.client.set_terminated(self.run_id)

    def close(self, *, failed: bool = False) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.client is not None and failed:
            with contextlib.suppress(Exception):  # the store is unreachable: the run stays RUNNING there
                self.client.set_terminated(self.run_id, status="KILLED")
        self.client = None


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def open_tracker(config: Any, run_dir: Path, *, start_epoch: int) -> Tracker | None:
    """The run's :class:`Tracker`, or ``None`` when ``config.tracking`` asks for nothing."""
    settings = resolve_tracking(config.tracking, run_dir)
    if not settings:
        return None
    try:
        return Tracker(settings, run_dir, config, start_epoch=start_epoch)
    except (ConfigError, MissingExtraError):
        raise
    except Exception as exc:  # an unusable store or directory: before any epoch is trained
        raise ConfigError(f"tracking {settings}: {_first_line(exc)}") from None


def _store_error(uri: str, exc: BaseException) -> ConfigError:
    return ConfigError(f"tracking.mlflow {uri!r}: not a usable MLflow store ({_first_line(exc)})")


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: " + (str(exc).strip().splitlines() or [""])[0][:300]
