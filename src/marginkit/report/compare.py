"""The comparison report of several losses' runs."""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from marginkit.report._html import fmt, fmt_as, header, img, number, read_jsonl, write_html
from marginkit.report.figures import (
    _PAIR_CURVES,
    LEGEND_SIZE,
    _epoch_axis,
    _new_figure,
    bar_figure,
    cmc_figure,
    det_figure,
    figure_png,
    line_style,
    projections_figure,
)


def _bar_plot(summary: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    return figure_png(bar_figure(summary, metrics))


def compare_plot(summary: list[dict[str, Any]], metrics: Sequence[str], path: str | Path) -> Path:
    """Write the comparison bar plot (mean ± std) as a PNG file."""
    path = Path(path)
    path.write_bytes(base64.b64decode(_bar_plot(summary, metrics)))
    return path


def _val_overlay(histories: dict[str, list[dict[str, Any]]]) -> str | None:
    if not any(histories.values()):
        return None
    fig = _new_figure(6.5, 3.8)
    ax = fig.subplots()
    plotted = 0
    for loss, hist in histories.items():
        key = next((k for k in ("val_knn_accuracy", "val_precision_at_1") if hist and k in hist[0]), None)
        if key:
            values = [r.get(key) for r in hist]
            ax.plot([r["epoch"] for r in hist], values, ms=3, label=loss, **line_style(plotted))
            plotted += 1
    if not plotted:  # no validation split: nothing to show
        return None
    _epoch_axis(ax)
    ax.set_ylabel("validation K-NN accuracy / precision@1")
    ax.grid(alpha=0.3)
    ax.legend(
        fontsize=LEGEND_SIZE, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False
    )  # off the curves
    fig.tight_layout()
    return figure_png(fig)


#: Summary keys that are bookkeeping or settings, not metrics (never a "best").
_NOT_METRICS = (
    "loss",
    "kind",
    "n_seeds",
    "runs",
    "seconds",
    "epochs",
    "description",
    "open_set",
    "protocol",
    "reused_runs",
)


def _metric_columns(summary: list[dict[str, Any]]) -> list[str]:
    """Metric columns of a comparison, in first-seen order; verification details that are
    not scores (thresholds, cost parameters, pair counts) are left to the per-run reports."""
    cols: list[str] = []
    for row in summary:
        for key, value in row.items():
            if key.endswith("_std") or key in _NOT_METRICS or key in cols:
                continue
            if re.search(r"threshold|dcf_params|num_genuine|num_impostor|calibration", key):
                continue
            if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                cols.append(key)
    return cols


def lower_is_better(metric: str) -> bool:
    """Error-type metrics (EER, minDCF, actual DCF, Cllr) are better when lower; everything else
    when higher."""
    return bool(re.search(r"(^|_)(eer|min_dcf|actual_dcf|cllr|loss|error)($|_)", metric))


def _winners(summary: list[dict[str, Any]], metric: str) -> tuple[list[str], float] | None:
    """The losses with the best mean of ``metric`` (several on an exact tie) and that mean."""
    vals = [(r["loss"], v) for r in summary if (v := number(r.get(metric))) is not None]
    if not vals:
        return None
    best = (min if lower_is_better(metric) else max)(v for _, v in vals)
    return [loss for loss, v in vals if v == best], best


def _within_noise(summary: list[dict[str, Any]], metric: str, winners: list[str], best: float) -> list[str]:
    """Other losses whose mean is within the summed std of the winner's (several seeds only)."""
    top = next(r for r in summary if r["loss"] == winners[0])
    s_top = number(top.get(f"{metric}_std"))
    out = []
    for r in summary:
        v, s = number(r.get(metric)), number(r.get(f"{metric}_std"))
        if r["loss"] in winners or v is None or s is None or s_top is None:
            continue
        if abs(best - v) <= s + s_top:
            out.append(r["loss"])
    return out


def winners_line(summary: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    """One sentence (HTML) naming the best loss on each metric, with the noise caveat."""
    parts = []
    for m in metrics:
        won = _winners(summary, m)
        if won is None:
            continue
        names, best = won
        text = f"{header(m)}: <b>{html.escape(' = '.join(names))}</b> {fmt(best)}"
        close = _within_noise(summary, m, names, best)
        if close:
            text += f" (within one std: {html.escape(', '.join(close))})"
        parts.append(text)
    if not parts:
        return ""
    seeds = max((int(r.get("n_seeds") or 1) for r in summary), default=1)
    caveat = (
        "one seed per loss: a difference of a few test samples can change with the seed (--seeds N)"
        if seeds == 1
        else f"means over {seeds} seeds"
    )
    return f"<p class=lead>Best — {' · '.join(parts)}. <span class=muted>({html.escape(caveat)})</span></p>"


def _run_facts(runs: dict[str, list[Path]]) -> dict[str, Any]:
    """What the runs were trained with, read from their ``metrics.json`` / ``config.yaml``."""
    facts: dict[str, Any] = {}
    for dirs in runs.values():
        for d in dirs:
            try:
                m = json.loads((d / "metrics.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if not isinstance(m, dict):
                continue
            for key in ("data", "model", "embedding_dim", "num_train", "num_test"):
                facts.setdefault(key, set()).add(str(m.get(key, "?")))
            cfg = _config_values(d / "config.yaml", ("epochs", "batch_size"))
            for key, value in cfg.items():
                facts.setdefault(key, set()).add(value)
    return {k: ", ".join(sorted(v)) for k, v in facts.items()}


def _config_values(path: Path, keys: Sequence[str]) -> dict[str, str]:
    """Top-level ``key: value`` scalars of a run's config.yaml (written by the trainer)."""
    out: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return out
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in keys and value.strip():
            out[key] = value.strip()
    return out


def _setup_line(summary: list[dict[str, Any]], runs: dict[str, list[Path]]) -> str:
    f = _run_facts(runs)
    seeds = max((int(r.get("n_seeds") or 1) for r in summary), default=1)
    losses = sum(r.get("kind") != "baseline" for r in summary)
    bits = [f"{losses} losses on {f.get('data', '?')}"]
    if "num_train" in f:
        bits[0] += f" ({f['num_train']} training / {f.get('num_test', '?')} test samples)"
    bits.append(f"{seeds} seed{'s' if seeds > 1 else ''} each")
    bits.append(f"backbone {f.get('model', '?')}")
    if "embedding_dim" in f:
        bits.append(f"embedding {f['embedding_dim']}")
    if "epochs" in f:
        bits.append(f"{f['epochs']} epoch{'' if f['epochs'] == '1' else 's'}")
    if "batch_size" in f:
        bits.append(f"batch {f['batch_size']}")
    return ", ".join(bits) + "; the same for every loss."


def _compare_table(summary: list[dict[str, Any]], cols: list[str]) -> str:
    keys = ["kind", *cols, "seconds"] if summary and "kind" in summary[0] else [*cols, "seconds"]
    keys = [k for k in keys if any(k in r for r in summary)]
    best = {m: w for m in cols if (w := _winners(summary, m)) is not None}
    body = []
    for r in summary:
        cells = [f"<td>{html.escape(str(r['loss']))}</td>"]
        for k in keys:
            v, sd = r.get(k), number(r.get(f"{k}_std"))
            text = fmt_as(k, v) + (f"<br><span class=std>± {fmt_as(k, sd)}</span>" if sd is not None else "")
            cls = " class=best" if k in best and r["loss"] in best[k][0] else ""
            cells.append(f"<td{cls}>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{header(h)}</th>" for h in ["loss", *keys])
    return f"<div class=wide><table><tr>{head}</tr>{''.join(body)}</table></div>"


def _compare_curves(evals: dict[str, dict[str, np.ndarray]]) -> list[str]:
    """Each loss's DET (per kind of pair score) and CMC curves overlaid, first seed."""
    figures = []
    for key, label in (*_PAIR_CURVES, ("identification", "open-set identification")):
        curves = [(loss, a[f"det_{key}_p_fa"], a[f"det_{key}_p_miss"]) for loss, a in evals.items()
                  if f"det_{key}_p_fa" in a]  # fmt: skip
        if not curves:
            continue
        name = label.split(",")[0].replace(" of {size}", "")
        axes = {"xlabel": "FPIR (%)", "ylabel": "FNIR (%)"} if key == "identification" else {}
        what = "cohort-normalised " if key.endswith("_normalized") else ""
        fig = det_figure(curves, title=f"DET, {what}{name}", **axes)
        figures.append(img(figure_png(fig), f"DET per loss: {what}{name}."))
    cmc = [(loss, a["cmc_rank"], a["cmc_rate"]) for loss, a in evals.items() if "cmc_rank" in a]
    if cmc:
        caption = "CMC per loss (open-set search of the test identities)."
        figures.append(img(figure_png(cmc_figure(cmc)), caption))
    if not figures:
        return []
    return ["<h2>DET and CMC curves (first seed)</h2><div class=grid>" + "".join(figures) + "</div>"]


def write_compare_report(
    out_dir: str | Path,
    summary: list[dict[str, Any]],
    runs: dict[str, list[Path]],
    *,
    title: str = "marginkit comparison",
    metrics: Sequence[str] = ("knn_accuracy", "map_at_r"),
    notes: str = "",
) -> Path:
    """Write ``out_dir/report.html`` for a comparison.

    The page opens with the best loss on each metric, then what was trained (read from the
    runs: data, backbone actually used, budget), the table (mean, and std under it when
    there are several seeds; the best cell of each metric in bold), the bar plot, the
    validation curves and the test embeddings of every loss.

    Args:
        summary: one row per loss (``loss`` plus ``metric`` / ``metric_std`` keys, ``n_seeds``).
        runs: loss → its run directories (the first seed's curves and projection are shown).
        metrics: the metrics of the bar plot.
        notes: one more sentence under the set-up (e.g. the total time).
    """
    out_dir = Path(out_dir)
    cols = _metric_columns(summary)
    parts = [f"<h1>{html.escape(title)}</h1>"]
    first = ("knn_accuracy", "head_accuracy", "map_at_r", "ver_eer", "ver_norm_eer", "tpl_eer",
             "tpl_norm_eer", "id_cmc_1")  # fmt: skip
    headline = [m for m in first if m in cols] or cols[:3]
    parts.append(winners_line(summary, headline))
    setup = _setup_line(summary, runs) if summary else ""
    parts.append(f"<p>{html.escape(' '.join(x for x in (setup, notes) if x))}</p>")
    seeds = max((int(r.get("n_seeds") or 1) for r in summary), default=1)
    heading = f"mean ± std over {seeds} seeds" if seeds > 1 else "one seed per loss"
    parts.append(f"<h2>Results on the test set ({heading})</h2>" + _compare_table(summary, cols))
    base = [r for r in summary if r.get("kind") == "baseline"]
    if base:
        items = "".join(
            f"<li><b>{html.escape(str(r['loss']))}</b>: {html.escape(str(r.get('description', '')))}</li>"
            for r in base
        )
        parts.append(
            "<p class=muted>Baselines, on the same splits and scored by the same evaluation (nothing "
            f"learned by a loss):</p><ul class=muted>{items}</ul>"
        )
    if summary:
        caption = "Test metrics per loss" + (" (error bars: std over seeds)." if seeds > 1 else ".")
        parts.append(img(_bar_plot(summary, metrics), caption))
    histories = {loss: read_jsonl(dirs[0] / "metrics.jsonl") for loss, dirs in runs.items() if dirs}
    overlay = _val_overlay(histories)
    if overlay:
        parts.append(
            "<h2>Validation curves (first seed)</h2>" + img(overlay, "Model-selection metric per epoch.")
        )
    panels = []
    evals: dict[str, dict[str, np.ndarray]] = {}
    for loss, dirs in runs.items():
        if not dirs or not (dirs[0] / "eval.npz").is_file():
            continue
        with np.load(dirs[0] / "eval.npz", allow_pickle=False) as z:
            evals[loss] = {k: z[k] for k in z.files if k.startswith(("det_", "cmc_"))}
            if "projection" in z.files:
                panels.append((loss, z["projection"], z["projection_labels"]))
    parts.extend(_compare_curves(evals))
    if panels:
        caption = "Each loss's test embeddings on their two leading principal components (colour: class)."
        pca = figure_png(projections_figure(panels))
        parts.append("<h2>Test embeddings (PCA, first seed)</h2>" + img(pca, caption))
    links = []
    for loss, dirs in runs.items():
        for d in dirs:
            if (d / "report.html").is_file():
                rel = (
                    (d / "report.html").relative_to(out_dir)
                    if d.is_relative_to(out_dir)
                    else d / "report.html"
                )
                text = f"{html.escape(loss)} — {html.escape(d.name)}"
                links.append(f'<li><a href="{html.escape(str(rel))}">{text}</a></li>')
    if links:
        parts.append("<h2>Per-run reports</h2><ul>" + "".join(links) + "</ul>")
    if (out_dir / "summary.md").is_file():  # the table above as text, once, in its own file
        parts.append('<p class=muted>The table as Markdown: <a href="summary.md">summary.md</a>; every '
                     'figure of every row: <a href="summary.json">summary.json</a>.</p>')  # fmt: skip
    path = out_dir / "report.html"
    write_html(path, title, parts)
    return path
