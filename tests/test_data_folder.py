"""folder: read lazily (scan, index cache, layout from headers) and decode.py's bad samples."""

from __future__ import annotations

import io
import os
import pickle
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from marginkit.data import decode
from marginkit.data.decode import decode_image, image_header
from marginkit.data.folder import ImageFiles, scan_folder, scan_tree
from marginkit.data.loaders import read_folder
from marginkit.data.samples import BadSampleError, concat_samples

RNG = np.random.default_rng(0)


def _image(size=(6, 8), mode="RGB", seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    h, w = size
    shape = (h, w) if mode == "L" else (h, w, 3)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


def _write(path: Path, size=(6, 8), mode="RGB", seed=0, fmt=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    _image(size, mode, seed).save(path, format=fmt)
    return path


def _encoded(fmt: str, size=(16, 16), seed=0) -> bytes:
    buffer = io.BytesIO()
    _image(size, "RGB", seed).save(buffer, format=fmt)
    return buffer.getvalue()


def _make_folder(root: Path, classes=("cat", "dog", "emu"), per_class=5, size=(6, 8), mode="RGB") -> Path:
    seed = 0
    for c in classes:
        for i in range(per_class):
            ext = "png" if i % 2 else "jpg"
            _write(root / c / f"{i:02d}.{ext}", size, mode, seed)
            seed += 1
    return root


def _rows(lazy) -> np.ndarray:
    return np.stack([lazy.read(i) for i in range(len(lazy))])


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def _jpeg_claiming(width: int, height: int) -> bytes:
    data = bytearray(_encoded("JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


# --------------------------------------------------------------------------------------------
# decode.py


def test_decode_equals_the_eager_reader(tmp_path):
    from marginkit.data.loaders import _load_image

    for fmt, ext in (("PNG", "png"), ("JPEG", "jpg"), ("BMP", "bmp")):
        path = _write(tmp_path / f"x.{ext}", (9, 13), "RGB", 3, fmt)
        for mode in ("L", "RGB"):
            for size in (None, (5, 7), (9, 13), (20, 4)):
                expected = _load_image(path, mode, size)
                np.testing.assert_array_equal(decode_image(path, mode, size), expected)
                got = decode_image(path.read_bytes(), mode, size, where="bytes")
                np.testing.assert_array_equal(got, expected)
                assert got.dtype == np.uint8
    assert image_header(path) == ("RGB", (13, 9))


def _jpeg_variants() -> dict[str, bytes]:
    """JPEGs of every kind the fast path takes or leaves: subsamplings, qualities, progressive,
    optimised tables, grayscale, CMYK, odd sizes."""
    out = {}
    colour = _image((61, 97), "RGB", 5).resize((97, 61))
    for sub in (0, 1, 2):
        for progressive in (False, True):
            for quality in (40, 95):
                buffer = io.BytesIO()
                colour.save(buffer, "JPEG", subsampling=sub, progressive=progressive, quality=quality)
                out[f"rgb-{sub}-{progressive}-{quality}"] = buffer.getvalue()
    for name, image, options in (
        ("gray", colour.convert("L"), {"quality": 90}),
        ("gray-progressive", colour.convert("L"), {"progressive": True}),
        ("optimized", colour, {"optimize": True}),
        ("cmyk", colour.convert("CMYK"), {}),
        ("tiny", _image((1, 3), "RGB", 2), {}),
    ):
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", **options)
        out[name] = buffer.getvalue()
    return out


def test_fast_jpeg_decoder_gives_pillows_pixels(tmp_path, monkeypatch):
    pytest.importorskip("simplejpeg")
    import simplejpeg

    calls = []
    real = simplejpeg.decode_jpeg
    monkeypatch.setattr(simplejpeg, "decode_jpeg", lambda *a, **k: calls.append(1) or real(*a, **k))
    for name, data in _jpeg_variants().items():
        own = Image.open(io.BytesIO(data)).size[::-1]
        for mode in ("L", "RGB"):
            for size in (None, own, (7, 5)):
                calls.clear()
                fast = decode_image(data, mode, size, where=name)
                took_fast = bool(calls)
                monkeypatch.setattr(decode, "FAST_JPEG", False)
                try:
                    slow = decode_image(data, mode, size, where=name)
                finally:
                    monkeypatch.setattr(decode, "FAST_JPEG", True)
                assert fast.dtype == slow.dtype == np.uint8
                np.testing.assert_array_equal(fast, slow, err_msg=f"{name} {mode} {size}")
                # the fast path is taken exactly where it gives Pillow's pixels (module doc)
                gray = name.startswith("gray")
                expect = name != "cmyk" and size != (7, 5) and (mode == "RGB" or gray)
                assert took_fast == expect, (name, mode, size)


def test_fast_jpeg_decoder_leaves_bad_files_to_pillow(tmp_path):
    pytest.importorskip("simplejpeg")
    data = _jpeg_variants()["rgb-2-False-95"]
    # extraneous bytes before a marker: libjpeg warns (simplejpeg's strict mode refuses), Pillow decodes
    sos = data.index(b"\xff\xda")
    padded = data[:sos] + b"\x00" * 7 + data[sos:]
    np.testing.assert_array_equal(
        decode_image(padded, "RGB"), np.asarray(Image.open(io.BytesIO(padded))).transpose(2, 0, 1)
    )
    path = tmp_path / "cut.jpg"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadSampleError, match=rf"{path}: truncated or corrupt image"):
        decode_image(path, "RGB")
    with pytest.raises(BadSampleError, match="colour image"):
        decode_image(data, "L", gray_only=True)
    assert decode_image(_jpeg_variants()["gray"], "L", gray_only=True).shape == (1, 61, 97)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image_names_the_file(tmp_path, fmt):
    path = tmp_path / "cls" / f"cut.{fmt.lower()}"
    path.parent.mkdir()
    data = _encoded(fmt, (64, 64))
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadSampleError, match=rf"{path}: truncated or corrupt image") as info:
        decode_image(path, "RGB")
    assert info.value.where == str(path)


def test_corrupt_png_checksum_and_corrupt_jpeg_header(tmp_path):
    png = bytearray(_encoded("PNG"))
    idat = png.index(b"IDAT")
    png[idat + 10] ^= 0xFF  # the chunk's CRC no longer matches
    path = tmp_path / "flip.png"
    path.write_bytes(bytes(png))
    with pytest.raises(BadSampleError, match=rf"{path}: truncated or corrupt image"):
        decode_image(path, "RGB")
    jpeg = bytearray(_encoded("JPEG"))
    jpeg[3:40] = b"\x00" * 37  # no marker where the header should be
    path = tmp_path / "garbled.jpg"
    path.write_bytes(bytes(jpeg))
    with pytest.raises(BadSampleError, match=rf"{path}: truncated or corrupt image"):
        decode_image(path, "RGB")


def test_empty_and_non_image_files(tmp_path):
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(BadSampleError, match=rf"{empty}: empty file \(0 bytes\)"):
        decode_image(empty, "RGB")
    text = tmp_path / "notes.jpg"
    text.write_text("not a picture\n" * 20)
    with pytest.raises(BadSampleError, match=rf"{text}: not an image"):
        decode_image(text, "L")
    with pytest.raises(BadSampleError, match="no such file"):
        decode_image(tmp_path / "gone.png", "L")


@pytest.mark.parametrize("make", [_png_header_only, _jpeg_claiming])
def test_decompression_bomb_refused_from_the_header(tmp_path, monkeypatch, make):
    path = tmp_path / "bomb.img"
    path.write_bytes(make(30_000, 30_000))

    def never(*args, **kwargs):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr("PIL.ImageFile.ImageFile.load", never)
    with pytest.raises(BadSampleError, match=rf"{path}: .*decompression bomb before decoding"):
        decode_image(path, "RGB")
    with pytest.raises(BadSampleError, match="decompression bomb"):
        image_header(path)


def test_own_pixel_cap_applies_below_pillows(tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    Image.new("RGB", (100, 100), (9, 9, 9)).save(path)  # a few hundred bytes
    with pytest.raises(BadSampleError, match=r"declares 100 x 100 pixels, more than the 5,000"):
        decode_image(path, "RGB", max_pixels=5000)
    monkeypatch.setenv("MARGINKIT_MAX_INPUT_MB", "0.01")  # 10 KiB: 2,621 pixels at 4 bytes
    assert decode.max_image_pixels() == int(0.01 * 2**20) // 4
    with pytest.raises(BadSampleError, match="decompression bomb"):
        decode_image(path, "RGB")


def test_decoded_shape_checked_against_the_source(tmp_path):
    path = _write(tmp_path / "x.png", (6, 8))
    with pytest.raises(
        BadSampleError, match=r"decoded to \[3, 6, 8\] but the source's samples are \[3, 4, 4\]"
    ):
        decode_image(path, "RGB", expected=(3, 4, 4))
    with pytest.raises(BadSampleError, match="colour image"):
        decode_image(path, "L", gray_only=True)
    with pytest.raises(ValueError, match="mode must be"):
        decode_image(path, "RGBA")


# --------------------------------------------------------------------------------------------
# folder:


def _assert_same(lazy_raw, eager_raw):
    assert lazy_raw.class_names == eager_raw.class_names
    for side in ("train", "val", "test"):
        lazy_x, eager_x = getattr(lazy_raw, f"x_{side}"), getattr(eager_raw, f"x_{side}")
        if eager_x is None:
            assert lazy_x is None
            continue
        assert lazy_x.shape == eager_x.shape
        np.testing.assert_array_equal(lazy_x.to_array(), eager_x)
        np.testing.assert_array_equal(getattr(lazy_raw, f"y_{side}"), getattr(eager_raw, f"y_{side}"))


@pytest.mark.parametrize(
    "options", [{}, {"image_size": (4, 5)}, {"color": "grayscale", "test_fraction": 0.4}]
)
def test_lazy_folder_equals_eager_read_folder(tmp_path, options):
    root = _make_folder(tmp_path / "data")
    lazy, eager = scan_folder(root, **options), read_folder(root, **options)
    _assert_same(lazy, eager)
    assert lazy.info["split"] == eager.info["split"] and lazy.info["color"] == eager.info["color"]
    assert lazy.kind == "image" and lazy.x_train.dtype == np.uint8


def test_split_layout_and_grayscale_auto_equal_eager(tmp_path):
    root = tmp_path / "data"
    for split, n in (("train", 3), ("val", 2), ("test", 2)):
        _make_folder(
            root / split, classes=("a", "b") if split != "test" else ("b", "c"), per_class=n, mode="L"
        )
    (root / "README.txt").write_text("ignored")
    lazy, eager = scan_folder(root), read_folder(root)
    _assert_same(lazy, eager)
    assert lazy.x_train.sample_shape == (1, 6, 8)
    assert lazy.x_val.relative_path(0) == "val/a/00.jpg"


def test_nested_class_folders_hidden_and_other_files(tmp_path):
    root = tmp_path / "data"
    _write(root / "ann" / "s2" / "b.png", seed=1)
    _write(root / "ann" / "s1" / "a.png", seed=2)
    _write(root / "ann" / "top.png", seed=3)
    _write(root / "bob" / "x.png", seed=4)
    _write(root / "bob" / ".hidden.png", seed=5)
    _write(root / ".cache" / "z.png", seed=6)
    (root / "bob" / "labels.txt").write_text("x")
    scan = scan_tree(root)
    from marginkit.data.folder import _unpack

    assert _unpack(scan.blob, scan.offsets) == ["ann/s1/a.png", "ann/s2/b.png", "ann/top.png", "bob/x.png"]
    assert scan.label.tolist() == [0, 0, 0, 1] and scan.class_names == ["ann", "bob"] and scan.ignored == 1
    raw = scan_folder(root, test_fraction=0.0)
    assert len(raw.x_train) == 4 and raw.info["ignored_files"] == 1
    np.testing.assert_array_equal(raw.x_train.read(0), np.asarray(_image(seed=2)).transpose(2, 0, 1))


def test_bad_files_in_a_class_folder_name_the_file(tmp_path):
    root = _make_folder(tmp_path / "data", per_class=3)
    bad = root / "dog" / "zz.png"
    bad.write_bytes(b"")
    # the header sample reads every header of a small folder: the scan refuses it
    with pytest.raises(BadSampleError, match=rf"{bad}: empty file"):
        scan_folder(root)


def test_a_bad_file_outside_the_header_sample_fails_on_read(tmp_path, monkeypatch):
    root = _make_folder(tmp_path / "data", classes=("a",), per_class=3)
    other = _write(root / "a" / "01.png", (5, 8), seed=9)  # the middle one: not sampled
    monkeypatch.setattr(decode, "HEADER_SAMPLE", 2)
    raw = scan_folder(root, test_fraction=0.0)
    pos = [raw.x_train.where(i) for i in range(3)].index(str(other))
    with pytest.raises(BadSampleError, match=rf"{other}: decoded to \[3, 5, 8\]"):
        raw.x_train.read(pos)
    assert "2 of the 3 images" in raw.info["layout"]


def test_differing_sizes_without_image_size_is_refused(tmp_path):
    root = _make_folder(tmp_path / "data", per_class=2)
    _write(root / "cat" / "odd.png", (7, 7))
    with pytest.raises(ValueError, match="images differ in size.*image_size"):
        scan_folder(root)
    assert scan_folder(root, image_size=7).x_train.sample_shape == (3, 7, 7)


def test_folder_errors_as_the_eager_reader(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        scan_folder(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class sub-folders"):
        scan_folder(tmp_path / "empty")
    (tmp_path / "d" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="class folder holds no images"):
        scan_folder(tmp_path / "d")
    with pytest.raises(ValueError, match="image_size"):
        scan_folder(tmp_path / "d", image_size=0)


def _age(root: Path, seconds: float = 60) -> None:
    old = time.time() - seconds
    for path, _, _ in os.walk(root):
        os.utime(path, (old, old))


def test_index_cache_is_keyed_by_the_directories(tmp_path):
    root = _make_folder(tmp_path / "data")
    _write(root / "dog" / "sess" / "n.png", seed=40)
    cache = tmp_path / "cache"
    first = scan_folder(root, cache_dir=cache)
    assert first.info["index"] == "scanned" and not (cache / "folder-index").exists()  # too fresh to trust
    _age(root)
    assert scan_folder(root, cache_dir=cache).info["index"] == "scanned"
    again = scan_folder(root, cache_dir=cache)
    assert again.info["index"] == "cached scan"
    fresh = scan_folder(root)
    for side in ("train", "test"):
        a, b = getattr(again, f"x_{side}"), getattr(fresh, f"x_{side}")
        assert [a.where(i) for i in range(len(a))] == [b.where(i) for i in range(len(b))]
        np.testing.assert_array_equal(getattr(again, f"y_{side}"), getattr(fresh, f"y_{side}"))
    _write(root / "dog" / "sess" / "m.png", seed=41)  # a nested directory changes
    _age(root)
    changed = scan_folder(root, cache_dir=cache)
    assert changed.info["index"] == "scanned" and changed.info["files"] == first.info["files"] + 1
    (cache / "folder-index").joinpath(os.listdir(cache / "folder-index")[0]).write_bytes(b"junk")
    assert scan_folder(root, cache_dir=cache).info["files"] == first.info["files"] + 1  # ignored, redone


def test_progress_bar_when_asked(tmp_path, capsys):
    root = _make_folder(tmp_path / "data", per_class=2)
    scan_tree(root, progress=True)
    assert "scanning" in capsys.readouterr().err
    scan_tree(root)  # not a terminal: nothing
    assert capsys.readouterr().err == ""


def test_views_pickle_and_pool(tmp_path):
    root = _make_folder(tmp_path / "data")
    raw = scan_folder(root)
    pooled = concat_samples([raw.x_train, raw.x_test])
    assert isinstance(pooled, ImageFiles) and len(pooled) == 15
    clone = pickle.loads(pickle.dumps(pooled[np.arange(15) % 2 == 0]))
    np.testing.assert_array_equal(_rows(clone), _rows(pooled)[::2])
    assert clone.relative_path(0).count("/") == 1 and clone.nbytes_decoded() == 8 * 3 * 6 * 8
