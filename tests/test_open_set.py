"""Open-set runs on a user's own data: train / eval / compare report the field's figures (checked
against a brute force over `marginkit embed`), model selection on disjoint classes, the baselines,
and opt-in augmentation (seeded per batch, reproducible under --resume, never at evaluation)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from marginkit.cli import main
from marginkit.data import load_dataset
from marginkit.data.augment import BatchAugment, augment_options
from marginkit.train.baselines import evaluate_baselines, fit_whitened_pca
from marginkit.train.config import ConfigError, TrainConfig, apply_overrides
from marginkit.train.trainer import train
from test_trainer import assert_same, state_tensors

YALE = Path(__file__).resolve().parents[2] / "shared" / "data" / "yalefaces"


def digits_people(path: Path) -> Path:
    """A user's own open-set .npz, MedMNIST-style: 'people' (digits) 0..5 train, 6..9 test."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = (x.reshape(-1, 8, 8) * (255 / 16)).astype(np.uint8)
    keep = np.concatenate([np.flatnonzero(y == c)[:25] for c in range(10)])
    x, y = images[keep], y[keep]
    train = y < 6
    np.savez(path, train_images=x[train], train_labels=y[train], test_images=x[~train], test_labels=y[~train])
    return path


def yale_people(path: Path) -> Path:
    """Yale faces as the issue's user has them: 10 people train, the other 5 test (64 x 64 grey)."""
    from PIL import Image

    xs, ys = [], []
    for i, person in enumerate(sorted(p for p in YALE.iterdir() if p.is_dir())):
        for f in sorted(person.glob("*.png")):
            xs.append(np.asarray(Image.open(f).convert("L").resize((32, 32), Image.BILINEAR)))
            ys.append(i)
    x, y = np.stack(xs), np.asarray(ys)
    train = y < 10
    np.savez(path, train_images=x[train], train_labels=y[train], test_images=x[~train], test_labels=y[~train])
    return path


def brute_force(emb: np.ndarray, labels: np.ndarray, fars: tuple[float, ...]) -> dict[str, object]:
    """EER, TAR@FAR and MAP@R of all unordered pairs by direct enumeration (float64, no sorting tricks)."""
    e = emb.astype(np.float64)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    sim = e @ e.T
    i, j = np.triu_indices(len(labels), 1)
    scores, genuine = sim[i, j], labels[i] == labels[j]
    gen, imp = scores[genuine], scores[~genuine]
    points = [(-np.inf, 1.0, 0.0)] + [(t, (imp > t).mean(), (gen <= t).mean()) for t in np.unique(scores)]
    eer = None
    for (_, far0, frr0), (_, far1, frr1) in itertools.pairwise(points):
        d0, d1 = far0 - frr0, far1 - frr1
        if d0 >= 0 >= d1:  # FAR falls and FRR rises with t: they cross on this segment
            w = d0 / (d0 - d1) if d0 != d1 else 0.0
            eer = far0 + w * (far1 - far0)
            break
    tars = {}
    for far in fars:
        m = int(np.floor(far * len(imp)))
        if m < 1 and far * len(imp) < 1:
            tars[far] = None
            continue
        t = np.sort(imp)[::-1][m]  # the (m+1)-th largest impostor score
        tars[far] = float((gen > t).mean())
    aps = []
    for q in range(len(labels)):
        others = np.delete(np.arange(len(labels)), q)
        order = others[np.argsort(-sim[q, others], kind="stable")]
        rel = labels[order] == labels[q]
        r = int(rel.sum())
        hits = rel[:r]
        aps.append(float(np.sum(np.cumsum(hits) / np.arange(1, r + 1) * hits) / r))
    return {"eer": eer, "tar_at_far": tars, "map_at_r": float(np.mean(aps))}


FACES = [pytest.param(digits_people, id="digits-people")]
FACES.append(
    pytest.param(
        yale_people, id="yalefaces",
        marks=pytest.mark.skipif(not YALE.is_dir(), reason=f"real faces absent: no {YALE} (../shared/data)"),
    )
)  # fmt: skip


@pytest.mark.parametrize("make", FACES)
def test_open_set_npz_reports_the_fields_figures_equal_to_a_brute_force(tmp_path, capsys, make):
    """The user's own .npz with unseen test people: figures of the field, never a closed-set 0.0000."""
    data = make(tmp_path / "faces.npz")
    run = tmp_path / "run"
    args = ["train", "--data", f"npz:{data}", "--loss", "circle", "--model", "mlp", "--epochs", "2",
            "--embedding-dim", "16", "--out", str(run), "-q"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "verification EER" in printed and "leave-one-out in test" in printed and "MAP@R" in printed
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["open_set"] and metrics["knn_accuracy"] > 0 and "head_accuracy" not in metrics
    report = (run / "report.html").read_text()
    test_classes = metrics["class_split"]["test"]  # the source's test people, named in the report
    assert f"test {len(test_classes)} ({', '.join(test_classes)}): never seen in training" in report
    assert "Verification (test pairs)" in report
    ver = metrics["verification"]
    assert set(ver["confidence_intervals"]["tar_at_far"]) == set(ver["tar_at_far"])
    lo, hi = ver["confidence_intervals"]["eer"]
    assert lo <= ver["eer"] <= hi

    assert main(["embed", str(run), "--split", "test", "--out", str(tmp_path / "emb.npz"), "-q"]) == 0
    with np.load(tmp_path / "emb.npz") as z:
        emb, labels = z["test_embeddings"], z["test_labels"]
    fars = tuple(float(f) for f in ver["tar_at_far"])
    ref = brute_force(emb, labels, fars)
    assert ver["eer"] == pytest.approx(ref["eer"], abs=1e-6)
    for far in fars:
        got, want = ver["tar_at_far"][str(far)], ref["tar_at_far"][far]
        assert got == want if want is None else got == pytest.approx(want, abs=1e-6), far
    assert metrics["map_at_r"] == pytest.approx(ref["map_at_r"], abs=1e-6)
    assert ver["num_impostor"] == int((labels[:, None] != labels[None]).sum() // 2)

    assert main(["eval", str(run), "-q"]) == 0
    assert "verification EER" in capsys.readouterr().out


def test_compare_on_open_set_data_has_baselines_and_losses_in_one_table(tmp_path, capsys):
    data = digits_people(tmp_path / "people.npz")
    out = tmp_path / "cmp"
    args = ["compare", "--data", f"npz:{data}", "--losses", "circle,qmargin", "--model", "mlp",
            "--epochs", "1", "--embedding-dim", "16", "--out", str(out), "-q"]  # fmt: skip
    assert main(args) == 0
    table = capsys.readouterr().out
    rows = {r["loss"]: r for r in json.loads((out / "summary.json").read_text())}
    assert list(rows) == ["circle", "qmargin", "raw", "pca_whitened"]
    assert rows["raw"]["kind"] == rows["pca_whitened"]["kind"] == "baseline"
    for row in rows.values():
        assert row["ver_eer"] is not None and row["map_at_r"] is not None and row["knn_accuracy"] > 0
        assert "ver_tar_at_far_0.01" in row
    header = next(line for line in table.splitlines() if line.startswith("| loss"))
    assert "ver_eer" in header and "ver_thresholds" not in header and "map_at_r" in header
    assert "| raw (baseline) |" in table and "| pca_whitened (baseline) |" in table
    assert "Baselines, on the same splits" in (out / "report.html").read_text()
    assert main([*args, "--no-baselines"]) == 0  # reuses the runs
    assert [r["loss"] for r in json.loads((out / "summary.json").read_text())] == ["circle", "qmargin"]


# --------------------------------------------------------------------------------------------
# model selection on classes never trained on


def _small(**over: object) -> TrainConfig:
    base = {"data": "digits", "model": "mlp", "model_options": {"hidden": [32]}, "embedding_dim": 8,
            "epochs": 2, "batch_size": 64, "k": 3, "loss": "cosface", "num_threads": 1}  # fmt: skip
    base.update(over)
    return apply_overrides(TrainConfig(), base)


def test_selection_on_disjoint_validation_classes(tmp_path):
    lines: list[str] = []
    cfg = _small(data_options={"split": "classes", "test_classes": 4, "val_classes": 2}, selection="eer")
    result = train(cfg, tmp_path / "r", report=False, log=lines.append)
    assert any("model selection: the EER of the validation pairs" in line for line in lines)
    assert any("open set" in line and "validation 2 (" in line for line in lines)
    for row in result.history:
        assert row["val_selection"] == -row["val_eer"] and "val_knn_accuracy" not in row
    assert result.metrics["class_split"]["val"] and result.metrics["split"].startswith("split='classes'")
    auto = train(_small(data_options=cfg.data_options), tmp_path / "a", report=False, quiet=True)
    assert all(r["val_selection"] == r["val_precision_at_1"] for r in auto.history)
    with pytest.raises(ConfigError, match="selection=knn_accuracy predicts training classes"):
        train(_small(data_options=cfg.data_options, selection="knn_accuracy"), tmp_path / "k", quiet=True)


# --------------------------------------------------------------------------------------------
# baselines against independent references


@pytest.mark.parametrize("shape", [(40, 9), (12, 30)], ids=["more samples", "more pixels"])
def test_whitened_pca_equals_sklearn(shape):
    from sklearn.decomposition import PCA

    x = torch.from_numpy(np.random.default_rng(1).normal(size=shape) * np.linspace(3, 0.1, shape[1]))
    k = min(5, shape[0] - 1)
    ours = fit_whitened_pca(x, components=k)(x).double().numpy()
    ref = PCA(n_components=k, whiten=True, svd_solver="full").fit_transform(x.numpy())
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    np.testing.assert_allclose(ours @ ours.T, ref @ ref.T, atol=1e-5)  # component signs are arbitrary


def test_closed_set_baselines_equal_sklearn():
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier

    data = load_dataset("digits", train_per_class=20)
    found = evaluate_baselines(data, _small())
    tr, te = data.train.x.flatten(1).double().numpy(), data.test.x.flatten(1).double().numpy()
    knn = KNeighborsClassifier(n_neighbors=1).fit(tr, data.train.y.numpy()).score(te, data.test.y.numpy())
    lr = LogisticRegression(C=1.0, max_iter=2000).fit(tr, data.train.y.numpy()).score(te, data.test.y.numpy())
    assert found["raw_1nn"]["knn_accuracy"] == pytest.approx(knn)
    assert found["logistic"]["head_accuracy"] == pytest.approx(lr)


# --------------------------------------------------------------------------------------------
# augmentation


def test_image_augmentation_is_a_function_of_seed_epoch_and_step():
    aug = BatchAugment(augment_options("flip,crop,rotate,brightness,contrast"), "image")
    x = torch.rand(16, 1, 12, 10, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(7)
    before = torch.rand(3)
    torch.manual_seed(7)
    a = aug(x, seed=0, epoch=1, step=2)
    assert torch.equal(torch.rand(3), before)  # the training's random stream is untouched
    assert torch.equal(a, aug(x, seed=0, epoch=1, step=2))
    assert not torch.equal(a, aug(x, seed=0, epoch=1, step=3)) and not torch.equal(
        a, aug(x, seed=1, epoch=1, step=2)
    )
    assert a.shape == x.shape and float(a.min()) >= 0 and float(a.max()) <= 1
    flips = BatchAugment({"flip": 1.0}, "image")(x, seed=0, epoch=0, step=0)
    assert torch.equal(flips, x.flip(-1))


def _is_shift_and_mask(frames: torch.Tensor, length: int, pad: int, most: int) -> bool:
    """``frames`` is ``0..L-1`` shifted by at most ``pad`` (edges repeated), then one block of at
    most ``most`` frames zeroed."""
    t = torch.arange(length)
    for offset in range(-pad, pad + 1):
        shifted = (t + offset).clamp(0, length - 1).to(frames.dtype)
        changed = torch.nonzero(frames != shifted).flatten()
        if changed.numel() == 0:
            return True
        block = changed.numel() <= most and int(changed[-1] - changed[0]) + 1 == changed.numel()
        if block and bool((frames[changed] == 0).all()):
            return True
    return False


def test_sequence_augmentation_shifts_and_masks_each_sample():
    x = torch.arange(20.0).repeat(64, 3, 1)  # [N, C, L]: frame t holds t
    out = BatchAugment({"crop": 0.1, "time_mask": 0.2}, "sequence")(x, seed=0, epoch=0, step=0)
    for row in out:
        assert torch.equal(row[0], row[1]) and torch.equal(row[1], row[2])  # one shift and mask per sample
        assert _is_shift_and_mask(row[0], 20, pad=2, most=4)
    assert len({tuple(r[0].tolist()) for r in out}) > 10  # drawn per sample
    flat = BatchAugment({"crop": 0.1}, "sequence")(torch.arange(20.0).repeat(8, 1), seed=3, epoch=0, step=0)
    assert all(_is_shift_and_mask(r, 20, pad=2, most=0) for r in flat)  # [N, L] too, no mask asked


def test_augmentation_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown augmentation 'flp' \(did you mean 'flip'\?\)"):
        _small(augment="flp")
    with pytest.raises(ConfigError, match=r"augment.rotate must be a number in \[0, 180\]"):
        _small(augment={"rotate": 200})
    assert _small(augment="flip,crop").augment == {"flip": 0.5, "crop": 0.1}
    assert _small(augment={"flip": None, "crop": 0.2}).augment == {"flip": 0.5, "crop": 0.2}
    with pytest.raises(ConfigError, match="augment applies to images and to sequences"):
        train(_small(data="breast_cancer", augment="crop"), tmp_path / "a", quiet=True)
    with pytest.raises(ConfigError, match="flip do.es. not apply to sequence inputs"):
        train(
            _small(data="mnist1d", model="cnn1d", model_options={}, augment="flip"),
            tmp_path / "b",
            quiet=True,
        )


def test_augmented_batches_repeat_after_resume_and_evaluation_is_never_augmented(tmp_path, monkeypatch):
    seen: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    calls = {"n": 0}
    real = BatchAugment.__call__

    def spy(self, x, *, seed, epoch, step):
        out = real(self, x, seed=seed, epoch=epoch, step=step)
        seen.setdefault(current, {})[(epoch, step)] = out.clone()
        calls["n"] += 1
        return out

    monkeypatch.setattr(BatchAugment, "__call__", spy)
    cfg = _small(model="cnn2d", model_options={}, epochs=2, augment="flip,crop", train_per_class=20)
    current = "full"
    full = train(cfg, tmp_path / "full", quiet=True, report=False)
    steps = calls["n"]
    assert steps == 2 * len([k for k in seen["full"] if k[0] == 0])  # training batches only
    current = "part"
    train(cfg, tmp_path / "part", quiet=True, report=False, stop_after=1)
    torch.manual_seed(999)  # another process state: the batches must not depend on it
    current = "resumed"
    resumed = train(None, tmp_path / "part", resume=True, quiet=True, report=False)
    for key, batch in seen["resumed"].items():
        assert key[0] == 1 and torch.equal(batch, seen["full"][key]), key
    assert_same(state_tensors(tmp_path / "full"), state_tensors(tmp_path / "part"))
    assert resumed.metrics["knn_accuracy"] == full.metrics["knn_accuracy"]
    before = calls["n"]
    from marginkit.train.evaluate import evaluate_run

    evaluate_run(tmp_path / "full", report=False)
    assert calls["n"] == before  # evaluation embeds the inputs as they are
