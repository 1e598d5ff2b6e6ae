"""Torch's intra-op threads in a training loop of one's own: one thread against torch's default.

Usage:  python benchmarks/bench_threads.py [--quick] [--steps S] [--rounds R]

One step is what a user's loop does with the library: a small MLP, a ``CosineHead`` over 100
classes and ``CosFaceLoss`` on a batch of 128, backward, AdamW. The two settings run
interleaved (round-robin, ``torch.set_num_threads`` switched between rounds) so that both see
the same load; each round times ``S`` steps after 20 warm-up steps. Printed per setting: the
median and the 90th percentile of the step times over all rounds, and the ratio of the medians.
On an idle machine the default's extra threads help large products a little; on cores that
other processes keep busy they wait for each other, and the small steps of such a loop take
many times longer (OMP_WAIT_POLICY=PASSIVE, set by ./dev.sh test, softens but does not remove it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from marginkit.heads import CosineHead
from marginkit.losses import CosFaceLoss


def steps(n: int) -> list[float]:
    """Seconds of each of ``n`` training steps (after 20 unmeasured ones)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    head, loss = CosineHead(100, 64), CosFaceLoss(scale=16.0, margin=0.2)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-3)
    x, y = torch.randn(128, 64), torch.randint(0, 100, (128,))
    out = []
    for i in range(n + 20):
        t = time.perf_counter()
        value = loss(head(model(x)), y)
        opt.zero_grad()
        value.backward()
        opt.step()
        if i >= 20:
            out.append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per setting, interleaved")
    args = parser.parse_args()
    n, rounds = (20, 1) if args.quick else (args.steps, args.rounds)
    default = torch.get_num_threads()
    settings = {f"torch's default ({default} threads)": default, "1 thread": 1}
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(rounds):
        for name, threads in settings.items():
            torch.set_num_threads(threads)
            times[name] += steps(n)
    torch.set_num_threads(default)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"{n} steps x {rounds} round(s) per setting; load average {load}; {os.cpu_count()} logical cores")
    medians = {}
    for name, ts in times.items():
        ts.sort()
        medians[name] = statistics.median(ts)
        p90 = ts[int(0.9 * (len(ts) - 1))]
        print(f"{name:<28} median {1e3 * medians[name]:7.2f} ms   p90 {1e3 * p90:7.2f} ms")
    first, one = medians.values()
    print(f"default / 1 thread: {first / one:.2f}x")


if __name__ == "__main__":
    main()
