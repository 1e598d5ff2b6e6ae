"""load_dataset: built-ins, the split pipeline, stratified selection, errors."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marginkit.data import (
    DATASETS,
    FILE_FORMATS,
    DatasetSplits,
    dataset_options,
    load_dataset,
    stratified_split,
    stratified_subset,
)
from marginkit.data import datasets as ds

# --------------------------------------------------------------------------------------------
# mnist1d: generated once per module into a temporary cache


@pytest.fixture(scope="module")
def mnist1d_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("mk_cache")
    np_state = np.random.get_state()[1].copy()  # noqa: NPY002 - checking the global state is untouched
    data = load_dataset("mnist1d", cache_dir=str(cache))
    after = np.random.get_state()[1]  # noqa: NPY002
    return cache, data, np_state, after


def test_mnist1d_shapes_and_cache(mnist1d_cache):
    cache, data, _, _ = mnist1d_cache
    assert isinstance(data, DatasetSplits)
    assert data.input_shape == (40,) and data.num_classes == 10 and data.kind == "vector"
    assert not data.open_set and data.class_names == [str(i) for i in range(10)]
    assert len(data.train) + len(data.val) == 4000 and len(data.test) == 1000
    assert data.train.x.dtype == torch.float32 and data.train.y.dtype == torch.int64
    assert data.mean is None  # mnist1d is already standardised by its generator
    assert (cache / "mnist1d-v2.npz").is_file()
    assert not list(cache.glob("*.tmp"))  # the atomic write left no temporary behind


def test_mnist1d_matches_the_package_and_keeps_global_rng(mnist1d_cache):
    from mnist1d.data import get_dataset_args, make_dataset

    _, data, before, after = mnist1d_cache
    np.testing.assert_array_equal(before, after)
    state, py_state = np.random.get_state(), random.getstate()  # noqa: NPY002 - the package seeds them
    try:
        ref = make_dataset(get_dataset_args())  # independent reference: the package itself
    finally:
        np.random.set_state(state)  # noqa: NPY002
        random.setstate(py_state)
    x = torch.cat([data.train.x, data.val.x]).numpy()
    y = torch.cat([data.train.y, data.val.y]).numpy()
    order = np.lexsort(x.T[::-1])
    ref_order = np.lexsort(ref["x"].T[::-1])
    np.testing.assert_allclose(x[order], ref["x"][ref_order].astype(np.float32), rtol=0, atol=0)
    np.testing.assert_array_equal(y[order], ref["y"][ref_order])
    np.testing.assert_allclose(data.test.x.numpy(), ref["x_test"].astype(np.float32), rtol=0, atol=0)
    np.testing.assert_array_equal(data.test.y.numpy(), ref["y_test"])


def test_mnist1d_second_load_reads_the_cache(mnist1d_cache, monkeypatch):
    cache, data, _, _ = mnist1d_cache

    def boom():
        raise AssertionError("regenerated although the cache is valid")

    monkeypatch.setattr(ds, "_generate_mnist1d", boom)
    again = load_dataset("mnist1d", cache_dir=str(cache))
    assert torch.equal(again.train.x, data.train.x) and torch.equal(again.test.y, data.test.y)


def test_mnist1d_corrupt_cache_is_regenerated(mnist1d_cache, tmp_path, monkeypatch):
    _, data, _, _ = mnist1d_cache
    (tmp_path / "mnist1d-v2.npz").write_bytes(b"not a zip archive")
    calls = []
    good = {
        "x": torch.cat([data.train.x, data.val.x]).numpy(),
        "y": torch.cat([data.train.y, data.val.y]).numpy(),
        "x_test": data.test.x.numpy(),
        "y_test": data.test.y.numpy(),
    }
    monkeypatch.setattr(ds, "_generate_mnist1d", lambda: calls.append(1) or good)
    with pytest.warns(UserWarning, match="mnist1d-v2.npz unreadable"):
        load_dataset("mnist1d", cache_dir=str(tmp_path))
    assert calls == [1]
    with np.load(tmp_path / "mnist1d-v2.npz") as archive:  # rewritten with the valid content
        assert archive["x"].shape == (4000, 40)


def test_mnist1d_altered_cache_is_detected_and_regenerated(mnist1d_cache, tmp_path, monkeypatch):
    cache, data, _, _ = mnist1d_cache
    with np.load(cache / "mnist1d-v2.npz") as archive:
        arrays = {k: archive[k] for k in archive.files}
    assert set(arrays) == {"x", "y", "x_test", "y_test", "sha256"}
    assert str(arrays["sha256"]) == ds.arrays_digest({k: v for k, v in arrays.items() if k != "sha256"})
    fresh = {k: v for k, v in arrays.items() if k != "sha256"}
    monkeypatch.setattr(ds, "_generate_mnist1d", lambda: dict(fresh))
    tampered = dict(arrays)
    tampered["y"] = (arrays["y"] + 1) % 10  # altered labels, checksum kept: still plausible data
    np.savez(tmp_path / "mnist1d-v2.npz", **tampered)
    with pytest.warns(UserWarning, match="does not match the checksum recorded when it was made"):
        again = load_dataset("mnist1d", cache_dir=str(tmp_path))
    assert torch.equal(again.test.y, data.test.y) and torch.equal(again.train.y, data.train.y)
    with np.load(tmp_path / "mnist1d-v2.npz") as archive:  # rewritten with the generated content
        np.testing.assert_array_equal(archive["y"], arrays["y"])
    del tampered["sha256"]  # a cache without a checksum is not trusted either
    np.savez(tmp_path / "mnist1d-v2.npz", **tampered)
    with pytest.warns(UserWarning, match="does not match the checksum"):
        load_dataset("mnist1d", cache_dir=str(tmp_path))


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("MARGINKIT_CACHE", str(tmp_path / "a"))
    assert ds.resolve_cache_dir() == tmp_path / "a"
    assert ds.resolve_cache_dir(tmp_path / "b") == tmp_path / "b"
    monkeypatch.delenv("MARGINKIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert ds.resolve_cache_dir() == tmp_path / "x" / "marginkit"


def test_mnist1d_train_per_class_and_val(mnist1d_cache):
    cache = mnist1d_cache[0]
    data = load_dataset("mnist1d", cache_dir=str(cache), train_per_class=10, seed=3)
    assert data.train.class_counts(10).tolist() == [10] * 10
    # validation is carved before subsetting: its size does not depend on train_per_class
    full = load_dataset("mnist1d", cache_dir=str(cache), seed=3)
    assert torch.equal(data.val.x, full.val.x)


# --------------------------------------------------------------------------------------------
# scikit-learn sets


def _row_index(rows: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index in ``table`` of every row of ``rows`` (exact match), -1 if absent."""
    lookup = {r.tobytes(): i for i, r in enumerate(table)}
    return np.array([lookup.get(r.tobytes(), -1) for r in rows])


def _nearest_rows(rows: np.ndarray, table: np.ndarray, rtol: float = 1e-5) -> np.ndarray:
    """Index of the nearest ``table`` row for each row; asserts they agree to ``rtol``."""
    scale = np.abs(table).max(0) + 1e-12
    d = np.abs(rows[:, None, :] - table[None, :, :]) / scale
    idx = d.max(-1).argmin(1)
    assert d[np.arange(len(rows)), idx].max() < rtol
    return idx


def test_digits_split_is_fixed_stratified_and_exact():
    from sklearn.datasets import load_digits

    ref = load_digits()
    a = load_dataset("digits", seed=0)
    b = load_dataset("digits", seed=5)
    assert a.input_shape == (1, 8, 8) and a.kind == "image"
    assert len(a.train) + len(a.val) + len(a.test) == 1797
    assert torch.equal(a.test.x, b.test.x)  # the test split does not depend on `seed`
    assert not torch.equal(a.val.y, b.val.y) or not torch.equal(a.train.x, b.train.x)
    assert float(a.train.x.min()) >= 0 and float(a.train.x.max()) <= 1
    images = (ref.images.astype(np.float32) / 16).reshape(len(ref.images), -1)
    test_counts = Counter(ref.target.tolist())
    got = Counter(a.test.y.tolist())
    for c, n in test_counts.items():
        assert got[c] == math.floor(0.25 * n + 0.5)
    # each test image is an original image with its original label
    idx = _row_index(a.test.x.reshape(len(a.test), -1).numpy(), images)
    assert (idx >= 0).all()
    np.testing.assert_array_equal(ref.target[idx], a.test.y.numpy())


def test_digits_train_per_class_small_regime():
    data = load_dataset("digits", train_per_class=10, seed=1)
    assert data.train.class_counts(10).tolist() == [10] * 10
    again = load_dataset("digits", train_per_class=10, seed=1)
    assert torch.equal(data.train.x, again.train.x) and torch.equal(data.val.y, again.val.y)


def test_breast_cancer_standardised_with_train_statistics_only():
    from sklearn.datasets import load_breast_cancer

    raw = load_breast_cancer().data
    data = load_dataset("breast_cancer", train_per_class=50, seed=2)
    assert data.input_shape == (30,) and data.num_classes == 2
    assert data.class_names == ["malignant", "benign"]
    assert data.train.class_counts(2).tolist() == [50, 50]
    train_raw = (data.train.x.double() * data.std.double() + data.mean.double()).numpy()
    idx = _nearest_rows(train_raw, raw)
    assert len(set(idx.tolist())) == 100
    ref = raw[idx]  # independent float64 statistics of exactly the training rows
    np.testing.assert_allclose(data.mean.numpy(), ref.mean(0), rtol=1e-5)
    np.testing.assert_allclose(data.std.numpy(), ref.std(0), rtol=1e-5)
    np.testing.assert_allclose(data.train.x.mean(0).numpy(), 0, atol=1e-5)
    # test rows use the training statistics, not their own
    test_raw = (data.test.x.double() * data.std.double() + data.mean.double()).numpy()
    _nearest_rows(test_raw, raw)
    assert float(data.test.x.mean(0).abs().max()) > 1e-3
    # preprocess maps new raw rows into the same space
    np.testing.assert_allclose(data.preprocess(raw[idx[:5]]).numpy(), data.train.x[:5].numpy(), atol=1e-5)


def test_train_per_class_larger_than_a_class_warns_and_keeps_all():
    with pytest.warns(UserWarning, match="fewer training samples"):
        data = load_dataset("breast_cancer", train_per_class=200, val_fraction=0.1)
    full = load_dataset("breast_cancer", val_fraction=0.1)
    counts = data.train.class_counts(2).tolist()
    available = full.train.class_counts(2).tolist()  # 212 malignant, 357 benign before splitting
    assert available[0] < 200 < available[1]
    assert counts == [available[0], 200]


def test_val_fraction_zero_gives_empty_validation():
    data = load_dataset("digits", val_fraction=0.0)
    assert len(data.val) == 0 and data.val.x.shape[1:] == (1, 8, 8)


# --------------------------------------------------------------------------------------------
# the generic pipeline on a features file with traceable rows


def _traceable(tmp_path, n_per_class=(30, 20, 10), labels=(0, 1, 2)):
    ys = np.concatenate([np.full(n, lab) for n, lab in zip(n_per_class, labels, strict=True)])
    ids = np.arange(len(ys), dtype=np.float64)
    x = np.stack([ids, ids * 0 + 1.0, np.sin(ids)], axis=1)
    path = tmp_path / "feat.npz"
    np.savez(path, x=x, y=ys)
    return path, ids, ys


def test_splits_partition_the_data_without_overlap(tmp_path):
    path, ids, ys = _traceable(tmp_path)
    data = load_dataset(f"features:{path}", val_fraction=0.2, standardize=False, seed=4)
    parts = [s.x[:, 0].long().tolist() for s in (data.train, data.val, data.test)]
    flat = [i for p in parts for i in p]
    assert sorted(flat) == ids.astype(int).tolist()  # a partition: nothing lost, nothing shared
    for split in (data.train, data.val, data.test):  # labels travel with their rows
        np.testing.assert_array_equal(ys[split.x[:, 0].long().numpy()], split.y.numpy())
    assert data.std is None


def test_non_contiguous_labels_are_mapped_to_0_to_C_minus_1(tmp_path):
    path, _, ys = _traceable(tmp_path, labels=(3, 7, 10))
    data = load_dataset(f"features:{path}", standardize=False)
    assert data.num_classes == 3 and data.class_names == ["3", "7", "10"]
    original = np.array([3, 7, 10])
    for split in (data.train, data.val, data.test):
        np.testing.assert_array_equal(original[split.y.numpy()], ys[split.x[:, 0].long().numpy()])


def test_labels_indexing_given_class_names_are_kept(tmp_path):
    x = np.arange(40, dtype=np.float64)[:, None].repeat(2, 1)
    y = np.where(np.arange(40) % 2 == 0, 0, 2)
    np.savez(tmp_path / "n.npz", x=x, y=y, class_names=np.array(["a", "b", "c", "d"]))
    data = load_dataset(f"features:{tmp_path / 'n.npz'}")
    assert data.num_classes == 4 and data.class_names == ["a", "b", "c", "d"]
    assert set(data.train.y.tolist()) == {0, 2}
    np.savez(tmp_path / "m.npz", x=x, y=y + 3, class_names=np.array(["a", "b", "c", "d"]))
    with pytest.raises(ValueError, match="label 5 has no entry in its 4 class names"):
        load_dataset(f"features:{tmp_path / 'm.npz'}")


def test_constant_feature_is_not_divided_by_zero(tmp_path):
    path, _, _ = _traceable(tmp_path)
    data = load_dataset(f"features:{path}")
    assert torch.isfinite(data.train.x).all() and float(data.std[1]) == 1.0
    assert torch.all(data.train.x[:, 1] == 0)


def test_determinism_and_seed_dependence(tmp_path):
    path, _, _ = _traceable(tmp_path, n_per_class=(60, 60, 60))
    a = load_dataset(f"features:{path}", seed=7, train_per_class=5, standardize=False)
    b = load_dataset(f"features:{path}", seed=7, train_per_class=5, standardize=False)
    c = load_dataset(f"features:{path}", seed=8, train_per_class=5, standardize=False)
    for s in ("train", "val", "test"):
        assert torch.equal(getattr(a, s).x, getattr(b, s).x)
    assert torch.equal(a.test.x, c.test.x)  # split_seed fixes the test split
    assert not torch.equal(a.train.x, c.train.x)


# --------------------------------------------------------------------------------------------
# errors


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(ValueError, match="unknown dataset 'mnist' .*did you mean 'mnist1d'") as info:
        load_dataset("mnist")
    for name in (*DATASETS, *FILE_FORMATS):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="unknown dataset 'png:/x'"):
        load_dataset("png:/x")
    with pytest.raises(TypeError, match="spec must be a str"):
        load_dataset(3)


def test_bad_arguments_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="unknown option 'test_frac' .*did you mean 'test_fraction'"):
        load_dataset("digits", test_frac=0.3)
    with pytest.raises(ValueError, match="unknown option 'standardize'.*valid options: split, test_classes"):
        load_dataset(f"npz:{tmp_path}/x.npz", standardize=True)  # npz has only the split options
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        load_dataset("digits", val_fraction=1.0)
    with pytest.raises(ValueError, match="train_per_class must be >= 1"):
        load_dataset("digits", train_per_class=0)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        load_dataset("digits", seed=-1)
    with pytest.raises(ValueError, match="needs a path"):
        load_dataset("npz:")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_dataset(f"npz:{tmp_path}/missing.npz")


def test_dataset_options_lists_keywords():
    split = ("split", "test_classes", "val_classes", "folds", "fold")
    pipeline = ("stream", "memory_budget", "on_bad_sample")  # how any source is read
    assert dataset_options("mnist1d") == ("cache_dir", *split, "split_seed", "test_fraction", *pipeline)
    assert "nuisance_strength" in dataset_options("identities")
    assert not set(split) & set(dataset_options("identities"))  # disjoint identities by construction
    folder = ("image_size", "color", "test_fraction", "split_seed", "cache_dir", *split, *pipeline)
    assert dataset_options("folder:/x") == folder


# --------------------------------------------------------------------------------------------
# stratified selection (property-based, against plain Counter bookkeeping)

labels_strategy = st.lists(st.integers(0, 6), min_size=0, max_size=80)


@given(labels=labels_strategy, per_class=st.integers(1, 12), seed=st.integers(0, 2**32))
def test_stratified_subset_properties(labels, per_class, seed):
    y = torch.tensor(labels, dtype=torch.int64)
    idx = stratified_subset(y, per_class, seed=seed)
    assert idx.dtype == torch.int64
    assert torch.equal(idx, torch.sort(idx).values) and len(set(idx.tolist())) == len(idx)
    assert all(0 <= i < len(labels) for i in idx.tolist())
    want = {c: min(n, per_class) for c, n in Counter(labels).items()}
    assert Counter(y[idx].tolist()) == Counter(want)
    assert torch.equal(idx, stratified_subset(np.array(labels, dtype=np.int64), per_class, seed=seed))
    bigger = set(stratified_subset(y, per_class + 1, seed=seed).tolist())
    assert set(idx.tolist()) <= bigger  # nested in per_class


@given(labels=labels_strategy, fraction=st.floats(0, 0.95), seed=st.integers(0, 1000))
def test_stratified_split_properties(labels, fraction, seed):
    y = np.array(labels, dtype=np.int64)
    kept, held = stratified_split(y, fraction, seed=seed)
    assert sorted(kept.tolist() + held.tolist()) == list(range(len(labels)))
    got = Counter(y[held.numpy()].tolist())
    for c, n in Counter(labels).items():
        assert got[c] == min(math.floor(fraction * n + 0.5), n - 1)
        assert (y[kept.numpy()] == c).any()  # never all of a class


def test_stratified_subset_varies_with_seed():
    y = torch.arange(100) % 4
    picks = {tuple(stratified_subset(y, 3, seed=s).tolist()) for s in range(10)}
    assert len(picks) > 5


def test_stratified_selection_rejects_bad_input():
    with pytest.raises(ValueError, match="labels must be a 1-D integer array"):
        stratified_subset(torch.zeros(4), 2)
    with pytest.raises(ValueError, match="per_class must be >= 1"):
        stratified_subset(torch.zeros(4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\)"):
        stratified_split(torch.zeros(4, dtype=torch.long), 1.0)


@pytest.mark.parametrize("data", ["digits", "breast_cancer"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (2**64, "split_seed must be <= 2\\*\\*63 - 1"),
        (-1, "split_seed must be >= 0"),
        (1.5, "split_seed must be an int"),
    ],
)
def test_split_seed_out_of_range_is_refused_by_name(data, value, message) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        load_dataset(data, split_seed=value)
