"""HTML reports: self-contained (embedded PNGs, no external resources), the right figures."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from marginkit.report import lower_is_better, winners_line, write_compare_report, write_run_report
from marginkit.train.evaluate import confusion_matrix, pca_2d, roc_curve

PNG = b"\x89PNG\r\n\x1a\n"


def images(html_text: str) -> list[bytes]:
    return [
        base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html_text)
    ]


def assert_self_contained(html_text: str) -> None:
    # no external resources: every src/href to an image, script or stylesheet is inline
    assert not re.search(r"<(script|link)[^>]*(src|href)=", html_text)
    for src in re.findall(r'src="([^"]+)"', html_text):
        assert src.startswith("data:image/png;base64,")
    assert all(img.startswith(PNG) for img in images(html_text))


def fake_run(run_dir: Path, *, open_set: bool, alpha: bool, gen: torch.Generator) -> Path:
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("loss: qmargin\nepochs: 2\n")
    rows = [
        {
            "epoch": 1,
            "train_loss": 1.0,
            "lr": 0.001,
            "val_knn_accuracy": 0.8,
            "epoch_seconds": 1.0,
            "best": True,
        },
        {
            "epoch": 2,
            "train_loss": 0.5,
            "lr": 0.0005,
            "val_knn_accuracy": 0.9,
            "epoch_seconds": 1.0,
            "best": True,
        },
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = {"loss": "qmargin", "data": "toy", "open_set": open_set, "k": 5, "knn_accuracy": 0.9,
               "precision_at_1": 0.91, "map_at_r": 0.7, "model": "mlp", "checkpoint": "best.pt", "epoch": 2,
               "fingerprint": "sha256:abc<script>"}  # fmt: skip
    labels = torch.randint(0, 4, (60,), generator=gen)
    arrays = {
        "projection": torch.randn(60, 2, generator=gen).numpy(),
        "projection_labels": labels.numpy(),
    }
    if open_set:
        scores = torch.rand(200, generator=gen)
        genuine = torch.rand(200, generator=gen) < scores
        arrays["roc_far"], arrays["roc_tar"] = roc_curve(scores, genuine)
        metrics["verification"] = {"eer": 0.2, "tar_at_far": {"0.01": 0.5, "0.0001": None}}
    else:
        arrays["confusion"] = confusion_matrix(labels, labels, 4).numpy()
        arrays["margin_gap"] = torch.randn(60, generator=gen).numpy()
        metrics["head_accuracy"] = 0.88
        metrics["per_class_recall"] = [1.0, 0.5, None, 1.0]
    if alpha:
        arrays["support_size"] = torch.randint(1, 4, (60,), generator=gen).numpy()
        metrics["support_size_mean"] = 2.0
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    np.savez(run_dir / "eval.npz", **arrays)
    return run_dir


def fake_runs(
    root: Path, losses: tuple[str, ...], *, open_set: bool, gen: torch.Generator
) -> dict[str, list[Path]]:
    """One fake first-seed run per loss under ``root/runs``, as a comparison lays them out."""
    runs = {}
    for loss in losses:
        d = root / "runs" / loss / "seed0"
        d.parent.mkdir(parents=True)
        runs[loss] = [fake_run(d, open_set=open_set, alpha=False, gen=gen)]
    return runs


def test_closed_set_run_report(tmp_path, gen):
    run = fake_run(tmp_path / "r", open_set=False, alpha=True, gen=gen)
    path = write_run_report(run)
    text = path.read_text()
    assert_self_contained(text)
    # curves, confusion matrix, projection, margin gap, support size
    assert len(images(text)) == 5
    for caption in (
        "Confusion matrix",
        "Margin gap",
        "Support size",
        "principal components",
        "Training loss",
    ):
        assert caption in text
    assert "ROC and DET" not in text
    assert "&lt;script&gt;" in text and "<script>" not in text  # values are escaped
    assert "Per-class recall" in text


def test_open_set_run_report_has_roc_det_and_no_confusion(tmp_path, gen):
    run = fake_run(tmp_path / "r", open_set=True, alpha=False, gen=gen)
    text = write_run_report(run).read_text()
    assert_self_contained(text)
    assert "ROC of test pairs" in text and "DET curves of pair scores" in text
    assert "Confusion matrix" not in text and "Support size" not in text
    assert "TAR @ FAR 0.01" in text and len(images(text)) == 4  # curves, ROC, DET (from the ROC), PCA
    assert "tar_at_far" not in text


def test_metric_blocks_have_readable_labels_and_intervals(tmp_path, gen):
    run = fake_run(tmp_path / "r", open_set=True, alpha=False, gen=gen)
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["verification"].update(
        thresholds={"0.01": 0.7}, dcf_params={"p_target": 0.01, "c_miss": 1.0, "c_fa": 1.0},
        confidence_intervals={"level": 0.95, "tar_at_far": {"0.01": [0.4, 0.6]}, "eer": [0.15, 0.25]},
    )  # fmt: skip
    metrics["identification"] = {"cmc": {"1": 0.9}, "dir_at_fpir": {"0.01": 0.5}, "thresholds": {"0.01": 0.8},
                                 "num_mated": 10, "num_nonmated": 20}  # fmt: skip
    (run / "metrics.json").write_text(json.dumps(metrics))
    text = write_run_report(run).read_text()
    cells = re.findall(r"<td>([^<]*)</td>", text)
    for label in ("TAR @ FAR 0.01", "threshold @ FAR 0.01", "DCF C_miss", "CI: TAR @ FAR 0.01", "CI: EER",
                  "CMC rank 1", "DIR @ FPIR 0.01", "threshold @ FPIR 0.01", "non-mated probes"):  # fmt: skip
        assert label in cells, label
    assert "[0.1500, 0.2500]" in cells  # an interval is shown, not dropped
    assert not any("_" in c and "." in c for c in cells if not c[:1].isdigit())  # no raw dotted keys


def test_det_axes_are_normal_deviates_labelled_in_percent():
    from marginkit.metrics import det_curve, normal_deviate
    from marginkit.report import det_figure

    gen = torch.Generator().manual_seed(0)
    genuine = torch.arange(4000) < 1000
    scores = torch.randn(4000, generator=gen) + 2.5 * genuine  # EER ~ 10 %
    d = det_curve(scores, genuine)
    fig = det_figure([("a", d["p_fa"].numpy(), d["p_miss"].numpy())])
    ax = fig.axes[0]
    for ticks, labels in ((ax.get_xticks(), ax.get_xticklabels()), (ax.get_yticks(), ax.get_yticklabels())):
        rates = [float(t.get_text()) / 100 for t in labels]
        assert np.allclose(ticks, normal_deviate(torch.tensor(rates)).numpy())  # at Φ⁻¹(p), text p in %
        assert {"10", "40"} <= {t.get_text() for t in labels} and len(labels) >= 4
        assert min(np.diff(ticks)) >= (ticks[-1] - ticks[0]) / 12  # none crowded
    lo, hi = ax.get_xlim()
    z = normal_deviate(torch.tensor([0.012, 0.4])).tolist()  # the curve leaves the 40 % box at ~1.2 % FA
    assert lo <= z[0] and z[1] <= hi
    line = ax.get_lines()[0]  # the curve: exact operating points, inside the rates (0, 1)
    assert np.all(np.isfinite(line.get_xdata())) and np.all(np.diff(line.get_xdata()) <= 0)


def test_run_report_draws_cmc_and_open_set_det_and_compare_overlays_them(tmp_path, gen):
    runs = fake_runs(tmp_path, ("softmax", "circle"), open_set=True, gen=gen)
    for (d,) in runs.values():
        with np.load(d / "eval.npz") as z:
            arrays = dict(z)
        arrays["cmc_rank"], arrays["cmc_rate"] = np.arange(1, 11), np.linspace(0.5, 1.0, 10)
        arrays["det_identification_p_fa"] = np.linspace(1.0, 0.0, 50)
        arrays["det_identification_p_miss"] = np.linspace(0.0, 1.0, 50) ** 0.5
        np.savez(d / "eval.npz", **arrays)
        text = write_run_report(d).read_text()
        assert "CMC of the open-set search" in text and "Open-set identification" in text
    summary = [{"loss": "softmax", "ver_eer": 0.2}, {"loss": "circle", "ver_eer": 0.1}]
    text = write_compare_report(tmp_path, summary, runs).read_text()
    assert_self_contained(text)
    assert "CMC per loss" in text and "DET per loss: open-set identification" in text


def test_compare_report(tmp_path, gen):
    runs = fake_runs(tmp_path, ("softmax", "triplet"), open_set=False, gen=gen)
    for (d,) in runs.values():
        write_run_report(d)
    summary = [
        {
            "loss": "softmax",
            "knn_accuracy": 0.9,
            "knn_accuracy_std": 0.01,
            "map_at_r": 0.7,
            "map_at_r_std": None,
        },
        {
            "loss": "triplet",
            "knn_accuracy": 0.92,
            "knn_accuracy_std": 0.02,
            "map_at_r": 0.75,
            "map_at_r_std": None,
        },
    ]
    for row in summary:
        row["reused_runs"] = 0  # bookkeeping of compare: not a column of the report
    text = write_compare_report(tmp_path, summary, runs).read_text()
    assert_self_contained(text)
    assert "reused" not in text
    assert "0.9200<br><span class=std>± 0.0200</span>" in text and "class=best" in text
    assert 'href="runs/softmax/seed0/report.html"' in text
    assert len(images(text)) == 3  # bar plot, validation curves, the projections of both losses


def test_roc_curve_matches_brute_force(gen):
    scores = torch.randint(0, 5, (50,), generator=gen).float()  # many ties
    genuine = torch.rand(50, generator=gen) < 0.4
    far, tar = roc_curve(scores, genuine)
    thresholds = sorted(set(scores.tolist()), reverse=True)
    n_g, n_i = int(genuine.sum()), int((~genuine).sum())
    expect_far = [0.0] + [float(((scores >= t) & ~genuine).sum()) / n_i for t in thresholds]
    expect_tar = [0.0] + [float(((scores >= t) & genuine).sum()) / n_g for t in thresholds]
    assert np.allclose(far, expect_far) and np.allclose(tar, expect_tar)


def test_pca_2d_matches_numpy_svd(gen):
    x = torch.randn(40, 6, generator=gen) * torch.tensor([5.0, 3.0, 1.0, 0.5, 0.2, 0.1])
    p = pca_2d(x).numpy()
    xc = x.double().numpy() - x.double().numpy().mean(0)
    _, _, vt = np.linalg.svd(xc, full_matrices=False)
    ref = xc @ vt[:2].T
    for j in range(2):  # equal up to the sign of each axis
        assert np.allclose(np.abs(p[:, j]), np.abs(ref[:, j]), atol=1e-4)
    assert p[:, 0].var() >= p[:, 1].var()


def test_confusion_matrix_counts():
    pred = torch.tensor([0, 1, 1, 2, 2, 2])
    true = torch.tensor([0, 1, 2, 2, 2, 0])
    conf = confusion_matrix(pred, true, 3)
    assert conf.tolist() == [[1, 0, 1], [0, 1, 0], [0, 1, 2]]


@pytest.mark.slow
def test_demo_like_end_to_end(tmp_path, capsys):
    """A short demo (two losses, one epoch) through the command line: summary.json + report."""
    from marginkit.cli import main

    code = main(
        ["demo", "--out", str(tmp_path / "d"), "--epochs", "1", "--losses", "softmax,local_triplet", "-q"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "| softmax |" in out and "report" in out
    rows = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert [r["loss"] for r in rows] == ["softmax", "local_triplet", "raw_1nn", "logistic"]
    losses = rows[:2]
    assert all({"loss", "knn_accuracy", "map_at_r"} <= set(r) for r in losses)
    assert max(r["knn_accuracy"] for r in losses) > 0.5  # one epoch on mnist1d: far above chance (0.1)
    assert 0.5 < rows[2]["knn_accuracy"] < 0.6 and 0.3 < rows[3]["head_accuracy"] < 0.36  # SPEC §7's figures
    assert_self_contained((tmp_path / "d" / "report.html").read_text())


# ---------------------------------------------------------------- what a reader sees (issue 14)
def compare_fixture(tmp_path: Path, gen: torch.Generator, *, seeds: int, model: str = "cnn1d") -> tuple:
    """Two losses trained like `marginkit compare` leaves them: run dirs and the summary rows."""
    runs = {}
    for loss in ("softmax", "triplet"):
        d = tmp_path / "runs" / loss / "seed0"
        d.parent.mkdir(parents=True)
        fake_run(d, open_set=False, alpha=False, gen=gen)
        m = json.loads((d / "metrics.json").read_text())
        m.update(loss=loss, model=model, embedding_dim=64, num_train=900, num_test=300)
        (d / "metrics.json").write_text(json.dumps(m))
        runs[loss] = [d]
    std = 0.01 if seeds > 1 else None
    summary = [
        {"loss": "softmax", "n_seeds": seeds, "knn_accuracy": 0.9, "knn_accuracy_std": std, "map_at_r": 0.8,
         "map_at_r_std": std, "kind": "class", "seconds": 4.5020, "runs": [str(runs["softmax"][0])]},
        {"loss": "triplet", "n_seeds": seeds, "knn_accuracy": 0.95, "knn_accuracy_std": std, "map_at_r": 0.79,
         "map_at_r_std": std, "kind": "pair", "seconds": 12.25, "runs": [str(runs["triplet"][0])]},
    ]  # fmt: skip
    return runs, summary


def test_compare_report_says_who_won_on_which_metric(tmp_path, gen):
    runs, summary = compare_fixture(tmp_path, gen, seeds=1)
    text = write_compare_report(tmp_path, summary, runs).read_text()
    lead = re.search(r"<p class=lead>(.*?)</p>", text).group(1)
    assert text.index("<p class=lead>") < text.index("<table")  # at the top, before the table
    assert (
        "knn_<wbr>accuracy: <b>triplet</b> 0.9500" in lead
        and "map_<wbr>at_<wbr>r: <b>softmax</b> 0.8000" in lead
    )
    assert "one seed per loss" in lead


def test_winners_with_seeds_ties_and_error_metrics():
    rows = [
        {"loss": "a", "n_seeds": 3, "knn_accuracy": 0.90, "knn_accuracy_std": 0.02, "ver_eer": 0.10,
         "ver_eer_std": 0.001},
        {"loss": "b", "n_seeds": 3, "knn_accuracy": 0.92, "knn_accuracy_std": 0.01, "ver_eer": 0.20,
         "ver_eer_std": 0.001},
        {"loss": "c", "n_seeds": 3, "knn_accuracy": 0.92, "knn_accuracy_std": 0.01, "ver_eer": 0.30,
         "ver_eer_std": 0.001},
    ]  # fmt: skip
    line = winners_line(rows, ["knn_accuracy", "ver_eer"])
    assert "<b>b = c</b> 0.9200 (within one std: a)" in line  # a tie, and a within noise
    assert "ver_<wbr>eer: <b>a</b> 0.1000" in line  # lower is better for an error rate
    assert "means over 3 seeds" in line
    assert lower_is_better("ver_eer") and lower_is_better("ver_min_dcf") and not lower_is_better("map_at_r")


def test_compare_table_has_no_list_repr_and_readable_seconds(tmp_path, gen):
    runs, summary = compare_fixture(tmp_path, gen, seeds=1)
    text = write_compare_report(tmp_path, summary, runs).read_text()
    table = re.search(r"<table>.*?</table>", text).group(0)
    assert "[" not in table and "runs/" not in table  # "runs" is not a column (the links are below)
    assert "<td>4.5 s</td>" in table and "<td>12.2 s</td>" in table and "4.5020" not in text


def test_one_seed_is_not_called_mean_and_std(tmp_path, gen):
    runs, summary = compare_fixture(tmp_path, gen, seeds=1)
    text = write_compare_report(tmp_path, summary, runs).read_text()
    assert "mean ± std" not in text and "Results on the test set (one seed per loss)" in text
    assert "error bars" not in text and "± " not in re.search(r"<table>.*?</table>", text).group(0)
    runs, summary = compare_fixture(tmp_path / "three", gen, seeds=3)
    text = write_compare_report(tmp_path / "three", summary, runs).read_text()
    assert (
        "Results on the test set (mean ± std over 3 seeds)" in text and "error bars: std over seeds" in text
    )


def test_compare_header_names_the_backbone_used(tmp_path, gen):
    runs, summary = compare_fixture(tmp_path, gen, seeds=1, model="cnn2d")
    text = write_compare_report(tmp_path, summary, runs, notes="Total 3 s.").read_text()
    assert "backbone cnn2d" in text and "model auto" not in text and "backbone auto" not in text
    assert "2 losses on toy (900 training / 300 test samples), 1 seed each" in text and "Total 3 s." in text


def test_wide_comparison_fits_the_page(tmp_path, gen):
    """Open-set comparisons carry a dozen verification numbers: the table keeps the scores,
    leaves thresholds and counts to the per-run reports, wraps headers, and scrolls itself."""
    runs, summary = compare_fixture(tmp_path, gen, seeds=1)
    for r in summary:
        r.update({"ver_tar_at_far_0.01": 0.5, "ver_tar_at_far_0.001": 0.3, "ver_thresholds_0.01": 0.7,
                  "ver_eer": 0.1, "ver_auc": 0.9, "ver_min_dcf": 0.4, "ver_min_dcf_threshold": 0.6,
                  "ver_dcf_params_p_target": 0.01, "ver_num_genuine": 100,
                  "ver_num_impostor": 1000})  # fmt: skip
    text = write_compare_report(tmp_path, summary, runs).read_text()
    table = re.search(r"<div class=wide><table>.*?</table></div>", text).group(0)
    assert "ver_<wbr>tar_<wbr>at_<wbr>far_<wbr>0.01" in table and "ver_<wbr>eer" in table
    for hidden in (
        "thresholds",
        "dcf_<wbr>params",
        "num_<wbr>genuine",
        "num_<wbr>impostor",
        "dcf_<wbr>threshold",
    ):
        assert hidden not in table
    assert ".wide{overflow-x:auto" in text
    assert "max-width:1100px" in text  # the page, and so the table's box, stays narrower than 1400 px


def test_bar_chart_legend_clear_of_bars_and_labels_inside():
    from marginkit.report import bar_figure

    names = ("softmax", "cosface", "arcface", "qmargin", "mep", "circle", "triplet", "local_triplet")
    summary = [{"loss": n, "knn_accuracy": 0.97, "map_at_r": 0.9, "precision_at_1": 0.96} for n in names]
    fig = bar_figure(summary, ["knn_accuracy", "map_at_r", "precision_at_1"])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent(renderer)
    for bar in ax.patches:
        assert not legend.overlaps(bar.get_window_extent(renderer))
    page = fig.bbox
    for label in ax.get_xticklabels():
        box = label.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0, label.get_text()


def test_projections_have_a_class_legend(gen):
    from marginkit.report import projection_figure, projections_figure

    points = torch.randn(60, 2, generator=gen).numpy()
    labels = np.arange(60) % 4
    fig = projection_figure(points, labels)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "0",
        "1",
        "2",
        "3",
    ] and legend.get_title().get_text() == "class"
    fig = projections_figure([("a", points, labels), ("b", points, (labels + 1) % 5)])
    (legend,) = fig.legends  # one legend for all panels, same colour per class in each
    assert [t.get_text() for t in legend.get_texts()] == ["0", "1", "2", "3", "4"]
    many = projection_figure(torch.randn(300, 2, generator=gen).numpy(), np.arange(300) % 30)
    assert not many.legends  # 30 classes: no legend of 30 indistinguishable colours


def test_run_report_headline_and_backbone(tmp_path, gen):
    run = fake_run(tmp_path / "r", open_set=False, alpha=False, gen=gen)
    text = write_run_report(run).read_text()
    lead = re.search(r"<p class=lead>(.*?)</p>", text).group(1)
    assert lead.startswith("qmargin: K-NN accuracy <b>0.9000</b> · cosine-head accuracy <b>0.8800</b>")
    assert "5-NN" in lead and "checkpoint of epoch 2 of 2" in lead
    assert "backbone mlp" in text
    log = re.search(r"<h2>Training log</h2>(.*?)</table>", text).group(1)
    assert "<td>1.0 s</td>" in log and "<td>0.001</td>" in log  # epoch seconds; lr not padded


# ---------------------------------------------------------------- readable without colour (issue 27)
def test_curves_differ_in_line_style_and_bars_say_where_the_axis_starts():
    from marginkit.report.figures import bar_figure, cmc_figure, det_figure, line_style

    assert len({str(line_style(i)) for i in range(6)}) == 6 and line_style(6) == line_style(0)
    p = np.linspace(0.01, 0.5, 20)
    for fig in (det_figure([("a", p, p[::-1]), ("b", p, p[::-1] * 0.9)]),
                cmc_figure([("a", np.arange(1, 6), p[:5]), ("b", np.arange(1, 6), p[:5])])):  # fmt: skip
        ax = fig.axes[0]
        styles = [line.get_linestyle() for line in ax.lines if not line.get_label().startswith("_")]
        assert len(styles) == 2 and styles[0] != styles[1]
        assert all(t.get_fontsize() >= 9 for t in ax.get_legend().get_texts())
    rows = [{"loss": "a", "knn_accuracy": 0.9}, {"loss": "raw_1nn", "kind": "baseline", "knn_accuracy": 0.7}]
    ax = bar_figure(rows, ["knn_accuracy"]).axes[0]
    assert ax.get_ylabel() == "score (higher is better); axis from 0.6" and ax.get_ylim()[0] == 0.6
    hatches = [bar.get_hatch() for bar in ax.patches]
    assert hatches == [None, "//"] and [t.get_text() for t in ax.get_xticklabels()] == [
        "a",
        "raw_1nn\n(baseline)",
    ]


def test_compare_times_count_reused_runs_apart():
    from marginkit.cli.compare import _time_note

    assert _time_note([], 10.2) == "This invocation: 10 s."
    note = _time_note([60.0, 83.0], 2.4)
    assert note == ("This invocation: 2 s, 2 run(s) reused from an earlier invocation into the same "
                    "directory (their training took 143 s then).")  # fmt: skip
