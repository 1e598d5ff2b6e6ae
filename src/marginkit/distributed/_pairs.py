"""Pair losses on the global batch under data parallelism: gather the embeddings, then the loss.

A pair loss (circle, triplet, local-margin triplet) compares every sample with every other one
of its batch; under ``DistributedDataParallel`` each rank only holds ``1/N`` of the batch, so
the pairs across ranks would be lost. :class:`GatheredPairLoss` all-gathers the embeddings (with
autograd) and the labels in rank order and evaluates the wrapped loss on the concatenated batch:
every rank gets the single-process value, and the gradients follow the same convention as
:class:`~marginkit.heads.ShardedCosineHead` (``docs/distributed.md``). It wraps any loss
callable and imports none.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from marginkit._validation import choice
from marginkit.distributed._collectives import exchange, gather_rows, gather_rows_with_grad
from marginkit.distributed._group import FLOAT_DTYPES, Group, comm_device, is_distributed, world_size


class GatheredPairLoss(nn.Module):
    r"""Wrap a pair loss so that every rank evaluates it on the global batch.

    .. math:: L = \text{loss}\big(\mathrm{cat}(e_0, \dots, e_{N-1}),\ \mathrm{cat}(y_0, \dots, y_{N-1})\big)

    ``forward(embeddings, labels)`` takes this rank's rows ``[B_r, D]`` and labels ``[B_r]`` (batch
    sizes may differ across ranks) and returns ``L``, the same value on every rank (a scalar, or
    ``[B_0 + … + B_{N-1}]`` for ``reduction="none"``): exactly the wrapped loss on the
    concatenated batch. Call ``backward()`` on it on every rank. The local embeddings receive
    ``N·∂L/∂e`` with ``grad_reduction="mean"`` (``DistributedDataParallel`` averages the backbone
    gradients over the ``N`` ranks, which makes them exactly the single-process gradients) or
    ``∂L/∂e`` with ``grad_reduction="sum"``. Without a process group (or with one rank) the
    wrapper is the wrapped loss.

    Each rank computes the whole ``[B, B]`` pair loss (the pair matrix of a global batch of a
    few thousand is small next to the backbone); the communication is one all-gather of the
    embeddings and one of the labels forward, and one all-reduce of ``[B, D]`` backward.

    Args:
        loss: a pair loss taking ``(embeddings, labels)``, e.g.
            :class:`~marginkit.losses.CircleLoss`, :class:`~marginkit.losses.TripletMarginLoss`,
            :class:`~marginkit.losses.LocalMarginTripletLoss`.
        group: process group (default: the world).
        grad_reduction: ``"mean"`` | ``"sum"``, as above.

    Example:
        >>> import torch
        >>> from marginkit.losses import CircleLoss, GatheredPairLoss
        >>> loss_fn = GatheredPairLoss(CircleLoss(margin=0.25, gamma=64.0))
        >>> e = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        >>> loss_fn(e, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])).shape  # one process: CircleLoss itself
        torch.Size([])
    """

    def __init__(self, loss: nn.Module, group: Group = None, grad_reduction: str = "mean") -> None:
        super().__init__()
        if not callable(loss):
            raise TypeError(f"loss must be a callable pair loss, got {type(loss).__name__}")
        self.loss = loss
        self.group = group
        self.grad_reduction = choice(grad_reduction, "grad_reduction", ("mean", "sum"))

    def extra_repr(self) -> str:
        return f"grad_reduction={self.grad_reduction!r}"

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        """The wrapped loss on the global batch (``embeddings [B_r, D]``, ``labels [B_r]`` here)."""
        if not is_distributed(self.group):
            return self.loss(embeddings, labels)
        ok = (
            isinstance(embeddings, Tensor)
            and embeddings.dtype in FLOAT_DTYPES
            and embeddings.dim() == 2
            and isinstance(labels, Tensor)
            and not torch.is_floating_point(labels)
            and labels.dtype != torch.bool
            and tuple(labels.shape) == (embeddings.shape[0],)
        )
        device = embeddings.device if isinstance(embeddings, Tensor) else torch.device("cpu")
        shape = (
            (embeddings.shape[0], embeddings.shape[1], FLOAT_DTYPES.index(embeddings.dtype))
            if ok
            else (0, -1, -1)
        )
        rows = exchange([int(ok), *shape], self.group, device)
        bad = [r for r, m in enumerate(rows) if not m[0]]
        if bad:
            raise ValueError(
                f"embeddings must be a floating [batch, dim] tensor and labels an integer [batch] tensor "
                f"on every rank; ranks {bad} passed something else"
            )
        if len({(m[2], m[3]) for m in rows}) > 1:
            listed = ", ".join(
                f"rank {r}: dim {m[2]}, dtype {FLOAT_DTYPES[m[3]]}" for r, m in enumerate(rows)
            )
            raise ValueError(f"embeddings must have the same dim and dtype on every rank, got {listed}")
        sizes = [m[1] for m in rows]
        scale = 1.0 if self.grad_reduction == "mean" else 1.0 / world_size(self.group)
        gathered = gather_rows_with_grad(embeddings, sizes, self.group, scale)
        wire = comm_device(self.group, device)
        all_labels = gather_rows(labels.to(device=wire, dtype=torch.long), sizes, self.group)
        return self.loss(gathered, all_labels.to(embeddings.device))
