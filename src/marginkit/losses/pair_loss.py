"""The call every pair loss shares (not re-exported): ``loss(embeddings, labels, ...)``.

The triplet losses (:mod:`marginkit.losses.triplet`) and the pair-matrix losses
(:mod:`marginkit.losses.pair_matrix`) take the same inputs in the same order, checked in the
same order: first the hyper-parameters (a schedule or a user may have set them since
construction), then the embeddings and labels (:func:`marginkit.ops.pairs.prepare_pairs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from marginkit.ops.pairs import PairBatch, PairIndices, prepare_pairs

#: mined pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)``
Indices = PairIndices | tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: ``check(value, name) -> value``: returns the checked value or raises naming ``name``
Check = Callable[[Any, str], Any]


class PairLoss(nn.Module):
    """Base of the pair losses: the shared :meth:`forward`; a subclass implements :meth:`_pair_loss`.

    A subclass lists its hyper-parameters in :attr:`hyperparameters` as (name, check) pairs and sets
    them with :meth:`_set`; ``forward`` checks them again, and ``repr`` shows them followed by
    :attr:`repr_options`.
    """

    #: the hyper-parameters a schedule or a user may change after construction, with their checks
    hyperparameters: ClassVar[tuple[tuple[str, Check], ...]] = ()
    #: the other attributes ``repr`` shows, after the hyper-parameters
    repr_options: ClassVar[tuple[str, ...]] = ("reduction",)
    validate: bool
    reduction: str
    last_active_fraction: torch.Tensor | None

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor | None = None,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
        indices: Indices | None = None,
    ) -> torch.Tensor:
        """The loss of ``embeddings [B, D]`` against themselves or ``ref_embeddings [R, D]``.

        ``labels [B]`` / ``ref_labels [R]`` define the pairs, or a miner's ``indices`` list
        them: ``(a, p, n)`` triplets (every pair loss), or ``(a1, p, a2, n)`` pairs (the
        pair-matrix losses); the labels are then optional and only the listed pairs count.
        The references are a memory bank (e.g. MoCo's queue) or another modality; self-pairs
        are excluded only when they are the batch itself. Output: scalar, or ``[B]`` with
        ``reduction="none"`` (one value per triplet for the triplet losses given ``indices``);
        float32 (float64 for float64 embeddings).
        """
        self._check_hyperparameters()
        batch = prepare_pairs(embeddings, labels, ref_embeddings, ref_labels, labels_required=indices is None)
        return self._pair_loss(batch, indices)

    def _set(self, **values: Any) -> None:
        """Check and set hyper-parameters of :attr:`hyperparameters`."""
        checks = dict(self.hyperparameters)
        for name, value in values.items():
            setattr(self, name, checks[name](value, name))

    def _check_hyperparameters(self) -> None:
        """Re-check the hyper-parameters (a schedule or a user may have set them)."""
        for name, check in self.hyperparameters:
            check(getattr(self, name), name)

    def extra_repr(self) -> str:
        names = (*(name for name, _ in self.hyperparameters), *self.repr_options)
        values = {name: getattr(self, name) for name in names}
        # numbers as str() shows them (a schedule may have set a numpy or tensor scalar), strings quoted
        return ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())

    def _pair_loss(self, batch: PairBatch, indices: Any) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError
