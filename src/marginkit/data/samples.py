"""Lazy samples: the leading axis of an array of samples that stay in their files until read.

Every reader of a file-backed source (``folder:``, ``csv:``, ``rec:``; audio lists) returns
:class:`~marginkit.data.loaders.RawSplits` whose ``x_*`` are :class:`LazySamples` instead of
numpy arrays. A :class:`LazySamples` behaves like an array's first axis *without decoding
anything*: ``len(x)``, ``x.shape``, ``x[index_array]``, ``x[boolean_mask]``, ``x[a:b]`` and
:func:`concat_samples` (what ``np.concatenate`` does for pooled splits) give *views*, other
:class:`LazySamples` over a subset of the source's rows. So the split logic of
:func:`~marginkit.data.resplit.labelled_splits` and :func:`~marginkit.data.load_dataset`
(validation carving, class-disjoint splits, ``train_per_class``) is one implementation for
arrays and files alike. :meth:`LazySamples.read` decodes one row, in the process that calls it
(a DataLoader worker): file handles are opened there, never inherited (they are dropped when a
source is pickled, and reopened when the process id changes).

A format implements four methods over its own *keys* ``0..num_keys-1`` (its rows in file order):
``_num_keys``, ``_read_key``, ``_where_key`` and ``_relative_key``; views, concatenation,
pickling, shapes and the bounds checks are implemented here, once.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "BAD_SAMPLE_POLICIES",
    "BadSampleError",
    "ConcatSamples",
    "LazySamples",
    "concat_samples",
    "is_lazy",
    "read_or_skip",
]

#: What ``on_bad_sample`` may say: stop the run with the error, or drop the sample (counted).
BAD_SAMPLE_POLICIES = ("raise", "skip")


class BadSampleError(ValueError):
    """A sample that cannot be read: ``str(err) == f"{where}: {problem}"``.

    ``where`` names the file (and row / record / byte offset), e.g. ``"/data/faces/017/3.jpg"``
    or ``"train.rec record 17 (byte offset 123456)"``; ``problem`` says what is wrong. Built
    from one string (as torch's DataLoader re-raises a worker's exception) it is all ``problem``.
    """

    def __init__(self, where: str, problem: str | None = None) -> None:
        if problem is None:
            where, problem = "", str(where)
        self.where, self.problem = str(where), str(problem)
        super().__init__(f"{self.where}: {self.problem}" if self.where else self.problem)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.where, self.problem))


def _rows_of(key: Any, n: int) -> np.ndarray:
    """``key`` (int, slice, int array / list, boolean mask) as int64 positions in ``0..n-1``."""
    if isinstance(key, slice):
        return np.arange(n, dtype=np.int64)[key]
    if isinstance(key, (bool, np.bool_)):
        raise TypeError("a LazySamples index must be an int, a slice, an integer array or a boolean mask")
    if isinstance(key, (int, np.integer)):
        i = int(key)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of bounds for {n} samples")
        return np.array([i % n], dtype=np.int64)
    array = np.asarray(key)
    if array.dtype == np.bool_:
        if array.shape != (n,):
            raise IndexError(f"boolean mask of shape {list(array.shape)} does not match {n} samples")
        return np.flatnonzero(array).astype(np.int64)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(
            "a LazySamples index must be an int, a slice, a 1-D integer array or a boolean mask, "
            f"got {array.dtype} of shape {list(array.shape)}"
        )
    if array.min() < -n or array.max() >= n:
        bad = array[(array < -n) | (array >= n)][0]
        raise IndexError(f"index {int(bad)} is out of bounds for {n} samples")
    return np.where(array < 0, array + n, array).astype(np.int64)


class LazySamples:
    """Rows of a file-backed source, decoded one at a time by :meth:`read` (see the module doc).

    Attributes:
        kind: ``"image"`` or ``"audio"``.
        sample_shape: the decoded shape of one row (``(C, H, W)`` for images; ``()`` where rows
            differ in length, as audio does).
        dtype: the dtype :meth:`read` returns (``uint8`` pixels; ``float32`` / ``int16`` audio).
        uses_rng: whether :meth:`read` draws from its ``rng`` (an audio crop); ``False`` lets a
            reader pass ``None`` instead of seeding a generator per row (about 20 µs each).

    Subclasses call ``super().__init__()`` and implement ``_num_keys``, ``_read_key``,
    ``_where_key`` and ``_relative_key``; per-process state (open files) lives in the dict
    :meth:`_local` returns, which is emptied in a new process and never pickled.
    """

    kind: str = "image"
    sample_shape: tuple[int, ...] = ()
    dtype: np.dtype = np.dtype(np.uint8)
    uses_rng: bool = True

    def __init__(self) -> None:
        self._rows: np.ndarray | None = None  # None: every key, in order
        self._token = object()  # shared by views of one source (concatenated as one view)
        self._local_state: dict[str, Any] = {}
        self._pid = os.getpid()

    # ---------------------------------------------------------------- what a format implements
    def _num_keys(self) -> int:
        raise NotImplementedError

    def _read_key(self, key: int, rng: np.random.Generator | None) -> np.ndarray:
        raise NotImplementedError

    def _where_key(self, key: int) -> str:
        raise NotImplementedError

    def _relative_key(self, key: int) -> str:
        raise NotImplementedError

    def _encoded_key(self, key: int) -> tuple[bytes, str] | None:
        """The key's sample as its file stores it (encoded image bytes, extension), where a format
        keeps one; ``None`` otherwise."""
        return None

    #: ``(mode, image_size, gray_only)`` that :func:`~marginkit.data.decode.decode_image` turns
    #: :meth:`encoded` bytes into :meth:`read`'s rows with; ``None`` for formats without encoded rows.
    decode_params: tuple[str, tuple[int, int] | None, bool] | None = None

    def _row_nbytes(self) -> int:
        """Decoded bytes of one row (formats of variable-length rows override it)."""
        return math.prod(self.sample_shape) * np.dtype(self.dtype).itemsize

    def _local(self) -> dict[str, Any]:
        """Per-process state (open handles): a fresh dict in a process other than the one that
        made it, so no handle crosses a fork or a pickle."""
        if self._pid != os.getpid():
            self._local_state, self._pid = {}, os.getpid()
        return self._local_state

    # ---------------------------------------------------------------- the array-like interface
    @property
    def keys(self) -> np.ndarray:
        """The source's keys of this view's rows (int64, a copy)."""
        return np.arange(self._num_keys(), dtype=np.int64) if self._rows is None else self._rows.copy()

    def _key(self, i: int) -> int:
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"row {i} is out of bounds for {n} samples")
        i %= n
        return i if self._rows is None else int(self._rows[i])

    def __len__(self) -> int:
        return self._num_keys() if self._rows is None else len(self._rows)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.sample_shape)

    @property
    def ndim(self) -> int:
        return 1 + len(self.sample_shape)

    def __getitem__(self, key: Any) -> LazySamples:
        """A view of the rows ``key`` selects (int, slice, integer array, boolean mask); nothing
        is decoded. An int gives a one-row view; use :meth:`read` to decode a row."""
        positions = _rows_of(key, len(self))
        return self._view(positions if self._rows is None else self._rows[positions])

    def _view(self, keys: np.ndarray) -> LazySamples:
        view = copy.copy(self)
        view._rows = np.ascontiguousarray(keys, dtype=np.int64)
        view._rows.setflags(write=False)
        return view

    def read(self, i: int, rng: np.random.Generator | None = None) -> np.ndarray:
        """Decode row ``i`` (``sample_shape``, ``dtype``), opening files lazily in this process.

        ``rng``: ``None`` at evaluation; in training a generator seeded from (seed, epoch, index)
        (images ignore it; audio draws its crop from it). Raises :class:`BadSampleError`
        naming the file for a sample that cannot be read.
        """
        return self._read_key(self._key(i), rng)

    def where(self, i: int) -> str:
        """The file (or record) of row ``i``, for messages."""
        return self._where_key(self._key(i))

    def relative_path(self, i: int) -> str:
        """Row ``i``'s path relative to the data root (what ``embed`` writes beside embeddings)."""
        return self._relative_key(self._key(i))

    def nbytes_decoded(self) -> int:
        """Bytes the decoded rows would take (the memory-budget decision)."""
        return len(self) * self._row_nbytes()

    def encoded(self, i: int) -> tuple[bytes, str] | None:
        """Row ``i`` as stored (encoded image bytes and their extension), without decoding it, or
        ``None`` where the format keeps no encoded form (a shard writer then stores pixels)."""
        return self._encoded_key(self._key(i))

    def to_array(self, budget: Any = None) -> np.ndarray:
        """Every row decoded into one ``[N, *sample_shape]`` array (rows of one shape only).

        ``budget``: a :class:`~marginkit._files.InputBudget` charged before allocating (a fresh
        one for this source by default).
        """
        from marginkit._files import InputBudget

        if not self.sample_shape and self.kind != "image":
            raise ValueError(f"{self!r}: rows of different lengths cannot be stacked into one array")
        budget = budget if budget is not None else InputBudget(repr(self))
        budget.take(self.nbytes_decoded(), f"{len(self)} decoded samples of {list(self.sample_shape)}")
        out = np.empty(self.shape, dtype=self.dtype)
        for i in range(len(self)):
            out[i] = self.read(i)
        return out

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(
            f"{type(self).__name__} is lazy (rows stay in their files): read rows with .read(i), or "
            ".to_array() to decode them all"
        )

    def __iter__(self) -> Any:
        raise TypeError(f"{type(self).__name__} is lazy: iterate over range(len(x)) and call x.read(i)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} x {list(self.sample_shape)} {np.dtype(self.dtype)})"

    # ---------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_local_state"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()


class ConcatSamples(LazySamples):
    """Rows of several sources one after another (:func:`concat_samples`); keys run through the
    parts in order."""

    def __init__(self, parts: Sequence[LazySamples]) -> None:
        super().__init__()
        first = parts[0]
        self.kind, self.sample_shape, self.dtype = first.kind, tuple(first.sample_shape), first.dtype
        self.parts = list(parts)
        self._starts = np.cumsum([0] + [len(p) for p in self.parts]).astype(np.int64)
        params = {p.decode_params for p in self.parts}
        self.decode_params = params.pop() if len(params) == 1 else None
        self.uses_rng = any(p.uses_rng for p in self.parts)

    def _part(self, key: int) -> tuple[LazySamples, int]:
        p = int(np.searchsorted(self._starts, key, side="right")) - 1
        return self.parts[p], key - int(self._starts[p])

    def _num_keys(self) -> int:
        return int(self._starts[-1])

    def _read_key(self, key: int, rng: np.random.Generator | None) -> np.ndarray:
        part, i = self._part(key)
        return part.read(i, rng)

    def _where_key(self, key: int) -> str:
        part, i = self._part(key)
        return part.where(i)

    def _relative_key(self, key: int) -> str:
        part, i = self._part(key)
        return part.relative_path(i)

    def _encoded_key(self, key: int) -> tuple[bytes, str] | None:
        part, i = self._part(key)
        return part.encoded(i)

    def _row_nbytes(self) -> int:
        return self.parts[0]._row_nbytes()

    def nbytes_decoded(self) -> int:
        if self._rows is None:
            return sum(p.nbytes_decoded() for p in self.parts)
        return super().nbytes_decoded()


def concat_samples(parts: Sequence[LazySamples]) -> LazySamples:
    """The rows of ``parts`` one after another, as ``np.concatenate`` stacks arrays.

    Views of one source give one view of it (the pooled splits of a folder stay one source);
    others are chained by :class:`ConcatSamples`. The parts must agree in ``kind``,
    ``sample_shape`` and ``dtype``.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("concat_samples needs at least one part")
    for p in parts:
        if not isinstance(p, LazySamples):
            raise TypeError(f"concat_samples takes LazySamples, got {type(p).__name__}")
        if (p.kind, tuple(p.sample_shape), np.dtype(p.dtype)) != (
            parts[0].kind,
            tuple(parts[0].sample_shape),
            np.dtype(parts[0].dtype),
        ):
            raise ValueError(
                f"cannot concatenate {parts[0]!r} and {p!r}: kind, sample shape and dtype must agree"
            )
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if all(type(p) is type(first) and p._token is first._token for p in parts):
        return first._view(np.concatenate([p.keys for p in parts]))
    return ConcatSamples(parts)


def is_lazy(x: Any) -> bool:
    """Whether ``x`` is a :class:`LazySamples` (rows read from files), not an in-memory array."""
    return isinstance(x, LazySamples)


def read_or_skip(
    samples: LazySamples, i: int, rng: np.random.Generator | None = None, policy: str = "raise"
) -> np.ndarray | None:
    """Row ``i`` of ``samples`` under the ``on_bad_sample`` policy: ``"raise"`` lets a
    :class:`BadSampleError` through, ``"skip"`` returns ``None`` for it (the caller drops the
    sample and counts it). Any other error is not a bad sample and always propagates."""
    if policy not in BAD_SAMPLE_POLICIES:
        raise ValueError(f"on_bad_sample must be one of {', '.join(BAD_SAMPLE_POLICIES)}, got {policy!r}")
    try:
        return samples.read(i, rng)
    except BadSampleError:
        if policy == "skip":
            return None
        raise
