"""Fair tuning: every loss gets the same number of Optuna TPE trials over its own hyper-parameters.

Each trial trains on a *development* draw of the tuning setting (its own seed, never one of
the evaluation seeds) and is scored by K-NN accuracy on a validation split carved from the
training pool — disjoint from the training subset, and never the test split. Every trial
is stored (``trials.json``, rewritten atomically after each); an interrupted job resumes from
it (the finished trials are told to the sampler, not re-run).

Optuna (``pip install 'marginkit[study]'``): Akiba et al., "Optuna: A Next-generation
Hyperparameter Optimization Framework", KDD 2019; TPE: Bergstra et al., NeurIPS 2011.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from marginkit._lazy import require

__all__ = ["PAPER", "QMARGIN_SPEAKER", "SPACES", "partial_result", "run_defaults", "run_tuning", "summarize"]

# (name, kind, low, high) — kind: "log" (float, log-uniform), "float", "int_log", or a tuple of choices.
_OPT = [("lr", "log", 3e-4, 1e-2), ("weight_decay", "log", 1e-5, 5e-2), ("epochs", "int_log", 15, 120)]
_PAIR = [("samples_per_class", (2, 5, 10), None, None)]

#: Search space of each loss (training options first, then ``loss_options.*``).
SPACES: dict[str, list[tuple[str, Any, Any, Any]]] = {
    "softmax": [*_OPT, ("loss_options.scale", "log", 4.0, 64.0)],
    "cosface": [*_OPT, ("loss_options.scale", "log", 4.0, 64.0), ("loss_options.margin", "float", 0.0, 0.5)],
    "arcface": [*_OPT, ("loss_options.scale", "log", 4.0, 64.0), ("loss_options.margin", "float", 0.0, 0.5)],
    "qmargin": [
        *_OPT,
        ("loss_options.alpha", "float", 1.05, 2.0),
        ("loss_options.scale", "log", 4.0, 64.0),
        ("loss_options.margin", "float", 0.0, 0.5),
    ],
    "mep": [*_OPT, ("loss_options.scale", "log", 4.0, 64.0), ("loss_options.margin", "log", 0.25, 16.0)],
    "circle": [
        *_OPT,
        *_PAIR,
        ("loss_options.gamma", "log", 16.0, 256.0),
        ("loss_options.margin", "float", 0.1, 0.45),
    ],
    "triplet": [
        *_OPT,
        *_PAIR,
        ("loss_options.margin", "log", 0.02, 1.0),
        ("loss_options.mining", ("batch_all", "batch_hard"), None, None),
    ],
    "local_triplet": [
        *_OPT,
        *_PAIR,
        ("loss_options.margin", "log", 0.02, 1.0),
        ("loss_options.k", (1, 3, 5, 10), None, None),
        ("loss_options.normalize", (True, False), None, None),
    ],
}

#: The second row per loss: its source's published settings (training schedule as the defaults').
PAPER: dict[str, tuple[str, dict[str, Any]]] = {
    "softmax": ("NormFace-style s = 16 (the previous default; NormFace learns s)", {"scale": 16.0}),
    "cosface": ("CosFace paper: s = 64, m = 0.35", {"scale": 64.0, "margin": 0.35}),
    "arcface": ("ArcFace paper: s = 64, m = 0.5", {"scale": 64.0, "margin": 0.5}),
    "qmargin": (
        "Q-Margin paper (face): α = 1.25, s = 35, m = 0.2",
        {"alpha": 1.25, "scale": 35.0, "margin": 0.2},
    ),
    "mep": (
        "MEP: s = 16, m = 4 (the previous default; the blog gives no training settings)",
        {"scale": 16.0, "margin": 4.0},
    ),
    "circle": (
        "Circle paper / PML (fine-grained retrieval): m = 0.4, γ = 80",
        {"margin": 0.4, "gamma": 80.0},
    ),
    "triplet": ("FaceNet: margin 0.2 on unit embeddings, batch-all", {"margin": 0.2, "mining": "batch_all"}),
    "local_triplet": ("the brief's formulation: margin 0.2, k = the K-NN's K", {"margin": 0.2}),
}
#: Q-Margin's speaker setting (the paper's summary: α = 1.5–1.75, s = 5–10), used on speakers.
QMARGIN_SPEAKER = (
    "Q-Margin paper (speaker): α = 1.75, s = 10, m = 0.2",
    {"alpha": 1.75, "scale": 10.0, "margin": 0.2},
)


def _suggest(trial: Any, name: str, kind: Any, low: Any, high: Any) -> Any:
    if isinstance(kind, tuple):
        return trial.suggest_categorical(name, list(kind))
    if kind == "log":
        return trial.suggest_float(name, low, high, log=True)
    if kind == "int_log":
        return trial.suggest_int(name, low, high, log=True)
    return trial.suggest_float(name, low, high)


def _objective(job: dict[str, Any], splits: Any, params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    from marginkit.train import TrainConfig, train
    from marginkit.train.config import apply_overrides
    from marginkit.train.small_data import resolve_epochs

    base = TrainConfig(
        data=job["data"],
        loss=job["loss"],
        seed=job["dev_seed"],
        train_per_class=job["per_class"],
        val_fraction=job["val_fraction"],
        num_threads=1,
        max_impostors=20_000,
    )
    cfg = resolve_epochs(apply_overrides(base, params), len(splits.train))
    cfg.eval_every = cfg.epochs  # score the final weights only (no selection inside a trial)
    cfg.checkpoint_every = cfg.epochs  # a trial interrupted is run again whole
    cfg.validate()
    with tempfile.TemporaryDirectory() as tmp:
        res = train(cfg, Path(tmp) / "run", splits=splits, quiet=True, report=False)
    last = res.history[-1]
    return float(last.get("val_knn_accuracy", math.nan)), {"seconds": round(res.seconds, 2)}


def _distributions(space: list[tuple[str, Any, Any, Any]]) -> dict[str, Any]:
    require("optuna", extra="study", purpose="the study's tuning")
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for name, kind, low, high in space:
        if isinstance(kind, tuple):
            out[name] = CategoricalDistribution(list(kind))
        elif kind == "int_log":
            out[name] = IntDistribution(low, high, log=True)
        else:
            out[name] = FloatDistribution(low, high, log=kind == "log")
    return out


def _finished_trials(path: Path, job: dict[str, Any]) -> list[dict[str, Any]]:
    """The trials an interrupted run of the same job stored (``[]`` if none or another job's)."""
    import json

    if not path.is_file():
        return []
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(stored, dict) or stored.get("job") != job:
        return []
    return list(stored.get("trials", []))[: job["trials"]]


def _development_splits(job: dict[str, Any]) -> Any:
    """The tuning setting's development draw, with its validation split from the training pool."""
    from marginkit.data import load_dataset
    from marginkit.train.small_data import MIN_VAL_PER_CLASS

    splits = load_dataset(
        job["data"],
        seed=job["dev_seed"],
        train_per_class=job["per_class"],
        val_fraction=job["val_fraction"],
        min_val_per_class=MIN_VAL_PER_CLASS,
    )
    if len(splits.val) == 0:
        raise ValueError(f"tuning {job['data']}: the validation split is empty")
    return splits


def run_defaults(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The registry defaults scored like one trial (same development draw and validation split):
    the tuning table's reference point, so a tuned best is read against what users get."""
    splits = _development_splits(job)
    value, extra = _objective(job, splits, dict(job.get("train_options", {})))
    result = {"val_knn_accuracy": value, **extra, "num_train": len(splits.train), "num_val": len(splits.val)}
    return {"config": job, "result": result}


def run_tuning(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One loss's study: ``job["trials"]`` TPE trials (seed ``job["sampler_seed"]``)."""
    import json

    optuna = require("optuna", extra="study", purpose="the study's tuning")

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    splits = _development_splits(job)
    space = SPACES[job["loss"]]
    sampler = optuna.samplers.TPESampler(
        seed=job["sampler_seed"], n_startup_trials=job["startup_trials"], multivariate=True
    )
    study = optuna.create_study(direction="maximize", sampler=sampler)
    trials = _finished_trials(run_dir / "trials.json", job)
    for t in trials:  # an interrupted tuning job resumes: finished trials are told, not re-run
        study.add_trial(
            optuna.trial.create_trial(
                params=t["params"], distributions=_distributions(space), value=t["val_knn_accuracy"]
            )
        )

    def objective(trial: Any) -> float:
        params = {name: _suggest(trial, name, kind, lo, hi) for name, kind, lo, hi in space}
        t0 = time.perf_counter()
        value, extra = _objective(job, splits, params)
        trials.append(
            {
                "number": trial.number,
                "params": params,
                "val_knn_accuracy": value,
                "seconds": round(time.perf_counter() - t0, 2),
                **extra,
            }
        )
        text = json.dumps({"job": job, "trials": trials}, indent=2) + "\n"
        tmp = run_dir / "trials.json.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, run_dir / "trials.json")
        return value

    study.optimize(objective, n_trials=max(0, job["trials"] - len(trials)))
    out = summarize(trials)
    out.update({"num_train": len(splits.train), "num_val": len(splits.val)})
    return {"config": job, "result": out}


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """The best trial (ties: the earliest) and every trial."""
    best = max(trials, key=lambda t: (t["val_knn_accuracy"], -t["number"]))
    return {
        "best_params": best["params"],
        "best_value": best["val_knn_accuracy"],
        "best_trial": best["number"],
        "trials": trials,
    }


def partial_result(job: dict[str, Any], out_dir: str | Path) -> dict[str, Any] | None:
    """An unfinished tuning job's stored trials as a result marked ``partial`` (None if none)."""
    trials = _finished_trials(Path(out_dir) / "runs" / job["name"] / "trials.json", job)
    if not trials:
        return None
    return {"job": job, "result": {**summarize(trials), "partial": True}, "seconds": 0.0, "reused": True}
