"""Streaming data pipeline (issue 35): memory that does not grow with the data set, and its cost.

Generates a folder of ``--size`` 112×112 RGB JPEGs (``--classes`` identities) OUTSIDE the
repository (``--root``, default a temporary directory; 16 random images are encoded once and each
file is one of them with its own first two quantisation values: distinct pixels per file, as real
images, and 200 k files take seconds), then measures,
side by side in one run:

0. the file-list scan of ``folder:`` (cold, writing its index, from the index: ``--scan-only``);
1. peak RSS and PSS (shared pages divided between the processes that map them) of the whole
   process tree of ``marginkit train --data folder:DIR --set
   data_options.split=classes --loss cosface --model cnn2d --epochs 1`` (sampled every 50 ms from
   /proc; goal <= 2.5 GB at every size), with the default path choice and with ``stream=true``;
2. training samples/s, streamed against in-memory (``stream=true`` / ``false``) with the default
   worker count (goal >= 0.9x);
3. the loader alone (``marginkit.data.loading``, no model) against a plain loop of
   ``PIL.Image.open(p).convert("RGB").resize(...)`` in one process, images/s per worker (goal >= 0.9x);
4. with ``--runs memory,wds``: the same run from the folder packed into WebDataset shards
   (``marginkit pack``'s writer, once, beside the folder).

    python benchmarks/bench_streaming.py --size 10000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_FOLDER_VERSION = 2  # 1: the 16 encodings' pixels repeated (files differed by a comment only)


def _quantised(blob: bytes, variant: int) -> bytes:
    """``blob`` (a baseline JPEG) with the first two entries of its first quantisation table set
    from ``variant`` (< 255²): the same entropy-coded data dequantised differently, so a valid JPEG
    with other pixels (the DC and the first AC coefficient of every block scale)."""
    at = blob.index(b"\xff\xdb") + 5  # DQT marker, length (2), Pq/Tq (1): the table's first value
    q0, q1 = 1 + variant % 255, 1 + (variant // 255) % 255
    return blob[:at] + bytes((q0, q1)) + blob[at + 2 :]


def make_folder(root: Path, size: int, classes: int, side: int = 112) -> Path:
    """``size`` JPEGs in ``root/<class>/``: 16 encodings, each file one of them with its own first
    two quantisation values (distinct pixels per file, as real images: no file's embedding ties
    with another's; 16 * 255² variants at most)."""
    from io import BytesIO

    from PIL import Image

    stamp = [size, classes, _FOLDER_VERSION]
    if (root / ".complete").is_file() and json.loads((root / ".complete").read_text()) == stamp:
        return root
    if size > 16 * 255 * 255:
        raise ValueError(f"--size {size}: at most {16 * 255 * 255} distinct images")
    rng = np.random.default_rng(0)
    blobs = []
    for _ in range(16):
        base = rng.integers(0, 256, size=(side // 8, side // 8, 3), dtype=np.uint8)
        image = Image.fromarray(base).resize((side, side), Image.BILINEAR)
        buf = BytesIO()
        image.save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
    for c in range(classes):
        (root / f"id{c:05d}").mkdir(parents=True, exist_ok=True)
    for i in range(size):
        blob = _quantised(blobs[i % len(blobs)], i // len(blobs))
        (root / f"id{i % classes:05d}" / f"{i:07d}.jpg").write_bytes(blob)
    (root / ".complete").write_text(json.dumps(stamp))
    return root


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _tree_memory(pid: int, per_process: list[tuple[int, int]] | None = None) -> tuple[int, int]:
    """``(RSS, PSS)`` bytes of the process tree of ``pid``. RSS counts a page shared by forked
    workers (torch's libraries, the parent's heap before the fork) once per process; PSS divides
    it between them, so the PSS sum is the tree's real footprint. ``per_process`` receives each
    process's ``(pid, RSS)``."""
    rss = pss = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                        if per_process is not None:
                            per_process.append((p, int(line.split()[1]) * 1024))
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def train_run(data: str, out: Path, extra: list[str]) -> dict[str, float]:
    """One ``marginkit train`` subprocess: its peak tree RSS, wall time and training samples/s."""
    argv = [sys.executable, "-m", "marginkit.cli", "train", "--data", data, "--set",
            "data_options.split=classes", "--loss", "cosface", "--model", "cnn2d", "--epochs", "1",
            "--out", str(out), "--no-report", "-q", *extra]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # the epoch's row in metrics.jsonl marks the end of training: the peaks after it are the
    # final evaluation's (embedding every split, K-NN, verification, retrieval)
    peaks = {"train": [0, 0], "evaluation": [0, 0]}
    when: dict[str, object] = {}  # each phase's RSS peak: seconds after the start, per process
    history = out / "metrics.jsonl"
    while proc.poll() is None:
        name = "evaluation" if history.is_file() and history.stat().st_size else "train"
        phase = peaks[name]
        processes: list[tuple[int, int]] = []
        rss, pss = _tree_memory(proc.pid, processes)
        if rss > phase[0]:
            when[name] = {
                "seconds": round(time.perf_counter() - t0, 1),
                "rss_gb_by_process": [round(r / 1e9, 3) for _, r in processes],
            }
        phase[0], phase[1] = max(phase[0], rss), max(phase[1], pss)
        time.sleep(0.05)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"marginkit train failed ({proc.returncode}): {err[-2000:]}")
    rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
    final = json.loads((out / "metrics.json").read_text())
    return {
        "peak_gb": max(p[0] for p in peaks.values()) / 1e9,
        "peak_pss_gb": max(p[1] for p in peaks.values()) / 1e9,
        "train_peak_gb": peaks["train"][0] / 1e9,
        "evaluation_peak_gb": peaks["evaluation"][0] / 1e9,
        "peaks_at": when,
        "seconds": time.perf_counter() - t0,
        "samples_per_s": rows[-1]["samples_per_second"],
        "num_train": final.get("num_train"),
        "num_test": final.get("num_test"),
    }


def _cpu_ns(pids: list[int]) -> int:
    """CPU time (nanoseconds) of ``pids``, all their threads (a worker pickles and sends its
    batches from a second thread): ``/proc/PID/task/TID/schedstat``."""
    total = 0
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                with open(f"/proc/{p}/task/{t}/schedstat") as fh:
                    total += int(fh.read().split()[0])
            except (OSError, IndexError, ValueError):
                continue
    return total


def loader_alone(folder: Path, limit: int, side: int = 112, rounds: int = 5) -> dict[str, float]:
    """Images/s of the loader (``evaluation_loader``, batch 128, one worker) against a plain loop
    ``np.asarray(PIL.Image.open(p).convert("RGB").resize((side, side)))`` in this process.

    Fair by construction: the same ``limit`` files, decoded to the same pixels (the files are
    ``side`` x ``side``, so neither side resizes: Pillow's ``resize`` to the image's own size is
    a copy, and the loader skips it), the page cache warm for both (one untimed pass of each),
    the loader's persistent worker already started (as for every epoch but the first), and
    ``rounds`` rounds of one plain pass then one loader pass, so both see the same load from
    other processes. Reported: the median of the rounds' ratios of wall-clock rates, and —
    robust to a busy machine, where a worker process gets its own share of the CPUs — the
    ratio of images per CPU-second: the plain loop's process against the worker's (the training
    process's own CPU time to receive the batches is reported beside it, per image). JPEGs are
    decoded by simplejpeg where it gives Pillow's pixels (``marginkit.data.decode``); the
    ``pillow_worker_*`` ratios are the same loader with Pillow for every file."""
    import statistics

    import torch
    from PIL import Image

    from marginkit.data.folder import scan_folder
    from marginkit.data.loading import evaluation_loader

    raw = scan_folder(folder, test_fraction=0.0)
    x = raw.x_train[np.arange(min(limit, len(raw.x_train)))]
    paths = [str(folder / x.relative_path(i)) for i in range(len(x))]
    n = len(paths)
    me = os.getpid()

    def plain() -> tuple[float, int]:
        t0, c0 = time.perf_counter(), time.process_time_ns()
        for p in paths:
            np.asarray(Image.open(p).convert("RGB").resize((side, side)))
        return time.perf_counter() - t0, time.process_time_ns() - c0

    from marginkit.data import decode

    def streamed(loader: object) -> tuple[float, int, int]:
        workers = [p for p in _tree(me) if p != me]
        t0, c0, m0 = time.perf_counter(), _cpu_ns(workers), time.process_time_ns()
        count = sum(len(b.x) for b in loader.epoch())  # type: ignore[attr-defined]
        assert count == n, (count, n)
        return time.perf_counter() - t0, _cpu_ns(workers) - c0, time.process_time_ns() - m0

    loader = evaluation_loader(x, torch.arange(n), batch_size=128, workers=1)
    # the same loader with Pillow decoding every JPEG (decode.FAST_JPEG off in its forked worker)
    pillow = evaluation_loader(x, torch.arange(n), batch_size=128, workers=1)
    try:
        t0 = time.perf_counter()
        streamed(loader)  # warms the page cache; the worker starts
        first = n / (time.perf_counter() - t0)
        decode.FAST_JPEG = False
        try:
            streamed(pillow)
        finally:
            decode.FAST_JPEG = True
        plain()
        walls, cpu_plain, cpu_worker, cpu_main, cpu_pillow = [], 0, 0, 0, 0
        for _ in range(rounds):
            wall_p, cpu_p = plain()
            wall_l, cpu_w, cpu_m = streamed(loader)
            wall_pil, cpu_pil, _ = streamed(pillow)
            walls.append((n / wall_p, n / wall_l, n / wall_pil))
            cpu_plain, cpu_worker, cpu_main = cpu_plain + cpu_p, cpu_worker + cpu_w, cpu_main + cpu_m
            cpu_pillow += cpu_pil
    finally:
        loader.close()
        pillow.close()
    plain_rate = statistics.median(w[0] for w in walls)
    return {
        "images": n, "rounds": rounds,
        "plain_images_per_s": plain_rate,
        "loader_images_per_s_per_worker": statistics.median(w[1] for w in walls),
        "ratio": statistics.median(w[1] / w[0] for w in walls),
        "plain_cpu_us_per_image": cpu_plain / 1e3 / (n * rounds),
        "worker_cpu_us_per_image": cpu_worker / 1e3 / (n * rounds),
        "main_process_cpu_us_per_image": cpu_main / 1e3 / (n * rounds),
        "cpu_ratio": cpu_plain / cpu_worker if cpu_worker else float("nan"),
        "pillow_worker_ratio": statistics.median(w[2] / w[0] for w in walls),
        "pillow_worker_cpu_ratio": cpu_plain / cpu_pillow if cpu_pillow else float("nan"),
        "jpeg_decoder": "simplejpeg" if decode._fast_jpeg() is not None else "pillow (no simplejpeg)",
        "first_pass_ratio": first / plain_rate,
    }  # fmt: skip


def scan_times(folder: Path) -> dict[str, float]:
    """Seconds of :func:`~marginkit.data.folder.scan_folder` without a cache, then writing its
    index, then reading the index (a second run on unchanged directories), and peak RSS growth."""
    import resource

    from marginkit.data.folder import MTIME_SETTLE_S, scan_folder

    time.sleep(max(0.0, MTIME_SETTLE_S - (time.time() - folder.stat().st_mtime)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    raw = scan_folder(folder, test_fraction=0.0, progress=False)
    cold = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        scan_folder(folder, test_fraction=0.0, cache_dir=cache, progress=False)
        writing = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = scan_folder(folder, test_fraction=0.0, cache_dir=cache, progress=False)
        cached = time.perf_counter() - t0
    assert len(again.x_train) == len(raw.x_train)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {"files": len(raw.x_train), "scan_s": cold, "scan_and_write_index_s": writing,
            "cached_s": cached, "peak_rss_growth_mb": grown / 1e6}  # fmt: skip


def packed(folder: Path) -> Path:
    """The folder written as WebDataset shards beside it (once; JPEG bytes kept as they are)."""
    from marginkit.data.datasets import read_source
    from marginkit.data.shards import META_NAME, write_shards

    out = folder.with_name(folder.name + "-shards")
    if not (out / META_NAME).is_file():
        t0 = time.perf_counter()
        write_shards(read_source(f"folder:{folder}"), out, progress=False)
        print(f"packed {folder} into {out} in {time.perf_counter() - t0:.1f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--classes", type=int, default=None, help="default: size // 10")
    ap.add_argument("--root", type=Path, default=None, help="where the images go (default: a temp dir)")
    ap.add_argument("--skip-train", action="store_true", help="only the loader-alone comparison")
    ap.add_argument(
        "--rounds", type=int, default=5, help="plain / loader rounds of the loader-alone comparison"
    )
    ap.add_argument("--scan-only", action="store_true", help="only the file-list scan (cold, cached)")
    ap.add_argument(
        "--runs", default="memory,stream",
        help="which training runs: memory (stream=false), stream, wds (the folder packed into shards once)",
    )  # fmt: skip
    ap.add_argument("--set", dest="sets", action="append", default=[], help="passed to each run's --set")
    args = ap.parse_args()
    classes = args.classes or max(2, args.size // 10)
    base = args.root or Path(tempfile.gettempdir()) / "marginkit-bench-streaming"
    t0 = time.perf_counter()
    folder = make_folder(base / f"jpeg{args.size}", args.size, classes)
    print(f"{args.size} JPEGs in {folder} ({time.perf_counter() - t0:.1f} s to make or find)")
    result: dict[str, object] = {"size": args.size, "classes": classes, "cores": len(os.sched_getaffinity(0))}
    result["scan"] = scan_times(folder)
    print(json.dumps(result["scan"]))
    if args.scan_only:
        return
    result["loader_alone"] = loader_alone(folder, min(args.size, 2000), rounds=args.rounds)
    print(json.dumps(result["loader_alone"]))
    if not args.skip_train:
        with tempfile.TemporaryDirectory() as runs:
            chosen = args.runs.split(",")
            sets = [a for s in args.sets for a in ("--set", s)]
            for name, extra in (("memory", ["--set", "data_options.stream=false"]),
                                ("stream", ["--set", "data_options.stream=true"]), ("wds", [])):  # fmt: skip
                if name not in chosen:
                    continue
                data = f"folder:{folder}" if name != "wds" else f"wds:{packed(folder)}"
                result[name] = train_run(data, Path(runs) / name, extra + sets)
                print(name, json.dumps(result[name]))
        for name in ("stream", "wds"):
            if "memory" in result and name in result:
                result[f"{name}_vs_memory_samples_per_s"] = (
                    result[name]["samples_per_s"] / result["memory"]["samples_per_s"]  # type: ignore[index]
                )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
