"""The study's tables (one per section) and ``RESULTS.md``, from the finished jobs."""

from __future__ import annotations

from typing import Any

from marginkit.study.jobs import FARS, PRECISIONS
from marginkit.study.plan import StudyPlan, identity_rows
from marginkit.study.stats import RULE_Z, difference_se, tuned_beats_defaults
from marginkit.study.tables import markdown_table, stat

__all__ = ["TABLES", "build_tables", "results_markdown"]

TITLES = {
    "tuning": "1. Fair tuning: the same TPE budget per loss (development draw, validation from training)",
    "target": "2. The target: defaults on the real MNIST sample, 10 training images per class",
    "knn": "3. Small-data K-NN classification, defaults, no augmentation (test accuracy %, k = 5, cosine)",
    "paper": "4. Defaults vs each loss's published settings (mnist-sample, 10 per class; K-NN accuracy %)",
    "peers": "5. The peers' losses at their defaults on the target setting (K-NN accuracy %)",
    "disjoint": "6. Class-disjoint retrieval, open-set verification and identification (half the classes)",
    "faces": "7. Real faces of people never seen in training: Yale, leave-people-out folds",
    "speakers": "7b. Speakers never heard in training: synthetic espeak-ng voices, a trial list",
    "verification": "8. Open-set verification and identification at low FAR: the `identities` simulation",
    "precision": "9. Margins under low precision: fake-quantised weights (MEP vs cross-entropy vs hinge)",
    "throughput": "10. Throughput: training step, backbone + head + loss and head + loss alone",
}


#: Table files every study writes, in RESULTS.md order (the CI test checks them).
TABLES = tuple(TITLES)


def _setting(data: str, pc: int | None) -> str:
    return f"{data}-{pc}pc" if pc else f"{data}-full"


def _fmt(values: dict[int, float | None], scale: float = 100.0, digits: int = 1) -> str:
    return stat(values.values()).fmt(scale, digits)


def _mean(values: dict[int, float | None]) -> float | None:
    return stat(values.values()).mean


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _tuning(plan: StudyPlan, res: Any) -> tuple[str, dict[str, Any]]:
    rows, facts = [], {}
    for loss in plan.tune_losses:
        found = res.select("tune", loss=loss)
        ref = res.per_seed_free("tune_defaults", "val_knn_accuracy", loss=loss)
        n_val = res.per_seed_free("tune_defaults", "num_val", loss=loss)
        at_defaults = f"{100 * ref:.1f}" if ref is not None else "not run"
        if not found:
            rows.append([loss, "not run", at_defaults, "", "", "", ""])
            continue
        r = found[0]["result"]
        verdict = "—"
        if ref is not None and n_val and not r.get("partial"):
            adopt = tuned_beats_defaults(r["best_value"], ref, int(n_val))
            verdict = "tuned better: move the default" if adopt else "keep the defaults"
        params = ", ".join(
            f"{k.removeprefix('loss_options.')}={_short(v)}" for k, v in r["best_params"].items()
        )
        values = [t["val_knn_accuracy"] for t in r["trials"]]
        rows.append(
            [
                loss,
                f"{100 * r['best_value']:.1f}",
                at_defaults,
                f"{100 * min(values):.1f}–{100 * max(values):.1f}",
                f"{len(values)} of {plan.trials}" + (" (unfinished)" if r.get("partial") else ""),
                verdict,
                params,
            ]
        )
        facts[loss] = r
    setting = _setting(plan.tune_data, plan.tune_per_class)
    note = (
        f"\nSetting: {setting}, development seed {plan.dev_seed} (never an evaluation seed); validation = "
        f"{plan.tune_val_fraction:g} of each class of the training pool, disjoint from the training subset "
        f"and from the test split; score = K-NN accuracy (k = {plan.k}, cosine) of the final weights. "
        f"{plan.trials} trials per loss, Optuna TPE (multivariate, seed {plan.sampler_seed}, "
        f"{plan.startup_trials} random start-up trials). Every trial: "
        f"`OUT/runs/tune/{setting}/LOSS/trials.json`. "
        "Search spaces: `marginkit/study/tuning.py` (lr, weight decay, epochs, and each loss's "
        "own options). 'At the defaults': the library's defaults (`compare` with no options) trained "
        "and scored the same way on the same draw. Verdict (`marginkit.study.stats.tuned_beats_defaults`): "
        "a default moves only when the best trial beats it by more than 1.96 "
        "standard errors of a difference of two proportions on the validation split "
        f"({_val_se(res)}); the best of several noisy trials is biased upwards, and this is one draw.\n"
    )
    header = ["loss", "best val K-NN acc (%)", "at the defaults (%)", "range over trials", "trials",
              "verdict", "best parameters"]  # fmt: skip
    return markdown_table(header, rows) + note, facts


def _val_se(res: Any) -> str:
    """The standard error of a difference of two validation accuracies near 90 %, and the rule's bar."""
    n = next((r["result"].get("num_val") for r in res.select("tune_defaults")), None)
    if not n:
        return "n not known"
    se = 100 * difference_se(0.9, 0.9, n)
    bar = RULE_Z * se
    return f"n = {n}: one standard error is about {se:.1f} points near 90 %, so the bar about {bar:.1f}"


def _baselines(res: Any, data: str, pc: int | None) -> dict[str, dict[int, float | None]]:
    return {
        key: res.per_seed("baseline", key, data=data, per_class=pc)
        for key in ("raw_1nn_l2", "raw_knn_cosine", "logistic_regression")
    }


def _knn(plan: StudyPlan, res: Any) -> str:
    rows = []
    for data, pc in plan.knn_settings:
        base = _baselines(res, data, pc)
        head = res.per_seed("knn", "head_accuracy", data=data, per_class=pc, loss="softmax", row="defaults")
        ntrain = next(
            (r["result"]["num_train"] for r in res.select("baseline", data=data, per_class=pc)), "?"
        )
        row = [f"{_setting(data, pc)} (n={ntrain})"] + [_fmt(base[k]) for k in base] + [_fmt(head)]
        row += [
            _fmt(res.per_seed("knn", "knn_accuracy", data=data, per_class=pc, loss=loss, row="defaults"))
            for loss in plan.knn_losses
        ]
        rows.append(row)
    header = [
        "data (train size)",
        "raw 1-NN (L2)",
        f"raw {plan.k}-NN (cos)",
        "logistic regr.",
        "softmax head",
    ]
    header += [f"K-NN {loss}" for loss in plan.knn_losses]
    note = (
        f"\nMean ± std over {plan.seeds} seeds (seed = training subset + initialisation + batch order; "
        "the test split is fixed). Every loss at the library's defaults (`marginkit compare` with no options "
        "on a data set of this size: no validation split below 10 per class, the last checkpoint, "
        "`epochs: auto`); baselines on the same subsets and inputs. japanese-vowels: 12 LPC cepstra "
        "resampled to 16 frames, `cnn1d`; breast_cancer: standardised features, `mlp`.\n"
    )
    return markdown_table(header, rows) + note


def _target(plan: StudyPlan, res: Any, facts: dict[str, Any]) -> str:
    data, pc = plan.tune_data, plan.tune_per_class
    raw = res.per_seed("baseline", "raw_1nn_l2", data=data, per_class=pc)
    per_loss = {
        loss: res.per_seed("knn", "knn_accuracy", data=data, per_class=pc, loss=loss, row="defaults")
        for loss in plan.knn_losses
    }
    means = {k: _mean(v) for k, v in per_loss.items() if _mean(v) is not None}
    raw_mean = _mean(raw)
    best = max(means, key=lambda k: means[k]) if means else None
    facts["target"] = {"raw": raw_mean, "means": means, "best": best}
    rows = [["raw-pixel 1-NN (L2)", _fmt(raw), "—"]]
    for loss, values in per_loss.items():
        rows.append([loss, _fmt(values), "best" if loss == best else ""])
    checks = []
    if best is not None and raw_mean is not None:
        checks.append(
            f"best loss ≥ 85.0 %: {best} {100 * means[best]:.1f} % → "
            + ("met" if means[best] >= 0.85 else "NOT met")
        )
        for loss in ("qmargin", "local_triplet"):
            if loss in means:
                ok = means[loss] >= raw_mean + 0.08
                checks.append(
                    f"{loss} ≥ raw 1-NN + 8 pts ({100 * (raw_mean + 0.08):.1f} %): {100 * means[loss]:.1f} % "
                    f"→ {'met' if ok else 'NOT met'}"
                )
    note = (
        "\n"
        + ("; ".join(checks) if checks else "not measured")
        + (". Means over the study's seeds; the paired intervals are in the verdicts.\n")
    )
    return markdown_table([f"{_setting(data, pc)}", "K-NN accuracy (%)", ""], rows) + note


def _paper(plan: StudyPlan, res: Any) -> str:
    from marginkit.study.stats import compare
    from marginkit.study.tuning import PAPER

    rows = []
    for data, pc in plan.paper_settings:
        for loss in plan.knn_losses:
            d = res.per_seed("knn", "knn_accuracy", data=data, per_class=pc, loss=loss, row="defaults")
            p = res.per_seed("knn", "knn_accuracy", data=data, per_class=pc, loss=loss, row="paper")
            c = compare(loss, "defaults", d, "paper", p)
            delta = (
                "not measured"
                if c.diff is None
                else f"{100 * c.diff:+.1f} [{100 * c.lo:+.1f}, {100 * c.hi:+.1f}]"
            )
            rows.append([f"{_setting(data, pc)} {loss}", _fmt(d), _fmt(p), delta, PAPER[loss][0]])
    header = [
        "setting / loss",
        "defaults",
        "published settings",
        "Δ defaults − published (95 % CI)",
        "published",
    ]
    return (
        markdown_table(header, rows)
        + "\nSame schedule (the defaults' epochs, lr, weight decay) in both rows.\n"
    )


def _peers(plan: StudyPlan, res: Any, facts: dict[str, Any]) -> str:
    """The peers' losses against raw 1-NN and the target section's best seed loss."""
    from marginkit.study.stats import compare

    data, pc = plan.tune_data, plan.tune_per_class
    raw = res.per_seed("baseline", "raw_1nn_l2", data=data, per_class=pc)
    best = facts["target"]["best"]
    match = {"data": data, "per_class": pc, "loss": best, "row": "defaults"}
    best_values = res.per_seed("knn", "knn_accuracy", **match) if best else {}
    rows = []
    for loss in plan.peer_losses:
        v = res.per_seed("knn", "knn_accuracy", data=data, per_class=pc, loss=loss, row="peer")
        cells = [loss, _fmt(v)]
        for ref_name, ref in (("raw 1-NN", raw), (best, best_values)):
            c = compare(loss, "peer", v, str(ref_name), ref)
            ci = "" if c.diff is None else f"{100 * c.diff:+.1f} [{100 * c.lo:+.1f}, {100 * c.hi:+.1f}]"
            cells.append(ci or "not measured")
        rows.append(cells)
    header = [
        f"{_setting(data, pc)} loss",
        "K-NN accuracy (%)",
        "Δ vs raw-pixel 1-NN (95 % CI)",
        f"Δ vs the best seed loss at its defaults ({best or '—'}) (95 % CI)",
    ]
    note = (
        "\nThe losses users bring from pytorch-metric-learning and arcface_torch (issue [5/6]), each at its "
        "registry defaults (`marginkit losses`) and the library's training defaults, on the same subsets "
        "and seeds as section 2 (paired). They were not tuned (section 1's budget covers the seed losses), "
        "so this is what `compare --losses ...` gives a user with no options. AdaFace runs with "
        "`normalize: false` (it reads the embedding norms; the trainer refuses it otherwise).\n"
    )
    return markdown_table(header, rows) + note


def _id_cells(res: Any, kind: str, **m: Any) -> list[str]:
    """Rank-1 (CMC) and DIR at FPIR 1e-2 of the open-set identification protocol."""
    return [
        _fmt(res.per_seed(kind, "identification/cmc/1", **m)),
        _fmt(res.per_seed(kind, "identification/dir_at_fpir/0.01", **m)),
    ]


def _disjoint(plan: StudyPlan, res: Any) -> str:
    rows = []
    for data, pc in plan.disjoint_settings:
        for loss in ("raw", *plan.knn_losses):
            m = {"data": data, "per_class": pc, "loss": loss}
            found = res.select("disjoint", **m)
            n_imp = next((r["result"]["verification"]["num_impostor_pairs"] for r in found), None)
            rows.append(
                [
                    f"{_setting(data, pc)} {'raw input' if loss == 'raw' else loss}",
                    _fmt(res.per_seed("disjoint", "map_at_r", **m)),
                    _fmt(res.per_seed("disjoint", "precision_at_1", **m)),
                    _fmt(res.per_seed("disjoint", "verification/tar_at_far/0.001", **m)),
                    _fmt(res.per_seed("disjoint", "verification/eer", **m), 100, 2),
                    *_id_cells(res, "disjoint", **m),
                    str(n_imp) if n_imp is not None else "—",
                ]
            )
    header = ["data / embedding", "MAP@R", "P@1", "TAR@FAR=1e-3", "EER (%)", "rank-1 (%)",
              "DIR@FPIR=1e-2 (%)", "impostor pairs"]  # fmt: skip
    note = (
        "\n`split=halves` (the retrieval benchmarks' convention, Musgrave et al. 2020): training on "
        "the first C // 2 classes only (japanese-vowels: speakers 1–4 of 9), with the setting's "
        "samples per class; queries and pairs are every sample of the unseen classes (the source's "
        "training and test rows pooled), each query against the others. " + _ID_NOTE
    )
    return markdown_table(header, rows) + note


_ID_NOTE = (
    "Identification: `marginkit eval --protocol identification` on the same test rows — half of the "
    "identities enrolled with one gallery sample each (seeded), their other samples mated probes, every "
    "sample of the rest a non-mated probe; rank-1 = CMC(1) over mated probes, DIR@FPIR = detection and "
    "identification rate at the threshold passed by that share of non-mated probes ('not measurable' "
    "where there are too few non-mated probes to resolve it).\n"
)


def face_units(res: Any, kind: str, path: str, **match: Any) -> dict[int, float | None]:
    """``{fold * 1000 + seed: result[path]}`` of the faces jobs: the paired unit is a fold and a seed."""
    found = res.select(kind, **match)
    values = res._values(kind, path, **match)
    return {
        int(r["job"]["fold"]) * 1000 + int(r["job"].get("seed", 0)): v
        for r, v in zip(found, values, strict=True)
    }


def face_baseline_units(res: Any, name: str, path: str, units: Any) -> dict[int, float | None]:
    """A baseline's value on each ``unit``'s fold (the baselines have no seed: fitted once per fold)."""
    per_fold = {k // 1000: v for k, v in face_units(res, "faces_baseline", f"{name}/{path}").items()}
    return {u: per_fold.get(u // 1000) for u in units}


#: The faces section's columns: (header, result path, scale, digits).
_FACE_COLUMNS = (
    ("EER (%)", "verification/eer", 100, 1),
    ("TAR@FAR=1e-2 (%)", "verification/tar_at_far/0.01", 100, 1),
    ("TAR@FAR=1e-1 (%)", "verification/tar_at_far/0.1", 100, 1),
    ("MAP@R (%)", "map_at_r", 100, 1),
    ("P@1 (%)", "precision_at_1", 100, 1),
)


def _by_fold(values: dict[int, float | None], scale: float = 100) -> str:
    folds: dict[int, list[float]] = {}
    for unit, v in values.items():
        if v is not None:
            folds.setdefault(unit // 1000, []).append(v)
    return " / ".join(f"{scale * sum(v) / len(v):.1f}" for _, v in sorted(folds.items())) or "—"


def _faces(plan: StudyPlan, res: Any) -> str:
    if not res.select("faces") and not res.select("faces_baseline"):
        return (
            f"Not run: no faces at `{plan.faces}` (the Yale faces of `../shared/data`, read in place). "
            "Run the study from the repository's root beside `shared/` to measure this section.\n"
        )
    rows = []
    for name, label in (("raw", "raw pixels"), ("pca_whitened", "Eigenfaces (whitened PCA)")):
        cells = [
            _fmt(face_units(res, "faces_baseline", f"{name}/{p}"), sc, d) for _, p, sc, d in _FACE_COLUMNS
        ]
        rows.append([label, *cells, _by_fold(face_units(res, "faces_baseline", f"{name}/verification/eer"))])
    for loss in (*plan.face_losses, *plan.face_peers):
        for augmented in (False, True) if loss in plan.face_losses else (False,):
            m = {"loss": loss, "augment": augmented}
            cells = [_fmt(face_units(res, "faces", p, **m), sc, d) for _, p, sc, d in _FACE_COLUMNS]
            label = f"{loss} + augment" if augmented else loss
            rows.append([label, *cells, _by_fold(face_units(res, "faces", "verification/eer", **m))])
    found = res.select("faces")
    n_train = sorted({r["result"]["num_train"] for r in found})
    epochs = sorted({r["result"]["epochs"] for r in found})
    pca = sorted({r["result"]["pca_whitened"]["pca_components"] for r in res.select("faces_baseline")})
    header = ["embedding", *(c[0] for c in _FACE_COLUMNS), "EER by fold (%)"]
    o = plan.faces_options
    note = (
        f"\nThe Yale faces (15 people × 11 images: lighting, expression, glasses), "
        f"{o['image_size']}×{o['image_size']} grey, `split=classes, folds={o['folds']}, split_seed=0`: "
        f"each fold tests {15 // o['folds']} people never seen in training and trains on the others "
        f"({', '.join(map(str, n_train))} images). Every loss at the library's defaults (`model: auto` "
        f"= cnn2d, epochs auto = {', '.join(map(str, epochs))}, no validation split: the last "
        f"checkpoint), {plan.faces_seeds} seeds per fold; '+ augment' adds `--augment "
        f"{plan.face_augment}`. Eigenfaces: PCA fitted on the fold's training people, "
        f"{', '.join(map(str, pca))} components, whitened; raw pixels and Eigenfaces are "
        "L2-normalised and scored by the same evaluation as the losses (cosine pairs of the test "
        "people; mean ± std over folds, and over seeds for the losses). Each run's metrics also "
        "carry 95 % intervals from a bootstrap over the test people. The section's claim pairs "
        "each seed loss with Eigenfaces fold by fold.\n"
    )
    return markdown_table(header, rows) + note


_SPEAKER_COLUMNS = (
    ("trial EER (%)", "eer", 100.0, 1),
    ("TAR @ FAR 1e-2 (%)", "tar_at_far/0.01", 100.0, 1),
    ("minDCF 0.01", "min_dcf_0.01", 1.0, 3),
    ("minDCF 0.05", "min_dcf_0.05", 1.0, 3),
    ("all-pairs EER (%)", "all_pairs_eer", 100.0, 1),
)


def _speaker_values(res: Any, path: str, **match: Any) -> dict[int, float | None]:
    out: dict[int, float | None] = {}
    for r in res.select("speakers", **match):
        value: Any = r["result"]
        for part in path.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        out[int(r["job"]["seed"])] = None if value is None else float(value)
    return out


def _paired_text(a: dict[int, float | None], b: dict[int, float | None]) -> str:
    """The mean per-seed difference ``a - b`` (points) with its 95 % paired bootstrap interval."""
    from marginkit.study.stats import MIN_SEEDS, paired_bootstrap

    seeds = sorted(s for s in set(a) & set(b) if a[s] is not None and b[s] is not None)
    if len(seeds) < MIN_SEEDS:
        return f"not measured ({len(seeds)} paired seeds, {MIN_SEEDS} needed)"
    diff, lo, hi = paired_bootstrap([a[s] for s in seeds], [b[s] for s in seeds])  # type: ignore[misc]
    return f"{100 * diff:+.1f} pts [{100 * lo:+.1f}, {100 * hi:+.1f}] over {len(seeds)} seeds"


def _speakers(plan: StudyPlan, res: Any) -> str:
    from marginkit.study.plan import speaker_dir, speaker_rows

    if not res.select("speakers") and not res.select("speakers_baseline"):
        return (
            f"Not run: no synthetic speakers at `{speaker_dir(plan)}` (make them with `python "
            "benchmarks/make_espeak_speakers.py --speakers 40 --utterances 12`, which needs the "
            "system package espeak-ng).\n"
        )
    rows = []
    for base in res.select("speakers_baseline"):
        got = base["result"]
        if got is None:
            absent = ["not run: weights absent"] * len(_SPEAKER_COLUMNS)
            rows.append(["pretrained GE2E (Resemblyzer)", *absent])
            continue
        cells = []
        for _, path, scale, digits in _SPEAKER_COLUMNS:
            value: Any = got
            for part in path.split("/"):
                value = value.get(part) if isinstance(value, dict) else None
            cells.append("—" if value is None else f"{scale * float(value):.{digits}f}")
        rows.append(["pretrained GE2E (Resemblyzer, not trained here)", *cells])
    for label, loss, _ in speaker_rows():
        cells = [_fmt(_speaker_values(res, p, loss=loss), sc, d) for _, p, sc, d in _SPEAKER_COLUMNS]
        rows.append([label, *cells])
    header = ["embedding", *(c[0] for c in _SPEAKER_COLUMNS)]
    pairs = []
    for metric, path in (("trial EER", "eer"), ("TAR @ FAR 1e-2", "tar_at_far/0.01")):
        q = _speaker_values(res, path, loss="qmargin")
        for other in ("arcface", "cosface"):
            b = _speaker_values(res, path, loss=other)
            pairs.append(f"- {metric}, Q-Margin − {other}: {_paired_text(q, b)}")
    found = res.select("speakers")
    trials = sorted({r["result"]["num_trials"] for r in found if r.get("result")})
    train = sorted({r["result"]["num_train"] for r in found if r.get("result")})
    st = plan.speaker_train
    note = (
        f"\nA SIMULATION of speakers (espeak-ng voices, variants, pitch and rate: "
        f"`benchmarks/make_espeak_speakers.py`), not recordings of people. The speakers of the trial "
        f"list ({', '.join(map(str, trials))} trials, VoxCeleb format) are held out of training "
        f"(`split=classes`, `test_classes` = them); the others train ({', '.join(map(str, train))} "
        f"utterances). Model `{st['model']}` with {st.get('model_options')}, {st['epochs']} epochs, "
        f"batch {st['batch_size']}, 2 s crops, whole utterances at evaluation, no augmentation, "
        f"{plan.speaker_seeds} seeds (mean ± std over seeds). Scored by the run's own `--trials` "
        "evaluation; all-pairs EER over every pair of the test speakers' utterances. GE2E: "
        "Resemblyzer's pretrained encoder, scored on the same list by the same code. Paired "
        "comparisons over seeds (95 % bootstrap of the mean difference):\n\n" + "\n".join(pairs) + "\n"
    )
    return markdown_table(header, rows) + note


def _verification(plan: StudyPlan, res: Any) -> str:
    rows, n_imp = [], set()
    for label, _loss, _opts in identity_rows():
        found = res.select("identities", label=label)
        n_imp |= {r["result"]["num_impostor_pairs"] for r in found}
        act = res.per_seed("identities", "active_class_fraction", label=label)
        rows.append(
            [label]
            + [_fmt(res.per_seed("identities", f"tar_at_far/{f}", label=label)) for f in FARS]
            + [
                _fmt(res.per_seed("identities", "eer", label=label), 100, 2),
                *_id_cells(res, "identities", label=label),
                _fmt(act) if any(v is not None for v in act.values()) else "—",
            ]
        )
    header = ["loss (settings)"] + [f"TAR@FAR={f:g} (%)" for f in FARS]
    header += ["EER (%)", "rank-1 (%)", "DIR@FPIR=1e-2 (%)", "active classes (%)"]
    note = (
        f"\nImpostor pairs per seed: {sorted(n_imp)} (all pairs of the test identities); a FAR "
        "below 1/pairs is "
        "'not measurable'. `identities` is a SIMULATION (marginkit.data.IdentitySimulator), not face or "
        "speaker data. Active classes: mean support of the alpha loss's posterior on the training rows. "
        + _ID_NOTE
    )
    return markdown_table(header, rows) + note


def _precision(plan: StudyPlan, res: Any) -> str:
    names = {"ce": "cross-entropy", "hinge": "Crammer–Singer hinge", "mep": "MEP (L2)"}
    rows = []
    for data, pc in plan.margin_settings:
        for obj in ("ce", "hinge", "mep"):
            m = {"data": data, "per_class": pc, "objective": obj}
            row = [f"{_setting(data, pc)} {names[obj]}"]
            for p in PRECISIONS:
                row.append(
                    f"{_fmt(res.per_seed('margin', f'{p}/test_accuracy', **m))} / "
                    f"{_fmt(res.per_seed('margin', f'{p}/test_margin_fraction', **m))}"
                )
            row.append(_fmt(res.per_seed("margin", "train_zero_mep_grad_fraction", **m)))
            rows.append(row)
    header = ["setting / objective"] + [f"{p}: acc / rows keeping margin" for p in PRECISIONS]
    header.append("train rows with zero MEP gradient")
    note = (
        f"\nAll three on s·cos with s = {plan.margin_scale:g}, margin m = {plan.margin_margin:g} "
        "in score units "
        f"(= {plan.margin_margin / plan.margin_scale:g} in cosine), {plan.margin_epochs} epochs, AdamW lr "
        f"{plan.margin_lr:g}. Weight matrices and kernels rounded to the precision (int8: "
        "symmetric per output "
        "channel), biases and batch-norm in float32; a test row keeps the margin when "
        "s·(c_y − max_{j≠y} c_j) ≥ m.\n"
    )
    return markdown_table(header, rows) + note


def _throughput(plan: StudyPlan, res: Any, facts: dict[str, Any]) -> str:
    found = res.select("e2e")
    if not found:
        return "(the throughput job was not run)\n"
    sps = found[0]["result"]["samples_per_second"]
    methods = list(plan.e2e["methods"])
    rows, ratios = [], {}
    for classes, per in sps.items():
        for what, label in (("e2e", "backbone + head + loss"), ("head_loss", "head + loss")):
            row = [f"C = {int(classes):,}: {label}"] + [f"{per[m][what]:.0f}" for m in methods]
            q = per["Q-Margin"][what]
            row += [f"{q / per['CosFace'][what]:.2f}×", f"{q / per['ArcFace'][what]:.2f}×"]
            ratios[f"{classes}/{what}"] = q / per["ArcFace"][what]
            rows.append(row)
    facts["throughput"] = ratios
    e = plan.e2e
    header = (
        ["classes: measured"]
        + [f"{m} samples/s" for m in methods]
        + ["Q-Margin ÷ CosFace", "Q-Margin ÷ ArcFace"]
    )
    note = (
        f"\nOne training step (forward, backward, AdamW) at batch {e['batch']}, median of {e['rounds'] - 1} "
        f"rounds after one warm-up, methods interleaved per round, one thread; backbone: `mlp` "
        f"{e['input_dim']} → {e['hidden']} → {e['dim']} (unit embeddings); losses at the library defaults "
        "(Q-Margin with its exact candidate filter, `topk=auto`). Ratios of two timings taken side by side; "
        "absolute numbers depend on the (shared) machine. The detailed head + loss benchmark is "
        "`benchmarks/bench_qmargin.py` (docs/throughput.md).\n"
    )
    return markdown_table(header, rows) + note


def build_tables(plan: StudyPlan, res: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """Every table of :data:`marginkit.study.runner.TABLES` (Markdown) and facts for the verdicts."""
    facts: dict[str, Any] = {}
    tables = {}
    tables["tuning"], facts["tuning"] = _tuning(plan, res)
    tables["target"] = _target(plan, res, facts)
    tables["knn"] = _knn(plan, res)
    tables["paper"] = _paper(plan, res)
    tables["peers"] = _peers(plan, res, facts)
    tables["disjoint"] = _disjoint(plan, res)
    tables["faces"] = _faces(plan, res)
    tables["speakers"] = _speakers(plan, res)
    tables["verification"] = _verification(plan, res)
    tables["precision"] = _precision(plan, res)
    tables["throughput"] = _throughput(plan, res, facts)
    return tables, facts


def _computed_on_text(cost: dict[str, Any]) -> str:
    where = cost.get("computed_on") or {}
    if not where:
        return ""
    listed = "; ".join(f"{cpu}: {n} jobs" for cpu, n in where.items())
    return (
        f"Computed on {listed} (float results depend on the CPU's vector kernels: another CPU "
        "rounds differently and training carries that on, so the same command there gives other "
        "figures). "
    )


def results_markdown(
    plan: StudyPlan, tables: dict[str, str], claims: list[dict[str, Any]], cost: dict[str, Any], jobs: int
) -> str:
    import torch

    cmd = "python benchmarks/study.py --out study_out" + (" --quick" if plan.mode == "quick" else "")
    partial = ""
    if cost["missing"]:
        listing = "; ".join(f"{k} ({v})" for k, v in sorted(cost["missing_groups"].items()))
        partial = (
            f"**PARTIAL RESULTS: {cost['missing']} job(s) of this plan did not finish and are "
            "absent from the "
            f"tables (cells show 'not measurable' or fewer seeds):** {listing}. Rerun the "
            "command to complete "
            "them (finished runs are reused).\n"
        )
    cpu = ", ".join(f"{k} {v / 60:.1f} min" for k, v in cost["cpu_by_kind"].items())
    parts = [
        "# marginkit study: the seeds' losses on real small data, measured\n",
        f"Generated by `{cmd}` (mode **{plan.mode}**, {jobs} worker process(es), one torch thread each). "
        f"Wall time of this invocation {cost['wall_seconds'] / 60:.1f} min; {cost['reused']} of "
        f"{cost['jobs']} "
        f"jobs reused from an earlier invocation into the same OUT. The jobs' own CPU time sums to "
        f"{cost['job_cpu_seconds'] / 60:.1f} min ({cpu}); load average (1, 5, 15 min) "
        f"{cost['load_average_start']} at the start and {cost['load_average_end']} at the end "
        f"(the end figure includes this invocation's own workers). torch {torch.__version__}, "
        f"Python {cost['python']}, "
        f"{cost['machine']}. {_computed_on_text(cost)}"
        f"{plan.seeds} seeds per cell, no augmentation, nothing selected on test data. "
        "Each run's config is saved next to its result under `OUT/runs/`.\n",
        partial,
        "## Verdicts\n",
        "Rules fixed in code before the run (`marginkit/study/stats.py`, `claims.py`): each comparison is "
        "paired over seeds (same subset, initialisation and batch order), with a 95 % percentile-bootstrap "
        "interval of the mean per-seed difference; it is a *win* only when the interval excludes zero in the "
        "claim's favour, a *loss* when it excludes zero against it, else a *tie*. A claim is "
        "*supported* with "
        "≥ 80 % wins and no loss, *contradicted* with ≥ 50 % losses, *not supported* with no win, *mixed* "
        "otherwise. Throughput has no seeds: supported at ≥ 0.9× ArcFace, mixed at ≥ 0.7×.\n",
    ]
    for c in claims:
        parts.append(f"- **{c['claim']}** — *{c['verdict']}*. {c['sentence']}")
    parts.append("")
    for name in TABLES:
        parts.append(f"## {TITLES[name]}\n")
        parts.append(tables[name])
    return "\n".join(parts) + "\n"
