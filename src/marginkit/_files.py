"""Reading users' files without trusting them: one input memory limit and bounded ``.npz`` reads.

Every reader of data from a file (data sets, K-NN indices, cached built-ins) checks what a file
*claims* — array shapes in ``.npy`` headers, IDX dimensions, image sizes — against what the file
holds and against :func:`input_limit_bytes` *before* allocating, so a corrupt or hostile file
ends in a :class:`ValueError` naming it, never in ``MemoryError`` or a machine swapping.

The limit bounds the bytes decoded from one source (all the files of one data set, one index
file); it is ``$MARGINKIT_MAX_INPUT_MB`` megabytes, :data:`DEFAULT_INPUT_LIMIT_MB` when unset.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_INPUT_LIMIT_MB",
    "INPUT_LIMIT_ENV",
    "InputBudget",
    "NpyMember",
    "input_limit_bytes",
    "npz_members",
    "read_npz_arrays",
]

INPUT_LIMIT_ENV = "MARGINKIT_MAX_INPUT_MB"
DEFAULT_INPUT_LIMIT_MB = 4096
# Errors a damaged archive raises inside numpy / zipfile while it is read.
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError, NotImplementedError)


def input_limit_bytes() -> int:
    """The input memory limit in bytes (``$MARGINKIT_MAX_INPUT_MB``, default 4096 MB)."""
    raw = os.environ.get(INPUT_LIMIT_ENV, "").strip()
    if not raw:
        return DEFAULT_INPUT_LIMIT_MB * 2**20
    try:
        mb = float(raw)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb > 0):
        raise ValueError(f"${INPUT_LIMIT_ENV} must be a number of megabytes > 0, got {raw!r}")
    return int(mb * 2**20)


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MB"


class InputBudget:
    """Running total of the bytes one source decodes, refused past :func:`input_limit_bytes`."""

    def __init__(self, where: str | os.PathLike[str]) -> None:
        self.where, self.limit, self.used = str(where), input_limit_bytes(), 0

    def take(self, nbytes: int, what: str) -> None:
        """Account for ``nbytes`` more (before allocating them); raise past the limit."""
        self.used += int(nbytes)
        if self.used > self.limit:
            raise ValueError(
                f"{self.where}: {what} needs {_mb(self.used)} in all, above the input memory limit "
                f"of {_mb(self.limit)}; set ${INPUT_LIMIT_ENV} to raise it if the file is genuine"
            )


@dataclass(frozen=True)
class NpyMember:
    """One array of an ``.npz`` as its header declares it."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def npz_members(path: str | os.PathLike[str], budget: InputBudget | None = None) -> dict[str, NpyMember]:
    """Read and check every member header of the ``.npz`` at ``path`` without reading data.

    Each member must be a ``.npy`` array without Python objects whose header's shape and dtype
    account exactly for the member's size; the total is charged to ``budget`` (a fresh one for
    ``path`` by default). Raises :class:`ValueError` naming ``path`` and the problem.
    """
    path = Path(path)
    budget = budget or InputBudget(path)
    members: dict[str, NpyMember] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    raise ValueError(f"member {info.filename!r} is not a .npy array")
                name = info.filename[: -len(".npy")]
                with archive.open(info) as handle:
                    version = np.lib.format.read_magic(handle)
                    if version not in _HEADER_READERS:
                        raise ValueError(f"array {name!r} has unsupported .npy format version {version}")
                    shape, _, dtype = _HEADER_READERS[version](handle)
                    header = handle.tell()
                if dtype.hasobject:
                    raise ValueError(f"array {name!r} holds Python objects (refused: it would need pickle)")
                nbytes = math.prod(shape) * dtype.itemsize
                if nbytes != info.file_size - header:
                    raise ValueError(
                        f"array {name!r} declares shape {list(shape)} {dtype} ({nbytes:,} bytes) but holds "
                        f"{max(0, info.file_size - header):,} bytes (truncated or corrupt)"
                    )
                members[name] = NpyMember(name, tuple(shape), dtype, nbytes)
    except _READ_ERRORS as exc:
        raise ValueError(f"{path}: not a readable .npz archive of plain arrays ({exc})") from exc
    for member in members.values():
        budget.take(member.nbytes, f"array {member.name!r} {list(member.shape)} {member.dtype}")
    return members


def read_npz_arrays(path: str | os.PathLike[str], budget: InputBudget | None = None) -> dict[str, np.ndarray]:
    """All arrays of the ``.npz`` at ``path``, after :func:`npz_members` accepted its headers."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a .npz archive)")
    npz_members(path, budget)
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except _READ_ERRORS as exc:
        raise ValueError(f"{path}: not a readable .npz archive of plain arrays ({exc})") from exc
