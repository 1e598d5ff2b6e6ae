"""The run report: ``report.html`` of one run directory."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from marginkit.report._html import fmt, img, number, read_jsonl, table, write_html
from marginkit.report.figures import (
    _PAIR_SCORES,
    _confusion,
    _curves,
    _histogram,
    _pair_dets,
    _projection,
    _roc,
    cmc_figure,
    det_figure,
    figure_png,
)


def _identification_figures(arrays: dict[str, np.ndarray]) -> list[str]:
    figures = []
    if "cmc_rank" in arrays:
        figures.append(img(figure_png(cmc_figure([("", arrays["cmc_rank"], arrays["cmc_rate"])])),
                            "CMC of the open-set search: share of mated probes whose identity is "
                            "within the first k gallery labels."))  # fmt: skip
    if "det_identification_p_fa" in arrays:
        fig = det_figure([("", arrays["det_identification_p_fa"], arrays["det_identification_p_miss"])],
                         xlabel="FPIR (%)", ylabel="FNIR (%)", title="open-set DET")  # fmt: skip
        figures.append(img(figure_png(fig), "Open-set identification: false-negative identification rate "
                            "against false-positive identification rate (non-mated probes)."))  # fmt: skip
    return figures


_SCALARS = (
    ("knn_accuracy", "K-NN accuracy"),
    ("head_accuracy", "cosine-head accuracy"),
    ("precision_at_1", "precision@1"),
    ("r_precision", "R-precision"),
    ("map_at_r", "MAP@R"),
    ("margin_gap_median", "median margin gap (cosine)"),
    ("margin_gap_positive_fraction", "share with positive margin gap"),
    ("support_size_mean", "mean posterior support size"),
)


_METRIC_SECTIONS = (
    *((key, heading) for key, _, heading in _PAIR_SCORES),
    ("identification", "Open-set identification (1:N)"),
    ("trials", "Speaker verification: the trial list (--trials)"),
)


def _flatten(prefix: str, value: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (int, float, str, bool)) or value is None:
        out.append((prefix, value))
    elif isinstance(value, (list, tuple)) and len(value) == 2 and all(number(v) is not None for v in value):
        out.append((prefix, f"[{fmt(float(value[0]))}, {fmt(float(value[1]))}]"))  # an interval


#: Readable names of the metric blocks' keys; ``{}`` is the key's last part (a rate or a rank).
_LABELS = {
    "tar_at_far": "TAR @ FAR {}", "dir_at_fpir": "DIR @ FPIR {}", "cmc": "CMC rank {}",
    "eer": "EER", "auc": "AUC", "min_dcf": "minDCF", "min_dcf_threshold": "minDCF threshold",
    "actual_dcf": "actual DCF", "cllr": "Cllr", "min_cllr": "min Cllr",
    "p_target": "P_target", "c_miss": "C_miss", "c_fa": "C_fa", "normalized": "normalised",
    "num_genuine": "genuine pairs", "num_impostor": "impostor pairs", "num_mated": "mated probes",
    "num_nonmated": "non-mated probes", "num_gallery_labels": "gallery labels",
    "num_subjects": "subjects", "decision": "decision rule", "confidence_intervals": "CI:",
    "dcf_params": "DCF", "valid_replicates": "valid replicates",
    "min_dcf_0.01": "minDCF (P_target 0.01)", "min_dcf_0.05": "minDCF (P_target 0.05)",
    "num_trials": "trials", "num_target": "target trials", "num_nontarget": "non-target trials",
    "num_utterances": "utterances embedded", "norm": "score normalisation", "source": "trial list",
    "actual_dcf_0.01": "actual DCF (P_target 0.01)", "calibration": "calibration",
}  # fmt: skip


def _metric_label(key: str, section: str) -> str:
    """``tar_at_far.0.01`` → ``TAR @ FAR 0.01``; ``dcf_params.c_miss`` → ``DCF C_miss``;
    ``thresholds.x`` → ``threshold @ FAR x`` (``FPIR`` in the identification block). The rates
    are float keys, so the dotted path is split at the first name that takes one."""
    if key in _LABELS and "{}" not in _LABELS[key]:  # a whole key, dot included (min_dcf_0.01)
        return _LABELS[key]
    parts = key.split(".")
    words: list[str] = []
    for i, name in enumerate(parts):
        rate = ".".join(parts[i + 1 :])
        if name == "thresholds" and rate:
            words.append(f"threshold @ {'FPIR' if section == 'identification' else 'FAR'} {rate}")
            break
        if "{}" in _LABELS.get(name, "") and rate:
            words.append(_LABELS[name].format(rate))
            break
        words.append(_LABELS.get(name, name.replace("_", " ")))
    return " ".join(words)


def _run_headline(metrics: dict[str, Any], history: list[dict[str, Any]]) -> str:
    """One line: the run's main test result and where it stands."""
    bits = []
    for key, label in (("knn_accuracy", "K-NN accuracy"), ("head_accuracy", "cosine-head accuracy"),
                       ("map_at_r", "MAP@R")):  # fmt: skip
        if number(metrics.get(key)) is not None:
            bits.append(f"{label} <b>{fmt(float(metrics[key]))}</b>")
    for key, label in (
        ("verification", "EER"), ("verification_normalized", "normalised EER"),
        ("templates", "template EER"), ("templates_normalized", "normalised template EER"),
        ("trials", "trial-list EER"),
    ):  # fmt: skip
        block = metrics.get(key)
        if isinstance(block, dict) and number(block.get("eer")) is not None:
            bits.append(f"{label} <b>{fmt(float(block['eer']))}</b>")
    ident = metrics.get("identification")
    if isinstance(ident, dict) and number((ident.get("cmc") or {}).get("1")) is not None:
        bits.append(f"open-set rank-1 <b>{fmt(float(ident['cmc']['1']))}</b>")
    if not bits:
        return ""
    where = []
    if metrics.get("num_test") is not None:
        where.append(f"{html.escape(str(metrics['num_test']))} test samples")
    if metrics.get("k") is not None and "knn_accuracy" in metrics:
        where.append(f"{html.escape(str(metrics['k']))}-NN")
    epochs = len(history)
    if metrics.get("epoch") is not None:
        where.append(
            f"checkpoint of epoch {html.escape(str(metrics['epoch']))}" + (f" of {epochs}" if epochs else "")
        )
    tail = f" <span class=muted>({', '.join(where)})</span>" if where else ""
    return f"<p class=lead>{html.escape(str(metrics.get('loss', '?')))}: {' · '.join(bits)}{tail}</p>"


def write_run_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``report.html`` for a run directory; returns its path."""
    run_dir = Path(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
    history = read_jsonl(run_dir / "metrics.jsonl")
    config_text = (
        (run_dir / "config.yaml").read_text(encoding="utf-8") if (run_dir / "config.yaml").is_file() else ""
    )
    arrays: dict[str, np.ndarray] = {}
    if (run_dir / "eval.npz").is_file():
        with np.load(run_dir / "eval.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    title = f"marginkit run — {metrics.get('loss', '?')} on {metrics.get('data', '?')}"
    parts = [f"<h1>{html.escape(title)}</h1>", _run_headline(metrics, history)]
    parts.append(
        f"<p class=muted>{html.escape(str(run_dir))} · "
        f"backbone {html.escape(str(metrics.get('model', '?')))} · "
        f"embedding dim {metrics.get('embedding_dim', '?')} · "
        f"checkpoint {html.escape(str(metrics.get('checkpoint')))} (epoch {metrics.get('epoch', '?')}) · "
        f"fingerprint <code>{html.escape(str(metrics.get('fingerprint', '')))}</code></p>"
    )
    split = metrics.get("class_split")
    if isinstance(split, dict):  # which classes trained, validated and tested

        def names(side: str) -> str:
            found = [str(n) for n in split.get(side) or []]
            shown = ", ".join(found[:12]) + (", …" if len(found) > 12 else "")
            return f"{len(found)} ({html.escape(shown)})" if found else "none"

        test = "never seen in training" if metrics.get("open_set") else "the training classes"
        parts.append(
            f"<p>Classes — training {names('train')}; validation {names('val')}; test {names('test')}: "
            f"{test}. <span class=muted>{html.escape(str(metrics.get('split', '')))}</span></p>"
        )
    rows = [(label, metrics[key]) for key, label in _SCALARS if key in metrics]
    if metrics.get("open_set"):
        rows.insert(1, ("K-NN protocol", metrics.get("knn_protocol", "")))
    parts.append("<h2>Test metrics</h2>" + table(rows, ["metric", "value"]))
    for key, heading in _METRIC_SECTIONS:
        if isinstance(metrics.get(key), dict):
            flat: list[tuple[str, Any]] = []
            _flatten("", metrics[key], flat)
            flat = [(_metric_label(name, key), value) for name, value in flat]
            parts.append(f"<h3>{heading}</h3>" + table(flat, ["metric", "value"]))
    figures = []
    curves = _curves(history)
    if curves:
        figures.append(img(curves, "Training loss and validation metrics per epoch."))
    if "confusion" in arrays:
        figures.append(
            img(
                _confusion(arrays["confusion"], None),
                "Confusion matrix of the K-NN classifier on the test set.",
            )
        )
    if "roc_far" in arrays:
        figures.append(img(_roc(arrays["roc_far"], arrays["roc_tar"]), "ROC of test pairs."))
    dets = _pair_dets(arrays, metrics)
    if dets:
        caption = ("DET curves of pair scores: miss against false-alarm rate on normal-deviate axes "
                   "(accept iff score > threshold).")  # fmt: skip
        figures.append(img(figure_png(det_figure(dets)), caption))
    figures.extend(_identification_figures(arrays))
    if "projection" in arrays:
        proj = _projection(arrays["projection"], arrays["projection_labels"])
        figures.append(
            img(proj, "Test embeddings projected on their two leading principal components (colour: class).")
        )
    if "margin_gap" in arrays:
        figures.append(
            img(
                _histogram(
                    arrays["margin_gap"], "margin gap: true-class cosine − best other cosine", vline=0.0
                ),
                "Margin gap of the cosine head on test samples (right of the dashed line = correct).",
            )
        )
    if "support_size" in arrays:
        figures.append(
            img(
                _histogram(
                    arrays["support_size"].astype(float), "classes with non-zero probability", discrete=True
                ),
                "Support size of the sparse (alpha-softargmax) posterior on test samples.",
            )
        )
    parts.append("<h2>Figures</h2><div class=grid>" + "".join(figures) + "</div>")
    if "per_class_recall" in metrics:
        rec = [(i, r) for i, r in enumerate(metrics["per_class_recall"])]
        parts.append("<h2>Per-class recall (K-NN)</h2>" + table(rec, ["class", "recall"]))
    if history:
        keys = [k for k in history[0] if k not in ("best",)]
        parts.append("<h2>Training log</h2>" + table([[r.get(k) for k in keys] for r in history], keys))
    if config_text:
        parts.append(f"<h2>Configuration</h2><pre>{html.escape(config_text)}</pre>")
    path = Path(out) if out else run_dir / "report.html"
    write_html(path, title, parts)
    return path
