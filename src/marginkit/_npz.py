"""Reading ``.npz`` archives from untrusted sources with bounded memory and no pickle.

Each member's ``.npy`` header is parsed first; the array's size (shape x item size) is
checked against the remaining budget *before* any data is read, and then exactly that many
bytes are read from the (possibly compressed) member. A zip member that lies about its
size, an object or structured dtype, or a member that is not an ``.npy`` file is rejected.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from collections.abc import Iterable
from typing import BinaryIO

import numpy as np

__all__ = ["NpzError", "read_npy", "read_npz"]

_KINDS = "biufU"  # bool, integers, floats, unicode strings (e.g. JSON metadata)
_MAX_HEADER = 10_000


class NpzError(ValueError):
    """An ``.npz`` archive is malformed, too large or holds an unsupported array."""


def _read_member(fh: BinaryIO, where: str, budget: int) -> np.ndarray:
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(fh, max_header_size=_MAX_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(fh, max_header_size=_MAX_HEADER)
        else:
            raise NpzError(f"{where}: unsupported .npy format version {version}")
    except NpzError:
        raise
    except Exception as exc:  # numpy raises ValueError/OSError/SyntaxError on bad headers
        raise NpzError(f"{where}: not a valid .npy array ({exc})") from None
    if dtype.kind not in _KINDS or dtype.hasobject or dtype.fields is not None:
        raise NpzError(f"{where}: dtype {dtype} is not allowed (numbers, bools or strings only)")
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes > budget:
        raise NpzError(
            f"{where}: array of shape {list(shape)} ({nbytes} bytes) exceeds the limit of {budget} bytes"
        )
    data = fh.read(nbytes)
    if len(data) != nbytes:
        raise NpzError(f"{where}: truncated array data ({len(data)} of {nbytes} bytes)")
    array = np.frombuffer(data, dtype=dtype, count=count)
    return array.reshape(shape, order="F" if fortran else "C").copy()


def read_npy(data: bytes, *, where: str, max_bytes: int) -> np.ndarray:
    """The array of one ``.npy`` file's bytes (``numpy.save`` output), at most ``max_bytes`` of
    array data; the same checks as a member of :func:`read_npz`, and no byte may follow the data.

    Raises:
        NpzError: naming ``where`` and what is wrong.
    """
    fh = io.BytesIO(data)
    array = _read_member(fh, where, int(max_bytes))
    if fh.read(1):
        raise NpzError(f"{where}: bytes follow the array data (expected one .npy array)")
    return array


def read_npz(
    source: str | os.PathLike[str] | bytes | BinaryIO,
    *,
    where: str,
    max_bytes: int,
    names: Iterable[str] | None = None,
    required: Iterable[str] = (),
) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` archive, at most ``max_bytes`` of array data in total.

    Args:
        source: a path, the archive's bytes, or a binary file object.
        where: how to name the source in error messages (e.g. the file name).
        max_bytes: bound on the decoded array data.
        names: if given, the only member names accepted (others are an error).
        required: member names that must be present.

    Raises:
        NpzError: naming ``where`` and what is wrong.
    """
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    allowed = None if names is None else set(names)
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError, ValueError):
        raise NpzError(f"{where}: not an .npz archive (expected numpy.savez output)") from None
    out: dict[str, np.ndarray] = {}
    with archive:
        members = archive.infolist()
        if len(members) > 64:
            raise NpzError(f"{where}: {len(members)} members; at most 64 arrays are accepted")
        budget = int(max_bytes)
        for info in members:
            if not info.filename.endswith(".npy") or "/" in info.filename:
                raise NpzError(f"{where}: member {info.filename!r} is not a top-level .npy array")
            name = info.filename[: -len(".npy")]
            if allowed is not None and name not in allowed:
                raise NpzError(f"{where}: unexpected array {name!r}; expected {', '.join(sorted(allowed))}")
            try:
                with archive.open(info) as fh:
                    array = _read_member(fh, f"{where}: array {name!r}", budget)
            except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as exc:
                raise NpzError(f"{where}: array {name!r} is corrupted ({exc})") from None
            budget -= array.nbytes
            out[name] = array
    missing = [n for n in required if n not in out]
    if missing:
        found = ", ".join(sorted(out)) or "none"
        raise NpzError(f"{where}: missing array(s) {', '.join(missing)} (found {found})")
    return out
