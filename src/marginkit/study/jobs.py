"""One unit of the study: a training run (via :func:`marginkit.train.train`), a custom
margin-objective run (section 4: cross-entropy, Crammer–Singer hinge, MEP), a transfer
run (section 6) or the throughput benchmark (section 3).

A job is a JSON-able dict; :func:`run_job` writes ``job.json`` (its full config) and
``result.json`` into ``OUT/runs/<name>/`` and returns the result. Every job runs with one
intra-op thread (these models are tiny; more threads only spin on shared cores).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FARS", "crammer_singer_hinge", "run_job"]

#: False-accept rates of the verification table (a FAR below 1/impostor pairs is reported as None).
FARS = (1e-2, 1e-3, 1e-4, 1e-5)


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


# ---------------------------------------------------------------------------- helpers
def _epochs(n_train: int, batch: int, steps: int) -> int:
    return max(1, math.ceil(steps / max(1, n_train // max(1, min(batch, n_train)))))


def _load(data: str, seed: int, per_class: int | None, options: dict[str, Any] | None = None) -> Any:
    from marginkit.data import load_dataset

    return load_dataset(data, seed=seed, train_per_class=per_class, val_fraction=0.0, **(options or {}))


def _batch_sizes(n_train: int, num_classes: int, loss_kind: str) -> dict[str, int]:
    batch = 128 if n_train >= 1000 else 64
    batch = min(batch, n_train)
    if loss_kind == "pair":
        k = max(4, min(16, batch // max(2, min(num_classes, 16))))
        p = max(2, min(num_classes, batch // k))
        return {"batch_size": p * k, "samples_per_class": k, "classes_per_batch": p}
    return {"batch_size": batch}


def _config(job: dict[str, Any], splits: Any) -> Any:
    from marginkit.train import TrainConfig
    from marginkit.train.registry import LOSSES

    kind = LOSSES[job["loss"]].kind
    sizes = _batch_sizes(len(splits.train), splits.num_classes, kind)
    epochs = _epochs(len(splits.train), sizes["batch_size"], job["steps"])
    return TrainConfig(
        data=job["data"],
        loss=job["loss"],
        seed=job["seed"],
        train_per_class=job.get("per_class"),
        val_fraction=0.0,
        data_options=job.get("data_options", {}),
        loss_options=job.get("loss_options", {}),
        epochs=epochs,
        eval_every=epochs,
        k=job.get("k", 5),
        num_threads=1,
        max_impostors=20_000,
        **sizes,
    ).validate()


def _train(job: dict[str, Any], run_dir: Path, splits: Any) -> tuple[dict[str, Any], Any]:
    from marginkit.train import load_run, train

    config = _config(job, splits)
    result = train(config, run_dir / "train", splits=splits, quiet=True, report=False, overwrite=True)
    run = load_run(run_dir / "train", "best")
    return {"config": config.to_dict(), "metrics": result.metrics, "train_seconds": result.seconds}, run


# ---------------------------------------------------------------------------- job kinds
def _job_knn(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    splits = _load(job["data"], job["seed"], job.get("per_class"))
    out, _ = _train(job, run_dir, splits)
    m = out["metrics"]
    out["result"] = {
        "knn_accuracy": m.get("knn_accuracy"),
        "head_accuracy": m.get("head_accuracy"),
        "map_at_r": m.get("map_at_r"),
        "precision_at_1": m.get("precision_at_1"),
        "num_train": m.get("num_train"),
    }
    return out


def _job_identities(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    from marginkit.metrics import pair_scores, retrieval_metrics, verification_metrics
    from marginkit.train.evaluate import embed
    from marginkit.train.registry import LOSSES, build_loss

    splits = _load("identities", job["seed"], None, job.get("data_options"))
    out, run = _train(job, run_dir, splits)
    model, head, config = run["model"], run["head"], run["config"]
    test = embed(model, splits.test.x)
    scores, genuine = pair_scores(test, splits.test.y, max_impostors=None)
    ver = verification_metrics(scores, genuine, fars=FARS)
    res: dict[str, Any] = {
        "tar_at_far": {str(f): ver["tar_at_far"].get(f) for f in FARS},
        "eer": float(ver["eer"]),
        "min_dcf": float(ver["min_dcf"]),
        "num_impostor_pairs": int(ver["num_impostor"]),
        "num_genuine_pairs": int(ver["num_genuine"]),
    }
    ret = retrieval_metrics(test, splits.test.y)
    res["map_at_r"], res["precision_at_1"] = float(ret["map_at_r"]), float(ret["precision_at_1"])
    if head is not None and LOSSES[config.loss].alpha:
        train_emb = embed(model, splits.train.x)
        with torch.no_grad():
            cos = head(train_emb)
            loss = build_loss(config.loss, config.loss_options, k=config.k)
            loss(cos, splits.train.y)
        res["active_class_fraction"] = float(loss.last_support_size.double().mean()) / splits.num_classes
    out["result"] = res
    return out


def _shuffled(n: int, batch: int, seed: int, epoch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=g)
    size = min(batch, n)
    return [perm[i * size : (i + 1) * size] for i in range(max(1, n // size))]


def _job_margin(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Section 4: one backbone + cosine head trained with CE, the hinge or MEP on s·cos."""
    from marginkit.heads import CosineHead
    from marginkit.losses import MEPLoss
    from marginkit.metrics import knn_accuracy
    from marginkit.models import build_model
    from marginkit.ops import margin_gap, mep
    from marginkit.train.evaluate import embed
    from marginkit.train.trainer import recalibrate_batchnorm

    splits = _load(job["data"], job["seed"], job.get("per_class"))
    s, m, objective = job["scale"], job["margin"], job["objective"]
    model_name = {"mnist1d": "cnn1d", "digits": "cnn2d"}.get(job["data"], "mlp")
    torch.manual_seed(job["seed"])
    model = build_model(model_name, splits.input_shape, embedding_dim=64)
    head = CosineHead(splits.num_classes, 64)
    n = len(splits.train)
    batch = min(128 if n >= 1000 else 64, n)
    epochs = _epochs(n, batch, job["steps"])
    total = epochs * max(1, n // batch)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 5e-4},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": list(head.parameters()), "weight_decay": 0.0},
        ],
        lr=1e-3,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, total) / total))
    )
    mep_loss = MEPLoss(margin=m)
    x_train, y_train = splits.train.x, splits.train.y
    for epoch in range(epochs):
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
    with torch.no_grad():
        tr, te = embed(model, x_train), embed(model, splits.test.x)
        s_tr, s_te = s * head(tr), s * head(te)
        gap_tr, gap_te = margin_gap(s_tr, y_train), margin_gap(s_te, splits.test.y)
        # MEP gradient 2(x - MEP(x)) is exactly zero on a row iff MEP leaves it bit-identical
        zero_mep = (mep(s_tr, y_train, m) == s_tr).all(1)
        zero_hinge = crammer_singer_hinge(s_tr, y_train, m) == 0
    config = {
        **job,
        "model": model_name,
        "batch_size": batch,
        "epochs": epochs,
        "lr": 1e-3,
        "weight_decay": 5e-4,
        "optimizer": "adamw",
        "scheduler": "cosine (per step)",
    }
    return {
        "config": config,
        "result": {
            "train_accuracy": float((s_tr.argmax(1) == y_train).double().mean()),
            "test_accuracy": float((s_te.argmax(1) == splits.test.y).double().mean()),
            "knn_accuracy": knn_accuracy(te, splits.test.y, tr, y_train, k=5),
            "test_margin_fraction": float((gap_te >= m).double().mean()),
            "train_margin_fraction": float((gap_tr >= m).double().mean()),
            "train_zero_mep_grad_fraction": float(zero_mep.double().mean()),
            "train_zero_hinge_fraction": float(zero_hinge.double().mean()),
        },
    }


def _subset(split: Any, keep: torch.Tensor, offset: int = 0) -> Any:
    from marginkit.data import Split

    return Split(split.x[keep], split.y[keep] - offset)


def _job_transfer(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Section 6: train on classes 0..H-1, K-NN on the unseen classes H..C-1 from few references."""
    import dataclasses

    from marginkit.metrics import knn_accuracy
    from marginkit.train.evaluate import embed

    full = _load(job["data"], job["seed"], None)
    half = full.num_classes // 2
    seen_tr, seen_te = full.train.y < half, full.test.y < half
    splits = dataclasses.replace(
        full,
        train=_subset(full.train, seen_tr),
        val=_subset(full.train, torch.zeros_like(seen_tr)),
        test=_subset(full.test, seen_te),
        num_classes=half,
        class_names=None,
    )
    out, run = _train(job, run_dir, splits)
    model = run["model"]
    pool = _subset(full.train, ~seen_tr, half)
    query = _subset(full.test, ~seen_te, half)
    emb_pool, emb_query = embed(model, pool.x), embed(model, query.x)
    raw_pool, raw_query = pool.x.flatten(1), query.x.flatten(1)
    res: dict[str, Any] = {
        "seen_classes": list(range(half)),
        "unseen_classes": list(range(half, full.num_classes)),
    }
    for r in job["refs"]:
        acc_e, acc_r = [], []
        for draw in range(job["draws"]):
            g = torch.Generator().manual_seed(job["seed"] * 1000 + draw)
            keys = torch.rand(len(pool.y), generator=g) + pool.y.double() * 2  # per-class random order
            order = torch.argsort(keys)
            rank = torch.empty_like(order)
            counts = torch.bincount(pool.y, minlength=half)
            starts = torch.cumsum(counts, 0) - counts
            rank[order] = torch.arange(len(order)) - starts[pool.y[order]]
            pick = rank < r
            acc_e.append(knn_accuracy(emb_query, query.y, emb_pool[pick], pool.y[pick], k=1))
            acc_r.append(knn_accuracy(raw_query, query.y, raw_pool[pick], pool.y[pick], k=1))
        res[f"embedding_1nn_{r}ref"] = sum(acc_e) / len(acc_e)
        res[f"raw_1nn_{r}ref"] = sum(acc_r) / len(acc_r)
    out["result"] = res
    return out


def _job_bench(job: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    script = Path(job["script"])
    if not script.is_file():
        return {"config": job, "result": {"available": False, "text": f"{script} not found"}}
    proc = subprocess.run(
        [sys.executable, str(script), *job["args"]], capture_output=True, text=True, check=False
    )
    text = proc.stdout + (f"\n(stderr)\n{proc.stderr[-2000:]}" if proc.returncode else "")
    return {"config": job, "result": {"available": proc.returncode == 0, "text": text}}


_KINDS = {
    "knn": _job_knn,
    "identities": _job_identities,
    "margin": _job_margin,
    "transfer": _job_transfer,
    "bench": _job_bench,
}


def run_job(job: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Run one job into ``out_dir/runs/<job name>/``; reuse a finished result of the same job."""
    run_dir = Path(out_dir) / "runs" / job["name"]
    done = run_dir / "result.json"
    if done.is_file():
        stored = json.loads(done.read_text(encoding="utf-8"))
        if stored.get("job") == job:
            stored["reused"] = True
            return stored
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps(job, indent=2) + "\n", encoding="utf-8")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out = _KINDS[job["kind"]](job, run_dir)
    out["job"] = job
    out["seconds"] = round(time.perf_counter() - t0, 3)
    (run_dir / "result.json").write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
    return out
