"""One unit of the study. A job is a JSON-able dict; :func:`run_job` writes ``job.json`` (its
full config) and ``result.json`` into ``OUT/runs/<name>/`` and returns the result.

Kinds: ``tune`` (one loss's Optuna study, :mod:`marginkit.study.tuning`), ``knn`` (small-data
K-NN classification through :func:`marginkit.train.train`), ``baseline`` (raw-input K-NN and a
logistic regression on the same subset), ``disjoint`` (train on half of the classes, retrieve
and verify on the unseen half), ``faces`` and ``faces_baseline`` (real faces, leave-people-out
folds: a loss, or raw pixels and Eigenfaces), ``identities`` (open-set verification at very low FAR),
``margin`` (cross-entropy, Crammer–Singer hinge and MEP, evaluated with fake-quantised weights)
and ``e2e`` (training-step throughput, backbone + head + loss and head + loss alone).

Every training run uses ``val_fraction = 0`` (the learner has only its N samples per class; the
last checkpoint is kept) and one intra-op thread (the models are tiny; more threads only spin
on shared cores). Nothing here ever looks at test data to choose anything.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FARS", "PRECISIONS", "crammer_singer_hinge", "fake_quantized", "run_job"]

#: False-accept rates of the verification tables (a FAR below 1/impostor pairs is reported as None).
FARS = (1e-2, 1e-3, 1e-4, 1e-5)
#: Weight precisions of the low-precision scenario.
PRECISIONS = ("fp32", "bf16", "fp16", "int8")


def crammer_singer_hinge(scores: torch.Tensor, labels: torch.Tensor, margin: float) -> torch.Tensor:
    r"""Crammer–Singer multi-class hinge, one value per row.

    .. math:: \ell(x, y) = \max\bigl(0,\; m + \max_{j \ne y} x_j - x_y\bigr)

    Source: Crammer & Singer, "On the Algorithmic Implementation of Multiclass Kernel-based
    Vector Machines", JMLR 2001. Zero (with zero gradient) once the row keeps margin ``m``.

    Args:
        scores: ``[B, C]`` floating, ``C >= 2``.
        labels: ``[B]`` int64 class ids.
        margin: ``m > 0``.
    """
    if scores.ndim != 2 or scores.shape[1] < 2:
        raise ValueError(f"scores must be [B, C] with C >= 2, got shape {tuple(scores.shape)}")
    x = scores.float()
    target = x.gather(1, labels[:, None]).squeeze(1)
    other = x.scatter(1, labels[:, None], -math.inf).amax(1)
    return torch.relu(margin + other - target)


@torch.no_grad()
def fake_quantized(module: nn.Module, precision: str) -> nn.Module:
    """A copy of ``module`` whose weight matrices / kernels (parameters with ``ndim >= 2``) are
    rounded to ``precision`` and stored back in float32 ("fake quantisation"); biases and
    batch-norm parameters stay float32, as in common post-training quantisation.

    ``bf16`` / ``fp16``: round to the nearest representable value. ``int8``: symmetric,
    per output channel (row 0 of the weight), ``w ≈ s · round(w / s)`` with
    ``s = max|w_row| / 127`` (Jacob et al., CVPR 2018, without the zero point).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    out = copy.deepcopy(module)
    if precision == "fp32":
        return out
    for p in out.parameters():
        if p.ndim < 2:
            continue
        w = p.data.float()
        if precision == "int8":
            scale = w.abs().flatten(1).amax(1).clamp_min(1e-12) / 127.0
            shape = (-1,) + (1,) * (w.ndim - 1)
            q = torch.round(w / scale.view(shape)).clamp(-127, 127) * scale.view(shape)
        else:
            q = w.to(torch.bfloat16 if precision == "bf16" else torch.float16).float()
        p.data.copy_(q)
    return out


# ---------------------------------------------------------------------------- helpers
def _load(data: str, seed: int, per_class: int | None, options: dict[str, Any] | None = None) -> Any:
    from marginkit.data import load_dataset

    return load_dataset(data, seed=seed, train_per_class=per_class, val_fraction=0.0, **(options or {}))


def _config(job: dict[str, Any], splits: Any) -> Any:
    from marginkit.train import TrainConfig
    from marginkit.train.config import apply_overrides
    from marginkit.train.small_data import resolve_epochs

    base = TrainConfig(
        data=job["data"],
        loss=job["loss"],
        seed=job["seed"],
        train_per_class=job.get("per_class"),
        val_fraction=0.0,
        data_options=job.get("data_options", {}),
        num_threads=1,
        max_impostors=20_000,
    )
    overrides = dict(job.get("train_options", {}))
    overrides.update({f"loss_options.{k}": v for k, v in job.get("loss_options", {}).items()})
    cfg = resolve_epochs(apply_overrides(base, overrides), len(splits.train))
    cfg.eval_every = cfg.epochs  # no validation split: evaluate once, keep the last weights
    cfg.checkpoint_every = cfg.epochs  # a job interrupted is run again whole: no resumable epochs
    return cfg.validate()


def _train(job: dict[str, Any], run_dir: Path, splits: Any) -> tuple[dict[str, Any], Any]:
    from marginkit.train import load_run, train

    config = _config(job, splits)
    result = train(config, run_dir / "train", splits=splits, quiet=True, report=False, overwrite=True)
    run = load_run(run_dir / "train", "best")
    return {"config": config.to_dict(), "metrics": result.metrics, "train_seconds": result.seconds}, run


def _verification(
    emb: torch.Tensor, labels: torch.Tensor, max_impostors: int | None = None
) -> dict[str, Any]:
    from marginkit.metrics import pair_scores, verification_metrics

    scores, genuine = pair_scores(emb, labels, max_impostors=max_impostors)
    ver = verification_metrics(scores, genuine, fars=FARS)
    return {
        "tar_at_far": {str(f): ver["tar_at_far"].get(f) for f in FARS},
        "eer": float(ver["eer"]),
        "min_dcf": float(ver["min_dcf"]),
        "num_impostor_pairs": int(ver["num_impostor"]),
        "num_genuine_pairs": int(ver["num_genuine"]),
    }


def _identification(emb: torch.Tensor, labels: torch.Tensor, seed: int) -> dict[str, Any]:
    """Open-set identification of ``marginkit eval --protocol identification``: half of the
    identities enrolled with one gallery sample each (seeded), their other samples mated probes,
    every sample of the rest a non-mated probe; CMC at ranks 1, 5, 10 and DIR at FPIR 1e-1,
    1e-2, 1e-3 (``None`` where the non-mated probes cannot resolve the rate)."""
    from marginkit.train.protocols import ProtocolOptions, evaluate_protocol

    metrics, _ = evaluate_protocol(
        ProtocolOptions(protocol="identification"), {"test": emb}, {"test": labels}, seed=seed
    )
    return json.loads(json.dumps(metrics["identification"]))  # the stored result's string keys


# ---------------------------------------------------------------------------- job kinds
def _job_tune(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    from marginkit.study.tuning import run_tuning

    return run_tuning(job, run_dir)


def _job_tune_defaults(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    from marginkit.study.tuning import run_defaults

    return run_defaults(job, run_dir)


def _job_knn(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    splits = _load(job["data"], job["seed"], job.get("per_class"), job.get("data_options"))
    out, _ = _train(job, run_dir, splits)
    m = out["metrics"]
    out["result"] = {
        key: m.get(key)
        for key in ("knn_accuracy", "head_accuracy", "map_at_r", "precision_at_1", "num_train")
    }
    out["result"]["epochs"] = out["config"]["epochs"]
    return out


def _job_baseline(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Raw inputs on the same subset: 1-NN (Euclidean), the embeddings' K-NN (cosine, k), and
    an L2-regularised logistic regression (scikit-learn, C = 1, on the model's input scale)."""
    from sklearn.linear_model import LogisticRegression

    from marginkit.metrics import knn_accuracy

    splits = _load(job["data"], job["seed"], job.get("per_class"), job.get("data_options"))
    tr, te = splits.train.x.flatten(1), splits.test.x.flatten(1)
    lr = LogisticRegression(C=1.0, max_iter=2000).fit(tr.double().numpy(), splits.train.y.numpy())
    return {
        "config": job,
        "result": {
            "raw_1nn_l2": knn_accuracy(te, splits.test.y, tr, splits.train.y, k=1, metric="l2"),
            "raw_knn_cosine": knn_accuracy(
                te, splits.test.y, tr, splits.train.y, k=job["k"], metric="cosine"
            ),
            "logistic_regression": float(lr.score(te.double().numpy(), splits.test.y.numpy())),
            "num_train": len(splits.train),
        },
    }


def _job_disjoint(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Train on the first half of the classes (``split=halves``, the retrieval benchmarks'
    convention); query the unseen half's samples among themselves (retrieval, Musgrave et al.
    2020) and score their pairs (open-set verification) and 1:N search."""
    from marginkit.metrics import retrieval_metrics
    from marginkit.train.evaluate import embed

    splits = _load(job["data"], job["seed"], job.get("per_class"), job["data_options"])
    query = splits.test
    res: dict[str, Any] = {
        "seen_classes": splits.num_classes,
        "unseen_classes": int(torch.unique(query.y).numel()),
        "num_queries": len(query),
    }
    out: dict[str, Any] = {"config": job}
    x = query.x.flatten(1)  # loss "raw": the inputs themselves, the baseline
    if job["loss"] != "raw":
        out, run = _train(job, run_dir, splits)
        x = embed(run["model"], query.x)
    ret = retrieval_metrics(x, query.y, metric="cosine")
    res["map_at_r"], res["precision_at_1"] = float(ret["map_at_r"]), float(ret["precision_at_1"])
    res["verification"] = _verification(x, query.y)
    res["identification"] = _identification(x, query.y, job["seed"])
    out["result"] = res
    return out


#: What a faces job keeps of the run's open-set metrics (``verification`` with its intervals).
_FACE_METRICS = ("map_at_r", "precision_at_1", "r_precision", "knn_accuracy", "num_train", "num_test")


def _face_result(metrics: dict[str, Any]) -> dict[str, Any]:
    ver = metrics["verification"]
    ci = ver.get("confidence_intervals") or {}
    return {
        **{key: metrics.get(key) for key in _FACE_METRICS},
        "verification": {
            "eer": ver["eer"], "tar_at_far": ver["tar_at_far"], "min_dcf": ver["min_dcf"],
            "eer_interval": ci.get("eer"), "tar_at_far_interval": ci.get("tar_at_far"),
            "num_genuine_pairs": ver["num_genuine"], "num_impostor_pairs": ver["num_impostor"],
        },
    }  # fmt: skip


def _job_faces(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One loss on one leave-people-out fold of the real faces, at the library's defaults (epochs
    from the data's size, no validation split: the last checkpoint); the run's own open-set
    evaluation (verification with subject-bootstrap intervals, retrieval within the test people)."""
    splits = _load(job["data"], job["seed"], None, job["data_options"])
    out, _ = _train(job, run_dir, splits)
    out["result"] = {**_face_result(out["metrics"]), "epochs": out["config"]["epochs"]}
    out["result"]["test_people"] = splits.info["class_split"]["test"]
    return out


def _job_faces_baseline(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Raw pixels and whitened PCA (Eigenfaces, fitted on the fold's training people) on one fold,
    by the same evaluation as the losses' runs."""
    from marginkit.train import TrainConfig
    from marginkit.train.baselines import evaluate_baselines

    splits = _load(job["data"], 0, None, job["data_options"])
    config = TrainConfig(data=job["data"], k=job["k"], max_impostors=20_000, val_fraction=0.0)
    found = evaluate_baselines(splits, config)
    result = {name: _face_result(metrics) for name, metrics in found.items()}
    result["pca_whitened"]["pca_components"] = found["pca_whitened"]["pca_components"]
    result["test_people"] = splits.info["class_split"]["test"]
    return {"config": job, "result": result}


def _speaker_result(trials: dict[str, Any], verification: dict[str, Any] | None = None) -> dict[str, Any]:
    ci = trials.get("confidence_intervals") or {}
    out = {
        "eer": trials["eer"], "min_dcf_0.01": trials["min_dcf_0.01"], "min_dcf_0.05": trials["min_dcf_0.05"],
        "tar_at_far": trials["tar_at_far"], "eer_interval": ci.get("eer"),
        "tar_at_far_interval": ci.get("tar_at_far"), "num_trials": trials["num_trials"],
    }  # fmt: skip
    if verification is not None:  # every pair of the test speakers' utterances
        out["all_pairs_eer"] = verification["eer"]
    return json.loads(json.dumps(out))  # FAR keys as result.json stores them ("0.01")


def _job_speakers(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One loss on the synthetic speakers: trained on the speakers outside the trial list, scored
    on the trial list (each utterance embedded whole) by the run's own ``--trials`` evaluation."""
    from marginkit.train.sources import register_sources

    register_sources()
    splits = _load(job["data"], job["seed"], None, job["data_options"])
    out, _ = _train(job, run_dir, splits)
    metrics = out["metrics"]
    out["result"] = {**_speaker_result(metrics["trials"], metrics.get("verification")),
                     "epochs": out["config"]["epochs"], "num_train": metrics["num_train"]}  # fmt: skip
    return out


def _job_speakers_baseline(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Resemblyzer's pretrained GE2E encoder (never trained here) on the same trial list."""
    import numpy as np

    from marginkit.audio.evaluate import embed_utterances, relative_paths
    from marginkit.audio.ge2e import GE2EEncoder, find_weights
    from marginkit.audio.sources import read_audio_source
    from marginkit.audio.trials import read_trials, score_trials

    weights = find_weights()
    if weights is None:
        return {"config": job, "result": None, "why": "Resemblyzer's weights not found"}
    samples = read_audio_source(job["data"].split(":", 1)[1], test_fraction=0.0).x_train
    trials = read_trials(job["trials"])
    names = relative_paths(samples)
    rows = np.flatnonzero(np.isin(names, trials.utterances))
    emb, kept, _ = embed_utterances(GE2EEncoder(weights), samples, rows=rows)
    paths = names[kept]
    speakers = np.array([p.split("/", 1)[0] for p in paths])
    metrics = score_trials(trials, emb, paths, bootstrap=200, speakers=speakers)
    return {"config": job, "result": _speaker_result(metrics)}


def _job_identities(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    from marginkit.metrics import retrieval_metrics
    from marginkit.train.evaluate import embed
    from marginkit.train.registry import LOSSES, build_loss

    splits = _load("identities", job["seed"], None, job.get("data_options"))
    out, run = _train(job, run_dir, splits)
    model, head, config = run["model"], run["head"], run["config"]
    test = embed(model, splits.test.x)
    res = _verification(test, splits.test.y)
    ret = retrieval_metrics(test, splits.test.y)
    res["map_at_r"], res["precision_at_1"] = float(ret["map_at_r"]), float(ret["precision_at_1"])
    res["identification"] = _identification(test, splits.test.y, job["seed"])
    if head is not None and LOSSES[config.loss].alpha:
        with torch.no_grad():
            loss = build_loss(config.loss, config.loss_options, k=config.k)
            loss(head(embed(model, splits.train.x)), splits.train.y)
        res["active_class_fraction"] = float(loss.last_support_size.double().mean()) / splits.num_classes
    out["result"] = res
    return out


def _shuffled(n: int, batch: int, seed: int, epoch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=g)
    size = min(batch, n)
    return [perm[i * size : (i + 1) * size] for i in range(max(1, n // size))]


def _job_margin(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Backbone + cosine head trained with CE, the hinge or MEP on s·cos; evaluated with its
    weights at each precision of :data:`PRECISIONS` (the MEP blog's first scenario)."""
    from marginkit.heads import CosineHead
    from marginkit.losses import MEPLoss
    from marginkit.models import build_model
    from marginkit.ops import margin_gap, mep
    from marginkit.train.evaluate import embed
    from marginkit.train.trainer import recalibrate_batchnorm, resolve_model_name

    splits = _load(job["data"], job["seed"], job.get("per_class"))
    s, m, objective = job["scale"], job["margin"], job["objective"]
    from marginkit.train import TrainConfig

    model_name = resolve_model_name(TrainConfig(data=job["data"]), splits.input_shape, job["data"])
    torch.manual_seed(job["seed"])
    model = build_model(model_name, splits.input_shape, embedding_dim=64)
    head = CosineHead(splits.num_classes, 64)
    n = len(splits.train)
    batch = min(128, n)
    total = job["epochs"] * max(1, n // batch)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": job["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": list(head.parameters()), "weight_decay": 0.0},
        ],
        lr=job["lr"],
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, total) / total))
    )
    mep_loss = MEPLoss(margin=m)
    x_train, y_train = splits.train.x, splits.train.y
    for epoch in range(job["epochs"]):
        model.train()
        for idx in _shuffled(n, batch, job["seed"], epoch):
            scores = s * head(model(x_train[idx]))
            yb = y_train[idx]
            if objective == "ce":
                loss = F.cross_entropy(scores, yb)
            elif objective == "hinge":
                loss = crammer_singer_hinge(scores, yb, m).mean()
            else:
                loss = mep_loss(scores, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    recalibrate_batchnorm(
        model, x_train, batch_size=batch, max_samples=4096, seed=job["seed"], device=torch.device("cpu")
    )
    res: dict[str, Any] = {}
    with torch.no_grad():
        s_tr = s * head(embed(model, x_train))
        res["train_margin_fraction"] = float((margin_gap(s_tr, y_train) >= m).double().mean())
        # MEP's gradient 2(x - MEP(x)) is exactly zero on a row iff MEP leaves it bit-identical
        res["train_zero_mep_grad_fraction"] = float((mep(s_tr, y_train, m) == s_tr).all(1).double().mean())
        for precision in PRECISIONS:
            q_model, q_head = fake_quantized(model, precision), fake_quantized(head, precision)
            s_te = s * q_head(embed(q_model, splits.test.x))
            gap = margin_gap(s_te, splits.test.y)
            res[precision] = {
                "test_accuracy": float((s_te.argmax(1) == splits.test.y).double().mean()),
                "test_margin_fraction": float((gap >= m).double().mean()),
                "test_gap_median": float(gap.median()),
            }
    config = {
        **job,
        "model": model_name,
        "batch_size": batch,
        "optimizer": "adamw",
        "scheduler": "cosine (per step)",
    }
    return {"config": config, "result": res}


def _job_e2e(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Median time of one training step (forward, backward, AdamW step) per method and class
    count, rounds interleaved across methods so that load drifts hit all alike; with the
    backbone (``mlp`` on ``input_dim`` features) and without it (head + loss on fixed embeddings)."""
    from marginkit.heads import CosineHead
    from marginkit.models import build_model
    from marginkit.train.registry import build_loss

    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for classes in job["classes"]:
        x = torch.randn(job["batch"], job["input_dim"], generator=g)
        y = torch.randint(0, classes, (job["batch"],), generator=g)
        setups = {}
        for label, (loss_name, options) in job["methods"].items():
            torch.manual_seed(0)
            backbone = build_model("mlp", (job["input_dim"],), embedding_dim=job["dim"], hidden=job["hidden"])
            head = CosineHead(classes, job["dim"])
            loss = build_loss(loss_name, options)
            opt_e2e = torch.optim.AdamW([*backbone.parameters(), *head.parameters()], lr=1e-3)
            emb = torch.nn.functional.normalize(torch.randn(job["batch"], job["dim"], generator=g), dim=1)
            emb.requires_grad_(True)
            opt_head = torch.optim.AdamW([*head.parameters(), emb], lr=1e-3)
            setups[label] = (backbone, head, loss, opt_e2e, emb, opt_head)
        times: dict[str, dict[str, list[float]]] = {k: {"e2e": [], "head_loss": []} for k in setups}
        for _ in range(job["rounds"]):
            for label, (backbone, head, loss, opt_e2e, emb, opt_head) in setups.items():
                for what in ("e2e", "head_loss"):
                    t0 = time.perf_counter()
                    if what == "e2e":
                        value = loss(head(backbone(x)), y)
                        opt_e2e.zero_grad(set_to_none=True)
                        value.backward()
                        opt_e2e.step()
                    else:
                        value = loss(head(emb), y)
                        opt_head.zero_grad(set_to_none=True)
                        value.backward()
                        opt_head.step()
                    times[label][what].append(time.perf_counter() - t0)
        out[str(classes)] = {
            label: {what: job["batch"] / statistics.median(ts[1:] or ts) for what, ts in per.items()}
            for label, per in times.items()
        }  # samples per second (the first round is warm-up)
    return {"config": job, "result": {"samples_per_second": out, "threads": torch.get_num_threads()}}


_KINDS = {
    "tune": _job_tune,
    "tune_defaults": _job_tune_defaults,
    "knn": _job_knn,
    "baseline": _job_baseline,
    "disjoint": _job_disjoint,
    "faces": _job_faces,
    "faces_baseline": _job_faces_baseline,
    "speakers": _job_speakers,
    "speakers_baseline": _job_speakers_baseline,
    "identities": _job_identities,
    "margin": _job_margin,
    "e2e": _job_e2e,
}


def library_defaults(job: dict[str, Any]) -> dict[str, Any] | None:
    """The library defaults a training job depends on (TrainConfig, the loss's registry options,
    the small-data rules): stored with its result, so a changed default is never reused. The
    throughput job builds each of its methods' losses from the registry: their options."""
    from marginkit.train.registry import resolved_options

    if job.get("kind") == "e2e":
        return {"losses": {label: resolved_options(name) for label, (name, _) in job["methods"].items()}}
    if job.get("loss") in (None, "raw"):
        return None
    from marginkit.train import TrainConfig
    from marginkit.train import small_data as sd

    return {
        "train": _results_keys(TrainConfig().to_dict()),
        "loss": resolved_options(job["loss"]),
        "small_data": [sd.AUTO_MIN_EPOCHS, sd.AUTO_MIN_SAMPLES, sd.MIN_VAL_PER_CLASS],
    }


def _results_keys(train: dict[str, Any]) -> dict[str, Any]:
    """The TrainConfig defaults that can change a result (not the runtime keys)."""
    from marginkit.train.config import RUNTIME_KEYS

    return {k: v for k, v in train.items() if k not in RUNTIME_KEYS}


def _legacy(defaults: Any) -> Any:
    """Stored defaults in today's spelling: ``amp`` was a bool before fp16, read as the config
    reads it (:func:`marginkit.train.config.amp_mode`: False is "off", True "bf16"); runtime
    keys, stored before they were left out, are dropped; keys added since (:data:`_ADDED_KEYS`)
    read as the values that reproduce the stored runs."""
    from marginkit.train.config import amp_mode

    train = defaults.get("train") if isinstance(defaults, dict) else None
    if isinstance(train, dict):
        train = {**_ADDED_KEYS, **_results_keys(train)}
        if isinstance(train.get("amp"), bool):
            train["amp"] = amp_mode(train["amp"])
        defaults = {**defaults, "train": train}
    return defaults


#: TrainConfig keys added after results were stored, at the values that compute what the runs
#: did before them: no augmentation; ``selection: auto`` is the K-NN accuracy (closed set) or
#: leave-one-out precision@1 (disjoint validation) that selected checkpoints before; random
#: starting weights, nothing frozen, one learning rate, no large-margin phase, no checkpointing.
_ADDED_KEYS = {
    "augment": {}, "selection": "auto", "weights": None, "pretrained": False, "init_from": None,
    "freeze": "none", "backbone_lr_mult": 1.0, "large_margin": {}, "grad_checkpointing": False,
}  # fmt: skip


def _wired(result: Any) -> bool:
    ident = result.get("identification") if isinstance(result, dict) else None
    return isinstance(ident, dict) and "not_wired" not in ident


def stored_result(job: dict[str, Any], out_dir: str | Path) -> dict[str, Any] | None:
    """The finished result of exactly this job (same job dict and library defaults), else None."""
    done = Path(out_dir) / "runs" / job["name"] / "result.json"
    if not done.is_file():
        return None
    stored = json.loads(done.read_text(encoding="utf-8"))
    if stored.get("job") != job:
        return None
    if "defaults" in stored and _legacy(stored["defaults"]) != json.loads(json.dumps(library_defaults(job))):
        return None
    if job["kind"] in ("disjoint", "identities") and not _wired(stored.get("result")):
        return None  # stored before identification was wired into the study: run it again
    stored["reused"] = True
    return stored


@functools.cache  # one CPU per process: read /proc/cpuinfo once, not once per job
def computed_on() -> str:
    """The CPU and the kernels torch picks on it, e.g. ``"AMD EPYC (torch kernels AVX512)"``.

    Floating-point results depend on them (oneDNN and ATen choose their vector kernels by the
    CPU's instruction set, and the summation order with them), so the same job on another CPU
    rounds differently and, through training, ends elsewhere; on the same kind of CPU it repeats.
    """
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:  # not Linux
        pass
    return f"{model} (torch kernels {torch.backends.cpu.get_cpu_capability()})"


def run_job(job: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Run one job into ``out_dir/runs/<job name>/``; reuse a finished result of the same job.

    ``seconds`` is the job's wall time, ``cpu_seconds`` its own process CPU time (on a shared
    machine the wall time also counts other work)."""
    run_dir = Path(out_dir) / "runs" / job["name"]
    stored = stored_result(job, out_dir)
    if stored is not None:
        return stored
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps(job, indent=2) + "\n", encoding="utf-8")
    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), time.process_time()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tiny-data notices; the job's config records all
        out = _KINDS[job["kind"]](job, run_dir)
    out["job"] = job
    out["defaults"] = library_defaults(job)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    out["cpu_seconds"] = round(time.process_time() - c0, 3)
    out["computed_on"] = computed_on()
    (run_dir / "result.json").write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
    return out
