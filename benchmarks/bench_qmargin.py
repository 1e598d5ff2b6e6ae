"""Q-Margin loss throughput next to CosFace/ArcFace, entmax and pytorch-metric-learning.

Forward + backward, batch B = 128, C classes, side by side in one run (issue 3):

(a) on cosine logits ``[B, C]`` (gradient w.r.t. the cosines):
    QMarginLoss (automatic candidate reduction), QMarginLoss(topk=0.05), QMarginLoss with the
    candidate reduction disabled, our CosFaceLoss and ArcFaceLoss, ``entmax.EntmaxBisectLoss``
    at the same alpha on ``s·c``; reference rows: CosFace as plain ``F.cross_entropy`` on
    margin-modified logits, and ``_validation.cosine_tensor`` alone (a full input check).
(b) with a CosineHead (D = 512; D = 128 at C = 10^6; gradients w.r.t. embeddings and centres):
    QMarginLoss (auto and topk=0.05), our CosFaceLoss/ArcFaceLoss, and pytorch-metric-learning's
    CosFaceLoss/ArcFaceLoss (which own the centres; set to the same values). Q-Margin hands the
    head a sparse gradient (its support and the labels), the others a dense one.

Inputs are built once per C and shared by every method: unit class centres, embeddings at a
target cosine uniform in [0.2, 0.8] from their centre (a mid-training state; non-target
cosines ≈ N(0, 1/D)). Q-Margin's active-class count, hence its speed, depends on that state.

Timing: one warm-up call per method, then ``--repeats`` rounds (``--large-repeats`` at 10^6);
each round runs every method once (the order reversed every other round), so methods are
measured side by side under the same machine load.
Times are medians over rounds; ratios are medians of the per-round ratios (paired, robust to
load drifting between rounds). ``torch.set_num_threads(--threads)`` is fixed.

    python benchmarks/bench_qmargin.py            # C = 1e4, 1e5, 1e6 (minutes)
    python benchmarks/bench_qmargin.py --quick    # tiny smoke run
    python benchmarks/bench_qmargin.py --issue36  # issue 36's table: ms, aten ops, device reads
"""

from __future__ import annotations

import os
import sys

# On a shared, oversubscribed machine, OpenMP workers spinning after each parallel region steal
# the core from the main thread: every small op after a big one then costs a scheduler slice
# (measured here: a [128]-sized op 20-30 ms instead of 20 µs, the whole CosFace step 2.3×
# slower). Passive waiting removes that artefact; it must be set before torch is imported.
# ``--omp-active`` keeps the OpenMP default.
if "--omp-active" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from marginkit._validation import cosine_tensor
from marginkit.heads import CosineHead
from marginkit.losses import ArcFaceLoss, CosFaceLoss, QMarginLoss

Step = Callable[[], None]


def make_inputs(
    num_classes: int, dim: int, batch: int, seed: int
) -> tuple[CosineHead, torch.Tensor, torch.Tensor]:
    """Head with unit centres, embeddings at cosine U(0.2, 0.8) from their class centre, labels."""
    torch.manual_seed(seed)  # CosineHead init draws from the global RNG, like torch.nn layers
    head = CosineHead(num_classes, dim)
    g = torch.Generator().manual_seed(seed + 1)
    labels = torch.randint(0, num_classes, (batch,), generator=g)
    w = head.weight.detach()[labels]
    noise = torch.randn(batch, dim, generator=g)
    noise -= (noise * w).sum(1, keepdim=True) * w  # orthogonal to the centre
    noise = F.normalize(noise, dim=1)
    c_target = 0.2 + 0.6 * torch.rand(batch, 1, generator=g)
    emb = c_target * w + torch.sqrt(1 - c_target**2) * noise
    return head, emb, labels


def logit_steps(cos: torch.Tensor, labels: torch.Tensor, alpha: float, with_entmax: bool) -> dict[str, Step]:
    """Forward+backward closures on the cosine logits (a fresh leaf per method, same values)."""
    steps: dict[str, Step] = {}

    def add(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        x = cos.detach().clone().requires_grad_(True)

        def step() -> None:
            x.grad = None
            fn(x).backward()

        steps[name] = step

    qm = QMarginLoss(alpha=alpha, scale=35.0, margin=0.2)
    qm_top = QMarginLoss(alpha=alpha, scale=35.0, margin=0.2, topk=0.05)
    qm_full = QMarginLoss(alpha=alpha, scale=35.0, margin=0.2, candidates=False)
    cosface, arcface = CosFaceLoss(scale=64.0, margin=0.4), ArcFaceLoss(scale=64.0, margin=0.5)
    add("QMargin auto", lambda x: qm(x, labels))
    add("QMargin topk=5%", lambda x: qm_top(x, labels))
    add("QMargin no candidate filter", lambda x: qm_full(x, labels))
    add("CosFace (ours)", lambda x: cosface(x, labels))
    add("ArcFace (ours)", lambda x: arcface(x, labels))
    if with_entmax:
        from entmax import EntmaxBisectLoss

        ent = EntmaxBisectLoss(alpha=alpha)  # n_iter=50 (the package default)
        add("entmax EntmaxBisectLoss", lambda x: ent(35.0 * x, labels))
    onehot = F.one_hot(labels, cos.shape[1]).to(cos.dtype)
    add("(ref) F.cross_entropy CosFace", lambda x: F.cross_entropy(64.0 * (x - 0.4 * onehot), labels))

    x_check = cos.detach().clone()

    def check_only() -> None:
        cosine_tensor(x_check, "cosines")

    steps["(ref) cosine_tensor check alone"] = check_only
    steps["__qm_losses__"] = (qm, qm_top, qm_full)  # type: ignore[assignment]
    return steps


def head_steps(head: CosineHead, emb: torch.Tensor, labels: torch.Tensor, alpha: float) -> dict[str, Step]:
    from pytorch_metric_learning import losses as pml

    num_classes, dim = head.weight.shape
    steps: dict[str, Step] = {}

    def add_ours(name: str, loss: torch.nn.Module) -> None:
        h = CosineHead(num_classes, dim)
        h.weight.data.copy_(head.weight.detach())
        e = emb.detach().clone().requires_grad_(True)

        def step() -> None:
            e.grad = None
            h.weight.grad = None
            loss(h(e), labels).backward()

        steps[name] = step

    def add_pml(name: str, loss: torch.nn.Module) -> None:
        loss.W.data = head.weight.detach().t().clone()  # PML: W [D, C]
        e = emb.detach().clone().requires_grad_(True)

        def step() -> None:
            e.grad = None
            loss.W.grad = None
            loss(e, labels).backward()

        steps[name] = step

    qm = QMarginLoss(alpha=alpha, scale=35.0, margin=0.2)
    qm_top = QMarginLoss(alpha=alpha, scale=35.0, margin=0.2, topk=0.05)
    add_ours("head + QMargin auto", qm)
    add_ours("head + QMargin topk=5%", qm_top)
    add_ours("head + CosFace (ours)", CosFaceLoss(scale=64.0, margin=0.4))
    add_ours("head + ArcFace (ours)", ArcFaceLoss(scale=64.0, margin=0.5))
    add_pml("PML CosFaceLoss", pml.CosFaceLoss(num_classes, dim, margin=0.4, scale=64))
    # PML's ArcFace margin is in degrees: 0.5 rad = 28.65°
    add_pml("PML ArcFaceLoss", pml.ArcFaceLoss(num_classes, dim, margin=math.degrees(0.5), scale=64))
    steps["__qm_losses__"] = (qm, qm_top)  # type: ignore[assignment]
    return steps


def measure(steps: dict[str, Step], repeats: int, slow: dict[str, int]) -> dict[str, list[float]]:
    """Warm up each step once, then ``repeats`` interleaved rounds (``slow`` caps some methods)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()
    names = list(steps)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:  # alternate the order: drift cancels
            step = steps[name]
            if r >= slow.get(name, repeats):
                continue
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratio(times: dict[str, list[float]], name: str, ref: str) -> float:
    n = min(len(times[name]), len(times[ref]))
    return statistics.median(times[name][i] / times[ref][i] for i in range(n))


def mean_support(losses: tuple[QMarginLoss, ...]) -> list[float]:
    return [float(loss.last_support_size.double().mean()) for loss in losses]


def run(num_classes: int, dim: int, args: argparse.Namespace) -> list[str]:
    head, emb, labels = make_inputs(num_classes, dim, args.batch, args.seed)
    with torch.no_grad():
        cos = head(emb)
    with_entmax = num_classes <= args.entmax_max_classes
    repeats = args.repeats if num_classes < 1_000_000 else min(args.repeats, args.large_repeats)
    lines = [
        f"\n### C = {num_classes:,}, B = {args.batch}, D = {dim}, "
        f"alpha = {args.alpha}, threads = {args.threads}, rounds = {repeats}"
    ]
    # (a) cosine logits
    steps_a = logit_steps(cos, labels, args.alpha, with_entmax)
    qm_a = steps_a.pop("__qm_losses__")
    slow = {"entmax EntmaxBisectLoss": args.entmax_repeats}
    times_a = measure(steps_a, repeats, slow)
    support_a = mean_support(qm_a)
    ref = "CosFace (ours)"
    lines += ["", "(a) on cosine logits", "", "| method | median ms | × our CosFace | mean active classes |"]
    lines.append("|---|---:|---:|---:|")
    sup = dict(
        zip(["QMargin auto", "QMargin topk=5%", "QMargin no candidate filter"], support_a, strict=True)
    )
    for name, ts in times_a.items():
        active = f"{sup[name]:.1f}" if name in sup else ""
        lines.append(
            f"| {name} | {1e3 * statistics.median(ts):.1f} "
            f"| {paired_ratio(times_a, name, ref):.3f} | {active} |"
        )
    if with_entmax:
        speedup = 1 / paired_ratio(times_a, "QMargin auto", "entmax EntmaxBisectLoss")
        lines.append(f"\nQMargin auto is {speedup:.1f}× faster than entmax.EntmaxBisectLoss (n_iter=50).")
    else:
        lines.append(
            f"\nentmax.EntmaxBisectLoss skipped at C > {args.entmax_max_classes:,} (--entmax-max-classes)."
        )
    del steps_a
    # (b) with the head
    steps_b = head_steps(head, emb, labels, args.alpha)
    qm_b = steps_b.pop("__qm_losses__")
    times_b = measure(steps_b, repeats, {})
    support_b = mean_support(qm_b)
    ref_b = "head + CosFace (ours)"
    lines += ["", "(b) with CosineHead (gradients w.r.t. embeddings and centres)", ""]
    lines += ["| method | median ms | × head + our CosFace | × PML same loss | mean active classes |"]
    lines.append("|---|---:|---:|---:|---:|")
    sup_b = dict(zip(["head + QMargin auto", "head + QMargin topk=5%"], support_b, strict=True))
    peer = {"head + CosFace (ours)": "PML CosFaceLoss", "head + ArcFace (ours)": "PML ArcFaceLoss"}
    for name, ts in times_b.items():
        vs_peer = f"{paired_ratio(times_b, name, peer[name]):.3f}" if name in peer else ""
        active = f"{sup_b[name]:.1f}" if name in sup_b else ""
        lines.append(
            f"| {name} | {1e3 * statistics.median(ts):.1f} | {paired_ratio(times_b, name, ref_b):.3f} "
            f"| {vs_peer} | {active} |"
        )
    arc = "head + ArcFace (ours)"
    tput = [
        f"{1 / paired_ratio(times_b, q, arc):.2f}×" for q in ("head + QMargin auto", "head + QMargin topk=5%")
    ]
    lines.append(
        f"\nThroughput relative to head + ArcFace (ours), the paper's table analogue (paper: 0.73× full, "
        f"0.95× top-5 %): QMargin auto {tput[0]}, QMargin topk=5% {tput[1]}."
    )
    return lines


def count_ops(step: Step) -> tuple[int, int]:
    """Aten ops and device reads of one call, inside ``deferred_checks()`` (the trainer's setting)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from dispatch_counts import DispatchCounter

    try:
        from marginkit._validation import deferred_checks
    except ImportError:  # (before issue 36)
        import contextlib

        deferred_checks = contextlib.nullcontext  # type: ignore[assignment]
    with deferred_checks(), DispatchCounter() as counter:
        step()
    return counter.ops, counter.reads


def issue36_table(args: argparse.Namespace) -> list[str]:
    """Issue 36's table on the CPU: Q-Margin (auto, top-5 %) vs CosFace vs ArcFace with a CosineHead."""
    sizes = [(128, 5994, 256, 1.5, 10.0), (128, 100_000, 512, args.alpha, 35.0)]
    if args.quick:
        sizes = [(16, 1000, 32, 1.5, 10.0), (16, 5000, 32, args.alpha, 35.0)]
    lines = ["| B | C | D | α, s | method | median ms | × CosFace | aten ops | device reads |"]
    lines.append("|---|---|---|---|---|---:|---:|---:|---:|")
    for batch, num_classes, dim, alpha, scale in sizes:
        head, emb, labels = make_inputs(num_classes, dim, batch, args.seed)
        steps: dict[str, Step] = {}
        for name, loss in (
            ("QMargin", QMarginLoss(alpha=alpha, scale=scale, margin=0.2)),
            ("QMargin topk=5%", QMarginLoss(alpha=alpha, scale=scale, margin=0.2, topk=0.05)),
            ("CosFace", CosFaceLoss(scale=64.0, margin=0.4)),
            ("ArcFace", ArcFaceLoss(scale=64.0, margin=0.5)),
        ):
            h = CosineHead(num_classes, dim)
            h.weight.data.copy_(head.weight.detach())
            e = emb.detach().clone().requires_grad_(True)

            def step(
                h: CosineHead = h, e: torch.Tensor = e, loss: torch.nn.Module = loss, y: torch.Tensor = labels
            ) -> None:
                e.grad = None
                h.weight.grad = None
                loss(h(e), y).backward()

            steps[name] = step
        counts = {name: count_ops(step) for name, step in steps.items()}
        times = measure(steps, args.repeats, {})
        for name, ts in times.items():
            ops, reads = counts[name]
            lines.append(
                f"| {batch} | {num_classes:,} | {dim} | {alpha:g}, {scale:g} | {name} | "
                f"{1e3 * statistics.median(ts):.1f} | {paired_ratio(times, name, 'CosFace'):.3f} "
                f"| {ops} | {reads} |"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    parser.add_argument("--omp-active", action="store_true", help="keep OpenMP's spinning wait policy")
    parser.add_argument("--classes", type=int, nargs="*", default=None, help="default 1e4 1e5 1e6")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=1.25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--large-repeats", type=int, default=3, help="rounds at C >= 1e6")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--entmax-max-classes", type=int, default=100_000)
    parser.add_argument("--entmax-repeats", type=int, default=3, help="rounds for the (slow) entmax row")
    parser.add_argument("--issue36", action="store_true", help="only issue 36's table, with op / read counts")
    args = parser.parse_args(argv)
    if args.issue36:
        torch.set_num_threads(args.threads)
        if args.quick:
            args.repeats = min(args.repeats, 2)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU")
        print("\n".join(issue36_table(args)))
        return
    if args.quick:
        args.classes = args.classes or [1000, 5000]
        args.batch = min(args.batch, 16)
        args.repeats = min(args.repeats, 2)
    classes = args.classes or [10_000, 100_000, 1_000_000]
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}, "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '(unset)')}"
    )
    for num_classes in classes:
        dim = 128 if num_classes >= 1_000_000 else 512
        if args.quick:
            dim = 32
        print("\n".join(run(num_classes, dim, args)), flush=True)


if __name__ == "__main__":
    main()
