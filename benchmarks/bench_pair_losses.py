"""Pair losses side by side: forward + backward time, and peak memory at B = 4096.

Rows (D = 128, labels: B/8 classes × 8 samples in random order — NT-Xent: B/2 classes × 2,
SimCLR's two views — float32, CPU):

- ``LocalMarginTripletLoss`` vs a per-anchor Python loop of the same formula (each iteration
  vectorised over the references; target: ≥ 30× faster at B = 256);
- ``CircleLoss`` vs pytorch-metric-learning's ``CircleLoss`` (same m, γ; target ≤ 1.0×);
- ``TripletMarginLoss(mining="batch_all", distance="l2")`` vs pytorch-metric-learning's
  ``TripletMarginLoss`` (all triplets, its defaults; target ≤ 1.0×). The two agree in value
  and gradient (tests/test_triplet.py);
- issue 16's losses against PML's, each with PML's defaults and the same hyper-parameters
  (agreement in value and gradient: tests/test_pair_losses_peers.py; target ≤ 1.0× at
  B = 128…1024): ``MultiSimilarityLoss`` (all pairs; and ``epsilon=0.1`` vs PML's
  ``MultiSimilarityMiner`` + loss), ``SupConLoss``, ``NTXentLoss``, ``ContrastiveLoss``,
  ``TripletMarginLoss(smooth_loss=True)`` (batch-all, l2). PML's ``NTXentLoss`` builds a
  ``[positive pairs, negative pairs]`` matrix (B² · B floats at two views per class): where
  that would take more than half of the available memory, the row is skipped and says so.

Timing: ``--repeats`` forward+backward passes after one warm-up, the two implementations of
a row interleaved in the same process, ``torch.set_num_threads(--threads)``. The ratio uses
the fastest run of each (the least disturbed by other processes on a shared machine); the
medians are printed next to it. Each pass follows the other implementation's, so it starts with
the caches that one left (a fixed cost of a step's code paths, not of its size);
``--in-a-row K`` times the fastest of K passes in a row instead (warm, as ``timeit`` measures).
``--no-kernel``: the local-margin triplet's selection by torch's ``topk`` even where numba (the
``fast`` extra) would run the compiled selection (the first line says which ran).

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


def make_batch(batch: int, seed: int = 0, per_class: int = PER_CLASS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(batch, DIM, generator=gen)
    labels = torch.randperm(batch, generator=gen) % max(1, batch // per_class)
    return emb, labels


#: samples per class of the rows that do not use PER_CLASS
ROW_PER_CLASS = {"ntxent": 2, "pml_ntxent": 2}


def pml_ntxent_bytes(batch: int) -> int:
    """Rough peak of PML's NTXentLoss: ~5 float32 copies of its [pos pairs, neg pairs] matrix."""
    return 5 * 4 * batch * batch * (batch - 2)


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

    def peers():  # issue 16: ours -> PML, same hyper-parameters (PML's defaults)
        from pytorch_metric_learning import losses as pml
        from pytorch_metric_learning import miners

        import marginkit.losses as mk

        def pml_ms_mined():
            miner, loss = miners.MultiSimilarityMiner(0.1), pml.MultiSimilarityLoss(2, 50, 0.5)
            return lambda x, y: loss(x, y, miner(x, y))

        return {
            "ms": (
                lambda: mk.MultiSimilarityLoss(2.0, 50.0, 0.5),
                lambda: pml.MultiSimilarityLoss(2, 50, 0.5),
            ),
            "ms_mined": (lambda: mk.MultiSimilarityLoss(2.0, 50.0, 0.5, epsilon=0.1), pml_ms_mined),
            "supcon": (lambda: mk.SupConLoss(0.1), lambda: pml.SupConLoss(0.1)),
            "ntxent": (lambda: mk.NTXentLoss(0.07), lambda: pml.NTXentLoss(0.07)),
            "contrastive": (lambda: mk.ContrastiveLoss(0.0, 1.0), lambda: pml.ContrastiveLoss(0, 1)),
            "smooth_triplet": (
                lambda: mk.TripletMarginLoss(0.2, "batch_all", "l2", smooth_loss=True),
                lambda: pml.TripletMarginLoss(0.2, smooth_loss=True),
            ),
        }

    out = {
        "local_margin": ours_local,
        "local_margin_loop": lambda: local_margin_loop,
        "circle": ours_circle,
        "pml_circle": pml_circle,
        "batch_all": ours_batch_all,
        "pml_batch_all": pml_batch_all,
    }
    for name in PEERS:
        out[name] = lambda name=name: peers()[name][0]()
        out[f"pml_{name}"] = lambda name=name: peers()[name][1]()
    return out


PEERS = {
    "ms": "MultiSimilarityLoss vs PML MultiSimilarityLoss",
    "ms_mined": "MultiSimilarityLoss(epsilon=0.1) vs PML miner + loss",
    "supcon": "SupConLoss vs PML SupConLoss",
    "ntxent": "NTXentLoss vs PML NTXentLoss (2 views per class)",
    "contrastive": "ContrastiveLoss vs PML ContrastiveLoss",
    "smooth_triplet": "TripletMarginLoss(smooth_loss=True) vs PML (smooth_loss=True)",
}
PAIRS = [
    ("LocalMarginTripletLoss vs per-anchor loop", "local_margin", "local_margin_loop"),
    ("CircleLoss vs PML CircleLoss", "circle", "pml_circle"),
    ("TripletMarginLoss batch_all vs PML TripletMarginLoss", "batch_all", "pml_batch_all"),
    *((title, name, f"pml_{name}") for name, title in PEERS.items()),
]


def step(loss_fn: Callable, emb: torch.Tensor, labels: torch.Tensor) -> float:
    x = emb.clone().requires_grad_(True)
    start = time.perf_counter()
    loss_fn(x, labels).backward()
    return time.perf_counter() - start


Row = tuple[str, int, list[float], list[float]]


def time_all(
    batch_sizes: list[int], repeats: int, loop_max: int, only: set[str] | None, in_a_row: int = 1
) -> list[Row]:
    impls = {name: make() for name, make in implementations().items()}
    rows = []
    for batch in batch_sizes:
        for title, ours, ref in PAIRS:
            if only and ours not in only:
                continue
            emb, labels = make_batch(batch, per_class=ROW_PER_CLASS.get(ours, PER_CLASS))
            reps = repeats
            if ref == "local_margin_loop" and batch > loop_max:
                continue
            if ref == "pml_ntxent" and pml_ntxent_bytes(batch) > _available_gb() * 2**30 / 2:
                print(
                    f"  skipped {title} at B={batch}: PML needs ~{pml_ntxent_bytes(batch) / 2**30:.0f} GB",
                    file=sys.stderr,
                )
                rows.append((title, batch, [], []))
                continue
            if ref in ("pml_batch_all", "pml_smooth_triplet", "pml_ntxent") and batch >= 1024:
                reps = max(2, repeats // 4)  # seconds per call
            times: dict[str, list[float]] = {ours: [], ref: []}
            for name in (ours, ref):
                step(impls[name], emb, labels)  # warm-up
            for _ in range(reps):
                for name in (ours, ref):  # interleaved: both see the same machine load
                    times[name].append(min(step(impls[name], emb, labels) for _ in range(in_a_row)))
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
    per_class = ROW_PER_CLASS.get(name, PER_CLASS)
    small_emb, small_labels = make_batch(64, per_class=per_class)
    step(loss_fn, small_emb, small_labels)  # imports, kernels, allocator warm-up
    emb, labels = make_batch(batch, per_class=per_class)
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
    parser.add_argument(
        "--in-a-row", type=int, default=1, help="passes in a row per round, the fastest kept (default 1)"
    )
    parser.add_argument("--memory-batch", type=int, default=4096)
    parser.add_argument("--sizes", type=int, nargs="+", help="batch sizes (default 128 256 512 1024)")
    parser.add_argument(
        "--only", nargs="+", help=f"rows by our implementation's name: {', '.join(n for _, n, _ in PAIRS)}"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory table")
    parser.add_argument(
        "--no-kernel",
        action="store_true",
        help="the local-margin triplet's selection by torch even where numba is installed",
    )
    parser.add_argument("--_peak", nargs=2, metavar=("NAME", "B"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._peak:
        _peak_child(args._peak[0], int(args._peak[1]))
        return

    torch.set_num_threads(args.threads)
    from marginkit.ops import selection

    if args.no_kernel:
        selection.LOCAL_KERNEL.loaded = False
    kernel = selection.LOCAL_KERNEL.get() is not None
    sizes = [32, 64] if args.quick else (args.sizes or [128, 256, 512, 1024])
    repeats = 2 if args.quick else args.repeats
    mem_batch = 256 if args.quick else args.memory_batch
    only = set(args.only) if args.only else None
    print(
        f"torch {torch.__version__}, threads={args.threads}, D={DIM}, {PER_CLASS} samples per class,"
        f" {max(1, args.in_a_row)} pass(es) in a row per round; the local-margin triplet's selection by"
        f" {'the compiled kernel' if kernel else 'torch (topk)'}"
    )
    rows = time_all(sizes, repeats, loop_max=1024, only=only, in_a_row=max(1, args.in_a_row))
    print()
    print(
        "| comparison | B | ours: min (median) ms | reference: min (median) ms | speed-up (ref / ours, min) |"
    )
    print("|---|---:|---:|---:|---:|")
    for title, batch, ours, ref in rows:
        if not ref:
            print(
                f"| {title} | {batch} | — | skipped: PML needs ~{pml_ntxent_bytes(batch) / 2**30:.0f} GB "
                "| — |"
            )
            continue
        o, r = min(ours), min(ref)
        om, rm = statistics.median(ours), statistics.median(ref)
        cells = f"{o * 1e3:.2f} ({om * 1e3:.2f}) | {r * 1e3:.2f} ({rm * 1e3:.2f})"
        print(f"| {title} | {batch} | {cells} | {r / o:.2f}× |")
    print()
    if args.no_memory:
        return
    print(f"Peak extra resident memory of one forward+backward at B={mem_batch} (fresh subprocess each):")
    print()
    print("| implementation | peak memory (step time) |")
    print("|---|---:|")
    timeout = 60.0 if args.quick else 600.0
    names = [n for _, ours, ref in PAIRS for n in (ours, ref) if n != "local_margin_loop"]
    for name in names:
        if only and name.removeprefix("pml_") not in only:
            continue
        if name in ("pml_batch_all", "pml_smooth_triplet") and not args.quick and _available_gb() < 16:
            print(f"| {name} | skipped (only {_available_gb():.1f} GB available) |")
            continue
        if name == "pml_ntxent" and pml_ntxent_bytes(mem_batch) > _available_gb() * 2**30 / 2:
            print(f"| {name} | skipped (needs ~{pml_ntxent_bytes(mem_batch) / 2**30:.0f} GB) |")
            continue
        print(f"| {name} | {peak_memory(name, mem_batch, timeout)} |", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
