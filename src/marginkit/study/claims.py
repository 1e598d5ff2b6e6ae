"""One verdict per claim of SPEC §8 (+ the transfer claim), computed from the study's numbers.

Rules (stated here and in RESULTS.md, decided before looking at the numbers): a comparison
is "won" when the mean over seeds is higher. A claim is *supported* when it wins every
comparison it makes (resp. ≥ 80 % of them for the many-cell claims), *not supported* when
it wins ≤ 20 % (resp. none of the key ones), *mixed* otherwise.
"""

from __future__ import annotations

import re
from typing import Any

from marginkit.study.plan import StudyPlan

__all__ = ["verdicts"]


def _pct(x: float | None) -> str:
    return "n/m" if x is None else f"{100 * x:.1f}%"


def _grade(wins: int, total: int) -> str:
    if total == 0:
        return "not measured"
    share = wins / total
    if share >= 0.8:
        return "supported"
    if share <= 0.2:
        return "not supported"
    return "mixed"


def _mep(plan: StudyPlan, s: dict[str, Any]) -> dict[str, Any]:
    bits, brakes, acc_ok = [], 0, 0
    for setting, objs in s["mep"].items():
        z = objs["mep"]["train_zero_mep_grad_fraction"]["mean"]
        acc = {o: objs[o]["test_accuracy"]["mean"] for o in objs}
        sd = {o: objs[o]["test_accuracy"]["std"] or 0.0 for o in objs}
        keep = {o: objs[o]["test_margin_fraction"]["mean"] for o in objs}
        if z is None or acc["mep"] is None or acc["ce"] is None:
            bits.append(f"{setting}: not run")
            continue
        brakes += z is not None and z >= 0.5
        acc_ok += acc["mep"] >= acc["ce"] - (sd["mep"] + sd["ce"])
        bits.append(
            f"{setting}: {_pct(z)} of training rows have exactly zero MEP gradient at the end; test accuracy "
            f"MEP {_pct(acc['mep'])} vs cross-entropy {_pct(acc['ce'])} vs hinge {_pct(acc['hinge'])}; "
            f"test rows keeping the margin MEP {_pct(keep['mep'])} / CE {_pct(keep['ce'])} "
            f"/ hinge {_pct(keep['hinge'])}"
        )
    n = sum(not b.endswith("not run") for b in bits)
    verdict = _grade(brakes + acc_ok, 2 * n)
    return {
        "claim": "MEP targets train a classifier that keeps a margin without over-training (brakes)",
        "verdict": verdict,
        "sentence": "; ".join(bits)
        + f". Brakes (≥ 50 % zero-gradient rows) in {brakes}/{n} settings, accuracy "
        f"within one std of cross-entropy or better in {acc_ok}/{n}.",
    }


def _local_triplet(plan: StudyPlan, s: dict[str, Any]) -> dict[str, Any]:
    wins, total, bits = 0, 0, []
    for data, pc, _ in plan.knn_settings:
        if data == "mnist1d" and pc is None:
            continue  # not small data
        setting = f"{data}-{pc}pc" if pc else f"{data}-full"
        cell = s["knn"][setting]
        lt, head, tri = cell["local_triplet"]["mean"], cell["softmax_head"]["mean"], cell["triplet"]["mean"]
        for other in (head, tri):
            if lt is not None and other is not None:
                wins += lt > other
                total += 1
        bits.append(
            f"{setting}: local-triplet K-NN {_pct(lt)} vs softmax head {_pct(head)} "
            f"vs triplet K-NN {_pct(tri)}"
        )
    return {
        "claim": "Local-margin triplet + K-NN beats end-to-end softmax and plain triplet on small data",
        "verdict": _grade(wins, total),
        "sentence": "; ".join(bits) + f" — wins {wins}/{total} comparisons.",
    }


def _qmargin(plan: StudyPlan, s: dict[str, Any]) -> dict[str, Any]:
    ver = s["verification"]

    def best(prefixes: tuple[str, ...], far: float) -> tuple[float | None, str]:
        cands = [
            (v["tar"][str(far)]["mean"], k)
            for k, v in ver.items()
            if k.startswith(prefixes) and v["tar"][str(far)]["mean"] is not None
        ]
        return max(cands) if cands else (None, "")

    wins, total, bits = 0, 0, []
    for far in (1e-4, 1e-5):
        q, qk = best(("Q-Margin",), far)
        b, bk = best(("ArcFace", "CosFace"), far)
        if q is None or b is None:
            bits.append(f"TAR@{far:g} not measurable")
            continue
        total += 1
        wins += q > b
        bits.append(f"TAR@{far:g}: best Q-Margin {_pct(q)} ({qk}) vs best ArcFace/CosFace {_pct(b)} ({bk})")
    d16 = "Q-Margin α=1.25 s=16"
    if d16 in ver:
        bits.append(
            f"at the default α=1.25, s=16: TAR@1e-4 {_pct(ver[d16]['tar'][str(1e-4)]['mean'])} "
            "vs CosFace s=16 "
            f"{_pct(ver.get('CosFace s=16', {}).get('tar', {}).get(str(1e-4), {}).get('mean'))}"
        )
    return {
        "claim": "Q-Margin beats ArcFace/CosFace at low FAR",
        "verdict": _grade(wins, total) if total else "not measured",
        "sentence": "; ".join(bits)
        + " (each family at its best scale of the sweep, chosen on the test identities "
        "for all families alike).",
    }


def _speed(s: dict[str, Any]) -> dict[str, Any]:
    text = s["throughput_text"]
    found = re.findall(r"QMargin auto ([0-9.]+)×, QMargin topk=5% ([0-9.]+)×", text)
    sizes = re.findall(r"### C = ([0-9][0-9,]*[0-9])", text)
    if not found:
        return {
            "claim": "Exact truncation keeps Q-Margin about as fast as CosFace/ArcFace",
            "verdict": "not measured",
            "sentence": "the throughput benchmark did not run.",
        }
    auto, top = (float(v) for v in found[-1])
    cells = ", ".join(f"C={c}: auto {a}×, top-5% {t}×" for c, (a, t) in zip(sizes, found, strict=False))
    best = max(auto, top)
    verdict = "supported" if best >= 0.9 else ("mixed" if best >= 0.7 else "not supported")
    return {
        "claim": "Exact truncation keeps Q-Margin about as fast as CosFace/ArcFace",
        "verdict": verdict,
        "sentence": f"Q-Margin throughput relative to head + ArcFace ({cells}; "
        "paper: 0.73× full, 0.95× top-5 %); "
        f"at the largest C measured the better variant runs at {best:.2f}×.",
    }


def _circle(plan: StudyPlan, s: dict[str, Any]) -> dict[str, Any]:
    wins, total, bits = 0, 0, []
    for setting, cell in s["knn"].items():
        if setting == "identities":
            c, t = cell["Circle (pairs)"]["mean"], cell["Triplet (pairs)"]["mean"]
        else:
            c, t = cell["circle_map_at_r"]["mean"], cell["triplet_map_at_r"]["mean"]
        if c is None or t is None:
            continue
        total += 1
        wins += c > t
        bits.append(f"{setting} {_pct(c)} vs {_pct(t)}")
    return {
        "claim": "Circle loss beats triplet on retrieval with a PK sampler",
        "verdict": _grade(wins, total),
        "sentence": "MAP@R Circle vs triplet: " + "; ".join(bits) + f" — Circle wins {wins}/{total}.",
    }


def _transfer(plan: StudyPlan, s: dict[str, Any]) -> dict[str, Any]:
    wins, total, bits = 0, 0, []
    for data, cell in s["transfer"].items():
        for n in plan.transfer_refs:
            raw = cell["raw"][str(n)]["mean"]
            embs = {loss: cell[loss][str(n)]["mean"] for loss in plan.transfer_losses}
            embs = {k: v for k, v in embs.items() if v is not None}
            if raw is None or not embs:
                bits.append(f"{data}, {n} ref/class: not run")
                continue
            wins += sum(v > raw for v in embs.values())
            total += len(embs)
            top = max(embs, key=lambda k: embs[k])
            bits.append(
                f"{data}, {n} ref/class: raw {_pct(raw)}, best embedding {top} {_pct(embs[top])}, "
                f"worst {_pct(min(embs.values()))}"
            )
    return {
        "claim": "Embeddings learned on half the classes transfer to the unseen half (K-NN, few references)",
        "verdict": _grade(wins, total),
        "sentence": "; ".join(bits) + f" — embeddings beat raw inputs in {wins}/{total} cells.",
    }


def verdicts(plan: StudyPlan, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The claim list: ``{"claim", "verdict", "sentence"}`` each."""
    return [
        _mep(plan, summary),
        _local_triplet(plan, summary),
        _qmargin(plan, summary),
        _speed(summary),
        _circle(plan, summary),
        _transfer(plan, summary),
    ]
