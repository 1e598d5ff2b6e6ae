"""Readers for users' own data files: ``npz:``, ``mnist-idx:``, ``cifar10:``, ``folder:``, ``features:``.

Each reader returns a :class:`RawSplits` (numpy arrays, labels not yet checked against each
other); :func:`marginkit.data.load_dataset` turns it into tensors, carves the validation split,
applies ``train_per_class`` and standardisation. The readers only *parse and validate*:
every problem with a file is a :class:`ValueError` (or :class:`FileNotFoundError`) whose message
names the path and what was expected. What a file claims (npz member headers, IDX headers,
image sizes) is checked against the file and against the input memory limit
(:mod:`marginkit._files`, ``$MARGINKIT_MAX_INPUT_MB``) before anything is allocated.

Nothing here executes code from a data file: ``.npz`` archives are opened with
``allow_pickle=False`` and CIFAR-10's pickled batches go through :class:`RestrictedUnpickler`,
which admits only numpy array reconstruction.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from marginkit._files import InputBudget, read_npz_arrays
from marginkit.data.splits import stratified_split

__all__ = [
    "IMAGE_EXTENSIONS",
    "RawSplits",
    "RestrictedUnpickler",
    "read_cifar10",
    "read_features",
    "read_folder",
    "read_mnist_idx",
    "read_npz",
]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


@dataclass
class RawSplits:
    """Arrays read from a source, before tensors, validation carving and subsetting.

    ``kind`` is ``"image"`` (``x`` is ``[N, C, H, W]``, ``uint8`` in 0..255 or floating in
    [0, 1]) or ``"vector"`` (``x`` is ``[N, ...]`` floating, standardised later when
    ``standardize``). Labels are 1-D integer arrays. ``x_val``/``y_val`` are ``None`` when the
    source has no validation split (one is then carved from the training split).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    x_val: np.ndarray | None = None
    y_val: np.ndarray | None = None
    kind: str = "vector"
    class_names: list[str] | None = None
    standardize: bool = False
    open_set: bool = False
    info: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# shared checks


def labels_array(y: Any, where: str) -> np.ndarray:
    """Integer labels as a 1-D int64 array; ``[N, 1]`` is squeezed.

    Floating labels are accepted only when every value is a whole number; anything else
    (fractions, NaN, strings, multi-label ``[N, K>1]``) is a :class:`ValueError` naming ``where``.
    """
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ValueError(
            f"{where}: labels must have shape [N] or [N, 1] (one integer class per sample), got shape "
            f"{list(y.shape)}" + (" (multi-label data is not supported)" if y.ndim == 2 else "")
        )
    if y.dtype == np.bool_ or not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise ValueError(f"{where}: labels must be integers, got dtype {y.dtype}")
    if np.issubdtype(y.dtype, np.floating):
        bad = ~np.isfinite(y) | (y != np.round(y))
        if bad.any():
            first = y[np.flatnonzero(bad)[0]]
            raise ValueError(f"{where}: labels must be integers, got non-integer value {first!r}")
    if y.size and y.min() < 0:
        raise ValueError(f"{where}: labels must be non-negative integers, got {int(y.min())}")
    return y.astype(np.int64)


def image_array(x: Any, where: str) -> np.ndarray:
    """Images as ``[N, C, H, W]`` (C in {1, 3}); accepts ``[N, H, W]``, ``[N, H, W, C]``, ``[N, C, H, W]``.

    ``uint8`` is kept as is (scaled to [0, 1] later); floating images must lie in [0, 1].
    """
    x = np.asarray(x)
    if x.dtype == np.uint8:
        pass
    elif np.issubdtype(x.dtype, np.floating):
        if x.size and (not np.isfinite(x).all() or x.min() < 0 or x.max() > 1):
            raise ValueError(
                f"{where}: floating images must be finite and lie in [0, 1] (or use uint8 0..255)"
            )
    else:
        raise ValueError(f"{where}: images must be uint8 (0..255) or floating in [0, 1], got dtype {x.dtype}")
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4:
        if x.shape[3] in (1, 3):
            return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        if x.shape[1] in (1, 3):
            return x
    raise ValueError(
        f"{where}: images must have shape [N, H, W], [N, H, W, C] or [N, C, H, W] with C in {{1, 3}}, "
        f"got {list(x.shape)}"
    )


def same_length(x: np.ndarray, y: np.ndarray, where: str) -> None:
    if len(x) != len(y):
        raise ValueError(f"{where}: {len(x)} samples but {len(y)} labels; they must match")


# --------------------------------------------------------------------------------------------
# npz: MedMNIST schema


def read_npz(path: str | os.PathLike[str]) -> RawSplits:
    """Read an ``.npz`` in MedMNIST's schema.

    Keys ``train_images``, ``train_labels``, ``test_images``, ``test_labels`` (required) and
    ``val_images``, ``val_labels`` (optional, together). Images ``[N, H, W]`` or ``[N, H, W, C]``
    ``uint8`` (or floating in [0, 1]); labels ``[N]`` or ``[N, 1]`` integers.
    """
    path = Path(path)
    arrays = read_npz_arrays(path)
    required = ("train_images", "train_labels", "test_images", "test_labels")
    missing = [key for key in required if key not in arrays]
    if missing:
        raise ValueError(
            f"{path}: missing array(s) {', '.join(missing)}; expected MedMNIST's keys "
            f"{', '.join(required)} (and optionally val_images, val_labels); "
            f"found {', '.join(arrays) or 'none'}"
        )
    has_val = ("val_images" in arrays, "val_labels" in arrays)
    if has_val[0] != has_val[1]:
        raise ValueError(f"{path}: val_images and val_labels must be given together")
    splits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split in ("train", "val", "test") if all(has_val) else ("train", "test"):
        where = f"{path} [{split}]"
        x = image_array(arrays[f"{split}_images"], f"{where} {split}_images")
        y = labels_array(arrays[f"{split}_labels"], f"{where} {split}_labels")
        same_length(x, y, where)
        splits[split] = (x, y)
    shapes = {split: xy[0].shape[1:] for split, xy in splits.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"{path}: image shapes differ between splits: {shapes}")
    val = splits.get("val", (None, None))
    return RawSplits(
        *splits["train"],
        *splits["test"],
        x_val=val[0],
        y_val=val[1],
        kind="image",
        info={"source": str(path)},
    )


# --------------------------------------------------------------------------------------------
# IDX (MNIST, Fashion-MNIST, KMNIST, ...)

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _idx_layout(head: bytes, where: str) -> tuple[np.dtype, int]:
    """Dtype and rank from the magic number ``00 00 <type> <ndim>``."""
    if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES or not 1 <= head[3] <= 4:
        raise ValueError(f"{where}: not an IDX file (bad magic number {head[:4].hex() or 'empty'})")
    return np.dtype(_IDX_DTYPES[head[2]]), head[3]


def _idx_shape(sizes: bytes, ndim: int, where: str) -> tuple[int, ...]:
    if len(sizes) < 4 * ndim:
        raise ValueError(f"{where}: truncated IDX header")
    return tuple(int(d) for d in np.frombuffer(sizes, dtype=">u4", count=ndim))


def _idx_size_error(where: str, shape: tuple[int, ...], expected: int, held: str) -> ValueError:
    return ValueError(
        f"{where}: IDX header declares shape {list(shape)} ({expected} data bytes) but the file holds "
        f"{held} data bytes (truncated or corrupt)"
    )


# Bytes decompressed per read into the IDX array (the only temporary besides the array itself).
_IDX_CHUNK = 1 << 22


def read_idx(path: Path, budget: InputBudget) -> np.ndarray:
    """Read one IDX file, gzipped or not, charging its declared size to ``budget`` before reading.

    The size decompressed is bounded before decompressing: the header comes first and declares
    the data's size, which is charged to the input limit (:class:`~marginkit._files.InputBudget`,
    the limit of the ``.npz`` reader, below ``RLIMIT_AS`` when the process has one); then the
    gzip stream is decompressed in chunks into the one array of that size, and a single byte more
    tells trailing data. Gzip's own size field (ISIZE, the length modulo 2**32, unchecked by
    anything) is never trusted. A gzip bomb, or a header claiming more than the limit, costs
    nothing.
    """
    where, gzipped = str(path), False
    try:
        with path.open("rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            stream = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
            dtype, ndim = _idx_layout(stream.read(4), where)
            shape = _idx_shape(stream.read(4 * ndim), ndim, where)
            expected = math.prod(shape) * dtype.itemsize
            if not gzipped and path.stat().st_size - 4 - 4 * ndim != expected:
                raise _idx_size_error(where, shape, expected, str(path.stat().st_size - 4 - 4 * ndim))
            budget.take(expected, f"{path.name} (IDX array {list(shape)})")
            out = np.empty(expected, dtype=np.uint8)
            view, filled = memoryview(out), 0
            while filled < expected:
                n = stream.readinto(view[filled : filled + _IDX_CHUNK])
                if not n:
                    break
                filled += n
            trailing = stream.read(1)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{where}: {'corrupt gzip data' if gzipped else 'cannot read'} ({exc})") from exc
    if filled != expected or trailing:
        raise _idx_size_error(where, shape, expected, str(filled) if filled < expected else "more")
    array = out.view(dtype).reshape(shape)
    if dtype.itemsize > 1 and not dtype.isnative:  # in place: no second copy of the data
        array = array.byteswap(inplace=True).view(dtype.newbyteorder("="))
    return array


def _find_idx(root: Path, prefix: str, what: str, rank: int) -> Path:
    stems = [f"{prefix}-{what}-idx{rank}-ubyte", f"{prefix}-{what}.idx{rank}-ubyte"]
    for stem in stems:
        for name in (stem, stem + ".gz"):
            if (root / name).is_file():
                return root / name
    raise FileNotFoundError(f"{root}: missing IDX file {stems[0]} (or {stems[0]}.gz)")


def read_mnist_idx(directory: str | os.PathLike[str]) -> RawSplits:
    """Read MNIST-style IDX files from ``directory``, gzipped or not.

    Expects ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
    ``t10k-labels-idx1-ubyte`` (each optionally ``.gz``; ``train-images.idx3-ubyte`` spelling accepted).
    Headers are checked (magic number, dimensions, data size) and labels must be integers.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory (expected a folder of MNIST IDX files)")
    out = []
    budget = InputBudget(root)
    for prefix in ("train", "t10k"):
        images_path = _find_idx(root, prefix, "images", 3)
        labels_path = _find_idx(root, prefix, "labels", 1)
        images = read_idx(images_path, budget)
        labels = read_idx(labels_path, budget)
        if images.ndim != 3:
            raise ValueError(f"{images_path}: expected 3-D images [N, H, W], got shape {list(images.shape)}")
        if images.dtype != np.uint8:
            raise ValueError(
                f"{images_path}: expected unsigned-byte images (IDX type 0x08), got {images.dtype}"
            )
        if labels.ndim != 1:
            raise ValueError(f"{labels_path}: expected 1-D labels [N], got shape {list(labels.shape)}")
        labels = labels_array(labels, str(labels_path))
        same_length(images, labels, f"{images_path} / {labels_path}")
        out += [images[:, None], labels]
    if out[0].shape[1:] != out[2].shape[1:]:
        raise ValueError(
            f"{root}: train images {out[0].shape[2:]} and test images {out[2].shape[2:]} differ in size"
        )
    return RawSplits(*out, kind="image", info={"source": str(root)})


# --------------------------------------------------------------------------------------------
# CIFAR-10 python batches, restricted unpickling


def _numpy_reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _numpy_scalar() -> Any:
    try:
        from numpy._core.multiarray import scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import scalar
    return scalar


def _numpy_frombuffer() -> Any:
    try:
        from numpy._core.numeric import _frombuffer
    except ImportError:  # numpy < 2
        from numpy.core.numeric import _frombuffer
    return _frombuffer


def _latin1_encode(text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
    """``_codecs.encode`` as Python's protocol-2 pickles call it, ``encode(str, "latin1")``, and
    nothing else: another codec (an unknown one, or one that compresses or decodes) is refused."""
    import codecs

    if not isinstance(encoding, str) or not isinstance(text, str) or errors != "strict":
        raise pickle.UnpicklingError(
            f"refusing _codecs.encode({type(text).__name__}, {encoding!r}, {errors!r}): only "
            "encode(str, 'latin1'), as Python writes bytes at protocol 2"
        )
    try:
        latin1 = codecs.lookup(encoding).name == "iso8859-1"
    except LookupError:
        latin1 = False
    if not latin1:
        raise pickle.UnpicklingError(
            f"refusing _codecs.encode with codec {encoding[:40]!r}: only 'latin1', as Python writes "
            "bytes at protocol 2"
        )
    try:
        return text.encode("latin1")
    except UnicodeEncodeError as exc:
        raise pickle.UnpicklingError(f"a bytes object is not latin1 text ({exc.reason})") from None


def _codecs_encode() -> Any:
    return _latin1_encode


class _ArrayType:
    """What the global ``numpy.ndarray`` resolves to: a token for ``_reconstruct``, not a constructor.

    Calling ``numpy.ndarray(shape, dtype)`` from a pickle would allocate an array of any size
    filled with uninitialised memory; numpy's own pickles only name the class as the first
    argument of ``_reconstruct``.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise pickle.UnpicklingError("refusing to call numpy.ndarray (it allocates uninitialised memory)")


_ARRAY_TYPE = _ArrayType()


def _safe_reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """``_reconstruct`` as numpy's pickles call it: an empty array that the pickle's state then fills.

    The state (shape, dtype, raw bytes) goes through ``ndarray.__setstate__``, which checks that
    the bytes match the shape, so every array's data comes from the file itself.
    """
    if subtype is not _ARRAY_TYPE or not isinstance(shape, tuple) or shape != (0,):
        raise pickle.UnpicklingError(
            "refusing numpy _reconstruct other than numpy's own _reconstruct(ndarray, (0,), ...)"
        )
    return _numpy_reconstruct()(np.ndarray, (0,), dtype)


def _safe_dtype(*args: Any) -> np.dtype:
    """``numpy.dtype`` restricted to plain numbers and strings (no objects, no structured types)."""
    dtype = np.dtype(*args)
    if dtype.kind not in "biufcSU":
        raise pickle.UnpicklingError(f"refusing numpy dtype {dtype}: only numeric and string arrays")
    return dtype


# (module, name) -> factory of the one object it may resolve to. Nothing else is importable.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {}
for _module in ("numpy.core.multiarray", "numpy._core.multiarray"):
    _ALLOWED_GLOBALS[(_module, "_reconstruct")] = lambda: _safe_reconstruct
    _ALLOWED_GLOBALS[(_module, "scalar")] = _numpy_scalar
for _module in ("numpy.core.numeric", "numpy._core.numeric"):
    _ALLOWED_GLOBALS[(_module, "_frombuffer")] = _numpy_frombuffer
_ALLOWED_GLOBALS[("numpy", "ndarray")] = lambda: _ARRAY_TYPE
_ALLOWED_GLOBALS[("numpy", "dtype")] = lambda: _safe_dtype
# protocol-2 pickles written by Python 3 spell ``bytes`` objects as _codecs.encode(str, "latin1")
_ALLOWED_GLOBALS[("_codecs", "encode")] = _codecs_encode


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild numpy arrays, dicts, lists, str/bytes and numbers — nothing else.

    :meth:`find_class` admits only numpy's array/dtype/scalar reconstructors (under their
    numpy 1 and numpy 2 module names) and ``_codecs.encode`` (how Python 3 writes ``bytes`` at
    protocol 2). Any other global — ``os.system``, ``builtins.eval``, ``subprocess.Popen``, a
    user class — raises :class:`pickle.UnpicklingError` *before* anything is called, so a
    malicious pickle cannot execute code. The numpy ones are narrowed to what numpy's own
    pickles do: ``numpy.ndarray`` cannot be called (uninitialised memory), ``_reconstruct``
    only builds the empty array that the pickled state fills, and dtypes are numbers or
    strings; so every array holds bytes that are in the file.
    """

    def find_class(self, module: str, name: str) -> Any:
        factory = _ALLOWED_GLOBALS.get((module, name))
        if factory is None:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: only numpy arrays and plain Python "
                "containers are allowed in data files"
            )
        return factory()


def restricted_load(path: Path) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler` (``encoding="bytes"`` for Python 2 pickles)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with path.open("rb") as handle:
            return RestrictedUnpickler(handle, encoding="bytes").load()
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{path}: unsafe or corrupt pickle refused: {exc}") from exc
    except Exception as exc:  # only the admitted globals run: any failure is the file's own
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{path}: corrupt pickle ({type(exc).__name__}: {first})") from exc


def _text(key: Any) -> Any:
    return key.decode("latin1") if isinstance(key, bytes) else key


_CIFAR_CLASSES = 10
_CIFAR_ROW = 3 * 32 * 32


def _cifar_batch(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One batch, checked to be CIFAR-10's documented layout before it is used.

    ``{"data": uint8 [N, 3072], "labels": N ints in [0, num_classes)}``, and no larger than
    the file that holds it.
    """
    batch = restricted_load(path)
    if not isinstance(batch, dict):
        raise ValueError(
            f"{path}: expected a pickled dict with 'data' and 'labels', got {type(batch).__name__}"
        )
    batch = {_text(k): v for k, v in batch.items()}
    if "data" not in batch or "labels" not in batch:
        raise ValueError(f"{path}: expected keys 'data' and 'labels', found {sorted(map(str, batch))}")
    data = batch["data"]
    if (
        type(data) is not np.ndarray
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != _CIFAR_ROW
    ):
        shape = list(data.shape) if isinstance(data, np.ndarray) else type(data).__name__
        dtype = data.dtype if isinstance(data, np.ndarray) else "-"
        raise ValueError(f"{path}: 'data' must be a uint8 array [N, 3072] (32x32 RGB), got {shape} {dtype}")
    if data.nbytes > path.stat().st_size:
        raise ValueError(f"{path}: 'data' holds {data.nbytes} bytes, more than the file's size (corrupt)")
    labels = batch["labels"]
    if isinstance(labels, list) and not all(type(v) is int for v in labels):
        raise ValueError(f"{path}: labels must be integers")
    if not isinstance(labels, (list, np.ndarray)):
        raise ValueError(f"{path}: 'labels' must be a list of integers, got {type(labels).__name__}")
    labels = labels_array(np.asarray(labels), f"{path} labels")
    same_length(data, labels, str(path))
    if labels.size and labels.max() >= num_classes:
        raise ValueError(
            f"{path}: label {int(labels.max())} is outside the {num_classes} classes 0..{num_classes - 1}"
        )
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_class_names(path: Path) -> list[str] | None:
    if not path.is_file():
        return None
    meta = restricted_load(path)
    if isinstance(meta, dict):
        names_raw = {_text(k): v for k, v in meta.items()}.get("label_names")
        if isinstance(names_raw, list) and names_raw and all(isinstance(n, (bytes, str)) for n in names_raw):
            return [str(_text(n)) for n in names_raw]
    return None


def read_cifar10(directory: str | os.PathLike[str]) -> RawSplits:
    """Read CIFAR-10's python batches (``data_batch_1`` … ``data_batch_5``, ``test_batch``).

    ``directory`` may be the ``cifar-10-batches-py`` folder or its parent. Every batch goes
    through :class:`RestrictedUnpickler` and must hold ``data`` (uint8 ``[N, 3072]``) and
    ``labels`` (``N`` class ids below 10, or below the number of ``label_names`` in the
    optional ``batches.meta``, which supplies class names).
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory (expected CIFAR-10's python batches)")
    if not (root / "test_batch").exists() and (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [name for name in names if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{root}: missing CIFAR-10 batch file(s) {', '.join(missing)}")
    budget = InputBudget(root)
    for name in names:  # a batch's arrays are never larger than its file (checked per batch)
        budget.take((root / name).stat().st_size, f"batch file {name}")
    class_names = _cifar_class_names(root / "batches.meta")
    num_classes = len(class_names) if class_names else _CIFAR_CLASSES
    batches = [_cifar_batch(root / name, num_classes) for name in names]
    x_train = np.concatenate([b[0] for b in batches[:5]])
    y_train = np.concatenate([b[1] for b in batches[:5]])
    return RawSplits(
        x_train, y_train, *batches[5], kind="image", class_names=class_names, info={"source": str(root)}
    )


# --------------------------------------------------------------------------------------------
# folder of class sub-folders, read with Pillow


def _class_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
    )


_GRAY_MODES = ("1", "L", "LA", "I", "I;16", "F")
_BYTES_PER_PIXEL = 4  # Pillow decodes every mode used here to at most 4 bytes per pixel


def _image_header(path: Path) -> tuple[str, tuple[int, int]]:
    """Mode and (width, height) from the file's header, without decoding the pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.mode, image.size
    except Image.DecompressionBombError as exc:
        raise ValueError(f"{path}: refused as a decompression bomb ({exc})") from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ValueError(f"{path}: cannot read image ({exc})") from exc


def _load_image(path: Path, mode: str, size: tuple[int, int] | None) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.verify()  # chunk checksums and the end marker: a truncated PNG would decode
        with Image.open(path) as image:
            image = image.convert(mode)
            if size is not None and image.size != (size[1], size[0]):
                image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            array = np.asarray(image, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{path}: cannot read image ({exc})") from exc
    return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)


def _image_mode(headers: dict[Path, tuple[str, tuple[int, int]]], color: str) -> str:
    if color == "grayscale":
        return "L"
    if color == "rgb" or any(mode not in _GRAY_MODES for mode, _ in headers.values()):
        return "RGB"
    return "L"


def _common_size(root: Path, headers: dict[Path, tuple[str, tuple[int, int]]]) -> tuple[int, int]:
    """The one (H, W) all images share, from their headers; else the error that asks for image_size."""
    sizes: dict[tuple[int, int], Path] = {}
    for path, (_, (w, h)) in headers.items():
        sizes.setdefault((h, w), path)
        if len(sizes) > 1:
            (a, pa), (b, pb) = list(sizes.items())[:2]
            raise ValueError(
                f"{root}: images differ in size ({pa}: {a[0]}x{a[1]}, {pb}: {b[0]}x{b[1]}); "
                "pass the option image_size=S (or (H, W)) to resize them to a common size"
            )
    return next(iter(sizes))


def read_folder(
    directory: str | os.PathLike[str],
    *,
    image_size: int | tuple[int, int] | None = None,
    color: str = "auto",
    test_fraction: float = 0.2,
    split_seed: int = 0,
) -> RawSplits:
    """Read a folder with one sub-folder of images per class.

    Layouts: ``DIR/<class>/*.png``, or ``DIR/train/<class>/…`` and ``DIR/test/<class>/…``
    (plus optional ``DIR/val/<class>/…``), used as given. In the first layout a stratified
    ``test_fraction`` of each class (seeded by ``split_seed``, see
    :func:`marginkit.data.stratified_split`) becomes the test split. Class names are the
    sorted folder names (union over splits); labels are their indices. ``color``: ``"auto"``
    (grayscale if every image is, else RGB), ``"grayscale"`` or ``"rgb"``. ``image_size``
    (``S`` or ``(H, W)``) resizes every image bilinearly; without it all images must already
    share one size.
    """
    from marginkit._validation import choice

    color = choice(color, "color", ("auto", "grayscale", "rgb"))
    size: tuple[int, int] | None = None
    if image_size is not None:
        if isinstance(image_size, int) and not isinstance(image_size, bool):
            size = (image_size, image_size)
        elif (
            isinstance(image_size, (tuple, list))
            and len(image_size) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) for s in image_size)
        ):
            size = (int(image_size[0]), int(image_size[1]))
        else:
            raise ValueError(f"image_size must be an int or a pair (H, W) of ints, got {image_size!r}")
        if min(size) < 1:
            raise ValueError(f"image_size must be positive, got {image_size!r}")
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory (expected one sub-folder of images per class)")
    split_layout = (root / "train").is_dir() and (root / "test").is_dir()
    split_roots = (
        {s: root / s for s in ("train", "val", "test") if (root / s).is_dir()} if split_layout else {}
    )
    roots = split_roots or {"all": root}
    listing: dict[str, dict[str, list[Path]]] = {}
    for split, split_root in roots.items():
        dirs = _class_dirs(split_root)
        if not dirs:
            raise ValueError(
                f"{split_root}: no class sub-folders found (expected {split_root}/<class>/<image>)"
            )
        listing[split] = {}
        for d in dirs:
            files = _image_files(d)
            if not files:
                raise ValueError(f"{d}: class folder holds no images ({', '.join(IMAGE_EXTENSIONS)})")
            listing[split][d.name] = files
    class_names = sorted({name for per in listing.values() for name in per})
    index = {name: i for i, name in enumerate(class_names)}
    all_files = [f for per in listing.values() for files in per.values() for f in files]
    headers = {path: _image_header(path) for path in all_files}
    for path, (_, (w, h)) in headers.items():  # what decoding one image costs, before it is decoded
        InputBudget(path).take(w * h * _BYTES_PER_PIXEL, f"decoding its {w}x{h} pixels")
    mode = _image_mode(headers, color)
    shape = (1 if mode == "L" else 3, *(size or _common_size(root, headers)))
    budget = InputBudget(root)
    what = f"{len(all_files)} images of {'x'.join(map(str, shape))}"
    budget.take(len(all_files) * math.prod(shape), what + (f" (image_size={image_size!r})" if size else ""))
    arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split, per in listing.items():
        images = np.empty((sum(map(len, per.values())), *shape), dtype=np.uint8)
        labels, row = [], 0
        for name, files in per.items():
            for path in files:
                image = _load_image(path, mode, size)
                if image.shape != shape:  # the header lied about the size
                    raise ValueError(f"{path}: decoded to {list(image.shape)}, its header says {list(shape)}")
                images[row] = image
                row += 1
            labels.append(np.full(len(files), index[name], dtype=np.int64))
        arrays[split] = (images, np.concatenate(labels))
    info = {"source": str(root), "color": mode, "image_size": shape[1:]}
    if split_layout:
        val = arrays.get("val", (None, None))
        info["split"] = "train/ and test/ sub-folders as given"
        return RawSplits(
            *arrays["train"], *arrays["test"], x_val=val[0], y_val=val[1], kind="image",
            class_names=class_names, info=info,
        )  # fmt: skip
    x, y = arrays["all"]
    train, test = _seeded_split(y, test_fraction, split_seed)
    info["split"] = split_note(test_fraction, split_seed)
    return RawSplits(x[train], y[train], x[test], y[test], kind="image", class_names=class_names, info=info)


def split_note(test_fraction: float, split_seed: int) -> str:
    """The ``info["split"]`` of a source split here by :func:`stratified_split`."""
    return f"stratified test_fraction={test_fraction} per class, split_seed={split_seed}"


def _seeded_split(y: np.ndarray, test_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    train, test = stratified_split(y, test_fraction, seed=split_seed)
    if len(test) == 0 and test_fraction > 0:  # 0: nothing held out (the caller re-splits the pool)
        raise ValueError(
            f"test_fraction={test_fraction} leaves no test samples ({len(y)} samples); "
            "raise test_fraction or provide an explicit test split"
        )
    return train.numpy(), test.numpy()


# --------------------------------------------------------------------------------------------
# features: x, y arrays


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def read_features(
    path: str | os.PathLike[str], *, test_fraction: float = 0.2, split_seed: int = 0, standardize: bool = True
) -> RawSplits:
    """Read ``x``, ``y`` (and optional ``x_val``/``y_val``, ``x_test``/``y_test``, ``class_names``).

    ``x`` is ``[N, D, ...]`` numeric (cast to float32), ``y`` integer labels ``[N]``. Without
    ``x_test``/``y_test``, a stratified ``test_fraction`` of each class (seeded by ``split_seed``)
    becomes the test split. With ``standardize`` every feature is later centred and scaled
    with the mean and standard deviation of the final training split only.
    """
    path = Path(path)
    arrays = read_npz_arrays(path)
    if "x" not in arrays or "y" not in arrays:
        raise ValueError(
            f"{path}: expected arrays 'x' (features [N, D]) and 'y' (integer labels [N]); "
            f"found {', '.join(arrays) or 'none'}"
        )
    out: dict[str, np.ndarray] = {}
    for suffix in ("", "_val", "_test"):
        kx, ky = f"x{suffix}", f"y{suffix}"
        if (kx in arrays) != (ky in arrays):
            raise ValueError(f"{path}: {kx} and {ky} must be given together")
        if kx not in arrays:
            continue
        x = arrays[kx]
        if x.ndim < 2 or x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.number):
            raise ValueError(
                f"{path}: '{kx}' must be a numeric array [N, D, ...], got {list(x.shape)} {x.dtype}"
            )
        if np.iscomplexobj(x) or not np.isfinite(x).all():
            raise ValueError(f"{path}: '{kx}' must hold finite real numbers")
        largest = float(np.abs(x).max()) if x.size and np.issubdtype(x.dtype, np.floating) else 0.0
        if largest > _FLOAT32_MAX:  # features are float32 tensors: this would become inf
            raise ValueError(
                f"{path}: '{kx}' holds values up to {largest:.3g}, beyond float32's range "
                f"(|x| <= {_FLOAT32_MAX:.3g}); rescale the features"
            )
        y = labels_array(arrays[ky], f"{path} '{ky}'")
        same_length(x, y, f"{path} '{kx}'/'{ky}'")
        if suffix and x.shape[1:] != out["x"].shape[1:]:
            raise ValueError(
                f"{path}: '{kx}' has per-sample shape {list(x.shape[1:])} "
                f"but 'x' has {list(out['x'].shape[1:])}"
            )
        out[kx], out[ky] = x, y
    class_names = None
    if "class_names" in arrays:
        names = arrays["class_names"]
        if names.ndim != 1 or names.dtype.kind not in "US":
            raise ValueError(f"{path}: 'class_names' must be a 1-D array of strings")
        class_names = [str(_text(n)) for n in names.tolist()]
    info: dict[str, Any] = {"source": str(path)}
    if "x_test" not in out and len(out["y"]) == 0:
        raise ValueError(f"{path}: 'x' and 'y' hold no samples")
    if "x_test" in out:
        x_train, y_train, x_test, y_test = out["x"], out["y"], out["x_test"], out["y_test"]
        info["split"] = "x_test/y_test as given"
    else:
        train, test = _seeded_split(out["y"], test_fraction, split_seed)
        x_train, y_train, x_test, y_test = out["x"][train], out["y"][train], out["x"][test], out["y"][test]
        info["split"] = split_note(test_fraction, split_seed)
    return RawSplits(
        x_train, y_train, x_test, y_test, x_val=out.get("x_val"), y_val=out.get("y_val"), kind="vector",
        class_names=class_names, standardize=standardize, info=info,
    )  # fmt: skip
