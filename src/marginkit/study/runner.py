"""Build the study's jobs from a :class:`StudyPlan`, run them (in parallel worker processes,
one thread each), and write the tables, the claim verdicts and ``RESULTS.md``.

Output layout::

    OUT/plan.json                  the plan (every knob of the run)
    OUT/runs/<section>/.../        job.json (the run's config) + result.json (+ train/ run dir,
                                   tune/*: trials.json with every Optuna trial)
    OUT/tables/*.md                one Markdown table per section
    OUT/claims.json, OUT/comparisons.json, OUT/cost.json, OUT/RESULTS.md
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from marginkit._lazy import require
from marginkit.study.claims import verdicts
from marginkit.study.jobs import run_job, stored_result
from marginkit.study.plan import PEER_TRAIN_OPTIONS, StudyPlan, identity_rows, study_plan
from marginkit.study.sections import TABLES, build_tables, results_markdown
from marginkit.study.tuning import partial_result
from marginkit.train.progress import RunsProgress

__all__ = ["TABLES", "build_jobs", "face_jobs", "run_study", "speaker_jobs"]


def setting_name(data: str, per_class: int | None) -> str:
    return f"{data}-{per_class}pc" if per_class else f"{data}-full"


def _slug(text: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-._" else "_" for c in text)
    return "_".join(part for part in keep.split("_") if part)


def build_jobs(plan: StudyPlan) -> list[dict[str, Any]]:
    """Every job of the study, in the order they are started (see ``priority``)."""
    from marginkit.study.tuning import PAPER

    seeds = range(plan.seeds)
    opts = dict(plan.train_options)
    jobs: list[dict[str, Any]] = []
    for loss in plan.tune_losses:
        jobs.append(
            {
                "name": f"tune/{setting_name(plan.tune_data, plan.tune_per_class)}/{loss}",
                "kind": "tune",
                "data": plan.tune_data,
                "per_class": plan.tune_per_class,
                "val_fraction": plan.tune_val_fraction,
                "loss": loss,
                "trials": plan.trials,
                "startup_trials": plan.startup_trials,
                "dev_seed": plan.dev_seed,
                "sampler_seed": plan.sampler_seed,
                "train_options": opts,
            }
        )
    for loss in plan.tune_losses:
        jobs.append(
            {
                "name": f"tune_defaults/{setting_name(plan.tune_data, plan.tune_per_class)}/{loss}",
                "kind": "tune_defaults",
                "data": plan.tune_data,
                "per_class": plan.tune_per_class,
                "val_fraction": plan.tune_val_fraction,
                "loss": loss,
                "dev_seed": plan.dev_seed,
                "train_options": opts,
            }
        )
    for seed in seeds:
        for loss in plan.peer_losses:
            jobs.append(
                {
                    "name": f"knn/{setting_name(plan.tune_data, plan.tune_per_class)}/{loss}/seed{seed}",
                    "kind": "knn",
                    "data": plan.tune_data,
                    "per_class": plan.tune_per_class,
                    "seed": seed,
                    "loss": loss,
                    "row": "peer",
                    "train_options": {**opts, **PEER_TRAIN_OPTIONS.get(loss, {})},
                }
            )
        for data, pc in plan.knn_settings:
            setting = setting_name(data, pc)
            jobs.append(
                {
                    "name": f"baseline/{setting}/seed{seed}",
                    "kind": "baseline",
                    "data": data,
                    "per_class": pc,
                    "seed": seed,
                    "k": plan.k,
                }
            )
            for loss in plan.knn_losses:
                jobs.append(
                    {
                        "name": f"knn/{setting}/{loss}/seed{seed}",
                        "kind": "knn",
                        "data": data,
                        "per_class": pc,
                        "seed": seed,
                        "loss": loss,
                        "row": "defaults",
                        "train_options": opts,
                    }
                )
        for data, pc in plan.paper_settings:
            for loss in plan.knn_losses:
                jobs.append(
                    {
                        "name": f"paper/{setting_name(data, pc)}/{loss}/seed{seed}",
                        "kind": "knn",
                        "data": data,
                        "per_class": pc,
                        "seed": seed,
                        "loss": loss,
                        "row": "paper",
                        "loss_options": PAPER[loss][1],
                        "train_options": opts,
                    }
                )
        for data, pc in plan.disjoint_settings:
            for loss in ("raw", *plan.knn_losses):
                jobs.append(
                    {
                        "name": f"disjoint/{setting_name(data, pc)}/{loss}/seed{seed}",
                        "kind": "disjoint",
                        "data": data,
                        "data_options": {"split": "halves"},
                        "per_class": pc,
                        "seed": seed,
                        "loss": loss,
                        "train_options": opts,
                    }
                )
        for label, loss, loss_opts in identity_rows():
            jobs.append(
                {
                    "name": f"identities/{_slug(label)}/seed{seed}",
                    "kind": "identities",
                    "data": "identities",
                    "label": label,
                    "seed": seed,
                    "loss": loss,
                    "loss_options": loss_opts,
                    "data_options": dict(plan.identity_options),
                    "train_options": opts,
                }
            )
        for data, pc in plan.margin_settings:
            for objective in ("ce", "hinge", "mep"):
                jobs.append(
                    {
                        "name": f"margin/{setting_name(data, pc)}/{objective}/seed{seed}",
                        "kind": "margin",
                        "data": data,
                        "per_class": pc,
                        "seed": seed,
                        "objective": objective,
                        "scale": plan.margin_scale,
                        "margin": plan.margin_margin,
                        "epochs": plan.margin_epochs,
                        "lr": plan.margin_lr,
                        "weight_decay": 5e-4,
                    }
                )
    jobs.extend(face_jobs(plan))
    jobs.extend(speaker_jobs(plan))
    jobs.append({"name": "throughput/e2e", "kind": "e2e", **plan.e2e})
    target = (plan.tune_data, plan.tune_per_class)

    def priority(job: dict[str, Any]) -> int:
        # tuning, then the target setting's defaults and baselines (every seed), the
        # throughput job, then everything else seed-major (an interrupted study still covers
        # every table with its first seeds)
        if job["kind"] in ("tune", "tune_defaults"):
            return 0
        at_target = (job.get("data"), job.get("per_class")) == target
        if job["kind"] in ("knn", "baseline") and at_target and job.get("row", "defaults") == "defaults":
            return 1
        if job["kind"] == "e2e":
            return 2
        return 3 + job.get("seed", 0)  # the faces baselines have no seed: with seed 0

    return sorted(jobs, key=priority)  # stable: the order above within a tier


def face_jobs(plan: StudyPlan) -> list[dict[str, Any]]:
    """The real-faces section: leave-people-out folds of the Yale faces (``split=classes``,
    ``folds``), the baselines once per fold, every loss per fold and seed; none when the faces
    are absent (the section says so)."""
    if not Path(plan.faces).is_dir():
        return []
    data, folds = f"folder:{plan.faces}", int(plan.faces_options["folds"])
    opts = dict(plan.train_options)
    jobs: list[dict[str, Any]] = []
    for fold in range(folds):
        options = {**plan.faces_options, "split": "classes", "fold": fold, "split_seed": 0}
        base = {"data": data, "data_options": options, "fold": fold}
        jobs.append({"name": f"faces/fold{fold}/baselines", "kind": "faces_baseline", **base, "k": plan.k})
        for seed in range(plan.faces_seeds):
            rows = [(loss, False) for loss in (*plan.face_losses, *plan.face_peers)]
            rows += [(loss, True) for loss in plan.face_losses]
            for loss, augmented in rows:
                train = {**opts, **({"augment": plan.face_augment} if augmented else {})}
                jobs.append(
                    {
                        "name": f"faces/fold{fold}/{loss}{'-augment' if augmented else ''}/seed{seed}",
                        "kind": "faces", **base, "seed": seed, "loss": loss, "augment": augmented,
                        "train_options": train,
                    }
                )  # fmt: skip
    return jobs


def speaker_jobs(plan: StudyPlan) -> list[dict[str, Any]]:
    """The speaker section: synthetic espeak-ng speakers (:func:`~marginkit.study.plan.speaker_dir`),
    the speakers of its trial list held out of training (``split=classes``, ``test_classes``),
    each row of :func:`~marginkit.study.plan.speaker_rows` per seed, and the pretrained GE2E
    encoder once; none when the folder or its trial list is absent (the section says so)."""
    from marginkit.audio.trials import read_trials
    from marginkit.study.plan import speaker_dir, speaker_rows

    root = speaker_dir(plan)
    trials = root / "trials.txt"
    if not trials.is_file():
        return []
    tested = sorted({str(u).split("/", 1)[0] for u in read_trials(trials).utterances})
    base = {
        "data": f"audio:{root}", "trials": str(trials),
        "data_options": {"split": "classes", "test_classes": tested, "split_seed": 0},
    }  # fmt: skip
    jobs: list[dict[str, Any]] = [{"name": "speakers/pretrained_ge2e", "kind": "speakers_baseline", **base}]
    for seed in range(plan.speaker_seeds):
        for label, loss, options in speaker_rows():
            jobs.append(
                {
                    "name": f"speakers/{loss}/seed{seed}", "kind": "speakers", **base, "seed": seed,
                    "loss": loss, "loss_options": options, "label": label,
                    "train_options": {**plan.speaker_train, "trials": str(trials)},
                }
            )  # fmt: skip
    return jobs


def cost_group(job: dict[str, Any]) -> tuple[Any, ...]:
    """What a job's cost depends on, most specific last: the progress ETA's groups.

    The kinds cost orders of magnitude apart (a tuning job trains dozens of models, a baseline
    none), and within a kind the data set and the loss set the cost.
    """
    return (job["kind"], job.get("data"), job.get("per_class"), job.get("loss"), job.get("label"),
            job.get("augment"))  # fmt: skip


def _run_all(
    jobs: list[dict[str, Any]], out: Path, workers: int, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    progress = RunsProgress(
        {job["name"]: (1, None) for job in jobs},
        desc="study",
        unit="jobs",
        write=log,
        groups={job["name"]: cost_group(job) for job in jobs},
        workers=workers,
    )

    def record(res: dict[str, Any]) -> None:
        results.append(res)
        name = res["job"]["name"]
        tag = (
            "reused"
            if res.get("reused")
            else f"{res['seconds']:.1f}s wall, {res.get('cpu_seconds', 0):.1f}s cpu"
        )
        progress.finish(name, f"{name} {tag}", reused=bool(res.get("reused")), seconds=res.get("seconds"))

    if workers <= 1:
        for job in progress.wrap(jobs):
            record(run_job(job, str(out)))
        return results
    with job_pool(workers) as pool:
        futures = {pool.submit(run_job, job, str(out)): job for job in jobs}
        for fut in progress.wrap(as_completed(futures)):
            record(fut.result())
    return results


def job_pool(workers: int) -> ProcessPoolExecutor:
    """The study's job processes: spawned (a fresh interpreter, one thread each), and each starts
    its own children the platform's default way (:func:`_platform_start_method`)."""
    ctx = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_platform_start_method)


def _platform_start_method() -> None:
    """In a job process: start children (a lazy source's DataLoader workers) the platform's
    default way. A process started by ``spawn`` inherits ``spawn`` as its default, and each
    spawned DataLoader worker then imports torch and marginkit again before its first sample
    (seconds per loader, against milliseconds for a fork)."""
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)


# ---------------------------------------------------------------------------- collection
class Results:
    """The finished jobs, indexed for the tables: ``per_seed(kind, **match)(key) -> {seed: value}``."""

    def __init__(self, results: list[dict[str, Any]]) -> None:
        self.all = results

    def select(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [
            r
            for r in self.all
            if r["job"]["kind"] == kind and all(r["job"].get(k) == v for k, v in match.items())
        ]

    def per_seed_free(self, kind: str, path: str, **match: Any) -> float | None:
        """``result[path]`` of the one job of a kind without seeds (None if not finished)."""
        values = [v for v in self._values(kind, path, **match) if v is not None]
        return values[0] if values else None

    def _values(self, kind: str, path: str, **match: Any) -> list[float | None]:
        out: list[float | None] = []
        for r in self.select(kind, **match):
            value: Any = r["result"]
            for part in path.split("/"):
                value = value.get(part) if isinstance(value, dict) else None
            out.append(None if value is None else float(value))
        return out

    def per_seed(self, kind: str, path: str, **match: Any) -> dict[int, float | None]:
        """``{seed: result[path]}``; ``path`` is ``/``-separated (``verification/eer``): keys hold dots."""
        found = self.select(kind, **match)
        values = self._values(kind, path, **match)
        return {int(r["job"]["seed"]): v for r, v in zip(found, values, strict=True)}


def _collect(jobs: list[dict[str, Any]], out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Finished results of ``jobs`` already in ``out`` (same job dict), and the jobs without one."""
    done, missing = [], []
    for job in jobs:
        stored = stored_result(job, out)
        (done if stored is not None else missing).append(stored if stored is not None else job)
    return done, missing


def _load_average() -> str:
    try:
        return ", ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "n/a"


def run_study(
    out: str | Path,
    *,
    quick: bool = False,
    jobs: int = 2,
    log: Callable[[str], None] | None = None,
    collect_only: bool = False,
) -> dict[str, Any]:
    """Run the study into ``out``; returns ``{"wall_seconds", "tables", "claims", "results_md"}``.

    With ``collect_only`` nothing is trained: the tables are written from the finished runs
    already in ``out`` (an interrupted study), and RESULTS.md lists what is missing.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = study_plan(quick, jobs)
    (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2) + "\n", encoding="utf-8")
    job_list = build_jobs(plan)
    if not collect_only and any(job["kind"] == "tune" for job in job_list):
        require("optuna", extra="study", purpose="the study's tuning")  # now, not after hours of jobs
    load_before = _load_average()
    log(f"study ({plan.mode}): {len(job_list)} jobs on {jobs} worker(s); load average {load_before}")
    missing: list[dict[str, Any]] = []
    if collect_only:
        results, missing = _collect(job_list, out)
        log(f"collected {len(results)} finished jobs, {len(missing)} missing")
    else:
        results = _run_all(job_list, out, jobs, log)
    done = {r["job"]["name"] for r in results}
    for job in job_list:  # an unfinished tuning job still shows the trials it finished
        if job["kind"] == "tune" and job["name"] not in done:
            partial = partial_result(job, out)
            if partial is not None:
                results.append(partial)
    res = Results(results)
    tables, facts = build_tables(plan, res)
    tdir = out / "tables"
    tdir.mkdir(exist_ok=True)
    for name in TABLES:
        (tdir / f"{name}.md").write_text(tables[name], encoding="utf-8")
    claims, comparisons = verdicts(plan, res, facts)
    (out / "claims.json").write_text(json.dumps(claims, indent=2) + "\n", encoding="utf-8")
    (out / "comparisons.json").write_text(json.dumps(comparisons, indent=2) + "\n", encoding="utf-8")
    wall = time.perf_counter() - t0
    cost = _cost(results, missing)
    cost.update(
        {
            "wall_seconds": round(wall, 1),
            "load_average_start": load_before,
            "load_average_end": _load_average(),
        }
    )
    (out / "cost.json").write_text(json.dumps(cost, indent=2) + "\n", encoding="utf-8")
    md = results_markdown(plan, tables, claims, cost, jobs)
    (out / "RESULTS.md").write_text(md, encoding="utf-8")
    log(f"study wall time: {wall:.1f} s ({wall / 60:.1f} min)")
    return {
        "wall_seconds": wall,
        "tables": list(TABLES),
        "claims": claims,
        "results_md": str(out / "RESULTS.md"),
    }


def _computed_on(results: list[dict[str, Any]]) -> dict[str, int]:
    """How many of the results were computed on each CPU (results stored before it was
    recorded: ``"not recorded"``)."""
    return dict(Counter(str(r.get("computed_on", "not recorded")) for r in results).most_common())


def _cost(results: list[dict[str, Any]], missing: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, float] = {}
    cpu_by_kind: dict[str, float] = {}
    for r in results:
        kind = r["job"]["kind"]
        by_kind[kind] = by_kind.get(kind, 0.0) + float(r.get("seconds", 0.0))
        cpu_by_kind[kind] = cpu_by_kind.get(kind, 0.0) + float(r.get("cpu_seconds", 0.0))
    groups: dict[str, int] = {}
    for job in missing:
        key = job["name"].rsplit("/", 1)[0]
        groups[key] = groups.get(key, 0) + 1
    return {
        "jobs": len(results),
        "reused": sum(bool(r.get("reused")) for r in results),
        "job_wall_seconds": round(sum(by_kind.values()), 1),
        "job_cpu_seconds": round(sum(cpu_by_kind.values()), 1),
        "cpu_by_kind": {k: round(v, 1) for k, v in sorted(cpu_by_kind.items())},
        "missing": len(missing),
        "missing_groups": groups,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "computed_on": _computed_on(results),
    }
