"""One verdict per claim (SPEC §8, the MEP blog's low-precision scenario, issue 12's target),
from paired comparisons over seeds (:mod:`marginkit.study.stats`; the rules are there).

Which comparisons each claim makes is fixed here, before any run:

- *local-margin triplet*: on every small-data setting (≤ 50 per class), its K-NN accuracy vs
  the softmax head and vs plain triplet K-NN;
- *Q-Margin at low FAR*: on ``identities``, Q-Margin vs ArcFace and vs CosFace at TAR@1e-4 and
  TAR@1e-5, at the defaults and at the published settings; on Japanese Vowels' unseen speakers
  at TAR@1e-3 vs both;
- *Circle vs triplet*: MAP@R on every class-disjoint setting;
- *real faces*: each seed loss (Q-Margin, Circle, local-margin triplet, MEP), at the defaults and
  with augmentation, vs Eigenfaces (whitened PCA) on EER and TAR@FAR=1e-2, paired by fold and
  seed over the Yale leave-people-out folds;
- *margins survive low precision*: at bf16, fp16 and int8, MEP vs cross-entropy and vs the
  hinge in test rows keeping the margin, and in test accuracy;
- *embeddings beat raw pixels* (the target): on mnist-sample at 10 per class, Q-Margin and the
  local-margin triplet vs raw-pixel 1-NN + 8 points (the comparison is shifted by 0.08);
- *throughput*: Q-Margin ÷ ArcFace samples/s at the largest class count (ratio rule).
"""

from __future__ import annotations

from typing import Any

from marginkit.study.jobs import PRECISIONS
from marginkit.study.plan import StudyPlan, identity_rows
from marginkit.study.stats import Comparison, compare, grade

__all__ = ["verdicts"]


def _shift(values: dict[int, float | None], by: float) -> dict[int, float | None]:
    return {k: None if v is None else v + by for k, v in values.items()}


def _claim(claim: str, comps: list[Comparison], extra: str = "") -> dict[str, Any]:
    counts = {r: sum(c.result == r for c in comps) for r in ("win", "tie", "loss", "not measured")}
    plural = {"win": "wins", "tie": "ties", "loss": "losses", "not measured": "not measured"}
    tally = ", ".join(f"{v} {k if v == 1 else plural[k]}" for k, v in counts.items() if v)
    text = "; ".join(c.text() for c in comps)
    return {
        "claim": claim,
        "verdict": grade(comps),
        "sentence": (text + f" — {tally or 'nothing measured'}." + (f" {extra}" if extra else "")).strip(),
        "comparisons": [c.to_dict() for c in comps],
    }


def _local_triplet(plan: StudyPlan, res: Any) -> dict[str, Any]:
    comps = []
    for data, pc in plan.knn_settings:
        if pc is None or pc > 50:
            continue
        m = {"data": data, "per_class": pc, "row": "defaults"}
        lt = res.per_seed("knn", "knn_accuracy", loss="local_triplet", **m)
        head = res.per_seed("knn", "head_accuracy", loss="softmax", **m)
        tri = res.per_seed("knn", "knn_accuracy", loss="triplet", **m)
        setting = f"{data}-{pc}pc"
        comps.append(compare(f"{setting}", "local-triplet K-NN", lt, "softmax head", head))
        comps.append(compare(f"{setting}", "local-triplet K-NN", lt, "triplet K-NN", tri))
    return _claim(
        "Local-margin triplet + K-NN beats end-to-end softmax and plain triplet on small data", comps
    )


def _qmargin(plan: StudyPlan, res: Any) -> dict[str, Any]:
    from marginkit.study.tuning import QMARGIN_SPEAKER

    groups: dict[str, dict[str, str]] = {}
    for label, _loss, options in identity_rows():
        kind = "defaults" if not options else ("speaker" if options == QMARGIN_SPEAKER[1] else "paper")
        groups.setdefault(kind, {})[label.partition(" (")[0]] = label
    comps = []
    for kind in ("defaults", "paper"):
        g = groups.get(kind, {})
        if "Q-Margin" not in g:
            continue
        for far in (1e-4, 1e-5):
            q = res.per_seed("identities", f"tar_at_far/{far}", label=g["Q-Margin"])
            for other in ("ArcFace", "CosFace"):
                if other in g:
                    o = res.per_seed("identities", f"tar_at_far/{far}", label=g[other])
                    comps.append(compare(f"identities {kind} TAR@{far:g}", "Q-Margin", q, other, o))
    for data, pc in plan.disjoint_settings:
        if data != "japanese-vowels":
            continue
        m = {"data": data, "per_class": pc}
        q = res.per_seed("disjoint", "verification/tar_at_far/0.001", loss="qmargin", **m)
        c = res.per_seed("disjoint", "verification/tar_at_far/0.001", loss="cosface", **m)
        comps.append(compare("japanese-vowels unseen speakers TAR@0.001", "Q-Margin", q, "CosFace", c))
    return _claim("Q-Margin beats ArcFace/CosFace at low FAR", comps)


def _circle(plan: StudyPlan, res: Any) -> dict[str, Any]:
    comps = []
    for data, pc in plan.disjoint_settings:
        m = {"data": data, "per_class": pc}
        c = res.per_seed("disjoint", "map_at_r", loss="circle", **m)
        t = res.per_seed("disjoint", "map_at_r", loss="triplet", **m)
        comps.append(
            compare(f"{data}{f'-{pc}pc' if pc else ''} unseen classes MAP@R", "Circle", c, "triplet", t)
        )
    return _claim("Circle loss beats triplet on retrieval with a PK sampler", comps)


def _faces(plan: StudyPlan, res: Any) -> dict[str, Any]:
    from marginkit.study.sections import face_baseline_units, face_units

    comps = []
    for augmented in (False, True):
        for loss in plan.face_losses:
            m = {"loss": loss, "augment": augmented}
            name = f"{loss}{' + augment' if augmented else ''}"
            eer = face_units(res, "faces", "verification/eer", **m)
            tar = face_units(res, "faces", "verification/tar_at_far/0.01", **m)
            pca_eer = face_baseline_units(res, "pca_whitened", "verification/eer", eer)
            pca_tar = face_baseline_units(res, "pca_whitened", "verification/tar_at_far/0.01", tar)
            # lower EER is better: compare the negated rates, so that a win is a lower EER
            comps.append(compare("faces EER (negated)", name, _negate(eer), "Eigenfaces", _negate(pca_eer)))
            comps.append(compare("faces TAR@1e-2", name, tar, "Eigenfaces", pca_tar))
    return _claim(
        "On real faces of people never seen in training (Yale, leave-people-out), the seeds' losses beat "
        "Eigenfaces (whitened PCA) on EER and TAR@FAR=1e-2, at the defaults and with augmentation",
        comps,
    )


def _negate(values: dict[int, float | None]) -> dict[int, float | None]:
    return {k: None if v is None else -v for k, v in values.items()}


def _precision(plan: StudyPlan, res: Any) -> dict[str, Any]:
    comps = []
    for data, pc in plan.margin_settings:
        for p in PRECISIONS[1:]:
            for key, what in (("test_margin_fraction", "rows keeping margin"), ("test_accuracy", "accuracy")):
                mep = res.per_seed("margin", f"{p}/{key}", data=data, per_class=pc, objective="mep")
                for other, name in (("ce", "cross-entropy"), ("hinge", "hinge")):
                    o = res.per_seed("margin", f"{p}/{key}", data=data, per_class=pc, objective=other)
                    comps.append(compare(f"{data} {p} {what}", "MEP", mep, name, o))
    return _claim(
        "Margins survive low precision: MEP keeps the margin and accuracy under bf16 / fp16 / int8 weights "
        "better than cross-entropy and the hinge",
        comps,
    )


def _target(plan: StudyPlan, res: Any, facts: dict[str, Any]) -> dict[str, Any]:
    data, pc = plan.tune_data, plan.tune_per_class
    raw = res.per_seed("baseline", "raw_1nn_l2", data=data, per_class=pc)
    comps = []
    for loss in ("qmargin", "local_triplet"):
        acc = res.per_seed("knn", "knn_accuracy", data=data, per_class=pc, loss=loss, row="defaults")
        comps.append(compare(f"{data}-{pc}pc", f"{loss} K-NN", acc, "raw 1-NN + 8 pts", _shift(raw, 0.08)))
    t = facts.get("target", {})
    best = t.get("best")
    extra = (
        f"Best loss at the defaults: {best} {100 * t['means'][best]:.1f} % (target ≥ 85 %)." if best else ""
    )
    return _claim(
        "With the defaults, Q-Margin and the local-margin triplet beat raw-pixel 1-NN by ≥ 8 points "
        f"on real MNIST digits at {pc} per class",
        comps,
        extra,
    )


def _speed(plan: StudyPlan, facts: dict[str, Any]) -> dict[str, Any]:
    ratios = facts.get("throughput") or {}
    claim = "Exact truncation keeps Q-Margin about as fast as ArcFace/CosFace"
    if not ratios:
        return {
            "claim": claim,
            "verdict": "not measured",
            "sentence": "the throughput job did not run.",
            "comparisons": [],
        }
    largest = max(int(k.split("/")[0]) for k in ratios)
    e2e, head = ratios[f"{largest}/e2e"], ratios[f"{largest}/head_loss"]
    best = max(e2e, head)
    verdict = "supported" if best >= 0.9 else ("mixed" if best >= 0.7 else "not supported")
    cells = ", ".join(f"C={k.split('/')[0]} {k.split('/')[1]} {v:.2f}×" for k, v in sorted(ratios.items()))
    return {
        "claim": claim,
        "verdict": verdict,
        "sentence": f"Q-Margin samples/s ÷ ArcFace's: {cells} (paper: 0.73× full, 0.95× with top-5 %); at "
        f"C = {largest:,}: end-to-end {e2e:.2f}×, head + loss {head:.2f}×.",
        "comparisons": [],
    }


def verdicts(
    plan: StudyPlan, res: Any, facts: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The claim list (``{"claim", "verdict", "sentence", "comparisons"}`` each) and every comparison."""
    claims = [
        _target(plan, res, facts),
        _local_triplet(plan, res),
        _qmargin(plan, res),
        _circle(plan, res),
        _faces(plan, res),
        _precision(plan, res),
        _speed(plan, facts),
    ]
    return claims, [c for claim in claims for c in claim["comparisons"]]
