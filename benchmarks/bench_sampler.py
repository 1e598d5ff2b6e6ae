"""Benchmark of marginkit.data.PKSampler against pytorch-metric-learning's MPerClassSampler.

Usage:  python benchmarks/bench_sampler.py [--quick] [--rounds R]

For each (N samples, C classes, P, K), labels drawn uniformly at random (seeded), one epoch of
each sampler is materialised (all batches as Python lists, as a DataLoader would consume them).
PKSampler's times are the median of ``R`` rounds; MPerClassSampler is timed once (it reshuffles
the whole class list for every batch: minutes per epoch at C = 10^5). Quality of that epoch:

- ``init``: constructor time; ``epoch``: building and iterating one epoch.
- ``coverage``: fraction of the N samples that appear in the epoch.
- ``exact PxK``: fraction of batches with exactly P distinct classes of K samples each.

MPerClassSampler is a flat sampler (``batch_size = P*K``, ``m = K``) asked for the same number
of samples per epoch as PKSampler yields (``length_before_new_iter``); it draws classes anew for
every batch and samples within a class with replacement only when the class is smaller than K.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from marginkit.data import PKSampler

SIZES = [(10**6, 10**3, 64, 4), (10**5, 10**4, 16, 2), (10**6, 10**5, 32, 4)]
QUICK_SIZES = [(10**4, 10**3, 8, 4)]


def epoch_pk(labels: np.ndarray, p: int, k: int) -> tuple[float, float, list[list[int]]]:
    start = time.perf_counter()
    sampler = PKSampler(labels, p, k, seed=0)
    built = time.perf_counter()
    sampler.set_epoch(1)
    batches = list(sampler)
    done = time.perf_counter()
    return built - start, done - built, batches


def epoch_pml(labels: np.ndarray, p: int, k: int, length: int) -> tuple[float, float, list[list[int]]]:
    from pytorch_metric_learning.samplers import MPerClassSampler

    start = time.perf_counter()
    sampler = MPerClassSampler(labels, m=k, batch_size=p * k, length_before_new_iter=length)
    built = time.perf_counter()
    flat = list(sampler)
    batches = [flat[i : i + p * k] for i in range(0, len(flat) - p * k + 1, p * k)]
    done = time.perf_counter()
    return built - start, done - built, batches


def quality(labels: np.ndarray, batches: list[list[int]], p: int, k: int) -> tuple[float, float]:
    arr = np.asarray(batches, dtype=np.int64)
    coverage = np.unique(arr).size / labels.size
    blocks = labels[arr].reshape(len(arr), p, k)
    same = (blocks == blocks[..., :1]).all(axis=(1, 2))
    heads = np.sort(blocks[..., 0], axis=1)
    distinct = (heads[:, 1:] != heads[:, :-1]).all(axis=1)
    return float(coverage), float((same & distinct).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke run)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    rounds = 1 if args.quick else args.rounds

    header = f"{'N':>8} {'C':>7} {'P':>3} {'K':>2}  {'sampler':<16} {'init s':>7} {'epoch s':>8} "
    header += f"{'batches':>8} {'coverage':>9} {'exact PxK':>10}"
    print(header)
    for n, c, p, k in sizes:
        labels = np.random.default_rng(0).integers(0, c, size=n)
        times: dict[str, list[tuple[float, float]]] = {"PKSampler": [], "pml MPerClass": []}
        results = {}
        for _ in range(rounds):
            init, epoch, batches = epoch_pk(labels, p, k)
            times["PKSampler"].append((init, epoch))
            results["PKSampler"] = batches
        init, epoch, batches = epoch_pml(labels, p, k, len(results["PKSampler"]) * p * k)
        times["pml MPerClass"].append((init, epoch))
        results["pml MPerClass"] = batches
        for name, measured in times.items():
            init = statistics.median(t[0] for t in measured)
            epoch = statistics.median(t[1] for t in measured)
            coverage, exact = quality(labels, results[name], p, k)
            print(
                f"{n:>8} {c:>7} {p:>3} {k:>2}  {name:<16} {init:>7.3f} {epoch:>8.3f} "
                f"{len(results[name]):>8} {coverage:>9.4f} {exact:>10.4f}"
            )


if __name__ == "__main__":
    main()
