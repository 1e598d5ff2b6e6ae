"""The study (issue 12): statistics and verdict rules, fake quantisation, the plan, the tuning
spaces, and the --quick run producing every table, trial, config and verdict."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from marginkit.study.jobs import crammer_singer_hinge, fake_quantized
from marginkit.study.plan import KNN_LOSSES, identity_rows, study_plan
from marginkit.study.runner import build_jobs
from marginkit.study.sections import TABLES
from marginkit.study.stats import Comparison, compare, grade, outcome, paired_bootstrap, tuned_beats_defaults
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
    with pytest.raises(ValueError, match="scores"):
        crammer_singer_hinge(torch.zeros(3), torch.tensor([0, 0, 0]), 1.0)


def test_stat_and_table() -> None:
    s = stat([0.9, 0.8, None])
    assert s.n == 2 and math.isclose(s.mean, 0.85) and s.fmt().endswith("(some seeds n/m)")
    assert stat([None, None]).fmt() == "not measurable"
    assert markdown_table(["a", "b"], [[1, 2]]).splitlines()[1] == "|:---|---:|"


# ----------------------------------------------------------------------------- statistics
def test_tuned_beats_defaults_is_a_two_proportion_z_rule() -> None:
    # n = 200, 0.925 vs 0.885: se = sqrt((0.925*0.075 + 0.885*0.115) / 200) = 0.02926, 1.96 se = 5.7 pts
    assert not tuned_beats_defaults(0.925, 0.885, 200)
    assert tuned_beats_defaults(0.95, 0.885, 200)  # 6.5 pts > 1.96 * 0.0272
    assert not tuned_beats_defaults(0.88, 0.915, 200)  # defaults better: never moved
    assert tuned_beats_defaults(0.90, 0.885, 100_000)  # a small gap counts on a large split


def test_paired_bootstrap_matches_scipy() -> None:
    from scipy.stats import bootstrap

    rng = np.random.default_rng(3)
    a, b = rng.normal(0.8, 0.05, 8), rng.normal(0.75, 0.05, 8)
    mean, lo, hi = paired_bootstrap(a, b, n_boot=20_000)
    ref = bootstrap((a - b,), np.mean, n_resamples=20_000, method="percentile", random_state=1)
    assert math.isclose(mean, float(np.mean(a - b)), rel_tol=1e-12)
    assert abs(lo - ref.confidence_interval.low) < 0.004 and abs(hi - ref.confidence_interval.high) < 0.004


def test_paired_bootstrap_constant_difference_and_errors() -> None:
    assert paired_bootstrap([0.5, 0.6, 0.7], [0.4, 0.5, 0.6]) == pytest.approx((0.1, 0.1, 0.1))
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([], [])


def test_outcome_and_grade_rules() -> None:
    assert outcome(0.01, 0.2) == "win" and outcome(-0.2, -0.01) == "loss" and outcome(-0.1, 0.1) == "tie"

    def c(result: str) -> Comparison:
        return Comparison("x", "a", "b", 5, 0.0, 0.0, 0.0, 0.0, 0.0, result)

    assert grade([c("win")] * 4 + [c("tie")]) == "supported"
    assert grade([c("win")] * 4 + [c("loss")]) == "mixed"  # a single loss forbids "supported"
    assert grade([c("loss"), c("loss"), c("tie"), c("win")]) == "contradicted"
    assert grade([c("tie"), c("tie")]) == "not supported"
    assert grade([c("not measured")]) == "not measured"


def test_compare_pairs_common_seeds_only() -> None:
    a = {0: 0.9, 1: 0.91, 2: 0.92, 3: None, 4: 0.95}
    b = {0: 0.8, 1: 0.8, 2: 0.81, 3: 0.5, 5: 0.1}
    got = compare("x", "a", a, "b", b)
    assert got.n == 3 and got.result == "win" and got.mean_b == pytest.approx(0.8033333)
    assert compare("x", "a", {0: 1.0}, "b", {0: 0.0}).result == "not measured"  # < 3 paired seeds


# ----------------------------------------------------------------------------- fake quantisation
def test_fake_quantized_weights(gen: torch.Generator) -> None:
    layer = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    with torch.no_grad():
        layer[0].weight.copy_(torch.randn(4, 6, generator=gen))
    original = layer[0].weight.detach().clone()
    q = fake_quantized(layer, "int8")
    w = q[0].weight.detach()
    step = original.abs().amax(1, keepdim=True) / 127
    ratio = w / step
    torch.testing.assert_close(ratio, ratio.round(), atol=1e-4, rtol=0)  # on the per-row int8 grid
    assert float((w - original).abs().max()) <= float(step.max()) / 2 + 1e-7
    assert torch.equal(q[0].bias, layer[0].bias) and torch.equal(layer[0].weight, original)  # copy
    bf = fake_quantized(layer, "bf16")[0].weight
    assert torch.equal(bf, original.to(torch.bfloat16).float())
    assert torch.equal(fake_quantized(layer, "fp32")[0].weight, original)
    with pytest.raises(ValueError, match="precision"):
        fake_quantized(layer, "int4")


# ----------------------------------------------------------------------------- plan and spaces
def test_full_plan_covers_the_issue() -> None:
    plan = study_plan(quick=False)
    assert plan.seeds >= 5
    per_class = {pc for _, pc in plan.knn_settings}
    assert {10, 50, 100} <= per_class
    data = {d for d, _ in plan.knn_settings}
    assert {"mnist-sample", "japanese-vowels", "digits", "breast_cancer", "mnist1d"} <= data
    assert ("mnist-sample", 10) in plan.paper_settings and plan.tune_data == "mnist-sample"
    assert any(d == "japanese-vowels" for d, _ in plan.disjoint_settings)
    o = plan.identity_options
    n_test = o["num_test_identities"] * o.get("test_samples_per_identity", 10)
    genuine = o["num_test_identities"] * math.comb(o.get("test_samples_per_identity", 10), 2)
    assert math.comb(n_test, 2) - genuine >= 10**6  # very low FAR is measurable
    jobs = build_jobs(plan)
    names = [j["name"] for j in jobs]
    assert len(names) == len(set(names))
    tunes = [j for j in jobs if j["kind"] == "tune"]
    assert {j["loss"] for j in tunes} == set(KNN_LOSSES)
    assert len({(j["trials"], j["startup_trials"], j["dev_seed"], j["sampler_seed"]) for j in tunes}) == 1
    assert all(j["seed"] < plan.dev_seed for j in jobs if "seed" in j)  # never tune on an evaluation seed
    paper = {j["loss"] for j in jobs if j["kind"] == "knn" and j["row"] == "paper"}
    assert paper == set(KNN_LOSSES)


def test_faces_section_is_leave_people_out_folds_with_and_without_augmentation(tmp_path) -> None:
    from dataclasses import replace

    from marginkit.study.plan import FACE_LOSSES, FACE_PEERS
    from marginkit.study.runner import face_jobs

    faces = tmp_path / "yale"
    for person in range(15):
        (faces / f"subject{person:02d}").mkdir(parents=True)
    plan = replace(study_plan(quick=False), faces=str(faces))
    jobs = face_jobs(plan)
    base = [j for j in jobs if j["kind"] == "faces_baseline"]
    runs = [j for j in jobs if j["kind"] == "faces"]
    assert [j["fold"] for j in base] == [0, 1, 2] and plan.faces_seeds >= 3
    assert all(j["data_options"] == {"image_size": 32, "folds": 3, "split": "classes", "fold": j["fold"],
                                     "split_seed": 0} for j in jobs)  # fmt: skip
    rows = {(j["loss"], j["augment"]) for j in runs}
    assert rows == {(loss, False) for loss in (*FACE_LOSSES, *FACE_PEERS)} | {
        (loss, True) for loss in FACE_LOSSES
    }
    assert len(runs) == 3 * plan.faces_seeds * len(rows)
    assert all(
        j["train_options"].get("augment") == (plan.face_augment if j["augment"] else None) for j in runs
    )
    assert face_jobs(replace(plan, faces=str(tmp_path / "absent"))) == []  # no faces here: no section jobs


def test_speaker_section_holds_the_trial_speakers_out_and_scores_the_list(tmp_path) -> None:
    """Issue 37: the speaker section's jobs (synthetic speakers here, espeak-ng's in the study),
    run end to end at the quick plan's budget: one row per loss and the pretrained baseline."""
    from dataclasses import replace

    from marginkit.audio.synthetic import synthetic_speakers, write_speaker_folder
    from marginkit.study.jobs import run_job
    from marginkit.study.plan import speaker_rows
    from marginkit.study.runner import Results, speaker_jobs
    from marginkit.study.sections import _speakers

    root = tmp_path / "speakers"
    write_speaker_folder(root, synthetic_speakers(6, seed=3), 3, seconds=(0.6, 1.0), seed=4)
    utts = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.wav") if p.parts[-3] >= "spk004")
    lines = [
        f"{int(a.split('/')[0] == b.split('/')[0])} {a} {b}"
        for i, a in enumerate(utts)
        for b in utts[i + 1 :]
    ]
    (root / "trials.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    plan = replace(study_plan(quick=True), speakers=str(root))
    jobs = speaker_jobs(plan)
    assert [j["kind"] for j in jobs] == ["speakers_baseline"] + ["speakers"] * len(speaker_rows())
    assert all(j["data_options"]["test_classes"] == ["spk004", "spk005"] for j in jobs)
    assert speaker_jobs(replace(plan, speakers=str(tmp_path / "absent"))) == []
    res = Results([run_job(j, str(tmp_path / "out")) for j in jobs])
    for r in res.select("speakers"):
        assert r["result"]["num_trials"] == len(lines) and 0 <= r["result"]["eer"] <= 1
        assert r["result"]["num_train"] == 12  # 4 speakers x 3 utterances: the trial speakers never train
    table = _speakers(plan, res)
    assert all(label in table for label, _, _ in speaker_rows()) and "pretrained GE2E" in table
    assert _speakers(plan, Results([])).startswith("Not run: no synthetic speakers")


def test_tuning_spaces_are_options_of_their_losses() -> None:
    from marginkit.study.tuning import PAPER, SPACES
    from marginkit.train import TrainConfig
    from marginkit.train.registry import check_loss_options

    fields = set(TrainConfig.keys())
    for loss in KNN_LOSSES:
        names = [name for name, *_ in SPACES[loss]]
        loss_opts = {n.split(".", 1)[1]: None for n in names if n.startswith("loss_options.")}
        check_loss_options(loss, loss_opts)  # raises for an option the loss does not take
        assert {n for n in names if "." not in n} <= fields
        check_loss_options(loss, PAPER[loss][1])
    for _label, loss, options in identity_rows():
        check_loss_options(loss, options)


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_quick_study_writes_every_table(tmp_path) -> None:
    from marginkit.study import run_study

    lines: list[str] = []
    res = run_study(tmp_path, quick=True, jobs=2, log=lines.append)
    n = len(build_jobs(study_plan(quick=True)))
    # the ETA is per kind of job: at first most kinds have no timed job, and it says so
    first = next(line for line in lines if line.startswith(f"[1/{n}]"))
    assert re.search(r" ETA [\d:]+ \+ \d+ jobs not timed yet$", first), first
    assert next(line for line in lines if line.startswith(f"[{n}/{n}]")).endswith("ETA 0:00")
    faces = Path(study_plan(quick=True).faces).is_dir()  # the real faces of ../shared/data, if here
    for name in TABLES:
        table = (tmp_path / "tables" / f"{name}.md").read_text(encoding="utf-8")
        absent = (name == "faces" and not faces and table.startswith("Not run: no faces")) or (
            name == "speakers" and table.startswith("Not run: no synthetic speakers")
        )
        assert "|" in table or absent, name
    md = (tmp_path / "RESULTS.md").read_text(encoding="utf-8")
    assert "## Verdicts" in md and all(f"## {i}." in md for i in range(1, 11))
    claims = json.loads((tmp_path / "claims.json").read_text(encoding="utf-8"))
    verdicts = ("supported", "not supported", "mixed", "contradicted", "not measured")
    assert len(claims) == 7 and all(c["verdict"] in verdicts for c in claims)
    face_claim = next(c for c in claims if c["claim"].startswith("On real faces"))
    assert (face_claim["verdict"] != "not measured") == faces  # 3 folds x 1 seed: 3 paired units
    assert res["wall_seconds"] > 0
    cost = json.loads((tmp_path / "cost.json").read_text(encoding="utf-8"))
    assert cost["missing"] == 0 and cost["job_cpu_seconds"] > 0
    # each job records the CPU and kernels it ran on (they set the rounding); the header lists them
    (cpu, count), *others = cost["computed_on"].items()
    assert not others and count == cost["jobs"] and "torch kernels" in cpu and f"Computed on {cpu}" in md
    for job in build_jobs(study_plan(quick=True)):
        run_dir = tmp_path / "runs" / job["name"]
        assert json.loads((run_dir / "job.json").read_text(encoding="utf-8")) == job
        assert (run_dir / "result.json").is_file()
        if job["kind"] == "tune":
            stored = json.loads((run_dir / "trials.json").read_text(encoding="utf-8"))
            trials = stored["trials"]
            assert stored["job"] == job
            assert len(trials) == job["trials"] and all(0 <= t["val_knn_accuracy"] <= 1 for t in trials)
        if job["kind"] in ("knn", "identities") or (job["kind"] == "disjoint" and job["loss"] != "raw"):
            assert (run_dir / "train" / "config.yaml").is_file()


def test_a_job_process_starts_its_children_the_platform_default_way() -> None:
    """The job processes are spawned; a DataLoader worker they start must not be spawned too (each
    would import torch and marginkit again: seconds per loader of a folder source's job)."""
    import multiprocessing

    from marginkit.study.runner import job_pool

    with job_pool(1) as pool:
        method = pool.submit(multiprocessing.get_start_method).result()
    assert method == multiprocessing.get_all_start_methods()[0]


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


def test_a_result_is_reused_only_with_the_same_job_and_defaults(tmp_path) -> None:
    from marginkit.study.jobs import library_defaults, stored_result

    job = {"name": "knn/x/softmax/seed0", "kind": "knn", "loss": "softmax", "seed": 0}
    path = tmp_path / "runs" / job["name"] / "result.json"
    path.parent.mkdir(parents=True)
    assert stored_result(job, tmp_path) is None
    path.write_text(json.dumps({"job": job, "defaults": library_defaults(job), "result": {}}))
    assert stored_result(job, tmp_path)["reused"] is True
    path.write_text(json.dumps({"job": {**job, "seed": 1}, "defaults": library_defaults(job)}))
    assert stored_result(job, tmp_path) is None  # another job
    changed = library_defaults(job)
    changed["train"]["lr"] = 1.0
    path.write_text(json.dumps({"job": job, "defaults": changed}))
    assert stored_result(job, tmp_path) is None  # a default changed since: rerun


def test_the_throughput_job_is_rerun_when_a_methods_default_changes(tmp_path) -> None:
    from marginkit.study.jobs import library_defaults, stored_result

    job = {"name": "throughput/e2e", "kind": "e2e", "methods": {"Q-Margin": ["qmargin", {}]}}
    defaults = library_defaults(job)
    assert set(defaults["losses"]["Q-Margin"]) >= {"alpha", "scale", "margin"}
    path = tmp_path / "runs" / job["name"] / "result.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"job": job, "defaults": defaults, "result": {}}))
    assert stored_result(job, tmp_path)["reused"] is True
    old = json.loads(json.dumps(defaults))
    old["losses"]["Q-Margin"]["scale"] += 1.0  # stored under another default
    path.write_text(json.dumps({"job": job, "defaults": old, "result": {}}))
    assert stored_result(job, tmp_path) is None
    path.write_text(json.dumps({"job": job, "defaults": None, "result": {}}))  # before they were stored
    assert stored_result(job, tmp_path) is None


def test_unfinished_tuning_shows_its_trials(tmp_path) -> None:
    from marginkit.study.tuning import partial_result

    job = {"name": "tune/x/softmax", "kind": "tune", "loss": "softmax", "trials": 2}
    path = tmp_path / "runs" / job["name"] / "trials.json"
    path.parent.mkdir(parents=True)
    assert partial_result(job, tmp_path) is None
    trials = [{"number": n, "params": {"lr": lr}, "val_knn_accuracy": v} for n, lr, v in
              ((0, 1e-3, 0.8), (1, 2e-3, 0.9), (2, 3e-3, 0.95))]  # fmt: skip
    path.write_text(json.dumps({"job": job, "trials": trials}))
    got = partial_result(job, tmp_path)["result"]
    assert got["partial"] and got["best_params"] == {"lr": 2e-3} and len(got["trials"]) == 2  # capped
    path.write_text(json.dumps({"job": {**job, "trials": 3}, "trials": trials}))
    assert partial_result(job, tmp_path) is None  # another job's trials are never told
