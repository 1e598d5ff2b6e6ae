"""docs/open_set.md runs as written on the real faces (skipped where ../shared/data is absent): its
command (a cheap variant, by its marker) and its Python block, whose printed output must be the
page's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_readme import CONSOLE, blocks, plan

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "open_set.md"
SHARED = ROOT.parent / "shared"

pytestmark = pytest.mark.skipif(
    not (SHARED / "data" / "yalefaces").is_dir(), reason=f"real faces absent: no {SHARED}/data/yalefaces"
)


def _workdir(tmp_path: Path) -> Path:
    """A directory with ``../shared`` beside it, as the repository's root has."""
    work = tmp_path / "clone"
    work.mkdir()
    (tmp_path / "shared").symlink_to(SHARED, target_is_directory=True)
    return work


@pytest.mark.slow
def test_open_set_page_runs_as_written(tmp_path):
    found = blocks(PAGE.read_text(encoding="utf-8"))
    work = _workdir(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    commands = [plan(b) for b in found if b.lang == "bash"]
    assert len(commands) == 1 and "--epochs 1" in commands[0]
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", commands[0]], cwd=work, env=env,
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| raw (baseline) |" in done.stdout and "| pca_whitened (baseline) |" in done.stdout
    assert "test 5 (subject03, subject09, subject10, subject11, subject15)" in done.stderr  # the log's split

    python = [b for b in found if b.lang == "python"]
    assert len(python) == 1
    (tmp_path / "console.py").write_text(CONSOLE)
    (tmp_path / "block.py").write_text(python[0].code)
    ran = subprocess.run([sys.executable, str(tmp_path / "console.py"), str(tmp_path / "block.py")], cwd=work,
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    shown = next(b for b in found if b.lang == "text" and b.line > python[0].line)
    assert ran.stdout.strip().splitlines() == shown.code.strip().splitlines()
