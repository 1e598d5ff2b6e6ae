"""``folder:DIR`` read lazily: a scan of the file names (cached), images decoded one by one.

Layouts (as the eager :func:`~marginkit.data.loaders.read_folder`): ``DIR/<class>/…`` (a stratified,
seeded ``test_fraction`` of each class becomes the test split) or ``DIR/train/<class>/…`` and
``DIR/test/<class>/…`` (plus optional ``DIR/val/<class>/…``) used as given. A class folder may
hold its images in sub-folders (``DIR/<class>/<session>/x.jpg``): the class is the folder right
under ``DIR`` (or under ``DIR/<split>``). Hidden files and folders (``.name``) are skipped, and so
are files whose extension is not one of :data:`~marginkit.data.loaders.IMAGE_EXTENSIONS` (their
count is in ``info["ignored_files"]``). Class names are the sorted folder names (union over
splits), labels their indices; rows are in class order, then in path order within a class, so on
the same files this reader and the eager one give the same rows, labels and splits.

**The scan.** ``os.scandir`` over the directories only: a directory entry's type comes from the
directory listing itself, so files are never ``stat``-ed (directories are, once each, for the
cache key). The rows' relative paths are kept as one UTF-8 byte string plus offsets (about 30
bytes a file, not a Python string each). A progress bar counts the files while scanning (on a
terminal, or when asked).

**The index cache** (``cache_dir`` given: ``<cache_dir>/folder-index/<digest of DIR's real
path>.npz``) records the scan and the key it is valid for: every directory of the tree
(relative path) with its modification time in nanoseconds. Adding, removing or renaming an entry
of a directory changes that directory's mtime, so the stored scan is used only while every
stored directory still has its stored mtime — checked by one ``stat`` per directory, not per
file — and the scan is redone otherwise (a new sub-folder changes its parent's mtime). Files
rewritten in place keep their names, which is all the index holds (their pixels are read at
:meth:`~marginkit.data.samples.LazySamples.read`). An index is written only when every directory
is older than :data:`MTIME_SETTLE_S` seconds, so a change within the file system's timestamp
granularity cannot hide behind an unchanged mtime. The file is an ``.npz`` read without pickle;
one that is unreadable or for another directory is ignored (and rewritten).

**Shape.** The decoded ``[C, H, W]`` is decided from the headers of at most
:data:`~marginkit.data.decode.HEADER_SAMPLE` images spread evenly over the rows
(:func:`~marginkit.data.decode.choose_layout`), and every read image is checked against it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from marginkit.data.decode import (
    ImageLayout,
    choose_layout,
    decode_image,
    image_header,
    max_image_pixels,
    sample_positions,
)
from marginkit.data.loaders import IMAGE_EXTENSIONS, RawSplits, _seeded_split, split_note
from marginkit.data.samples import BadSampleError, LazySamples

__all__ = ["MTIME_SETTLE_S", "FolderScan", "ImageFiles", "scan_folder", "scan_tree"]

#: A directory modified less than this many seconds before a scan is not trusted to key the cache.
MTIME_SETTLE_S = 2.0
_INDEX_VERSION = 1
_SPLITS = ("train", "val", "test")
_ALL = 3  # split code of the one-folder layout


# --------------------------------------------------------------------------------------------
# a list of image files as lazy samples (also the rows of csv: manifests)


def _pack(names: list[str]) -> tuple[bytes, np.ndarray]:
    """Strings as one UTF-8 blob and ``len + 1`` offsets."""
    encoded = [n.encode("utf-8", "surrogateescape") for n in names]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    if encoded:
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return b"".join(encoded), offsets


def _unpack(blob: bytes, offsets: np.ndarray) -> list[str]:
    return [
        blob[a:b].decode("utf-8", "surrogateescape")
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    ]


class ImageFiles(LazySamples):
    """Image files under ``root``, one row each, decoded by :func:`~marginkit.data.decode.decode_image`.

    ``blob`` / ``offsets``: the rows' paths relative to ``root`` (``/``-separated), packed.
    ``layout``: the mode, ``[C, H, W]`` and checks every read applies (:func:`choose_layout`);
    ``image_size``: ``(H, W)`` to resize to, or ``None`` to require ``layout``'s size.
    """

    kind = "image"
    dtype = np.dtype(np.uint8)
    uses_rng = False  # no random draw: an image decodes to the same pixels in every epoch

    def __init__(
        self,
        root: str | os.PathLike[str],
        blob: bytes,
        offsets: np.ndarray,
        layout: ImageLayout,
        image_size: tuple[int, int] | None,
        max_pixels: int | None = None,
    ) -> None:
        super().__init__()
        self.root = os.fspath(root)
        self._blob, self._offsets = blob, np.asarray(offsets, dtype=np.int64)
        self.layout, self.image_size = layout, image_size
        self.sample_shape = tuple(layout.shape)
        self.max_pixels = max_pixels if max_pixels is not None else max_image_pixels()

    @classmethod
    def from_paths(
        cls,
        root: str | os.PathLike[str],
        relative: list[str],
        *,
        image_size: Any = None,
        color: str = "auto",
        source: str | None = None,
    ) -> ImageFiles:
        """Rows for ``relative`` paths under ``root``, their layout read from a sample of headers."""
        from marginkit.data.decode import image_size_option

        blob, offsets = _pack(relative)
        size = image_size_option(image_size)
        layout = _layout_of(os.fspath(root), blob, offsets, size, color, source or os.fspath(root))
        return cls(root, blob, offsets, layout, size)

    def _num_keys(self) -> int:
        return len(self._offsets) - 1

    def _relative_key(self, key: int) -> str:
        a, b = self._offsets[key], self._offsets[key + 1]
        return self._blob[a:b].decode("utf-8", "surrogateescape")

    def _where_key(self, key: int) -> str:
        return os.path.join(self.root, self._relative_key(key))

    def _read_key(self, key: int, rng: np.random.Generator | None) -> np.ndarray:
        path = self._where_key(key)
        return decode_image(
            path,
            self.layout.mode,
            self.image_size,
            where=path,
            max_pixels=self.max_pixels,
            expected=self.sample_shape,
            gray_only=self.layout.gray_only,
        )

    @property
    def decode_params(self) -> tuple[str, tuple[int, int] | None, bool]:  # type: ignore[override]
        return self.layout.mode, self.image_size, self.layout.gray_only

    def _encoded_key(self, key: int) -> tuple[bytes, str]:
        path = self._where_key(key)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            raise BadSampleError(path, f"cannot read the file ({exc.strerror or exc})") from exc
        return data, os.path.splitext(path)[1].lstrip(".").lower() or "img"


def _layout_of(
    root: str, blob: bytes, offsets: np.ndarray, size: tuple[int, int] | None, color: str, source: str
) -> ImageLayout:
    """:func:`choose_layout` over the headers of :func:`sample_positions` of the rows."""
    n = len(offsets) - 1
    headers = []
    limit = max_image_pixels()
    for k in sample_positions(n).tolist():
        rel = blob[offsets[k] : offsets[k + 1]].decode("utf-8", "surrogateescape")
        path = os.path.join(root, rel)
        headers.append((path, image_header(path, where=path, max_pixels=limit)))
    return choose_layout(headers, n, image_size=size, color=color, source=source)


# --------------------------------------------------------------------------------------------
# the scan


def _progress(enabled: bool | None, desc: str) -> Any:
    """A tqdm counter on stderr (``enabled``: ``None`` = only on a terminal), or ``None``."""
    if enabled is None:
        try:
            enabled = sys.stderr.isatty()
        except (AttributeError, ValueError):
            enabled = False
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is an extra (marginkit[cli]); scanning works without it
        return None
    return tqdm(desc=desc, unit=" files", file=sys.stderr, mininterval=0.25)


@dataclass
class FolderScan:
    """The file listing of a folder data set (see the module doc).

    ``blob`` / ``offsets``: every image's path relative to the root, in row order; ``split``:
    each row's split code (0 train, 1 val, 2 test, 3 the one-folder layout); ``label``: its class
    index into ``class_names``; ``dirs`` / ``mtimes``: the cache key; ``ignored``: files skipped
    for their extension.
    """

    root: str
    blob: bytes
    offsets: np.ndarray
    split: np.ndarray
    label: np.ndarray
    class_names: list[str]
    dirs: list[str]
    mtimes: np.ndarray
    ignored: int
    cached: bool = False


def _walk(top: str, rel: str, out: list[str], dirs: list[str], mtimes: list[int], state: dict) -> None:
    """Append ``top``'s image files (recursively, as paths relative to the root) to ``out``."""
    st = os.stat(top)
    ident = (st.st_dev, st.st_ino)
    if ident in state["seen"]:  # a symbolic link back into the tree
        raise ValueError(f"{top}: a directory link loops back into the data set")
    state["seen"].add(ident)
    dirs.append(rel)
    mtimes.append(st.st_mtime_ns)
    files, subdirs = [], []
    with os.scandir(top) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                subdirs.append(entry.name)
            elif entry.is_file():
                if os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS:
                    files.append(entry.name)
                else:
                    state["ignored"] += 1
    # order within a class: by path components (files of a folder and its sub-folders interleave
    # as the sorted parts do, which for a flat class folder is the eager reader's name order)
    items = [(name, False) for name in files] + [(name, True) for name in subdirs]
    for name, is_dir in sorted(items):
        child = f"{rel}/{name}"
        if is_dir:
            _walk(os.path.join(top, name), child, out, dirs, mtimes, state)
        else:
            out.append(child)
    if files and state["bar"] is not None:
        state["bar"].update(len(files))
    state["seen"].discard(ident)


def _class_dirs(split_root: str) -> list[str]:
    with os.scandir(split_root) as entries:
        return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())


def scan_tree(root: str | os.PathLike[str], *, progress: bool | None = None) -> FolderScan:
    """List a folder data set's images (no cache; see :func:`scan_folder`)."""
    top = os.fspath(root)
    split_layout = os.path.isdir(os.path.join(top, "train")) and os.path.isdir(os.path.join(top, "test"))
    roots = [(c, s) for c, s in enumerate(_SPLITS) if split_layout and os.path.isdir(os.path.join(top, s))]
    roots = roots or [(_ALL, "")]
    root_stat = os.stat(top)
    dirs, mtimes = [""], [root_stat.st_mtime_ns]
    state: dict[str, Any] = {"seen": set(), "ignored": 0, "bar": _progress(progress, f"scanning {top}")}
    per_split: list[tuple[int, dict[str, list[str]]]] = []
    try:
        for code, split in roots:
            split_root = os.path.join(top, split) if split else top
            if split:
                st = os.stat(split_root)
                dirs.append(split)
                mtimes.append(st.st_mtime_ns)
            classes = _class_dirs(split_root)
            if not classes:
                raise ValueError(
                    f"{split_root}: no class sub-folders found (expected {split_root}/<class>/<image>)"
                )
            # each class's names packed at once: a million Python strings held to the end of the
            # scan cost ten times the packed bytes
            listing: dict[str, tuple[bytes, np.ndarray]] = {}
            for name in classes:
                files: list[str] = []
                rel = f"{split}/{name}" if split else name
                _walk(os.path.join(split_root, name), rel, files, dirs, mtimes, state)
                if not files:
                    raise ValueError(
                        f"{os.path.join(split_root, name)}: class folder holds no images "
                        f"({', '.join(IMAGE_EXTENSIONS)})"
                    )
                listing[name] = _pack(files)
            per_split.append((code, listing))
    finally:
        if state["bar"] is not None:
            state["bar"].close()
    class_names = sorted({name for _, listing in per_split for name in listing})
    index = {name: i for i, name in enumerate(class_names)}
    blobs: list[bytes] = []
    lengths: list[np.ndarray] = []
    split_codes: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for code, listing in per_split:
        for name, (chunk, chunk_offsets) in listing.items():
            blobs.append(chunk)
            lengths.append(np.diff(chunk_offsets))
            split_codes.append(np.full(len(chunk_offsets) - 1, code, dtype=np.int8))
            labels.append(np.full(len(chunk_offsets) - 1, index[name], dtype=np.int64))
    blob = b"".join(blobs)
    del blobs
    sizes = np.concatenate(lengths)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return FolderScan(
        top, blob, offsets, np.concatenate(split_codes), np.concatenate(labels), class_names, dirs,
        np.asarray(mtimes, dtype=np.int64), int(state["ignored"]),
    )  # fmt: skip


def _index_path(cache_dir: str | os.PathLike[str], root: str) -> Path:
    digest = hashlib.sha256(os.path.realpath(root).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return Path(cache_dir) / "folder-index" / f"{digest}.npz"


def _text_array(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8", "surrogateescape"), dtype=np.uint8)


def _save_index(path: Path, scan: FolderScan) -> None:
    dirs_blob, dirs_offsets = _pack(scan.dirs)
    names_blob, names_offsets = _pack(scan.class_names)
    arrays = {
        "version": np.array(_INDEX_VERSION, dtype=np.int64),
        "root": _text_array(os.path.realpath(scan.root)),
        "blob": np.frombuffer(scan.blob, dtype=np.uint8),
        "offsets": scan.offsets,
        "split": scan.split,
        "label": scan.label,
        "names_blob": np.frombuffer(names_blob, dtype=np.uint8),
        "names_offsets": names_offsets,
        "dirs_blob": np.frombuffer(dirs_blob, dtype=np.uint8),
        "dirs_offsets": dirs_offsets,
        "mtimes": scan.mtimes,
        "ignored": np.array(scan.ignored, dtype=np.int64),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_index(path: Path, root: str) -> FolderScan | None:
    """The stored scan of ``root`` if it is still valid (every directory's mtime unchanged)."""
    from marginkit._files import read_npz_arrays

    if not path.is_file():
        return None
    try:
        a = read_npz_arrays(path)
        own_root = _text_array(os.path.realpath(root)).tobytes()
        if int(a["version"]) != _INDEX_VERSION or bytes(a["root"]) != own_root:
            return None
        dirs = _unpack(bytes(a["dirs_blob"]), a["dirs_offsets"])
        mtimes = a["mtimes"].astype(np.int64)
        offsets = a["offsets"].astype(np.int64)
        n = len(offsets) - 1
        blob = bytes(a["blob"])
        if (
            len(dirs) != len(mtimes)
            or offsets[-1] != len(blob)
            or {a["split"].shape, a["label"].shape} != {(n,)}
        ):
            return None
        names = _unpack(bytes(a["names_blob"]), a["names_offsets"])
    except (ValueError, KeyError, OSError, UnicodeDecodeError):
        return None
    for rel, mtime in zip(dirs, mtimes.tolist(), strict=True):
        try:
            if os.stat(os.path.join(root, rel) if rel else root).st_mtime_ns != mtime:
                return None
        except OSError:
            return None
    label = a["label"].astype(np.int64)
    if n and (label.min() < 0 or label.max() >= len(names)):
        return None
    return FolderScan(root, blob, offsets, a["split"].astype(np.int8), label, names, dirs, mtimes,
                      int(a["ignored"]), cached=True)  # fmt: skip


def cached_scan(
    directory: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None,
    *,
    progress: bool | None = None,
) -> FolderScan:
    """:func:`scan_tree`, through the index cache under ``cache_dir`` when given (module doc)."""
    root = os.fspath(directory)
    path = _index_path(cache_dir, root) if cache_dir is not None else None
    if path is not None:
        stored = _load_index(path, root)
        if stored is not None:
            return stored
    started = time.time_ns()
    scan = scan_tree(root, progress=progress)
    if path is not None and int(scan.mtimes.max()) < started - int(MTIME_SETTLE_S * 1e9):
        with contextlib.suppress(OSError):  # a read-only cache: scan again next time
            _save_index(path, scan)
    return scan


def scan_folder(
    directory: str | os.PathLike[str],
    *,
    image_size: int | tuple[int, int] | None = None,
    color: str = "auto",
    test_fraction: float = 0.2,
    split_seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
) -> RawSplits:
    """``folder:DIR`` as :class:`~marginkit.data.loaders.RawSplits` of :class:`ImageFiles` (lazy).

    Options as :func:`~marginkit.data.loaders.read_folder` (``image_size``, ``color``,
    ``test_fraction``, ``split_seed``), with the same rows, labels and splits; ``cache_dir``: where
    the scan's index is cached (``None``: scan every time); ``progress``: the scan's progress bar
    (``None``: on a terminal only). Nothing is decoded but the headers of
    :data:`~marginkit.data.decode.HEADER_SAMPLE` images (see the module doc).
    """
    from marginkit.data.decode import image_size_option

    size = image_size_option(image_size)
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory (expected one sub-folder of images per class)")
    scan = cached_scan(root, cache_dir, progress=progress)
    layout = _layout_of(os.fspath(root), scan.blob, scan.offsets, size, color, str(root))
    files = ImageFiles(root, scan.blob, scan.offsets, layout, size)
    info: dict[str, Any] = {
        "source": str(root),
        "color": layout.mode,
        "image_size": tuple(layout.shape[1:]),
        "layout": layout.note,
        "files": len(scan.label),
        "ignored_files": scan.ignored,
        "index": "cached scan" if scan.cached else "scanned",
        "lazy": True,
    }
    if scan.split[0] != _ALL:  # every class folder holds an image: there is a row 0
        parts = {s: np.flatnonzero(scan.split == c) for c, s in enumerate(_SPLITS)}
        info["split"] = "train/ and test/ sub-folders as given"
        train, val, test = parts["train"], parts["val"], parts["test"]
        return RawSplits(
            files[train], scan.label[train], files[test], scan.label[test],
            x_val=files[val] if val.size else None, y_val=scan.label[val] if val.size else None,
            kind="image", class_names=scan.class_names, info=info,
        )  # fmt: skip
    train, test = _seeded_split(scan.label, test_fraction, split_seed)
    info["split"] = split_note(test_fraction, split_seed)
    return RawSplits(
        files[train], scan.label[train], files[test], scan.label[test], kind="image",
        class_names=scan.class_names, info=info,
    )  # fmt: skip
