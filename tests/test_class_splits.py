"""Class-disjoint (open-set) splits of every data source: the ``split`` data options."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marginkit.data import load_dataset
from marginkit.data.class_splits import choose_classes
from test_loaders import _idx_bytes, _write_cifar, _write_folder


def _names(n: int) -> list[str]:
    return [f"c{i}" for i in range(n)]


def _classes(data) -> dict[str, set[str]]:
    return {
        s: {data.class_names[int(c)] for c in torch.unique(getattr(data, s).y)}
        for s in ("train", "val", "test")
    }


# --------------------------------------------------------------------------------------------
# choosing the classes


@given(n=st.integers(4, 40), folds=st.integers(2, 4), seed=st.integers(0, 2**31))
def test_folds_partition_the_classes(n, folds, seed):
    """Each class tests in exactly one fold; training is always the rest; a fold of one class is refused."""
    present = np.arange(n)
    tests = []
    for fold in range(folds):
        size = len(np.array_split(present, folds)[fold])
        if size < 2:
            with pytest.raises(ValueError, match="leaves 1 test class"):
                choose_classes(present, _names(n), mode="classes", folds=folds, fold=fold, seed=seed)
            tests.append(None)
            continue
        split = choose_classes(present, _names(n), mode="classes", folds=folds, fold=fold, seed=seed)
        assert len(split.test) == size
        assert not np.intersect1d(split.train, split.test).size
        assert np.array_equal(np.union1d(split.train, split.test), present)
        tests.append(split.test)
    if all(t is not None for t in tests):
        assert sorted(np.concatenate(tests).tolist()) == list(range(n))


@given(n=st.integers(5, 60), frac=st.floats(0.05, 0.6), val=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_fraction_and_validation_classes_are_disjoint(n, frac, val, seed):
    present = np.arange(n)
    count = max(1, int(np.floor(frac * n + 0.5)))
    try:
        split = choose_classes(
            present, _names(n), mode="classes", test_classes=frac, val_classes=val, seed=seed
        )
    except ValueError as exc:  # too few classes left on one side: said, not silently shrunk
        assert count < 2 or n - count - val < 2, str(exc)
        return
    assert len(split.test) == count and len(split.val) == val
    sides = [set(split.train.tolist()), set(split.val.tolist()), set(split.test.tolist())]
    assert sum(map(len, sides)) == n and set.union(*sides) == set(range(n))
    again = choose_classes(present, _names(n), mode="classes", test_classes=frac, val_classes=val, seed=seed)
    assert np.array_equal(again.test, split.test) and np.array_equal(again.val, split.val)


def test_halves_is_the_retrieval_benchmarks_convention():
    split = choose_classes(np.arange(200), _names(200), mode="halves")
    assert split.train.tolist() == list(range(100)) and split.test.tolist() == list(range(100, 200))
    odd = choose_classes(np.arange(9), _names(9), mode="halves")  # 4 train, 5 test (as the study had)
    assert odd.train.tolist() == [0, 1, 2, 3] and odd.test.tolist() == [4, 5, 6, 7, 8]


def test_explicit_lists_by_name_or_id():
    names = ["ann", "bob", "cy", "dee", "eve", "fay"]
    split = choose_classes(np.arange(6), names, mode="classes", test_classes=["eve", "bob"], val_classes="cy")
    assert split.test.tolist() == [1, 4] and split.val.tolist() == [2] and split.train.tolist() == [0, 3, 5]
    by_id = choose_classes(np.arange(6), names, mode="classes", test_classes=[1, 4])
    assert by_id.test.tolist() == [1, 4]
    numbered = [str(v) for v in (1001, 2002, 3003, 4004, 5005)]  # ids as the user's file has them
    split = choose_classes(np.arange(5), numbered, mode="classes", test_classes=[4004, 5005])
    assert split.test.tolist() == [3, 4]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"test_classes": ["zed"]}, "test_classes: no class 'zed'; the classes are ann, bob"),
        ({"test_classes": ["ann", "ann"]}, "names a class twice"),
        ({"test_classes": 1.5}, r"fraction in \(0, 1\)"),
        ({"test_classes": 0}, "count >= 1"),
        ({"test_classes": 5}, "at least 2 must remain for training"),
        ({"test_classes": 1}, "leaves 1 test class"),
        ({"test_classes": 2, "folds": 3, "fold": 0}, "either test_classes or folds/fold"),
        ({"folds": 3}, "folds and fold go together"),
        ({"folds": 3, "fold": 3}, r"fold must be an integer in 0..2"),
        ({"folds": 1, "fold": 0}, "folds must be an integer >= 2"),
        ({"test_classes": 3, "val_classes": 2}, "val_classes=2 takes 2 of 3 classes and leaves 1"),
        ({"test_classes": True}, "a fraction in"),
    ],
)
def test_bad_class_options_name_themselves(options, message):
    with pytest.raises(ValueError, match=message):
        choose_classes(np.arange(6), ["ann", "bob", "cy", "dee", "eve", "fay"], mode="classes", **options)


# --------------------------------------------------------------------------------------------
# every source


def _disjoint(data, *, train: int, test: int, val: int = 0) -> None:
    sides = _classes(data)
    assert data.open_set and len(sides["train"]) == train == data.num_classes
    unseen_val = sides["val"] - sides["train"]  # validation classes of their own (val_classes)
    assert len(sides["test"]) == test and len(unseen_val) == val
    assert not sides["train"] & sides["test"] and not sides["val"] & sides["test"]
    assert not val or not sides["val"] & sides["train"]
    assert int(data.train.y.max()) < data.num_classes <= int(data.test.y.min())  # training classes first
    assert data.info["class_split"]["test"] == sorted(sides["test"], key=data.class_names.index)


def _pool_size(spec, **options) -> int:
    d = load_dataset(spec, val_fraction=0, **options)
    return len(d.train) + len(d.test)


@pytest.mark.parametrize("spec", ["digits", "mnist1d", "mnist-sample", "japanese-vowels"])
def test_builtins_split_by_class(spec):
    data = load_dataset(spec, split="classes", test_classes=4, val_classes=2, split_seed=3)
    _disjoint(data, train=len(data.class_names) - 6, test=4, val=2)
    assert len(data.train) + len(data.val) + len(data.test) == _pool_size(spec)  # the whole source, pooled
    halves = load_dataset(spec, split="halves", val_fraction=0)
    names = halves.class_names
    assert halves.info["class_split"]["train"] == sorted(names[: halves.num_classes], key=names.index)
    assert len(halves.info["class_split"]["train"]) == len(names) // 2


def test_the_split_does_not_depend_on_the_run_seed():
    a = load_dataset("digits", split="classes", seed=0, split_seed=5)
    b = load_dataset("digits", split="classes", seed=1, split_seed=5)
    c = load_dataset("digits", split="classes", seed=0, split_seed=6)
    assert a.info["class_split"] == b.info["class_split"] != c.info["class_split"]
    assert torch.equal(a.test.x, b.test.x) and torch.equal(a.test.y, b.test.y)


def test_npz_folder_features_idx_cifar_split_by_class(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(60, 8, 8), dtype=np.uint8)
    y = np.arange(60) % 6
    np.savez(
        tmp_path / "d.npz", train_images=x[:40], train_labels=y[:40], test_images=x[40:], test_labels=y[40:]
    )
    _disjoint(
        load_dataset(f"npz:{tmp_path}/d.npz", split="classes", test_classes=["4", "5"]), train=4, test=2
    )

    _write_folder(tmp_path / "f", rng, classes=("ann", "bob", "cy", "dee"), per_class=4)
    data = load_dataset(f"folder:{tmp_path}/f", split="classes", test_classes=["bob", "dee"], val_fraction=0)
    _disjoint(data, train=2, test=2)
    assert _classes(data)["test"] == {"bob", "dee"} and len(data.test) == 8  # every image of a test person

    np.savez(tmp_path / "feat.npz", x=rng.normal(size=(50, 3)), y=np.arange(50) % 5 + 100)
    data = load_dataset(f"features:{tmp_path}/feat.npz", split="classes", folds=2, fold=1, split_seed=1)
    _disjoint(data, train=3, test=2)  # 5 classes in 2 folds: 3 and 2
    data = load_dataset(f"features:{tmp_path}/feat.npz", split="halves", val_fraction=0)
    _disjoint(data, train=2, test=3)
    assert _classes(data)["train"] == {"100", "101"}  # the original label values name the classes

    root = tmp_path / "idx"
    root.mkdir()
    for prefix, m in (("train", 30), ("t10k", 12)):
        images, labels = (
            rng.integers(0, 256, size=(m, 7, 5), dtype=np.uint8),
            (np.arange(m) % 6).astype(np.uint8),
        )
        for kind, rank, arr in (("images", 3, images), ("labels", 1, labels)):
            (root / f"{prefix}-{kind}-idx{rank}-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(arr)))
    _disjoint(load_dataset(f"mnist-idx:{root}", split="halves", val_fraction=0), train=3, test=3)

    _write_cifar(tmp_path / "cifar", rng, per_batch=20)
    data = load_dataset(
        f"cifar10:{tmp_path}/cifar", split="classes", test_classes=["cat", "dog"], val_fraction=0
    )
    _disjoint(data, train=8, test=2)
    assert len(data.train) + len(data.test) == 120


def test_folds_of_a_source_cover_every_class_once():
    tests = [
        set(
            load_dataset("digits", split="classes", folds=3, fold=f, split_seed=2).info["class_split"]["test"]
        )
        for f in range(3)
    ]
    assert set.union(*tests) == {str(i) for i in range(10)} and sum(map(len, tests)) == 10


# --------------------------------------------------------------------------------------------
# a source's own split: closed, open or refused


def _npz(path, train_labels, test_labels, *, val_labels=None, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, labels in (("train", train_labels), ("test", test_labels), ("val", val_labels)):
        if labels is None:
            continue
        labels = np.asarray(labels)
        arrays[f"{split}_images"] = rng.integers(0, 256, size=(len(labels), 6, 6), dtype=np.uint8)
        arrays[f"{split}_labels"] = labels
    np.savez(path, **arrays)
    return f"npz:{path}"


def test_a_test_split_of_unseen_classes_is_open_set(tmp_path):
    """The user's own faces: people 0..24 train, 25..39 test. Detected, never scored closed-set."""
    spec = _npz(tmp_path / "faces.npz", np.repeat(np.arange(25), 4), np.repeat(np.arange(25, 40), 4))
    data = load_dataset(spec, val_fraction=0)
    assert data.open_set and data.num_classes == 25
    assert _classes(data)["test"] == {str(i) for i in range(25, 40)}
    assert int(data.test.y.min()) >= 25 and len(data.class_names) == 40
    closed = load_dataset(_npz(tmp_path / "c.npz", np.repeat(np.arange(5), 4), np.arange(5)))
    assert not closed.open_set and closed.class_names == [str(i) for i in range(5)]


def test_a_partial_overlap_is_refused_with_both_ways_out(tmp_path):
    spec = _npz(tmp_path / "p.npz", np.repeat(np.arange(6), 3), np.array([4, 5, 6, 7]))
    refused = (
        r"only in part: 2 have no training samples \(6, 7\) while 2 do \(4, 5\).*split=classes.*split=samples"
    )
    with pytest.raises(ValueError, match=refused):
        load_dataset(spec)
    for mode in ("classes", "samples"):
        load_dataset(spec, split=mode)  # each way out works
    assert not load_dataset(spec, split="samples").open_set
    val = _npz(tmp_path / "v.npz", np.repeat(np.arange(6), 3), np.arange(6), val_labels=np.array([1, 9]))
    with pytest.raises(ValueError, match="the val split's classes overlap"):
        load_dataset(val)


def test_validation_classes_from_a_closed_source(tmp_path):
    spec = _npz(tmp_path / "d.npz", np.repeat(np.arange(8), 5), np.repeat(np.arange(6), 2))
    data = load_dataset(spec, val_classes=2, split_seed=1)
    assert not data.open_set and data.val_open_set
    sides = _classes(data)
    assert len(sides["val"]) == 2 and not sides["val"] & (sides["train"] | sides["test"])
    assert sides["val"] <= {"6", "7"}  # only classes the test split does not use


def test_split_option_errors(tmp_path):
    spec = _npz(tmp_path / "d.npz", np.repeat(np.arange(6), 3), np.arange(6))
    with pytest.raises(ValueError, match="split must be one of source, samples, classes, halves"):
        load_dataset(spec, split="people")
    with pytest.raises(ValueError, match="test_fraction splits samples.*use test_classes"):
        load_dataset("digits", split="classes", test_fraction=0.3)
    with pytest.raises(ValueError, match="test_fraction: this source has its own test split.*split=samples"):
        load_dataset(spec, test_fraction=0.3)
    with pytest.raises(ValueError, match="split='halves' fixes the test classes"):
        load_dataset("digits", split="halves", test_classes=3)
    with pytest.raises(ValueError, match="keeps the test split's classes"):
        load_dataset("digits", split="samples", test_classes=3)
    with pytest.raises(ValueError, match="unknown option 'split'"):
        load_dataset("identities", split="classes")  # disjoint identities by construction
    with pytest.raises(ValueError, match="split_seed must be >= 0"):
        load_dataset("digits", split="classes", split_seed=-1)
