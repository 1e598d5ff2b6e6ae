"""``rec:DIR`` — insightface's MXNet RecordIO (``train.rec`` + ``train.idx``), read without mxnet.

The layout (``SPEC.md`` §10; dmlc-core ``include/dmlc/recordio.h``, mxnet ``recordio.py``):

- ``train.rec`` is a stream of records. Each part starts with a little-endian uint32 magic
  ``0xced7230a`` and a uint32 ``lrec`` whose low 29 bits are the part's length and high 3 bits a
  continuation flag (0 whole record, 1 first part, 2 middle, 3 last); the payload follows, padded
  with zeros to a multiple of 4 bytes. The writer splits a payload wherever the magic occurs at a
  4-byte-aligned position; the reader rejoins the parts with the magic between them.
- ``train.idx`` is text, one ``key<TAB>byte offset`` per line: where each record starts.
- An image record's payload starts with a 24-byte header, struct ``<IfQQ`` = (flag, label, id,
  id2). When ``flag > 0`` it is followed by ``flag`` float32 labels (the class is the first; the
  scalar field is unused); the rest is the encoded image (JPEG / PNG).
- Record 0 is either insightface's header record (MS1M, Glint, WebFace: ``flag > 0`` and no
  image after its labels; ``label[0]`` is one past the last image key, images are keys
  ``1 .. label[0] - 1``; the keys after them are identity ranges, not images) or, in mxnet's
  ``im2rec`` layout, an ordinary image (every key of the ``.idx`` is an image). Which one is
  decided by that test (insightface's own reader looks at ``flag > 0`` only, which an ``im2rec``
  file with vector labels would fool).
- ``property`` (optional) holds ``num_classes,height,width``; its class count is checked against
  the labels.

**Labels without decoding.** Labels sit in each record's header, so listing them reads 24–28
bytes per record: the headers are gathered through a memory map, a million at a time (records
whose header is split into parts are read one by one). With ``cache_dir`` the keys, offsets and
labels are cached (``<cache_dir>/rec-index/<digest>.npz``, keyed by both files' real paths, sizes
and modification times), so a 5 M-record file is listed once.

**Reading.** :class:`RecordSamples` reads a record with ``os.pread`` on a handle it opens in the
reading process (never inherited: dropped on pickling, reopened in a new process id), so forked
DataLoader workers never share a file offset. ``.idx`` offsets are checked against the ``.rec``'s
size when the source is opened (a ValueError naming the record); a bad magic, a truncated record
or a bad image is a :class:`~marginkit.data.samples.BadSampleError` naming the record and its
byte offset.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from marginkit.data.decode import (
    ImageLayout,
    choose_layout,
    decode_image,
    image_header,
    image_size_option,
    max_image_pixels,
    sample_positions,
)
from marginkit.data.loaders import RawSplits, _seeded_split, split_note
from marginkit.data.samples import BadSampleError, LazySamples

__all__ = ["MAGIC", "RecordSamples", "read_record", "read_recordio", "unpack_image_record"]

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_LENGTH_MASK = (1 << 29) - 1
_IMAGE_HEADER = struct.Struct("<IfQQ")  # flag, label, id, id2: 24 bytes
_INDEX_VERSION = 1
_CHUNK = 1 << 18  # records whose headers are gathered at once


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def read_record(fd: int, offset: int, file_size: int, where: str, max_bytes: int) -> bytes:
    """The payload of the record at ``offset`` of the open ``.rec`` ``fd`` (parts rejoined).

    ``where`` names the record in errors (:class:`BadSampleError`); ``max_bytes`` bounds the
    rejoined payload.
    """
    parts: list[bytes] = []
    position, total, expect_first = offset, 0, True
    while True:
        head = os.pread(fd, 8, position)
        if len(head) < 8:
            raise BadSampleError(where, f"truncated: the .rec ends inside a record header at byte {position}")
        magic, lrec = struct.unpack("<II", head)
        if magic != MAGIC:
            raise BadSampleError(
                where,
                f"bad magic 0x{magic:08x} at byte offset {position} (expected 0x{MAGIC:08x}): not a record",
            )
        length, cflag = lrec & _LENGTH_MASK, lrec >> 29
        if cflag > 3 or (expect_first and cflag not in (0, 1)) or (not expect_first and cflag not in (2, 3)):
            raise BadSampleError(where, f"bad continuation flag {cflag} at byte offset {position}")
        total += length + (0 if expect_first else 4)
        if total > max_bytes:
            raise BadSampleError(
                where, f"a record of more than {max_bytes:,} bytes (above the input memory limit)"
            )
        if position + 8 + length > file_size:
            raise BadSampleError(
                where,
                f"truncated: a part of {length} bytes at byte offset {position} runs past the .rec's end",
            )
        payload = os.pread(fd, length, position + 8)
        if len(payload) != length:
            raise BadSampleError(
                where, f"truncated: read {len(payload)} of {length} bytes at byte offset {position}"
            )
        parts.append(payload)
        if cflag in (0, 3):
            return _MAGIC_BYTES.join(parts)
        position += 8 + _pad4(length)
        expect_first = False


def unpack_image_record(payload: bytes, where: str) -> tuple[int, np.ndarray, bytes]:
    """``(flag, labels float32 [max(flag, 1)], encoded image)`` of an image record's payload."""
    if len(payload) < _IMAGE_HEADER.size:
        raise BadSampleError(
            where, f"a record of {len(payload)} bytes, shorter than the 24-byte image header"
        )
    flag, label, _, _ = _IMAGE_HEADER.unpack_from(payload)
    start = _IMAGE_HEADER.size + 4 * flag
    if flag > 0:
        if len(payload) < start:
            raise BadSampleError(where, f"its header declares {flag} labels but the record ends before them")
        labels = np.frombuffer(payload, dtype="<f4", count=flag, offset=_IMAGE_HEADER.size).astype(np.float32)
    else:
        labels = np.array([label], dtype=np.float32)
    return flag, labels, payload[start:]


# --------------------------------------------------------------------------------------------
# the index: keys, offsets and labels


def _read_idx(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Keys and offsets of ``train.idx`` (``key<TAB>offset`` lines)."""
    from marginkit._files import InputBudget

    InputBudget(path).take(path.stat().st_size * 4, "its index")  # the file and the int64 pairs
    data = path.read_bytes()
    body = data.strip()
    lines = body.count(b"\n") + 1 if body else 0
    pairs = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns (or raises) where a token is not an integer
        with contextlib.suppress(ValueError, DeprecationWarning):
            flat = np.fromstring(body, dtype=np.int64, sep=" ") if body else np.zeros(0, np.int64)
            if flat.size == 2 * lines:
                pairs = flat.reshape(-1, 2)
    if pairs is None:  # blank lines, or a bad one to name: line by line
        rows = []
        for number, line in enumerate(data.splitlines(), 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 2 or not all(f.isdigit() for f in fields):
                raise ValueError(
                    f"{path}, line {number}: expected 'key<TAB>byte offset' (two non-negative integers), "
                    f"got {line[:80]!r}"
                )
            rows.append((int(fields[0]), int(fields[1])))
        pairs = np.array(rows, dtype=np.int64).reshape(-1, 2)
    keys, offsets = pairs[:, 0], pairs[:, 1]
    if keys.size and (keys.min() < 0 or offsets.min() < 0):
        raise ValueError(f"{path}: negative keys or offsets")
    if np.unique(keys).size != keys.size:
        raise ValueError(f"{path}: a key is listed twice")
    return keys, offsets


def _labels_of(rec: Path, fd: int, size: int, keys: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The class (first label) of every record, from its header (see the module doc).

    Records start at multiples of 4 (parts are padded), so the header's words are gathered from
    the file viewed as uint32: magic, lrec, flag, the scalar label and the first vector label
    (word 8). A record whose header is not whole in its first part (continued, or short) is read
    in full instead.
    """
    labels = np.empty(len(offsets), dtype=np.float64)
    fast = (offsets + 36 <= size) & (offsets % 4 == 0)
    slow = ~fast
    if size >= 36 and fast.any():
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
            words = np.frombuffer(mapped, dtype="<u4", count=size // 4)
            try:
                positions = np.flatnonzero(fast)
                for start in range(0, len(positions), _CHUNK):
                    rows = positions[start : start + _CHUNK]
                    w = offsets[rows] // 4
                    magic, lrec, flag = words[w], words[w + 1], words[w + 2]
                    scalar, first = words[w + 3].view("<f4"), words[w + 8].view("<f4")
                    length, cflag = lrec & _LENGTH_MASK, lrec >> 29
                    ok = (magic == MAGIC) & (cflag == 0) & (length >= 24 + 4 * np.minimum(flag, 1))
                    labels[rows] = np.where(flag > 0, first, scalar)
                    slow[rows[~ok]] = True
            finally:
                del words
    limit = _record_limit()
    for row in np.flatnonzero(slow).tolist():
        where = _where(rec, int(keys[row]), int(offsets[row]))
        _, values, _ = unpack_image_record(read_record(fd, int(offsets[row]), size, where, limit), where)
        labels[row] = values[0]
    return labels


def _record_limit() -> int:
    from marginkit._files import input_limit_bytes

    return input_limit_bytes()


def _where(rec: Path | str, key: int, offset: int) -> str:
    return f"{rec} record {key} (byte offset {offset})"


def _index_file(cache_dir: str | os.PathLike[str], rec: Path, idx: Path) -> Path:
    parts = []
    for path in (rec, idx):
        st = path.stat()
        parts.append(f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}")
    digest = hashlib.sha256("\n".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return Path(cache_dir) / "rec-index" / f"{digest}.npz"


def _cached_index(path: Path) -> dict[str, np.ndarray] | None:
    from marginkit._files import read_npz_arrays

    if not path.is_file():
        return None
    try:
        arrays = read_npz_arrays(path)
        n = arrays["keys"].shape
        if (
            int(arrays["version"]) != _INDEX_VERSION
            or arrays["offsets"].shape != n
            or arrays["labels"].shape != n
        ):
            return None
        return arrays
    except (ValueError, KeyError, OSError):
        return None


def _save_index(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, version=np.array(_INDEX_VERSION), **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _image_keys(
    rec: Path, fd: int, size: int, keys: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, str]:
    """Which ``.idx`` rows are images: all (``im2rec``) or keys ``1 .. label[0] - 1`` (insightface)."""
    zero = np.flatnonzero(keys == 0)
    if not zero.size:
        return np.arange(len(keys)), "im2rec (no record 0: every key an image)"
    where = _where(rec, 0, int(offsets[zero[0]]))
    payload = read_record(fd, int(offsets[zero[0]]), size, where, _record_limit())
    flag, labels, image = unpack_image_record(payload, where)
    if not (flag > 0 and image == b""):
        return np.arange(len(keys)), "im2rec (record 0 is an image: every key an image)"
    end = float(labels[0])
    if not (np.isfinite(end) and end == int(end) and 1 <= end <= 2**53):
        raise ValueError(f"{where}: header record's label[0] = {end} is not an image key range end")
    images = np.flatnonzero((keys >= 1) & (keys < int(end)))
    if images.size != int(end) - 1:
        raise ValueError(
            f"{where}: the header record says images are keys 1..{int(end) - 1}, but the .idx lists "
            f"{images.size} of them"
        )
    return images, f"insightface (record 0 a header: images are keys 1..{int(end) - 1})"


# --------------------------------------------------------------------------------------------
# the lazy rows


class RecordSamples(LazySamples):
    """Image records of a ``.rec``, one row per image key, decoded on :meth:`read`."""

    kind = "image"
    dtype = np.dtype(np.uint8)

    def __init__(
        self,
        rec: str | os.PathLike[str],
        keys: np.ndarray,
        offsets: np.ndarray,
        file_size: int,
        layout: ImageLayout,
        image_size: tuple[int, int] | None,
    ) -> None:
        super().__init__()
        self.rec = os.fspath(rec)
        self._keys, self._offsets = np.asarray(keys, np.int64), np.asarray(offsets, np.int64)
        self.file_size = int(file_size)
        self.layout, self.image_size = layout, image_size
        self.sample_shape = tuple(layout.shape)
        self.max_pixels = max_image_pixels()
        self.max_bytes = _record_limit()

    def _fd(self) -> int:
        local = self._local()
        if "rec" not in local:
            local["rec"] = _Handle(self.rec)
        return local["rec"].fd

    def _num_keys(self) -> int:
        return len(self._keys)

    def _where_key(self, key: int) -> str:
        return _where(self.rec, int(self._keys[key]), int(self._offsets[key]))

    def _relative_key(self, key: int) -> str:
        return f"{os.path.basename(self.rec)}#{int(self._keys[key])}"

    @property
    def decode_params(self) -> tuple[str, tuple[int, int] | None, bool]:  # type: ignore[override]
        return self.layout.mode, self.image_size, self.layout.gray_only

    def _encoded_key(self, key: int) -> tuple[bytes, str]:
        where = self._where_key(key)
        _, _, image = unpack_image_record(
            read_record(self._fd(), int(self._offsets[key]), self.file_size, where, self.max_bytes), where
        )
        kind = (
            "jpg" if image[:3] == b"\xff\xd8\xff" else "png" if image[:8] == b"\x89PNG\r\n\x1a\n" else "img"
        )
        return image, kind

    def _read_key(self, key: int, rng: np.random.Generator | None) -> np.ndarray:
        where = self._where_key(key)
        _, _, image = unpack_image_record(
            read_record(self._fd(), int(self._offsets[key]), self.file_size, where, self.max_bytes), where
        )
        return decode_image(
            image,
            self.layout.mode,
            self.image_size,
            where=where,
            max_pixels=self.max_pixels,
            expected=self.sample_shape,
            gray_only=self.layout.gray_only,
        )


class _Handle:
    """A read-only descriptor, closed when the last view of its source in this process goes."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _property(directory: Path) -> tuple[int, int, int] | None:
    path = directory / "property"
    if not path.is_file():
        return None
    text = path.read_text(errors="replace").strip()
    fields = [f.strip() for f in text.split(",")]
    if len(fields) != 3 or not all(f.isdigit() for f in fields):
        raise ValueError(f"{path}: expected 'num_classes,height,width', got {text[:80]!r}")
    return int(fields[0]), int(fields[1]), int(fields[2])


def read_recordio(
    directory: str | os.PathLike[str],
    *,
    image_size: int | tuple[int, int] | None = None,
    color: str = "auto",
    test_fraction: float = 0.2,
    split_seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
) -> RawSplits:
    """``rec:DIR`` as :class:`~marginkit.data.loaders.RawSplits` of :class:`RecordSamples` (lazy).

    ``DIR`` holds ``train.rec`` and ``train.idx`` (and optionally ``property``); ``DIR`` may also
    name the ``.rec`` itself (its ``.idx`` beside it). One split is stored: a stratified
    ``test_fraction`` of each class (seeded by ``split_seed``) is held out, as ``folder:`` does.
    ``image_size`` / ``color`` as ``folder:`` (the layout from a sample of the records' image
    headers). ``cache_dir``: where the label index is cached (``None``: read every time).
    """
    root = Path(directory)
    if root.is_file() and root.suffix == ".rec":
        rec, root = root, root.parent
    else:
        rec = root / "train.rec"
    idx = rec.with_suffix(".idx")
    for path in (rec, idx):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (rec:DIR needs train.rec and train.idx)")
    size = rec.stat().st_size
    index_path = _index_file(cache_dir, rec, idx) if cache_dir is not None else None
    cached = _cached_index(index_path) if index_path is not None else None
    fd = os.open(rec, os.O_RDONLY)
    try:
        if cached is not None:
            keys, offsets, labels, note = (
                cached["keys"],
                cached["offsets"],
                cached["labels"],
                str(cached["note"]),
            )
        else:
            keys, offsets = _read_idx(idx)
            past = np.flatnonzero(offsets + 8 > size)
            if past.size:
                k = int(past[0])
                raise ValueError(
                    f"{idx}: record {int(keys[k])} at byte offset {int(offsets[k])} is past the end of {rec} "
                    f"({size} bytes){f' (and {past.size - 1} more)' if past.size > 1 else ''}"
                )
            rows, note = _image_keys(rec, fd, size, keys, offsets)
            keys, offsets = keys[rows], offsets[rows]
            values = _labels_of(rec, fd, size, keys, offsets)
            bad = np.flatnonzero(~np.isfinite(values) | (values < 0) | (values != np.round(values)))
            if bad.size:
                k = int(bad[0])
                where = _where(rec, int(keys[k]), int(offsets[k]))
                raise ValueError(f"{where}: label {values[k]} is not a non-negative integer")
            labels = values.astype(np.int64)
            if index_path is not None:
                with contextlib.suppress(OSError):
                    _save_index(
                        index_path,
                        {"keys": keys, "offsets": offsets, "labels": labels, "note": np.array(note)},
                    )
        if not len(keys):
            raise ValueError(f"{rec}: holds no image records")
        sizes = image_size_option(image_size)
        headers = []
        for k in sample_positions(len(keys)).tolist():
            where = _where(rec, int(keys[k]), int(offsets[k]))
            _, _, image = unpack_image_record(
                read_record(fd, int(offsets[k]), size, where, _record_limit()), where
            )
            headers.append((where, image_header(image, where=where)))
        layout = choose_layout(headers, len(keys), image_size=sizes, color=color, source=str(rec))
    finally:
        os.close(fd)
    prop = _property(root)
    if prop is not None and labels.size and int(labels.max()) >= prop[0]:
        raise ValueError(
            f"{root / 'property'}: num_classes={prop[0]} but a record has label {int(labels.max())}"
        )
    samples = RecordSamples(rec, keys, offsets, size, layout, sizes)
    train, test = _seeded_split(labels, test_fraction, split_seed)
    info: dict[str, Any] = {
        "source": str(rec),
        "records": f"{len(keys)} images; {note}",
        "color": layout.mode,
        "image_size": tuple(layout.shape[1:]),
        "layout": layout.note,
        "index": "cached" if cached is not None else "read from the record headers",
        "split": split_note(test_fraction, split_seed),
        "lazy": True,
    }
    if prop is not None:
        info["property"] = {"num_classes": prop[0], "height": prop[1], "width": prop[2]}
    return RawSplits(samples[train], labels[train], samples[test], labels[test], kind="image", info=info)
