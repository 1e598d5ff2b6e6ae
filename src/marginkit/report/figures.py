"""The reports' matplotlib figures (object-oriented API, Agg canvas: no pyplot state or display)."""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def _mpl() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("reports need matplotlib: pip install 'marginkit[cli]'") from exc
    return Figure, FigureCanvasAgg


#: Text sizes of the figures (points; at the PNG's 100 dpi a point is about 1.4 screen pixels).
LEGEND_SIZE = 9
TICK_SIZE = 8

#: Line styles and markers, cycled with the colours, so that curves are told apart without colour.
_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 1)), "x"))


def line_style(i: int) -> dict[str, Any]:
    """The ``i``-th curve's line style and marker (matplotlib keywords), cycling."""
    ls, marker = _STYLES[i % len(_STYLES)]
    return {"ls": ls, "marker": marker}


def figure_png(fig: Any) -> str:
    """Render a matplotlib ``Figure`` to a base64 PNG string."""
    _, canvas_cls = _mpl()
    canvas_cls(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _new_figure(w: float = 5.2, h: float = 3.6) -> Any:
    figure_cls, canvas_cls = _mpl()
    fig = figure_cls(figsize=(w, h))
    canvas_cls(fig)  # an Agg canvas: layout and text extents work before the PNG is written
    return fig


def _epoch_axis(ax: Any) -> None:
    """An x axis of epochs: whole numbers only (not 1.0, 1.2, … for a two-epoch run, nor 0.95 …
    1.05 around a single epoch). Call it after plotting."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("epoch")
    epochs = sorted({float(x) for line in ax.lines for x in np.asarray(line.get_xdata(), dtype=float)})
    if epochs and epochs[-1] - epochs[0] < 2:  # one or two epochs: ticks at them, half an epoch around
        ax.set_xticks(epochs, [f"{e:g}" for e in epochs])
        ax.set_xlim(epochs[0] - 0.5, epochs[-1] + 0.5)
        return
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _curves(history: list[dict[str, Any]], title: str = "") -> str | None:
    if not history:
        return None
    fig = _new_figure(8.5, 3.2)
    ax1, ax2 = fig.subplots(1, 2)
    epochs = [r["epoch"] for r in history]
    ax1.plot(epochs, [r.get("train_loss") for r in history], marker="o", ms=3)
    _epoch_axis(ax1)
    ax1.set_ylabel("training loss")
    ax1.grid(alpha=0.3)
    drawn = 0
    for key, label in (
        ("val_knn_accuracy", "val K-NN accuracy"),
        ("val_head_accuracy", "val head accuracy"),
        ("val_precision_at_1", "val precision@1"),
        ("val_eer", "val EER (lower is better)"),
    ):
        values = [r.get(key) for r in history]
        if any(v is not None for v in values):
            ax2.plot(
                epochs, [np.nan if v is None else v for v in values], ms=3, label=label, **line_style(drawn)
            )
            drawn += 1
    _epoch_axis(ax2)
    ax2.set_ylabel("validation")
    ax2.grid(alpha=0.3)
    if not drawn:
        ax2.text(0.5, 0.5, "no validation split", ha="center", va="center", transform=ax2.transAxes)
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=LEGEND_SIZE)
    if title:
        fig.suptitle(title)
    fig.tight_layout()  # the right panel's y label clear of the left panel
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
               fontsize=LEGEND_SIZE, title_fontsize=LEGEND_SIZE, markerscale=2.5, frameon=False)  # fmt: skip


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
    for i, (label, p_fa, p_miss) in enumerate(drawn):
        style = line_style(i)
        ax.plot(_probit(p_fa), _probit(p_miss), lw=1.5, label=label, ls=style["ls"])
    (zx, zy, zh) = (float(v) for v in _probit(np.array([lo_x, lo_y, hi])))
    ax.set_xlim(zx - 0.1, zh + 0.05)
    ax.set_ylim(zy - 0.1, zh + 0.05)
    both = (min(zx, zy) - 0.1, zh + 0.05)
    ax.plot(both, both, color="0.6", lw=0.8, ls="--", label="_EER line")
    for lo, set_ticks in ((lo_x, ax.set_xticks), (lo_y, ax.set_yticks)):
        ticks = _det_ticks(lo, hi)
        set_ticks(_probit(np.array(ticks)), [_percent(t) for t in ticks], fontsize=TICK_SIZE)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if any(label for label, _, _ in drawn):
        # Below-left of every DET curve lies no curve (both error rates lower than any point
        # the systems reach): the legend there hides none of them.
        ax.legend(fontsize=LEGEND_SIZE, loc="lower left")
    fig.tight_layout()
    return fig


def cmc_figure(curves: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> Any:
    """CMC curves ``(label, ranks, rates)``: identification rate of the mated probes by rank."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    fig = _new_figure(4.6, 4.2)
    ax = fig.subplots()
    low, top = 1.0, 1
    for i, (label, ranks, rates) in enumerate(curves):
        style = line_style(i)
        marker = style["marker"] if len(ranks) <= 20 else None
        ax.plot(ranks, rates, ls=style["ls"], marker=marker, ms=3, lw=1.5, label=label)
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
        ax.legend(fontsize=LEGEND_SIZE, loc="lower right")
    fig.tight_layout()
    return fig


def bar_figure(summary: list[dict[str, Any]], metrics: Sequence[str]) -> Any:
    """Grouped bars, one group per loss; the legend sits above the axes (never on a bar) and
    the loss names are drawn inside the figure (``tight_layout``)."""
    fig = _new_figure(max(6.0, 1.0 * len(summary) + 2.5), 4.0)
    ax = fig.subplots()
    n = len(metrics)
    width = 0.8 / max(1, n)
    x = np.arange(len(summary))
    baseline = [r.get("kind") == "baseline" for r in summary]
    for i, m in enumerate(metrics):
        means = [r.get(m, np.nan) if r.get(m) is not None else np.nan for r in summary]
        stds = [r.get(f"{m}_std") or 0.0 for r in summary]
        yerr = stds if any(stds) else None
        bars = ax.bar(x + (i - (n - 1) / 2) * width, means, width, yerr=yerr, capsize=2, label=m)
        for bar, base in zip(bars, baseline, strict=True):
            if base:  # a baseline's bars hatched: nothing learned by a loss
                bar.set_hatch("//")
                bar.set_alpha(0.6)
    names = [
        f"{r['loss']}\n(baseline)" if base else r["loss"] for r, base in zip(summary, baseline, strict=True)
    ]
    crowded = max((len(nm) for nm in names), default=0) * len(names) > 70
    ax.set_xticks(x, names, rotation=30 if crowded else 0, ha="right" if crowded else "center",
                  rotation_mode="anchor")  # fmt: skip
    ax.set_xlim(-0.6, len(summary) - 0.4)
    finite = [r.get(m) for r in summary for m in metrics if isinstance(r.get(m), (int, float))]
    lo = min(finite) if finite else 0.0
    bottom = max(0.0, math.floor((lo - 0.05) * 10) / 10)
    ax.set_ylim(bottom, 1.0)
    ax.set_ylabel("score (higher is better)" + (f"; axis from {bottom:g}" if bottom > 0 else ""))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(
        fontsize=LEGEND_SIZE, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=max(1, n), frameon=False
    )
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
