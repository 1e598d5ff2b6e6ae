"""Issue 36's checks on one NVIDIA GPU, importing the project from ``src/`` (nothing installed).

    PYTHONPATH=src python benchmarks/device_check.py            # the GPU run (a few minutes)
    PYTHONPATH=src python benchmarks/device_check.py --cpu-smoke  # every section at tiny sizes on the CPU

Sections (each prints a Markdown table):

1. CUDA == CPU float64 for MEP (L2, L1), Q-Margin (+ gradients), CosFace, ArcFace, the local-margin
   triplet loss and the exact K-NN (largest absolute difference).
2. The Q-Margin table: Q-Margin, Q-Margin top-5 %, CosFace, ArcFace (fwd + bwd with a CosineHead)
   at issue 36's (B, C, D); ms (median of CUDA-event timings), ratio to CosFace, peak memory,
   and host syncs per call (``torch.cuda.set_sync_debug_mode("warn")``, warnings counted), run
   inside ``deferred_checks()`` as the trainer does.
3. MEP against one ``torch.sort`` of the array and the blog's O(n²)-per-row code in JAX under
   ``jax.jit`` (written from SPEC §1's description) when ``jax`` imports.
4. ``marginkit.train.train`` against a bare PyTorch loop (same model, CosineHead, CosFace, SGD,
   batch, synthetic uint8 images): timm ``resnet18`` at 112×112 bf16 and the built-in ``resnet`` at
   64×64, samples/s, and syncs per step of the bare loop.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from marginkit._validation import deferred_checks
from marginkit.heads import CosineHead
from marginkit.losses import ArcFaceLoss, CosFaceLoss, LocalMarginTripletLoss, QMarginLoss
from marginkit.ops.projection import mep


def say(line: str = "") -> None:
    print(line, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median ms of ``fn`` after one warm-up (CUDA events on a GPU)."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def syncs(fn: Callable[[], object], device: torch.device) -> int | str:
    """Host synchronisations of one call, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them."""
    if device.type != "cuda":
        return "n/a"
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# ----------------------------------------------------------------------------------- 1. equality
def equality(device: torch.device, small: bool) -> None:
    say("## 1. CUDA == CPU (float64)\n")
    say("| op | largest abs. difference |")
    say("|---|---:|")
    g = torch.Generator().manual_seed(0)
    b, c, d = (16, 300, 16) if small else (64, 20_000, 128)

    def on_both(fn: Callable[[torch.device], list[torch.Tensor]]) -> float:
        ref, got = fn(torch.device("cpu")), fn(device)
        return max(float((a - r.to(a.device)).abs().max()) for a, r in zip(got, ref, strict=True))

    scores = torch.randn(b, c, generator=g, dtype=torch.float64)
    pos = torch.rand(b, c, generator=g) < 0.01
    pos[:, 0] = True
    for norm in ("l2", "l1"):
        say(f"| MEP {norm} | {on_both(lambda dv, n=norm: [mep(scores.to(dv), pos.to(dv), 0.5, n)]):.2e} |")
    cos = (torch.rand(b, c, generator=g, dtype=torch.float64) * 1.2 - 0.6).clamp(-1, 1)
    y = torch.randint(0, c, (b,), generator=g)
    cos[torch.arange(b // 2), y[: b // 2]] = 0.7
    for name, loss_fn in (
        ("Q-Margin", QMarginLoss(reduction="none")),
        ("CosFace", CosFaceLoss(reduction="none")),
        ("ArcFace", ArcFaceLoss(reduction="none")),
    ):

        def run(dv: torch.device, loss_fn: torch.nn.Module = loss_fn) -> list[torch.Tensor]:
            x = cos.to(dv).requires_grad_(True)
            loss = loss_fn(x, y.to(dv))
            (grad,) = torch.autograd.grad(loss.sum(), x)
            return [loss.detach(), grad]

        say(f"| {name} (loss and gradient) | {on_both(run):.2e} |")
    emb = torch.randn(4 * 16, d, generator=g, dtype=torch.float64)
    lab = torch.arange(16).repeat_interleave(4)

    def triplet(dv: torch.device) -> list[torch.Tensor]:
        x = emb.to(dv).requires_grad_(True)
        loss = LocalMarginTripletLoss()(x, lab.to(dv))
        (grad,) = torch.autograd.grad(loss, x)
        return [loss.detach(), grad]

    say(f"| local-margin triplet (loss and gradient) | {on_both(triplet):.2e} |")
    from marginkit.knn import KNNClassifier

    ref = torch.randn(500, d, generator=g, dtype=torch.float64)
    ref_y = torch.randint(0, 20, (500,), generator=g)
    queries = torch.randn(50, d, generator=g, dtype=torch.float64)

    def knn(dv: torch.device) -> list[torch.Tensor]:
        clf = KNNClassifier(k=5).fit(ref.to(dv), ref_y.to(dv))
        return [clf.predict_proba(queries.to(dv)).double()]

    say(f"| exact K-NN (vote shares) | {on_both(knn):.2e} |")


# ------------------------------------------------------------------------------ 2. Q-Margin table
TABLE = [  # (B, C, D, alpha, scale): issue 36's table
    (128, 5994, 256, 1.5, 10.0),
    (128, 100_000, 512, 1.25, 35.0),
    (512, 100_000, 512, 1.25, 35.0),
    (128, 1_000_000, 512, 1.25, 35.0),
    (512, 1_000_000, 512, 1.25, 35.0),
    (512, 2_000_000, 512, 1.25, 35.0),
]


def head_inputs(
    b: int, c: int, d: int, device: torch.device
) -> tuple[CosineHead, torch.Tensor, torch.Tensor]:
    """Unit centres, embeddings at a cosine in [0.2, 0.8] from their centre (bench_qmargin's state)."""
    torch.manual_seed(0)
    head = CosineHead(c, d).to(device)
    labels = torch.randint(0, c, (b,), device=device)
    w = head.weight.detach()[labels]
    noise = torch.randn(b, d, device=device)
    noise -= (noise * w).sum(1, keepdim=True) * w
    noise = torch.nn.functional.normalize(noise, dim=1)
    target = 0.2 + 0.6 * torch.rand(b, 1, device=device)
    return head, (target * w + (1 - target**2).sqrt() * noise).requires_grad_(True), labels


def qmargin_table(device: torch.device, small: bool, repeats: int) -> None:
    say("\n## 2. Q-Margin against CosFace / ArcFace (fwd + bwd with a CosineHead, inside deferred_checks)\n")
    say("| B | C | D | α, s | method | ms | × CosFace | peak MiB | syncs / call |")
    say("|---|---|---|---|---|---:|---:|---:|---:|")
    sizes = [(16, 2000, 32, 1.5, 10.0), (16, 20_000, 32, 1.25, 35.0)] if small else TABLE
    # a first measured call may sync once for an initialisation (seen once, on the first row): spend it here
    warm = torch.randn(8, 8, device=device, requires_grad=True)
    syncs(lambda: (warm @ warm).sum().backward(), device)
    for b, c, d, alpha, s in sizes:
        head, e, labels = head_inputs(b, c, d, device)
        rows = []
        for name, loss_fn in (
            ("Q-Margin", QMarginLoss(alpha=alpha, scale=s, margin=0.2)),
            ("Q-Margin top-5 %", QMarginLoss(alpha=alpha, scale=s, margin=0.2, topk=0.05)),
            ("CosFace", CosFaceLoss(scale=64.0, margin=0.4)),
            ("ArcFace", ArcFaceLoss(scale=64.0, margin=0.5)),
        ):

            def step(
                loss_fn: torch.nn.Module = loss_fn,
                head: CosineHead = head,
                e: torch.Tensor = e,
                y: torch.Tensor = labels,
            ) -> None:
                e.grad = None
                head.weight.grad = None
                with deferred_checks():  # (its exit reads the flags once: outside the timed region below)
                    loss_fn(head(e), y).backward()

            def inner(
                loss_fn: torch.nn.Module = loss_fn,
                head: CosineHead = head,
                e: torch.Tensor = e,
                y: torch.Tensor = labels,
            ) -> None:
                e.grad = None
                head.weight.grad = None
                loss_fn(head(e), y).backward()

            step()  # exactness and input flags: raised here if any
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with deferred_checks():
                ms = timed(inner, device, repeats)
                peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
                n_sync = syncs(inner, device)
            rows.append((name, ms, peak, n_sync))
        cosface = rows[2][1]
        for name, ms, peak, n_sync in rows:
            say(
                f"| {b} | {c:,} | {d} | {alpha:g}, {s:g} | {name} | {ms:.2f} | {ms / cosface:.2f} "
                f"| {peak:.0f} | {n_sync} |"
            )
        del head, e
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ 3. MEP
def jax_mep(norm: str, rows: bool = True) -> Callable[[np.ndarray, np.ndarray, float], object] | None:
    """The blog's reference algorithm (SPEC §1) under jax.jit (rows by lax.map): L2 evaluates f′ at
    every breakpoint (O(n²) per row), L1 takes the order statistic u_(|N|) from one sort.

    ``rows=False``: the jitted one-row function, as the blog's code is written (1-D input only)."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None

    def row_l2(x: jnp.ndarray, p: jnp.ndarray, m: float) -> jnp.ndarray:
        bp = jnp.where(p, x, x + m)  # the breakpoints of f'

        def fprime(level: jnp.ndarray) -> jnp.ndarray:  # O(n) per breakpoint
            up = jnp.where(p, jnp.maximum(level - x, 0.0), 0.0).sum()
            down = jnp.where(p, 0.0, jnp.maximum(x + m - level, 0.0)).sum()
            return 2.0 * (up - down)

        fp = jax.vmap(fprime)(bp)
        below = jnp.where(fp <= 0, bp, -jnp.inf).max()  # f' increasing: the bracket of its zero
        above = jnp.where(fp >= 0, bp, jnp.inf).min()
        f_lo, f_hi = fprime(below), fprime(above)
        level = jnp.where(f_hi > f_lo, below - f_lo * (above - below) / (f_hi - f_lo), below)
        return feasible_or(x, p, m, level)

    def row_l1(x: jnp.ndarray, p: jnp.ndarray, m: float) -> jnp.ndarray:
        bp = jnp.where(p, x, x + m)
        level = jnp.sort(bp)[jnp.maximum((~p).sum() - 1, 0)]  # u_(|N|), 1-based: one sort
        return feasible_or(x, p, m, level)

    def feasible_or(x: jnp.ndarray, p: jnp.ndarray, m: float, level: jnp.ndarray) -> jnp.ndarray:
        z = jnp.where(p, jnp.maximum(x, level), jnp.minimum(x, level - m))
        ok = jnp.where(p, x, jnp.inf).min() - jnp.where(p, -jnp.inf, x).max() >= m
        return jnp.where(ok, x, z)

    row = row_l2 if norm == "l2" else row_l1
    if not rows:
        return jax.jit(row, static_argnums=2)
    return jax.jit(lambda x, p, m: jax.lax.map(lambda xp: row(xp[0], xp[1], m), (x, p)), static_argnums=2)


def mep_section(device: torch.device, small: bool, repeats: int) -> None:
    say("\n## 3. MEP against one torch.sort and the blog's O(n²) code in JAX\n")
    say("| rows × n | norm | MEP ms | torch.sort ms | × sort | JAX ms | × JAX | max diff vs JAX |")
    say("|---|---|---:|---:|---:|---:|---:|---:|")
    sizes = [(8, 50), (16, 200)] if small else [(256, 1000), (1024, 10_000), (128, 100_000)]
    g = torch.Generator().manual_seed(1)
    for rows, n in sizes:
        x = torch.randn(rows, n, generator=g).to(device)
        p = (torch.rand(rows, n, generator=g) < 0.01).to(device)
        p[:, 0] = True
        t_sort = timed(lambda x=x: torch.sort(x, dim=-1), device, repeats)
        for norm in ("l2", "l1"):
            t_mep = timed(lambda x=x, p=p, norm=norm: mep(x, p, 0.5, norm, validate=False), device, repeats)
            jx, diff = "", ""
            # L2's reference is O(n²) per row; L1's is one sort, timed at every size
            fn = jax_mep(norm) if norm == "l1" or rows * n * n <= 2e11 else None
            if fn is not None:
                import jax

                xn, pn = x.cpu().numpy(), p.cpu().numpy()
                xj, pj = jax.device_put(xn), jax.device_put(pn)  # on JAX's default device, as ours are
                out = np.asarray(fn(xj, pj, 0.5))  # compile and check
                t0 = time.perf_counter()
                for _ in range(repeats):
                    fn(xj, pj, 0.5).block_until_ready()  # type: ignore[attr-defined]
                t_jax = 1e3 * (time.perf_counter() - t0) / repeats
                ours = mep(x, p, 0.5, norm).cpu().numpy()
                if norm == "l2":
                    diff = f"{np.abs(out - ours).max():.1e}"
                else:  # L1 minimisers are not unique: compare objective values
                    obj = lambda z, xn=xn: np.abs(z - xn).sum(1)  # noqa: E731
                    diff = f"{np.abs(obj(out) - obj(ours)).max():.1e} (objective)"
                jx = f"{t_jax:.3f} | {t_mep / t_jax:.2f}"
            else:
                jx = "(no jax, or too large) | "
            say(
                f"| {rows} × {n:,} | {norm} | {t_mep:.3f} | {t_sort:.3f} | {t_mep / t_sort:.2f} "
                f"| {jx} | {diff} |"
            )


# --------------------------------------------------------------------------------------- 4. trainer
def synthetic_npz(path: Path, n: int, size: int, classes: int) -> None:
    """A MedMNIST-style .npz of random uint8 images (the step's cost does not depend on the pixels)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    labels = np.arange(n) % classes
    test = max(classes * 2, n // 20)
    np.savez(
        path, train_images=images, train_labels=labels, test_images=images[:test], test_labels=labels[:test]
    )


def bare_loop(
    model: torch.nn.Module,
    dim: int,
    classes: int,
    images: torch.Tensor,
    labels: torch.Tensor,
    batch: int,
    amp: bool,
    device: torch.device,
    steps: int,
) -> tuple[float, int | str]:
    """samples/s of model → CosineHead → CosFace with SGD on batches already on the device."""
    head = CosineHead(classes, dim).to(device)
    loss_fn = CosFaceLoss()
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.01, momentum=0.9)
    mean = torch.tensor([0.5, 0.5, 0.5], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.5, 0.5, 0.5], device=device).view(1, 3, 1, 1) * 255
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()

    def step(i: int) -> None:
        lo = (i * batch) % (images.shape[0] - batch + 1)
        x = (images[lo : lo + batch].float() - mean) / std
        with ctx:
            loss = loss_fn(head(model(x)), labels[lo : lo + batch])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for i in range(3):
        step(i)
    sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    sync(device)
    rate = steps * batch / (time.perf_counter() - t0)
    return rate, syncs(lambda: step(0), device)


def trainer_section(device: torch.device, small: bool) -> None:
    from marginkit.train import TrainConfig, train
    from marginkit.train import trainer as trainer_module

    say("\n## 4. marginkit.train.train against a bare PyTorch loop (CosineHead + CosFace, SGD)\n")
    say(
        "train() samples/s: the median of its epochs after the first (`samples_per_second` in the history:"
        " the training steps, loader included; no start-up, validation or checkpoint). Syncs / step of"
        " train(): `set_sync_debug_mode` over its last epoch's loop, divided by its steps.\n"
    )
    say(
        "| model | image | batch | amp | compile | bare loop samples/s | syncs / step (bare) |"
        " train() samples/s | syncs / step (train) | × bare | first epoch s |"
    )
    say("|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
    cases = [
        ("timm:resnet18", 112, 256, "bf16", False),
        ("resnet", 64, 256, "off", False),
        ("timm:resnet18", 112, 256, "bf16", True),
    ]
    n, classes, epochs = (64, 4, 3) if small else (16_384, 100, 3)
    if small:  # (both models and both precisions of the GPU run; compile: tests/test_compile.py)
        cases = [("timm:resnet18", 32, 16, "bf16", False), ("resnet", 32, 16, "off", False)]
    counted: dict[str, int] = {}
    real_epoch = trainer_module._one_epoch

    def last_epoch_counted(run: object, bar: object) -> dict:
        if getattr(run, "epoch", 0) < epochs - 1:
            return real_epoch(run, bar)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                stats = real_epoch(run, bar)
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        counted["syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        counted["steps"] = stats["steps"]
        return stats

    trainer_module._one_epoch = last_epoch_counted
    rates: dict[tuple[str, int, str], tuple[float, int | str]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for model_name, size, batch, amp, compiled in cases:
                data = Path(tmp) / f"synthetic{size}.npz"
                if not data.exists():
                    synthetic_npz(data, n, size, classes)
                config = TrainConfig(
                    data=f"npz:{data}", model=model_name, loss="cosface", optimizer="sgd", lr=0.01,
                    epochs=epochs, batch_size=batch, amp=amp, device=device.type, embedding_dim=512,
                    eval_every=1000, compile=compiled,
                )  # fmt: skip
                counted.clear()
                run_dir = Path(tmp) / f"run-{model_name.replace(':', '-')}-{size}-{compiled}"
                result = train(config, run_dir, quiet=True, report=False, stop_after=epochs)
                later = [r["samples_per_second"] for r in result.history[1:]]
                rate_train = statistics.median(later)
                first = result.history[0]["epoch_seconds"]
                on_gpu = device.type == "cuda" and counted
                train_syncs = f"{counted['syncs'] / counted['steps']:.2f}" if on_gpu else "n/a"
                key = (model_name, size, amp)
                if key not in rates:
                    from marginkit.models import build_model  # type: ignore[attr-defined]

                    model = build_model(model_name, (3, size, size), 512).to(device)
                    g = torch.Generator().manual_seed(0)
                    shape = (n, 3, size, size)
                    images = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device)
                    labels = (torch.arange(n) % classes).to(device)
                    steps = 5 if small else 2 * (n // batch)
                    rates[key] = bare_loop(
                        model, 512, classes, images, labels, batch, amp == "bf16", device, steps
                    )
                    del model, images
                rate, n_sync = rates[key]
                say(
                    f"| {model_name} | {size} | {batch} | {amp} | {'yes' if compiled else 'no'} | {rate:.0f} "
                    f"| {n_sync} | {rate_train:.0f} | {train_syncs} | {rate_train / rate:.2f} | {first:.1f} |"
                )
    finally:
        trainer_module._one_epoch = real_epoch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (tests the script)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip", nargs="*", default=[], choices=["equality", "table", "mep", "trainer"])
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        device, repeats = torch.device("cpu"), 2
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --cpu-smoke to test the script on the CPU")
        device, repeats = torch.device("cuda"), args.repeats
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    say(f"# device check: {name}, torch {torch.__version__}\n")
    sections = {
        "equality": lambda: equality(device, args.cpu_smoke),
        "table": lambda: qmargin_table(device, args.cpu_smoke, repeats),
        "mep": lambda: mep_section(device, args.cpu_smoke, repeats),
        "trainer": lambda: trainer_section(device, args.cpu_smoke),
    }
    for key, run in sections.items():
        if key in args.skip:
            continue
        t0 = time.perf_counter()
        try:
            run()
        except Exception as exc:  # one failing section must not hide the others' figures
            say(f"\n**section {key} failed: {type(exc).__name__}: {exc}**")
        say(f"\n({key}: {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
