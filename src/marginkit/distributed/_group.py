"""The process group: rank, size, the device its collectives use, balanced slices, start-up."""

from __future__ import annotations

import socket
import sys
from typing import Any

import torch

Group = Any  # torch.distributed.ProcessGroup | None (None: the default group)

#: Floating dtypes a gathered embedding may have, in the order of their codes on the wire.
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


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


def comm_device(group: Group, fallback: torch.device) -> torch.device:
    """Device for the small tensors a collective of ``group`` exchanges.

    NCCL: the current CUDA device. Otherwise (gloo) ``fallback`` if it is a CPU or CUDA device,
    else the CPU.
    """
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback if fallback.type in ("cpu", "cuda") else torch.device("cpu")


def balanced_slices(num_items: int, world: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of every rank's contiguous slice: ``size = n//W + (r < n%W)``."""
    base, extra = divmod(num_items, world)
    return [(r * base + min(r, extra), base + (r < extra)) for r in range(world)]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, release it).

    Another process can take it before you do: retry with a new port on "address already in use".
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _loopback_interface() -> str:
    return "lo0" if sys.platform == "darwin" else "lo"


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
