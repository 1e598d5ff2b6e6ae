"""Random batches through ``mep`` (the compiled kernel where numba is installed) against the torch path.

Usage:  python benchmarks/_mep_kernel_stress.py --seed 11 --batches 400

Six families of float32 scores (Gaussian at scales 1e-3 to 1e4, a quarter grid, tiny entries, whole
numbers with ties and -0.0, mixed magnitudes, dominant labels), masks of 1-90 % density or labels,
scalar or per-row margins, L2 and L1; rows up to 3,000 columns. Prints the batches whose bits
differ from the torch path (there should be none) and the totals.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from marginkit.ops import mep, selection


def reference(*args: object) -> torch.Tensor:
    selection.FAST_CPU = False
    try:
        return mep(*args)
    finally:
        selection.FAST_CPU = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    bad = rows = 0
    for it in range(args.batches):
        b, n = int(rng.integers(1, 64)), int(rng.integers(2, 3000))
        family = int(rng.integers(0, 6))
        x = rng.standard_normal((b, n)) * rng.choice([1e-3, 0.1, 1, 3, 30, 1e4])
        if family == 1:
            x = np.round(x * 4) / 4
        elif family == 2:
            x[rng.random((b, n)) < 0.01] *= 1e-7
        elif family == 3:
            x = np.round(x)
        elif family == 4:
            x = np.where(rng.random((b, n)) < 0.5, x, x * 1e-4)
        scores = torch.from_numpy(x.astype(np.float32))
        if rng.random() < 0.5:
            positives = torch.from_numpy(rng.random((b, n)) < rng.choice([0.01, 0.1, 0.5, 0.9]))
        else:
            positives = torch.from_numpy(rng.integers(0, n, b))
            if family == 5:
                scores[torch.arange(b), positives] += float(rng.choice([0.5, 3, 10]))
        if rng.random() < 0.7:
            margin: float | torch.Tensor = float(rng.choice([1e-3, 0.1, 0.35, 1.0, 7.0]))
        else:
            margin = torch.from_numpy((rng.random(b) + 0.01).astype(np.float32))
        norm = "l1" if rng.random() < 0.4 else "l2"
        fast, ref = mep(scores, positives, margin, norm), reference(scores, positives, margin, norm)
        rows += b
        if not torch.equal(fast.view(torch.int32), ref.view(torch.int32)):
            bad += 1
            print(f"batch {it}: bits differ (family {family}, {b} x {n}, {norm})", flush=True)
    print(f"seed {args.seed}: {args.batches} batches, {rows} rows, {bad} with different bits")


if __name__ == "__main__":
    main()
