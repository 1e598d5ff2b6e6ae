"""Millions of templates on one machine: memory, load time, identify latency and recall.

A gallery of ``--n`` templates of D = 512 (default 10⁶; ``--quick``: 10⁵): ``--n / 4``
identities with 4 noisy templates each around a random unit centre (so that the data have the
clusters real embeddings have), and 200 probes, each a fresh noisy view of a random identity.
For each storage — float32, float16, int8 with one scale per vector
(:mod:`marginkit.gallery.quantize`) — and each search — exact (torch, chunked) and FAISS
(``IndexFlatIP``; ``IndexScalarQuantizer`` fp16 / 8-bit; HNSW ``M`` 32, efSearch 128; IVF-Flat
``nlist`` √n, nprobe 32) — it prints, side by side in one run:

- bytes per template in memory (the codes, scales and index structures; FAISS's by
  serialising the index),
- load time from the file (``np.load`` of the stored arrays, ``faiss.read_index``),
- one-probe top-1 latency p50 / p99 (``--threads`` threads),
- recall@1 against the exact float32 search (the same nearest template).

    python benchmarks/bench_gallery_scale.py [--quick] [--n 1000000] [--threads 1] [--skip-hnsw]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

DIM = 512


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10^5 templates")
    p.add_argument("--n", type=int, default=1_000_000, help="templates")
    p.add_argument("--probes", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch and FAISS threads")
    p.add_argument("--skip-hnsw", action="store_true", help="skip HNSW (its build is the slowest step)")
    return p.parse_args()


def data(n: int, probes: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    ids = n // 4
    centres = rng.normal(size=(ids, DIM)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = np.repeat(centres, 4, axis=0)
    for start in range(0, n, 100_000):  # in place, in chunks: no second n x D temporary
        part = x[start : start + 100_000]
        part += 0.6 / np.sqrt(DIM) * rng.normal(size=part.shape).astype(np.float32)
        part /= np.linalg.norm(part, axis=1, keepdims=True)
    q = centres[rng.integers(0, ids, probes)] + 0.6 / np.sqrt(DIM) * rng.normal(size=(probes, DIM))
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    return x, q


def timed(search: Any, queries: np.ndarray) -> tuple[np.ndarray, float, float]:
    """Top-1 of each query, one at a time; p50 / p99 latency in ms."""
    search(queries[:2])  # warm-up
    top = np.empty(len(queries), dtype=np.int64)
    lat = []
    for i in range(len(queries)):
        t0 = time.perf_counter()
        top[i] = search(queries[i : i + 1])[0]
        lat.append(time.perf_counter() - t0)
    ms = np.array(lat) * 1e3
    return top, float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def main() -> int:
    args = parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import faiss
    import torch

    from marginkit.gallery.quantize import quantize, scores

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    n = 100_000 if args.quick else args.n
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    x, q = data(n, args.probes, rng)
    print(f"{n:,} templates of D = {DIM} ({n // 4:,} identities x 4), {len(q)} probes; "
          f"made in {time.perf_counter() - t0:.1f} s; {args.threads} thread(s)", flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    truth: np.ndarray | None = None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for dtype in ("float32", "float16", "int8"):
            codes, scale = quantize(torch.from_numpy(x), dtype)
            path = root / f"{dtype}.npz"
            arrays = {"codes": codes.numpy()} | ({} if scale is None else {"scales": scale.numpy()})
            np.savez(path, **arrays)
            t0 = time.perf_counter()
            with np.load(path) as f:
                loaded = {k: f[k] for k in f.files}
            load = time.perf_counter() - t0
            codes = torch.from_numpy(loaded["codes"])
            scale = torch.from_numpy(loaded["scales"]) if "scales" in loaded else None
            nbytes = sum(a.nbytes for a in loaded.values())

            def exact(queries: np.ndarray, codes: Any = codes, scale: Any = scale) -> np.ndarray:
                return scores(torch.from_numpy(queries), codes, scale).argmax(1).numpy()

            top, p50, p99 = timed(exact, q)
            truth = top if truth is None else truth
            rows.append({"storage": dtype, "search": "exact (torch)", "bytes": nbytes / n, "load_s": load,
                         "p50": p50, "p99": p99, "recall": float((top == truth).mean())})  # fmt: skip
            print(rows[-1], flush=True)
            del codes, scale, loaded
        assert truth is not None
        nlist = int(np.sqrt(n))
        ip, sq = faiss.METRIC_INNER_PRODUCT, faiss.ScalarQuantizer
        ivf = f"nlist {nlist}, nprobe 32"
        indexes: list[tuple[str, str, Any]] = [
            ("float32", "FAISS flat", lambda: faiss.IndexFlatIP(DIM)),
            ("float16", "FAISS SQ fp16", lambda: faiss.IndexScalarQuantizer(DIM, sq.QT_fp16, ip)),
            ("int8 (per dim)", "FAISS SQ 8-bit", lambda: faiss.IndexScalarQuantizer(DIM, sq.QT_8bit, ip)),
            (
                "float32", f"FAISS IVF-Flat {ivf}",
                lambda: faiss.IndexIVFFlat(faiss.IndexFlatIP(DIM), DIM, nlist, ip),
            ),
            (
                "int8 (per dim)", f"FAISS IVF-SQ8 {ivf}",
                lambda: faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(DIM), DIM, nlist, sq.QT_8bit, ip),
            ),
        ]  # fmt: skip
        if not args.skip_hnsw:
            indexes.append(("float32", "FAISS HNSW M 32, efSearch 128",
                            lambda: faiss.IndexHNSWFlat(DIM, 32, faiss.METRIC_INNER_PRODUCT)))  # fmt: skip
        for storage, name, make in indexes:
            index = make()
            t0 = time.perf_counter()
            if not index.is_trained:
                index.train(x[rng.choice(n, min(n, 40 * nlist), replace=False)])
            if hasattr(index, "hnsw"):
                index.hnsw.efConstruction = 80
            index.add(x)
            build = time.perf_counter() - t0
            if hasattr(index, "nprobe"):
                index.nprobe = 32
            if hasattr(index, "hnsw"):
                index.hnsw.efSearch = 128
            path = root / "index.faiss"
            faiss.write_index(index, str(path))
            size = path.stat().st_size
            del index
            t0 = time.perf_counter()
            index = faiss.read_index(str(path))
            load = time.perf_counter() - t0
            if hasattr(index, "nprobe"):
                index.nprobe = 32
            if hasattr(index, "hnsw"):
                index.hnsw.efSearch = 128

            def search(queries: np.ndarray, index: Any = index) -> np.ndarray:
                return index.search(queries, 1)[1][:, 0]

            top, p50, p99 = timed(search, q)
            rows.append({"storage": storage, "search": name, "bytes": size / n, "load_s": load, "p50": p50,
                         "p99": p99, "recall": float((top == truth).mean()), "build_s": build})  # fmt: skip
            print(rows[-1], flush=True)
            del index
            path.unlink()
    print("\n| storage | search | bytes / template | load s | p50 / p99 ms | recall@1 vs exact float32 |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        build = f" (built in {r['build_s']:.0f} s)" if "build_s" in r else ""
        print(f"| {r['storage']} | {r['search']}{build} | {r['bytes']:.0f} | {r['load_s']:.2f} | "
              f"{r['p50']:.2f} / {r['p99']:.2f} | {r['recall']:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
