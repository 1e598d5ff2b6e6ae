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

from marginkit.report.compare import compare_plot, lower_is_better, winners_line, write_compare_report
from marginkit.report.figures import (
    bar_figure,
    cmc_figure,
    det_figure,
    figure_png,
    projection_figure,
    projections_figure,
)
from marginkit.report.run import write_run_report

__all__ = [
    "bar_figure",
    "cmc_figure",
    "compare_plot",
    "det_figure",
    "figure_png",
    "lower_is_better",
    "projection_figure",
    "projections_figure",
    "winners_line",
    "write_compare_report",
    "write_run_report",
]
