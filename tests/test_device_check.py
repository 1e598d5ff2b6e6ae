"""``benchmarks/device_check.sh`` (issue 36's prepared GPU check) runs its every section on the CPU.

A session lent a GPU has minutes for one run of that script; a broken section would cost the run.
``--cpu-smoke`` takes the GPU run's code paths (every op of the equality section, the Q-Margin table,
MEP against one sort, the trainer against a bare loop with both models and both precisions) at tiny
sizes; a failing section prints ``**section ... failed**`` and the script goes on, so the output is
what this test reads.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_device_check_runs_every_section_on_the_cpu():
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)  # the script puts src/ first itself
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_check.sh"), "--cpu-smoke"],
        capture_output=True, text=True, env=env, timeout=340, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed" not in out, out
    for header in ("1. CUDA == CPU", "2. Q-Margin against", "3. MEP against", "4. marginkit.train"):
        assert f"## {header}" in out, out
    # section 1 compares the CPU with itself here: every difference is exactly zero
    diffs = re.findall(r"^\| [^|]+ \| (\S+) \|$", out.split("## 2.")[0], flags=re.M)
    assert len(diffs) == 7 and all(float(d) == 0.0 for d in diffs), diffs
    for method in ("Q-Margin", "Q-Margin top-5 %", "CosFace", "ArcFace"):
        assert re.search(rf"\| {re.escape(method)} \| [\d.]+ \| [\d.]+ \|", out), method
    assert len(re.findall(r"^\| \d+ × \d+ \| l[12] \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out, flags=re.M)) == 4
    for model, amp in (("timm:resnet18", "bf16"), ("resnet", "off")):
        row = rf"^\| {re.escape(model)} \| 32 \| 16 \| {amp} \| no \| \d+ \|"
        assert re.search(row, out, flags=re.M), model
