"""Millions of templates on one machine: memory, load time, identify latency and recall.

A gallery of ``--n`` templates of D = 512 (default 10⁶; ``--quick``: 10⁵): ``--n / 4``
identities with 4 noisy templates each around a random unit centre (so that the data have the
clusters real embeddings have), and 200 probes, each a fresh noisy view of a random identity.
For each storage of the SQLite :class:`~marginkit.gallery.Gallery` — ``dtype`` float32, float16,
int8 with one scale per vector (:mod:`marginkit.gallery.quantize`), searched exactly; float32
also with the gallery's approximate searches, ``backend="ivf"`` and ``"hnsw"`` — and for
FAISS indexes over the same templates (``IndexFlatIP``; ``IndexScalarQuantizer`` fp16 / 8-bit;
IVF-Flat and IVF-SQ8 ``nlist`` √n, nprobe 32; HNSW ``M`` 32, efSearch 128) it prints, side by
side in one run:

- bytes per template in memory (the gallery's codes and scales; FAISS's index serialised) and,
  for the gallery, in its SQLite file,
- build time (the gallery: enrolment in transactions of 50,000 templates; FAISS: train + add),
- load time from the file (opening the gallery again, for ``ivf`` / ``hnsw`` with building
  their index; ``faiss.read_index``),
- one-probe latency p50 / p99 (``Gallery.identify(k=1)``; FAISS's top-1 search), ``--threads``
  threads,
- recall@1 against the exact float32 gallery (the same identity first).

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


def top1(g: Any, queries: np.ndarray) -> np.ndarray:
    """The first identity of ``Gallery.identify`` as its number."""
    ident = g.identify(queries, k=1, kind="embeddings")[0]
    return np.array([int(ident.candidates[0].identity[2:])])


def index_settings(g: Any) -> str:
    index = g._knn._require_fitted()[0]
    if hasattr(index, "nprobe"):
        return f"nlist {index.nlist}, nprobe {index.nprobe}"
    return f"M {g._knn.hnsw_m}, efConstruction {g._knn.hnsw_ef_construction}, efSearch {index.ef_search}"


def index_bytes(g: Any, faiss: Any) -> int:
    """Bytes the gallery's template index holds: the float32 templates and FAISS's structure."""
    index = g._knn._require_fitted()[0]
    if hasattr(index, "nprobe"):  # IVF: float32 store + 8-bit codes and ids + centroids
        ivf = index.index
        return index.vectors().nbytes + ivf.ntotal * (ivf.code_size + 8) + ivf.nlist * ivf.d * 4
    return int(faiss.serialize_index(index.index).nbytes)  # HNSW: its storage and graph


def main() -> int:
    args = parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import faiss
    import torch

    from marginkit.gallery import Gallery

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    n = 100_000 if args.quick else args.n
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    x, q = data(n, args.probes, rng)
    print(
        f"{n:,} templates of D = {DIM} ({n // 4:,} identities x 4), {len(q)} probes; "
        f"made in {time.perf_counter() - t0:.1f} s; {args.threads} thread(s)",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    truth: np.ndarray | None = None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        owner_names = [f"id{i:07d}" for i in range(n // 4)]
        for dtype in ("float32", "float16", "int8"):
            # The SQLite gallery itself: enrolled in transactions of 50,000 templates, then
            # opened again from the file (what a restarted server does) and queried.
            path = root / f"{dtype}.db"
            g = Gallery(path, model_fingerprint="bench", embedding_dim=DIM, threshold=0.0, dtype=dtype)
            t0 = time.perf_counter()
            for start in range(0, n, 50_000):
                stop = min(n, start + 50_000)
                g.enroll_many([owner_names[i // 4] for i in range(start, stop)], x[start:stop])
            enroll = time.perf_counter() - t0
            g.close()
            del g
            t0 = time.perf_counter()
            g = Gallery(path, threshold=0.0)
            load = time.perf_counter() - t0
            # the templates as held: float32 in the K-NN index, float16 / int8 as codes (+ scales)
            held = g._knn.reference_embeddings(copy=False) if dtype == "float32" else g._codes
            memory = held.nbytes + (0 if g._scales is None else g._scales.nbytes)

            top, p50, p99 = timed(lambda queries, g=g: top1(g, queries), q)
            truth = top if truth is None else truth
            rows.append(
                {
                    "storage": dtype,
                    "search": "Gallery (SQLite), exact",
                    "bytes": memory / n,
                    "file_bytes": path.stat().st_size / n,
                    "load_s": load,
                    "p50": p50,
                    "p99": p99,
                    "recall": float((top == truth).mean()),
                    "build_s": enroll,
                }
            )
            print(rows[-1], flush=True)
            g.close()
            del g
            if dtype == "float32":
                # The gallery's approximate template searches, over the same file: opening it
                # builds the index (IVF: trains its cells; HNSW: inserts every template).
                for backend in ("ivf",) + (() if args.skip_hnsw else ("hnsw",)):
                    t0 = time.perf_counter()
                    g = Gallery(path, threshold=0.0, backend=backend)
                    load = time.perf_counter() - t0
                    top, p50, p99 = timed(lambda queries, g=g: top1(g, queries), q)
                    rows.append(
                        {
                            "storage": dtype,
                            "search": f"Gallery (SQLite), {backend} ({index_settings(g)})",
                            "bytes": index_bytes(g, faiss) / n,
                            "file_bytes": path.stat().st_size / n,
                            "load_s": load,
                            "p50": p50,
                            "p99": p99,
                            "recall": float((top == truth).mean()),
                            "build_s": float("nan"),
                        }
                    )
                    print(rows[-1], flush=True)
                    g.close()
                    del g
            path.unlink()
        # FAISS answers templates: recall@1 compares the identity of the template found.
        assert truth is not None
        nlist = int(np.sqrt(n))
        ip, sq = faiss.METRIC_INNER_PRODUCT, faiss.ScalarQuantizer
        ivf = f"nlist {nlist}, nprobe 32"
        indexes: list[tuple[str, str, Any]] = [
            ("float32", "FAISS flat", lambda: faiss.IndexFlatIP(DIM)),
            ("float16", "FAISS SQ fp16", lambda: faiss.IndexScalarQuantizer(DIM, sq.QT_fp16, ip)),
            ("int8 (per dim)", "FAISS SQ 8-bit", lambda: faiss.IndexScalarQuantizer(DIM, sq.QT_8bit, ip)),
            (
                "float32",
                f"FAISS IVF-Flat {ivf}",
                lambda: faiss.IndexIVFFlat(faiss.IndexFlatIP(DIM), DIM, nlist, ip),
            ),
            (
                "int8 (per dim)",
                f"FAISS IVF-SQ8 {ivf}",
                lambda: faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(DIM), DIM, nlist, sq.QT_8bit, ip),
            ),
        ]
        if not args.skip_hnsw:
            indexes.append(
                (
                    "float32",
                    "FAISS HNSW M 32, efSearch 128",
                    lambda: faiss.IndexHNSWFlat(DIM, 32, faiss.METRIC_INNER_PRODUCT),
                )
            )
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
            rows.append(
                {
                    "storage": storage,
                    "search": name,
                    "bytes": size / n,
                    "load_s": load,
                    "p50": p50,
                    "p99": p99,
                    "recall": float((top // 4 == truth).mean()),
                    "build_s": build,
                }
            )
            print(rows[-1], flush=True)
            del index
            path.unlink()
    print(
        "\n| storage | search | bytes / template (file) | build s | load s | p50 / p99 ms "
        "| recall@1 vs exact float32 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        file = f" ({r['file_bytes']:.0f})" if "file_bytes" in r else ""
        build = "" if np.isnan(r["build_s"]) else f"{r['build_s']:.1f}"
        print(
            f"| {r['storage']} | {r['search']} | {r['bytes']:.0f}{file} | {build} | "
            f"{r['load_s']:.2f} | {r['p50']:.2f} / {r['p99']:.2f} | {r['recall']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
