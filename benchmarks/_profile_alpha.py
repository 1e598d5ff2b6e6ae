"""Developer timing script for the alpha-divergence losses (not the published benchmark).

Forward + backward on cosine logits, B = 128, side by side: QMarginLoss (automatic candidate
filter, top-K 5 %, candidates disabled), an inline CosFace (F.cross_entropy on s(c − m e_y)) and
entmax's EntmaxBisectLoss at the same α. Reports the minimum over repeats of the wall time and of
the CPU time of the calling thread (with one intra-op thread the latter is robust to other
processes sharing the machine). Two cosine regimes: "random" (random unit embeddings and centres,
D = 512: the start of training) and "trained" (the label cosine ~0.7, the others ~N(0, 0.1)).

    python benchmarks/_profile_alpha.py [--quick] [--classes 10000 100000] [--threads 1]
    python benchmarks/_profile_alpha.py --iterations    # Newton iteration counts per dtype
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from entmax import EntmaxBisectLoss

from marginkit.losses import QMarginLoss
from marginkit.ops.alpha import _candidates as candidates_impl
from marginkit.ops.alpha import _newton as newton_impl


def cosines(kind: str, b: int, c: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, c, (b,), generator=gen)
    if kind == "random":
        d = 512
        e = F.normalize(torch.randn(b, d, generator=gen), dim=1)
        cos = torch.empty(b, c)
        for start in range(0, c, 65536):  # chunked to bound memory at 10^6 classes
            w = F.normalize(torch.randn(min(65536, c - start), d, generator=gen), dim=1)
            cos[:, start : start + w.shape[0]] = e @ w.T
    else:
        cos = (0.1 * torch.randn(b, c, generator=gen)).clamp_(-1, 1)
        cos[torch.arange(b), y] = (0.7 + 0.1 * torch.randn(b, generator=gen)).clamp_(-1, 1)
    return cos.contiguous(), y


def measure(fn, repeats: int) -> tuple[float, float]:
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpus.append(time.thread_time() - c0)
        walls.append(time.perf_counter() - w0)
    return min(walls) * 1e3, min(cpus) * 1e3


def iteration_counts(quick: bool) -> None:
    """Newton iterations until |step| <= 4 eps (1 + |tau|), per row, by alpha, dtype and data.

    Also the bisection steps the same tolerance would need from the same bracket.
    """
    gen = torch.Generator().manual_seed(0)
    rows, n = (16, 2000) if quick else (128, 20_000)
    data = {
        "cos d=512, s=35": lambda: 35 * torch.randn(rows, n, generator=gen, dtype=torch.float64) / 512**0.5,
        "N(0,1)": lambda: torch.randn(rows, n, generator=gen, dtype=torch.float64),
        "N(0,10^2)": lambda: 10 * torch.randn(rows, n, generator=gen, dtype=torch.float64),
        "ties+1 big": lambda: torch.zeros(rows, n, dtype=torch.float64).index_fill_(
            1, torch.tensor([0]), 3.0
        ),
    }
    print(f"rows={rows} n={n}; per-row Newton iterations to convergence: mean / max; executed; bisection")
    for name, make in data.items():
        x64 = make()
        for alpha in (1.1, 1.25, 1.5, 2.0, 3.0, 4.0):
            for dtype in (torch.float32, torch.float64):
                x = x64.to(dtype)
                beta = torch.full((rows,), alpha - 1, dtype=dtype)
                problem = newton_impl._Problem(candidates_impl._Entries(rows, n), x, None, beta, alpha - 1)
                lo, hi = newton_impl._lower_bound(problem), newton_impl._upper_bound(problem)
                trace: list[torch.Tensor] = []
                tau, _, _, _ = newton_impl._find_tau(problem, lo, hi, hybrid=alpha > 2, trace=trace)
                done = torch.stack(trace)
                first = torch.where(done.any(0), done.int().argmax(0) + 1, len(trace) + 1).double()
                tol = 4 * torch.finfo(dtype).eps * (1 + tau.abs())
                bisect = torch.log2((hi - lo).double() / tol.double()).clamp_min(0).ceil()
                print(
                    f"  {name:16s} alpha={alpha:<4} {str(dtype)[6:]:8s} newton {first.mean():5.2f} / "
                    f"{int(first.max()):3d}   executed {len(trace):3d}   bisection {int(bisect.max()):3d}"
                )


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke run)")
    parser.add_argument("--classes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=1.25)
    parser.add_argument("--no-entmax", action="store_true")
    parser.add_argument("--iterations", action="store_true", help="measure Newton iteration counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.iterations:
        iteration_counts(args.quick)
        return
    classes = [2000] if args.quick else args.classes
    repeats = 1 if args.quick else args.repeats
    s, m, alpha = 35.0, 0.2, args.alpha
    gen = torch.Generator().manual_seed(0)
    print(f"B={args.batch} alpha={alpha} s={s} m={m} threads={args.threads}; ms: wall / thread-CPU (min)")
    for kind in ("random", "trained"):
        for c in classes:
            cos, y = cosines(kind, args.batch, c, gen)
            x = cos.clone().requires_grad_()
            rows = torch.arange(args.batch)

            def cosface(x=x, y=y, rows=rows):
                logits = x * s
                logits[rows, y] -= s * m
                F.cross_entropy(logits, y).backward()

            variants = {"cosface(inline)": cosface}
            for name, kwargs in (("qmargin", {}), ("qmargin topk5%", {"topk": 0.05}), ("qmargin nocand", {})):
                loss_fn = QMarginLoss(alpha, s, m, **kwargs, candidates=name != "qmargin nocand")
                variants[name] = lambda f=loss_fn, x=x, y=y: f(x, y).backward()
            if not args.no_entmax and c <= 100_000:
                peer = EntmaxBisectLoss(alpha)
                # the peer has no reference measure: time it on s·c (same cost)
                variants["entmax EntmaxBisectLoss"] = lambda p=peer, x=x, y=y: p(x * s, y).backward()
            results = {}
            for name, fn in variants.items():
                if name == "qmargin nocand" and c > 100_000:
                    continue
                results[name] = measure(fn, repeats if "entmax" not in name else max(1, repeats // 3))
            base = results["cosface(inline)"][1]
            loss_fn = QMarginLoss(alpha, s, m)
            loss_fn(cos, y)
            support = float(loss_fn.last_support_size.float().mean())
            print(f"[{kind}] C={c}: mean support {support:.1f}")
            for name, (wall, cpu) in results.items():
                print(f"  {name:26s} {wall:9.2f} / {cpu:9.2f}   cpu ratio to cosface {cpu / base:6.2f}")


if __name__ == "__main__":
    main()
