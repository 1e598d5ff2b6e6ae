"""Build the study's jobs from a :class:`StudyPlan`, run them (in parallel worker processes,
one thread each), and write the tables, the figure, the claim verdicts and ``RESULTS.md``.

Output layout::

    OUT/plan.json                  the plan (every knob of the run)
    OUT/runs/<section>/.../        job.json (the run's config) + result.json (+ train/ run dir)
    OUT/tables/*.md                one Markdown table per section
    OUT/figures/alpha_s.png        TAR@FAR against the scale s per loss family
    OUT/claims.json, OUT/RESULTS.md
"""

from __future__ import annotations

import json
import multiprocessing
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from marginkit.study.claims import verdicts
from marginkit.study.jobs import FARS, run_job
from marginkit.study.plan import StudyPlan, study_plan
from marginkit.study.tables import markdown_table, stat
from marginkit.train.progress import RunsProgress

__all__ = ["TABLES", "build_jobs", "run_study"]

#: Table files every study writes (the CI test checks them).
TABLES = ("knn", "verification", "alpha_s", "throughput", "mep", "retrieval", "transfer")
BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_qmargin.py"


def _setting(data: str, per_class: int | None) -> str:
    return f"{data}-{per_class}pc" if per_class else f"{data}-full"


def _identity_variants(plan: StudyPlan) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, loss, loss_options) of section 2, plus the pair losses for section 5."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for s in plan.qmargin_scales:
        out.append((f"ArcFace s={s:g}", "arcface", {"scale": s}))
        out.append((f"CosFace s={s:g}", "cosface", {"scale": s}))
        for a in plan.qmargin_alphas:
            out.append((f"Q-Margin α={a:g} s={s:g}", "qmargin", {"alpha": a, "scale": s}))
    out.append(("Entmax α=1.25 s=16", "entmax", {"alpha": 1.25, "scale": 16.0}))
    out.append(("Sparsemax s=16", "sparsemax", {"scale": 16.0}))
    out.append(("Circle (pairs)", "circle", {}))
    out.append(("Triplet (pairs)", "triplet", {}))
    return out


def build_jobs(plan: StudyPlan) -> list[dict[str, Any]]:
    """Every job of the study (the slowest first, for load balance)."""
    jobs: list[dict[str, Any]] = [
        {
            "name": "throughput/bench_qmargin",
            "kind": "bench",
            "script": str(BENCH),
            "args": list(plan.bench_args),
        }
    ]
    for data, pc, seeds in plan.knn_settings:
        for loss in plan.knn_losses:
            for seed in range(seeds):
                jobs.append(
                    {
                        "name": f"knn/{_setting(data, pc)}/{loss}/seed{seed}",
                        "kind": "knn",
                        "data": data,
                        "per_class": pc,
                        "seed": seed,
                        "loss": loss,
                        "steps": plan.steps,
                        "k": plan.k,
                    }
                )
    for label, loss, opts in _identity_variants(plan):
        for seed in range(plan.identity_seeds):
            slug = (
                label.replace(" ", "_").replace("=", "").replace("α", "a").replace("(", "").replace(")", "")
            )
            jobs.append(
                {
                    "name": f"identities/{slug}/seed{seed}",
                    "kind": "identities",
                    "data": "identities",
                    "label": label,
                    "seed": seed,
                    "loss": loss,
                    "loss_options": opts,
                    "data_options": dict(plan.identity_options),
                    "steps": plan.identity_steps,
                }
            )
    for data, pc, seeds in plan.mep_settings:
        for objective in ("ce", "hinge", "mep"):
            for seed in range(seeds):
                jobs.append(
                    {
                        "name": f"mep/{_setting(data, pc)}/{objective}/seed{seed}",
                        "kind": "margin",
                        "data": data,
                        "per_class": pc,
                        "seed": seed,
                        "objective": objective,
                        "scale": plan.mep_scale,
                        "margin": plan.mep_margin,
                        "steps": plan.steps,
                    }
                )
    for data in plan.transfer_data:
        for loss in plan.transfer_losses:
            for seed in range(plan.transfer_seeds):
                jobs.append(
                    {
                        "name": f"transfer/{data}/{loss}/seed{seed}",
                        "kind": "transfer",
                        "data": data,
                        "seed": seed,
                        "loss": loss,
                        "steps": plan.steps,
                        "refs": list(plan.transfer_refs),
                        "draws": plan.transfer_draws,
                        "k": plan.k,
                    }
                )

    kinds = ("margin", "transfer", "identities", "knn")

    def priority(job: dict[str, Any]) -> tuple[float, int, bool]:
        # seed-major: every cell gets its first seed before any cell gets its second, so an
        # interrupted study (see collect_only) still covers every table; the long throughput
        # benchmark starts once every seed-0 run is done.
        if job["kind"] == "bench":
            return (0.5, 0, False)
        return (float(job["seed"]), kinds.index(job["kind"]), job.get("per_class") is not None)

    return sorted(jobs, key=priority)


def _run_all(
    jobs: list[dict[str, Any]], out: Path, workers: int, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    progress = RunsProgress({job["name"]: (1, None) for job in jobs}, desc="study", unit="jobs", write=log)

    def record(res: dict[str, Any]) -> None:
        results.append(res)
        name = res["job"]["name"]
        progress.finish(name, f"{name} {res['seconds']:.1f}s", reused=bool(res.get("reused")))

    if workers <= 1:
        for job in progress.wrap(jobs):
            record(run_job(job, str(out)))
        return results
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(run_job, job, str(out)): job for job in jobs}
        for fut in progress.wrap(as_completed(futures)):
            record(fut.result())
    return results


# ---------------------------------------------------------------------------- tables
def _by(results: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in results if r["job"]["kind"] == kind]


def _cell(rows: list[dict[str, Any]], key: str, scale: float = 100.0, digits: int = 1) -> str:
    return stat(r["result"].get(key) for r in rows).fmt(scale, digits)


def _knn_tables(plan: StudyPlan, results: list[dict[str, Any]]) -> tuple[str, str, dict[str, Any]]:
    knn = _by(results, "knn")
    summary: dict[str, Any] = {}
    rows, rrows = [], []
    for data, pc, seeds in plan.knn_settings:
        setting = _setting(data, pc)
        here = [r for r in knn if r["job"]["data"] == data and r["job"].get("per_class") == pc]
        per_loss = {loss: [r for r in here if r["job"]["loss"] == loss] for loss in plan.knn_losses}
        ntrain = next((r["result"]["num_train"] for r in here), "?")
        row = [f"{setting} (n={ntrain}, {seeds} seeds)", _cell(per_loss["softmax"], "head_accuracy")]
        row += [_cell(per_loss[loss], "knn_accuracy") for loss in plan.knn_losses]
        rows.append(row)
        summary[setting] = {
            "softmax_head": stat(r["result"]["head_accuracy"] for r in per_loss["softmax"]).__dict__,
            **{
                loss: stat(r["result"]["knn_accuracy"] for r in per_loss[loss]).__dict__
                for loss in plan.knn_losses
            },
            **{
                f"{loss}_map_at_r": stat(r["result"]["map_at_r"] for r in per_loss[loss]).__dict__
                for loss in ("circle", "triplet")
            },
        }
        rrows.append(
            [setting]
            + [
                _cell(per_loss[loss], key)
                for key in ("map_at_r", "precision_at_1")
                for loss in ("circle", "triplet")
            ]
        )
    header = ["data (train size)", "softmax head"] + [f"K-NN {loss}" for loss in plan.knn_losses]
    knn_md = markdown_table(header, rows)
    ident = _by(results, "identities")
    for label in ("Circle (pairs)", "Triplet (pairs)"):
        summary.setdefault("identities", {})[label] = stat(
            r["result"]["map_at_r"] for r in ident if r["job"]["label"] == label
        ).__dict__
    irow = ["identities (open set, test identities)"]
    for key in ("map_at_r", "precision_at_1"):
        for label in ("Circle (pairs)", "Triplet (pairs)"):
            irow.append(_cell([r for r in ident if r["job"]["label"] == label], key))
    rrows.append(irow)
    ret_md = markdown_table(["data", "MAP@R Circle", "MAP@R triplet", "P@1 Circle", "P@1 triplet"], rrows)
    return knn_md, ret_md, summary


def _verification_tables(
    plan: StudyPlan, results: list[dict[str, Any]]
) -> tuple[str, str, dict[str, Any], Any]:
    ident = [r for r in _by(results, "identities") if r["job"]["loss"] not in ("circle", "triplet")]
    labels = [label for label, loss, _ in _identity_variants(plan) if loss not in ("circle", "triplet")]
    rows, summary = [], {}
    for label in labels:
        here = [r for r in ident if r["job"]["label"] == label]
        tars = {f: stat(r["result"]["tar_at_far"].get(str(f)) for r in here) for f in FARS}
        eer = stat(r["result"]["eer"] for r in here)
        act = stat(r["result"].get("active_class_fraction") for r in here)
        rows.append(
            [label]
            + [tars[f].fmt() for f in FARS]
            + [eer.fmt(100, 2), act.fmt(100, 1) if act.mean is not None else "—"]
        )
        summary[label] = {
            "tar": {str(f): tars[f].__dict__ for f in FARS},
            "eer": eer.__dict__,
            "active": act.__dict__,
        }
    n_imp = sorted({r["result"]["num_impostor_pairs"] for r in ident})
    header = ["loss"] + [f"TAR@FAR={f:g} (%)" for f in FARS] + ["EER (%)", "active classes (%)"]
    ver_md = markdown_table(header, rows) + (
        f"\nImpostor pairs per seed: {n_imp}; a FAR below 1/pairs is reported as 'not measurable'. "
        "Active classes: mean support of the loss's posterior on the training rows, "
        "as a share of the training identities.\n"
    )
    # alpha–s coupling: TAR@1e-3 and 1e-4 per family and scale
    families = ["ArcFace", "CosFace"] + [f"Q-Margin α={a:g}" for a in plan.qmargin_alphas]
    arows = []
    for fam in families:
        row = [fam]
        for s in plan.qmargin_scales:
            label = f"{fam} s={s:g}"
            row += [
                summary[label]["tar"][str(1e-3)]["mean"] * 100
                if summary[label]["tar"][str(1e-3)]["mean"] is not None
                else None,
            ]
        arows.append(row)
    a_rows = [
        [fam]
        + [
            stat(
                r["result"]["tar_at_far"].get(str(f)) for r in ident if r["job"]["label"] == f"{fam} s={s:g}"
            ).fmt()
            for s in plan.qmargin_scales
            for f in (1e-3, 1e-4)
        ]
        for fam in families
    ]
    a_header = ["family"] + [f"s={s:g} TAR@{f:g}" for s in plan.qmargin_scales for f in (1e-3, 1e-4)]
    return ver_md, markdown_table(a_header, a_rows), summary, (families, arows)


def _figure(plan: StudyPlan, fig_data: Any, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dev dependency
        return False
    _families, rows = fig_data
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for row in rows:
        ax.plot(
            plan.qmargin_scales,
            [v if v is not None else float("nan") for v in row[1:]],
            marker="o",
            label=row[0],
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("scale s")
    ax.set_ylabel("TAR @ FAR=1e-3 (%)")
    ax.set_title("identities: the α–s coupling")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _mep_table(plan: StudyPlan, results: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    margin = _by(results, "margin")
    rows, summary = [], {}
    keys = (
        "test_accuracy",
        "knn_accuracy",
        "train_accuracy",
        "test_margin_fraction",
        "train_margin_fraction",
        "train_zero_mep_grad_fraction",
    )
    names = {"ce": "cross-entropy", "hinge": "Crammer–Singer hinge", "mep": "MEP (L2)"}
    for data, pc, seeds in plan.mep_settings:
        setting = _setting(data, pc)
        for obj in ("ce", "hinge", "mep"):
            here = [
                r
                for r in margin
                if r["job"]["data"] == data
                and r["job"].get("per_class") == pc
                and r["job"]["objective"] == obj
            ]
            rows.append([f"{setting} {names[obj]} ({seeds} seeds)"] + [_cell(here, k) for k in keys])
            summary.setdefault(setting, {})[obj] = {
                k: stat(r["result"][k] for r in here).__dict__ for k in keys
            }
    header = [
        "data / objective",
        "test acc (head)",
        "test K-NN acc",
        "train acc",
        "test rows keeping margin",
        "train rows keeping margin",
        "train rows with zero MEP gradient",
    ]
    note = (
        f"\nAll three on s·cos with s = {plan.mep_scale:g}; margin m = {plan.mep_margin:g} on the scores "
        f"(= {plan.mep_margin / plan.mep_scale:g} in cosine) for the hinge, MEP and the margin columns. "
        "A row keeps the margin when s·(c_y − max_{j≠y} c_j) ≥ m; its MEP gradient 2(x − MEP(x)) is then "
        "exactly zero (checked as MEP(x) == x bit for bit).\n"
    )
    return markdown_table(header, rows) + note, summary


def _transfer_table(plan: StudyPlan, results: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    tr = _by(results, "transfer")
    rows, summary = [], {}
    for data in plan.transfer_data:
        here_all = [r for r in tr if r["job"]["data"] == data]
        raw = [stat(r["result"][f"raw_1nn_{n}ref"] for r in here_all) for n in plan.transfer_refs]
        rows.append([f"{data}: raw input (baseline)"] + [s.fmt() for s in raw])
        summary[data] = {"raw": {str(n): s.__dict__ for n, s in zip(plan.transfer_refs, raw, strict=True)}}
        for loss in plan.transfer_losses:
            here = [r for r in here_all if r["job"]["loss"] == loss]
            cells = [stat(r["result"][f"embedding_1nn_{n}ref"] for r in here) for n in plan.transfer_refs]
            rows.append([f"{data}: {loss} ({plan.transfer_seeds} seeds)"] + [c.fmt() for c in cells])
            summary[data][loss] = {str(n): c.__dict__ for n, c in zip(plan.transfer_refs, cells, strict=True)}
    header = ["data: embedding"] + [f"1-NN acc, {n} ref/class (%)" for n in plan.transfer_refs]
    note = (
        "\nEmbeddings trained on classes 0–4 only; queries are the test rows of classes 5–9, references "
        f"{'/'.join(map(str, plan.transfer_refs))} random training rows per unseen class "
        f"({plan.transfer_draws} draws averaged per seed), cosine 1-NN.\n"
    )
    return markdown_table(header, rows) + note, summary


def _collect(jobs: list[dict[str, Any]], out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Finished results of ``jobs`` already in ``out`` (same job dict), and the jobs without one."""
    done, missing = [], []
    for job in jobs:
        path = out / "runs" / job["name"] / "result.json"
        stored = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        if stored is not None and stored.get("job") == job:
            stored["reused"] = True
            done.append(stored)
        else:
            missing.append(job)
    return done, missing


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
    log(f"study ({plan.mode}): {len(job_list)} jobs on {jobs} worker(s)")
    missing: list[dict[str, Any]] = []
    if collect_only:
        results, missing = _collect(job_list, out)
        log(f"collected {len(results)} finished jobs, {len(missing)} missing")
    else:
        results = _run_all(job_list, out, jobs, log)

    tables: dict[str, str] = {}
    tables["knn"], tables["retrieval"], knn_summary = _knn_tables(plan, results)
    tables["verification"], tables["alpha_s"], ver_summary, fig_data = _verification_tables(plan, results)
    benches = _by(results, "bench")
    bench = benches[0]["result"] if benches else {"text": "(the throughput benchmark was not run)\n"}
    tables["throughput"] = (
        f"Output of `python benchmarks/bench_qmargin.py {' '.join(plan.bench_args)}`:\n\n" + bench["text"]
    )
    tables["mep"], mep_summary = _mep_table(plan, results)
    tables["transfer"], transfer_summary = _transfer_table(plan, results)
    tdir = out / "tables"
    tdir.mkdir(exist_ok=True)
    for name, text in tables.items():
        (tdir / f"{name}.md").write_text(text, encoding="utf-8")
    has_fig = _figure(plan, fig_data, out / "figures" / "alpha_s.png")
    summary = {
        "knn": knn_summary,
        "verification": ver_summary,
        "mep": mep_summary,
        "transfer": transfer_summary,
        "throughput_text": bench["text"],
    }
    claims = verdicts(plan, summary)
    (out / "claims.json").write_text(json.dumps(claims, indent=2) + "\n", encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    wall = time.perf_counter() - t0
    cost = _cost(results)
    cost["missing"] = _missing_text(missing)
    (out / "cost.json").write_text(json.dumps(cost, indent=2) + "\n", encoding="utf-8")
    md = _results_md(plan, tables, claims, wall, has_fig, jobs, cost)
    (out / "RESULTS.md").write_text(md, encoding="utf-8")
    log(f"study wall time: {wall:.1f} s ({wall / 60:.1f} min)")
    return {
        "wall_seconds": wall,
        "tables": sorted(tables),
        "claims": claims,
        "results_md": str(out / "RESULTS.md"),
    }


def _missing_text(missing: list[dict[str, Any]]) -> str:
    if not missing:
        return ""
    groups: dict[str, int] = {}
    for job in missing:
        key = job["name"].rsplit("/", 1)[0]
        groups[key] = groups.get(key, 0) + 1
    listing = "; ".join(f"{k} ({v} seed(s))" for k, v in sorted(groups.items()))
    return (
        f"**PARTIAL RESULTS: {len(missing)} job(s) of this plan did not finish and are absent from the "
        f"tables below (cells show 'not measurable' or fewer seeds than stated):** {listing}. "
        "Rerun the command to complete them (finished runs are reused).\n"
    )


def _cost(results: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, float] = {}
    for r in results:
        by_kind[r["job"]["kind"]] = by_kind.get(r["job"]["kind"], 0.0) + float(r.get("seconds", 0.0))
    return {
        "jobs": len(results),
        "reused": sum(bool(r.get("reused")) for r in results),
        "total_seconds": sum(by_kind.values()),
        "by_kind": by_kind,
        "by_kind_text": ", ".join(f"{k} {v / 60:.1f} min" for k, v in sorted(by_kind.items())),
    }


def _results_md(
    plan: StudyPlan,
    tables: dict[str, str],
    claims: list[dict[str, Any]],
    wall: float,
    has_fig: bool,
    jobs: int,
    cost: dict[str, Any],
) -> str:
    import torch

    cmd = "python benchmarks/study.py --out study_out" + (" --quick" if plan.mode == "quick" else "")
    parts = [
        "# marginkit study: the sources' claims, measured\n",
        f"Generated by `{cmd}` (mode **{plan.mode}**, {jobs} worker process(es), one torch thread each; "
        f"wall time of this invocation {wall:.0f} s = {wall / 60:.1f} min, {cost['reused']} of "
        f"{cost['jobs']} jobs reused from an earlier invocation into the same OUT; the jobs' own compute "
        f"time sums to {cost['total_seconds'] / 60:.1f} min ({cost['by_kind_text']}); "
        f"torch {torch.__version__}, Python "
        f"{platform.python_version()}, {platform.machine()}). Every cell is mean ± sample std over seeds "
        "(seed = data subset + initialisation + batch order); no augmentation. Each run's config is saved "
        "next to its result under `OUT/runs/` (`job.json`, `result.json`, the trainer's `config.yaml`). "
        f"Training budget: about {plan.steps} optimiser steps per run "
        f"({plan.identity_steps} on `identities`), AdamW lr 1e-3, cosine schedule, embedding dim 64.\n",
        cost["missing"],
        "## Verdicts\n",
        "Rules, fixed before the numbers were seen (`marginkit/study/claims.py`): a comparison is won when "
        "the mean over seeds is higher; a claim is *supported* when it wins ≥ 80 % of its comparisons, "
        "*not supported* at ≤ 20 %, *mixed* in between. MEP: brakes when ≥ 50 % of the training rows have "
        "exactly zero MEP gradient at the end, and accuracy counts as kept when within one std (sum of "
        "both stds) of cross-entropy. Throughput: supported at ≥ 0.9× ArcFace, mixed at ≥ 0.7×. "
        "Hyper-parameters are the library's registry defaults (not tuned per loss), so a loss that needs "
        "tuning is at a disadvantage; the verdicts speak for this budget and these data only.\n",
    ]
    for c in claims:
        parts.append(f"- **{c['claim']}** — *{c['verdict']}*. {c['sentence']}")
    parts.append("")
    titles = {
        "knn": "1. Small-data classification: softmax head vs K-NN on embeddings (accuracy %, k=5, cosine)",
        "verification": "2. Open-set verification on the `identities` simulation",
        "alpha_s": "2b. The α–s coupling: TAR (%) per scale s",
        "throughput": "3. Throughput: Q-Margin vs CosFace/ArcFace",
        "mep": "4. MEP: margin, accuracy, brakes (vs cross-entropy and a multi-class hinge; %)",
        "retrieval": "5. Retrieval: Circle vs triplet with P×K batches (test split, %)",
        "transfer": "6. Transfer to unseen classes (K-NN from few references)",
    }
    for name in TABLES:
        parts.append(f"## {titles[name]}\n")
        parts.append(tables[name])
        if name == "alpha_s" and has_fig:
            parts.append("![alpha-s](figures/alpha_s.png)\n")
    return "\n".join(parts) + "\n"
