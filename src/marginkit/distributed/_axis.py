"""The class axis of a block whose classes are split over the ranks of a process group."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from marginkit._validation import check_flag
from marginkit.distributed._collectives import all_reduce_
from marginkit.distributed._group import Group


class ShardedAxis:
    """Classes split over the ranks of ``group``: each reduction is the local one, then an all-reduce.

    Implements :class:`marginkit.ops.classes.ClassAxis`. The parts of one call travel in one
    all-reduce (concatenated), so a loss pays one collective per reduction step whatever it
    folds into it. With one rank nothing is communicated.

    Args:
        group: the process group (``None``: the default group).
        rank, world: this rank's position and the group's size.
        num_classes: every rank's classes together.
    """

    def __init__(self, group: Group, rank: int, world: int, num_classes: int) -> None:
        self.group, self.rank, self.world, self.num_classes = group, rank, world, num_classes

    @property
    def partitioned(self) -> bool:
        return self.world > 1

    def _reduce(self, op: str, parts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if not self.partitioned:
            return parts
        if len(parts) == 1 and parts[0].is_contiguous():
            return (all_reduce_(parts[0], op, self.group),)
        flat = all_reduce_(torch.cat([p.reshape(-1) for p in parts]), op, self.group)
        chunks = flat.split([p.numel() for p in parts])
        return tuple(c.view(p.shape) for c, p in zip(chunks, parts, strict=True))

    def max_(self, *parts: Tensor) -> tuple[Tensor, ...]:
        return self._reduce("max", parts)

    def sum_(self, *parts: Tensor) -> tuple[Tensor, ...]:
        return self._reduce("sum", parts)

    def flags(self, bad: Callable[[], Tensor], dtype: torch.dtype) -> Tensor:
        flag = bad()
        flags = torch.zeros(self.world, dtype=dtype, device=flag.device)
        flags[self.rank] = flag.to(dtype)
        return flags

    def raise_flagged(
        self, flags: Tensor | None, local_error: Callable[[], None], message: Callable[[str], str]
    ) -> None:
        assert flags is not None

        def text(*per_rank: float) -> str:
            bad = [rank for rank, flag in enumerate(per_rank) if flag > 0]
            return message(f" on rank {', '.join(map(str, bad))}" if self.world > 1 else "")

        # (the flags are the same on every rank: every rank raises, or defers, alike)
        check_flag("sharded scores", flags.amax() > 0, text, *flags.unbind())

    def __repr__(self) -> str:
        return f"ShardedAxis(num_classes={self.num_classes}, rank={self.rank}/{self.world})"
