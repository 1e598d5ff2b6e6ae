"""rec: insightface RecordIO read without mxnet, from files written here from the documented layout."""

from __future__ import annotations

import io
import os
import pickle
import struct

import numpy as np
import pytest
from PIL import Image

from data_files import (
    MAGIC_BYTES,
    encoded,
    image,
    image_record,
    insightface_records,
    record_parts,
    write_recordio,
)
from marginkit.data.recordio import read_record, read_recordio
from marginkit.data.samples import BadSampleError, concat_samples


def _pixels(img, mode="RGB"):
    a = np.asarray(img.convert(mode))
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def _items(n=12, classes=3, fmt="PNG"):
    imgs = [image((6, 8), "RGB", seed) for seed in range(n)]
    return imgs, [(i % classes, encoded(img, fmt)) for i, img in enumerate(imgs)]


def _all(raw):
    """(pixels, labels) of every row, train then test, sorted by the record key."""
    x = concat_samples([raw.x_train, raw.x_test])
    y = np.concatenate([raw.y_train, raw.y_test])
    keys = [int(x.relative_path(i).split("#")[1]) for i in range(len(x))]
    order = np.argsort(keys)
    return np.stack([x.read(int(i)) for i in order]), y[order], np.array(keys)[order]


def test_record_framing_splits_at_the_magic_and_rejoins():
    payload = b"abcd" + MAGIC_BYTES + b"efgh" + MAGIC_BYTES + MAGIC_BYTES + b"xyz"
    framed = record_parts(payload)
    flags = []
    pos = 0
    while pos < len(framed):
        magic, lrec = struct.unpack_from("<II", framed, pos)
        assert magic == 0xCED7230A
        flags.append(lrec >> 29)
        pos += 8 + (((lrec & (2**29 - 1)) + 3) // 4) * 4
    assert flags == [1, 2, 2, 3]
    import tempfile

    with tempfile.TemporaryFile() as handle:
        handle.write(framed)
        handle.flush()
        assert read_record(handle.fileno(), 0, len(framed), "t", 1 << 20) == payload


def test_insightface_layout_with_header_record(tmp_path):
    imgs, items = _items()
    write_recordio(tmp_path, insightface_records(items, 3))
    (tmp_path / "property").write_text("3,6,8\n")
    raw = read_recordio(tmp_path, test_fraction=0.25)
    x, y, keys = _all(raw)
    assert keys.tolist() == list(range(1, 13))  # the identity records after the images are not rows
    np.testing.assert_array_equal(y, [label for label, _ in items])
    np.testing.assert_array_equal(x, np.stack([_pixels(i) for i in imgs]))
    assert "insightface" in raw.info["records"] and raw.info["property"]["num_classes"] == 3
    assert len(raw.y_test) == 3 and raw.x_train.sample_shape == (3, 6, 8)


def test_im2rec_layout_vector_labels_and_split_records(tmp_path):
    imgs, items = _items(fmt="JPEG")
    records = {}
    for key, (label, data) in enumerate(items):
        vector = [label, 0.25, 7.0] if key % 2 else label  # vector labels: the class is the first
        ids = (0xCED7230A, 0xCED7230A | (0xCED7230A << 32)) if key % 3 == 0 else (0, 0)  # magic in the header
        records[key] = image_record(vector, data, ids)
    rec, _ = write_recordio(tmp_path, records)
    assert rec.read_bytes().count(MAGIC_BYTES) > len(records)  # some records are written in parts
    raw = read_recordio(rec, test_fraction=0.25)  # the .rec named directly
    x, y, keys = _all(raw)
    assert keys.tolist() == list(range(12)) and "im2rec" in raw.info["records"]
    np.testing.assert_array_equal(y, [label for label, _ in items])
    for got, img in zip(x, imgs, strict=True):  # JPEG: compare with Pillow's decoding of the bytes
        np.testing.assert_array_equal(got, _pixels(Image.open(io.BytesIO(encoded(img, "JPEG")))))


def test_grayscale_resize_pickling_and_cache(tmp_path):
    _, items = _items()
    rec, _ = write_recordio(tmp_path, insightface_records(items, 3))
    raw = read_recordio(tmp_path, color="grayscale", image_size=(4, 4), cache_dir=tmp_path / "cache")
    assert raw.x_train.sample_shape == (1, 4, 4) and raw.info["index"] == "read from the record headers"
    first = raw.x_train.read(0)
    clone = pickle.loads(pickle.dumps(raw.x_train))
    assert clone._local() == {}
    np.testing.assert_array_equal(clone.read(0), first)
    again = read_recordio(tmp_path, color="grayscale", image_size=(4, 4), cache_dir=tmp_path / "cache")
    assert again.info["index"] == "cached"
    np.testing.assert_array_equal(again.y_train, raw.y_train)
    with open(rec, "ab") as handle:  # the .rec changes: the cached index is not used
        handle.write(b"\0\0\0\0")
    assert read_recordio(tmp_path, cache_dir=tmp_path / "cache").info["index"] != "cached"


def test_idx_offset_past_the_end_names_the_record(tmp_path):
    _, items = _items(4)
    rec, idx = write_recordio(tmp_path, {k: image_record(lab, d) for k, (lab, d) in enumerate(items)})
    lines = idx.read_text().splitlines()
    lines[2] = f"2\t{rec.stat().st_size + 100}"
    idx.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        ValueError, match=rf"{idx}: record 2 at byte offset {rec.stat().st_size + 100} is past the end"
    ):
        read_recordio(tmp_path)


def test_bad_magic_names_the_offset(tmp_path):
    _, items = _items(4)
    _, idx = write_recordio(tmp_path, {k: image_record(lab, d) for k, (lab, d) in enumerate(items)})
    lines = idx.read_text().splitlines()
    key, offset = map(int, lines[1].split())
    lines[1] = f"{key}\t{offset + 16}"  # inside the record, 4-aligned: no magic there
    idx.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        BadSampleError,
        match=rf"record 1 \(byte offset {offset + 16}\): bad magic 0x[0-9a-f]+ at byte offset {offset + 16}",
    ):
        read_recordio(tmp_path)


def test_corruption_after_opening_is_a_bad_sample_on_read(tmp_path):
    _, items = _items(6)
    rec, idx = write_recordio(tmp_path, {k: image_record(lab, d) for k, (lab, d) in enumerate(items)})
    raw = read_recordio(tmp_path, test_fraction=0.0)
    x = raw.x_train
    offset = int(idx.read_text().splitlines()[3].split()[1])
    row = [x.relative_path(i) for i in range(len(x))].index("train.rec#3")
    with open(rec, "r+b") as handle:
        handle.seek(offset + 8 + 24 + 10)
        handle.write(b"\0" * 40)  # inside the PNG's data
    with pytest.raises(
        BadSampleError, match=rf"{rec} record 3 \(byte offset {offset}\): (truncated or corrupt|not an image)"
    ):
        x.read(row)
    with open(rec, "r+b") as handle:
        handle.seek(offset)
        handle.write(b"XXXX")
    with pytest.raises(BadSampleError, match=rf"record 3 \(byte offset {offset}\): bad magic"):
        x.read(row)
    with open(rec, "r+b") as handle:
        handle.seek(offset)
        handle.write(MAGIC_BYTES)
    os.truncate(rec, offset + 20)
    with pytest.raises(BadSampleError, match="record 3 .*truncated"):
        x[np.array([row])].read(0)


def test_malformed_idx_bad_labels_and_property(tmp_path):
    _, items = _items(4)
    _, idx = write_recordio(tmp_path, {k: image_record(lab, d) for k, (lab, d) in enumerate(items)})
    good = idx.read_text()
    idx.write_text(good.replace("2\t", "2 x\t", 1))
    with pytest.raises(ValueError, match=rf"{idx}, line 3: expected 'key<TAB>byte offset'"):
        read_recordio(tmp_path)
    idx.write_text(good.replace("3\t", "3\t1.5", 1).replace("\t1.5", "\t1.5 ", 1))
    with pytest.raises(ValueError, match=rf"{idx}, line 4: expected"):
        read_recordio(tmp_path)
    idx.write_text("\n" + good.replace("\n", "\n\n"))  # blank lines are allowed
    assert len(read_recordio(tmp_path, test_fraction=0.0).y_train) == 4
    idx.write_text(good)
    (tmp_path / "property").write_text("2,6,8")
    with pytest.raises(ValueError, match="num_classes=2 but a record has label 2"):
        read_recordio(tmp_path)
    (tmp_path / "property").unlink()
    write_recordio(tmp_path, {0: image_record(-1, items[0][1]), 1: image_record(1.5, items[1][1])})
    with pytest.raises(
        ValueError, match=r"record 0 \(byte offset 0\): label -1.0 is not a non-negative integer"
    ):
        read_recordio(tmp_path)
    with pytest.raises(FileNotFoundError, match="train.idx"):
        read_recordio(tmp_path / "missing")


_INHERITED: dict = {}


def _read_in_child(i):
    x = _INHERITED["x"]  # inherited through fork, not pickled
    inherited = x._local_state["rec"]  # the parent's open handle came along ...
    array = x.read(i)
    own = x._local()["rec"]
    return array, own is not inherited and own.fd != inherited.fd  # ... and is not the one read with


def test_a_forked_worker_opens_its_own_handle(tmp_path):
    import multiprocessing

    _, items = _items(4)
    write_recordio(tmp_path, {k: image_record(lab, d) for k, (lab, d) in enumerate(items)})
    x = read_recordio(tmp_path, test_fraction=0.0).x_train
    parent = x.read(1)
    _INHERITED["x"] = x
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            child, reopened = pool.apply(_read_in_child, (1,))
    finally:
        _INHERITED.clear()
    np.testing.assert_array_equal(child, parent)
    assert reopened  # never the parent's descriptor (forked workers would share its file offset)
