"""Stratified, seeded index selection: per-class subsets and held-out shares.

Used by :func:`marginkit.data.load_dataset` (validation carving, ``train_per_class``) and by
the file readers of :mod:`marginkit.data.loaders` (test splits of ``folder:`` and
``features:``); it sits below both so that neither imports the other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from marginkit._validation import positive_float, positive_int

__all__ = ["stratified_split", "stratified_subset"]


def _labels_numpy(labels: Any, name: str = "labels") -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{name} must be a 1-D integer array, got shape {list(labels.shape)} dtype {labels.dtype}"
        )
    return labels


def _class_ranks(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random order within each class: returns (order, rank in class, class index of order)."""
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    sorted_labels = labels[order]
    _, first, inverse = np.unique(sorted_labels, return_index=True, return_inverse=True)
    rank = np.arange(len(labels)) - first[inverse]
    return order, rank, inverse


MAX_SEED = 2**63 - 1  # the range of TrainConfig.seed, and of torch's generators


def _seed(seed: Any, name: str = "seed") -> int:
    seed = positive_int(seed, name, minimum=0)
    if seed > MAX_SEED:
        raise ValueError(f"{name} must be <= 2**63 - 1, got {seed}")
    return seed


def stratified_subset(labels: Any, per_class: int, *, seed: int = 0) -> torch.Tensor:
    """Indices of ``min(per_class, n_c)`` samples drawn at random from every class ``c``.

    A class with fewer than ``per_class`` samples keeps all of them (nothing is repeated).
    Seeded and deterministic; the subsets are *nested*: for a fixed seed the subset for
    ``per_class = k`` is contained in the one for ``k + 1``. Vectorised (one permutation and
    one stable sort, no loop over classes).

    Args:
        labels: ``[N]`` integer labels (tensor or array, any integer values).
        per_class: samples to keep per class (``>= 1``).
        seed: non-negative seed.

    Returns:
        ``[M]`` int64 indices into ``labels``, ascending.

    Example:
        >>> idx = stratified_subset(torch.tensor([0, 0, 0, 1, 1, 2]), 2, seed=0)
        >>> torch.bincount(torch.tensor([0, 0, 0, 1, 1, 2])[idx]).tolist()
        [2, 2, 1]
    """
    labels = _labels_numpy(labels)
    per_class = positive_int(per_class, "per_class")
    return torch.from_numpy(_subset_indices(labels, per_class, np.random.default_rng(_seed(seed))))


def _subset_indices(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    if len(labels) == 0:
        return np.empty(0, dtype=np.int64)
    order, rank, _ = _class_ranks(labels, rng)
    return np.sort(order[rank < per_class]).astype(np.int64)


def stratified_split(labels: Any, fraction: float, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Split indices into ``(kept, held_out)`` with a ``fraction`` of every class held out.

    Class ``c`` with ``n_c`` samples gives ``min(round(fraction * n_c), n_c - 1)`` samples to
    ``held_out`` (halves round up): a class is never moved out entirely, and a class too
    small for its share to round to one sample stays whole in ``kept``. Seeded, vectorised.

    Args:
        labels: ``[N]`` integer labels.
        fraction: in ``[0, 1)``.
        seed: non-negative seed.

    Returns:
        Two ascending int64 index tensors that partition ``range(N)``.
    """
    labels = _labels_numpy(labels)
    fraction = positive_float(fraction, "fraction", allow_zero=True)
    if fraction >= 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    kept, held = _split_indices(labels, fraction, np.random.default_rng(_seed(seed)))
    return torch.from_numpy(kept), torch.from_numpy(held)


def _split_indices(
    labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    if len(labels) == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    order, rank, inverse = _class_ranks(labels, rng)
    counts = np.bincount(inverse)
    held = np.minimum(np.floor(fraction * counts + 0.5).astype(np.int64), counts - 1)
    out = rank < held[inverse]
    return np.sort(order[~out]).astype(np.int64), np.sort(order[out]).astype(np.int64)
