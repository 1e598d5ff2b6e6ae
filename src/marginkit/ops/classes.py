r"""The class dimension as a parameter: a block of class scores and the axis its reductions run on.

A class-level loss reads scores ``[B, C_b]`` (cosines between B embeddings and C_b class
centres) and, per row, the column of the label. Everything it needs from the classes is a
reduction over them: a row maximum, a row sum, the label's entry, a support count, the terms of
a Newton step. A :class:`ClassBlock` carries the scores together with the :class:`ClassAxis`
those reductions run on:

- :class:`LocalAxis`: one process holds every class (``C_b = C``); a reduction is the plain
  tensor reduction of the block.
- a sharded axis (:class:`marginkit.distributed.ShardedAxis`, from a
  :class:`~marginkit.heads.ShardedCosineHead`): rank ``r`` holds a slice of the classes; the
  same local reduction is followed by an all-reduce (MAX or SUM) over the ranks, so every rank
  gets the reduction over all C classes. Rows whose label lies on another rank are not
  ``owned`` here: their label entry comes from its owner.

A loss written once against the block is therefore sharded for free: the op code never asks
which axis it runs on, except through :attr:`ClassAxis.partitioned` (reductions are collectives:
fold what is needed later into one call; skip per-rank heuristics that would make ranks issue
different collectives). The gradient convention of the sharded axis (the one of insightface's
PartialFC): every rank computes the same loss from the reduced values and backpropagates it, so
the gradient of a local entry needs no communication (:meth:`ClassBlock.sum`,
:meth:`ClassBlock.target` are differentiable with local backward passes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from marginkit._validation import active_checks, float_tensor, label_tensor, same_batch

__all__ = ["ONE_PROCESS", "ClassAxis", "ClassBlock", "LocalAxis", "class_block"]


class ClassAxis(Protocol):
    """Where the reductions over the classes of a :class:`ClassBlock` run.

    ``max_``/``sum_`` reduce per-row partial results (any shapes, one dtype) over the axis, in
    one call: each part is this block's reduction; the returned parts are the reductions over
    every class (the same on every rank). They may work in place and carry no gradient.
    """

    #: Number of classes the axis spans (every rank's columns together; an upper bound with sampling).
    num_classes: int
    #: True when the classes are split over processes: every reduction is a collective.
    partitioned: bool

    def max_(self, *parts: Tensor) -> tuple[Tensor, ...]: ...

    def sum_(self, *parts: Tensor) -> tuple[Tensor, ...]: ...

    def flags(self, bad: Callable[[], Tensor], dtype: torch.dtype) -> Tensor | None:
        """A vector to MAX-reduce with other parts, nonzero where a process found ``bad()`` input.

        ``None`` when the check needs no reduction (:meth:`raise_flagged` then checks locally).
        """
        ...

    def raise_flagged(
        self, flags: Tensor | None, local_error: Callable[[], None], message: Callable[[str], str]
    ) -> None:
        """After the reduction of :meth:`flags`: raise the same error on every process.

        ``local_error`` checks one process's input and raises its detailed error;
        ``message(where)`` is the text when the input of some processes is bad (``where`` names
        them).
        """
        ...


class LocalAxis:
    """Every class is in the block: reductions are plain tensor reductions (identity here).

    ``num_classes``: the block's class count (``None`` where nobody asks: :data:`ONE_PROCESS`).
    """

    partitioned = False

    def __init__(self, num_classes: int | None = None) -> None:
        self.num_classes = num_classes

    def max_(self, *parts: Tensor) -> tuple[Tensor, ...]:
        return parts

    def sum_(self, *parts: Tensor) -> tuple[Tensor, ...]:
        return parts

    def flags(self, bad: Callable[[], Tensor], dtype: torch.dtype) -> None:
        return None

    def raise_flagged(
        self, flags: Tensor | None, local_error: Callable[[], None], message: Callable[[str], str]
    ) -> None:
        local_error()

    def __repr__(self) -> str:
        return f"LocalAxis(num_classes={self.num_classes})"


#: The axis of code that never partitions its classes (the defaults of the solvers).
ONE_PROCESS = LocalAxis()


@dataclass(frozen=True)
class ClassBlock:
    """Class scores ``[B, C_b]`` of B examples, the label column of each, and their :class:`ClassAxis`.

    Attributes:
        scores: ``[B, C_b]`` floating scores (cosines for the losses of :mod:`marginkit.losses`).
        labels: ``[B]`` int64 global class ids.
        column: ``[B]`` int64 column of the label in ``scores`` (0 where the row is not owned).
        owned: ``[B]`` bool, the label's column is in this block; ``None``: every row's is.
        axis: where the reductions over the classes run.
        batch_shape: the leading shape of the examples (``B = prod(batch_shape)``).
        keep: ``[B]`` bool, the rows that count (``None``: all); rows whose label was the
            ``ignore_index`` of :func:`class_block` carry class 0 in ``labels`` instead.
    """

    scores: Tensor
    labels: Tensor
    column: Tensor
    owned: Tensor | None
    axis: ClassAxis
    batch_shape: tuple[int, ...]
    keep: Tensor | None = None

    def max(self, values: Tensor) -> Tensor:
        """Row maximum over every class of the axis, ``[B]`` (no gradient: for shifts)."""
        with torch.no_grad():
            (top,) = self.axis.max_(values.detach().amax(dim=1))
        return top

    def sum(self, values: Tensor) -> Tensor:
        """Row sum over every class of the axis, ``[B]``, differentiable (local backward)."""
        return _AxisSum.apply(values, self.axis)

    def target(self, values: Tensor) -> Tensor:
        """``values[b, label_b]`` from the block that holds it, ``[B]``, differentiable."""
        return _AxisTarget.apply(values, self.column, self.owned, self.axis)


def target_entry(values: Tensor, column: Tensor, owned: Tensor | None) -> Tensor:
    """This block's part of the label entries: ``values[b, column_b]``, ``-inf`` where not owned."""
    entry = values.gather(1, column.unsqueeze(1)).squeeze(1)
    return entry if owned is None else torch.where(owned, entry, -math.inf)


def write_target(buf: Tensor, column: Tensor, owned: Tensor | None, values: Tensor | float) -> None:
    """``buf[b, column_b] = values_b`` in place, on the owned rows only (no host sync)."""
    index = column.unsqueeze(1)
    if owned is None:
        if isinstance(values, Tensor):
            buf.scatter_(1, index, values.to(buf.dtype).unsqueeze(1))
        else:
            buf.scatter_(1, index, values)
        return
    current = buf.gather(1, index).squeeze(1)
    buf.scatter_(1, index, torch.where(owned, values, current).to(buf.dtype).unsqueeze(1))


class _AxisSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, values: Tensor, axis: ClassAxis) -> Tensor:
        ctx.shape = values.shape
        (total,) = axis.sum_(values.sum(dim=1))
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad.unsqueeze(1).expand(ctx.shape), None


class _AxisTarget(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, values: Tensor, column: Tensor, owned: Tensor | None, axis: ClassAxis) -> Tensor:
        ctx.save_for_backward(column, owned)
        ctx.shape, ctx.dtype = values.shape, values.dtype
        (entry,) = axis.max_(target_entry(values.detach(), column, owned))
        return entry

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        column, owned = ctx.saved_tensors
        out = grad.new_zeros(ctx.shape, dtype=ctx.dtype)
        write_target(out, column, owned, grad)
        return out, None, None, None


def class_block(
    scores: Any,
    labels: Any,
    *,
    name: str = "cosines",
    batch_dims: bool = False,
    ignore_index: int | None = None,
) -> ClassBlock:
    """The :class:`ClassBlock` of a loss's input: a tensor of scores, or a sharded head's output.

    A tensor ``[B, C]`` (``[..., C]`` with ``batch_dims``) and integer ``labels`` of its batch
    shape, in ``[0, C)``, are checked (type, shapes, range; not the values of the scores, which
    the loss checks with reductions it computes anyway) and make a block on a
    :class:`LocalAxis`. Any other object providing ``class_block(labels)`` (the output of a
    :class:`~marginkit.heads.ShardedCosineHead`) builds its own block: a collective there.

    ``ignore_index``: labels equal to it mark rows that do not count (``block.keep`` is False
    there; they are given class 0 so that every row stays a valid problem). On a sharded head's
    output, ``keep`` covers the global batch (one more MAX reduction of ``[B]``).
    """
    keep = None
    if ignore_index is not None:
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be None or an int, got {type(ignore_index).__name__}")
        label_tensor(labels, "labels")
        keep = labels != ignore_index
        labels = labels.masked_fill(~keep, 0)
    if not isinstance(scores, Tensor):
        make = getattr(scores, "class_block", None)
        if make is not None:
            block = make(labels)
            if keep is None:
                return block
            rows = getattr(scores, "local_rows", None)
            if rows is None:
                raise TypeError(f"{name}: ignore_index needs to know this process's rows (local_rows)")
            flags = torch.zeros(block.labels.shape[0], dtype=torch.float32, device=block.labels.device)
            flags[rows] = keep.reshape(-1).to(device=flags.device, dtype=flags.dtype)
            (flags,) = block.axis.max_(flags)
            return replace(block, keep=flags > 0)
    float_tensor(scores, name, min_dim=1 if batch_dims else 0, allow_empty=True, check_values=False)
    if not batch_dims and scores.dim() != 2:
        raise ValueError(f"{name} must have shape [batch, num_classes], got shape {tuple(scores.shape)}")
    float_tensor(scores, name, check_values=False)  # a non-empty class dimension
    label_tensor(labels, "labels")  # the type first: a list gets a TypeError
    if scores.dim() >= 2 and labels.dim() >= 1:
        same_batch(scores, name, labels, "labels")
    num_classes = scores.shape[-1]
    label_tensor(labels, "labels", shape=scores.shape[:-1], num_classes=num_classes)
    # a [B, C] input is used as is (no view node: a sparse gradient can reach its producer)
    flat = scores if scores.dim() == 2 else scores.reshape(-1, num_classes)
    y = labels.reshape(-1).to(device=scores.device, dtype=torch.long)
    if active_checks() is not None:  # a deferred range check: keep the step well-defined until it is read
        y = y.clamp(0, num_classes - 1)
    if keep is not None:
        keep = keep.reshape(-1).to(scores.device)
    return ClassBlock(flat, y, y, None, LocalAxis(num_classes), tuple(scores.shape[:-1]), keep)
