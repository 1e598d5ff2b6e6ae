"""Data-parallel training for :func:`marginkit.train.train` (``torchrun`` / ``marginkit train --nproc``).

Under ``torchrun --nproc_per_node N`` (environment ``WORLD_SIZE > 1``) the trainer runs the
*same* optimisation as one process, split over the ranks (``docs/distributed.md``):

- every rank builds the same seeded global batch and takes a contiguous share of it (shares
  differ by at most one sample); concatenated in rank order they are the one-process batch;
- the backbone is wrapped in ``DistributedDataParallel`` (gradients averaged);
- class-level losses get a :class:`~marginkit.heads.ShardedCosineHead` (each rank owns a slice of
  the class centres, initialised from the one-process head's weights) whose losses return the
  one-process value; a class loss without a sharded version (MEP) gets a replicated
  ``CosineHead`` (in DDP) on the gathered embeddings; pair losses a
  :class:`~marginkit.losses.GatheredPairLoss`. Every path gives every rank the one-process loss
  and, after DDP's averaging, the one-process gradients;
- gradient clipping uses the global norm (the sharded head's squares are summed over ranks);
- validation, checkpoints (full head weight and optimiser state: resumable on any number of
  ranks) and the final evaluation run once, on rank 0, on the full evaluation sets.

Batch normalisation still normalises each rank's share of the batch (as in any data-parallel
run without synchronised batch norm), and dropout draws differ: those models are not bitwise the
one-process run; BN-free, dropout-free models are, up to float rounding.
"""

from __future__ import annotations

import datetime
import gc
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from marginkit.distributed import _prepare_process_group_init, balanced_slices
from marginkit.distributed._group import comm_device

__all__ = ["DistContext", "init_distributed"]


@dataclass
class DistContext:
    """This process's place in the run's process group (``world == 1``: no group)."""

    rank: int = 0
    world: int = 1
    created: bool = False  # the trainer initialised the group (and destroys it at the end)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable objects)."""
        if not self.active:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when ``flag`` is true on any rank (one MAX all-reduce)."""
        if not self.active:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=comm_device(None, device))
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item() > 0)

    def gather_rows(self, row: Tensor) -> Tensor:
        """Every rank's 1-D ``row`` as ``[world, len(row)]`` (one SUM all-reduce; no host read)."""
        if not self.active:
            return row[None]
        rows = torch.zeros(self.world, row.numel(), dtype=row.dtype, device=comm_device(None, row.device))
        rows[self.rank] = row.to(rows.device)
        torch.distributed.all_reduce(rows, op=torch.distributed.ReduceOp.SUM)
        return rows

    def share(self, n: int) -> slice:
        """This rank's contiguous share of a global batch of ``n`` samples."""
        start, size = balanced_slices(n, self.world)[self.rank]
        return slice(start, start + size)

    def close(self, clean: bool = True) -> None:
        """Destroy the group the trainer created. After a clean run, first wait until every rank
        is done with it (a rank that tears the group down while a peer is still receiving makes
        gloo abort that peer); after an error, at once (the peers may never reach a barrier)."""
        if self.active:
            # Free the DistributedDataParallel wrappers (reference cycles) while the group still
            # exists: destroying the group first makes their teardown abort the process at exit,
            # now and then (gloo, torch 2.x).
            gc.collect()
        if self.created and torch.distributed.is_initialized():
            if clean:
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
            self.created = False


def init_distributed(config: Any) -> DistContext:
    """Join the process group: an initialised one (tests, a caller), or ``torchrun``'s environment.

    Without either (``WORLD_SIZE`` unset or 1), a one-process context. The backend is NCCL when
    the run (``config``, a :class:`~marginkit.train.config.TrainConfig`, or ``None`` for the
    defaults) uses CUDA, gloo otherwise. A group created here times every collective out after
    ``config.collective_timeout`` seconds, and a rank started by torchrun dies with its agent: a
    stalled or vanished peer ends the run instead of hanging it.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return DistContext(torch.distributed.get_rank(), torch.distributed.get_world_size(), False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not torch.distributed.is_available():
        return DistContext()
    from marginkit.train.config import TrainConfig
    from marginkit.train.processes import die_with_parent

    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by a torchrun agent: end with it
        die_with_parent()
    config = config if config is not None else TrainConfig()
    device_name = config.device
    cuda = (device_name in ("cuda", "auto") and torch.cuda.is_available()) or device_name.startswith("cuda:")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _prepare_process_group_init()
    timeout = datetime.timedelta(seconds=float(config.collective_timeout))
    torch.distributed.init_process_group(backend, timeout=timeout)
    return DistContext(torch.distributed.get_rank(), torch.distributed.get_world_size(), True)


# What gloo and NCCL say when a peer does not answer in time, or has gone.
_TIMED_OUT = ("timed out", "timeout")
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


def peer_failure(ctx: DistContext, exc: BaseException) -> str | None:
    """A one-line explanation when ``exc`` is a collective that failed because a peer stalled
    or died; ``None`` for any other error."""
    from marginkit.train.errors import TrainingError

    if not ctx.active or not isinstance(exc, RuntimeError) or isinstance(exc, TrainingError):
        return None
    text = str(exc).lower()
    if any(s in text for s in _TIMED_OUT):
        return (
            f"rank {ctx.rank}: a peer process did not answer within the collective timeout "
            "(it stalled, was stopped or is much slower; see collective_timeout)"
        )
    if any(s in text for s in _PEER_GONE):
        return f"rank {ctx.rank}: a peer process died or closed its connection"
    return None


def run_device(device: torch.device, ctx: DistContext) -> torch.device:
    """One GPU per rank (``LOCAL_RANK``) under torchrun; the CPU is shared."""
    if ctx.active and device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


# ---------------------------------------------------------------------- components
@dataclass
class Parallel:
    """The data-parallel versions of a run's components."""

    model: nn.Module  # forward module (DDP-wrapped backbone)
    head: nn.Module | None  # ShardedCosineHead, a DDP-wrapped CosineHead, or None
    sharded: bool  # the head is a ShardedCosineHead
    loss: Callable[[Any, Tensor], Tensor]  # (head output or embeddings, local labels) -> global loss


def parallelize(
    ctx: DistContext, model: nn.Module, head: nn.Module | None, loss_fn: nn.Module, device: torch.device
) -> tuple[Parallel, nn.Module | None]:
    """Wrap ``model``/``head``/``loss_fn`` for ``ctx``; returns the wrappers and the module whose
    parameters the optimiser updates in place of ``head`` (the sharded head, or ``head``)."""
    if not ctx.active:
        return Parallel(model, head, False, loss_fn), head
    from torch.nn.parallel import DistributedDataParallel

    from marginkit.distributed import GatheredPairLoss, all_gather_no_grad, all_gather_with_grad
    from marginkit.heads.sharded import supports_sharding

    ids = [device.index] if device.type == "cuda" else None
    ddp_model = DistributedDataParallel(model, device_ids=ids)
    if head is None:
        return Parallel(ddp_model, None, False, GatheredPairLoss(loss_fn)), None
    if supports_sharding(loss_fn):
        from marginkit.heads.sharded import ShardedCosineHead

        sharded = ShardedCosineHead(
            head.num_classes, head.embedding_dim, seed=0, eps=head.eps, sub_centers=head.sub_centers
        )
        sharded = sharded.to(device=device, dtype=head.weight.dtype)
        sharded.load_state_dict(head.state_dict())  # the one-process initialisation, re-sliced

        return Parallel(ddp_model, sharded, True, loss_fn), sharded  # loss_fn(head(e), y) as usual
    ddp_head = DistributedDataParallel(head, device_ids=ids)

    def replicated(emb: Tensor, labels: Tensor) -> Tensor:  # every rank: the whole loss
        return loss_fn(ddp_head(all_gather_with_grad(emb)).float(), all_gather_no_grad(labels))

    return Parallel(ddp_model, None, False, replicated), head


def clip_grad_norm(
    ctx: DistContext, params: Iterable[Tensor], sharded_params: Iterable[Tensor], max_norm: float
) -> None:
    """``clip_grad_norm_`` with the global norm: replicated gradients once, sharded ones summed."""
    params = [p for p in params if p.grad is not None]
    shards = [p for p in sharded_params if p.grad is not None]
    if not ctx.active or not shards:
        torch.nn.utils.clip_grad_norm_(params + shards, max_norm)
        return
    device = (params + shards)[0].grad.device
    local = torch.zeros((), dtype=torch.float64, device=device)
    for p in shards:
        local += p.grad.detach().double().square().sum()
    torch.distributed.all_reduce(local)
    total = local
    for p in params:
        total = total + p.grad.detach().double().square().sum()
    coef = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
    for p in params + shards:
        p.grad.detach().mul_(coef.to(p.grad.dtype))


# ---------------------------------------------------------------------- checkpoints
def _param_index(optimizer: torch.optim.Optimizer, param: Tensor) -> int | None:
    i = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p is param:
                return i
            i += 1
    return None


def optimizer_state(optimizer: torch.optim.Optimizer, head: Any, sharded: bool) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the sharded head's state gathered to full ``[C, ...]`` (collective)."""
    state = optimizer.state_dict()
    if sharded:
        index = _param_index(optimizer, head.weight)
        full = head.full_optimizer_state(optimizer)
        if index is not None and full:
            state["state"][index] = full
    return state


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, state: dict[str, Any], head: Any, sharded: bool
) -> None:
    """Inverse of :func:`optimizer_state`, on any number of ranks."""
    optimizer.load_state_dict(state)
    if sharded:
        index = _param_index(optimizer, head.weight)
        full = state["state"].get(index) if index is not None else None
        if full:
            head.load_full_optimizer_state(optimizer, full)


def head_state(head: Any, sharded: bool) -> dict[str, Tensor]:
    """The head's world-size-independent state dict (the full weight; collective when sharded)."""
    if head is None:
        return {}
    return head.full_state_dict() if sharded else head.state_dict()


def evaluation_head(head: Any, sharded: bool, state: dict[str, Tensor]) -> nn.Module | None:
    """A one-process ``CosineHead`` with the full weight, for validation on rank 0."""
    if head is None or not sharded:
        return head
    from marginkit.heads import CosineHead

    plain = CosineHead(head.num_classes, head.embedding_dim, eps=head.eps, sub_centers=head.sub_centers)
    plain = plain.to(device=head.weight.device, dtype=head.weight.dtype)
    plain.load_state_dict(state)
    return plain
