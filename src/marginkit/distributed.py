r"""Small helpers over ``torch.distributed`` that also work in a single process.

``rank()``, ``world_size()`` and ``is_distributed()`` answer ``0``, ``1``, ``False`` when
``torch.distributed`` is unavailable or no process group is initialised, and every gather below
is then the identity, so the same code runs with and without ``torchrun``.

Gradient convention of :func:`all_gather_with_grad`
----------------------------------------------------
Every rank ``r`` holds local rows ``x_r``; the gather returns the same global batch
``G = cat(x_0, ..., x_{N-1})`` on every rank. Each rank then computes its own scalar
``l_r(G)``. The backward pass all-reduces (sums) the gradient with respect to ``G`` and gives each
rank its slice, i.e. it differentiates the **sum over ranks** of the per-rank objectives:

.. math:: \text{grad}(x_r) = \frac{\partial}{\partial x_r} \sum_s l_s(G).

Two ways of using it, compared with one process on the concatenated batch (loss ``L``;
DistributedDataParallel *averages* parameter gradients over the ``N`` ranks):

- **share** — each rank computes its part, ``sum_s l_s = L`` (its own anchors against the
  gathered batch normalised by the *global* count, or its own class centres in a sharded head).
  Embedding gradients equal the single-process ones exactly; under DDP multiply the loss by
  ``world_size()`` to get the single-process parameter gradients.
- **replicated** — every rank computes the whole loss, ``l_r = L`` (any loss called on the
  gathered batch). Embedding gradients are ``N`` times the single-process ones, which is exactly
  what DDP's averaging expects: ``loss(all_gather_with_grad(x), all_gather_no_grad(y))`` under
  DDP yields the single-process parameter gradients with no scaling.

Either way every rank must run the backward pass through the gather (its all-reduce is a
collective), as DDP itself requires.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "all_gather_no_grad",
    "all_gather_with_grad",
    "find_free_port",
    "gather_sizes",
    "is_distributed",
    "rank",
    "world_size",
]

Group = Any  # torch.distributed.ProcessGroup | None

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


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank(group: Group = None) -> int:
    """This process's rank in ``group`` (default: the world); 0 when not distributed."""
    return torch.distributed.get_rank(group) if _initialized() else 0


def world_size(group: Group = None) -> int:
    """Number of processes in ``group`` (default: the world); 1 when not distributed."""
    return torch.distributed.get_world_size(group) if _initialized() else 1


def is_distributed(group: Group = None) -> bool:
    """True when a process group is initialised and ``group`` has more than one process."""
    return _initialized() and torch.distributed.get_world_size(group) > 1


def _gather_shapes(tensor: torch.Tensor, name: str, group: Group) -> list[tuple[int, ...]]:
    """All ranks' shapes (and a dtype check), raising the same error on every rank on mismatch."""
    if tensor.dim() == 0:
        raise ValueError(f"{name} must have at least 1 dimension (rows are concatenated), got a scalar")
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"{name} must have at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"{name} has unsupported dtype {tensor.dtype} for gathering")
    meta = torch.full((_MAX_DIMS + 2,), -1, dtype=torch.int64, device=tensor.device)
    meta[0] = tensor.dim()
    meta[1] = _DTYPES.index(tensor.dtype)
    meta[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    metas = [torch.empty_like(meta) for _ in range(world_size(group))]
    torch.distributed.all_gather(metas, meta, group=group)
    rows = [m.tolist() for m in metas]
    shapes = [tuple(r[2 : 2 + r[0]]) for r in rows]
    if any(r[1] != rows[0][1] for r in rows):
        dtypes = ", ".join(f"rank {i}: {_DTYPES[r[1]]}" for i, r in enumerate(rows))
        raise TypeError(f"{name} must have the same dtype on every rank, got {dtypes}")
    if any(s[1:] != shapes[0][1:] for s in shapes):
        listed = ", ".join(f"rank {i}: {s}" for i, s in enumerate(shapes))
        raise ValueError(
            f"{name} must have the same shape beyond the first dimension on every rank, got {listed}"
        )
    return shapes


def _gather(tensor: torch.Tensor, sizes: Sequence[int], group: Group) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` (first-dimension sizes ``sizes``) in rank order."""
    send = tensor.contiguous()
    wire_dtype = torch.uint8 if send.dtype == torch.bool else send.dtype
    send = send.to(wire_dtype)
    longest = max(sizes)
    if send.shape[0] < longest:  # all_gather needs equal shapes: pad, then trim
        padding = send.new_zeros((longest - send.shape[0], *send.shape[1:]))
        send = torch.cat([send, padding])
    parts = [torch.empty_like(send) for _ in sizes]
    torch.distributed.all_gather(parts, send, group=group)
    out = torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])
    return out.to(tensor.dtype)


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
        me = rank(group)
        ctx.group = group
        ctx.start = sum(sizes[:me])
        ctx.stop = ctx.start + sizes[me]
        return _gather(tensor, sizes, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        total = grad.contiguous().clone()
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=ctx.group)
        return total[ctx.start : ctx.stop], None, None


def all_gather_with_grad(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    r"""Concatenate every rank's ``tensor`` along dim 0 in rank order, keeping gradients.

    Sizes along the first dimension may differ across ranks (they are gathered first); the other
    dimensions and the dtype must agree, otherwise every rank raises the same error. The backward
    pass sums the gradient over ranks and returns each rank its own rows: the gradient of the sum
    over ranks of what each rank computed (see the module docstring for the DDP convention). With
    one process, or none initialised, this is the identity.

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
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not is_distributed(group):
        return tensor
    sizes = [s[0] for s in _gather_shapes(tensor, "tensor", group)]
    return _AllGatherWithGrad.apply(tensor, sizes, group)


def all_gather_no_grad(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Like :func:`all_gather_with_grad` but detached — for labels, indices, masks.

    Integer and bool tensors are supported; sizes along the first dimension may differ.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not is_distributed(group):
        return tensor.detach()
    with torch.no_grad():
        sizes = [s[0] for s in _gather_shapes(tensor, "tensor", group)]
        return _gather(tensor.detach(), sizes, group)


def gather_sizes(size: int, group: Group = None) -> list[int]:
    """Every rank's ``size`` (e.g. local batch size), in rank order; ``[size]`` when not distributed.

    The local rows of a gathered batch are ``[sum(sizes[:rank()]), sum(sizes[:rank() + 1]))``.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size must be a non-negative int, got {size!r}")
    if not is_distributed(group):
        return [size]
    backend = torch.distributed.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = torch.tensor([size], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world_size(group))]
    torch.distributed.all_gather(parts, mine, group=group)
    return [int(p.item()) for p in parts]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, release it).

    Another process can take it before you do; :func:`_spawn_for_test` retries on that race.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- test support
class SpawnedRankError(RuntimeError):
    """A process started by :func:`_spawn_for_test` raised; ``rank`` is the one that failed first."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def _prepare_process_group_init() -> None:
    """Call before ``torch.distributed.init_process_group`` so that tearing the group down works.

    ``torch.distributed.nn.functional`` binds ``group.WORLD`` as a default argument of ten
    functions when it is first imported, and the first ``torch.optim`` optimizer imports it. If
    that happens after the default group exists, the group outlives ``destroy_process_group``
    (torch 2.13) and so do its gloo worker threads; a worker still releasing its last collective
    while the interpreter shuts down aborts the process ("terminate called without an active
    exception", SIGABRT after a successful run). Imported first, the defaults bind ``None``.
    """
    import torch.distributed.nn  # noqa: F401


def _loopback_interface() -> str:
    return "lo0" if sys.platform == "darwin" else "lo"


def _spawn_worker(
    local_rank: int,
    fn: Callable[..., None],
    world: int,
    port: int,
    timeout_s: float,
    error_dir: str,
    args: tuple[Any, ...],
) -> None:
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
        torch.set_num_threads(1)
        _prepare_process_group_init()
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=local_rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        fn(local_rank, world, *args)
    except BaseException:
        # Record when and why, before this process exits and its peers see the lost connection:
        # the parent reports the earliest failure (the cause), not a peer's consequence.
        with open(os.path.join(error_dir, f"rank{local_rank}.txt"), "w") as file:
            file.write(f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    # Only on success: after a failure the process exits with the group still open.
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


def _spawn_for_test(
    fn: Callable[..., None], world: int, *args: Any, timeout_s: float = 60.0, attempts: int = 3
) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined by a gloo group.

    For tests and benchmarks on one machine: the group meets on a free loopback port; ``fn``
    must be importable (module level) and the arguments picklable. Returns when every process
    has finished. If one raises, the others are terminated and :class:`SpawnedRankError` is
    raised here with the traceback of the rank that failed *first* (peers that merely lost their
    connection to it are listed, not blamed). A collective that hangs fails after ``timeout_s``.
    A rendezvous port taken between choosing and binding it is retried with a new port.
    """
    from torch.multiprocessing.spawn import ProcessException, spawn

    for attempt in range(attempts):
        port = find_free_port()
        error_dir = tempfile.mkdtemp(prefix="marginkit-spawn-")
        try:
            try:
                spawn(
                    _spawn_worker,
                    args=(fn, world, port, timeout_s, error_dir, args),
                    nprocs=world,
                    join=True,
                )
                return
            except ProcessException as error:
                failures = []
                for name in os.listdir(error_dir):
                    with open(os.path.join(error_dir, name)) as file:
                        stamp, _, trace = file.read().partition("\n")
                    failures.append((float(stamp), int(name[4:-4]), trace))
                if not failures:  # died without a Python exception (signal, os._exit)
                    raise
                failures.sort()
                _, first, trace = failures[0]
                if "address already in use" in trace.lower() and attempt + 1 < attempts:
                    continue
                others = ", ".join(str(r) for _, r, _ in failures[1:]) or "none"
                raise SpawnedRankError(
                    f"rank {first} of {world} failed first (ranks also failing after it: {others}):\n{trace}",
                    first,
                ) from error
        finally:
            shutil.rmtree(error_dir, ignore_errors=True)


def __getattr__(name: str) -> Any:
    """Lazy re-export: ``GatheredPairLoss`` lives in :mod:`marginkit.losses.gathered` (which imports
    this module, hence not imported at the top)."""
    if name == "GatheredPairLoss":
        from marginkit.losses.gathered import GatheredPairLoss

        return GatheredPairLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
