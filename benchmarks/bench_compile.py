"""``compile: true`` on the CPU: what ``torch.compile`` (inductor) costs once and gains per epoch.

Trains the same run eagerly and compiled, one after the other in this process (the data set is
loaded once), and prints, from each run's ``metrics.jsonl``: the first epoch's seconds (the
compiled one includes the compilation), and the median samples/s of the later epochs, compiled
÷ eager. ``torch.compile`` pays when the per-epoch gain times the epochs exceeds the first
epoch's extra seconds.

    python benchmarks/bench_compile.py                       # cnn2d on mnist-sample, 4 epochs
    python benchmarks/bench_compile.py --model mlp --data digits --epochs 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from marginkit.train import TrainConfig, train
from marginkit.train.components import load_splits


def run(config: TrainConfig, out: Path, splits) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    train(config, out, quiet=True, report=False, splits=splits)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "epoch_seconds" in r], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="mnist-sample")
    parser.add_argument("--model", default="cnn2d")
    parser.add_argument("--loss", default="cosface")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = TrainConfig(
        data=args.data, model=args.model, loss=args.loss, epochs=args.epochs, batch_size=args.batch_size,
        num_threads=args.threads, eval_every=args.epochs,
    ).validate()  # fmt: skip
    splits = load_splits(base)
    print(f"torch {torch.__version__}, {args.threads} thread(s); {args.model} on {args.data}, "
          f"{len(splits.train)} training samples, batch {args.batch_size}, {args.epochs} epochs")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        eager, eager_wall = run(base, Path(tmp) / "eager", splits)
        compiled, compiled_wall = run(TrainConfig(**{**vars(base), "compile": True}), Path(tmp) / "c", splits)
    rate = {name: [r["samples_per_second"] for r in rows[1:]] for name, rows in (("eager", eager),
            ("compiled", compiled))}  # fmt: skip
    first = {"eager": eager[0]["epoch_seconds"], "compiled": compiled[0]["epoch_seconds"]}
    ratio = statistics.median(rate["compiled"]) / statistics.median(rate["eager"])
    print(f"first epoch: eager {first['eager']:.1f} s, compiled {first['compiled']:.1f} s "
          f"(+{first['compiled'] - first['eager']:.1f} s: compilation)")  # fmt: skip
    print(f"later epochs, median samples/s: eager {statistics.median(rate['eager']):.0f}, compiled "
          f"{statistics.median(rate['compiled']):.0f} -> compiled / eager {ratio:.2f}x")  # fmt: skip
    per_epoch = eager[1]["epoch_seconds"] * (1 - 1 / ratio) if ratio > 0 else 0.0
    extra = first["compiled"] - first["eager"]
    if per_epoch > 0:
        print(f"pays after about {extra / per_epoch:.0f} epochs of this size "
              f"({per_epoch:.2f} s saved an epoch)")  # fmt: skip
    else:
        print("never pays here: the compiled epochs are not faster")
    print(f"wall: eager {eager_wall:.0f} s, compiled {compiled_wall:.0f} s (both include evaluation)")


if __name__ == "__main__":
    main()
