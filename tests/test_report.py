"""HTML reports: self-contained (embedded PNGs, no external resources), the right figures."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from marginkit.report import write_compare_report, write_run_report
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
    assert "ROC and DET" in text and "Confusion matrix" not in text and "Support size" not in text
    assert "tar_at_far.0.01" in text and len(images(text)) == 3


def test_compare_report(tmp_path, gen):
    runs = {}
    for loss in ("softmax", "triplet"):
        d = tmp_path / "runs" / loss / "seed0"
        d.parent.mkdir(parents=True)
        fake_run(d, open_set=False, alpha=False, gen=gen)
        write_run_report(d)
        runs[loss] = [d]
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
    text = write_compare_report(tmp_path, summary, runs, table_markdown="| loss |").read_text()
    assert_self_contained(text)
    assert "0.9200 ± 0.0200" in text and "class=best" in text
    assert 'href="runs/softmax/seed0/report.html"' in text
    assert len(images(text)) == 4  # bar plot, validation curves, two projections


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
    assert [r["loss"] for r in rows] == ["softmax", "local_triplet"]
    assert all({"loss", "knn_accuracy", "map_at_r"} <= set(r) for r in rows)
    assert max(r["knn_accuracy"] for r in rows) > 0.5  # one epoch on mnist1d: far above chance (0.1)
    assert_self_contained((tmp_path / "d" / "report.html").read_text())
