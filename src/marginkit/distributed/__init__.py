r"""Distributed plumbing over ``torch.distributed`` that also works in a single process.

``rank()``, ``world_size()`` and ``is_distributed()`` answer ``0``, ``1``, ``False`` when
``torch.distributed`` is unavailable or no process group is initialised, and every gather below
is then the identity, so the same code runs with and without ``torchrun``. This package is the
one home of the process-group plumbing of marginkit: the communication device, balanced slices,
recorded collectives, gathering rows with gradient, every rank raising the same error, the class
axis of a sharded head (:class:`ShardedAxis`) and :class:`GatheredPairLoss`. It imports no loss.

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

from marginkit.distributed._axis import ShardedAxis
from marginkit.distributed._collectives import (
    CommStats,
    all_gather_no_grad,
    all_gather_with_grad,
    gather_sizes,
    record_collectives,
)
from marginkit.distributed._group import _loopback_interface as _loopback_interface  # for marginkit.cli
from marginkit.distributed._group import (
    _prepare_process_group_init as _prepare_process_group_init,  # for marginkit.train
)
from marginkit.distributed._group import (
    balanced_slices,
    find_free_port,
    is_distributed,
    rank,
    world_size,
)
from marginkit.distributed._pairs import GatheredPairLoss

__all__ = [
    "CommStats",
    "GatheredPairLoss",
    "ShardedAxis",
    "all_gather_no_grad",
    "all_gather_with_grad",
    "balanced_slices",
    "find_free_port",
    "gather_sizes",
    "is_distributed",
    "rank",
    "record_collectives",
    "world_size",
]
