"""Class-sharded cosine head: each rank owns a slice of the class centres (model parallel).

With 10⁵–10⁷ identities the class centres ``[C, D]``, their gradient, their optimiser state and
the ``[B, C]`` logits outgrow one device. :class:`ShardedCosineHead` splits the classes into
``world_size`` balanced contiguous slices (rank ``r`` owns ``C//W + (r < C%W)`` of them, as
insightface's PartialFC), all-gathers the embeddings with autograd, and returns a
:class:`ShardedCosines`: a plain record of the cosines between the *global* batch and the
*local* centres, the global ids of its columns and its class axis
(:class:`~marginkit.distributed.ShardedAxis`). Every class-level loss of
:mod:`marginkit.losses` reads its input through :func:`marginkit.ops.classes.class_block`, so it
runs on that axis and returns exactly the single-process loss on the concatenated batch
(``docs/distributed.md``): one call site, ``loss(head(embeddings), labels)``, serves
:class:`~marginkit.heads.CosineHead` and :class:`ShardedCosineHead`.

Keep the head **outside** ``DistributedDataParallel`` (its parameters differ per rank; wrap only
the backbone). Checkpoints do not depend on the world size: :meth:`ShardedCosineHead.full_state_dict`
gathers the full ``[C, D]`` weight (the state dict of a ``CosineHead``), and ``load_state_dict``
accepts either that full weight (re-sliced for this rank) or this rank's own slice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from marginkit._validation import choice, positive_int, real
from marginkit.distributed import ShardedAxis, balanced_slices, is_distributed, rank, world_size
from marginkit.distributed._collectives import exchange, gather_rows, gather_rows_with_grad, where_rank
from marginkit.distributed._group import FLOAT_DTYPES, Group, comm_device
from marginkit.heads.cosine import _EPS, centre_shape, class_cosines, embedding_norms, head_arguments
from marginkit.ops.classes import ClassBlock

__all__ = ["ShardedCosineHead", "ShardedCosines", "balanced_slices", "supports_sharding"]

#: Classes per initialisation block: centres are drawn block by block from generators seeded by
#: ``(seed, block)``, so the full weight is the same whatever the world size.
INIT_BLOCK = 4096

_OK, _NOT_TENSOR, _NOT_FLOAT, _BAD_SHAPE, _NOT_FINITE = 0, 1, 2, 3, 4


def _mix(seed: int, block: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + block * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class ShardedCosineHead(nn.Module):
    r"""Cosine classifier whose class centres are split over the ranks of a process group.

    .. math:: c_{bj} = \cos\angle(e_b, w_j),\qquad b \in \text{global batch},\ j \in \text{local slice}

    ``forward(e)`` all-gathers every rank's embeddings ``[B_r, D]`` in rank order (with autograd)
    and returns a :class:`ShardedCosines`; pass it with the *local* labels to
    a class-level loss. Every rank gets the same value, the single-process loss on the
    concatenated batch; call ``backward()`` on it on every rank. The local centres then receive
    exactly :math:`\partial L/\partial W_r`, and the local embeddings
    :math:`\text{world\_size}\cdot\partial L/\partial e` (``grad_reduction="mean"``, what
    ``DistributedDataParallel``'s averaging of the backbone gradients divides away) or exactly
    :math:`\partial L/\partial e` (``grad_reduction="sum"``). Without an initialised process
    group (or with one rank) it is a plain cosine head returning a ``ShardedCosines``.

    Class sampling (``sample_rate < 1``, training mode only; An et al., "Partial FC: Training 10
    Million Identities on a Single Machine", ICCVW 2021): each step, every rank keeps the centres
    of all positive classes of the global batch in its slice plus random negatives, up to
    ``max(1, int(sample_rate · num_local))`` columns; the loss is then the exact loss over the
    sampled classes (non-sampled centres get a zero gradient). ``sample_rate=1`` is exact.

    Memory per rank (float32, ``C_r = C/W``): weights ``4·C_r·D`` bytes, their gradient as much,
    optimiser state ``k·4·C_r·D`` (SGD momentum k = 1, Adam k = 2), logits ``4·B·C_r·ρ`` per
    ``[B, C_r]`` buffer (ρ = sample_rate; the margin-softmax losses hold about three such buffers
    at the peak of a step). See ``docs/distributed.md`` for measured numbers.

    Args:
        num_classes: ``C``, at least the group's world size.
        embedding_dim: ``D ≥ 1``.
        group: process group (default: the world).
        sample_rate: fraction of each slice's centres used per training step, in ``(0, 1]``.
        grad_reduction: ``"mean"`` | ``"sum"``: how the backbone gradients are combined over the
            ranks after backward (``"mean"`` is DistributedDataParallel's averaging).
        seed: initialisation (and sampling) seed. ``None`` draws one from torch's global
            generator on the group's first rank and broadcasts it (a collective).
        sub_centers: ``K ≥ 1`` centres per class (as :class:`~marginkit.heads.CosineHead`:
            ``weight [num_local, K, D]``, the class cosine is the best sub-centre's; a class's
            sub-centres live on the rank that owns the class).
        eps: norm floor (as :class:`~marginkit.heads.CosineHead`).
        device, dtype: of the local centres.

    Shape:
        embeddings ``[B_r, D]`` on rank ``r`` → ``ShardedCosines`` with cosines
        ``[B_0 + … + B_{W-1}, num_local]``.

    Example:
        >>> import torch
        >>> from marginkit.heads import ShardedCosineHead
        >>> from marginkit.losses import CosFaceLoss
        >>> head = ShardedCosineHead(num_classes=10, embedding_dim=4, seed=0)  # 1 process: all classes
        >>> e = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        >>> y = torch.arange(8)
        >>> loss = CosFaceLoss(scale=30.0, margin=0.35)(head(e), y)  # as with a CosineHead
        >>> loss.backward()
        >>> head.full_state_dict()["weight"].shape
        torch.Size([10, 4])
    """

    weight: nn.Parameter

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        group: Group = None,
        sample_rate: float = 1.0,
        *,
        grad_reduction: str = "mean",
        seed: int | None = None,
        sub_centers: int = 1,
        eps: float = _EPS,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_classes, self.embedding_dim, self.eps = head_arguments(num_classes, embedding_dim, eps)
        self.sample_rate = real(sample_rate, "sample_rate", low=0, high=1, open_low=True)
        self.grad_reduction = choice(grad_reduction, "grad_reduction", ("mean", "sum"))
        self.sub_centers = positive_int(sub_centers, "sub_centers")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be None or a non-negative int, got {seed!r}")
        self.group = group
        self.world_size = world_size(group)
        self.rank = rank(group)
        if self.num_classes < self.world_size:
            raise ValueError(
                f"num_classes must be at least the number of ranks sharing the head: got num_classes="
                f"{self.num_classes} for a group of {self.world_size} ranks (every rank needs a class)"
            )
        self.class_offset, self.num_local = balanced_slices(self.num_classes, self.world_size)[self.rank]
        shape = centre_shape(self.num_local, self.sub_centers, self.embedding_dim)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.seed = self._agree_on_seed(seed)
        self._sample_gen: torch.Generator | None = None
        self.last_class_index: Tensor | None = None
        self.reset_parameters()

    # ---------------------------------------------------------------- set-up
    def _agree_on_seed(self, seed: int | None) -> int:
        if seed is not None:
            return seed
        drawn = torch.randint(0, 1 << 62, (1,), dtype=torch.long)
        if is_distributed(self.group):
            drawn = drawn.to(comm_device(self.group, torch.device("cpu")))
            src = 0 if self.group is None else torch.distributed.get_global_rank(self.group, 0)
            torch.distributed.broadcast(drawn, src=src, group=self.group)
        return int(drawn.item())

    def reset_parameters(self) -> None:
        """Centres uniform on the unit sphere, drawn per block of classes from ``(seed, block)``.

        Independent of the world size: the same ``seed`` gives the same full weight on any number
        of ranks, each rank drawing only the blocks that overlap its slice.
        """
        start, stop = self.class_offset, self.class_offset + self.num_local
        with torch.no_grad():  # block by block: the temporary is one block, not the slice
            for block in range(start // INIT_BLOCK, (stop - 1) // INIT_BLOCK + 1):
                gen = torch.Generator().manual_seed(_mix(self.seed, block))
                first = block * INIT_BLOCK
                size = min(INIT_BLOCK, self.num_classes - first)
                shape = centre_shape(size, self.sub_centers, self.embedding_dim)
                values = torch.randn(shape, generator=gen, dtype=torch.float64)
                lo, hi = max(start - first, 0), min(stop - first, size)
                values = values[lo:hi]
                values /= torch.linalg.vector_norm(values, dim=-1, keepdim=True).clamp_min(self.eps)
                self.weight[first + lo - start : first + hi - start].copy_(values)

    def slice_sizes(self) -> list[int]:
        """Every rank's number of classes, in rank order."""
        return [n for _, n in balanced_slices(self.num_classes, self.world_size)]

    # ---------------------------------------------------------------- forward
    def _exchange_and_check(self, embeddings: Any) -> list[int]:
        """Validate the embeddings on every rank together; return every rank's batch size.

        Every rank raises the same error (naming the offending ranks) when any rank's embeddings
        are not a floating ``[B, D]`` tensor with ``D = embedding_dim``, have a different dtype,
        or contain NaN/inf.
        """
        status, shape, dtype_code = _OK, (), -1
        if not isinstance(embeddings, Tensor):
            status = _NOT_TENSOR
        elif not torch.is_floating_point(embeddings) or embeddings.dtype not in FLOAT_DTYPES:
            status, shape = _NOT_FLOAT, tuple(embeddings.shape)
        else:
            shape, dtype_code = tuple(embeddings.shape), FLOAT_DTYPES.index(embeddings.dtype)
            if embeddings.dim() != 2 or embeddings.shape[1] != self.embedding_dim:
                status = _BAD_SHAPE
            elif embeddings.numel() and not bool(torch.isfinite(embeddings).all()):
                status = _NOT_FINITE
        rows = [(status, shape, dtype_code)]
        if is_distributed(self.group):
            device = embeddings.device if isinstance(embeddings, Tensor) else self.weight.device
            dims = [*shape[:3], -1, -1, -1][:3]
            rows = []
            for m in exchange([status, len(shape), *dims, dtype_code], self.group, device):
                dims_r = tuple(m[2 : 2 + min(m[1], 3)]) + (("...",) if m[1] > 3 else ())
                rows.append((m[0], dims_r, m[5]))
        self._raise_embedding_errors(rows, embeddings)
        return [s[0] for _, s, _ in rows]

    def _raise_embedding_errors(self, rows: list[tuple[int, tuple[Any, ...], int]], embeddings: Any) -> None:
        many = len(rows) > 1
        for r, (status, _shape, _) in enumerate(rows):
            where = where_rank(r, len(rows))
            if status == _NOT_TENSOR:
                got = "another type" if many else type(embeddings).__name__
                raise TypeError(f"embeddings{where} must be a torch.Tensor, got {got}")
            if status == _NOT_FLOAT:
                raise TypeError(
                    f"embeddings{where} must be a floating-point tensor (float16/32/64, bfloat16)"
                )
            if status == _NOT_FINITE:
                raise ValueError(f"embeddings{where} contain NaN or infinite values")
        bad = [r for r, (status, _, _) in enumerate(rows) if status == _BAD_SHAPE]
        if bad:
            listed = (
                ", ".join(f"rank {r}: {rows[r][1]}" for r in range(len(rows))) if many else str(rows[0][1])
            )
            raise ValueError(
                f"embeddings must have shape [batch, embedding_dim={self.embedding_dim}]"
                f"{' on every rank' if many else ''}, got {listed}"
            )
        codes = {code for _, _, code in rows}
        if len(codes) > 1:
            listed = ", ".join(f"rank {r}: {FLOAT_DTYPES[c]}" for r, (_, _, c) in enumerate(rows))
            raise TypeError(f"embeddings must have the same dtype on every rank, got {listed}")

    def _sampling(self) -> bool:
        return (
            self.training
            and self.sample_rate < 1.0
            and int(self.sample_rate * self.num_local) < self.num_local
        )

    def forward(self, embeddings: Tensor, *, with_norms: bool = False) -> ShardedCosines:
        """Gather the embeddings ``[B_r, D]`` of every rank; cosines against the local centres.

        The output always carries the global batch's embedding norms (:attr:`ShardedCosines.norms`),
        so ``with_norms`` (accepted for one call site with :class:`~marginkit.heads.CosineHead`)
        changes nothing.
        """
        sizes = self._exchange_and_check(embeddings)
        if is_distributed(self.group):
            scale = float(self.world_size) if self.grad_reduction == "mean" else 1.0
            gathered = gather_rows_with_grad(embeddings, sizes, self.group, scale)
        else:
            gathered = embeddings
        sample = self._sampling()
        return ShardedCosines(
            embeddings=gathered,
            batch_sizes=sizes,
            axis=ShardedAxis(self.group, self.rank, self.world_size, self.num_classes),
            class_offset=self.class_offset,
            num_local=self.num_local,
            cosines=None if sample else self._cosines(gathered, None),
            sample=self._sampled_block if sample else None,
        )

    def logits(self, embeddings: Tensor) -> ShardedCosines:
        """Alias of :meth:`forward` (as :meth:`marginkit.heads.CosineHead.logits`)."""
        return self.forward(embeddings)

    def _cosines(self, embeddings: Tensor, index: Tensor | None) -> Tensor:
        weight = self.weight if index is None else self.weight.index_select(0, index)
        return class_cosines(embeddings, weight, self.eps)

    def _sampled_block(self, embeddings: Tensor, positives: Tensor) -> tuple[Tensor, Tensor]:
        """Sampled columns (sorted local ids) for these local positives, and their cosines."""
        index = self._sample_index(positives)
        return index, self._cosines(embeddings, index)

    @torch.no_grad()
    def _sample_index(self, positives: Tensor) -> Tensor:
        """Sorted local ids: every positive, then random negatives up to the sample size."""
        num_sample = max(1, int(self.sample_rate * self.num_local))
        device = self.weight.device
        positives = torch.unique(positives.to(device))
        if positives.numel() >= num_sample:
            index = positives
        else:
            if self._sample_gen is None or self._sample_gen.device != device:
                self._sample_gen = torch.Generator(device=device).manual_seed(_mix(self.seed, -1 - self.rank))
            score = torch.rand(self.num_local, generator=self._sample_gen, device=device)
            score[positives] = 2.0
            index = torch.topk(score, num_sample).indices.sort().values
        self.last_class_index = index
        return index

    @torch.no_grad()
    def predict(self, embeddings: Tensor) -> Tensor:
        """Class ids ``[B_r]`` (int64) of this rank's embeddings: nearest centre over all ranks.

        Ties go to the lowest class id (as :meth:`CosineHead.predict`). A collective.
        """
        sizes = self._exchange_and_check(embeddings)
        gathered = gather_rows(embeddings, sizes, self.group) if is_distributed(self.group) else embeddings
        best, arg = self._cosines(gathered, None).max(dim=1)
        ids = arg + self.class_offset
        if is_distributed(self.group):
            top = best.clone()
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=self.group)
            ids = torch.where(best == top, ids, self.num_classes)
            torch.distributed.all_reduce(ids, op=torch.distributed.ReduceOp.MIN, group=self.group)
            start = sum(sizes[: self.rank])
            ids = ids[start : start + sizes[self.rank]]
        return ids

    # ---------------------------------------------------------------- checkpoints
    @torch.no_grad()
    def gather_rows(self, local: Tensor) -> Tensor:
        """Concatenate every rank's ``[num_local, ...]`` tensor into ``[num_classes, ...]`` (collective)."""
        if local.shape[:1] != (self.num_local,):
            raise ValueError(
                f"local must have {self.num_local} rows (this rank's classes), got {tuple(local.shape)}"
            )
        if not is_distributed(self.group):
            return local.detach().clone()
        return gather_rows(local.detach(), self.slice_sizes(), self.group)

    def local_rows(self, full: Tensor) -> Tensor:
        """This rank's rows ``[num_local, ...]`` of a full ``[num_classes, ...]`` tensor."""
        if full.shape[:1] != (self.num_classes,):
            raise ValueError(f"full must have num_classes={self.num_classes} rows, got {tuple(full.shape)}")
        return full[self.class_offset : self.class_offset + self.num_local]

    def full_state_dict(self) -> dict[str, Tensor]:
        """``{"weight": [num_classes, D]}`` on every rank: a world-size-independent checkpoint.

        A collective (every rank must call it); the result equals a ``CosineHead``'s state dict,
        and loads into a ``ShardedCosineHead`` on any number of ranks or into a ``CosineHead``.
        """
        return {"weight": self.gather_rows(self.weight)}

    def load_full_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load a :meth:`full_state_dict` (saved on any number of ranks): keep this rank's rows."""
        self.load_state_dict(state_dict)

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "weight"
        value = state_dict.get(key)
        if isinstance(value, Tensor):
            full = centre_shape(self.num_classes, self.sub_centers, self.embedding_dim)
            local = centre_shape(self.num_local, self.sub_centers, self.embedding_dim)
            if tuple(value.shape) == full and full != local:
                state_dict = {**state_dict, key: self.local_rows(value)}
            elif tuple(value.shape) != local:
                error_msgs.append(
                    f"{key}: expected the full weight {list(full)} (saved on any number of ranks) or this "
                    f"rank's slice {list(local)}, got {list(value.shape)}"
                )
                return
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimiser's state for ``weight`` with every per-class tensor gathered to ``[C, ...]``.

        A collective. Works for optimisers whose per-parameter state holds tensors shaped like
        the parameter (SGD momentum, Adam moments) and scalars (Adam's ``step``).
        """
        state = optimizer.state.get(self.weight, {})
        out: dict[str, Any] = {}
        for name in sorted(state):
            value = state[name]
            if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == self.num_local:
                out[name] = self.gather_rows(value)
            else:
                out[name] = value.clone() if isinstance(value, Tensor) else value
        return out

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        """Install a :meth:`full_optimizer_state` (from any world size) for ``weight`` in ``optimizer``."""
        if not any(self.weight is p for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("optimizer does not hold this head's weight")
        local: dict[str, Any] = {}
        for name, value in state.items():
            if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == self.num_classes:
                local[name] = self.local_rows(value).to(self.weight.device).clone()
            else:
                local[name] = value.clone() if isinstance(value, Tensor) else value
        optimizer.state[self.weight] = local

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}, "
            f"classes=[{self.class_offset}, {self.class_offset + self.num_local}), "
            f"rank={self.rank}/{self.world_size}, sample_rate={self.sample_rate:g}, "
            f"grad_reduction={self.grad_reduction!r}"
            + (f", sub_centers={self.sub_centers}" if self.sub_centers > 1 else "")
        )


# ------------------------------------------------------------------------------- the output
_LABEL_OK, _LABEL_NOT_TENSOR, _LABEL_NOT_INT, _LABEL_SHAPE, _LABEL_META = 0, 1, 2, 3, 4
Sampler = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


class ShardedCosines:
    """Output of :class:`ShardedCosineHead`: this rank's block of the cosines, its columns and axis.

    Pass it, with this rank's own labels, to any class-level loss of :mod:`marginkit.losses`:
    ``loss(head(embeddings), labels)``, the same call as with a
    :class:`~marginkit.heads.CosineHead`. The loss asks for :meth:`class_block` (a collective:
    the labels are gathered) and runs on its :attr:`axis`.

    Attributes:
        embeddings: the global batch ``[B, D]`` (all ranks' embeddings in rank order, with
            autograd back to each rank's own rows).
        batch_sizes: every rank's local batch size (``B = sum(batch_sizes)``).
        axis: the class axis (:class:`~marginkit.distributed.ShardedAxis`: group, rank, size).
        rank, world_size, group: this rank's position in the head's process group.
        class_offset: global id of the first local class; the slice is
            ``[class_offset, class_offset + num_local)``.
        num_local, num_classes: local and global class counts.
        class_index: ``None`` (every local class, in order) or, when the head samples classes
            (``sample_rate < 1``, training mode), the sorted local ids of the sampled columns
            (chosen at the first :meth:`class_block`, which knows the labels).
    """

    def __init__(
        self,
        *,
        embeddings: Tensor,
        batch_sizes: list[int],
        axis: ShardedAxis,
        class_offset: int,
        num_local: int,
        cosines: Tensor | None,
        sample: Sampler | None = None,
    ) -> None:
        self.embeddings, self.batch_sizes, self.axis = embeddings, batch_sizes, axis
        self.rank, self.world_size, self.group = axis.rank, axis.world, axis.group
        self.class_offset, self.num_local, self.num_classes = class_offset, num_local, axis.num_classes
        self._cosines, self._sample = cosines, sample
        self.class_index: Tensor | None = None

    @property
    def local_rows(self) -> slice:
        """This rank's rows of the global batch."""
        start = sum(self.batch_sizes[: self.rank])
        return slice(start, start + self.batch_sizes[self.rank])

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)

    @property
    def norms(self) -> Tensor:
        """The norms ``[B]`` of the global batch's embeddings (detached; for AdaFace's margin)."""
        return embedding_norms(self.embeddings)

    @property
    def cosines(self) -> Tensor:
        """The local block ``[B_global, num_local]`` (float32, float64 for float64 inputs).

        With class sampling the block exists only once a loss has chosen the columns.
        """
        if self._cosines is None:
            raise RuntimeError(
                "this ShardedCosines samples its class centres (sample_rate < 1, training mode): "
                "the cosines are computed by the loss, which knows the labels"
            )
        return self._cosines

    @property
    def columns(self) -> Tensor:
        """Global class id of every column of :attr:`cosines`."""
        local = torch.arange(self.num_local, device=self.embeddings.device)
        return self.class_offset + (local if self.class_index is None else self.class_index)

    def __repr__(self) -> str:
        return (
            f"ShardedCosines(global_batch={self.global_batch}, classes=[{self.class_offset}, "
            f"{self.class_offset + self.num_local}) of {self.num_classes}, rank={self.rank}/"
            f"{self.world_size}, sampled={self._sample is not None})"
        )

    def gather_labels(self, labels: Any) -> Tensor:
        """This rank's labels ``[B_local]`` → the global labels ``[B]`` (int64), validated.

        Every rank raises the same error when any rank's labels are malformed or out of
        ``[0, num_classes)`` (a collective: every rank must call it).
        """
        n_local = self.batch_sizes[self.rank]
        device = self.embeddings.device
        status, shape = _LABEL_OK, ()
        if not isinstance(labels, Tensor):
            status = _LABEL_NOT_TENSOR
        elif labels.dtype == torch.bool or torch.is_floating_point(labels) or torch.is_complex(labels):
            status, shape = _LABEL_NOT_INT, tuple(labels.shape)
        elif tuple(labels.shape) != (n_local,):
            status, shape = _LABEL_SHAPE, tuple(labels.shape)
        elif labels.device.type == "meta":
            status = _LABEL_META
        if self.world_size == 1:
            _raise_label_status([(status, shape)], [n_local], labels)
            y = labels.to(device=device, dtype=torch.long)
        else:
            payload = torch.zeros(max(self.batch_sizes), dtype=torch.long, device=device)
            if status == _LABEL_OK:
                payload[:n_local] = labels.to(device=device, dtype=torch.long)
            rows = exchange([status, len(shape), *[*shape[:2], -1, -1][:2]], self.group, device, payload)
            statuses = [
                (m[0], tuple(m[2 : 2 + min(m[1], 2)]) + (("...",) if m[1] > 2 else ())) for m, _ in rows
            ]
            _raise_label_status(statuses, self.batch_sizes, labels)
            y = torch.cat([p[:n] for (_, p), n in zip(rows, self.batch_sizes, strict=True)]).to(device)
        if y.numel():
            lo, hi = int(y.min()), int(y.max())
            if lo < 0 or hi >= self.num_classes:
                bad = int(((y < 0) | (y >= self.num_classes)).nonzero()[0, 0])
                where = int(
                    torch.searchsorted(
                        torch.tensor(self.batch_sizes).cumsum(0), torch.tensor(bad), right=True
                    )
                )
                raise ValueError(
                    f"labels must lie in [0, {self.num_classes}) (num_classes of the head), got values in "
                    f"[{lo}, {hi}]; the first one out of range is on rank {where}"
                )
        return y

    def class_block(self, labels: Any) -> ClassBlock:
        """This rank's :class:`~marginkit.ops.classes.ClassBlock` for these local labels (collective).

        With sampling, the columns are chosen here at the first call (all the local positives of
        the global batch, plus random negatives); later calls must pass the same labels.
        """
        y = self.gather_labels(labels)
        local = y - self.class_offset
        owned = (local >= 0) & (local < self.num_local)
        if self._cosines is None:
            assert self._sample is not None
            self.class_index, self._cosines = self._sample(self.embeddings, local[owned])
        if self.class_index is None:
            column = local
        else:  # positions of the labels among the sampled columns (every positive is sampled)
            index = self.class_index
            column = torch.searchsorted(index, local.clamp(0, self.num_local - 1)).clamp_max(
                index.shape[0] - 1
            )
            if bool((owned & (index[column] != local)).any()):
                raise ValueError(
                    "labels contain classes that were not sampled for this ShardedCosines: the columns "
                    "are sampled (sample_rate < 1) from the labels of the first loss call; pass the same "
                    "labels to every loss applied to one head output"
                )
        column = torch.where(owned, column, 0)
        return ClassBlock(self._cosines, y, column, owned, self.axis, (y.shape[0],))

    @torch.no_grad()
    def gather_cosines(self) -> Tensor:
        """The full ``[B, C]`` cosine matrix on every rank (no gradient; for small ``C``: tests)."""
        cos = self.cosines
        if self.class_index is not None:
            raise RuntimeError("gather_cosines needs every class column (no sampling)")
        if self.world_size == 1:
            return cos.clone()
        sizes = [n for _, n in balanced_slices(self.num_classes, self.world_size)]
        return gather_rows(cos.t(), sizes, self.group).t().contiguous()


def _raise_label_status(statuses: list[tuple[int, tuple[Any, ...]]], sizes: list[int], labels: Any) -> None:
    many = len(statuses) > 1
    for r, (status, shape) in enumerate(statuses):
        where = where_rank(r, len(statuses))
        if status == _LABEL_NOT_TENSOR:
            name = "another type" if many else type(labels).__name__
            raise TypeError(f"labels{where} must be a torch.Tensor of integer class ids, got {name}")
        if status == _LABEL_NOT_INT:
            detail = "" if many else f", got dtype {labels.dtype}"
            raise TypeError(f"labels{where} must be an integer tensor{detail}")
        if status == _LABEL_SHAPE:
            raise ValueError(
                f"labels{where} must have shape ({sizes[r]},) (one label per local embedding), "
                f"got shape {shape}"
            )
        if status == _LABEL_META:
            raise ValueError(
                f"labels{where} is on the meta device (a shape without data), so its values cannot be "
                "checked or used; create it on a real device"
            )


def supports_sharding(loss: Any) -> bool:
    """Does ``loss`` read its input through :func:`marginkit.ops.classes.class_block`?

    Such a loss accepts a :class:`ShardedCosineHead`'s output (and then runs on its class axis);
    the class-level losses of :mod:`marginkit.losses` say so with ``reads_class_blocks = True``.
    """
    return bool(getattr(loss, "reads_class_blocks", False))
