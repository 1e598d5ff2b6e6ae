"""Evaluation metrics side by side: AS-norm against numpy, EER/minDCF against scikit-learn.

1. AS-norm of 10⁶ trials against a 10⁴ cohort (top-k = 300). Trials are pairs of 10⁴
   enrollment and 10⁴ test embeddings (D = 256, simulated identities): per-trial cohort score
   matrices (10⁶ x 10⁴, 40 GB) cannot be held by either side, so both compute the cohort
   statistics once per embedding and index them by trial.

   - marginkit: ``cohort_stats`` (row chunks against the cohort through numpy's BLAS, each
     chunk's top k by ``np.partition`` in a worker thread while the next chunk is scored,
     ``memory_limit_mb=256``) for each side, then ``normalize_scores(..., trials=...)``;
   - numpy, sort-based (the plain implementation): the ``[10⁴, 10⁴]`` score matrix of each
     side, ``np.sort`` of every row, the last ``k`` columns' mean and std, then the trials;
   - numpy, partition-based (``np.partition`` instead of the sort): reported for fairness;
   - the two ``[10⁴, 256] x [256, 10⁴]`` products alone, with numpy's BLAS and with torch's
     (no selection): the floor of every method above, which all compute the same scores.

   Every method gets the same normalised embeddings; results are compared (max difference).

2. EER and minDCF (p_target 0.01) of 10⁷ scores (10⁵ genuine):

   - marginkit: ``eer`` + ``min_dcf``, and ``verification_metrics`` (which also gives TAR@FAR,
     AUC, thresholds from one sort per class);
   - scikit-learn: ``roc_curve(drop_intermediate=False)``, EER by linear interpolation of the
     crossing on its arrays, minDCF as the minimum over its operating points.

Each time is the best of ``--repeats``, the methods of a table timed round-robin in one
process. Peak memory: the growth of the process's peak RSS during one call, measured after
resetting the counter (``/proc/self/clear_refs``), with glibc told to ``mmap`` every allocation
over 64 KiB and to trim on free (the script re-executes itself with those settings), so RSS
follows live memory. Inputs exist before the measurement; outputs count.

3. Issue 39: the EER alone and the TAR at FAR = 1e-3 alone of the same 10⁷ scores — marginkit
   selects the order statistics they need (a histogram of the float bits, then one bin) — against
   scikit-learn's ``roc_curve`` + interpolation (goal: >= 30x at one thread), against the sorted
   path they took before (which must give the bit-identical float), and their distance to
   scikit-learn's value (within 1e-4). With numba (the ``fast`` extra) the histogram and the
   crossing bins' scores come from two compiled passes; ``--no-kernel`` times the numpy path.

    python benchmarks/bench_metrics.py [--quick] [--only as-norm|eer|selection|retrieval] [--threads 2]
        [--repeats 3] [--json out.json]

4. Retrieval: every ranking metric of ``retrieval_metrics`` (full MAP and MRR included: every
   reference ranked) over ``N`` = 40,000 float32 embeddings (D = 64, 10 per class), each query
   against the others — what ``marginkit train`` reports on a test split — with full MAP / MRR
   counted (``searchsorted`` of packed keys, ``O(N log R)`` a query) against the full sort of every
   row they took before (``retrieval.COUNT_FULL_RANKS = False``), and the other metrics alone
   (the floor: a top-R search). Both paths' values agree within float64 rounding.

``--quick`` shrinks every size 10x (smoke run); ``--only`` runs one of the four parts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

from bench_knn import best_times  # the same round-robin best-of timing

_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_WAIT_POLICY": "PASSIVE"}


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def peak_mb(fn: Callable[[], Any]) -> float:
    """Growth of the peak RSS (MB) during ``fn()`` (Linux); NaN where it cannot be measured."""
    if not os.path.exists("/proc/self/clear_refs"):
        return float("nan")
    gc.collect()
    base = _kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = fn()
    growth = (_kib("VmHWM:") - base) / 1024
    del out
    return growth


def table(title: str, rows: list[tuple[str, float, float, str]], base: str) -> list[dict[str, Any]]:
    times = {name: t for name, t, _, _ in rows}
    print(f"\n## {title}\n")
    print(f"| method | time (s) | speed-up over {base} | peak memory (MB) | agreement |")
    print("|---|---|---|---|---|")
    out = []
    for name, t, mem, agree in rows:
        print(f"| {name} | {t:.3f} | {times[base] / t:.2f}x | {mem:.0f} | {agree} |")
        out.append(
            {"method": name, "time_s": t, "speedup": times[base] / t, "peak_mb": mem, "agreement": agree}
        )
    return out


def as_norm(args: argparse.Namespace, scale: int) -> list[dict[str, Any]]:
    import numpy as np
    import torch

    from marginkit.metrics import cohort_stats, normalize_scores

    n_side, n_cohort, n_trials, dim, k = (
        10_000 // scale,
        10_000 // scale,
        1_000_000 // scale,
        256,
        300 // scale,
    )
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randn(n_side // 10, dim, generator=g)

    def people(n: int) -> torch.Tensor:
        x = ids[torch.randint(0, ids.shape[0], (n,), generator=g)] + torch.randn(n, dim, generator=g)
        return torch.nn.functional.normalize(x, dim=1).contiguous()

    enroll, test = people(n_side), people(n_side)
    cohort = torch.nn.functional.normalize(torch.randn(n_cohort, dim, generator=g), dim=1).contiguous()
    trials = torch.randint(0, n_side, (n_trials, 2), generator=g)
    scores = (enroll[trials[:, 0]] * test[trials[:, 1]]).sum(1)
    e_np, t_np, c_np, tr_np, s_np = (
        enroll.numpy(),
        test.numpy(),
        cohort.numpy(),
        trials.numpy(),
        scores.numpy(),
    )

    def ours() -> Any:
        se = cohort_stats(enroll, cohort, top_k=k)
        st = cohort_stats(test, cohort, top_k=k)
        return normalize_scores(scores, se, st, method="as-norm", trials=trials)

    def top_stats(s: Any, kind: str) -> tuple[Any, Any]:
        top = np.sort(s, axis=1)[:, -k:] if kind == "sort" else np.partition(s, -k, axis=1)[:, -k:]
        top = top.astype(np.float64)
        return top.mean(axis=1), top.std(axis=1)

    def plain(kind: str, se_np: Any = None, st_np: Any = None) -> Any:
        # one side's score matrix at a time (each freed once reduced)
        me, se = top_stats(e_np @ c_np.T if se_np is None else se_np, kind)
        mt, st = top_stats(t_np @ c_np.T if st_np is None else st_np, kind)
        a, b = tr_np[:, 0], tr_np[:, 1]
        s = s_np.astype(np.float64)
        return ((s - me[a]) / se[a] + (s - mt[b]) / st[b]) / 2

    def products(lib: str) -> Any:
        # the two sides' score matrices and nothing else: the work every method above shares
        for side in (enroll, test):
            out = side.numpy() @ c_np.T if lib == "numpy" else side @ cohort.T
            del out
        return None

    def run(fns: dict[str, Callable[[], Any]], label: str) -> list[tuple[str, float, float, str]]:
        timed = best_times(fns, args.repeats)
        mem = {name: peak_mb(fn) for name, fn in fns.items()}
        ref = timed["sort"][1]
        diff = {
            n: float(np.abs(np.asarray(out, dtype=np.float64) - ref).max())
            for n, (_, out) in timed.items()
            if out is not None
        }
        floor = [
            (f"(the two products alone, {lib}: no selection)", timed[lib][0], mem[lib], "-")
            for lib in ("numpy", "torch")
            if lib in timed
        ]
        return [
            ("numpy, np.sort per row", timed["sort"][0], mem["sort"], "reference"),
            (
                "numpy, np.partition per row",
                timed["partition"][0],
                mem["partition"],
                f"max diff {diff['partition']:.1e}",
            ),
            (
                f"marginkit {label}",
                timed["ours"][0],
                mem["ours"],
                f"max diff {diff['ours']:.1e}",
            ),
            *floor,
        ]

    sizes = f"{n_trials:,} trials, {n_side:,} + {n_side:,} trial sides, {n_cohort:,} cohort, top-k = {k}"
    out = table(
        f"AS-norm from embeddings (D = {dim}): {sizes}",
        run(
            {
                "ours": ours,
                "sort": lambda: plain("sort"),
                "partition": lambda: plain("partition"),
                "numpy": lambda: products("numpy"),
                "torch": lambda: products("torch"),
            },
            "cohort_stats + normalize_scores",
        ),
        "numpy, np.sort per row",
    )
    # The same from the two sides' cohort score matrices, given: the selection without the products.
    se_t, st_t = enroll @ cohort.T, test @ cohort.T
    se_np, st_np = se_t.numpy(), st_t.numpy()

    def ours_given() -> Any:
        return normalize_scores(scores, se_t, st_t, method="as-norm", top_k=k, trials=trials)

    out += table(
        f"AS-norm from the sides' cohort score matrices (given): {sizes}",
        run(
            {
                "ours": ours_given,
                "sort": lambda: plain("sort", se_np, st_np),
                "partition": lambda: plain("partition", se_np, st_np),
            },
            "normalize_scores(score matrices, trials=...)",
        ),
        "numpy, np.sort per row",
    )
    return out


def eer_min_dcf(args: argparse.Namespace, scale: int) -> list[dict[str, Any]]:
    import numpy as np
    import torch
    from sklearn.metrics import roc_curve

    from marginkit.metrics import eer, min_dcf, verification_metrics

    n, n_gen = 10_000_000 // scale, 100_000 // scale
    g = torch.Generator().manual_seed(args.seed)
    scores = torch.cat(
        [0.5 + 0.2 * torch.randn(n_gen, generator=g), 0.2 * torch.randn(n - n_gen, generator=g)]
    )
    is_genuine = torch.zeros(n, dtype=torch.bool)
    is_genuine[:n_gen] = True
    perm = torch.randperm(n, generator=g)
    scores, is_genuine = scores[perm].contiguous(), is_genuine[perm].contiguous()
    s_np, y_np = scores.numpy(), is_genuine.numpy()
    p = 0.01

    def sklearn() -> tuple[float, float]:
        fpr, tpr, _ = roc_curve(y_np, s_np, drop_intermediate=False)
        fnr = 1 - tpr
        d = fpr - fnr  # falls from 0 - 1 ... scikit-learn's order: thresholds descending
        j = int(np.nonzero(d >= 0)[0][0])
        a = -d[j - 1] / (d[j] - d[j - 1])
        e = fpr[j - 1] + a * (fpr[j] - fpr[j - 1])
        dcf = (p * fnr + (1 - p) * fpr).min() / min(p, 1 - p)
        return float(e), float(dcf)

    def ours() -> tuple[float, float]:
        return eer(scores, is_genuine), min_dcf(scores, is_genuine, p)[0]

    def ours_all() -> tuple[float, float]:
        m = verification_metrics(scores, is_genuine, p_target=p)
        return m["eer"], m["min_dcf"]

    fns = {"sklearn": sklearn, "ours": ours, "all": ours_all}
    timed = best_times(fns, args.repeats)
    mem = {name: peak_mb(fn) for name, fn in fns.items()}
    ref = timed["sklearn"][1]

    def agree(out: tuple[float, float]) -> str:
        return f"EER diff {abs(out[0] - ref[0]):.1e}, minDCF diff {abs(out[1] - ref[1]):.1e}"

    rows = [
        ("scikit-learn roc_curve + EER + minDCF", timed["sklearn"][0], mem["sklearn"], f"EER {ref[0]:.5f}"),
        ("marginkit eer + min_dcf", timed["ours"][0], mem["ours"], agree(timed["ours"][1])),
        ("marginkit verification_metrics (all)", timed["all"][0], mem["all"], agree(timed["all"][1])),
    ]
    return table(
        f"EER and minDCF of {n:,} scores ({n_gen:,} genuine)", rows, "scikit-learn roc_curve + EER + minDCF"
    )


def eer_tar_selection(args: argparse.Namespace, scale: int) -> list[dict[str, Any]]:
    """Issue 39: EER and TAR at FAR = 1e-3 alone, by selection (no sort) against scikit-learn."""
    import numpy as np
    import torch
    from sklearn.metrics import roc_curve

    from marginkit.metrics import _roc
    from marginkit.metrics.verification import eer, tar_at_far
    from marginkit.ops import selection

    if args.no_kernel:
        selection.BINS_KERNEL.loaded = False
    kernel = selection.BINS_KERNEL.get() is not None
    print(f"\nthe histogram: {'two compiled passes (numba)' if kernel else 'numpy'}")
    n, n_gen, far = 10_000_000 // scale, 100_000 // scale, 1e-3
    g = torch.Generator().manual_seed(args.seed)
    scores = torch.cat(
        [0.5 + 0.2 * torch.randn(n_gen, generator=g), 0.2 * torch.randn(n - n_gen, generator=g)]
    )
    is_genuine = torch.zeros(n, dtype=torch.bool)
    is_genuine[:n_gen] = True
    perm = torch.randperm(n, generator=g)
    scores, is_genuine = scores[perm].contiguous(), is_genuine[perm].contiguous()
    s_np, y_np = scores.numpy(), is_genuine.numpy()

    def sk_eer() -> float:
        fpr, tpr, _ = roc_curve(y_np, s_np, drop_intermediate=False)
        d = fpr - (1 - tpr)
        j = int(np.nonzero(d >= 0)[0][0])
        a = -d[j - 1] / (d[j] - d[j - 1])
        return float(fpr[j - 1] + a * (fpr[j] - fpr[j - 1]))

    def sk_tar() -> float:
        fpr, tpr, _ = roc_curve(y_np, s_np, drop_intermediate=False)
        return float(tpr[np.searchsorted(fpr, far, side="right") - 1])  # the last point with FAR <= far

    def sorted_eer() -> float:  # the path before issue 39: both classes sorted, then searches
        return _roc.eer(*_roc.sides(scores, is_genuine))

    def sorted_tar() -> tuple[Any, Any]:
        thresholds, tars = _roc.rates_at_targets(*_roc.sides(scores, is_genuine), (far,))
        return tars[far], thresholds[far]

    fns = {
        "sk_eer": sk_eer,
        "sorted_eer": sorted_eer,
        "eer": lambda: eer(scores, is_genuine),
        "sk_tar": sk_tar,
        "sorted_tar": sorted_tar,
        "tar": lambda: tar_at_far(scores, is_genuine, far),
    }
    timed = best_times(fns, args.repeats)
    t = {k: v[0] for k, v in timed.items()}
    out = {k: v[1] for k, v in timed.items()}
    same_eer = out["eer"] == out["sorted_eer"]
    same_tar = out["tar"] == out["sorted_tar"]
    print(f"\n## EER and TAR at FAR = {far:g} of {n:,} scores ({n_gen:,} genuine), float32 (issue 39)\n")
    print(
        "| metric | scikit-learn (s) | sorted path (s) | marginkit (s) | sklearn / marginkit | goal |"
        " bit-identical to the sorted path | |marginkit - sklearn| |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for name, key, same in (("EER", "eer", same_eer), (f"TAR@FAR={far:g}", "tar", same_tar)):
        value = out[key] if key == "eer" else out[key][0]
        ratio = t[f"sk_{key}"] / t[key]
        diff = abs(value - out[f"sk_{key}"])
        print(
            f"| {name} | {t[f'sk_{key}']:.3f} | {t[f'sorted_{key}']:.3f} | {t[key]:.4f} | {ratio:.1f}x |"
            f" >= 30x: {'holds' if ratio >= 30 else 'MISSED'} | {same} | {diff:.1e} |"
        )
        rows.append(
            {
                "metric": name,
                "sklearn_s": t[f"sk_{key}"],
                "sorted_s": t[f"sorted_{key}"],
                "marginkit_s": t[key],
                "ratio": ratio,
                "bit_identical": same,
                "diff_sklearn": diff,
            }
        )
    return rows


def retrieval(args: argparse.Namespace, scale: int) -> list[dict[str, Any]]:
    """Full MAP / MRR counted against the full sort they replace (``retrieval.COUNT_FULL_RANKS``)."""
    import time

    import torch

    from marginkit.metrics import retrieval as module
    from marginkit.metrics import retrieval_metrics

    n, per, dim = 40_000 // scale, 10, 64
    g = torch.Generator().manual_seed(args.seed)
    y = torch.arange(n // per).repeat_interleave(per)
    x = torch.randn(n // per, dim, generator=g)[y] + torch.randn(n, dim, generator=g)
    ks = (1, 5, 10)
    others = ("precision_at_1", "r_precision", "map_at_r", "precision_at_k", "recall_at_k")

    def run(counted: bool, include: tuple[str, ...] | None = None) -> tuple[float, dict[str, Any]]:
        module.COUNT_FULL_RANKS = counted
        try:
            t0 = time.perf_counter()
            out = retrieval_metrics(x, y, ks=ks, include=include)
            return time.perf_counter() - t0, out
        finally:
            module.COUNT_FULL_RANKS = True

    # each path runs for minutes at full size: one timing each, alternated by the repeats
    t: dict[str, float] = {}
    out: dict[str, dict[str, Any]] = {}
    for _ in range(max(1, args.repeats // 3)):
        for name, counted, include in (
            ("sorted", False, None),
            ("counted", True, None),
            ("floor", True, others),
        ):
            seconds, out[name] = run(counted, include)
            t[name] = min(t.get(name, float("inf")), seconds)
    diff = max(abs(out["counted"][m] - out["sorted"][m]) for m in ("mean_average_precision", "mrr"))
    print(
        f"\n## Retrieval metrics of {n:,} float32 embeddings (D = {dim}, {per} per class),"
        " each against the rest\n"
    )
    print("| path | time (s) | sorted / this | full MAP | MRR |")
    print("|---|---|---|---|---|")
    rows = []
    for name, label in (
        ("sorted", "full MAP / MRR by a full sort of every row (before)"),
        ("counted", "full MAP / MRR counted (searchsorted of packed keys)"),
        ("floor", "the other metrics alone (top-R search)"),
    ):
        m = out[name]
        full = (f"{m['mean_average_precision']:.6f}", f"{m['mrr']:.6f}") if name != "floor" else ("—", "—")
        print(f"| {label} | {t[name]:.2f} | {t['sorted'] / t[name]:.2f}x | {full[0]} | {full[1]} |")
        rows.append({"path": name, "time_s": t[name], "speedup": t["sorted"] / t[name]})
    print(f"\nlargest |counted - sorted| of full MAP and MRR: {diff:.1e}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10x smaller sizes (smoke run)")
    p.add_argument(
        "--only",
        choices=("as-norm", "eer", "selection", "retrieval"),
        help="run only this part (default: all)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the numbers to this file")
    p.add_argument(
        "--no-kernel",
        action="store_true",
        help="the EER / TAR histogram by numpy even where numba is installed",
    )
    args = p.parse_args()
    if any(os.environ.get(k) != v for k, v in _ENV.items()):  # allocator settings are read at start-up
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_ENV})
    import numpy
    import sklearn
    import torch

    torch.set_num_threads(args.threads)
    scale = 10 if args.quick else 1
    print(
        f"# bench_metrics: torch {torch.__version__}, numpy {numpy.__version__}, scikit-learn "
        f"{sklearn.__version__}, {args.threads} threads, {platform.processor() or platform.machine()}"
    )
    parts = {
        "as_norm": ("as-norm", as_norm),
        "eer_min_dcf": ("eer", eer_min_dcf),
        "eer_tar_selection": ("selection", eer_tar_selection),
        "retrieval": ("retrieval", retrieval),
    }
    results = {key: fn(args, scale) for key, (name, fn) in parts.items() if args.only in (None, name)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
