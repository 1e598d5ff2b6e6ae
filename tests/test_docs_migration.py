"""docs/migration.md runs as written: its python blocks, in order, pasted into one interactive
interpreter (its rules: a blank line ends a compound statement), in an empty directory (they
write ``runs/``), as a reader would."""

from __future__ import annotations

import code
import re
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "migration.md"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block."""
    return [
        (text[: m.start()].count("\n") + 1, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M)
    ]


def test_every_fence_of_the_page_is_python_or_output():
    fences = re.findall(r"^```(\S*)$", PAGE.read_text(encoding="utf-8"), re.M)
    opening = fences[::2]
    assert set(opening) <= {"python", "text"} and len(python_blocks(PAGE.read_text())) >= 4


def test_migration_page_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("pytorch_metric_learning")
    pytest.importorskip("onnxruntime")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    failures: list[str] = []

    class Console(code.InteractiveConsole):
        def showtraceback(self) -> None:
            failures.append(f"{sys.exc_info()[0].__name__}: {sys.exc_info()[1]}")

        def showsyntaxerror(self, filename=None, **kwargs) -> None:
            failures.append(f"SyntaxError: {sys.exc_info()[1]}")

    console = Console(locals=namespace)
    for line, block in python_blocks(PAGE.read_text(encoding="utf-8")):
        more = False
        for n, text in enumerate(block.splitlines()):
            more = console.push(text)
            if failures:
                pytest.fail(f"docs/migration.md:{line + 1 + n} failed: {failures[0]}")
        if more:
            console.push("")
        if failures:
            pytest.fail(f"docs/migration.md block at line {line} failed: {failures[0]}")
    out = capsys.readouterr().out
    assert re.search(r"^custom 32 0\.\d{3}$", out, re.M), out  # the run of SmallNet
    assert len(re.findall(r"K-NN accuracy 0\.\d{3}  MAP@R 0\.\d{3}", out)) == 3, out
    assert namespace["metrics"]["knn_accuracy"] == namespace["result"].metrics["knn_accuracy"]
    assert (tmp_path / "runs" / "own-bundle" / "manifest.json").is_file()
