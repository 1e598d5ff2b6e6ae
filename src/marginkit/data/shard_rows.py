"""``wds:DIR`` as a data source: a shard set's rows behind the array-like interface of every source.

:class:`ShardRows` numbers the samples of a shard set (:mod:`marginkit.data.shards`) once, its
splits one after another (train, val, test, each in shard order), and behaves like the other
lazy sources (:class:`~marginkit.data.samples.LazySamples`): views select rows (a class-disjoint
split, a validation carve-out, ``train_per_class``) without reading anything, views of one set
concatenate into one view, and each row has its label, file name and relative path. What differs
is how rows are read: a tar shard is read front to back, so a view is never read row by row
(:meth:`read` refuses) but streamed by :meth:`reader` — a
:class:`~marginkit.data.shards.ShardSamples` over the shards that hold the view's rows, passing
over the samples outside the view undecoded and naming each sample it yields by its row in the
view. :class:`~marginkit.data.loading.Loader` builds it for training (shards permuted by
``(seed, epoch)``, a shuffle buffer, an equal number of whole batches per rank) and evaluation
(every row once, placed by its number).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from marginkit.data.samples import LazySamples
from marginkit.data.shards import ShardSamples, ShardSplits

__all__ = ["ShardRows", "read_shard_source"]

_ORDER = ("train", "val", "test")


class ShardRows(LazySamples):
    """The rows of an opened shard set (see the module doc); built by :func:`read_shard_source`."""

    #: Read front to back by :meth:`reader`, never one row at a time.
    sequential = True

    def __init__(self, opened: ShardSplits, spec: str, *, shuffle_buffer: int = 1000) -> None:
        super().__init__()
        self.spec = spec
        self.names = [s for s in _ORDER if s in opened.splits]
        self.parts = [opened.splits[s] for s in self.names]
        self._starts = np.cumsum([0] + [p.num_samples for p in self.parts]).astype(np.int64)
        self.kind = opened.kind
        self.sample_shape = tuple(opened.sample_shape)
        self.dtype = np.dtype(opened.dtype)
        self.shuffle_buffer = int(shuffle_buffer)

    def split_rows(self, name: str) -> np.ndarray:
        """The keys of split ``name`` (empty when the set has none)."""
        if name not in self.names:
            return np.zeros(0, dtype=np.int64)
        i = self.names.index(name)
        return np.arange(self._starts[i], self._starts[i + 1], dtype=np.int64)

    def _part(self, key: int) -> tuple[int, int]:
        p = int(np.searchsorted(self._starts, key, side="right")) - 1
        return p, key - int(self._starts[p])

    def _num_keys(self) -> int:
        return int(self._starts[-1])

    def _read_key(self, key: int, rng: np.random.Generator | None) -> np.ndarray:
        raise TypeError(
            f"{self.spec}: a shard set is read front to back by the data loader "
            "(marginkit.data.loading.Loader), not one sample at a time"
        )

    def _where_key(self, key: int) -> str:
        p, i = self._part(key)
        return f"{self.parts[p].base} ({self.names[p]} sample {i})"

    def _relative_key(self, key: int) -> str:
        p, i = self._part(key)
        return self.parts[p].relative_path(i)

    def reader(
        self,
        *,
        seed: int = 0,
        training: bool = True,
        batch: int = 1,
        limit: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        on_bad_sample: str = "raise",
    ) -> ShardSamples:
        """A :class:`~marginkit.data.shards.ShardSamples` yielding this view's rows, each item's
        ``index`` its row in the view. ``training``: shuffled, an equal number of whole
        ``batch`` es on each of ``world_size`` ranks (``limit``: at most that many rows a rank);
        otherwise every row once, in shard order, by one rank."""
        keys = self.keys
        position = np.full(self._num_keys(), -1, dtype=np.int64)
        position[keys] = np.arange(len(keys), dtype=np.int64)
        used = [
            i for i in range(len(self.parts)) if (position[self._starts[i] : self._starts[i + 1]] >= 0).any()
        ]
        if not used:
            raise ValueError(f"{self.spec}: the view holds no rows to read")
        joined = ShardSamples.joined([self.parts[i] for i in used])
        selected = np.concatenate([position[self._starts[i] : self._starts[i + 1]] for i in used])
        if training:
            return joined.configured(
                seed=seed, shuffle=True, shuffle_buffer=self.shuffle_buffer, equal_per_rank=True,
                rank=rank, world_size=world_size, batch=batch, limit=limit, on_bad_sample=on_bad_sample,
                position=selected,
            )  # fmt: skip
        return joined.configured(
            seed=seed, shuffle=False, equal_per_rank=False, rank=0, world_size=1, batch=batch, limit=None,
            on_bad_sample=on_bad_sample, position=selected,
        )  # fmt: skip


def read_shard_source(spec: str, *, shuffle_buffer: int = 1000) -> dict[str, Any]:
    """Open ``wds:`` ``spec``'s shard set: its rows (:class:`ShardRows`) with every split's keys,
    labels and class names, as :func:`marginkit.data.datasets.load_dataset` splits them."""
    from marginkit.data.shards import open_shards

    if isinstance(shuffle_buffer, bool) or int(shuffle_buffer) < 0:
        raise ValueError(f"shuffle_buffer must be a non-negative integer, got {shuffle_buffer!r}")
    opened = open_shards(spec, shuffle_buffer=int(shuffle_buffer), rank=0, world_size=1)
    rows = ShardRows(opened, spec, shuffle_buffer=int(shuffle_buffer))
    labels = {}
    for name in rows.names:
        y = opened.labels.get(name)
        if y is None:
            raise ValueError(f"{spec}: split {name!r} has no labels file")
        labels[name] = np.asarray(y, dtype=np.int64)
    return {"rows": rows, "labels": labels, "class_names": opened.class_names, "info": opened.info}
