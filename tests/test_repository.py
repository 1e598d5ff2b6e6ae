"""The checkout itself: no file carries a merge's conflict markers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def test_no_conflict_markers_in_tracked_text_files():
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    bad = []
    for name in listed.stdout.splitlines():
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".txt", ".yaml", ".yml", ".cfg", ".sh", ".ini"}:
            continue
        if path.is_file() and MARKER.search(path.read_text(encoding="utf-8", errors="replace")):
            bad.append(name)
    assert not bad, f"conflict markers in {bad}"
