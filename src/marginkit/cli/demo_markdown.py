"""``marginkit demo --markdown``: the demo's results as the README shows them, to paste verbatim.

The table holds the test metrics only (mean ± std with several seeds). They are a function
of the code, the seeds, the budget, the torch version and the CPU's floating-point kernels:
each run trains with one thread, deterministic algorithms and its own seed, so the table is
the same whether the runs train one after another or in parallel processes (``--jobs``), and
the same on every rerun on one machine. Timings are not: they depend on the cores, on what
else runs, and on a first run's one-off costs (generating MNIST-1D, Python's byte-code and
matplotlib's font caches). The line under the table records both kinds of condition.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from marginkit.cli.compare import TABLE_METRICS, markdown_table

__all__ = ["cpu_name", "demo_markdown"]


def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _conditions(summary: list[dict[str, Any]], wall_seconds: float) -> str:
    from importlib.metadata import version

    from marginkit import __version__

    seeds = max((int(r.get("n_seeds") or 1) for r in summary), default=1)
    epochs, threads = "?", "?"
    first_run = next((Path(p) for r in summary for p in r.get("runs", [])), None)
    if first_run is not None and (first_run / "config.yaml").is_file():
        for line in (first_run / "config.yaml").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            if key == "epochs":
                epochs = value.strip()
            elif key == "num_threads":
                threads = value.strip()
    train = [float(r["seconds"]) for r in summary if isinstance(r.get("seconds"), (int, float))]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    span = f"{min(train):.1f}–{max(train):.1f} s" if train else "n/a"
    losses = sum(r.get("kind") != "baseline" for r in summary)
    reused = sum(int(r.get("reused_runs") or 0) for r in summary)
    runs = sum(len(r.get("runs", [])) for r in summary if r.get("kind") != "baseline")
    wall = f"Wall time {wall_seconds:.0f} s"
    if reused:
        wall += (
            f", {reused} of {runs} runs reused from an earlier invocation (their training times are "
            "from then)"
        )
    return (
        f"{losses} losses, {seeds} seed{'s' if seeds > 1 else ''}, {epochs} epochs; "
        f"marginkit {__version__}, torch {version('torch')}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}, {cpu_name()} ({os.cpu_count()} logical cores); "
        f"{threads} torch thread(s) per run. {wall} (training {span} per run; "
        f"load average at the end {load})."
    )


def demo_markdown(out: str | Path, *, wall_seconds: float) -> str:
    """The README block for the demo in ``out``: the metrics table, then the conditions."""
    out = Path(out)
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    metrics = [m for m in TABLE_METRICS if any(r.get(m) is not None for r in summary)]
    table = markdown_table(summary, metrics)
    return f"{table}\n\n{_conditions(summary, wall_seconds)}\n"
