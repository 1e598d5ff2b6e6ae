"""The loader policy: the only module that builds a ``torch.utils.data.DataLoader``.

Every split, in memory or streamed from disk, reaches the model through one :class:`Loader`:

- a map-style dataset (:class:`SplitDataset`) over the split's rows — a tensor in its source's
  dtype (``uint8`` images) or a lazy source (:class:`~marginkit.data.samples.LazySamples`). Its
  batched ``__getitems__`` is one gather for a tensor (in the training process: no worker, the
  speed of indexing the tensor directly) and ``read(i, rng)`` per row for a lazy source (in
  worker processes, which open their files themselves);
- a batch sampler: the seeded shuffled batches of class losses (:class:`ShuffledBatches`) or the
  P×K batches of pair losses (:class:`~marginkit.data.PKSampler`), wrapped by :class:`Batches`,
  which carries the epoch to the readers (the random crop of an audio row is drawn from a
  generator seeded with ``(seed, epoch, index)``: the same in any worker, after ``--resume``, and
  for any worker count) and, under data parallelism, keeps this rank's share of each batch, so a
  rank reads only its part and every rank takes the same number of steps;
- pinned host memory when the device is CUDA, and the next batches prefetched by the workers
  (:func:`marginkit.data.device.prefetched` keeps the next device copy in flight);
- ``on_bad_sample``: ``raise`` (a :class:`~marginkit.data.samples.BadSampleError` naming the file
  ends the run) or ``skip`` (the row is dropped from its batch and :attr:`Loader.skipped` counts it
  for the log and ``metrics.json``);
- a worker that dies (``kill -9``, the out-of-memory killer) or a read that hangs: torch raises
  ``DataLoader worker (pid X) is killed by signal`` / ``exited unexpectedly`` / ``timed out``
  (after :data:`READ_TIMEOUT` seconds), which :func:`worker_failure` recognises and the trainer
  turns into a clear error.

Workers: a streamed source gets :func:`default_workers` processes unless told (``--workers``);
in-memory tensors none (a gather in the training process is faster than any hand-over).
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from marginkit.data.samples import BAD_SAMPLE_POLICIES, BadSampleError, read_or_skip

__all__ = [
    "ON_BAD_SAMPLE",
    "READ_TIMEOUT",
    "Batch",
    "Batches",
    "FixedBatches",
    "Loader",
    "ShuffledBatches",
    "SplitDataset",
    "default_workers",
    "epoch_seed",
    "is_in_memory",
    "is_sequential",
    "release_free_memory",
    "worker_failure",
]

#: What a reader does with a sample it cannot decode (:func:`marginkit.data.samples.read_or_skip`).
ON_BAD_SAMPLE = BAD_SAMPLE_POLICIES
#: Seconds the training process waits for one batch from its workers before the run ends.
READ_TIMEOUT = 600.0
_MAX_DEFAULT_WORKERS = 8


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of ``epoch``'s batch order (one 32-bit word from ``(seed, epoch)``)."""
    return int(np.random.SeedSequence([int(seed), int(epoch), 0x6D6B]).generate_state(1)[0])


class ShuffledBatches:
    """Seeded shuffled mini-batches (drop-last, so BatchNorm never sees a batch of one)."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch = 0
        self.size = min(batch_size, n)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return max(1, self.n // self.size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        perm = torch.randperm(self.n, generator=g)
        for i in range(len(self)):
            yield perm[i * self.size : (i + 1) * self.size]


def release_free_memory() -> None:
    """Hand the allocator's free pages back to the operating system before workers are forked.

    A forked worker starts with every anonymous page of its parent in its resident set. glibc keeps
    the memory a process frees inside its heap (only the heap's top is returned by itself), so
    after a long training run most of the training process's heap can be free yet resident, and
    each worker forked then inherits it; its old copy stays in the worker once the parent reuses
    the page. Python's collector runs first, so that cycles free their memory too, then glibc's
    ``malloc_trim(0)``, which returns free pages anywhere in its heaps. A no-op without glibc.
    """
    import gc

    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None


def is_in_memory(data: Any) -> bool:
    """Whether ``data`` is an array held in memory (else a lazy source read row by row)."""
    return isinstance(data, (torch.Tensor, np.ndarray))


def default_workers(cores: int | None = None) -> int:
    """Worker processes for a streamed source: the available cores but the one the training
    process keeps, at least 1 and at most 8."""
    if cores is None:
        import os

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(_MAX_DEFAULT_WORKERS, int(cores) - 1))


class Request(NamedTuple):
    """What :class:`Batches` hands a reader: the rows of one batch (this rank's share), the
    epoch (``None`` at evaluation: no random draw) and the global batch's size."""

    epoch: int | None
    index: torch.Tensor
    total: int


class Batch(NamedTuple):
    """One batch as it leaves a reader: inputs in the source's dtype, int64 labels, the global
    batch's size, and where the rows skipped as bad came from (``on_bad_sample=skip``)."""

    x: torch.Tensor
    y: torch.Tensor
    total: int
    skipped: tuple[str, ...] = ()
    lease: tuple[int, int] | None = None  # (worker, slot) of a worker's reused buffer holding x


def _identity(batch: Batch) -> Batch:  # module level: workers pickle the collate function
    return batch


class _CollateItems:
    """A shard reader's items as one :class:`Batch`: stacked samples, ``y`` their rows in the
    view (the loader turns them into labels), skipped samples' places named."""

    def __init__(self, total: int, shape: tuple[int, ...], dtype: Any) -> None:
        self.total, self.shape, self.dtype = total, shape, dtype

    def __call__(self, items: list[Any]) -> Batch:
        kept = [it for it in items if hasattr(it, "sample")]
        skipped = tuple(f"{it.where}: {it.problem}" for it in items if not hasattr(it, "sample"))
        rows = torch.tensor([it.index for it in kept], dtype=torch.long)
        if not kept:
            empty = torch.from_numpy(np.empty((0, *self.shape), dtype=self.dtype))
            return Batch(empty, rows, self.total, skipped)
        return Batch(torch.from_numpy(np.stack([it.sample for it in kept])), rows, self.total, skipped)


def is_sequential(data: Any) -> bool:
    """Whether ``data`` is read front to back (a shard set's rows), not row by row."""
    return bool(getattr(data, "sequential", False))


class SplitDataset(Dataset):
    """One split as a map-style dataset: the rows of ``data`` with their ``labels``.

    ``data`` is a tensor (or numpy array) in the source's dtype, or a lazy source with
    ``read(i, rng)`` / ``where(i)`` (:class:`~marginkit.data.samples.LazySamples`).
    ``__getitems__`` takes a :class:`Request` and returns a :class:`Batch`.
    """

    def __init__(
        self, data: Any, labels: torch.Tensor, *, seed: int = 0, on_bad_sample: str = "raise"
    ) -> None:
        if on_bad_sample not in ON_BAD_SAMPLE:
            choices = ", ".join(ON_BAD_SAMPLE)
            raise ValueError(f"on_bad_sample must be one of {choices}, got {on_bad_sample!r}")
        self.data = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        if len(self.data) != len(self.labels):
            raise ValueError(f"{len(self.data)} samples but {len(self.labels)} labels; they must match")
        self.seed, self.on_bad_sample = int(seed), on_bad_sample
        # [workers, RING] flags in shared memory, 1 while the training process holds a worker's
        # batch buffer (:class:`Loader` sets it when it starts workers); None: a fresh buffer each
        self.ring_flags: torch.Tensor | None = None
        self._ring: tuple[int, dict[str, Any]] | None = None  # (pid, this process's buffers)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Batch:
        return self.__getitems__(Request(None, torch.tensor([int(i)]), 1))

    def __getitems__(self, request: Request) -> Batch:  # type: ignore[override]
        index = request.index
        if isinstance(self.data, torch.Tensor):
            # index_select, not data[index]: advanced indexing gathers a [256, 3, 64, 64] uint8
            # batch about 6x slower on the CPU (2.3 ms against 0.35 ms, one thread), in the main
            # process of every in-memory training step
            return Batch(self.data.index_select(0, index), self.labels.index_select(0, index), request.total)
        return self._read(request)

    def _read(self, request: Request) -> Batch:
        """Each row decoded and copied into the batch at once (a batch's worth of decoded rows
        held until one ``np.stack`` at the end costs fresh heap pages every batch)."""
        index = request.index.tolist()
        kept, skipped = [], []
        out: np.ndarray | None = None  # the batch, filled row by row
        rows: list[np.ndarray] | None = None  # rows of differing shapes: np.stack's error at the end
        x: torch.Tensor | None = None
        lease = None
        hwc = False  # the batch buffer holds [B, H, W, C] (x is its [B, C, H, W] view)
        # a generator per row only for a source that draws from it (images do not)
        draws = request.epoch is not None and getattr(self.data, "uses_rng", True)
        try:
            for i in index:
                rng = np.random.default_rng([self.seed, request.epoch, i]) if draws else None
                row = read_or_skip(self.data, i, rng, self.on_bad_sample)
                if row is None:
                    skipped.append(self.data.where(i))
                    continue
                if rows is None and out is None:
                    # a decoded image is a [C, H, W] view of Pillow's [H, W, C] pixels: the batch keeps
                    # that layout (a plain copy per row, not a transposing one); the training process
                    # gets the [B, C, H, W] view, made contiguous by its float conversion
                    hwc = (
                        row.ndim == 3
                        and not row.flags.c_contiguous
                        and row.transpose(1, 2, 0).flags.c_contiguous
                    )
                    shape = (len(index), *row.shape)
                    x, lease = self._batch_buffer(
                        shape if not hwc else (shape[0], *shape[2:], shape[1]), row.dtype
                    )
                    out = x.numpy()
                    x = x.permute(0, 3, 1, 2) if hwc else x
                if rows is None and (row.shape != x.shape[1:] or row.dtype != out.dtype):
                    rows = list(x[: len(kept)].numpy())
                if rows is not None:
                    rows.append(row)
                else:
                    out[len(kept)] = row.transpose(1, 2, 0) if hwc else row
                kept.append(i)
        except BaseException:
            self._give_back(lease)
            raise
        y: Any = self.labels[torch.tensor(kept, dtype=torch.long)]
        if torch.utils.data.get_worker_info() is not None:
            # a worker's labels travel inside its message: a tensor would be a second shared-memory
            # segment and file descriptor per batch (:meth:`Loader.epoch` makes it a tensor again)
            y = y.numpy()
        if x is None:
            empty = torch.empty((0, *getattr(self.data, "sample_shape", ())), dtype=_torch_dtype(self.data))
            return Batch(empty, y, request.total, tuple(skipped))
        if rows is not None:
            self._give_back(lease)
            return Batch(torch.from_numpy(np.stack(rows)), y, request.total, tuple(skipped))
        return Batch(x[: len(kept)], y, request.total, tuple(skipped), lease)

    def _batch_buffer(
        self, shape: tuple[int, ...], dtype: np.dtype
    ) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """An empty batch ``shape`` / ``dtype`` to fill, and the lease of the buffer it is in.

        In a ``DataLoader`` worker the batch is in shared memory (as torch's ``default_collate``
        makes it), so sending it passes a file descriptor rather than copying it into a new
        segment; and in one of the worker's :data:`RING` buffers that the training process has
        released (:func:`_leased`), since filling fresh shared pages costs more than the copy
        itself (the kernel zeroes every page). When none is free (a caller that keeps its
        batches) the batch gets a fresh segment: nothing waits, nothing is overwritten while the
        training process can still see it."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return torch.from_numpy(np.empty(shape, dtype=dtype)), None
        storage, lease = self._buffer(info.id, math.prod(shape) * np.dtype(dtype).itemsize)
        return torch.empty(0, dtype=_torch_dtype(np.empty(0, dtype))).set_(storage, 0, shape), lease

    def _give_back(self, lease: tuple[int, int] | None) -> None:
        if lease is not None and self.ring_flags is not None:
            _release(self.ring_flags, *lease)

    def _buffer(self, worker: int, nbytes: int) -> tuple[torch.UntypedStorage, tuple[int, int] | None]:
        flags = self.ring_flags
        if flags is None or not 0 <= worker < flags.shape[0]:
            return torch.UntypedStorage._new_shared(nbytes), None
        pid = os.getpid()
        if self._ring is None or self._ring[0] != pid:
            self._ring = (pid, {"next": 0, "buffers": [None] * flags.shape[1]})
        ring = self._ring[1]
        for _ in range(flags.shape[1]):
            slot = ring["next"]
            ring["next"] = (slot + 1) % flags.shape[1]
            if int(flags[worker, slot]) == 0:
                buffer = ring["buffers"][slot]
                if buffer is None or buffer.nbytes() < nbytes:
                    buffer = ring["buffers"][slot] = torch.UntypedStorage._new_shared(nbytes)
                flags[worker, slot] = 1
                return buffer, (worker, slot)
        return torch.UntypedStorage._new_shared(nbytes), None


#: Batch buffers each worker reuses: the batches in flight (``prefetch_factor`` 2), the one a
#: caller holds and the one :func:`~marginkit.data.device.prefetched` moves ahead, and a spare.
RING = 5


def _release(flags: torch.Tensor, worker: int, slot: int) -> None:
    flags[worker, slot] = 0


def _leased(x: torch.Tensor, flags: torch.Tensor | None, lease: Any) -> torch.Tensor:
    """``x`` (a worker's batch in one of its ring buffers) as a tensor whose last reference, when
    dropped, hands the buffer back to the worker: the tensor is made from a numpy view of ``x``
    with a finaliser, and every view or slice of it keeps that view alive."""
    if flags is None or lease is None:
        return x
    worker, slot = (int(v) for v in lease)
    view = x.numpy()
    weakref.finalize(view, _release, flags, worker, slot)
    return torch.from_numpy(view)


def _torch_dtype(data: Any) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=getattr(data, "dtype", np.uint8))).dtype


class Batches(Sampler):
    """A batch plan (an iterable of index batches with ``set_epoch``) as :class:`Request` s: the
    epoch carried along, and with ``share`` (``n -> slice``) only this rank's part of each batch."""

    def __init__(self, plan: Any, *, share: Callable[[int], slice] | None = None, epoch: bool = True) -> None:
        self.plan, self.share, self.with_epoch = plan, share, epoch
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if hasattr(self.plan, "set_epoch"):
            self.plan.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[Request]:
        epoch = self.epoch if self.with_epoch else None
        for idx in self.plan:
            idx = torch.as_tensor(idx, dtype=torch.long)
            total = int(idx.numel())
            yield Request(epoch, idx[self.share(total)] if self.share is not None else idx, total)


class FixedBatches:
    """Consecutive batches of ``size`` over ``index`` (the last one shorter): evaluation's order."""

    def __init__(self, index: torch.Tensor, size: int, *, drop_last: bool = False) -> None:
        self.index, self.size, self.drop_last = index, max(1, int(size)), drop_last

    def __len__(self) -> int:
        n = int(self.index.numel())
        return n // self.size if self.drop_last else -(-n // self.size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self)):
            yield self.index[i * self.size : (i + 1) * self.size]


def _unwrapped(exc: BadSampleError) -> BadSampleError:
    """A worker's :class:`BadSampleError` as the worker raised it (``where: problem``), without the
    traceback torch puts into the message of the copy it re-raises."""
    text = str(exc)
    if "Original Traceback" not in text:
        return exc
    last = [line for line in text.splitlines() if line.strip()][-1]
    name = f"{BadSampleError.__module__}.{BadSampleError.__name__}: "
    last = last.split(name, 1)[1] if name in last else last
    where, sep, problem = last.partition(": ")
    return BadSampleError(where, problem) if sep else BadSampleError(last)


class WorkerDied(RuntimeError):
    """A data-loading worker's connection closed mid-batch (torch reports most deaths itself)."""


class Loader:
    """The batches of one split: a ``DataLoader`` over :class:`SplitDataset` with ``plan``'s batches.

    Args:
        data, labels: the split (see :class:`SplitDataset`).
        plan: the batch plan (:class:`ShuffledBatches`, :class:`~marginkit.data.PKSampler`, or
            any iterable of index batches, with ``set_epoch`` when it depends on the epoch).
        device: where the batches go (pinned host memory when it is CUDA).
        workers: worker processes for a lazy source (``None``: :func:`default_workers`); an
            in-memory tensor is always gathered in the calling process.
        share: this rank's slice of a global batch of ``n`` (data parallelism), or ``None``.
        seed: the readers' seed (with the epoch and the row: the ``rng`` of ``read``).
        training: draw per-row generators (``False``: evaluation, ``rng=None``).
        on_bad_sample: ``raise`` or ``skip`` (:data:`ON_BAD_SAMPLE`).
        timeout: seconds to wait for one batch from the workers.
    """

    def __init__(
        self,
        data: Any,
        labels: torch.Tensor,
        plan: Any,
        *,
        device: torch.device | str = "cpu",
        workers: int | None = None,
        share: Callable[[int], slice] | None = None,
        seed: int = 0,
        training: bool = True,
        on_bad_sample: str = "raise",
        timeout: float = READ_TIMEOUT,
        limit: int | None = None,
    ) -> None:
        self.dataset = SplitDataset(data, labels, seed=seed, on_bad_sample=on_bad_sample)
        self.batches = Batches(plan, share=share, epoch=training)
        self.device = torch.device(device)
        self.lazy = not is_in_memory(self.dataset.data)
        if workers is not None and (isinstance(workers, bool) or int(workers) < 0):
            raise ValueError(f"workers must be a non-negative integer, got {workers!r}")
        self.workers = (default_workers() if workers is None else int(workers)) if self.lazy else 0
        if self.workers and multiprocessing.current_process().daemon:
            # a daemonic process (a job of compare --jobs / study's pool) may not start children:
            # it reads the rows itself
            self.workers = 0
        self.timeout = float(timeout)
        self.skipped: list[str] = []
        self._loader: DataLoader | None = None
        self._rows: torch.Tensor | None = None  # a shard reader's view rows -> the split's rows
        self._reader: Any = None
        self._nothing = False  # a shard source with no row to read (an empty split)
        if is_sequential(self.dataset.data):
            if len(self.dataset) == 0 or (isinstance(plan, FixedBatches) and not plan.index.numel()):
                self._nothing = True
            else:
                self._reader = self._shard_reader(plan, share, training, limit)

    def _shard_reader(
        self, plan: Any, share: Callable[[int], slice] | None, training: bool, limit: int | None
    ) -> Any:
        """The :class:`~marginkit.data.shards.ShardSamples` that reads a shard source's batches:
        in training ``plan`` must be seeded shuffled batches (their size; the order is the
        shards' own), at evaluation consecutive batches over any rows (read in shard order)."""
        data = self.dataset.data
        options = {"seed": self.dataset.seed, "on_bad_sample": self.dataset.on_bad_sample}
        if isinstance(plan, ShuffledBatches):
            total = plan.size
            if share is not None:  # this rank reads its share of every global batch from its own shards
                part = share(total)
                rank, world = _rank_and_world()
                options.update(batch=part.stop - part.start, rank=rank, world_size=world)
            else:
                options.update(batch=total)
            self.total = total
            return data.reader(training=True, limit=limit, **options)
        if isinstance(plan, FixedBatches) and not training:
            index = plan.index
            if not torch.equal(index, torch.arange(len(data))):
                data = data[index.numpy()]
                self._rows = index
            self.total = plan.size
            self._drop_last = plan.drop_last
            return data.reader(training=False, batch=plan.size, **options)
        raise ValueError(
            f"{getattr(data, 'spec', 'a shard set')}: shard sources are read in seeded shuffled batches "
            "(class-level losses) or in order (evaluation); the P×K batches of pair losses need a "
            "source read row by row (folder:, csv:, rec:, npz:), or pack the pairs' classes into it"
        )

    def __len__(self) -> int:
        if self._nothing:
            return 0
        if self._reader is not None:
            if self._reader.equal_per_rank:
                return self._reader.samples_per_rank // self._reader.batch
            return self._reader.batches_per_epoch(max(1, self.workers), drop_last=self._drop_last)
        return len(self.batches)

    _drop_last = True

    def _dataloader(self) -> DataLoader:
        if self._loader is None and self.workers > 0:
            release_free_memory()  # the workers forked next inherit less of this process
        if self._loader is None and self._reader is not None:
            reader = self._reader
            self._loader = DataLoader(
                reader,
                batch_size=reader.batch,
                collate_fn=_CollateItems(self.total, tuple(reader.sample_shape), reader.dtype),
                num_workers=self.workers,
                pin_memory=self.device.type == "cuda",
                # not persistent: the epoch (the shards' order) reaches the workers when they start
                persistent_workers=False,
                timeout=self.timeout if self.workers > 0 else 0,
                prefetch_factor=2 if self.workers > 0 else None,
                drop_last=self._drop_last,
                generator=torch.Generator().manual_seed(self.dataset.seed),
            )
        if self._loader is None:
            if self.workers > 0:
                self.dataset.ring_flags = torch.zeros((self.workers, RING), dtype=torch.int32).share_memory_()
            self._loader = DataLoader(
                self.dataset,
                batch_sampler=self.batches,
                collate_fn=_identity,
                num_workers=self.workers,
                pin_memory=self.device.type == "cuda",
                persistent_workers=self.workers > 0,
                timeout=self.timeout if self.workers > 0 else 0,
                prefetch_factor=2 if self.workers > 0 else None,
                # the workers' base seed from its own generator: iterating never draws from torch's
                # global one (the run's random stream, checkpointed); readers draw from (seed, epoch, row)
                generator=torch.Generator().manual_seed(self.dataset.seed),
            )
        return self._loader

    def epoch(self, epoch: int = 0) -> Iterator[Batch]:
        """The batches of ``epoch`` (host tensors in the source's dtype, pinned for CUDA)."""
        self.batches.set_epoch(epoch)
        if self._nothing:
            return
        if self._reader is not None:
            self._reader.set_epoch(epoch)
        batches = iter(self._dataloader())
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (EOFError, ConnectionError) as exc:  # a worker killed while it sent a batch
                raise WorkerDied(f"DataLoader worker exited unexpectedly: its pipe closed ({exc!r})") from exc
            except BadSampleError as exc:  # a worker's: torch wrapped its traceback into the message
                raise _unwrapped(exc) from None
            pinned = self._loader is not None and self._loader.pin_memory
            if isinstance(batch.y, np.ndarray):  # a worker's labels (SplitDataset._read)
                y = torch.from_numpy(batch.y)
                batch = batch._replace(y=y.pin_memory() if pinned else y)
            if batch.lease is not None:  # the worker may reuse its buffer once x is dropped
                flags = self.dataset.ring_flags
                if pinned and flags is not None:
                    _release(flags, *(int(v) for v in batch.lease))  # x is already a pinned copy
                    batch = batch._replace(lease=None)
                else:
                    batch = batch._replace(x=_leased(batch.x, flags, batch.lease), lease=None)
            if batch.skipped:
                self.skipped.extend(batch.skipped)
            if self._reader is not None:  # rows of the view -> rows of the split -> labels
                rows = batch.y if self._rows is None else self._rows[batch.y]
                batch = batch._replace(y=self.dataset.labels[rows])
            yield batch

    def close(self) -> None:
        """Stop the worker processes (they stop too when the loader is garbage-collected)."""
        loader, self._loader = self._loader, None
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def evaluation_loader(
    data: Any,
    labels: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device | str = "cpu",
    workers: int | None = None,
    on_bad_sample: str = "raise",
    rows: torch.Tensor | None = None,
    drop_last: bool = False,
) -> Loader:
    """A :class:`Loader` over ``rows`` (default: all) of a split in order, ``batch_size`` at a
    time, without random draws (evaluation, embedding, prediction, batch-norm statistics)."""
    index = torch.arange(len(labels)) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    return Loader(
        data, labels, FixedBatches(index, batch_size, drop_last=drop_last), device=device, workers=workers,
        training=False, on_bad_sample=on_bad_sample,
    )  # fmt: skip


def read_all(
    data: Any, *, workers: int | None = None, on_bad_sample: str = "raise", batch_size: int = 256,
    progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[str]]:  # fmt: skip
    """Decode every row of a lazy source into one array (the in-memory path of a small source).

    Returns ``(array [N', *sample_shape] in the source's dtype, kept row indices [N'] ascending,
    skipped)``, the array's rows in row order; ``N' < N`` only with ``on_bad_sample="skip"``.
    ``progress(n)`` is called with the rows done.
    """
    n = len(data)
    labels = torch.arange(n)
    loader = evaluation_loader(
        data, labels, batch_size=batch_size, workers=workers, on_bad_sample=on_bad_sample
    )
    shape = tuple(int(s) for s in getattr(data, "sample_shape", ()))
    out: np.ndarray | None = None
    filled = np.zeros(n, dtype=bool)
    done = 0
    try:
        for batch in loader.epoch():
            x, rows = batch.x.numpy(), batch.y.numpy()
            if out is None:
                out = np.empty((n, *(shape or x.shape[1:])), dtype=x.dtype)
            out[rows] = x  # by row: a shard source delivers its rows in shard order
            filled[rows] = True
            done += len(x)
            if progress is not None:
                progress(done)
    finally:
        loader.close()
    if out is None:
        out = np.empty((0, *shape), dtype=getattr(data, "dtype", np.uint8))
        return out, np.zeros(0, dtype=np.int64), loader.skipped
    index = np.flatnonzero(filled)
    return (out if index.size == n else out[index]), index, loader.skipped


def _rank_and_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_WORKER_FAILURES = ("DataLoader worker (pid", "DataLoader timed out after")


def worker_failure(exc: BaseException) -> str | None:
    """What happened, if ``exc`` is torch's report of a data-loading worker that died or stalled
    (``None`` otherwise)."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if not isinstance(exc, WorkerDied) and not any(marker in text for marker in _WORKER_FAILURES):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "timed out" in first:
        return f"a data-loading worker sent no batch for {READ_TIMEOUT:g} s ({first})"
    return (
        f"a data-loading worker process died ({first}); the likely causes are the out-of-memory "
        "killer (fewer --workers or a smaller batch_size) or a signal sent to it"
    )
