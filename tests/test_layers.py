"""The layering of ``src/marginkit`` (``[tool.importlinter]`` in pyproject.toml) holds.

A module that imports from a layer above its own (a future cycle in the making) fails here,
not in review. The contract is checked by import-linter itself; a second check builds a
throw-away package that breaks the same kind of contract, so the test cannot pass vacuously.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([LINT, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def lint_available() -> None:
    if not Path(LINT).exists():
        pytest.fail("lint-imports is not installed (the test extra installs import-linter)")


def test_the_package_keeps_its_layers(lint_available) -> None:
    res = _lint(ROOT, ROOT / "src")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "marginkit layers KEPT" in res.stdout


def test_an_upward_import_inside_a_function_breaks_the_contract(lint_available, tmp_path) -> None:
    pkg = tmp_path / "src" / "layered"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "high.py").write_text("from layered import low\n")
    (pkg / "low.py").write_text("def f():\n    from layered import high\n    return high\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.importlinter]\nroot_package = "layered"\n\n'
        '[[tool.importlinter.contracts]]\nname = "toy layers"\ntype = "layers"\n'
        'containers = ["layered"]\nlayers = ["high", "low"]\n'
    )
    res = _lint(tmp_path, tmp_path / "src")
    assert res.returncode != 0 and "toy layers BROKEN" in res.stdout, res.stdout + res.stderr
