"""ShardedCosineHead on 1/2/4 gloo processes (CPU): memory per rank, step time, communication.

Set-up (full size): C = 10⁶ classes, D = 128, a fixed *global* batch of B = 64 embeddings split
evenly over the N ranks (the same training problem on more ranks), float32, SGD with momentum on
the head, one intra-op thread per process. Each step is ``loss(head(e), y).backward()`` plus the
optimiser step; the embeddings are leaf tensors (no backbone), so the step is the head's work.

Columns, per rank (the maximum over ranks where they differ):

- ``state MiB``: weights + momentum of the local slice (``2·4·C·D/N`` bytes);
- ``peak MiB``: the process's resident-memory high-water mark during the step minus its
  resident memory just before the head was built (Linux: ``/proc/self/clear_refs`` resets the mark
  before each measured step): weights, momentum, gradient, the ``[B, C/N]`` logit buffers and
  every temporary. Expect both to scale as ``1/N``;
- ``step ms``: median wall time of the timed steps (the slowest rank's). This machine has 2 CPU
  cores shared with other jobs: 2 and 4 processes contend for them, so these times show the
  communication and contention overheads, not a speed-up;
- ``collectives`` / ``KiB/step``: calls and payload bytes of the collectives one step issues
  (counted by :func:`marginkit.distributed.record_collectives`; all-reduce: the buffer, all-gather:
  the gathered output). They do not depend on ``C``.

Rows: CosFace (softmax type: the same traffic for NormSoftmax/ArcFace/ClassCircle), Q-Margin
(α = 1.25, s = 35, m = 0.2: a global τ by Newton steps), and CosFace with PartialFC sampling
(``sample_rate = 0.1``).

Usage::

    python benchmarks/bench_distributed.py            # C = 10^6 (a few minutes, ~3 GB in all)
    python benchmarks/bench_distributed.py --quick    # C = 2·10^4, 1 and 2 ranks: smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from marginkit.distributed import record_collectives
from marginkit.heads import ShardedCosineHead
from marginkit.losses import CosFaceLoss, QMarginLoss

# The test suite's spawn harness (gloo on loopback; the spawned processes inherit sys.path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
from dist_utils import run_distributed

DIM = 128
GLOBAL_BATCH = 64


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


CONFIGS = {
    "CosFace": (lambda: CosFaceLoss(scale=64.0, margin=0.4), 1.0),
    "Q-Margin α=1.25": (lambda: QMarginLoss(alpha=1.25, scale=35.0, margin=0.2), 1.0),
    "CosFace, sample_rate=0.1": (lambda: CosFaceLoss(scale=64.0, margin=0.4), 0.1),
}


def _measure(name: str, world: int, num_classes: int, steps: int, gen: torch.Generator) -> dict:
    make_loss, rate = CONFIGS[name]
    local = GLOBAL_BATCH // world
    rss0 = _status_kb("VmRSS")  # before the head exists
    head = ShardedCosineHead(num_classes, DIM, sample_rate=rate, seed=0)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    loss_fn = make_loss()
    labels = torch.randint(0, num_classes, (local,), generator=gen)
    emb = torch.randn(local, DIM, generator=gen)

    def step() -> None:
        opt.zero_grad()
        e = emb.clone().requires_grad_(True)
        loss_fn(head(e), labels).backward()
        opt.step()

    step()  # warm-up: allocates the momentum buffer
    with record_collectives() as stats:
        step()
    peaks, times = [], []
    for _ in range(steps):
        exact = _reset_peak()
        if world > 1:
            torch.distributed.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        peaks.append(_status_kb("VmHWM") - rss0 if exact else None)
    return {
        "state_mib": 2 * head.weight.numel() * head.weight.element_size() / 2**20,
        "peak_mib": None if peaks[0] is None else max(peaks) / 1024,
        "step_ms": 1e3 * statistics.median(times),
        "calls": stats.total_calls,
        "kib": stats.total_bytes / 1024,
    }


def _worker(me: int, world: int, name: str, num_classes: int, steps: int, out_dir: str) -> None:
    gen = torch.Generator().manual_seed(100 + me)
    _measure(name, world, 8 * world, 1, gen)  # load every lazy piece before measuring memory
    result = _measure(name, world, num_classes, steps, gen)
    with open(os.path.join(out_dir, f"rank{me}.json"), "w") as file:
        json.dump(result, file)


def run(worlds: list[int], num_classes: int, steps: int) -> list[dict]:
    """One fresh group of processes per (world size, loss): memory peaks do not mix."""
    rows = []
    for world in worlds:
        for name in CONFIGS:
            with tempfile.TemporaryDirectory() as out_dir:
                run_distributed(_worker, world, name, num_classes, steps, out_dir, timeout_s=1800.0)
                per = []
                for r in range(world):
                    with open(os.path.join(out_dir, f"rank{r}.json")) as file:
                        per.append(json.load(file))
            peaks = [p["peak_mib"] for p in per]
            rows.append(
                {
                    "world": world,
                    "loss": name,
                    "state_mib": max(p["state_mib"] for p in per),
                    "peak_mib": None if None in peaks else max(peaks),
                    "step_ms": max(p["step_ms"] for p in per),
                    "calls": per[0]["calls"],
                    "kib": max(p["kib"] for p in per),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], num_classes: int) -> str:
    lines = [
        f"C = {num_classes:,}, D = {DIM}, global batch {GLOBAL_BATCH}, float32, SGD momentum, gloo on CPU",
        "",
        "| ranks | loss | state MiB/rank | peak MiB/rank | step ms | collectives/step | KiB/step/rank |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(
            f"| {r['world']} | {r['loss']} | {r['state_mib']:.0f} | {peak} | {r['step_ms']:.0f} | "
            f"{r['calls']} | {r['kib']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="C = 2·10^4, 2 steps (smoke test)")
    parser.add_argument("--classes", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--worlds", type=int, nargs="+", default=None, help="default: 1 2 4 (quick: 1 2)")
    args = parser.parse_args(argv)
    num_classes = args.classes or (20_000 if args.quick else 1_000_000)
    steps = args.steps or (2 if args.quick else 3)
    worlds = args.worlds or ([1, 2] if args.quick else [1, 2, 4])
    rows = run(worlds, num_classes, steps)
    print(table(rows, num_classes))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
