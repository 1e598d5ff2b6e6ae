"""Self-contained HTML reports (embedded base64 PNGs) for a run and for a comparison.

:func:`write_run_report` reads a run directory (``config.yaml``, ``metrics.jsonl``,
``metrics.json``, ``eval.npz``) and writes ``report.html`` with: the test metrics, training
curves, the confusion matrix (closed set), ROC and DET curves (open-set verification), a 2-D
PCA projection of the test embeddings, the margin-gap histogram of the cosine head and, for
alpha-divergence losses, the histogram of posterior support sizes.

:func:`write_compare_report` writes the comparison table (mean ± std over seeds), a bar
plot, validation curves of every loss and each loss's projection.

matplotlib (the ``cli`` extra) is imported lazily, through its object-oriented API with the
Agg canvas, so no global pyplot state or display is touched.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["figure_png", "write_compare_report", "write_run_report"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;
color:#222;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0;font-size:.92em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
.grid{display:flex;flex-wrap:wrap;gap:1em}.grid figure{margin:0}
figcaption{font-size:.85em;color:#555;max-width:520px}
img{max-width:100%}.muted{color:#777;font-size:.9em}code{background:#f4f4f4;padding:0 .2em}
.best{font-weight:bold}
"""


def _mpl() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("reports need matplotlib: pip install 'marginkit[cli]'") from exc
    return Figure, FigureCanvasAgg


def figure_png(fig: Any) -> str:
    """Render a matplotlib ``Figure`` to a base64 PNG string."""
    _, canvas_cls = _mpl()
    canvas_cls(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _new_figure(w: float = 5.2, h: float = 3.6) -> Any:
    figure_cls, _ = _mpl()
    return figure_cls(figsize=(w, h))


def _img(b64: str, caption: str) -> str:
    return (
        f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{b64}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"
    return html.escape(str(value))


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


# ---------------------------------------------------------------------- figures
def _curves(history: list[dict[str, Any]], title: str = "") -> str | None:
    if not history:
        return None
    fig = _new_figure(8.5, 3.2)
    ax1, ax2 = fig.subplots(1, 2)
    epochs = [r["epoch"] for r in history]
    ax1.plot(epochs, [r.get("train_loss") for r in history], marker="o", ms=3)
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("training loss")
    ax1.grid(alpha=0.3)
    for key, label in (
        ("val_knn_accuracy", "val K-NN accuracy"),
        ("val_head_accuracy", "val head accuracy"),
        ("val_precision_at_1", "val precision@1"),
    ):
        values = [r.get(key) for r in history]
        if any(v is not None for v in values):
            ax2.plot(epochs, [np.nan if v is None else v for v in values], marker="o", ms=3, label=label)
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("validation")
    ax2.grid(alpha=0.3)
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return figure_png(fig)


def _confusion(conf: np.ndarray, class_names: Sequence[str] | None) -> str:
    c = conf.shape[0]
    fig = _new_figure(min(9, 2.5 + 0.35 * c), min(8, 2 + 0.35 * c))
    ax = fig.subplots()
    rows = conf.sum(1, keepdims=True)
    norm = np.divide(conf, np.maximum(rows, 1))
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    if c <= 30:
        ticks = np.arange(c)
        labels = list(class_names) if class_names and len(class_names) == c else [str(i) for i in ticks]
        ax.set_xticks(ticks, labels, rotation=90 if c > 10 else 0, fontsize=7)
        ax.set_yticks(ticks, labels, fontsize=7)
        if c <= 15:
            for i in range(c):
                for j in range(c):
                    if conf[i, j]:
                        ax.text(j, i, str(conf[i, j]), ha="center", va="center", fontsize=7,
                                color="white" if norm[i, j] > 0.5 else "black")  # fmt: skip
    ax.set_xlabel("predicted (K-NN)")
    ax.set_ylabel("true")
    return figure_png(fig)


def _projection(points: np.ndarray, labels: np.ndarray, title: str = "", small: bool = False) -> str:
    fig = _new_figure(3.6, 3.4) if small else _new_figure(5.2, 4.6)
    ax = fig.subplots()
    classes = np.unique(labels)
    cmap = "tab10" if classes.size <= 10 else ("tab20" if classes.size <= 20 else "nipy_spectral")
    codes = np.searchsorted(classes, labels)
    ax.scatter(points[:, 0], points[:, 1], c=codes, cmap=cmap, s=4 if small else 6, alpha=0.75, linewidths=0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title or f"PCA of test embeddings ({classes.size} classes)", fontsize=9)
    return figure_png(fig)


def _histogram(values: np.ndarray, xlabel: str, *, discrete: bool = False, vline: float | None = None) -> str:
    fig = _new_figure()
    ax = fig.subplots()
    values = values[np.isfinite(values)]
    if discrete:
        lo, hi = int(values.min()), int(values.max())
        ax.hist(values, bins=np.arange(lo - 0.5, hi + 1.5, 1.0), rwidth=0.85)
    else:
        ax.hist(values, bins=50)
    if vline is not None:
        ax.axvline(vline, color="k", lw=1, ls="--")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test samples")
    ax.grid(alpha=0.3)
    return figure_png(fig)


def _probit(p: np.ndarray) -> np.ndarray:
    import torch

    return torch.special.ndtri(torch.as_tensor(np.clip(p, 1e-6, 1 - 1e-6), dtype=torch.float64)).numpy()


def _roc_det(far: np.ndarray, tar: np.ndarray) -> str:
    fig = _new_figure(9, 3.6)
    ax1, ax2 = fig.subplots(1, 2)
    keep = far > 0
    ax1.plot(far[keep], tar[keep])
    ax1.set_xscale("log")
    ax1.set_xlabel("false accept rate")
    ax1.set_ylabel("true accept rate")
    ax1.set_title("ROC", fontsize=10)
    ax1.grid(alpha=0.3, which="both")
    frr = 1 - tar
    ok = (far > 0) & (frr > 0)
    ax2.plot(_probit(far[ok]), _probit(frr[ok]))
    ticks = np.array([1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 0.99])
    labels = ["1e-5", "1e-4", "1e-3", "0.01", "0.1", "0.5", "0.9", "0.99"]
    ax2.set_xticks(_probit(ticks), labels, fontsize=7)
    ax2.set_yticks(_probit(ticks), labels, fontsize=7)
    if ok.any():
        lo_x, hi_x = _probit(far[ok]).min(), _probit(far[ok]).max()
        lo_y, hi_y = _probit(frr[ok]).min(), _probit(frr[ok]).max()
        ax2.set_xlim(lo_x - 0.2, hi_x + 0.2)
        ax2.set_ylim(lo_y - 0.2, hi_y + 0.2)
    ax2.set_xlabel("false accept rate")
    ax2.set_ylabel("false reject rate")
    ax2.set_title("DET (probit axes)", fontsize=10)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return figure_png(fig)


# ---------------------------------------------------------------------- run report
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


def _flatten(prefix: str, value: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (int, float, str, bool)) or value is None:
        out.append((prefix, value))


def write_run_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``report.html`` for a run directory; returns its path."""
    run_dir = Path(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
    history = _read_jsonl(run_dir / "metrics.jsonl")
    config_text = (
        (run_dir / "config.yaml").read_text(encoding="utf-8") if (run_dir / "config.yaml").is_file() else ""
    )
    arrays: dict[str, np.ndarray] = {}
    if (run_dir / "eval.npz").is_file():
        with np.load(run_dir / "eval.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    title = f"marginkit run — {metrics.get('loss', '?')} on {metrics.get('data', '?')}"
    parts = [f"<h1>{html.escape(title)}</h1>"]
    parts.append(
        f"<p class=muted>{html.escape(str(run_dir))} · model {html.escape(str(metrics.get('model', '?')))} · "
        f"embedding dim {metrics.get('embedding_dim', '?')} · "
        f"checkpoint {html.escape(str(metrics.get('checkpoint')))} (epoch {metrics.get('epoch', '?')}) · "
        f"fingerprint <code>{html.escape(str(metrics.get('fingerprint', '')))}</code></p>"
    )
    rows = [(label, metrics[key]) for key, label in _SCALARS if key in metrics]
    if metrics.get("open_set"):
        rows.insert(1, ("K-NN protocol", metrics.get("knn_protocol", "")))
    parts.append("<h2>Test metrics</h2>" + _table(rows, ["metric", "value"]))
    if "verification" in metrics:
        flat: list[tuple[str, Any]] = []
        _flatten("", metrics["verification"], flat)
        parts.append("<h3>Verification (held-out identities)</h3>" + _table(flat, ["metric", "value"]))
    figures = []
    curves = _curves(history)
    if curves:
        figures.append(_img(curves, "Training loss and validation metrics per epoch."))
    if "confusion" in arrays:
        figures.append(
            _img(
                _confusion(arrays["confusion"], None),
                "Confusion matrix of the K-NN classifier on the test set.",
            )
        )
    if "roc_far" in arrays:
        figures.append(
            _img(
                _roc_det(arrays["roc_far"], arrays["roc_tar"]),
                "ROC and DET curves of test pairs (held-out identities).",
            )
        )
    if "projection" in arrays:
        proj = _projection(arrays["projection"], arrays["projection_labels"])
        figures.append(_img(proj, "Test embeddings projected on their two leading principal components."))
    if "margin_gap" in arrays:
        figures.append(
            _img(
                _histogram(
                    arrays["margin_gap"], "margin gap: true-class cosine − best other cosine", vline=0.0
                ),
                "Margin gap of the cosine head on test samples (right of the dashed line = correct).",
            )
        )
    if "support_size" in arrays:
        figures.append(
            _img(
                _histogram(
                    arrays["support_size"].astype(float), "classes with non-zero probability", discrete=True
                ),
                "Support size of the sparse (alpha-softargmax) posterior on test samples.",
            )
        )
    parts.append("<h2>Figures</h2><div class=grid>" + "".join(figures) + "</div>")
    if "per_class_recall" in metrics:
        rec = [(i, r) for i, r in enumerate(metrics["per_class_recall"])]
        parts.append("<h2>Per-class recall (K-NN)</h2>" + _table(rec, ["class", "recall"]))
    if history:
        keys = [k for k in history[0] if k not in ("best",)]
        parts.append("<h2>Training log</h2>" + _table([[r.get(k) for k in keys] for r in history], keys))
    if config_text:
        parts.append(f"<h2>Configuration</h2><pre>{html.escape(config_text)}</pre>")
    path = Path(out) if out else run_dir / "report.html"
    _write_html(path, title, parts)
    return path


def _write_html(path: Path, title: str, parts: list[str]) -> None:
    doc = (
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body>{''.join(parts)}"
        "<p class=muted>Generated by marginkit.</p></body></html>\n"
    )
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(doc, encoding="utf-8")
    tmp.replace(path)


# ---------------------------------------------------------------------- compare report
def _bar_plot(summary: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    fig = _new_figure(max(6.0, 1.1 * len(summary) + 2), 3.8)
    ax = fig.subplots()
    n = len(metrics)
    width = 0.8 / max(1, n)
    x = np.arange(len(summary))
    for i, m in enumerate(metrics):
        means = [r.get(m, np.nan) if r.get(m) is not None else np.nan for r in summary]
        stds = [r.get(f"{m}_std") or 0.0 for r in summary]
        yerr = stds if any(stds) else None
        ax.bar(x + (i - (n - 1) / 2) * width, means, width, yerr=yerr, capsize=2, label=m)
    ax.set_xticks(x, [r["loss"] for r in summary], rotation=30, ha="right")
    finite = [r.get(m) for r in summary for m in metrics if isinstance(r.get(m), (int, float))]
    lo = min(finite) if finite else 0.0
    ax.set_ylim(max(0.0, lo - 0.1), 1.0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return figure_png(fig)


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
    for loss, hist in histories.items():
        key = next((k for k in ("val_knn_accuracy", "val_precision_at_1") if hist and k in hist[0]), None)
        if key:
            ax.plot([r["epoch"] for r in hist], [r.get(key) for r in hist], marker="o", ms=2, label=loss)
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation K-NN accuracy / precision@1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return figure_png(fig)


def write_compare_report(
    out_dir: str | Path,
    summary: list[dict[str, Any]],
    runs: dict[str, list[Path]],
    *,
    title: str = "marginkit comparison",
    table_markdown: str = "",
    metrics: Sequence[str] = ("knn_accuracy", "map_at_r"),
    notes: str = "",
) -> Path:
    """Write ``out_dir/report.html`` for a comparison.

    Args:
        summary: one row per loss (``loss`` plus ``metric`` / ``metric_std`` keys).
        runs: loss → its run directories (the first seed's curves and projection are shown).
        table_markdown: the text table, shown verbatim.
        metrics: the metrics of the bar plot.
    """
    out_dir = Path(out_dir)
    parts = [f"<h1>{html.escape(title)}</h1>"]
    if notes:
        parts.append(f"<p>{html.escape(notes)}</p>")
    keys = [k for k in summary[0] if not k.endswith("_std") and k not in ("loss",)] if summary else []
    best = {}
    for k in keys:
        vals = [
            r.get(k) for r in summary if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
        ]
        if vals and k not in ("seconds", "n_seeds", "epochs"):
            best[k] = max(vals)
    header = ["loss", *keys]
    body = []
    for r in summary:
        cells = [f"<td>{html.escape(r['loss'])}</td>"]
        for k in keys:
            v, s = r.get(k), r.get(f"{k}_std")
            text = _fmt(v) + (f" ± {_fmt(s)}" if isinstance(s, float) and not math.isnan(s) else "")
            cls = " class=best" if k in best and v == best[k] else ""
            cells.append(f"<td{cls}>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    parts.append(
        "<h2>Results (mean ± std over seeds)</h2><table><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in header)
        + "</tr>"
        + "".join(body)
        + "</table>"
    )
    if summary:
        parts.append(_img(_bar_plot(summary, metrics), "Test metrics per loss (error bars: std over seeds)."))
    histories = {loss: _read_jsonl(dirs[0] / "metrics.jsonl") for loss, dirs in runs.items() if dirs}
    overlay = _val_overlay(histories)
    if overlay:
        parts.append(
            "<h2>Validation curves (first seed)</h2>" + _img(overlay, "Model-selection metric per epoch.")
        )
    projections = []
    for loss, dirs in runs.items():
        if not dirs or not (dirs[0] / "eval.npz").is_file():
            continue
        with np.load(dirs[0] / "eval.npz", allow_pickle=False) as z:
            if "projection" in z.files:
                projections.append(
                    _img(_projection(z["projection"], z["projection_labels"], loss, small=True), loss)
                )
    if projections:
        parts.append(
            "<h2>Test embeddings (PCA, first seed)</h2><div class=grid>" + "".join(projections) + "</div>"
        )
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
    if table_markdown:
        parts.append(f"<h2>Table (Markdown)</h2><pre>{html.escape(table_markdown)}</pre>")
    path = out_dir / "report.html"
    _write_html(path, title, parts)
    return path
