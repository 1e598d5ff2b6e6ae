r"""Collectives: recorded all-reduce and all-gather, gathering rows (with gradient), agreeing on errors.

Every collective of the sharded head, the class axis and the gathered losses goes through
:func:`all_reduce_` / :func:`all_gather_`, which :func:`record_collectives` can count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from marginkit.distributed._group import Group, comm_device, is_distributed, rank, world_size

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


@dataclass
class CommStats:
    """Collectives issued inside :func:`record_collectives`: calls and payload bytes per kind.

    ``bytes`` counts the buffer each rank hands to the collective (all-reduce: the tensor;
    all-gather: the gathered output, i.e. world size × the padded input). A ring all-reduce puts
    ``2(N-1)/N`` times that on the wire per rank.
    """

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


_RECORDERS: list[CommStats] = []


@contextlib.contextmanager
def record_collectives() -> Iterator[CommStats]:
    """Count the collectives marginkit issues inside the ``with`` block (for benchmarks and tests)."""
    stats = CommStats()
    _RECORDERS.append(stats)
    try:
        yield stats
    finally:
        _RECORDERS.remove(stats)


def _record(kind: str, nbytes: int) -> None:
    for stats in _RECORDERS:
        stats.add(kind, nbytes)


def all_reduce_(tensor: Tensor, op: str, group: Group) -> Tensor:
    """In-place all-reduce of a contiguous tensor (``op``: "sum", "max" or "min"); returns it."""
    _record(f"all_reduce_{op}", tensor.numel() * tensor.element_size())
    torch.distributed.all_reduce(tensor, op=getattr(torch.distributed.ReduceOp, _REDUCE_OPS[op]), group=group)
    return tensor


def all_gather_(tensor: Tensor, group: Group) -> list[Tensor]:
    """Every rank's ``tensor`` (equal shapes and dtypes on every rank), in rank order."""
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(world_size(group))]
    _record("all_gather", len(parts) * tensor.numel() * tensor.element_size())
    torch.distributed.all_gather(parts, tensor, group=group)
    return parts


def gather_rows(tensor: Tensor, sizes: Sequence[int], group: Group) -> Tensor:
    """Concatenate every rank's rows (``sizes[r]`` of them on rank ``r``) in rank order.

    All-gather needs equal shapes: the rows are padded to the longest, gathered and trimmed.
    Bool tensors travel as ``uint8``.
    """
    send = tensor.contiguous()
    if send.dtype == torch.bool:
        send = send.to(torch.uint8)
    longest = max(sizes)
    if send.shape[0] < longest:
        send = torch.cat([send, send.new_zeros((longest - send.shape[0], *send.shape[1:]))])
    parts = all_gather_(send, group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]).to(tensor.dtype)


class _GatherRows(torch.autograd.Function):
    """:func:`gather_rows` with autograd; backward: SUM all-reduce, own rows, times ``grad_scale``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: Tensor, sizes: list[int], group: Group, grad_scale: float
    ) -> Tensor:
        ctx.start = sum(sizes[: rank(group)])
        ctx.stop = ctx.start + sizes[rank(group)]
        ctx.group, ctx.grad_scale = group, grad_scale
        return gather_rows(tensor, sizes, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        total = all_reduce_(grad.contiguous().clone(), "sum", ctx.group)
        mine = total[ctx.start : ctx.stop]
        if ctx.grad_scale != 1.0:
            mine = mine * ctx.grad_scale
        return mine, None, None, None


def gather_rows_with_grad(
    tensor: Tensor, sizes: Sequence[int], group: Group, grad_scale: float = 1.0
) -> Tensor:
    r"""All-gather ``tensor``'s rows (per-rank ``sizes`` known) keeping gradients.

    The backward pass sums the gradient over ranks (the gradient of the *sum over ranks* of the
    per-rank objectives, :mod:`marginkit.distributed`) and multiplies this rank's rows by
    ``grad_scale``.
    """
    return _GatherRows.apply(tensor, list(sizes), group, grad_scale)


def exchange(
    meta: Sequence[int], group: Group, device: torch.device, payload: Tensor | None = None
) -> list[Any]:
    """One all-gather of a small int64 record (and an int64 ``payload`` of one length everywhere).

    The way every rank learns every rank's status, so that a bad input on one rank makes every
    rank raise the same error instead of leaving the others blocked in the next collective.
    Returns each rank's ``meta`` as a list, in rank order; with ``payload``, pairs
    ``(meta, payload)``.
    """
    dev = comm_device(group, device)
    send = torch.tensor(list(meta), dtype=torch.long, device=dev)
    if payload is not None:
        send = torch.cat([payload.to(device=dev, dtype=torch.long), send])
    parts = all_gather_(send, group)
    k = len(meta)
    if payload is None:
        return [p.tolist() for p in parts]
    return [(p[-k:].tolist(), p[:-k]) for p in parts]


def where_rank(r: int, world: int) -> str:
    """`` on rank r`` in an error message of a multi-rank group, nothing for one process."""
    return f" on rank {r}" if world > 1 else ""


# ---------------------------------------------------------------------------- public gathers
_MAX_DIMS = 8
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def _gather_sizes_checked(tensor: Tensor, name: str, group: Group) -> list[int]:
    """All ranks' first-dimension sizes; the same error on every rank for mismatched dtypes/shapes."""
    if tensor.dim() == 0:
        raise ValueError(f"{name} must have at least 1 dimension (rows are concatenated), got a scalar")
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"{name} must have at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"{name} has unsupported dtype {tensor.dtype} for gathering")
    dims = [*tensor.shape, *[-1] * (_MAX_DIMS - tensor.dim())]
    rows = exchange([tensor.dim(), _DTYPES.index(tensor.dtype), *dims], group, tensor.device)
    shapes = [tuple(r[2 : 2 + r[0]]) for r in rows]
    if any(r[1] != rows[0][1] for r in rows):
        dtypes = ", ".join(f"rank {i}: {_DTYPES[r[1]]}" for i, r in enumerate(rows))
        raise TypeError(f"{name} must have the same dtype on every rank, got {dtypes}")
    if any(s[1:] != shapes[0][1:] for s in shapes):
        listed = ", ".join(f"rank {i}: {s}" for i, s in enumerate(shapes))
        raise ValueError(
            f"{name} must have the same shape beyond the first dimension on every rank, got {listed}"
        )
    return [s[0] for s in shapes]


def all_gather_with_grad(tensor: Tensor, group: Group = None) -> Tensor:
    r"""Concatenate every rank's ``tensor`` along dim 0 in rank order, keeping gradients.

    Sizes along the first dimension may differ across ranks (they are gathered first); the other
    dimensions and the dtype must agree, otherwise every rank raises the same error. The backward
    pass sums the gradient over ranks and returns each rank its own rows: the gradient of the sum
    over ranks of what each rank computed (see :mod:`marginkit.distributed` for the DDP
    convention). With one process, or none initialised, this is the identity.

    Shape:
        ``[n_r, *rest]`` on rank ``r`` -> ``[n_0 + ... + n_{N-1}, *rest]`` on every rank.

    Args:
        tensor: local rows (any dtype supported by the backend; gradients for floating dtypes).
        group: process group (default: the world).

    Example:
        >>> x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
        >>> all_gather_with_grad(x) is x  # not distributed: identity
        True
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not is_distributed(group):
        return tensor
    return gather_rows_with_grad(tensor, _gather_sizes_checked(tensor, "tensor", group), group)


def all_gather_no_grad(tensor: Tensor, group: Group = None) -> Tensor:
    """Like :func:`all_gather_with_grad` but detached — for labels, indices, masks.

    Integer and bool tensors are supported; sizes along the first dimension may differ.
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not is_distributed(group):
        return tensor.detach()
    with torch.no_grad():
        return gather_rows(tensor.detach(), _gather_sizes_checked(tensor, "tensor", group), group)


def gather_sizes(size: int, group: Group = None) -> list[int]:
    """Every rank's ``size`` (e.g. local batch size), in rank order; ``[size]`` when not distributed.

    The local rows of a gathered batch are ``[sum(sizes[:rank()]), sum(sizes[:rank() + 1]))``.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size must be a non-negative int, got {size!r}")
    if not is_distributed(group):
        return [size]
    return [r[0] for r in exchange([size], group, torch.device("cpu"))]
