"""The study (issue 8): the --quick run produces every table, config and verdict; helpers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from marginkit.study.claims import _grade
from marginkit.study.jobs import crammer_singer_hinge
from marginkit.study.plan import study_plan
from marginkit.study.runner import TABLES, build_jobs
from marginkit.study.tables import markdown_table, stat


def test_hinge_matches_explicit_loop(gen: torch.Generator) -> None:
    scores = torch.randn(7, 5, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, 5, (7,), generator=gen)
    got = crammer_singer_hinge(scores, labels, 1.5)
    for i in range(7):
        others = [float(scores[i, j]) for j in range(5) if j != int(labels[i])]
        want = max(0.0, 1.5 + max(others) - float(scores[i, labels[i]]))
        assert math.isclose(float(got[i]), want, rel_tol=1e-6, abs_tol=1e-6)


def test_hinge_zero_gradient_past_margin() -> None:
    scores = torch.tensor([[5.0, 1.0, 0.0], [1.0, 0.5, 0.0]], requires_grad=True)
    loss = crammer_singer_hinge(scores, torch.tensor([0, 0]), 2.0)
    loss.sum().backward()
    assert loss[0] == 0 and bool((scores.grad[0] == 0).all())
    assert loss[1] > 0 and scores.grad[1].abs().sum() > 0


def test_hinge_rejects_bad_shape() -> None:
    with pytest.raises(ValueError, match="scores"):
        crammer_singer_hinge(torch.zeros(3), torch.tensor([0, 0, 0]), 1.0)


def test_stat_and_table() -> None:
    s = stat([0.9, 0.8, None])
    assert s.n == 2 and math.isclose(s.mean, 0.85) and s.fmt().endswith("(some seeds n/m)")
    assert stat([None, None]).fmt() == "not measurable"
    assert stat([0.5]).fmt() == "50.0 (1 seed)"
    table = markdown_table(["a", "b"], [[1, 2]])
    assert table.splitlines()[1] == "|:---|---:|"


def test_grade_rule() -> None:
    assert _grade(4, 5) == "supported" and _grade(1, 5) == "not supported" and _grade(2, 5) == "mixed"
    assert _grade(0, 0) == "not measured"


def test_full_plan_covers_the_issue() -> None:
    plan = study_plan(quick=False)
    settings = {(d, pc) for d, pc, _ in plan.knn_settings}
    assert settings == {("mnist1d", 50), ("mnist1d", 100), ("mnist1d", None), ("digits", 10), ("digits", 30),
                        ("breast_cancer", None)}  # fmt: skip
    assert all(seeds >= 3 for _, _, seeds in plan.knn_settings + plan.mep_settings)
    jobs = build_jobs(plan)
    names = [j["name"] for j in jobs]
    assert len(names) == len(set(names))
    losses = {j["loss"] for j in jobs if j["kind"] == "identities"}
    assert {"arcface", "cosface", "entmax", "sparsemax", "qmargin"} <= losses
    alphas = {
        j["loss_options"].get("alpha") for j in jobs if j["kind"] == "identities" and j["loss"] == "qmargin"
    }
    assert alphas == {1.25, 1.5}


@pytest.mark.slow
def test_quick_study_writes_every_table(tmp_path) -> None:
    from marginkit.study import run_study

    res = run_study(tmp_path, quick=True, jobs=2, log=lambda _m: None)
    for name in TABLES:
        text = (tmp_path / "tables" / f"{name}.md").read_text(encoding="utf-8")
        assert "|" in text, name
    md = (tmp_path / "RESULTS.md").read_text(encoding="utf-8")
    for heading in ("## 1.", "## 2.", "## 2b.", "## 3.", "## 4.", "## 5.", "## 6.", "## Verdicts"):
        assert heading in md
    claims = json.loads((tmp_path / "claims.json").read_text(encoding="utf-8"))
    assert len(claims) == 6
    assert all(c["verdict"] in ("supported", "not supported", "mixed", "not measured") for c in claims)
    assert res["wall_seconds"] > 0
    plan = study_plan(quick=True)
    for job in build_jobs(plan):
        run_dir = tmp_path / "runs" / job["name"]
        assert json.loads((run_dir / "job.json").read_text(encoding="utf-8")) == job
        assert (run_dir / "result.json").is_file()
        if job["kind"] in ("knn", "identities", "transfer"):
            assert (run_dir / "train" / "config.yaml").is_file()


def test_cli_study_subcommand_rejects_bad_jobs(tmp_path, capsys) -> None:
    from marginkit.cli.app import main

    assert main(["study", "--out", str(tmp_path), "--jobs", "0"]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists()
    assert main(["study", "--quick"]) == 2  # --out is required


def test_collect_only_on_empty_dir_writes_partial_tables(tmp_path) -> None:
    from marginkit.study import run_study

    res = run_study(tmp_path, quick=True, collect_only=True, log=lambda _m: None)
    md = (tmp_path / "RESULTS.md").read_text(encoding="utf-8")
    assert "PARTIAL RESULTS" in md and "not measurable" in md
    assert all((tmp_path / "tables" / f"{name}.md").is_file() for name in TABLES)
    assert {c["verdict"] for c in res["claims"]} == {"not measured"}
    assert not (tmp_path / "runs").exists()  # nothing was trained
