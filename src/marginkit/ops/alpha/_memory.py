"""CPU memory and threading helpers of the alpha solver (no effect on CUDA).

The compact problems of the solver are small: above PyTorch's grain size every element-wise op
opens a parallel region whose fork/join costs more than the work, and fresh large allocations
cost their page faults. These helpers avoid both without changing any result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

# Compact problems up to this many entries are solved on one intra-op thread (see _serial).
_SERIAL_MAX = 1 << 19


@contextlib.contextmanager
def _serial(numel: int, device: torch.device) -> Iterator[None]:
    """Run the enclosed ops on one intra-op CPU thread when they act on at most ``_SERIAL_MAX`` entries.

    The solver issues tens of element-wise ops per Newton step on 10^4–10^5 entries. Above
    PyTorch's grain size each op opens a parallel region, and on such sizes its fork/join costs
    more than the work (``docs/qmargin.md``). The thread count is restored on exit; CUDA is
    unaffected.
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or numel > _SERIAL_MAX:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _sparse_nonzero(mask: Tensor) -> Tensor:
    """Sorted indices of the true entries of a mostly false 1-D bool tensor (``mask.nonzero()``).

    ``nonzero`` costs about a nanosecond per element on CPU whatever the output size; read as
    ``int64`` words of 8 flags it first finds the nonzero words (8× fewer elements), then the
    flags inside those words only.
    """
    pad = (-mask.numel()) % 8
    if pad:
        mask = torch.cat([mask, mask.new_zeros(pad)])
    word = mask.view(torch.int64).nonzero().squeeze(1)
    i, byte = mask.view(-1, 8).index_select(0, word).nonzero().unbind(1)
    return (word.index_select(0, i) * 8).add_(byte)


# Zero tensors of at least this many bytes come from calloc (see _sparse_target_zeros): glibc
# maps them fresh (above its largest mmap threshold, 32 MiB on 64-bit), so they are zero pages.
_CALLOC_MIN_BYTES = 32 << 20
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def _sparse_target_zeros(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor that a sparse gradient is about to be written into.

    ``torch.zeros`` writes every byte; for a large CPU tensor the pages are fresh from the kernel
    (already zero) and the write faults them all in. ``calloc`` (through ``numpy.zeros``) skips
    that: only the pages the support writes to, or that a consumer later reads, get mapped
    (``docs/qmargin.md``, item 9).
    """
    np_dtype = _NUMPY_DTYPES.get(dtype)
    large = shape[0] * shape[1] * dtype.itemsize >= _CALLOC_MIN_BYTES
    if device.type == "cpu" and np_dtype is not None and large:
        return torch.from_numpy(np.zeros(shape, dtype=np_dtype))
    return torch.zeros(shape, dtype=dtype, device=device)
