"""A FIFO memory bank of past embeddings and labels (cross-batch memory) for pair losses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from marginkit._validation import float_tensor, label_tensor, positive_int, same_batch

__all__ = ["MemoryBank"]


class MemoryBank:
    r"""Ring buffer of the last ``size`` detached embeddings and their labels.

    Pair losses take the bank's contents as the reference set (``ref_embeddings``/``ref_labels``),
    so each query batch meets ``size`` past embeddings as extra positives and negatives — the
    cross-batch memory of Wang et al., *Cross-Batch Memory for Embedding Learning* (CVPR 2020).
    Entries are detached: no gradient flows into the past.

    Storage is allocated on the first :meth:`update`, on that batch's device and in its dtype
    (or in ``dtype`` when given); later batches are cast to that dtype and must live on the same
    device. :meth:`update` is a single vectorised scatter: a batch of ``n`` rows overwrites the
    ``n`` oldest entries (wrapping around the end of the buffer); when ``n > size`` only its last
    ``size`` rows are kept, exactly as if the rows had been inserted one by one.

    Shape:
        - ``update(embeddings [n, dim], labels [n])``
        - ``get() -> (embeddings [len(self), dim], labels [len(self)])``, oldest first.

    Args:
        size: capacity (number of embeddings kept), ``>= 1``.
        dim: embedding dimension, ``>= 1``.
        dtype: storage dtype; ``None`` keeps the first batch's floating dtype.

    Example:
        >>> bank = MemoryBank(size=4, dim=2)
        >>> bank.update(torch.ones(3, 2), torch.tensor([0, 1, 2]))
        >>> bank.update(torch.zeros(2, 2), torch.tensor([3, 4]))
        >>> emb, lab = bank.get()
        >>> len(bank), lab.tolist()
        (4, [1, 2, 3, 4])
    """

    def __init__(self, size: int, dim: int, dtype: torch.dtype | None = None) -> None:
        self.size = positive_int(size, "size")
        self.dim = positive_int(dim, "dim")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
        self._requested_dtype = dtype
        self._embeddings: torch.Tensor | None = None
        self._labels: torch.Tensor | None = None
        self._next = 0  # slot the next row is written to (= oldest entry once full)
        self._count = 0

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device | None:
        """Device of the storage, ``None`` before the first update."""
        return None if self._embeddings is None else self._embeddings.device

    @property
    def dtype(self) -> torch.dtype | None:
        """Storage dtype, ``None`` before the first update unless given at construction."""
        return self._requested_dtype if self._embeddings is None else self._embeddings.dtype

    @property
    def is_full(self) -> bool:
        return self._count == self.size

    def __len__(self) -> int:
        return self._count

    # ------------------------------------------------------------------ updates
    @torch.no_grad()
    def update(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Append a batch (detached), evicting the oldest entries when full."""
        float_tensor(embeddings, "embeddings", min_dim=2)
        if embeddings.dim() != 2 or embeddings.shape[1] != self.dim:
            raise ValueError(f"embeddings must have shape [n, dim={self.dim}], got {tuple(embeddings.shape)}")
        label_tensor(labels, "labels")
        if labels.dim() != 1:
            raise ValueError(f"labels must be 1-D, got shape {tuple(labels.shape)}")
        same_batch(embeddings, "embeddings", labels, "labels")
        if self._embeddings is None:
            dtype = self._requested_dtype or embeddings.dtype
            self._embeddings = torch.zeros(self.size, self.dim, dtype=dtype, device=embeddings.device)
            self._labels = torch.zeros(self.size, dtype=torch.int64, device=embeddings.device)
        elif embeddings.device != self._embeddings.device:
            raise ValueError(
                f"embeddings are on {embeddings.device} but the memory bank lives on "
                f"{self._embeddings.device} (placed by its first batch); move them, call "
                "bank.to(device), or reset() the bank"
            )
        assert self._labels is not None
        n = embeddings.shape[0]
        if n == 0:
            return
        keep = min(n, self.size)
        slots = (self._next + torch.arange(keep, device=embeddings.device)) % self.size
        self._embeddings[slots] = embeddings[n - keep :].detach().to(self._embeddings.dtype)
        self._labels[slots] = labels[n - keep :].to(device=embeddings.device, dtype=torch.int64)
        self._next = (self._next + keep) % self.size
        self._count = min(self._count + keep, self.size)

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeddings, labels)`` of the filled part, oldest first, as new tensors.

        The result is a copy: it stays valid (and safe for autograd) while the bank is updated.
        An empty bank returns ``[0, dim]`` / ``[0]`` tensors on its device (CPU before the first
        update).
        """
        if self._embeddings is None or self._labels is None:
            return (
                torch.zeros(0, self.dim, dtype=self._requested_dtype or torch.get_default_dtype()),
                torch.zeros(0, dtype=torch.int64),
            )
        if self._count < self.size:
            return self._embeddings[: self._count].clone(), self._labels[: self._count].clone()
        order = (self._next + torch.arange(self.size, device=self._embeddings.device)) % self.size
        return self._embeddings[order], self._labels[order]

    def reset(self) -> None:
        """Empty the bank and free its storage; the next batch sets device and dtype again."""
        self._embeddings = None
        self._labels = None
        self._next = 0
        self._count = 0

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MemoryBank:
        """Move (and/or cast) the stored entries in place; returns ``self``."""
        if dtype is not None:
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
            self._requested_dtype = dtype
        if self._embeddings is not None and self._labels is not None:
            self._embeddings = self._embeddings.to(device=device, dtype=dtype)
            self._labels = self._labels.to(device=device)
        return self

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"size", "dim", "embeddings", "labels"}`` with the entries oldest first."""
        embeddings, labels = self.get()
        return {"size": self.size, "dim": self.dim, "embeddings": embeddings, "labels": labels}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the contents by a saved state (kept on the saved tensors' device).

        The saved ``size`` may differ from this bank's: only the newest ``size`` entries are kept.
        """
        for key in ("dim", "embeddings", "labels"):
            if key not in state_dict:
                raise ValueError(f"state_dict is missing {key!r}")
        if state_dict["dim"] != self.dim:
            raise ValueError(f"state_dict has dim {state_dict['dim']}, this memory bank has dim {self.dim}")
        self.reset()
        embeddings = state_dict["embeddings"]
        if embeddings.shape[0]:
            self.update(embeddings, state_dict["labels"])

    def __repr__(self) -> str:
        where = "unplaced" if self._embeddings is None else f"{self.device}, {self.dtype}"
        return f"MemoryBank(size={self.size}, dim={self.dim}, filled={self._count}, {where})"
