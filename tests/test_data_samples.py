"""LazySamples: views, masks, concatenation, pickling and shapes behave as numpy's leading axis."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marginkit.data.samples import (
    BadSampleError,
    ConcatSamples,
    LazySamples,
    concat_samples,
    is_lazy,
    read_or_skip,
)


class FileRows(LazySamples):
    """Rows of a raw uint8 file, read with a handle opened lazily (as the formats do)."""

    def __init__(self, path: str, n: int, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.path, self.n, self.sample_shape = path, n, shape

    def _num_keys(self) -> int:
        return self.n

    def _handle(self) -> int:
        local = self._local()
        if "fd" not in local:
            local["fd"] = os.open(self.path, os.O_RDONLY)
            local["opened"] = local.get("opened", 0) + 1
        return local["fd"]

    def _read_key(self, key: int, rng: np.random.Generator | None) -> np.ndarray:
        size = int(np.prod(self.sample_shape))
        data = os.pread(self._handle(), size, key * size)
        if data[:1] == b"\xff":
            raise BadSampleError(self._where_key(key), "marked bad")
        return np.frombuffer(data, dtype=np.uint8).reshape(self.sample_shape)

    def _where_key(self, key: int) -> str:
        return f"{self.path} row {key}"

    def _relative_key(self, key: int) -> str:
        return f"rows/{key}"


@pytest.fixture
def data(tmp_path):
    array = np.arange(20 * 6, dtype=np.uint8).reshape(20, 2, 3)
    array[:, 0, 0] = np.arange(20)  # row i starts with i (never 0xff)
    path = tmp_path / "rows.bin"
    path.write_bytes(array.tobytes())
    return FileRows(str(path), 20, (2, 3)), array


def _rows(lazy: LazySamples) -> np.ndarray:
    return np.stack([lazy.read(i) for i in range(len(lazy))]) if len(lazy) else np.zeros((0, 2, 3), np.uint8)


def test_shape_len_and_reading(data):
    lazy, array = data
    assert lazy.shape == (20, 2, 3) and len(lazy) == 20 and lazy.ndim == 3
    assert is_lazy(lazy) and not is_lazy(array)
    np.testing.assert_array_equal(_rows(lazy), array)
    np.testing.assert_array_equal(lazy.to_array(), array)
    assert lazy.nbytes_decoded() == array.nbytes
    assert lazy.where(3).endswith("row 3") and lazy.relative_path(-1) == "rows/19"


@settings(max_examples=40, deadline=None)
@given(
    first=st.lists(st.integers(-20, 19), max_size=15),
    mask_bits=st.lists(st.booleans(), min_size=20, max_size=20),
    start=st.integers(-25, 25),
    stop=st.integers(-25, 25),
    step=st.integers(1, 3),
)
def test_views_of_views_match_numpy(tmp_path_factory, first, mask_bits, start, stop, step):
    array = np.random.default_rng(0).integers(0, 255, (20, 2, 3)).astype(np.uint8)
    path = tmp_path_factory.mktemp("v") / "rows.bin"
    path.write_bytes(array.tobytes())
    lazy = FileRows(str(path), 20, (2, 3))
    index = np.array(first, dtype=np.int64)
    mask = np.array(mask_bits)
    for lz, ar in ((lazy, array), (lazy[::-1], array[::-1])):
        np.testing.assert_array_equal(_rows(lz[index]), ar[index])
        np.testing.assert_array_equal(_rows(lz[mask]), ar[mask])
        np.testing.assert_array_equal(_rows(lz[start:stop:step]), ar[start:stop:step])
        sub, sub_ar = lz[mask], ar[mask]
        if len(sub):
            inner = index % len(sub)
            np.testing.assert_array_equal(_rows(sub[inner]), sub_ar[inner])
            np.testing.assert_array_equal(_rows(sub[1:]), sub_ar[1:])


def test_index_errors(data):
    lazy, _ = data
    with pytest.raises(IndexError, match="out of bounds"):
        lazy[np.array([0, 20])]
    with pytest.raises(IndexError, match="out of bounds"):
        lazy.read(20)
    with pytest.raises(IndexError, match="boolean mask"):
        lazy[np.ones(19, dtype=bool)]
    with pytest.raises(TypeError, match="integer array"):
        lazy[np.array([0.5])]
    assert len(lazy[np.array([], dtype=float)]) == 0  # numpy's empty index
    with pytest.raises(TypeError, match="lazy"):
        np.asarray(lazy)
    one = lazy[-1]
    assert isinstance(one, LazySamples) and one.shape == (1, 2, 3)


def test_concat_of_one_source_is_one_view_and_matches_numpy(data, tmp_path):
    lazy, array = data
    a, b = lazy[np.array([5, 1])], lazy[np.arange(20) % 3 == 0]
    pooled = concat_samples([a, b])
    assert type(pooled) is FileRows  # one source: one view, no chain
    np.testing.assert_array_equal(_rows(pooled), np.concatenate([array[[5, 1]], array[::3]]))
    other_path = tmp_path / "other.bin"
    other = np.full((4, 2, 3), 7, dtype=np.uint8)
    other_path.write_bytes(other.tobytes())
    foreign = FileRows(str(other_path), 4, (2, 3))
    chained = concat_samples([a, foreign, b])
    assert isinstance(chained, ConcatSamples)
    expected = np.concatenate([array[[5, 1]], other, array[::3]])
    np.testing.assert_array_equal(_rows(chained), expected)
    mask = np.arange(len(chained)) % 2 == 1
    np.testing.assert_array_equal(_rows(chained[mask]), expected[mask])
    assert chained.where(2) == f"{other_path} row 0"
    assert chained.nbytes_decoded() == expected.nbytes == chained[np.arange(len(chained))].nbytes_decoded()
    with pytest.raises(ValueError, match="sample shape"):
        concat_samples([lazy, FileRows(str(other_path), 2, (3, 2))])
    with pytest.raises(ValueError, match="at least one"):
        concat_samples([])


def test_pickling_drops_open_handles(data):
    lazy, array = data
    view = lazy[np.array([3, 4])]
    view.read(0)
    assert "fd" in view._local()
    clone = pickle.loads(pickle.dumps(view))
    assert clone._local() == {}  # no handle survives pickling
    np.testing.assert_array_equal(_rows(clone), array[[3, 4]])
    assert "fd" in clone._local()
    clone._pid = -1  # as in a forked worker: the parent's handle is not reused
    clone.read(0)
    assert clone._local()["opened"] == 1 and clone._local() is not view._local()


def test_bad_sample_error_and_policy(data, tmp_path):
    lazy, _ = data
    path = tmp_path / "bad.bin"
    path.write_bytes(b"\xff" * 12)
    bad = FileRows(str(path), 2, (2, 3))
    with pytest.raises(BadSampleError, match=r"bad\.bin row 1: marked bad") as info:
        read_or_skip(bad, 1, policy="raise")
    assert info.value.where.endswith("row 1") and info.value.problem == "marked bad"
    assert read_or_skip(bad, 1, policy="skip") is None
    assert read_or_skip(lazy, 1, policy="skip") is not None
    with pytest.raises(ValueError, match="on_bad_sample"):
        read_or_skip(lazy, 1, policy="ignore")
    err = pickle.loads(pickle.dumps(BadSampleError("f.jpg", "truncated")))
    assert (err.where, err.problem, str(err)) == ("f.jpg", "truncated", "f.jpg: truncated")
    assert str(BadSampleError("whole message")) == "whole message"  # as DataLoader re-raises it
