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
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "bar_figure",
    "cmc_figure",
    "det_figure",
    "figure_png",
    "lower_is_better",
    "projection_figure",
    "projections_figure",
    "winners_line",
    "write_compare_report",
    "write_run_report",
]

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
.lead{font-size:1.05em;background:#f6f8fa;border-left:4px solid #4c72b0;padding:.5em .8em}
.wide{overflow-x:auto;max-width:100%}.std{color:#666;font-size:.85em;white-space:nowrap}
th{vertical-align:bottom}
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
    figure_cls, canvas_cls = _mpl()
    fig = figure_cls(figsize=(w, h))
    canvas_cls(fig)  # an Agg canvas: layout and text extents work before the PNG is written
    return fig


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


def _fmt_as(key: str, value: Any) -> str:
    """``value`` formatted for the column (or metric) ``key``: seconds with one decimal,
    rates as whole numbers, learning rates with three significant digits."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        if key.endswith("seconds") or key == "seconds":
            return f"{value:.1f} s"
        if key.endswith("per_second"):
            return f"{value:,.0f}"
        if key in ("lr", "learning rate"):
            return f"{value:.3g}"
    return _fmt(value)


def _header(name: str) -> str:
    """A column name that may wrap after its underscores (long metric names)."""
    return "_<wbr>".join(html.escape(part) for part in name.split("_"))


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str], keys: Sequence[str] | None = None) -> str:
    keys = list(keys) if keys is not None else list(header)
    head = "".join(f"<th>{_header(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{_fmt_as(k, v)}</td>" for k, v in zip(keys, row, strict=False)) + "</tr>"
        for row in rows
    )
    return f"<div class=wide><table><tr>{head}</tr>{body}</table></div>"


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


#: Classes up to which projections get one colour and one legend entry each.
_LEGEND_CLASSES = 20


def _scatter_classes(
    ax: Any, points: np.ndarray, labels: np.ndarray, classes: np.ndarray, size: float
) -> None:
    """One colour per class of ``classes`` (shared across panels), each a legend entry."""
    import matplotlib

    if classes.size > _LEGEND_CLASSES:
        codes = np.searchsorted(classes, labels)
        ax.scatter(points[:, 0], points[:, 1], c=codes, cmap="turbo", vmin=0, vmax=classes.size - 1,
                   s=size, alpha=0.75, linewidths=0)  # fmt: skip
    else:
        cmap = matplotlib.colormaps["tab10" if classes.size <= 10 else "tab20"]
        for i, c in enumerate(classes):
            keep = labels == c
            ax.scatter(points[keep, 0], points[keep, 1], color=cmap(i), s=size, alpha=0.75, linewidths=0,
                       label=str(c))  # fmt: skip
    ax.set_xticks([])
    ax.set_yticks([])


def _class_legend(fig: Any, ax: Any, classes: np.ndarray) -> None:
    if classes.size > _LEGEND_CLASSES:
        return  # too many to tell apart; the caption says how many
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, title="class", loc="center left", bbox_to_anchor=(1.0, 0.5),
               fontsize=8, title_fontsize=8, markerscale=2.5, frameon=False)  # fmt: skip


def _projection(points: np.ndarray, labels: np.ndarray) -> str:
    return figure_png(projection_figure(points, labels))


def projection_figure(points: np.ndarray, labels: np.ndarray) -> Any:
    """The 2-D projection of one run, one colour per class and a class legend (≤ 20 classes)."""
    fig = _new_figure(5.2, 4.6)
    ax = fig.subplots()
    classes = np.unique(labels)
    _scatter_classes(ax, points, labels, classes, 6)
    ax.set_title(f"PCA of test embeddings ({classes.size} classes)", fontsize=9)
    fig.tight_layout()
    _class_legend(fig, ax, classes)
    return fig


def projections_figure(panels: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> Any:
    """Several losses' projections side by side (four per row), one class legend for all."""
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = _new_figure(3.0 * cols, 2.9 * rows)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    classes = np.unique(np.concatenate([labels for _, _, labels in panels]))
    for ax, (title, points, labels) in zip(axes, panels, strict=False):
        _scatter_classes(ax, points, labels, classes, 4)
        ax.set_title(title, fontsize=10)
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    fig.tight_layout()
    _class_legend(fig, axes[0], classes)
    return fig


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
    import torch  # (report sits beside metrics in the layers: torch's ndtri, as metrics.normal_deviate)

    return torch.special.ndtri(torch.as_tensor(np.clip(p, 1e-6, 1 - 1e-6), dtype=torch.float64)).numpy()


def _roc(far: np.ndarray, tar: np.ndarray) -> str:
    fig = _new_figure(4.6, 4.2)
    ax = fig.subplots()
    keep = far > 0
    ax.plot(far[keep], tar[keep])
    ax.set_xscale("log")
    ax.set_xlabel("false accept rate")
    ax.set_ylabel("true accept rate")
    ax.set_title("ROC of test pairs", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return figure_png(fig)


#: Tick rates of DET axes (labelled in per cent, as in speaker-recognition papers), by priority:
#: a tick of a later level is drawn only where it does not crowd those already placed.
_DET_TICKS = (
    (1e-5, 1e-4, 1e-3, 0.01, 0.1, 0.4),
    (0.05, 0.2, 0.8),
    (5e-3, 0.02, 0.6, 0.9),
    (2e-3, 0.95, 0.99),
)


def _percent(p: float) -> str:
    return f"{100 * p:.3g}"


def _det_ticks(lo: float, hi: float) -> list[float]:
    """The DET ticks within ``[lo, hi]``, at least a tenth of the axis apart (normal deviates)."""
    z_lo, z_hi = (float(v) for v in _probit(np.array([lo, hi])))
    gap = (z_hi - z_lo) / 10
    kept: dict[float, float] = {}  # tick -> its deviate
    for level in _DET_TICKS:
        for t, z in zip(level, _probit(np.array(level)).tolist(), strict=True):
            if z_lo - 1e-9 <= z <= z_hi + 1e-9 and all(abs(z - k) >= gap for k in kept.values()):
                kept[t] = z
    return sorted(kept)


def det_figure(
    curves: Sequence[tuple[str, np.ndarray, np.ndarray]],
    *,
    xlabel: str = "false-alarm rate (%)",
    ylabel: str = "miss rate (%)",
    title: str = "DET",
) -> Any:
    """DET curves ``(label, p_fa, p_miss)`` on normal-deviate axes with ticks in %, the dashed
    diagonal marking the equal-error points.

    Both rates are drawn up to ``hi`` = 40 % (more for curves whose equal-error rate is high),
    each axis down to the smallest non-zero rate the curves reach inside that box; rates of 0
    or 1 (infinite deviates) are left out."""
    fig = _new_figure(4.6, 4.2)
    ax = fig.subplots()
    drawn = []
    for label, p_fa, p_miss in curves:
        p_fa, p_miss = np.asarray(p_fa, np.float64), np.asarray(p_miss, np.float64)
        ok = (p_fa > 0) & (p_fa < 1) & (p_miss > 0) & (p_miss < 1)
        if ok.any():
            drawn.append((label, p_fa[ok], p_miss[ok]))
    eer = 0.0  # the largest (approximate) equal-error rate drawn
    for _, a, b in drawn:
        i = int(np.argmin(np.abs(a - b)))
        eer = max(eer, float(a[i] + b[i]) / 2)
    hi = min(0.99, max(0.4, 2.5 * eer))
    lo_x = min((float(a[b <= hi].min()) for _, a, b in drawn if (b <= hi).any()), default=1e-3)
    lo_y = min((float(b[a <= hi].min()) for _, a, b in drawn if (a <= hi).any()), default=1e-3)
    lo_x, lo_y = max(lo_x, 1e-6), max(lo_y, 1e-6)
    for label, p_fa, p_miss in drawn:
        ax.plot(_probit(p_fa), _probit(p_miss), lw=1.5, label=label)
    (zx, zy, zh) = (float(v) for v in _probit(np.array([lo_x, lo_y, hi])))
    ax.set_xlim(zx - 0.1, zh + 0.05)
    ax.set_ylim(zy - 0.1, zh + 0.05)
    both = (min(zx, zy) - 0.1, zh + 0.05)
    ax.plot(both, both, color="0.6", lw=0.8, ls="--", label="_EER line")
    for lo, set_ticks in ((lo_x, ax.set_xticks), (lo_y, ax.set_yticks)):
        ticks = _det_ticks(lo, hi)
        set_ticks(_probit(np.array(ticks)), [_percent(t) for t in ticks], fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if any(label for label, _, _ in drawn):
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def cmc_figure(curves: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> Any:
    """CMC curves ``(label, ranks, rates)``: identification rate of the mated probes by rank."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    fig = _new_figure(4.6, 4.2)
    ax = fig.subplots()
    low, top = 1.0, 1
    for label, ranks, rates in curves:
        ax.plot(ranks, rates, marker="o" if len(ranks) <= 20 else None, ms=3, lw=1.5, label=label)
        if len(rates):
            low, top = min(low, float(np.min(rates))), max(top, int(np.max(ranks)))
    if top > 20:
        ax.set_xscale("log")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0.8 if top > 20 else 0.5, top * 1.1 if top > 20 else top + 0.5)
    ax.set_ylim(max(0.0, math.floor((low - 0.05) * 10) / 10), 1.005)
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
    ax.set_xlabel("rank")
    ax.set_ylabel("identification rate (mated probes)")
    ax.set_title("CMC", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    if len(curves) > 1:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


#: The kinds of pair score of a run: the metrics key (and ``eval.npz``'s ``det_<key>_p_fa``), the
#: label of its DET curve and the heading of its metrics section.
_PAIR_SCORES = (
    ("verification", "test pairs", "Verification (test pairs)"),
    ("verification_normalized", "test pairs, {norm}", "Verification, cohort-normalised scores"),
    ("templates", "templates of {size}", "Template verification (IJB pooling)"),
    ("templates_normalized", "templates of {size}, {norm}",
     "Template verification, cohort-normalised scores"),
)  # fmt: skip
_PAIR_CURVES = tuple((key, label) for key, label, _ in _PAIR_SCORES)


def _pair_dets(arrays: dict[str, np.ndarray], metrics: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    proto = metrics.get("protocol") if isinstance(metrics.get("protocol"), dict) else {}
    out = []
    for key, label in _PAIR_CURVES:
        if f"det_{key}_p_fa" in arrays:
            text = label.format(norm=proto.get("norm"), size=proto.get("template_size"))
            out.append((text, arrays[f"det_{key}_p_fa"], arrays[f"det_{key}_p_miss"]))
    if not out and "roc_far" in arrays:  # a run evaluated before the DET arrays were stored
        out.append(("test pairs", arrays["roc_far"], 1 - arrays["roc_tar"]))
    return out


def _identification_figures(arrays: dict[str, np.ndarray]) -> list[str]:
    figures = []
    if "cmc_rank" in arrays:
        figures.append(_img(figure_png(cmc_figure([("", arrays["cmc_rank"], arrays["cmc_rate"])])),
                            "CMC of the open-set search: share of mated probes whose identity is "
                            "within the first k gallery labels."))  # fmt: skip
    if "det_identification_p_fa" in arrays:
        fig = det_figure([("", arrays["det_identification_p_fa"], arrays["det_identification_p_miss"])],
                         xlabel="FPIR (%)", ylabel="FNIR (%)", title="open-set DET")  # fmt: skip
        figures.append(_img(figure_png(fig), "Open-set identification: false-negative identification rate "
                            "against false-positive identification rate (non-mated probes)."))  # fmt: skip
    return figures


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


_METRIC_SECTIONS = (
    *((key, heading) for key, _, heading in _PAIR_SCORES),
    ("identification", "Open-set identification (1:N)"),
)


def _flatten(prefix: str, value: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (int, float, str, bool)) or value is None:
        out.append((prefix, value))
    elif isinstance(value, (list, tuple)) and len(value) == 2 and all(_number(v) is not None for v in value):
        out.append((prefix, f"[{_fmt(float(value[0]))}, {_fmt(float(value[1]))}]"))  # an interval


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
}  # fmt: skip


def _metric_label(key: str, section: str) -> str:
    """``tar_at_far.0.01`` → ``TAR @ FAR 0.01``; ``dcf_params.c_miss`` → ``DCF C_miss``;
    ``thresholds.x`` → ``threshold @ FAR x`` (``FPIR`` in the identification block). The rates
    are float keys, so the dotted path is split at the first name that takes one."""
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
        if _number(metrics.get(key)) is not None:
            bits.append(f"{label} <b>{_fmt(float(metrics[key]))}</b>")
    for key, label in (
        ("verification", "EER"), ("verification_normalized", "normalised EER"),
        ("templates", "template EER"), ("templates_normalized", "normalised template EER"),
    ):  # fmt: skip
        block = metrics.get(key)
        if isinstance(block, dict) and _number(block.get("eer")) is not None:
            bits.append(f"{label} <b>{_fmt(float(block['eer']))}</b>")
    ident = metrics.get("identification")
    if isinstance(ident, dict) and _number((ident.get("cmc") or {}).get("1")) is not None:
        bits.append(f"open-set rank-1 <b>{_fmt(float(ident['cmc']['1']))}</b>")
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
    history = _read_jsonl(run_dir / "metrics.jsonl")
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
    rows = [(label, metrics[key]) for key, label in _SCALARS if key in metrics]
    if metrics.get("open_set"):
        rows.insert(1, ("K-NN protocol", metrics.get("knn_protocol", "")))
    parts.append("<h2>Test metrics</h2>" + _table(rows, ["metric", "value"]))
    for key, heading in _METRIC_SECTIONS:
        if isinstance(metrics.get(key), dict):
            flat: list[tuple[str, Any]] = []
            _flatten("", metrics[key], flat)
            flat = [(_metric_label(name, key), value) for name, value in flat]
            parts.append(f"<h3>{heading}</h3>" + _table(flat, ["metric", "value"]))
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
        figures.append(_img(_roc(arrays["roc_far"], arrays["roc_tar"]), "ROC of test pairs."))
    dets = _pair_dets(arrays, metrics)
    if dets:
        caption = ("DET curves of pair scores: miss against false-alarm rate on normal-deviate axes "
                   "(accept iff score > threshold).")  # fmt: skip
        figures.append(_img(figure_png(det_figure(dets)), caption))
    figures.extend(_identification_figures(arrays))
    if "projection" in arrays:
        proj = _projection(arrays["projection"], arrays["projection_labels"])
        figures.append(
            _img(proj, "Test embeddings projected on their two leading principal components (colour: class).")
        )
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
    return figure_png(bar_figure(summary, metrics))


def bar_figure(summary: list[dict[str, Any]], metrics: Sequence[str]) -> Any:
    """Grouped bars, one group per loss; the legend sits above the axes (never on a bar) and
    the loss names are drawn inside the figure (``tight_layout``)."""
    fig = _new_figure(max(6.0, 1.0 * len(summary) + 2.5), 4.0)
    ax = fig.subplots()
    n = len(metrics)
    width = 0.8 / max(1, n)
    x = np.arange(len(summary))
    for i, m in enumerate(metrics):
        means = [r.get(m, np.nan) if r.get(m) is not None else np.nan for r in summary]
        stds = [r.get(f"{m}_std") or 0.0 for r in summary]
        yerr = stds if any(stds) else None
        ax.bar(x + (i - (n - 1) / 2) * width, means, width, yerr=yerr, capsize=2, label=m)
    names = [r["loss"] for r in summary]
    crowded = max((len(nm) for nm in names), default=0) * len(names) > 70
    ax.set_xticks(x, names, rotation=30 if crowded else 0, ha="right" if crowded else "center",
                  rotation_mode="anchor")  # fmt: skip
    ax.set_xlim(-0.6, len(summary) - 0.4)
    finite = [r.get(m) for r in summary for m in metrics if isinstance(r.get(m), (int, float))]
    lo = min(finite) if finite else 0.0
    ax.set_ylim(max(0.0, math.floor((lo - 0.05) * 10) / 10), 1.0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=max(1, n), frameon=False)
    fig.tight_layout()
    return fig


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
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)  # off the curves
    fig.tight_layout()
    return figure_png(fig)


#: Summary keys that are bookkeeping or settings, not metrics (never a "best").
_NOT_METRICS = ("loss", "kind", "n_seeds", "runs", "seconds", "epochs")


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


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _winners(summary: list[dict[str, Any]], metric: str) -> tuple[list[str], float] | None:
    """The losses with the best mean of ``metric`` (several on an exact tie) and that mean."""
    vals = [(r["loss"], v) for r in summary if (v := _number(r.get(metric))) is not None]
    if not vals:
        return None
    best = (min if lower_is_better(metric) else max)(v for _, v in vals)
    return [loss for loss, v in vals if v == best], best


def _within_noise(summary: list[dict[str, Any]], metric: str, winners: list[str], best: float) -> list[str]:
    """Other losses whose mean is within the summed std of the winner's (several seeds only)."""
    top = next(r for r in summary if r["loss"] == winners[0])
    s_top = _number(top.get(f"{metric}_std"))
    out = []
    for r in summary:
        v, s = _number(r.get(metric)), _number(r.get(f"{metric}_std"))
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
        text = f"{_header(m)}: <b>{html.escape(' = '.join(names))}</b> {_fmt(best)}"
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
    bits = [f"{len(summary)} losses on {f.get('data', '?')}"]
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
            v, sd = r.get(k), _number(r.get(f"{k}_std"))
            text = _fmt_as(k, v) + (
                f"<br><span class=std>± {_fmt_as(k, sd)}</span>" if sd is not None else ""
            )
            cls = " class=best" if k in best and r["loss"] in best[k][0] else ""
            cells.append(f"<td{cls}>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{_header(h)}</th>" for h in ["loss", *keys])
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
        figures.append(_img(figure_png(fig), f"DET per loss: {what}{name}."))
    cmc = [(loss, a["cmc_rank"], a["cmc_rate"]) for loss, a in evals.items() if "cmc_rank" in a]
    if cmc:
        caption = "CMC per loss (open-set search of the test identities)."
        figures.append(_img(figure_png(cmc_figure(cmc)), caption))
    if not figures:
        return []
    return ["<h2>DET and CMC curves (first seed)</h2><div class=grid>" + "".join(figures) + "</div>"]


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

    The page opens with the best loss on each metric, then what was trained (read from the
    runs: data, backbone actually used, budget), the table (mean, and std under it when
    there are several seeds; the best cell of each metric in bold), the bar plot, the
    validation curves and the test embeddings of every loss.

    Args:
        summary: one row per loss (``loss`` plus ``metric`` / ``metric_std`` keys, ``n_seeds``).
        runs: loss → its run directories (the first seed's curves and projection are shown).
        table_markdown: the text table, shown verbatim.
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
    if summary:
        caption = "Test metrics per loss" + (" (error bars: std over seeds)." if seeds > 1 else ".")
        parts.append(_img(_bar_plot(summary, metrics), caption))
    histories = {loss: _read_jsonl(dirs[0] / "metrics.jsonl") for loss, dirs in runs.items() if dirs}
    overlay = _val_overlay(histories)
    if overlay:
        parts.append(
            "<h2>Validation curves (first seed)</h2>" + _img(overlay, "Model-selection metric per epoch.")
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
        parts.append("<h2>Test embeddings (PCA, first seed)</h2>" + _img(pca, caption))
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
