"""`marginkit demo --markdown`: the README's demo table, reproducible and pasted verbatim."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from marginkit.cli import main
from marginkit.cli.compare import DEMO_LOSSES
from marginkit.cli.demo_markdown import demo_markdown

README = Path(__file__).resolve().parents[1] / "README.md"
HEADER = "| loss | knn_accuracy | head_accuracy | precision_at_1 | r_precision | map_at_r |"


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_markdown_of_a_finished_demo(tmp_path):
    run = tmp_path / "runs" / "softmax" / "seed0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("loss: softmax\nepochs: 8\nnum_threads: 1\n")
    summary = [
        {"loss": "softmax", "n_seeds": 1, "knn_accuracy": 0.964, "knn_accuracy_std": None,
         "head_accuracy": 0.953, "precision_at_1": 0.954, "r_precision": 0.8, "map_at_r": 0.75,
         "seconds": 4.12, "runs": [str(run)]},
        {"loss": "triplet", "n_seeds": 1, "knn_accuracy": 0.98, "head_accuracy": None,
         "precision_at_1": 0.983, "r_precision": 0.939, "map_at_r": 0.9247, "seconds": 6.5, "runs": []},
    ]  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    text = demo_markdown(tmp_path, wall_seconds=49.4)
    lines = table_lines(text)
    assert lines[0] == HEADER  # metrics only: no timing column in a table meant to reproduce
    assert lines[2] == "| softmax | 0.9640 | 0.9530 | 0.9540 | 0.8000 | 0.7500 |"
    assert lines[3] == "| triplet | 0.9800 | — | 0.9830 | 0.9390 | 0.9247 |"
    conditions = text.strip().splitlines()[-1]
    assert conditions.startswith("2 losses, 1 seed, 8 epochs; marginkit ")
    for fact in ("torch ", "Python ", "logical cores", "1 torch thread(s) per run", "Wall time 49 s",
                 "training 4.1–6.5 s per run", "load average at the end"):  # fmt: skip
        assert fact in conditions, fact
    assert "reused" not in conditions
    summary[0]["reused_runs"] = 1  # a rerun: its wall time is not what the runs took
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert "Wall time 49 s, 1 of 1 runs reused from an earlier invocation" in demo_markdown(
        tmp_path, wall_seconds=49.4
    )


def test_readme_table_is_the_markdown_output():
    """The README shows `marginkit demo --markdown` as it prints: the table and the line under it."""
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    start = lines.index(HEADER)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    assert rows == [*DEMO_LOSSES, "raw_1nn (baseline)", "logistic (baseline)"]  # compare's baselines last
    after = lines[start + 2 + len(rows) :]
    conditions = next(line for line in after if line.strip())
    assert re.match(
        rf"{len(DEMO_LOSSES)} losses, \d+ seeds?, \d+ epochs; marginkit \S+, torch \S+, ", conditions
    )
    assert "marginkit demo --markdown" in text


@pytest.mark.slow
def test_two_demo_runs_give_identical_tables(tmp_path, capsys):
    """A tiny demo twice: once run by run in this process, once in two worker processes."""
    tables = []
    for jobs, out in ((1, tmp_path / "a"), (2, tmp_path / "b")):
        args = ["demo", "--out", str(out), "--epochs", "1", "--losses", "softmax,triplet"]
        assert main([*args, "--jobs", str(jobs), "--markdown", "-q"]) == 0
        tables.append(table_lines(capsys.readouterr().out))
    assert tables[0] == tables[1]
    assert tables[0][0] == HEADER and len(tables[0]) == 6  # two losses, two baselines
