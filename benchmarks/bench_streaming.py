"""Streaming data pipeline (issue 35): memory that does not grow with the data set, and its cost.

Generates a folder of ``--size`` 112×112 RGB JPEGs (``--classes`` identities) OUTSIDE the
repository (``--root``, default a temporary directory; a few random images are encoded once and
their bytes reused with a changed comment segment, so 200 k files take seconds), then measures,
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


def make_folder(root: Path, size: int, classes: int, side: int = 112) -> Path:
    """``size`` JPEGs in ``root/<class>/``: 16 encoded images whose bytes get a per-file COM segment
    (a different file each, decoded to the same pixels as its source)."""
    from io import BytesIO

    from PIL import Image

    if (root / ".complete").is_file() and json.loads((root / ".complete").read_text()) == [size, classes]:
        return root
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
        blob = blobs[i % len(blobs)]
        comment = f"marginkit bench {i}".encode()
        segment = b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment
        (root / f"id{i % classes:05d}" / f"{i:07d}.jpg").write_bytes(blob[:2] + segment + blob[2:])
    (root / ".complete").write_text(json.dumps([size, classes]))
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


def _tree_memory(pid: int) -> tuple[int, int]:
    """``(RSS, PSS)`` bytes of the process tree of ``pid``. RSS counts a page shared by forked
    workers (torch's libraries, the parent's heap before the fork) once per process; PSS divides
    it between them, so the PSS sum is the tree's real footprint."""
    rss = pss = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
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
    peak = peak_pss = 0
    while proc.poll() is None:
        rss, pss = _tree_memory(proc.pid)
        peak, peak_pss = max(peak, rss), max(peak_pss, pss)
        time.sleep(0.05)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"marginkit train failed ({proc.returncode}): {err[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "peak_gb": peak / 1e9,
        "peak_pss_gb": peak_pss / 1e9,
        "seconds": time.perf_counter() - t0,
        "samples_per_s": rows[-1]["samples_per_second"],
    }


def loader_alone(folder: Path, limit: int, side: int = 112) -> dict[str, float]:
    """Images/s of the loader (one worker) against a plain PIL loop in this process: each timed
    on a second pass (the files in the page cache for both; the loader's persistent worker
    already started, as it is for every epoch but the first), and the loader's first pass
    (worker start-up included) beside it."""
    import torch
    from PIL import Image

    from marginkit.data.folder import scan_folder
    from marginkit.data.loading import evaluation_loader

    raw = scan_folder(folder, test_fraction=0.0)
    x = raw.x_train[np.arange(min(limit, len(raw.x_train)))]
    paths = [str(folder / x.relative_path(i)) for i in range(len(x))]
    for _ in range(2):
        t0 = time.perf_counter()
        for p in paths:
            np.asarray(Image.open(p).convert("RGB").resize((side, side)))
        plain = len(paths) / (time.perf_counter() - t0)
    loader = evaluation_loader(x, torch.arange(len(x)), batch_size=128, workers=1)
    rates = []
    try:
        for _ in range(2):
            t0 = time.perf_counter()
            n = sum(len(b.x) for b in loader.epoch())
            rates.append(n / (time.perf_counter() - t0))
    finally:
        loader.close()
    return {
        "plain_images_per_s": plain, "loader_images_per_s_per_worker": rates[1], "ratio": rates[1] / plain,
        "first_pass_ratio": rates[0] / plain,
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
    result["loader_alone"] = loader_alone(folder, min(args.size, 2000))
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
