"""Real data inside other packages (mnist-sample, japanese-vowels), the .ts parser, and the
small-data rules (validation split, auto epochs)."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import torch

from marginkit.data import DATASETS, load_dataset
from marginkit.data.datasets import DATASET_INFO
from marginkit.data.packaged import read_ts, resample, summary_stats
from marginkit.train.small_data import AUTO_MIN_EPOCHS, MIN_VAL_PER_CLASS, auto_epochs, resolve_epochs

needs_mlxtend = pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None, reason="needs mlxtend")
needs_aeon = pytest.mark.skipif(importlib.util.find_spec("aeon") is None, reason="needs aeon's files")

TS_HEADER = "# a comment\n@problemName t\n@dimensions 2\n@classLabel true a b\n@data\n"


def _ts(tmp_path, body: str, header: str = TS_HEADER):
    path = tmp_path / "x.ts"
    path.write_text(header + body, encoding="utf-8")
    return path


def test_read_ts_parses_variable_lengths(tmp_path) -> None:
    path = _ts(tmp_path, "1,2,3:4,5,6:b\n\n0.5:-1e-3:a\n")
    series, labels, classes = read_ts(path)
    assert classes == ["a", "b"] and labels.tolist() == [1, 0]
    np.testing.assert_array_equal(series[0], [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(series[1], [[0.5], [-1e-3]])


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("1,2:3,4\n", "2 channels and a label"),
        ("1,2:3,4:c\n", "not one of @classLabel"),
        ("1,x:3,4:a\n", "must be numbers"),
        ("1,?:3,4:a\n", "must be numbers"),
        ("1,2,3:3,4:a\n", "same length"),
        ("1,nan:3,4:a\n", "non-finite"),
        ("", "no @data"),
    ],
)
def test_read_ts_rejects_bad_lines(tmp_path, body, match) -> None:
    with pytest.raises(ValueError, match=match):
        read_ts(_ts(tmp_path, body))


def test_read_ts_needs_a_header(tmp_path) -> None:
    with pytest.raises(ValueError, match="@data before"):
        read_ts(_ts(tmp_path, "1:2:a\n", header="@data\n"))
    with pytest.raises(ValueError, match="classLabel true"):
        read_ts(_ts(tmp_path, "", header="@dimensions 1\n@classLabel false\n@data\n"))


def test_resample_is_linear_interpolation_in_time() -> None:
    line = np.array([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0]])  # values on a straight line
    short = np.array([[7.0], [8.0]])  # one frame: constant
    out = resample([line, short], 7)
    assert out.shape == (2, 2, 7)
    np.testing.assert_allclose(out[0, 0], np.linspace(0, 3, 7))
    np.testing.assert_allclose(out[0, 1], 5.0)
    np.testing.assert_allclose(out[1], [[7.0] * 7, [8.0] * 7])


def test_summary_stats_per_channel() -> None:
    s = np.array([[1.0, 2.0, 6.0], [0.0, 0.0, 3.0]])
    got = summary_stats([s])[0]
    want = [3.0, 1.0, np.std([1, 2, 6]), np.std([0, 0, 3]), 1.0, 0.0, 6.0, 3.0]
    np.testing.assert_allclose(got, want)


def test_builtins_are_listed() -> None:
    assert {"mnist-sample", "japanese-vowels"} <= set(DATASETS)


@needs_mlxtend
def test_mnist_sample_is_mlxtends_digits() -> None:
    from mlxtend.data import mnist_data

    data = load_dataset("mnist-sample", val_fraction=0.0)
    assert data.input_shape == (1, 28, 28) and data.kind == "image" and data.num_classes == 10
    assert len(data.train) == 4000 and len(data.test) == 1000
    info = DATASET_INFO["mnist-sample"]  # what `marginkit datasets` says
    assert (info.samples, info.classes) == (len(data.train) + len(data.test), data.num_classes)
    assert data.train.class_counts(10).tolist() == [400] * 10
    assert data.test.class_counts(10).tolist() == [100] * 10
    x, y = mnist_data()  # the independent reference: mlxtend's own loader
    ours = torch.cat([data.train.x, data.test.x]).flatten(1).mul(255).round().to(torch.uint8).numpy()
    labels = torch.cat([data.train.y, data.test.y]).numpy()
    # the same multiset of (image, label) rows, compared exactly
    assert sorted(zip(map(bytes, ours), labels.tolist(), strict=True)) == sorted(
        zip(map(bytes, x.astype(np.uint8)), y.tolist(), strict=True)
    )


@needs_aeon
def test_japanese_vowels_from_aeons_files() -> None:
    data = load_dataset("japanese-vowels", val_fraction=0.0)
    assert data.num_classes == 9 and data.input_shape == (12, 16)
    assert len(data.train) == 270 and len(data.test) == 370
    assert data.train.class_counts(9).tolist() == [30] * 9
    assert data.test.class_counts(9).tolist() == [31, 35, 88, 44, 29, 24, 40, 50, 29]
    np.testing.assert_allclose(data.train.x.mean(0).numpy(), 0, atol=1e-5)  # standardised on train
    stats = load_dataset("japanese-vowels", val_fraction=0.0, representation="stats")
    assert stats.input_shape == (48,)
    with pytest.raises(ValueError, match="representation"):
        load_dataset("japanese-vowels", representation="dtw")
    with pytest.raises(ValueError, match="frames"):
        load_dataset("japanese-vowels", frames=1)


# ----------------------------------------------------------------------------- small-data rules
def _tiny_features(tmp_path, per_class: int = 10, classes: int = 3):
    g = np.random.default_rng(0)
    y = np.repeat(np.arange(classes), per_class)
    path = tmp_path / "tiny.npz"
    np.savez(path, x=g.normal(size=(y.size, 4)), y=y, x_test=g.normal(size=(36, 4)), y_test=np.arange(36) % 3)
    return f"features:{path}"


def test_tiny_validation_split_is_not_carved_and_the_warning_says_so(tmp_path) -> None:
    spec = _tiny_features(tmp_path)
    with pytest.warns(UserWarning, match=r"would hold out 3 samples \(1\.0 per class\), fewer than the 10"):
        data = load_dataset(spec, val_fraction=0.1, min_val_per_class=10)
    assert len(data.val) == 0 and len(data.train) == 30
    assert data.info["val_split"].startswith("none:")
    # enough per class: carved as asked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        big = load_dataset(spec, val_fraction=0.5, min_val_per_class=5)
    assert big.val.class_counts(3).tolist() == [5, 5, 5]
    # the library default (0) keeps the old behaviour
    assert len(load_dataset(spec, val_fraction=0.1).val) == 3


def test_train_per_class_warning_names_what_went_to_validation(tmp_path) -> None:
    spec = _tiny_features(tmp_path)
    with pytest.warns(UserWarning, match=r"0 \(9 after 1 went to validation\)"):
        data = load_dataset(spec, val_fraction=0.1, train_per_class=10)
    assert data.train.class_counts(3).tolist() == [9, 9, 9]


def test_auto_epochs_rule() -> None:
    assert auto_epochs(100) == 50 and auto_epochs(10**6) == AUTO_MIN_EPOCHS
    with pytest.raises(ValueError, match="n_train"):
        auto_epochs(0)
    assert MIN_VAL_PER_CLASS >= 5


def test_resolve_epochs_keeps_an_explicit_value() -> None:
    from marginkit.train import TrainConfig

    assert resolve_epochs(TrainConfig(epochs=3), 100).epochs == 3
    assert resolve_epochs(TrainConfig(), 100).epochs == auto_epochs(100)


def test_trainer_auto_epochs_and_last_checkpoint_on_tiny_data(tmp_path, monkeypatch) -> None:
    from marginkit.train import TrainConfig, small_data, train

    monkeypatch.setattr(small_data, "AUTO_MIN_SAMPLES", 60)  # 30 samples -> max(10, 2) epochs
    spec = _tiny_features(tmp_path)
    lines: list[str] = []
    cfg = TrainConfig(data=spec, loss="softmax", model="mlp", batch_size=16, num_threads=1)
    with pytest.warns(UserWarning, match="fewer than the"):
        res = train(cfg, tmp_path / "run", log=lines.append, report=False)
    assert res.config.epochs == 10 and res.epochs_completed == 10
    assert res.metrics["best_epoch"] == 10 and res.metrics["num_train"] == 30
    assert any("best.pt is the last epoch's checkpoint" in line for line in lines)
    assert "epochs: 10" in (tmp_path / "run" / "config.yaml").read_text()
