"""Batch samplers for pair losses: P classes × K samples per batch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["PKSampler"]


def _label_array(labels: Any) -> np.ndarray:
    """Return ``labels`` as a 1-D int64 numpy array or raise naming ``labels``."""
    if isinstance(labels, torch.Tensor):
        if labels.dtype == torch.bool or torch.is_floating_point(labels) or torch.is_complex(labels):
            raise TypeError(f"labels must hold integer class ids, got a tensor of dtype {labels.dtype}")
        array = labels.detach().cpu().numpy()
    elif isinstance(labels, np.ndarray):
        array = labels
    elif isinstance(labels, Sequence) and not isinstance(labels, (str, bytes)):
        if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in labels):
            raise TypeError("labels must hold integer class ids; the list contains a non-integer")
        array = np.asarray(labels, dtype=np.int64)
    else:
        raise TypeError(
            f"labels must be a 1-D torch.Tensor, numpy array or list of ints, got {type(labels).__name__}"
        )
    if array.dtype.kind not in "iu":
        raise TypeError(f"labels must hold integer class ids, got an array of dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"labels must be 1-D (one class id per sample), got shape {tuple(array.shape)}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError("labels must fit in int64")
    return array.astype(np.int64, copy=False)


def _int_arg(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _max_batches(chunks_per_class: np.ndarray, classes_per_batch: int) -> int:
    """Largest ``B`` such that ``B`` batches of ``P`` distinct classes fit the chunk counts.

    A class contributes at most one chunk per batch, so ``B`` batches are possible exactly when
    ``sum_c min(m_c, B) >= B * P`` (necessity is clear; sufficiency is the column construction of
    :class:`PKSampler`). ``h(B) = sum_c min(m_c, B) - B P`` is concave with ``h(0) = 0``, so the
    feasible ``B`` form an interval ``[0, B*]`` and a binary search finds ``B*``.
    """
    m = np.asarray(chunks_per_class, dtype=np.int64)
    lo, hi = 0, int(m.sum()) // classes_per_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(np.minimum(m, mid).sum()) >= mid * classes_per_batch:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PKSampler:
    r"""Batch sampler: every batch holds exactly ``P`` distinct classes × ``K`` samples each.

    Use it as ``DataLoader(dataset, batch_sampler=PKSampler(labels, P, K))``; each batch is a list
    of ``P * K`` dataset indices laid out class by class (``batch[j*K:(j+1)*K]`` share one label).

    **Scheme** (one epoch, all randomness from ``numpy.random.default_rng([seed, epoch])``):

    1. *Chunks.* Each class's ``n_c`` indices are shuffled and cut into
       ``m_c = ceil(n_c / K)`` chunks of ``K``; position ``p`` of the class's chunk sequence takes
       permuted sample ``p mod n_c``. So the last, partial chunk is topped up with the class's
       first (random) samples — distinct from those already in that chunk — and a class with
       ``n_c < K`` repeats its samples cyclically (each ``floor(K/n_c)`` or ``ceil(K/n_c)`` times).
    2. *Number of batches.* ``B`` is the largest number with ``sum_c min(m_c, B) >= B P``: the most
       batches of ``P`` distinct classes any arrangement of these chunks allows. It depends only on
       the class sizes, so ``len()`` is the same every epoch. A class with more than ``B`` chunks
       keeps its first ``B`` (the partial one is dropped first); of the rest, the ``E < P`` chunks
       beyond ``B P`` are dropped at the end of the class order below.
    3. *Grouping with distinct classes.* The kept chunks are laid out class by class in a random
       class order and cut into ``P`` rows of length ``B``; batch ``b`` takes one chunk per row.
       Row ``i`` sends its column ``t`` to batch ``sigma_i(t)``, where each ``sigma_i`` is a random
       permutation — independent across rows except that a class split across the end of row
       ``i - 1`` and the start of row ``i`` is kept out of batches it already occupies (possible
       because a class has at most ``B`` chunks). Hence every batch holds ``P`` distinct classes,
       and a class's chunks land in uniformly random batches, so class co-occurrences mix well.
    4. *Replicas.* Every replica builds the same epoch plan; replica ``r`` takes batches
       ``r, r + R, r + 2R, ...``, the first ``B // R`` of them. The ``B mod R`` leftover batches are
       dropped (never duplicated), so replicas get disjoint batches and equal counts.

    **Guarantees.** Exactly ``P`` distinct classes × ``K`` samples per batch. Sampling with
    replacement happens only inside classes smaller than ``K``; a batch without such classes has
    ``P K`` distinct indices. In an epoch each sample appears at most once, except (a) the
    ``K - (n_c mod K)`` top-up samples of a class whose size is not a multiple of ``K`` (at most
    twice) and (b) the cyclic repeats of classes smaller than ``K``. Every sample is visited except
    those of chunks dropped in step 2 (only needed when some class has more than ``B`` chunks,
    i.e. the data are too imbalanced for ``P`` distinct classes per batch, plus fewer than ``P``
    chunks) and of the ``B mod R`` leftover batches. The plan is a pure function of
    ``(labels, P, K, seed, epoch)``; ``len()`` equals the number of batches yielded.

    Call :meth:`set_epoch` before each epoch (as with ``DistributedSampler``): iterating twice
    without it yields the same batches.

    Args:
        labels: ``[N]`` integer class ids (torch tensor, numpy array or list); any integers.
        classes_per_batch: ``P`` with ``1 <= P <=`` number of distinct classes.
        samples_per_class: ``K >= 1``.
        seed: non-negative int; with the epoch it fixes the plan.
        num_replicas: number of data-parallel processes ``R`` (e.g. the world size).
        rank: this process's replica in ``[0, R)``.

    Example:
        >>> sampler = PKSampler([0, 0, 0, 1, 1, 2, 2, 2, 2], classes_per_batch=2, samples_per_class=2)
        >>> len(sampler), [len(b) for b in sampler]
        (2, [4, 4])

    Epoch construction is vectorised (one sort of ``N`` keys, a loop over the ``P`` rows only).
    """

    def __init__(
        self,
        labels: Any,
        classes_per_batch: int,
        samples_per_class: int,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        label_array = _label_array(labels)
        classes, inverse, counts = np.unique(label_array, return_inverse=True, return_counts=True)
        num_classes = len(classes)
        p = _int_arg(classes_per_batch, "classes_per_batch", 1)
        if p > num_classes:
            raise ValueError(
                f"classes_per_batch must be <= the number of distinct classes in labels "
                f"({num_classes}), got {p}"
            )
        k = _int_arg(samples_per_class, "samples_per_class", 1)
        self.seed = _int_arg(seed, "seed", 0)
        replicas = _int_arg(num_replicas, "num_replicas", 1)
        r = _int_arg(rank, "rank", 0)
        if r >= replicas:
            raise ValueError(f"rank must lie in [0, num_replicas={replicas}), got {r}")

        self.classes_per_batch = p
        self.samples_per_class = k
        self.num_replicas = replicas
        self.rank = r
        self.epoch = 0
        self.classes = classes
        self._inverse = inverse.astype(np.int64).reshape(-1)
        self._counts = counts.astype(np.int64)
        self._offsets = np.concatenate(([0], np.cumsum(self._counts)[:-1]))
        self._chunks = -(-self._counts // k)
        self.total_batches = _max_batches(self._chunks, p)
        self._len = self.total_batches // replicas
        if self._len == 0:
            raise ValueError(
                f"num_replicas={replicas} is more than the {self.total_batches} batch(es) of "
                f"{p} classes × {k} samples these labels allow per epoch"
            )
        # Bits left for the random part of the per-sample sort key (class id in the high bits).
        self._key_bits = 62 - max(1, int(num_classes).bit_length())

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def batch_size(self) -> int:
        return self.classes_per_batch * self.samples_per_class

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose plan the next iteration yields (same on every replica)."""
        self.epoch = _int_arg(epoch, "epoch", 0)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches(self.epoch)
        yield from batches[self.rank : self._len * self.num_replicas : self.num_replicas].tolist()

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """All replicas' batches of ``epoch`` as an int64 array ``[total_batches, P * K]``."""
        epoch = _int_arg(epoch, "epoch", 0)
        rng = np.random.default_rng([self.seed, epoch])
        p, k, b = self.classes_per_batch, self.samples_per_class, self.total_batches
        counts, offsets = self._counts, self._offsets

        # 1. Per-class random permutation: sort by (class, random key) in one int64 sort.
        rand = rng.integers(0, 1 << self._key_bits, size=self._inverse.size, dtype=np.int64)
        perm = np.argsort((self._inverse << self._key_bits) | rand)

        # 2. Chunk runs in a random class order, each class capped at B chunks, cut to B * P.
        order = rng.permutation(self.num_classes)
        runs = np.minimum(self._chunks, b)[order]
        run_starts = np.cumsum(runs) - runs
        seq_class = np.repeat(order, runs)[: b * p]
        seq_start = np.repeat(run_starts, runs)[: b * p]
        seq_end = seq_start + np.repeat(runs, runs)[: b * p]
        seq_j = np.arange(b * p) - seq_start

        # 3. Rows of length B; row i sends column t to batch sigma[i, t]. A class that wraps from
        #    the end of row i-1 (columns s..B-1) into row i (columns 0..w-1, w <= s) must avoid the
        #    batches sigma[i-1, s:], so its batches are drawn from sigma[i-1, :s].
        sigma = np.empty((p, b), dtype=np.int64)
        sigma[0] = rng.permutation(b)
        for i in range(1, p):
            head = i * b
            if seq_start[head] < head:  # the run at the start of row i began in row i-1
                s = int(seq_start[head]) - (i - 1) * b  # >= 1 since runs are at most B long
                w = min(int(seq_end[head]), head + b) - head  # <= s for the same reason
                chosen = rng.permutation(sigma[i - 1, :s])[:w]
                free = np.ones(b, dtype=bool)
                free[chosen] = False
                sigma[i, :w] = chosen
                sigma[i, w:] = rng.permutation(np.flatnonzero(free))
            else:
                sigma[i] = rng.permutation(b)
        position = np.empty((b, p), dtype=np.int64)
        position[sigma, np.arange(p)[:, None]] = np.arange(p * b).reshape(p, b)

        # 4. Expand chunks to sample indices: chunk j of class c holds permuted samples
        #    (j*K + t) mod n_c, t < K.
        cls = seq_class[position]  # [B, P]
        within = seq_j[position][..., None] * k + np.arange(k)  # [B, P, K]
        within %= counts[cls][..., None]
        return perm[offsets[cls][..., None] + within].reshape(b, p * k)

    def __repr__(self) -> str:
        return (
            f"PKSampler(num_samples={self._inverse.size}, num_classes={self.num_classes}, "
            f"classes_per_batch={self.classes_per_batch}, samples_per_class={self.samples_per_class}, "
            f"seed={self.seed}, num_replicas={self.num_replicas}, rank={self.rank}, "
            f"batches={self._len})"
        )
