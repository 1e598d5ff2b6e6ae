"""Speaker training from many long utterances (issue 37): peak memory of the whole process tree.

Generates ``--utterances`` files of ``--seconds`` seconds (16 kHz, 16-bit PCM; ``--speakers``
synthetic voiced speakers of :mod:`marginkit.audio.synthetic`) OUTSIDE the repository
(``--root``, default a temporary directory; one utterance per speaker is synthesised and each
file is a random circular shift of it plus noise, so 10⁴ files of 10 s take a minute), then runs

    marginkit train --data audio:DIR --model ecapa_tdnn --loss cosface --epochs 1

as a subprocess and samples the RSS and PSS of its process tree every 50 ms (goal: peak under
2.5 GB; the streaming bound of issue 35). Training reads 2 s crops (only those frames are read from
each file); evaluation embeds the held-out speakers' utterances whole, one per forward pass.

    python benchmarks/bench_audio_memory.py --utterances 10000 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streaming import _tree_memory


def make_utterances(root: Path, utterances: int, speakers: int, seconds: float, rate: int = 16000) -> Path:
    """``root/<speaker>/sess<k>/<nnnnn>.wav``; reused when already complete."""
    from marginkit.audio.synthetic import synthetic_speakers, voiced_utterance

    done = root / ".complete"
    if done.is_file() and done.read_text() == f"{utterances} {speakers} {seconds}":
        return root
    import soundfile as sf

    rng = np.random.default_rng(0)
    per = -(-utterances // speakers)
    written = 0
    for speaker in synthetic_speakers(speakers, seed=1):
        base = voiced_utterance(speaker, seconds, rng, rate)
        for u in range(min(per, utterances - written)):
            wave = np.roll(base, int(rng.integers(0, base.size))) + rng.normal(0, 0.01, base.size)
            path = root / speaker.name / f"sess{u % 2}" / f"{u:05d}.wav"
            path.parent.mkdir(parents=True, exist_ok=True)
            sf.write(path, np.clip(wave, -1, 1).astype(np.float32), rate, subtype="PCM_16")
            written += 1
    done.write_text(f"{utterances} {speakers} {seconds}")
    return root


def train_run(root: Path, out: Path, extra: list[str]) -> dict[str, float]:
    argv = [sys.executable, "-m", "marginkit.cli", "train", "--data", f"audio:{root}", "--model",
            "ecapa_tdnn", "--loss", "cosface", "--epochs", "1", "--out", str(out), "--no-report", "-q",
            *extra]  # fmt: skip
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
    metrics = json.loads((out / "metrics.json").read_text())
    return {
        "peak_rss_gb": peak / 1e9, "peak_pss_gb": peak_pss / 1e9, "seconds": time.perf_counter() - t0,
        "num_train": metrics["num_train"], "num_test": metrics["num_test"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--utterances", type=int, default=10_000)
    parser.add_argument("--speakers", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--root", type=Path, default=None, help="where the utterances are written (kept)")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="passed to marginkit train (e.g. --set data_options.test_fraction=0.05)",
    )  # fmt: skip
    args = parser.parse_args()
    root = args.root or Path(tempfile.gettempdir()) / f"marginkit-audio-{args.utterances}x{args.seconds:g}s"
    t0 = time.perf_counter()
    make_utterances(root, args.utterances, args.speakers, args.seconds)
    size = sum(p.stat().st_size for p in root.rglob("*.wav"))
    print(f"{args.utterances} utterances of {args.seconds:g} s in {root} ({size / 1e9:.2f} GB on disk, "
          f"{time.perf_counter() - t0:.0f} s to make or find)")  # fmt: skip
    extra = [arg for kv in args.sets for arg in ("--set", kv)]
    with tempfile.TemporaryDirectory() as tmp:
        got = train_run(root, Path(tmp) / "run", extra)
    print(f"marginkit train --data audio:DIR --model ecapa_tdnn --loss cosface --epochs 1 {' '.join(extra)}")
    print(f"  {got['num_train']} training / {got['num_test']} test utterances, {got['seconds']:.0f} s")
    print(f"  peak RSS of the process tree {got['peak_rss_gb']:.2f} GB, peak PSS {got['peak_pss_gb']:.2f} GB "
          "(goal: under 2.5 GB)")  # fmt: skip


if __name__ == "__main__":
    main()
