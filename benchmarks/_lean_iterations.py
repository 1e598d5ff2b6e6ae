"""Developer tool: the Newton steps the lean alpha solver needs, per band of α (not a benchmark).

The lean solver (``marginkit.ops.alpha._static._solve_lean``: Q-Margin, entmax and sparsemax with a
scalar 1 < α ≤ 2 on one process) runs a fixed number of Newton steps on the candidates, so that its
kernels do not depend on the data; its verdict flags a batch whose threshold did not converge. This
script draws batches of cosines (64 rows of 10³–10⁵ classes, embeddings from random unit vectors
to one dominant class, every fifth batch near-uniform, s in [4, 64], margins 0–0.4), with a budget
holding every candidate, and reports, per α band, how many batches needed each number of steps —
the fewest for which the verdict is "exact" (``--most`` + 1: not within ``--most``). The table
``_LEAN_ITERATIONS`` is the worst case + 1.

    PYTHONPATH=src python benchmarks/_lean_iterations.py --dtype float32 --alpha 1.5 1.75 --batches 50
    PYTHONPATH=src python benchmarks/_lean_iterations.py --full-rows --alpha 1.75 1.9 --batches 60

``--full-rows``: the solver of rows of at most the budget's classes (``_ITERATIONS``), through
``QMarginLoss`` inside ``deferred_checks()``.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
import torch.nn.functional as F

import marginkit.ops.alpha._static as static
from marginkit._validation import deferred_checks
from marginkit.losses import QMarginLoss
from marginkit.ops.alpha._candidates import _Blocks, _logits


def steps_needed(x: torch.Tensor, y: torch.Tensor, alpha: float, s: float, m: float, most: int) -> int:
    """The fewest Newton steps for which the lean solver's verdict is exact (``most + 1``: none)."""
    blocks = _Blocks(x)
    shift = blocks.rowmax
    theta_y = _logits(x.gather(1, y[:, None]).squeeze(1), shift, s, x.dtype)
    saved = static.ROW_BUDGET, static._lean_iterations
    static.ROW_BUDGET = x.shape[1]  # every candidate fits: the verdict is the convergence alone
    try:
        for steps in range(most + 1):
            static._lean_iterations = lambda beta, dtype, steps=steps: steps
            _, not_exact = static._solve_lean(
                x, blocks, scale=s, beta_scalar=alpha - 1.0, label=y, logq_value=-s * m, k=None,
                shift=shift, theta_y=theta_y,
            )  # fmt: skip
            if not bool(not_exact):
                return steps
        return most + 1
    finally:
        static.ROW_BUDGET, static._lean_iterations = saved


def full_row_steps_needed(
    x: torch.Tensor, y: torch.Tensor, alpha: float, s: float, m: float, most: int
) -> int:
    """The same for the full-row solver (``_ITERATIONS``; classes no more than the budget): the fewest
    steps for which Q-Margin inside ``deferred_checks()`` raises no "not exact" error."""
    saved = static._iterations
    try:
        for steps in range(most + 1):
            static._iterations = lambda beta, dtype, steps=steps: steps
            try:
                with deferred_checks() as checks:
                    QMarginLoss(alpha=alpha, scale=s, margin=m, reduction="none")(x, y)
                    checks.raise_if_failed()
                return steps
            except ValueError:
                continue
        return most + 1
    finally:
        static._iterations = saved


def draw(g: torch.Generator, b: int, lo: float, hi: float, dtype: torch.dtype, full: bool = False) -> tuple:
    decades = (1, 1.7) if full else (3, 2)  # full rows: 10 to 500 classes (within the default budget)
    n = int(10 ** (decades[0] + decades[1] * torch.rand(1, generator=g).item()))
    alpha = lo + (hi - lo) * torch.rand(1, generator=g).item()
    s = 4 * 16 ** torch.rand(1, generator=g).item()
    m = 0.4 * torch.rand(1, generator=g).item()
    dim = (16, 64, 256, 512)[b % 4]
    w = F.normalize(torch.randn(n, dim, generator=g), dim=1)
    y = torch.randint(0, n, (64,), generator=g)
    spread = (0.0, 0.5, 2.0, 8.0)[(b // 4) % 4]
    e = F.normalize(spread * w[y] + torch.randn(64, dim, generator=g) / dim**0.5, dim=1)
    x = (e @ w.T).clamp_(-1, 1)
    if b % 5 == 4:
        x = x * 0.01  # near-uniform rows
    return x.to(dtype), y, alpha, s, m, f"n={n} dim={dim} spread={spread}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--alpha", nargs=2, type=float, default=[1.05, 1.5], metavar=("LO", "HI"))
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--most", type=int, default=14)
    parser.add_argument("--full-rows", action="store_true", help="the full-row solver (10 to 500 classes)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed)
    counts: Counter[int] = Counter()
    worst = (-1, "")
    for b in range(args.batches):
        x, y, alpha, s, m, what = draw(g, b, *args.alpha, dtype, args.full_rows)
        measure = full_row_steps_needed if args.full_rows else steps_needed
        steps = measure(x, y, alpha, s, m, args.most)
        counts[steps] += 1
        if steps > worst[0]:
            worst = (steps, f"alpha={alpha:.3f} s={s:.2f} m={m:.3f} {what}")
    table = (static._iterations if args.full_rows else static._lean_iterations)(args.alpha[1] - 1.0, dtype)
    print(
        f"{args.dtype} alpha in [{args.alpha[0]}, {args.alpha[1]}]: batches per steps needed "
        f"{dict(sorted(counts.items()))}; worst {worst[0]} ({worst[1]}); the table runs {table}"
    )


if __name__ == "__main__":
    main()
