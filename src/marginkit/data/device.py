"""The one step from a batch in its source's dtype to the model's input, on the device.

Batches travel as their source stores them (``uint8`` pixels: a quarter of float32's bytes) from
the reader to the device: :func:`to_model_input` copies them (``non_blocking``: asynchronous from
pinned memory) and converts there, on the whole batch:

    x_model = (float32(x) / 255 − mean) / std     (uint8 images)
    x_model = (float32(x) − mean) / std           (floating inputs)

with ``mean`` / ``std`` only when given. ``float32(x) / 255`` is a correctly rounded IEEE division
on every device, so it equals numpy's ``x.astype(float32) / float32(255)`` bit for bit (the values
the in-memory path held before uint8 storage; ``tests/test_loading.py`` checks all 256). Training,
evaluation, ``embed`` and ``predict`` all go through it; augmentation runs after it, on the
converted batch (:mod:`marginkit.data.augment`).

:func:`prefetched` keeps the next batch's copy in flight while the current one trains. Copies go
on the current stream: the training step reads nothing back, so the host runs ahead of the device
and the copy of batch ``i + 1`` is queued behind step ``i`` (a side stream would need
``Tensor.record_stream`` for the allocator not to reuse a batch's memory too early: timm's and
arcface_torch's prefetchers rely on a per-step read instead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["prefetched", "to_model_input"]

T = TypeVar("T")


def to_model_input(
    x: torch.Tensor,
    device: torch.device | str | None = None,
    *,
    mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` (``uint8`` or floating, any shape ``[B, ...]``) as float32 model input on ``device``.

    ``uint8`` is scaled by 1/255 (by division: bit-identical to numpy's); floating inputs are cast
    to float32; ``mean`` / ``std`` (broadcastable to a sample) standardise after that. The copy
    to ``device`` is ``non_blocking`` (asynchronous when ``x`` is in pinned memory) and carries the
    source's dtype, not float32.
    """
    if device is not None:
        x = x.to(device, non_blocking=True)
    # (a streamed image batch is a channels-last view: the conversion makes it contiguous)
    if x.dtype == torch.uint8:
        x = x.to(torch.float32, memory_format=torch.contiguous_format).div_(255.0)
    elif x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32, memory_format=torch.contiguous_format)
    if mean is not None:
        x = x - mean.to(x.device, torch.float32)
    if std is not None:
        x = x / std.to(x.device, torch.float32)
    return x


def prefetched(batches: Iterable[T], move: Callable[[T], Any]) -> Iterator[Any]:
    """``move(b)`` for each of ``batches``, the next one moved before the current one is yielded
    (its host-to-device copy is queued while the current batch trains)."""
    it = iter(batches)
    try:
        ahead = move(next(it))
    except StopIteration:
        return
    for batch in it:
        current, ahead = ahead, move(batch)
        yield current
    yield ahead
