"""csv: manifests in OML's convention, read lazily; bad rows named by file and line."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from marginkit.data.manifest import read_manifest
from marginkit.data.samples import BadSampleError


def _image(path, seed, size=(6, 8)):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    return np.asarray(Image.open(path).convert("RGB")).transpose(2, 0, 1)


def _manifest(tmp_path, rows, header="label,path,split", name="data.csv"):
    csv = tmp_path / name
    csv.write_text(header + "\n" + "\n".join(rows) + "\n")
    return csv


@pytest.fixture
def images(tmp_path):
    pixels = {}
    for i in range(8):
        rel = f"img/{i}.png"
        pixels[rel] = _image(tmp_path / rel, i)
    return pixels


def test_oml_train_validation_rows_and_string_labels(tmp_path, images):
    rows = [f"{'cat' if i % 2 else 'ant'},img/{i}.png,{'train' if i < 5 else 'validation'}" for i in range(8)]
    rows = [r + (",True,False" if "validation" in r else ",,") for r in rows]
    raw = read_manifest(_manifest(tmp_path, rows, "label,path,split,is_query,is_gallery"))
    assert raw.class_names == ["ant", "cat"]
    assert raw.y_train.tolist() == [0, 1, 0, 1, 0] and raw.y_test.tolist() == [1, 0, 1]
    assert raw.x_val is None and "validation rows are the test split" in raw.info["split"]
    for i in range(3):
        np.testing.assert_array_equal(raw.x_test.read(i), images[f"img/{5 + i}.png"])
    assert raw.x_test.relative_path(0) == "img/5.png"
    assert raw.info["is_query"]["test"].tolist() == [True] * 3
    assert raw.info["is_gallery"]["test"].tolist() == [False] * 3


def test_integer_labels_test_and_val_rows_and_absolute_paths(tmp_path, images):
    absolute = tmp_path / "img" / "7.png"
    split = ["train", "train", "train", "val", "test", "TEST", "train", "validation"]
    rows = [f"{(i * 7) % 3 + 10},img/{i}.png,{split[i]}" for i in range(7)]
    rows.append(f"11,{absolute},{split[7]}")
    raw = read_manifest(_manifest(tmp_path, rows))
    assert raw.class_names == ["10", "11", "12"]
    assert (
        raw.y_train.tolist() == [0, 1, 2, 0]
        and raw.y_val.tolist() == [0, 1]
        and raw.y_test.tolist() == [1, 2]
    )
    np.testing.assert_array_equal(raw.x_val.read(1), images["img/7.png"])
    assert raw.x_val.where(1) == str(absolute)


def test_only_train_rows_hold_out_a_stratified_test_split(tmp_path, images):
    rows = [f"{i % 2},img/{i}.png,train" for i in range(8)]
    raw = read_manifest(_manifest(tmp_path, rows), test_fraction=0.25)
    assert len(raw.y_test) == 2 and sorted(raw.y_test.tolist()) == [0, 1] and len(raw.y_train) == 6


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("0,,train", r"line 3: missing path"),
        ("0,img/nope.png,train", r"line 3: .*img/nope\.png: no such file"),
        (",img/1.png,train", r"line 3: bad label: empty"),
        ("1.5,img/1.png,train", r"line 3: bad label '1\.5'"),
        ("-2,img/1.png,train", r"line 3: bad label '-2'"),
        ("0,img/1.png,holdout", r"line 3: unknown split 'holdout'"),
        ("0,img/1.png,train,extra", r"line 3: more fields"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, images, row, message):
    csv = _manifest(tmp_path, ["0,img/0.png,train", row, "1,img/2.png,test"])
    with pytest.raises(ValueError, match=rf"{csv}, {message}"):
        read_manifest(csv)


def test_bad_query_flag_missing_columns_and_empty(tmp_path, images):
    csv = _manifest(
        tmp_path, ["0,img/0.png,train,", "1,img/1.png,validation,maybe"], "label,path,split,is_query"
    )
    with pytest.raises(ValueError, match=rf"{csv}, line 3: is_query must be a boolean"):
        read_manifest(csv)
    csv = _manifest(tmp_path, ["img/0.png,train"], "path,split")
    with pytest.raises(ValueError, match=rf"{csv}: missing column\(s\) label"):
        read_manifest(csv)
    with pytest.raises(ValueError, match="lists no rows"):
        read_manifest(_manifest(tmp_path, []))
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_manifest(tmp_path / "none.csv")
    with pytest.raises(ValueError, match="no row has split 'train'"):
        read_manifest(_manifest(tmp_path, ["0,img/0.png,test"]))


def test_bounding_boxes_are_not_applied_and_said_so(tmp_path, images):
    rows = ["0,img/0.png,train,1,2,1,2", "1,img/1.png,test,,,,"]
    with pytest.warns(UserWarning, match="1 row\\(s\\) give a bounding box"):
        read_manifest(_manifest(tmp_path, rows, "label,path,split,x_1,x_2,y_1,y_2"))


def test_a_bad_image_is_named_on_read(tmp_path, images):
    (tmp_path / "img" / "1.png").write_bytes(b"\x89PNG broken")
    rows = [f"{i % 2},img/{i}.png,train" for i in range(8)]
    csv = _manifest(tmp_path, rows)
    with pytest.raises(BadSampleError, match=r"img/1\.png: (not an image|truncated)"):
        read_manifest(csv)  # a small manifest: every header is read up front
