"""Users' file formats, each on tiny files written here, including hostile and broken ones."""

from __future__ import annotations

import gzip
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from marginkit._files import INPUT_LIMIT_ENV
from marginkit.data import load_dataset
from marginkit.data.loaders import RestrictedUnpickler, read_idx, restricted_load


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# --------------------------------------------------------------------------------------------
# npz (MedMNIST schema)


def _medmnist(rng, n=(40, 10, 20), shape=(28, 28), classes=4, label_shape="column"):
    out = {}
    for split, m in zip(("train", "val", "test"), n, strict=True):
        out[f"{split}_images"] = rng.integers(0, 256, size=(m, *shape), dtype=np.uint8)
        y = np.arange(m) % classes
        out[f"{split}_labels"] = (y[:, None] if label_shape == "column" else y).astype(np.uint8)
    return out


def test_npz_medmnist_with_val(tmp_path, rng):
    arrays = _medmnist(rng)
    np.savez(tmp_path / "m.npz", **arrays)
    data = load_dataset(f"npz:{tmp_path / 'm.npz'}", val_fraction=0.5)
    assert data.input_shape == (1, 28, 28) and data.kind == "image" and data.num_classes == 4
    assert (len(data.train), len(data.val), len(data.test)) == (40, 10, 20)  # val_fraction ignored
    np.testing.assert_array_equal(data.val.x[:, 0].numpy(), arrays["val_images"] / np.float32(255))
    np.testing.assert_array_equal(data.test.y.numpy(), arrays["test_labels"][:, 0])
    assert data.info["val_split"] == "provided by the source"


def test_npz_rgb_channels_last_and_carved_val(tmp_path, rng):
    arrays = _medmnist(rng, shape=(8, 6, 3), label_shape="flat")
    del arrays["val_images"], arrays["val_labels"]
    np.savez(tmp_path / "rgb.npz", **arrays)
    data = load_dataset(f"npz:{tmp_path / 'rgb.npz'}", val_fraction=0.25, seed=1)
    assert data.input_shape == (3, 8, 6)
    assert len(data.train) == 28 and len(data.val) == 12  # round(0.25 * 10) = 3 per class (half up)
    img = arrays["test_images"][3]
    assert float(data.test.x[3, 2, 5, 1]) == pytest.approx(img[5, 1, 2] / 255)


def test_npz_errors_name_path_and_expectation(tmp_path, rng):
    good = _medmnist(rng)
    cases = {
        "missing": ({k: v for k, v in good.items() if k != "test_labels"}, "missing array.*test_labels"),
        "fraction": ({**good, "train_labels": np.full(40, 0.5)}, "labels must be integers.*0.5"),
        "mismatch": ({**good, "test_labels": good["test_labels"][:5]}, "20 samples but 5 labels"),
        "multi": ({**good, "train_labels": np.zeros((40, 3), np.uint8)}, "multi-label"),
        "shape": ({**good, "val_images": good["val_images"][:, :20]}, "image shapes differ"),
        "pixels": ({**good, "train_images": good["train_images"] * 2.0}, r"floating images .*\[0, 1\]"),
        "halfval": ({k: v for k, v in good.items() if k != "val_labels"}, "given together"),
    }
    for name, (arrays, message) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(ValueError, match=message) as info:
            load_dataset(f"npz:{path}")
        assert str(path) in str(info.value)


def test_npz_corrupt_pickled_and_missing_files(tmp_path):
    bad = tmp_path / "corrupt.npz"
    bad.write_bytes(b"PK\x03\x04 definitely not a zip")
    with pytest.raises(ValueError, match="not an .npz archive"):
        load_dataset(f"npz:{bad}")
    objects = tmp_path / "objects.npz"
    np.savez(objects, train_images=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match=str(objects)):
        load_dataset(f"npz:{objects}")
    with pytest.raises(FileNotFoundError, match="nowhere.npz"):
        load_dataset(f"npz:{tmp_path / 'nowhere.npz'}")


def test_npz_integral_float_labels_are_accepted(tmp_path, rng):
    arrays = _medmnist(rng)
    arrays["train_labels"] = arrays["train_labels"].astype(np.float32)
    np.savez(tmp_path / "f.npz", **arrays)
    data = load_dataset(f"npz:{tmp_path / 'f.npz'}")
    assert data.train.y.dtype == torch.int64 and data.num_classes == 4


def _npy_claiming(shape, dtype="<u1", data=b""):
    """The bytes of a .npy member whose header claims ``shape`` but that holds only ``data``."""
    header = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': {tuple(shape)}, }}"
    header = header.ljust(118) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1") + data


def test_npz_claiming_6_gb_is_refused_before_allocating(tmp_path, rng):
    import zipfile

    good = _medmnist(rng)
    path = tmp_path / "claims.npz"
    np.savez(path, **{k: v for k, v in good.items() if k != "train_images"})
    with zipfile.ZipFile(path, "a") as z:  # 144 bytes that claim 6 GB of images
        z.writestr("train_images.npy", _npy_claiming((60_000, 1000, 100)))
    with pytest.raises(ValueError, match=r"claims.npz: array 'train_images': .*\[60000, 1000, 100\]") as e:
        load_dataset(f"npz:{path}")
    assert "above the input memory limit" in str(e.value) and INPUT_LIMIT_ENV in str(e.value)
    small = tmp_path / "small.npz"  # a claim under the limit that the member does not hold
    np.savez(small, **{k: v for k, v in good.items() if k != "train_images"})
    with zipfile.ZipFile(small, "a") as z:
        z.writestr("train_images.npy", _npy_claiming((40, 1000, 1000)))
    with pytest.raises(ValueError, match=r"small.npz: array 'train_images': truncated array data"):
        load_dataset(f"npz:{small}")
    # A genuine archive over the limit is refused from its headers, before it is read.
    big = tmp_path / "big.npz"
    np.savez_compressed(
        big,
        **{**good, "train_images": np.zeros((3000, 28, 28), np.uint8), "train_labels": np.arange(3000) % 4},
    )
    assert big.stat().st_size < 100_000
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(INPUT_LIMIT_ENV, "2")
        with pytest.raises(ValueError, match=r"big.npz: array 'train_images': .*exceeds the limit"):
            load_dataset(f"npz:{big}")
        mp.setenv(INPUT_LIMIT_ENV, "3")
        assert len(load_dataset(f"npz:{big}").train) == 3000


# --------------------------------------------------------------------------------------------
# IDX


def _idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(">" + "I" * array.ndim, *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def _write_idx_dir(root, rng, *, gz: bool, n=(30, 12)):
    root.mkdir()
    arrays = {}
    for prefix, m in zip(("train", "t10k"), n, strict=True):
        images = rng.integers(0, 256, size=(m, 7, 5), dtype=np.uint8)
        labels = (np.arange(m) % 3).astype(np.uint8)
        arrays[prefix] = (images, labels)
        for kind, rank, arr in (("images", 3, images), ("labels", 1, labels)):
            name = f"{prefix}-{kind}-idx{rank}-ubyte"
            data = _idx_bytes(arr)
            if gz:
                (root / (name + ".gz")).write_bytes(gzip.compress(data))
            else:
                (root / name).write_bytes(data)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_plain_and_gzipped(tmp_path, rng, gz):
    arrays = _write_idx_dir(tmp_path / "idx", rng, gz=gz)
    data = load_dataset(f"mnist-idx:{tmp_path / 'idx'}", val_fraction=0.0)
    assert data.input_shape == (1, 7, 5) and data.num_classes == 3
    np.testing.assert_array_equal(data.test.x[:, 0].numpy(), arrays["t10k"][0] / np.float32(255))
    np.testing.assert_array_equal(data.test.y.numpy(), arrays["t10k"][1])
    # train order is preserved when nothing is carved
    np.testing.assert_array_equal(data.train.y.numpy(), arrays["train"][1])


def _budget():
    from marginkit._files import InputBudget

    return InputBudget("test")


def test_read_idx_other_types_and_endianness(tmp_path):
    a = np.arange(6, dtype=np.int32).reshape(2, 3) - 3
    (tmp_path / "a").write_bytes(_idx_bytes(a, 0x0C))
    np.testing.assert_array_equal(read_idx(tmp_path / "a", _budget()), a)
    f = np.linspace(-1, 1, 4).astype(np.float64)
    (tmp_path / "f.gz").write_bytes(gzip.compress(_idx_bytes(f, 0x0E)))
    np.testing.assert_array_equal(read_idx(tmp_path / "f.gz", _budget()), f)


def test_idx_gzip_bomb_is_refused_before_decompressing(tmp_path, monkeypatch):
    # 10 GB declared, a few kB of gzip: refused from the header, nothing is decompressed.
    header = bytes([0, 0, 0x08, 3]) + struct.pack(">III", 10_000, 1000, 1000)
    bomb = tmp_path / "bomb.gz"
    with gzip.open(bomb, "wb") as f:
        f.write(header)
        f.write(bytes(50_000_000))
    assert bomb.stat().st_size < 100_000
    with pytest.raises(
        ValueError, match=r"bomb.gz \(IDX array \[10000, 1000, 1000\]\) needs .*input memory limit"
    ):
        read_idx(bomb, _budget())
    # A header that understates its data: decompression stops one byte past the declared size.
    small = tmp_path / "small.gz"
    with gzip.open(small, "wb") as f:
        f.write(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10) + bytes(50_000_000))
    with pytest.raises(ValueError, match="declares shape \\[10\\].*holds more data bytes"):
        read_idx(small, _budget())
    # The limit is one environment variable.
    monkeypatch.setenv(INPUT_LIMIT_ENV, "0.5")
    one_mb = tmp_path / "one_mb.gz"
    one_mb.write_bytes(gzip.compress(_idx_bytes(np.zeros(2**20, np.uint8))))
    with pytest.raises(ValueError, match="above the input memory limit of 0.5 MB.*MARGINKIT_MAX_INPUT_MB"):
        read_idx(one_mb, _budget())
    monkeypatch.setenv(INPUT_LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match="MARGINKIT_MAX_INPUT_MB must be a number of megabytes"):
        read_idx(one_mb, _budget())


def test_mnist_idx_errors(tmp_path, rng):
    _write_idx_dir(tmp_path / "d", rng, gz=False)
    images = tmp_path / "d" / "train-images-idx3-ubyte"
    good = images.read_bytes()
    images.write_bytes(b"\x12\x34" + good[2:])
    with pytest.raises(ValueError, match="bad magic number"):
        load_dataset(f"mnist-idx:{tmp_path / 'd'}")
    images.write_bytes(good[:-7])
    with pytest.raises(ValueError, match=r"declares shape \[30, 7, 5\].*truncated") as info:
        load_dataset(f"mnist-idx:{tmp_path / 'd'}")
    assert str(images) in str(info.value)
    images.write_bytes(good)
    labels = tmp_path / "d" / "t10k-labels-idx1-ubyte"
    labels.write_bytes(_idx_bytes(np.zeros(5, np.uint8)))
    with pytest.raises(ValueError, match="12 samples but 5 labels"):
        load_dataset(f"mnist-idx:{tmp_path / 'd'}")
    labels.unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_dataset(f"mnist-idx:{tmp_path / 'd'}")
    gz = tmp_path / "d" / "t10k-labels-idx1-ubyte.gz"
    gz.write_bytes(b"\x1f\x8b" + b"broken")
    with pytest.raises(ValueError, match="corrupt gzip"):
        load_dataset(f"mnist-idx:{tmp_path / 'd'}")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_dataset(f"mnist-idx:{tmp_path / 'nope'}")


# --------------------------------------------------------------------------------------------
# CIFAR-10 python batches


def _write_cifar(root, rng, *, per_batch=6, protocol=2):
    root.mkdir()
    arrays = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        arrays[name] = (data, labels)
        batch = {b"batch_label": b"x", b"labels": labels, b"data": data, b"filenames": [b"f"] * per_batch}
        (root / name).write_bytes(pickle.dumps(batch, protocol=protocol))
    names = [n.encode() for n in ("airplane", "automobile", "bird", "cat", "deer")]
    names += [n.encode() for n in ("dog", "frog", "horse", "ship", "truck")]
    (root / "batches.meta").write_bytes(
        pickle.dumps({b"label_names": names, b"num_vis": 3072}, protocol=protocol)
    )
    return arrays


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_batches(tmp_path, rng, protocol):
    arrays = _write_cifar(tmp_path / "cifar-10-batches-py", rng, protocol=protocol)
    data = load_dataset(f"cifar10:{tmp_path}", val_fraction=0.0)  # the parent folder works too
    assert data.input_shape == (3, 32, 32) and data.num_classes == 10 and len(data.train) == 30
    assert data.class_names[:3] == ["airplane", "automobile", "bird"]
    raw, labels = arrays["test_batch"]
    # CIFAR rows are the R plane, then G, then B, each row-major 32x32
    assert float(data.test.x[2, 1, 3, 4]) == pytest.approx(raw[2, 1024 + 3 * 32 + 4] / 255)
    np.testing.assert_array_equal(data.test.y.numpy(), labels)


class _SystemCall:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _Eval:
    def __reduce__(self):
        return (eval, ("__import__('os').getcwd()",))


@pytest.mark.parametrize("payload", ["system", "eval", "nested"])
def test_malicious_cifar_pickle_is_refused(tmp_path, rng, payload):
    root = tmp_path / "c"
    _write_cifar(root, rng)
    marker = tmp_path / "pwned"
    evil = {
        "system": _SystemCall(f"touch {marker}"),
        "eval": _Eval(),
        "nested": {b"data": np.zeros((1, 3072), np.uint8), b"labels": [_SystemCall(f"touch {marker}")]},
    }[payload]
    (root / "data_batch_3").write_bytes(pickle.dumps(evil, protocol=2))
    with pytest.raises(ValueError, match="unsafe or corrupt pickle refused: refusing to load global") as info:
        load_dataset(f"cifar10:{root}")
    assert "data_batch_3" in str(info.value)
    assert not marker.exists()


def test_restricted_unpickler_admits_numpy_and_plain_data(tmp_path):
    value = {
        "a": np.arange(6, dtype=np.int16).reshape(2, 3),
        b"b": [1, 2.5, "s", b"bytes", None, True, (1, 2)],
        "c": np.float32(3.5),
    }
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"p{protocol}.pkl"
        path.write_bytes(pickle.dumps(value, protocol=protocol))
        back = restricted_load(path)
        np.testing.assert_array_equal(back["a"], value["a"])
        assert back[b"b"] == value[b"b"] and float(back["c"]) == 3.5
    assert issubclass(RestrictedUnpickler, pickle.Unpickler)
    (tmp_path / "cls.pkl").write_bytes(pickle.dumps(_Eval.__reduce__, protocol=2))
    with pytest.raises(ValueError, match="refusing to load global"):
        restricted_load(tmp_path / "cls.pkl")


def test_cifar10_errors(tmp_path, rng):
    root = tmp_path / "c"
    _write_cifar(root, rng)
    (root / "data_batch_5").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_5"):
        load_dataset(f"cifar10:{root}")
    (root / "data_batch_5").write_bytes(
        pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]})
    )
    with pytest.raises(ValueError, match=r"\[N, 3072\]"):
        load_dataset(f"cifar10:{root}")
    (root / "data_batch_5").write_bytes(
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1.5]})
    )
    with pytest.raises(ValueError, match="labels must be integers"):
        load_dataset(f"cifar10:{root}")
    (root / "data_batch_5").write_bytes(b"\x80\x02garbage")
    with pytest.raises(ValueError, match="data_batch_5"):
        load_dataset(f"cifar10:{root}")


class _Uninitialised:
    """Pickles as a direct call that allocates an array of uninitialised memory."""

    def __init__(self, shape, dtype, via_reconstruct=False):
        self.shape, self.dtype, self.via = shape, np.dtype(dtype), via_reconstruct

    def __reduce__(self):
        if self.via:
            from numpy._core.multiarray import _reconstruct

            return (_reconstruct, (np.ndarray, self.shape, b"B"))
        return (np.ndarray, (self.shape, self.dtype))


@pytest.mark.parametrize("via_reconstruct", [False, True])
def test_crafted_cifar_batch_of_uninitialised_memory_is_refused(tmp_path, rng, via_reconstruct):
    root = tmp_path / "c"
    _write_cifar(root, rng)
    batch = {
        b"data": _Uninitialised((30_000, 3072), np.uint8, via_reconstruct),
        b"labels": _Uninitialised((30_000,), np.int64, via_reconstruct),
    }
    payload = pickle.dumps(batch, protocol=2)
    assert len(payload) < 400  # a few hundred bytes that would claim 92 MB
    (root / "data_batch_2").write_bytes(payload)
    with pytest.raises(ValueError, match="data_batch_2: unsafe or corrupt pickle refused: refusing"):
        load_dataset(f"cifar10:{root}")


def test_cifar_batch_must_be_the_documented_layout(tmp_path, rng):
    root = tmp_path / "c"
    _write_cifar(root, rng)
    (root / "batches.meta").unlink()
    data = np.zeros((6, 3072), np.uint8)
    (root / "test_batch").write_bytes(pickle.dumps({b"data": data, b"labels": [232, 0, 1, 2, 3, 4]}))
    with pytest.raises(ValueError, match=r"test_batch: label 232 is outside the 10 classes 0..9"):
        load_dataset(f"cifar10:{root}")
    (root / "test_batch").write_bytes(pickle.dumps({b"data": data, b"labels": {"a": 1}}))
    with pytest.raises(ValueError, match="'labels' must be a list of integers"):
        load_dataset(f"cifar10:{root}")
    objects = np.array([None] * 6, dtype=object)
    (root / "test_batch").write_bytes(pickle.dumps({b"data": data, b"labels": objects}))
    with pytest.raises(ValueError, match="refusing numpy dtype object"):
        load_dataset(f"cifar10:{root}")
    with pytest.MonkeyPatch.context() as mp:  # six batch files of ~20 kB: over a 0.1 MB limit
        mp.setenv(INPUT_LIMIT_ENV, "0.1")
        with pytest.raises(ValueError, match="batch file .* above the input memory limit"):
            load_dataset(f"cifar10:{root}")


# --------------------------------------------------------------------------------------------
# folder of images


def _save(path, array):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def _write_folder(root, rng, *, classes=("cat", "dog", "eel"), per_class=5, size=(6, 9), rgb=False):
    arrays = {}
    for c in classes:
        for i in range(per_class):
            shape = (*size, 3) if rgb else size
            img = rng.integers(0, 256, size=shape, dtype=np.uint8)
            _save(root / c / f"{i}.png", img)
            arrays[(c, i)] = img
    return arrays


def test_folder_flat_layout_split_and_exact_pixels(tmp_path, rng):
    arrays = _write_folder(tmp_path / "f", rng, per_class=10)
    (tmp_path / "f" / "cat" / "notes.txt").write_text("ignored")
    data = load_dataset(f"folder:{tmp_path / 'f'}", test_fraction=0.2, val_fraction=0.0)
    assert data.class_names == ["cat", "dog", "eel"] and data.input_shape == (1, 6, 9)
    assert data.test.class_counts(3).tolist() == [2, 2, 2] and len(data.train) == 24
    table = {img.tobytes(): c for (c, _), img in arrays.items()}
    for split in (data.train, data.test):
        for x, y in zip(split.x, split.y, strict=True):
            pixels = np.round(x[0].numpy() * 255).astype(np.uint8)
            assert table[pixels.tobytes()] == data.class_names[int(y)]


def test_folder_train_test_layout_rgb_and_resize(tmp_path, rng):
    _write_folder(tmp_path / "g" / "train", rng, rgb=True, size=(10, 12))
    _write_folder(tmp_path / "g" / "test", rng, classes=("cat", "dog"), per_class=2, size=(20, 24), rgb=True)
    with pytest.raises(ValueError, match="images differ in size.*image_size"):
        load_dataset(f"folder:{tmp_path / 'g'}")
    data = load_dataset(f"folder:{tmp_path / 'g'}", image_size=(10, 12), val_fraction=0.2)
    assert data.input_shape == (3, 10, 12) and len(data.test) == 4 and len(data.train) + len(data.val) == 15
    gray = load_dataset(f"folder:{tmp_path / 'g'}", image_size=8, color="grayscale")
    assert gray.input_shape == (1, 8, 8)


def test_folder_auto_color_mixed_is_rgb(tmp_path, rng):
    _write_folder(tmp_path / "h", rng)
    _save(tmp_path / "h" / "cat" / "color.png", rng.integers(0, 256, size=(6, 9, 3), dtype=np.uint8))
    data = load_dataset(f"folder:{tmp_path / 'h'}")
    assert data.input_shape == (3, 6, 9)
    assert data.info["color"] == "RGB"


def test_folder_errors(tmp_path, rng):
    _write_folder(tmp_path / "e", rng)
    (tmp_path / "e" / "dog" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(ValueError, match="broken.png: not an image in a format read here"):
        load_dataset(f"folder:{tmp_path / 'e'}")
    (tmp_path / "e" / "dog" / "broken.png").unlink()
    (tmp_path / "e" / "fox").mkdir()
    with pytest.raises(ValueError, match="fox: class folder holds no images"):
        load_dataset(f"folder:{tmp_path / 'e'}")
    (tmp_path / "e" / "fox").rmdir()
    with pytest.raises(ValueError, match="color must be one of"):
        load_dataset(f"folder:{tmp_path / 'e'}", color="cmyk")
    with pytest.raises(ValueError, match="image_size must be"):
        load_dataset(f"folder:{tmp_path / 'e'}", image_size=(3,))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class sub-folders"):
        load_dataset(f"folder:{tmp_path / 'empty'}")


def _png_claiming(width, height):
    """A valid 8-bit grayscale PNG header claiming ``width x height`` with a few bytes of pixels."""
    import zlib

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(bytes(width + 1) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_folder_truncated_png_is_refused(tmp_path, rng):
    _write_folder(tmp_path / "t", rng)
    path = tmp_path / "t" / "dog" / "0.png"
    data = path.read_bytes()
    for cut in (12, 20):  # without its end chunk; inside the last data chunk's checksum
        path.write_bytes(data[:-cut])
        with pytest.raises(ValueError, match="dog/0.png: truncated or corrupt image"):
            load_dataset(f"folder:{tmp_path / 't'}")


def test_folder_decompression_bombs_are_refused_before_decoding(tmp_path, rng, monkeypatch):
    _write_folder(tmp_path / "b", rng)
    bomb = tmp_path / "b" / "cat" / "bomb.png"
    bomb.write_bytes(_png_claiming(40_000, 40_000))  # 1.6 gigapixels in a few kB
    with pytest.raises(ValueError, match="bomb.png: refused as a decompression bomb"):
        load_dataset(f"folder:{tmp_path / 'b'}")
    bomb.write_bytes(_png_claiming(1000, 1000))  # 4 MB to decode, over a 2 MB limit
    monkeypatch.setenv(INPUT_LIMIT_ENV, "2")
    with pytest.raises(
        ValueError, match=r"bomb.png: its header declares 1000 x 1000 pixels.* decompression bomb"
    ):
        load_dataset(f"folder:{tmp_path / 'b'}")
    bomb.unlink()
    monkeypatch.delenv(INPUT_LIMIT_ENV)
    # A bomb-sized image_size: 15 images of 100000 x 100000 are refused before any is resized.
    bomb_size = r"one decoded sample of \[1, 100000, 100000\] needs .* input memory limit"
    with pytest.raises(ValueError, match=bomb_size):
        load_dataset(f"folder:{tmp_path / 'b'}", image_size=100_000)


# --------------------------------------------------------------------------------------------
# features


def test_features_with_explicit_test_and_names(tmp_path, rng):
    x, y = rng.normal(size=(50, 4)), np.arange(50) % 5
    xt, yt = rng.normal(size=(10, 4)), np.arange(10) % 5
    names = np.array(["a", "b", "c", "d", "e"])
    np.savez(tmp_path / "f.npz", x=x, y=y, x_test=xt, y_test=yt, class_names=names)
    data = load_dataset(f"features:{tmp_path / 'f.npz'}", standardize=False, val_fraction=0.2)
    assert data.class_names == list(names) and data.input_shape == (4,)
    np.testing.assert_allclose(data.test.x.numpy(), xt.astype(np.float32))
    assert len(data.train) == 40 and len(data.val) == 10


def test_features_errors(tmp_path, rng):
    x = rng.normal(size=(20, 3))
    cases = {
        "noy": ({"x": x}, "expected arrays 'x'.*and 'y'"),
        "float": ({"x": x, "y": np.linspace(0, 1, 20)}, "labels must be integers"),
        "len": ({"x": x, "y": np.zeros(19, int)}, "20 samples but 19 labels"),
        "nan": ({"x": np.where(x > 1, np.nan, x), "y": np.zeros(20, int)}, "finite"),
        "dim": (
            {"x": x, "y": np.zeros(20, int), "x_test": x[:, :2], "y_test": np.zeros(20, int)},
            "per-sample",
        ),
        "str": ({"x": x.astype(str), "y": np.zeros(20, int)}, "numeric array"),
        "neg": ({"x": x, "y": -np.ones(20, int)}, "non-negative"),
        "overflow": ({"x": x * 1e300, "y": np.zeros(20, int)}, r"values up to .*e\+300, beyond float32"),
    }
    for name, (arrays, message) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(ValueError, match=message) as info:
            load_dataset(f"features:{path}")
        assert str(path) in str(info.value)


def test_restricted_unpickler_accepts_numpy1_module_names(tmp_path):
    """Pickles written by numpy 1 (e.g. the real CIFAR files) name ``numpy.core.multiarray``."""
    array = np.arange(12, dtype=np.uint8).reshape(3, 4)
    data = pickle.dumps({b"data": array}, protocol=2)
    assert b"numpy._core.multiarray" in data
    legacy = data.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
    assert legacy != data
    (tmp_path / "legacy.pkl").write_bytes(legacy)
    np.testing.assert_array_equal(restricted_load(tmp_path / "legacy.pkl")[b"data"], array)


def test_loaders_do_not_import_datasets():
    """No import cycle data.datasets <-> data.loaders, counting imports inside functions."""
    import ast
    import inspect

    from marginkit.data import datasets, loaders, splits

    def imported(module):
        names = set()
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    assert "marginkit.data.datasets" not in imported(loaders) | imported(splits)
    assert "marginkit.data.loaders" in imported(datasets)
