"""``wds:`` — WebDataset tar shards: sequential reading for data sets that are streamed, and a writer.

**Why webdataset.** Its shards are plain POSIX tar files (``<key>.jpg``, ``<key>.cls`` members):
readable with ``tar`` and by any tool, written once, appended to nothing, and streamed from any
URL its ``gopen`` opens (local paths, ``http(s)://`` through ``curl``, and ``pipe:`` commands)
with no index service and no cache directory. ``litdata`` and ``mosaicml-streaming`` store their
own binary chunk formats behind an ``index.json``, need a conversion step of their own and copy
remote chunks into a local cache managed by their own process coordination (shared memory,
lock files); their value is random access into remote data, which a sequential shard stream does
not need. From webdataset this module uses ``gopen`` (opening a shard), its buffer ``shuffle``
stage and its ``TarWriter``; the loop over a shard's members is written here, to bound each
member's size before reading it and to count a shard's samples against the metadata.

**Locations.** ``wds:DIR`` or ``wds:URL/`` (a folder holding :data:`META_NAME`), ``wds:FILE.tar``,
or a brace pattern ``wds:DIR/train-{000000..000099}.tar`` (a subset of the shards; the metadata
is read from the pattern's folder). URLs: ``http://`` / ``https://`` are read by webdataset's
``curl`` pipe; ``s3://bucket/key`` by a handler registered here on webdataset's ``gopen`` table
when it has none: webdataset's ``Pipe`` around ``aws s3 cp s3://bucket/key -`` (the AWS CLI and
its usual credentials; the command is an argument list, no shell). ``pipe:`` URLs (arbitrary
shell commands) are refused.

**Metadata** (``marginkit-shards.json``, written by :func:`write_shards` *last*, so a folder
without it is an unfinished data set): per split its shards with their sample counts, the class
names, the per-sample shape and dtype, how to decode (the source's ``mode`` / ``image_size``),
and a ``<split>-labels.npy`` of every sample's label in shard order.

**Order, splitting and equal steps** (:class:`ShardSamples`): each epoch the shard list is
permuted by ``(seed, epoch)`` (the same on every rank), dealt to the ranks (``shards[rank::R]``)
and then to the DataLoader workers of each rank (``[worker::W]``); samples pass a shuffle buffer
seeded by ``(seed, epoch, rank, worker)``. With ``equal_per_rank`` (the training default) every
rank yields exactly ``num_samples // world_size`` items an epoch, shared between its workers as
evenly as integers allow: a worker that exhausts its shards continues with a fresh permutation of
its rank's shards (those samples are seen twice in the epoch), and a worker past its share stops.
So every rank takes the same number of steps. Without it (evaluation) every sample is read once.
A DataLoader over a :class:`ShardSamples` must not use ``persistent_workers``: the epoch is set in
the main process (:meth:`ShardSamples.set_epoch`) and reaches the workers when they start.

**Bad samples.** A truncated or corrupt shard (its tar stream ends early, or it holds fewer or
more samples than the metadata says), a member past the size limit, or a sample that does not
decode is a :class:`~marginkit.data.samples.BadSampleError` naming the shard (and the sample's
key). With ``on_bad_sample="skip"`` it is yielded as a :class:`SkippedSample` in the sample's
place instead (the collate step drops and counts it; it takes the sample's place in the equal
count, so steps stay equal across ranks), and the rest of a broken shard is skipped.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import random
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlparse

import numpy as np
import torch

from marginkit.data.decode import decode_image
from marginkit.data.loaders import RawSplits
from marginkit.data.samples import BAD_SAMPLE_POLICIES, BadSampleError, LazySamples

__all__ = [
    "META_NAME",
    "ShardItem",
    "ShardSamples",
    "ShardSplits",
    "SkippedSample",
    "open_shards",
    "write_shards",
]

#: The metadata file beside the shards (its presence marks a finished data set).
META_NAME = "marginkit-shards.json"
_FORMAT, _VERSION = "marginkit-shards", 1
_SIDES = ("train", "val", "test")
_META_LIMIT = 256 * 2**20  # bytes read at most for the metadata or a labels file
_IMAGE_EXTS = ("jpg", "jpeg", "png", "bmp", "gif", "tif", "tiff", "webp", "ppm", "pgm", "img")


class ShardItem(NamedTuple):
    """One sample as :class:`ShardSamples` yields it: the decoded ``sample``, its ``label`` as
    its shard stores it, its ``key`` (the path relative to the source's root, or its shard key)
    and its ``index``: its position in the split's shard order (the row of the split's labels)."""

    sample: np.ndarray
    label: int
    key: str
    index: int


@dataclass(frozen=True)
class SkippedSample:
    """What :class:`ShardSamples` yields in place of a bad sample under ``on_bad_sample="skip"``:
    where it was, the problem, and how many samples were lost (the rest of a broken shard)."""

    where: str
    problem: str
    count: int = 1


# --------------------------------------------------------------------------------------------
# opening URLs with webdataset's gopen


def _gopen_s3(url: str, mode: str = "rb", bufsize: int = 8192) -> Any:
    """``s3://bucket/key`` streamed by ``aws s3 cp URL -`` in webdataset's ``Pipe`` (no shell)."""
    from webdataset.gopen import Pipe

    if mode[0] != "r":
        raise ValueError(f"{url}: shards are read from s3, not written")
    return Pipe(["aws", "s3", "cp", url, "-"], mode=mode, bufsize=bufsize, ignore_status=[141])


def _check_url(url: str) -> str:
    scheme = urlparse(url).scheme
    if scheme == "pipe":
        raise ValueError(
            f"{url}: pipe: URLs run shell commands and are refused; give a path or an http(s)/s3 URL"
        )
    if scheme not in ("", "file", "http", "https", "s3") and not (len(scheme) == 1 and os.name == "nt"):
        raise ValueError(f"{url}: unsupported URL scheme {scheme!r} (local paths, file:, http(s):, s3:)")
    return url


def _open(url: str) -> Any:
    """A readable binary stream for a shard or metadata location."""
    from webdataset.gopen import gopen, gopen_schemes

    _check_url(url)
    if urlparse(url).scheme == "s3":
        gopen_schemes.setdefault("s3", _gopen_s3)
    try:
        return gopen(url, "rb")
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{url}: no such file") from exc
    except OSError as exc:
        raise ValueError(f"{url}: cannot open ({exc})") from exc


def _read_all(url: str, limit: int = _META_LIMIT) -> bytes:
    stream = _open(url)
    try:
        data = stream.read(limit + 1)
    except OSError as exc:  # curl's exit status (a 404, no route) surfaces here
        raise ValueError(f"{url}: cannot read ({exc})") from exc
    finally:
        with contextlib.suppress(OSError):
            stream.close()
    if len(data) > limit:
        raise ValueError(f"{url}: larger than {limit:,} bytes")
    return data


def _is_remote(location: str) -> bool:
    return urlparse(location).scheme in ("http", "https", "s3")


def _join(base: str, name: str) -> str:
    if _is_remote(base) or base.startswith("file:"):
        return base.rstrip("/") + "/" + name
    return os.path.join(base, name)


def _locate(spec: str) -> tuple[str, list[str] | None]:
    """``(base location, shard names or None for all)`` of a ``wds:`` spec (see the module doc)."""
    import braceexpand

    spec = _check_url(str(spec))
    if spec.endswith(".tar") or "{" in spec:
        names = list(braceexpand.braceexpand(spec))
        bases = {n.rsplit("/", 1)[0] if "/" in n else "." for n in names}
        if len(bases) != 1:
            raise ValueError(f"{spec}: every shard of a pattern must sit in one folder (beside {META_NAME})")
        return bases.pop(), [n.rsplit("/", 1)[-1] for n in names]
    return spec.rstrip("/") if spec not in ("/", "") else spec, None


# --------------------------------------------------------------------------------------------
# metadata


def _validate_meta(meta: Any, where: str) -> dict[str, Any]:
    def bad(problem: str) -> ValueError:
        return ValueError(f"{where}: {problem} (not a shard set written by marginkit's write_shards)")

    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise bad("format is not " + repr(_FORMAT))
    if meta.get("version") != _VERSION:
        raise bad(f"version {meta.get('version')!r}, this reader reads version {_VERSION}")
    splits = meta.get("splits")
    if not isinstance(splits, dict) or "train" not in splits or not set(splits) <= set(_SIDES):
        raise bad("'splits' must map train (and optionally val, test) to their shards")
    for split, entry in splits.items():
        shards = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards, list) or not all(
            isinstance(s, dict)
            and isinstance(s.get("name"), str)
            and "/" not in s["name"]
            and isinstance(s.get("num_samples"), int)
            and s["num_samples"] >= 0
            for s in shards
        ):
            raise bad(f"split {split!r}: 'shards' must list {{name, num_samples}}")
        if entry.get("num_samples") != sum(s["num_samples"] for s in shards):
            raise bad(f"split {split!r}: num_samples is not the sum of its shards'")
    shape = meta.get("sample_shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad("'sample_shape' must be a list of sizes")
    if meta.get("encoding") not in ("encoded", "npy"):
        raise bad("'encoding' must be 'encoded' or 'npy'")
    names = meta.get("class_names")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise bad("'class_names' must be a list of strings")
    try:
        np.dtype(meta.get("dtype"))
    except TypeError as exc:
        raise bad(f"'dtype' {meta.get('dtype')!r} is not a numpy dtype") from exc
    return meta


def read_metadata(base: str) -> dict[str, Any]:
    """The validated :data:`META_NAME` of the shard set at ``base`` (a folder or URL)."""
    where = _join(base, META_NAME)
    try:
        data = _read_all(where)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"{where}: no such file; a shard folder without it is unfinished (write_shards writes it last)"
        ) from exc
    try:
        meta = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from exc
    return _validate_meta(meta, where)


def _read_labels(base: str, split: str, entry: dict[str, Any]) -> np.ndarray | None:
    name = entry.get("labels")
    if not isinstance(name, str) or "/" in name:
        return None
    where = _join(base, name)
    try:
        labels = np.load(io.BytesIO(_read_all(where)), allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{where}: not a labels array ({exc})") from exc
    if labels.shape != (entry["num_samples"],) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{where}: expected {entry['num_samples']} integer labels, got {labels.dtype} {labels.shape}"
        )
    return labels.astype(np.int64)


# --------------------------------------------------------------------------------------------
# reading


def _member_limit() -> int:
    from marginkit._files import input_limit_bytes

    return input_limit_bytes()


def _tar_samples(stream: Any, shard: str, limit: int) -> Iterator[dict[str, Any]]:
    """The samples of one tar stream: members grouped by key (the name up to the first dot of
    its base name, webdataset's convention), each member's size checked before it is read."""
    current: dict[str, Any] | None = None
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as archive:
            for info in archive:
                if not info.isreg():
                    continue
                folder, _, base = info.name.rpartition("/")
                key, dot, ext = base.partition(".")
                if not dot or not key:
                    continue
                key = f"{folder}/{key}" if folder else key
                if info.size > limit:
                    raise BadSampleError(
                        f"{shard} member {info.name}", f"{info.size:,} bytes, above the input memory limit"
                    )
                member = archive.extractfile(info)
                data = member.read() if member is not None else b""
                if current is not None and current["__key__"] != key:
                    yield current
                    current = None
                if current is None:
                    current = {"__key__": key}
                current[ext.lower()] = data
    except tarfile.TarError as exc:
        raise BadSampleError(shard, f"truncated or corrupt tar shard ({exc})") from exc
    except OSError as exc:
        raise BadSampleError(shard, f"cannot read the shard ({exc})") from exc
    if current is not None:
        yield current


def _seed_int(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0])


class ShardSamples(torch.utils.data.IterableDataset):
    """One split of a shard set, iterated as :class:`ShardItem` s (see the module doc).

    ``sample``: ``sample_shape`` in ``dtype`` (``uint8`` ``[C, H, W]`` images); ``label``: the
    shard's int; ``key``: the sample's path relative to its source's root (or its shard key);
    ``index``: the sample's row in the split (shard order: the row of the split's labels, so a
    reader that delivers samples out of order still names them). ``len()`` is the split's sample
    count; :attr:`samples_per_rank` what one rank yields an epoch under ``equal_per_rank``.
    Built by :func:`open_shards`; ``rank`` / ``world_size`` default to ``torch.distributed``'s
    when it is initialised, else 0 / 1. :meth:`configured` gives a copy for one use (a rank's
    training reader, evaluation, a prefix for batch-norm statistics).

    Under ``equal_per_rank`` a worker's share is a whole number of ``batch`` es (the rank's
    ``samples_per_rank // batch`` batches dealt to its workers as evenly as integers allow; the
    remainder below one batch is not read), so the number of batches a rank's DataLoader yields
    with ``drop_last`` does not depend on its worker count: every rank takes the same steps.
    ``limit`` caps ``samples_per_rank`` (a prefix of the epoch's order).
    """

    def __init__(
        self,
        base: str,
        split: str,
        meta: dict[str, Any],
        *,
        shards: list[str] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
        rank: int | None = None,
        world_size: int | None = None,
        equal_per_rank: bool | None = None,
        on_bad_sample: str = "raise",
        limit: int | None = None,
        batch: int = 1,
    ) -> None:
        super().__init__()
        entry = meta["splits"][split]
        counts = {s["name"]: int(s["num_samples"]) for s in entry["shards"]}
        names = list(counts) if shards is None else shards
        unknown = [n for n in names if n not in counts]
        if unknown:
            raise ValueError(
                f"{base}: shard(s) {', '.join(unknown[:5])} are not in split {split!r} of {META_NAME}"
            )
        if not names:
            raise ValueError(f"{base}: split {split!r} has no shards")
        self.base, self.split = base, split
        self.shards = names
        self.counts = [counts[n] for n in names]
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64).tolist()
        self.num_samples = int(sum(self.counts))
        self.class_names = meta.get("class_names")
        self.sample_shape = tuple(meta["sample_shape"])
        self.dtype = np.dtype(meta["dtype"])
        self.kind = meta.get("kind", "image")
        self.encoding = meta["encoding"]
        self.mode = meta.get("mode")
        size = meta.get("image_size")
        self.image_size = tuple(size) if size else None
        self.gray_only = bool(meta.get("gray_only", False))
        paths = entry.get("paths")
        self._paths_name = paths if isinstance(paths, str) and "/" not in paths and shards is None else None
        self._paths: list[str] | None = None
        if rank is None or world_size is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                rank, world_size = dist.get_rank(), dist.get_world_size()
            else:
                rank, world_size = 0, 1
        self.seed, self.shuffle, self.shuffle_buffer = int(seed), bool(shuffle), int(shuffle_buffer)
        self.rank, self.world_size = int(rank), int(world_size)
        self.equal_per_rank = self.shuffle if equal_per_rank is None else bool(equal_per_rank)
        self.on_bad_sample, self.limit, self.batch = on_bad_sample, limit, batch
        self.position: np.ndarray | None = None
        self.epoch = 0
        self.member_limit = _member_limit()
        self._check()

    def _check(self) -> None:
        if self.on_bad_sample not in BAD_SAMPLE_POLICIES:
            raise ValueError(
                f"on_bad_sample must be one of {', '.join(BAD_SAMPLE_POLICIES)}, got {self.on_bad_sample!r}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in 0..world_size-1, got rank={self.rank}, world_size={self.world_size}"
            )
        if self.equal_per_rank and self.num_selected < self.world_size:
            raise ValueError(
                f"{self.base}: {self.num_selected} samples cannot give each of {self.world_size} ranks one"
            )
        if isinstance(self.batch, bool) or int(self.batch) < 1:
            raise ValueError(f"batch must be a positive integer, got {self.batch!r}")
        if self.limit is not None and (isinstance(self.limit, bool) or int(self.limit) < 0):
            raise ValueError(f"limit must be a non-negative integer or None, got {self.limit!r}")
        if self.limit is not None and not self.equal_per_rank:
            raise ValueError("limit applies to an equal_per_rank reader (a prefix of the epoch's order)")
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {self.shuffle_buffer}")
        if self.position is not None and (
            not isinstance(self.position, np.ndarray) or self.position.shape != (self.num_samples,)
        ):
            raise ValueError(f"position must be an int64 array of {self.num_samples} entries (one a sample)")

    _SETTINGS = (
        "seed", "shuffle", "shuffle_buffer", "rank", "world_size", "equal_per_rank", "on_bad_sample",
        "limit", "batch", "position",
    )  # fmt: skip

    def configured(self, **changes: Any) -> ShardSamples:
        """A copy with some of the reading settings changed (``seed``, ``shuffle``,
        ``shuffle_buffer``, ``rank``, ``world_size``, ``equal_per_rank``, ``on_bad_sample``,
        ``limit``, ``batch``, ``position``); the epoch and the shard list are kept.

        ``position``: ``None`` (every sample) or an int64 array with one entry per sample (shard
        order): ``-1`` skips the sample unread (its bytes pass, nothing is decoded), any other
        value is yielded as the item's ``index`` — a view's row numbers (a class-disjoint split,
        a validation carve-out) read in shard order. Counts (``samples_per_rank``, the equal
        shares) are then of the selected samples, and shards holding none are not opened."""
        unknown = sorted(set(changes) - set(self._SETTINGS))
        if unknown:
            raise TypeError(f"configured() got unknown setting(s) {', '.join(unknown)}")
        out = copy.copy(self)
        for key, value in changes.items():
            setattr(out, key, value)
        out.rank, out.world_size, out.seed = int(out.rank), int(out.world_size), int(out.seed)
        out.shuffle_buffer = int(out.shuffle_buffer)
        if "position" in changes:
            out._selected = None
        out._check()
        return out

    _selected: list[int] | None = None

    def _selected_counts(self) -> list[int]:
        """Samples each shard yields under :attr:`position` (its count without one)."""
        if self.position is None:
            return self.counts
        if self._selected is None:
            chosen = (self.position >= 0).astype(np.int64)
            self._selected = np.add.reduceat(chosen, self.starts[:-1]).tolist() if self.counts else []
        return self._selected

    @property
    def num_selected(self) -> int:
        """Samples an evaluation pass yields (all, or those :attr:`position` selects)."""
        return int(sum(self._selected_counts()))

    @staticmethod
    def joined(parts: list[ShardSamples]) -> ShardSamples:
        """The shards of several splits of one set as one reader: rows run through ``parts`` in
        order (a pooled view reads train, val and test shards together)."""
        if len(parts) == 1:
            return parts[0]
        out = copy.copy(parts[0])
        out.split = "+".join(p.split for p in parts)
        out.shards = [n for p in parts for n in p.shards]
        out.counts = [c for p in parts for c in p.counts]
        out.starts = np.concatenate([[0], np.cumsum(out.counts)]).astype(np.int64).tolist()
        out.num_samples = int(sum(out.counts))
        out._paths_name, out._paths, out._selected, out.position = None, None, None, None
        return out

    def for_evaluation(self) -> ShardSamples:
        """Every sample once, in shard order, by one rank (its workers share the shards)."""
        return self.configured(shuffle=False, equal_per_rank=False, rank=0, world_size=1, limit=None, batch=1)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration follows (call before creating its iterator)."""
        self.epoch = int(epoch)

    @property
    def samples_per_rank(self) -> int:
        """Items one rank yields an epoch under ``equal_per_rank`` (before the ``batch`` rounding)."""
        per_rank = self.num_selected // self.world_size
        return per_rank if self.limit is None else min(per_rank, int(self.limit))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_samples, *self.sample_shape)

    def __len__(self) -> int:
        return self.num_samples

    def batches_per_epoch(self, workers: int, *, drop_last: bool) -> int:
        """Batches of :attr:`batch` a DataLoader with ``workers`` worker processes (``0``: one
        stream) yields this epoch, each worker's last short batch dropped with ``drop_last``."""
        if self.equal_per_rank:
            return self.samples_per_rank // self.batch
        mine = self._order()[self.rank :: self.world_size]
        streams = [mine[w :: max(1, workers)] for w in range(max(1, workers))]
        counts = self._selected_counts()
        sizes = [sum(counts[i] for i in s) for s in streams]
        if drop_last:
            return sum(n // self.batch for n in sizes)
        return sum(-(-n // self.batch) for n in sizes)

    def relative_path(self, i: int) -> str:
        """Row ``i``'s path relative to its source's root, as :func:`write_shards` recorded it in
        ``<split>-paths.json`` (read once, in this process); ``<split>/<i>`` without that file."""
        if not 0 <= int(i) < self.num_samples:
            raise IndexError(f"row {i} is out of bounds for {self.num_samples} samples")
        if self._paths is None and self._paths_name is not None:
            where = _join(self.base, self._paths_name)
            try:
                paths = json.loads(_read_all(where).decode("utf-8", "surrogateescape"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{where}: not valid JSON ({exc})") from exc
            if not isinstance(paths, list) or len(paths) != self.num_samples:
                raise ValueError(f"{where}: expected a list of {self.num_samples} paths")
            self._paths = [str(p) for p in paths]
        if self._paths is None:
            return f"{self.split}/{int(i)}"
        return self._paths[int(i)]

    def _order(self) -> list[int]:
        if not self.shuffle:
            order = list(range(len(self.shards)))
        else:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.shards)).tolist()
        if self.position is None:
            return order
        counts = self._selected_counts()
        return [i for i in order if counts[i]]

    def _passes(self, worker: int, workers: int) -> Iterator[list[int]]:
        """The worker's shards: its deal of this epoch's permutation, then (under
        ``equal_per_rank``, until its share is full) fresh permutations of its rank's shards."""
        order = self._order()
        yield order[self.rank :: self.world_size][worker::workers]
        if not self.equal_per_rank:
            return
        pool = order[self.rank :: self.world_size] or order
        for again in range(1, 2**62):
            rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker, again])
            yield [pool[i] for i in rng.permutation(len(pool)).tolist()]

    def _raw_samples(self, shards: list[int]) -> Iterator[dict[str, Any] | SkippedSample]:
        for index in shards:
            name, expected = self.shards[index], self.counts[index]
            url = _join(self.base, name)
            got = 0
            try:
                stream = _open(url)
                try:
                    for sample in _tar_samples(stream, url, self.member_limit):
                        got += 1
                        if got > expected:
                            raise BadSampleError(
                                url, f"holds more samples than the {expected} of {META_NAME}"
                            )
                        row = self.starts[index] + got - 1
                        if self.position is not None:
                            row = int(self.position[row])
                            if row < 0:  # not in this view: passed over, never decoded
                                continue
                        sample["__shard__"] = url
                        sample["__index__"] = row
                        yield sample
                finally:
                    with contextlib.suppress(OSError):
                        stream.close()
                if got < expected:
                    raise BadSampleError(url, f"truncated shard: {got} of its {expected} samples")
            except (BadSampleError, FileNotFoundError, ValueError) as exc:
                if self.on_bad_sample == "raise":
                    raise exc if isinstance(exc, BadSampleError) else BadSampleError(url, str(exc)) from exc
                where, problem = (
                    (exc.where, exc.problem) if isinstance(exc, BadSampleError) else (url, str(exc))
                )
                yield SkippedSample(where, problem, max(1, expected - got))

    def _decode(self, sample: dict[str, Any]) -> ShardItem | SkippedSample:
        where = f"{sample['__shard__']} sample {sample['__key__']}"
        try:
            if "cls" not in sample:
                raise BadSampleError(where, "has no .cls member (its label)")
            text = sample["cls"].decode("ascii", "replace").strip()
            if not text.isdigit():
                raise BadSampleError(where, f"label {text[:20]!r} is not a non-negative integer")
            key = sample["path"].decode("utf-8", "surrogateescape") if "path" in sample else sample["__key__"]
            if self.encoding == "npy":
                if "npy" not in sample:
                    raise BadSampleError(where, "has no .npy member")
                try:
                    array = np.load(io.BytesIO(sample["npy"]), allow_pickle=False)
                except (ValueError, OSError) as exc:
                    raise BadSampleError(where, f"corrupt .npy member ({exc})") from exc
                if array.dtype != self.dtype or (self.sample_shape and array.shape != self.sample_shape):
                    raise BadSampleError(
                        where,
                        f"holds {array.dtype} {list(array.shape)}, the metadata says {self.dtype} "
                        f"{list(self.sample_shape)}",
                    )
            else:
                ext = next((e for e in _IMAGE_EXTS if e in sample), None)
                if ext is None:
                    raise BadSampleError(where, "has no image member")
                array = decode_image(
                    sample[ext],
                    self.mode or "RGB",
                    self.image_size,  # type: ignore[arg-type]
                    where=f"{where}.{ext}",
                    expected=self.sample_shape,
                    gray_only=self.gray_only,
                )
            return ShardItem(array, int(text), key, int(sample["__index__"]))
        except BadSampleError as exc:
            if self.on_bad_sample == "raise":
                raise
            return SkippedSample(exc.where, exc.problem)

    def __iter__(self) -> Iterator[ShardItem | SkippedSample]:
        from webdataset import shuffle as buffer_shuffle

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.equal_per_rank:  # whole batches per worker: the rank's batch count ignores its workers
            steps = self.samples_per_rank // self.batch
            share = self.batch * (steps // workers + (1 if worker < steps % workers else 0))
        else:
            share = math.inf
        if share == 0:
            return
        done = 0
        for again, shards in enumerate(self._passes(worker, workers)):
            before = done
            stream: Iterator[Any] = self._raw_samples(shards)
            if self.shuffle and self.shuffle_buffer > 1:  # one pass at a time: passes never mix
                rng = random.Random(_seed_int(self.seed, self.epoch, self.rank, worker, again))
                stream = buffer_shuffle(self.shuffle_buffer, min(100, self.shuffle_buffer), rng=rng)(stream)
            for item in stream:
                yield item if isinstance(item, SkippedSample) else self._decode(item)
                done += 1
                if done >= share:
                    return
            if not self.equal_per_rank:
                return
            if again and done == before:
                raise ValueError(
                    f"{self.base}: rank {self.rank}'s shards of split {self.split!r} hold no samples"
                )


@dataclass
class ShardSplits:
    """What :func:`open_shards` returns: a :class:`ShardSamples` per split with its labels (in shard
    order, as written), the class names, the per-sample shape and dtype, and provenance."""

    splits: dict[str, ShardSamples]
    labels: dict[str, np.ndarray | None]
    class_names: list[str] | None
    sample_shape: tuple[int, ...]
    dtype: np.dtype
    kind: str
    info: dict[str, Any] = field(default_factory=dict)


def open_shards(
    spec: str | os.PathLike[str],
    *,
    seed: int = 0,
    shuffle_buffer: int = 1000,
    rank: int | None = None,
    world_size: int | None = None,
    on_bad_sample: str = "raise",
    read_labels: bool = True,
) -> ShardSplits:
    """Open the shard set at ``spec`` (a folder, URL, ``.tar`` or brace pattern; module doc).

    The training split shuffles (shards and a ``shuffle_buffer``, seeded by ``(seed, epoch)``) and
    yields an equal number of samples on every rank; validation and test splits are read in
    order, each sample once (split between ranks and workers). ``read_labels``: load every split's
    labels file (a few bytes a sample).
    """
    base, names = _locate(os.fspath(spec))
    meta = read_metadata(base)
    chosen: dict[str, list[str] | None] = {}
    for split, entry in meta["splits"].items():
        if names is None:
            chosen[split] = None
        else:
            own = [n for n in names if n in {s["name"] for s in entry["shards"]}]
            if own:
                chosen[split] = own
    listed = {n for split in meta["splits"].values() for n in (s["name"] for s in split["shards"])}
    if names is not None and (missing := [n for n in names if n not in listed]):
        raise ValueError(
            f"{spec}: shard(s) {', '.join(missing[:5])} are not listed in {_join(base, META_NAME)}"
        )
    if "train" not in chosen:
        raise ValueError(f"{spec}: no training shard among those named")
    splits = {
        split: ShardSamples(
            base, split, meta, shards=picked, seed=seed, shuffle=split == "train",
            shuffle_buffer=shuffle_buffer, rank=rank, world_size=world_size, on_bad_sample=on_bad_sample,
        )
        for split, picked in chosen.items()
    }  # fmt: skip
    labels: dict[str, np.ndarray | None] = {}
    for split, samples in splits.items():
        everything = _read_labels(base, split, meta["splits"][split]) if read_labels else None
        if everything is None or chosen[split] is None:
            labels[split] = everything
            continue
        offsets = {}  # a subset of the shards: their slices of the split's labels, in their order
        start = 0
        for s in meta["splits"][split]["shards"]:
            offsets[s["name"]] = (start, start + int(s["num_samples"]))
            start += int(s["num_samples"])
        labels[split] = np.concatenate([everything[slice(*offsets[n])] for n in samples.shards])
    info = {
        "source": os.fspath(spec),
        "shards": {split: len(s.shards) for split, s in splits.items()},
        "samples": {split: s.num_samples for split, s in splits.items()},
        "order": f"shards permuted by (seed={seed}, epoch), shuffle buffer {shuffle_buffer}; "
        "split by rank, then by DataLoader worker",
        "written_from": meta.get("source"),
    }
    return ShardSplits(
        splits, labels, meta.get("class_names"), tuple(meta["sample_shape"]), np.dtype(meta["dtype"]),
        meta.get("kind", "image"), info,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# writing


def _rows(x: Any) -> int:
    return len(x)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


class _SplitWriter:
    """Shards ``<split>-NNNNNN.tar`` of one split, each written under ``.tmp`` and renamed when
    closed; a new one starts at ``per_shard`` samples or ``max_bytes``."""

    def __init__(self, out: Path, split: str, per_shard: int, max_bytes: int) -> None:
        self.out, self.split, self.per_shard, self.max_bytes = out, split, per_shard, max_bytes
        self.shards: list[dict[str, Any]] = []
        self.writer: Any = None
        self.name, self.count, self.size = "", 0, 0

    def _finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
            os.replace(self.out / (self.name + ".tmp"), self.out / self.name)
            self.shards.append({"name": self.name, "num_samples": self.count, "bytes": self.size})
            self.writer = None

    def add(self, sample: dict[str, Any], nbytes: int) -> None:
        from webdataset import TarWriter

        if self.writer is None or self.count >= self.per_shard or self.size >= self.max_bytes:
            self._finish()
            self.name, self.count, self.size = f"{self.split}-{len(self.shards):06d}.tar", 0, 0
            self.writer = TarWriter(str(self.out / (self.name + ".tmp")), encoder=False, mtime=0)
        self.writer.write(sample)
        self.count += 1
        self.size += nbytes + 1536  # with the members' tar headers

    def close(self) -> list[dict[str, Any]]:
        self._finish()
        return self.shards


def write_shards(
    source: RawSplits | Mapping[str, tuple[Any, Any]],
    out_dir: str | os.PathLike[str],
    *,
    class_names: list[str] | None = None,
    samples_per_shard: int = 5000,
    max_shard_bytes: int = 256 * 2**20,
    overwrite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Pack a source's splits into WebDataset tar shards in ``out_dir``; returns the metadata path.

    ``source``: :class:`~marginkit.data.loaders.RawSplits` (its train / val / test) or a mapping
    ``split -> (x, y)``, ``x`` a :class:`~marginkit.data.samples.LazySamples` or an array
    ``[N, ...]``. A sample becomes ``<key>.<ext>`` (the encoded image bytes as the source's file
    stores them, when every row has them and one way to decode: JPEG / PNG stay compressed) or
    ``<key>.npy`` (the decoded row), ``<key>.cls`` (its label) and ``<key>.path`` (its path
    relative to the source's root); ``<split>-labels.npy`` and ``<split>-paths.json`` hold every
    sample's label and path in shard order (what evaluation and ``marginkit embed`` read). A shard
    closes at ``samples_per_shard`` samples or ``max_shard_bytes``. Shards are
    ``<split>-NNNNNN.tar``; :data:`META_NAME` is written last.
    ``overwrite``: replace a finished shard set in ``out_dir`` (its metadata is removed first).
    """
    from marginkit.data.folder import _progress

    if isinstance(source, RawSplits):
        parts = {"train": (source.x_train, source.y_train), "test": (source.x_test, source.y_test)}
        if source.x_val is not None:
            parts["val"] = (source.x_val, source.y_val)
        class_names = class_names if class_names is not None else source.class_names
        kind, origin = source.kind, source.info.get("source")
    else:
        parts, kind, origin = dict(source), None, None
    unknown = [s for s in parts if s not in _SIDES]
    if unknown or "train" not in parts:
        raise ValueError(f"splits must be train (required), val, test; got {', '.join(parts)}")
    if not _rows(parts["train"][0]):
        raise ValueError("the training split is empty: nothing to write")
    if samples_per_shard < 1 or max_shard_bytes < 1:
        raise ValueError("samples_per_shard and max_shard_bytes must be positive")
    out = Path(out_dir)
    meta_path = out / META_NAME
    if meta_path.exists():
        if not overwrite:
            raise FileExistsError(
                f"{meta_path}: a shard set is already here (pass overwrite=True to replace it)"
            )
        meta_path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    first = parts["train"][0]
    lazy = {s: isinstance(x, LazySamples) for s, (x, _) in parts.items()}
    params = {x.decode_params if lazy[s] else None for s, (x, _) in parts.items()}
    encoded = len(params) == 1 and None not in params
    mode, image_size, gray_only = params.pop() if encoded else (None, None, False)
    shapes = {tuple(x.shape[1:]) for x, _ in parts.values()}
    dtypes = {np.dtype(x.dtype) for x, _ in parts.values()}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ValueError(
            f"the splits differ in sample shape or dtype: {sorted(shapes)}, {sorted(map(str, dtypes))}"
        )
    meta: dict[str, Any] = {
        "format": _FORMAT,
        "version": _VERSION,
        "kind": kind or getattr(first, "kind", "image"),
        "sample_shape": list(shapes.pop()),
        "dtype": str(dtypes.pop()),
        "encoding": "encoded" if encoded else "npy",
        "mode": mode,
        "image_size": list(image_size) if image_size else None,
        "gray_only": bool(gray_only),
        "class_names": list(class_names) if class_names is not None else None,
        "source": origin,
        "splits": {},
    }
    total = sum(_rows(x) for x, _ in parts.values())
    bar = _progress(progress, f"writing shards to {out}")
    if bar is not None:
        bar.total = total
    try:
        for split in (s for s in _SIDES if s in parts and (s == "train" or _rows(parts[s][0]))):
            x, y = parts[split]
            labels = np.asarray(y)
            if labels.shape != (_rows(x),) or not np.issubdtype(labels.dtype, np.integer):
                raise ValueError(
                    f"split {split!r}: expected {_rows(x)} integer labels, got {labels.dtype} {labels.shape}"
                )
            writer = _SplitWriter(out, split, samples_per_shard, max_shard_bytes)
            paths_file = (out / f"{split}-paths.json").open("w", encoding="utf-8", errors="surrogateescape")
            try:
                paths_file.write("[")  # streamed: a million paths never sit in one Python list
                for i in range(_rows(x)):
                    if encoded:
                        data, ext = x.encoded(i)
                        ext = ext if ext in _IMAGE_EXTS else "img"
                    else:
                        data, ext = _npy_bytes(x.read(i) if lazy[split] else np.asarray(x[i])), "npy"
                    path = x.relative_path(i) if lazy[split] else f"{split}/{i}"
                    writer.add(
                        {
                            "__key__": f"{split}-{i:09d}",
                            ext: data,
                            "cls": str(int(labels[i])).encode(),
                            "path": path.encode("utf-8", "surrogateescape"),
                        },
                        len(data),
                    )
                    paths_file.write(("," if i else "") + json.dumps(path))
                    if bar is not None:
                        bar.update(1)
                paths_file.write("]\n")
            finally:
                shards = writer.close()
                paths_file.close()
            np.save(out / f"{split}-labels.npy", labels.astype(np.int64), allow_pickle=False)
            meta["splits"][split] = {
                "num_samples": int(_rows(x)),
                "labels": f"{split}-labels.npy",
                "paths": f"{split}-paths.json",
                "shards": shards,
            }
    finally:
        if bar is not None:
            bar.close()
    tmp = out / (META_NAME + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, meta_path)
    return meta_path
