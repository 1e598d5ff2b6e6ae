"""The class-level losses of issue 16 next to their peers, with a cosine head at C = 10^5.

Forward + backward (gradients w.r.t. the embeddings and the centres), D = 128, batches
B = 128, 256, 512, 1024, side by side in one run; each pair is "ours ÷ peer":

- SubCenterArcFaceLoss on ``CosineHead(sub_centers=3)`` ÷ pytorch-metric-learning's
  SubCenterArcFaceLoss (sub_centers=3; it owns the centres, set to the same values);
- ProxyAnchorLoss on ``CosineHead`` ÷ pytorch-metric-learning's ProxyAnchorLoss;
- CombinedMarginLoss(1, 0.3, 0.2) ÷ arcface_torch's recipe in plain torch (normalised
  embeddings × normalised centres, the target column replaced by cos(m1·arccos c + m2) − m3,
  scaled, ``F.cross_entropy``);
- AdaFaceLoss ÷ the AdaFace authors' head in plain torch (arccos, both margins, clamps, CE).

Timing as ``bench_qmargin.py``: one warm-up and one peak-memory call per method, then
``--repeats`` interleaved rounds (order reversed every other round); ratios are medians of
per-round ratios. Peak memory: the
process's resident high-water mark during one step minus its resident size before it
(``/proc/self/clear_refs``; glibc is told to mmap allocations over 64 KiB and trim on free, so
RSS follows live memory; the script re-executes itself with that setting).

    python benchmarks/bench_class_losses.py            # B = 128 … 1024 at C = 1e5 (minutes)
    python benchmarks/bench_class_losses.py --quick    # tiny smoke run
    python benchmarks/bench_class_losses.py --only SubCenterArcFace --batches 256,512
"""

from __future__ import annotations

import os
import sys

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # before torch allocates anything
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.execv(sys.executable, [sys.executable, *sys.argv])

import argparse
import gc
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from marginkit.heads import CosineHead
from marginkit.losses import AdaFaceLoss, CombinedMarginLoss, ProxyAnchorLoss, SubCenterArcFaceLoss

Step = Callable[[], None]


def _kib(field: str) -> int:
    with open("/proc/self/status") as file:
        return next(int(line.split()[1]) for line in file if line.startswith(field + ":"))


def peak_mib(step: Step) -> float | None:
    """Resident high-water mark of one call minus the resident size before it (MiB)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:
        return None
    base = _kib("VmRSS")
    step()
    return (_kib("VmHWM") - base) / 1024


def combined_reference(e, w, y, m1=1.0, m2=0.3, m3=0.2, s=64.0):
    cos = F.normalize(e) @ F.normalize(w).t()
    c_y = cos.gather(1, y[:, None]).clamp(-1 + 1e-7, 1 - 1e-7)
    target = torch.cos(m1 * torch.arccos(c_y) + m2) - m3
    return F.cross_entropy(s * cos.scatter(1, y[:, None], target), y)


def adaface_reference(e, w, y, m=0.4, h=0.333, s=64.0, eps=1e-3):
    norms = torch.linalg.vector_norm(e, dim=1, keepdim=True)
    cos = ((e / norms) @ F.normalize(w).t()).clamp(-1 + eps, 1 - eps)
    safe = norms.clamp(0.001, 100).detach()
    scaler = ((safe - safe.mean()) / (safe.std() + eps) * h).clamp(-1, 1)
    onehot = torch.zeros_like(cos).scatter_(1, y[:, None], 1.0)
    theta = (cos.acos() + onehot * (-m * scaler)).clamp(eps, math.pi - eps)
    return F.cross_entropy(s * (theta.cos() - onehot * (m + m * scaler)), y)


def steps_for(num_classes: int, dim: int, batch: int, seed: int) -> dict[str, Step]:
    from pytorch_metric_learning import losses as pml

    gen = torch.Generator().manual_seed(seed)
    head = CosineHead(num_classes, dim)
    sub = CosineHead(num_classes, dim, sub_centers=3)
    y = torch.randint(0, num_classes, (batch,), generator=gen)
    e = head.weight.detach()[y] + 0.9 * torch.randn(batch, dim, generator=gen) / math.sqrt(dim)
    e = e * (1 + 4 * torch.rand(batch, 1, generator=gen))  # norms in [1, 5]: AdaFace's scaler varies

    def ours(module: torch.nn.Module, loss: Callable[..., torch.Tensor], **kw: bool) -> Step:
        def step() -> None:
            module.zero_grad(set_to_none=True)
            x = e.clone().requires_grad_(True)
            loss(module(x, **kw), y).backward()

        return step

    def peer(loss: torch.nn.Module, weight: str, value: torch.Tensor) -> Step:
        getattr(loss, weight).data = value.clone()

        def step() -> None:
            loss.zero_grad(set_to_none=True)
            x = e.clone().requires_grad_(True)
            loss(x, y).backward()

        return step

    def plain(fn: Callable[..., torch.Tensor]) -> Step:
        w = head.weight.detach().clone().requires_grad_(True)

        def step() -> None:
            w.grad = None
            x = e.clone().requires_grad_(True)
            fn(x, w, y).backward()

        return step

    sub_w = sub.weight.detach().reshape(num_classes * 3, dim).t()
    return {
        "SubCenterArcFace": ours(sub, SubCenterArcFaceLoss(64.0, 0.5, sub_centers=3)),
        "PML SubCenterArcFace": peer(
            pml.SubCenterArcFaceLoss(num_classes=num_classes, embedding_size=dim, sub_centers=3), "W", sub_w
        ),
        "ProxyAnchor": ours(head, ProxyAnchorLoss()),
        "PML ProxyAnchor": peer(
            pml.ProxyAnchorLoss(num_classes, dim, margin=0.1, alpha=32), "proxies", head.weight.detach()
        ),
        "CombinedMargin": ours(head, CombinedMarginLoss(1.0, 0.3, 0.2, 64.0)),
        "arcface_torch recipe": plain(combined_reference),
        "AdaFace": ours(head, AdaFaceLoss(t_alpha=1.0), with_norms=True),
        "AdaFace authors' head": plain(adaface_reference),
    }


PAIRS = [
    ("SubCenterArcFace", "PML SubCenterArcFace"),
    ("ProxyAnchor", "PML ProxyAnchor"),
    ("CombinedMargin", "arcface_torch recipe"),
    ("AdaFace", "AdaFace authors' head"),
]


def measure(steps: dict[str, Step], repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batches", default="128,256,512,1024", help="comma- or space-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="C = 2000, B = 32,64, 2 rounds")
    parser.add_argument(
        "--only", nargs="+", choices=[ours for ours, _ in PAIRS], help="these losses (and their peers) only"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.classes, args.batches, args.repeats = 2000, "32,64", 2
    torch.set_num_threads(args.threads)
    print(f"C = {args.classes}, D = {args.dim}, {args.threads} threads, {args.repeats} rounds")
    print("| B | loss | ms | peak MiB | peer | peer ms | peer peak MiB | time ÷ peer | peak ÷ peer |")
    print("|---|---|---|---|---|---|---|---|---|")
    pairs = [pair for pair in PAIRS if not args.only or pair[0] in args.only]
    for batch in (int(b) for b in args.batches.replace(",", " ").split()):
        steps = steps_for(args.classes, args.dim, batch, seed=batch)
        steps = {name: step for name, step in steps.items() if any(name in pair for pair in pairs)}
        for step in steps.values():  # warm-up
            step()
        peaks = {name: peak_mib(step) for name, step in steps.items()}
        times = measure(steps, args.repeats)
        for ours, peer in pairs:
            ratio = statistics.median(a / b for a, b in zip(times[ours], times[peer], strict=True))
            t_ours, t_peer = (1e3 * statistics.median(times[n]) for n in (ours, peer))
            p_ours, p_peer = peaks[ours], peaks[peer]
            mem = f"{p_ours / p_peer:.2f}×" if p_ours and p_peer else "n/a"
            print(
                f"| {batch} | {ours} | {t_ours:.0f} | {p_ours or float('nan'):.0f} | {peer} | {t_peer:.0f} | "
                f"{p_peer or float('nan'):.0f} | {ratio:.2f}× | {mem} |",
                flush=True,
            )
        del steps


if __name__ == "__main__":
    main()
