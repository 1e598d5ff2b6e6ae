"""Count the aten ops a piece of code dispatches, and those that read the device back.

Usage::

    from dispatch_counts import DispatchCounter

    with DispatchCounter() as c:
        loss = f(x)
        loss.backward()
    assert c.ops <= 25 and c.reads == 0
    print(c.by_name)  # {"aten.sort.stable": 1, ...}

A *device read* is an op whose result the host must wait for on an accelerator (a host sync):
``aten._local_scalar_dense`` (behind ``.item()``, ``bool()``, ``float()``, ``int()``), ``nonzero``,
``masked_select``, every ``unique*`` / ``_unique*``, ``index`` with a boolean (or byte) mask among its
indices, and ``repeat_interleave`` without ``output_size``. On the CPU these ops run like any other,
so the counts are the same on every device (issue 36: the CPU count reproduces the GPU's).

Ops dispatched inside autograd's backward are counted as well (the mode is active on the thread
that runs backward). ``by_name`` maps the overload's name (``"aten.add.Tensor"``) to its count;
``read_names`` does the same for the reads only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DispatchCounter", "is_device_read"]

_READ_PACKETS = frozenset({"_local_scalar_dense", "nonzero", "nonzero_static_never", "masked_select"})


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in (indices or ()))


def is_device_read(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the aten op ``func`` with these arguments reads the device back (see the module doc)."""
    packet = func.overloadpacket.__name__
    if packet in _READ_PACKETS or "unique" in packet:
        return True
    if packet in ("index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_"):
        indices = kwargs.get("indices", args[1] if len(args) > 1 else None)
        return _has_bool_index(indices)
    if packet == "repeat_interleave":
        # .Tensor(repeats) and .self_Tensor(self, repeats) size their output from the data; .self_int does not
        repeats = args[0] if len(args) == 1 else args[1]
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


class DispatchCounter(TorchDispatchMode):
    """A ``TorchDispatchMode`` that counts every aten op (``ops``) and the device reads (``reads``)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.read_names: Counter[str] = Counter()

    @property
    def ops(self) -> int:
        return sum(self.by_name.values())

    @property
    def reads(self) -> int:
        return sum(self.read_names.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        self.by_name[name] += 1
        if is_device_read(func, args, kwargs):
            self.read_names[name] += 1
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"DispatchCounter(ops={self.ops}, reads={self.reads})"
