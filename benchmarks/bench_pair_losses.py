"""Pair losses side by side: forward + backward time, and peak memory at B = 4096.

Rows (D = 128, labels: B/8 classes × 8 samples in random order, float32, CPU):

- ``LocalMarginTripletLoss`` vs a per-anchor Python loop of the same formula (each iteration
  vectorised over the references; target: ≥ 30× faster at B = 256);
- ``CircleLoss`` vs pytorch-metric-learning's ``CircleLoss`` (same m, γ; target ≤ 1.0×);
- ``TripletMarginLoss(mining="batch_all", distance="l2")`` vs pytorch-metric-learning's
  ``TripletMarginLoss`` (all triplets, its defaults; target ≤ 1.0×). The two agree in value
  and gradient (tests/test_triplet.py).

Timing: ``--repeats`` forward+backward passes after one warm-up, the two implementations of
a row interleaved in the same process, ``torch.set_num_threads(--threads)``. The ratio uses
the fastest run of each (the least disturbed by other processes on a shared machine); the
medians are printed next to it.

Peak memory: each (implementation, B) runs in a fresh subprocess. The process resets its
peak resident set size (Linux: ``echo 5 > /proc/self/clear_refs``) after building the
inputs and a small warm-up, runs one forward+backward, and reports ``VmHWM − VmRSS_before``
from ``/proc/self/status``: the extra resident memory the step needed (tracemalloc does not
see torch's allocations). Where ``clear_refs`` is unavailable it falls back to
``ru_maxrss`` (then the number is only an upper bound of the whole process peak).

Usage::

    python benchmarks/bench_pair_losses.py            # full run (a few minutes)
    python benchmarks/bench_pair_losses.py --quick    # tiny sizes, smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

DIM = 128
PER_CLASS = 8


def make_batch(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(batch, DIM, generator=gen)
    labels = torch.randperm(batch, generator=gen) % max(1, batch // PER_CLASS)
    return emb, labels


def local_margin_loop(
    emb: torch.Tensor, labels: torch.Tensor, k: int = 5, margin: float = 0.2
) -> torch.Tensor:
    """The per-anchor formulation of SPEC §5 (what the vectorised loss replaces)."""
    x = F.normalize(emb, dim=1)
    losses = []
    for a in range(x.shape[0]):
        d = ((x[a] - x) ** 2).sum(1)
        pos = labels == labels[a]
        pos[a] = False
        neg = labels != labels[a]
        if not bool(pos.any()) or not bool(neg.any()):
            continue
        d_pos = torch.sort(d[pos], stable=True).values
        bound = d_pos[min(k, d_pos.shape[0]) - 1]
        losses.append(F.relu(bound - d[neg].min() + margin))
    return torch.stack(losses).mean() if losses else x.sum() * 0


def implementations() -> dict[str, Callable[[], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]]:
    """name -> factory of a ``loss(emb, labels)`` callable (built lazily, imports included)."""

    def ours_local():
        from marginkit.losses import LocalMarginTripletLoss

        return LocalMarginTripletLoss(k=5, margin=0.2)

    def ours_circle():
        from marginkit.losses import CircleLoss

        return CircleLoss(margin=0.25, gamma=256.0)

    def pml_circle():
        from pytorch_metric_learning.losses import CircleLoss

        return CircleLoss(m=0.25, gamma=256.0)

    def ours_batch_all():
        from marginkit.losses import TripletMarginLoss

        return TripletMarginLoss(margin=0.2, mining="batch_all", distance="l2")

    def pml_batch_all():
        from pytorch_metric_learning.losses import TripletMarginLoss

        return TripletMarginLoss(margin=0.2)

    return {
        "local_margin": ours_local,
        "local_margin_loop": lambda: local_margin_loop,
        "circle": ours_circle,
        "pml_circle": pml_circle,
        "batch_all": ours_batch_all,
        "pml_batch_all": pml_batch_all,
    }


PAIRS = [
    ("LocalMarginTripletLoss vs per-anchor loop", "local_margin", "local_margin_loop"),
    ("CircleLoss vs PML CircleLoss", "circle", "pml_circle"),
    ("TripletMarginLoss batch_all vs PML TripletMarginLoss", "batch_all", "pml_batch_all"),
]


def step(loss_fn: Callable, emb: torch.Tensor, labels: torch.Tensor) -> float:
    x = emb.clone().requires_grad_(True)
    start = time.perf_counter()
    loss_fn(x, labels).backward()
    return time.perf_counter() - start


Row = tuple[str, int, list[float], list[float]]


def time_all(batch_sizes: list[int], repeats: int, loop_max: int) -> list[Row]:
    impls = {name: make() for name, make in implementations().items()}
    rows = []
    for batch in batch_sizes:
        emb, labels = make_batch(batch)
        for title, ours, ref in PAIRS:
            reps = repeats
            if ref == "local_margin_loop" and batch > loop_max:
                continue
            if ref == "pml_batch_all" and batch >= 1024:
                reps = max(2, repeats // 4)  # seconds per call
            times: dict[str, list[float]] = {ours: [], ref: []}
            for name in (ours, ref):
                step(impls[name], emb, labels)  # warm-up
            for _ in range(reps):
                for name in (ours, ref):  # interleaved: both see the same machine load
                    times[name].append(step(impls[name], emb, labels))
            rows.append((title, batch, times[ours], times[ref]))
            print(f"  timed {title} at B={batch}", file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------- peak memory (subprocess)


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _peak_child(name: str, batch: int) -> None:
    torch.set_num_threads(1)
    loss_fn = implementations()[name]()
    small_emb, small_labels = make_batch(64)
    step(loss_fn, small_emb, small_labels)  # imports, kernels, allocator warm-up
    emb, labels = make_batch(batch)
    method = "VmHWM-VmRSS"
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        before = _status_kb("VmRSS")
    except OSError:
        method, before = "ru_maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = step(loss_fn, emb, labels)
    after = (
        _status_kb("VmHWM") if method == "VmHWM-VmRSS" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    )
    print(json.dumps({"peak_mb": (after - before) / 1024, "method": method, "seconds": seconds}))


def peak_memory(name: str, batch: int, timeout: float) -> str:
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--_peak", name, str(batch)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"> {timeout:.0f} s (stopped)"
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"failed ({tail[:60]})"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return f"{result['peak_mb']:.0f} MB ({result['seconds']:.2f} s)"


def _available_gb() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--memory-batch", type=int, default=4096)
    parser.add_argument("--_peak", nargs=2, metavar=("NAME", "B"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._peak:
        _peak_child(args._peak[0], int(args._peak[1]))
        return
    torch.set_num_threads(args.threads)
    sizes = [32, 64] if args.quick else [128, 256, 1024]
    repeats = 2 if args.quick else args.repeats
    mem_batch = 256 if args.quick else args.memory_batch
    print(f"torch {torch.__version__}, threads={args.threads}, D={DIM}, {PER_CLASS} samples per class")
    rows = time_all(sizes, repeats, loop_max=1024)
    print()
    print(
        "| comparison | B | ours: min (median) ms | reference: min (median) ms | speed-up (ref / ours, min) |"
    )
    print("|---|---:|---:|---:|---:|")
    for title, batch, ours, ref in rows:
        o, r = min(ours), min(ref)
        om, rm = statistics.median(ours), statistics.median(ref)
        cells = f"{o * 1e3:.2f} ({om * 1e3:.2f}) | {r * 1e3:.2f} ({rm * 1e3:.2f})"
        print(f"| {title} | {batch} | {cells} | {r / o:.1f}× |")
    print()
    print(f"Peak extra resident memory of one forward+backward at B={mem_batch} (fresh subprocess each):")
    print()
    print("| implementation | peak memory (step time) |")
    print("|---|---:|")
    timeout = 60.0 if args.quick else 600.0
    for name in ("local_margin", "circle", "pml_circle", "batch_all", "pml_batch_all"):
        if name == "pml_batch_all" and not args.quick and _available_gb() < 16:
            print(f"| {name} | skipped (only {_available_gb():.1f} GB available) |")
            continue
        print(f"| {name} | {peak_memory(name, mem_batch, timeout)} |", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
