r"""Class-sharded losses: the class-dimension reductions of every class-level loss, over ranks.

A :class:`~marginkit.heads.ShardedCosineHead` gives each rank ``r`` a contiguous slice of the
class centres and returns a :class:`ShardedCosines`: the cosines ``[B, C_r]`` between the
*global* batch (embeddings all-gathered with autograd) and the local centres. The class-level
losses (NormSoftmax, CosFace, ArcFace, Q-Margin, Entmax, Sparsemax, ClassCircle) recognise it
and run the versions below, which equal the single-process loss on the concatenated batch up to
rounding. The logits never leave their rank; what travels are ``(global batch, k)`` tensors:

- **softmax type** (NormSoftmax, CosFace, ArcFace, ClassCircle; Q-Margin/Entmax at α = 1): one
  MAX all-reduce of ``[B, 2]`` (the largest non-target logit of the slice, and the target cosine
  from its owner, ``-inf`` elsewhere), then one SUM all-reduce of ``[B]`` (the slice's
  :math:`\sum_{j\ne y} e^{z_j - \mathrm{shift}}`). The target logit ``s·f(c_y)`` is evaluated on
  every rank from the gathered ``c_y``, so the margin's derivative comes from autograd on ``[B]``
  values as in the single-process loss. Backward: local, no communication
  (:math:`\partial\ell/\partial z_j = p_j` on the slice; the owner adds the target term).
  This is PartialFC's scheme (insightface ``partial_fc_v2.py``) with its three all-reduces
  folded into two.
- **alpha losses** (Q-Margin, Entmax, Sparsemax): a global threshold τ. One MAX all-reduce of
  ``[B, 2]`` gives the lower bound :math:`\tau_{lo} = \max(\max_{j\ne y}\theta_j,\ \theta_y - E(q_y))`
  (mass ≥ 1) and ``θ_y``; every rank then keeps its exact candidates
  :math:`\theta_j > \tau_{lo} - 1/(\alpha-1)` (SPEC §2), and a safeguarded Newton iteration on
  :math:`h(\tau) = (M(\tau)^{\alpha-1} - 1)/(\alpha-1)` runs identically on every rank, each step
  SUM-all-reducing ``[B, 4]``: the mass :math:`M = \sum_j p_j`, the slope :math:`\sum_j w_j`,
  :math:`\sum_j p_j(\theta_j - \theta_y)` and the support size (the last two make the loss
  value free after the last step). Backward: :math:`\partial\ell/\partial c_j = s(p_j - \delta_{jy})`
  on the slice, local.

Gradient convention (documented in ``docs/distributed.md``): every rank returns the *same*
value, the single-process loss on the concatenated batch (a scalar, or ``[B_global]`` with
``reduction="none"``), and must use it identically (e.g. call ``backward()`` on it). The local
class centres then get exactly :math:`\partial L/\partial W_r`, and the local embeddings get
:math:`\partial L/\partial e` times ``world_size`` when the head's ``grad_reduction="mean"``
(what ``DistributedDataParallel``'s gradient averaging divides away) or exactly
:math:`\partial L/\partial e` with ``grad_reduction="sum"``.

Every collective issued here goes through :func:`_all_reduce` / :func:`_all_gather`, which
:func:`record_collectives` can count (benchmarks).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from marginkit._validation import COSINE_ATOL, positive_float, reduce

if TYPE_CHECKING:  # pragma: no cover
    from marginkit.heads.sharded import ShardedCosineHead

__all__ = [
    "CommStats",
    "ShardedCosines",
    "gather_rows_with_grad",
    "record_collectives",
    "sharded_loss",
    "supports_sharding",
]

Group = Any

# Newton on the global τ: the convergence rule of marginkit.ops.alpha (|step| ≤ 4 ulp·(1 + |τ|)),
# its iteration caps, and its schedule of convergence checks (one host read every 2 iterations
# from the 4th: the flag travels inside the SUM all-reduce, so the check costs no extra collective).
_TOL_ULPS = 4.0
_FIRST_CHECK = 4
_CHECK_EVERY = 2


# --------------------------------------------------------------------------------------------
# Collectives (recorded)
# --------------------------------------------------------------------------------------------


@dataclass
class CommStats:
    """Collectives issued by the sharded head/losses: calls and payload bytes per kind.

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
    """Count the collectives the sharded head and losses issue inside the ``with`` block."""
    stats = CommStats()
    _RECORDERS.append(stats)
    try:
        yield stats
    finally:
        _RECORDERS.remove(stats)


def _record(kind: str, nbytes: int) -> None:
    for stats in _RECORDERS:
        stats.add(kind, nbytes)


def _all_reduce(tensor: Tensor, op: str, group: Group) -> Tensor:
    """In-place all-reduce (``op`` "sum" or "max"); returns ``tensor``."""
    _record(f"all_reduce_{op}", tensor.numel() * tensor.element_size())
    ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}
    torch.distributed.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def _all_gather(tensor: Tensor, world: int, group: Group) -> list[Tensor]:
    """Every rank's ``tensor`` (equal shapes), in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(world)]
    _record("all_gather", world * tensor.numel() * tensor.element_size())
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _gather_padded(tensor: Tensor, sizes: list[int], group: Group) -> Tensor:
    """Concatenate each rank's rows (``sizes[r]`` of them) in rank order (pad, gather, trim)."""
    longest = max(sizes)
    send = tensor
    if send.shape[0] < longest:
        send = torch.cat([send, send.new_zeros((longest - send.shape[0], *send.shape[1:]))])
    parts = _all_gather(send, len(sizes), group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


class _GatherRows(torch.autograd.Function):
    """All-gather rows with autograd; backward: SUM all-reduce, own rows, times ``grad_scale``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: Tensor, sizes: list[int], me: int, group: Group, grad_scale: float
    ) -> Tensor:
        ctx.start = sum(sizes[:me])
        ctx.stop = ctx.start + sizes[me]
        ctx.group, ctx.grad_scale = group, grad_scale
        return _gather_padded(tensor.contiguous(), sizes, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        total = _all_reduce(grad.contiguous().clone(), "sum", ctx.group)
        mine = total[ctx.start : ctx.stop]
        if ctx.grad_scale != 1.0:
            mine = mine * ctx.grad_scale
        return mine, None, None, None, None


def gather_rows_with_grad(
    tensor: Tensor, sizes: list[int], me: int, group: Group, grad_scale: float = 1.0
) -> Tensor:
    """All-gather ``tensor``'s rows (known per-rank ``sizes``) keeping gradients.

    The backward pass sums the gradient over ranks (the gradient of the sum of the per-rank
    objectives) and multiplies this rank's rows by ``grad_scale``.
    """
    return _GatherRows.apply(tensor, sizes, me, group, grad_scale)


def comm_device(group: Group, fallback: torch.device) -> torch.device:
    """Device for small control tensors: CUDA for NCCL, otherwise ``fallback``."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


# --------------------------------------------------------------------------------------------
# The head's output
# --------------------------------------------------------------------------------------------

_LABEL_OK, _LABEL_NOT_TENSOR, _LABEL_NOT_INT, _LABEL_SHAPE = 0, 1, 2, 3


class ShardedCosines:
    """Output of :class:`~marginkit.heads.ShardedCosineHead`: this rank's block of the cosines.

    Pass it, with this rank's own labels, to any class-level loss of :mod:`marginkit.losses`:
    ``loss(head(embeddings), labels)``, the same call as with a
    :class:`~marginkit.heads.CosineHead`.

    Attributes:
        embeddings: the global batch ``[B, D]`` (all ranks' embeddings in rank order, with
            autograd back to each rank's own rows).
        batch_sizes: every rank's local batch size (``B = sum(batch_sizes)``).
        rank, world_size, group: this rank's position in the head's process group.
        class_offset: global id of the first local class; the slice is
            ``[class_offset, class_offset + num_local)``.
        num_local, num_classes: local and global class counts.
        class_index: ``None`` (every local class, in order) or, when the head samples classes
            (``sample_rate < 1``, training mode), the sorted local ids of the sampled columns
            (set by the loss, which knows the labels).
    """

    def __init__(
        self,
        *,
        head: ShardedCosineHead,
        embeddings: Tensor,
        batch_sizes: list[int],
        cosines: Tensor | None,
        sample: bool,
    ) -> None:
        self.head = head
        self.embeddings = embeddings
        self.batch_sizes = batch_sizes
        self.rank, self.world_size, self.group = head.rank, head.world_size, head.group
        self.class_offset, self.num_local, self.num_classes = (
            head.class_offset,
            head.num_local,
            head.num_classes,
        )
        self._cosines = cosines
        self._sample = sample
        self.class_index: Tensor | None = None

    # -- shape information ----------------------------------------------------------------
    @property
    def local_rows(self) -> slice:
        """This rank's rows of the global batch."""
        start = sum(self.batch_sizes[: self.rank])
        return slice(start, start + self.batch_sizes[self.rank])

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

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

    def __repr__(self) -> str:
        return (
            f"ShardedCosines(global_batch={self.global_batch}, classes=[{self.class_offset}, "
            f"{self.class_offset + self.num_local}) of {self.num_classes}, rank={self.rank}/"
            f"{self.world_size}, sampled={self._sample})"
        )

    # -- labels ---------------------------------------------------------------------------
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
        if not self.distributed:
            _raise_label_status([(status, shape)], [n_local], type(labels).__name__, labels)
            y = labels.to(device=device, dtype=torch.long)
        else:
            longest = max(self.batch_sizes)
            send = torch.zeros(longest + 4, dtype=torch.long, device=comm_device(self.group, device))
            if status == _LABEL_OK:
                send[:n_local] = labels.to(device=send.device, dtype=torch.long)
            dims = [*shape[:2], -1, -1][:2]
            send[longest:] = torch.tensor([status, len(shape), *dims], dtype=torch.long)
            parts = _all_gather(send, self.world_size, self.group)
            meta = [p[longest:].tolist() for p in parts]
            statuses = [(m[0], tuple(m[2 : 2 + min(m[1], 2)]) + (("...",) if m[1] > 2 else ())) for m in meta]
            _raise_label_status(statuses, self.batch_sizes, type(labels).__name__, labels)
            y = torch.cat([p[:n] for p, n in zip(parts, self.batch_sizes, strict=True)]).to(device)
        if y.numel():
            lo, hi = int(y.min()), int(y.max())
            if lo < 0 or hi >= self.num_classes:
                bad = ((y < 0) | (y >= self.num_classes)).nonzero()[0, 0].item()
                ends = torch.tensor(self.batch_sizes).cumsum(0)
                where = int(torch.searchsorted(ends, torch.tensor(bad), right=True))
                raise ValueError(
                    f"labels must lie in [0, {self.num_classes}) (num_classes of the head), got values in "
                    f"[{lo}, {hi}]; the first one out of range is on rank {where}"
                )
        return y

    # -- columns --------------------------------------------------------------------------
    def _block(self, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Cosine block, and per row: does this rank own the label's column, and which column.

        ``labels`` are the global labels. With sampling, the columns are chosen here (all the
        local positives of the global batch, plus random negatives) and ``class_index`` is set.
        """
        local = labels - self.class_offset
        owned = (local >= 0) & (local < self.num_local)
        if self._cosines is None:
            self.class_index = self.head._sample_index(local[owned])
            self._cosines = self.head._cosines(self.embeddings, self.class_index)
        if self.class_index is None:
            col = local
        else:  # positions of the labels among the sampled columns (every positive is sampled)
            index = self.class_index
            col = torch.searchsorted(index, local.clamp(0, self.num_local - 1)).clamp_max(index.shape[0] - 1)
            if bool((owned & (index[col] != local)).any()):
                raise ValueError(
                    "labels contain classes that were not sampled for this ShardedCosines: the columns "
                    "are sampled (sample_rate < 1) from the labels of the first loss call; pass the same "
                    "labels to every loss applied to one head output"
                )
        col = torch.where(owned, col, 0)
        return self._cosines, owned, col

    @torch.no_grad()
    def gather_cosines(self) -> Tensor:
        """The full ``[B, C]`` cosine matrix on every rank (no gradient; for small ``C``: tests)."""
        cos = self.cosines
        if self.class_index is not None:
            raise RuntimeError("gather_cosines needs every class column (no sampling)")
        if not self.distributed:
            return cos.clone()
        sizes = self.head.slice_sizes()
        return _gather_padded(cos.t().contiguous(), sizes, self.group).t().contiguous()


def _raise_label_status(
    statuses: list[tuple[int, tuple[Any, ...]]], sizes: list[int], local_type: str, labels: Any
) -> None:
    for r, (status, shape) in enumerate(statuses):
        where = f" on rank {r}" if len(statuses) > 1 else ""
        if status == _LABEL_NOT_TENSOR:
            name = local_type if len(statuses) == 1 else "another type"
            raise TypeError(f"labels{where} must be a torch.Tensor of integer class ids, got {name}")
        if status == _LABEL_NOT_INT:
            detail = f", got dtype {labels.dtype}" if len(statuses) == 1 else ""
            raise TypeError(f"labels{where} must be an integer tensor{detail}")
        if status == _LABEL_SHAPE:
            raise ValueError(
                f"labels{where} must have shape ({sizes[r]},) (one label per local embedding), "
                f"got shape {shape}"
            )


# --------------------------------------------------------------------------------------------
# Softmax-type: cross-entropy with a target logit t(c_y) and non-target logits z(c_j)
# --------------------------------------------------------------------------------------------


def _flags_buffer(cos: Tensor, me: int, world: int) -> Tensor:
    """``[world]`` with 1 at this rank if its cosines are non-finite or outside [-1, 1] (+atol)."""
    flags = cos.new_zeros(world)
    if cos.numel():
        lo, hi = cos.amin(), cos.amax()
        bad = ~(torch.isfinite(lo) & torch.isfinite(hi) & (lo >= -1 - COSINE_ATOL) & (hi <= 1 + COSINE_ATOL))
        flags[me] = bad.to(cos.dtype)
    return flags


def _raise_flags(flags: Tensor, name: str = "cosines") -> None:
    bad = (flags > 0).nonzero().flatten().tolist()
    if bad:
        ranks = ", ".join(map(str, bad))
        where = f" on rank {ranks}" if flags.numel() > 1 else ""
        raise ValueError(
            f"{name} must be finite cosines in [-1, 1] (up to rounding){where}: NaN/inf or out-of-range "
            "values (check the embeddings and the class centres)"
        )


def _write_owned(buf: Tensor, col: Tensor, owned: Tensor, values: Tensor) -> None:
    """``buf[b, col[b]] = values[b]`` for the owned rows only (no host sync, no row selection)."""
    idx = col.unsqueeze(1)
    current = buf.gather(1, idx).squeeze(1)
    buf.scatter_(1, idx, torch.where(owned, values.to(buf.dtype), current).unsqueeze(1))


@dataclass(frozen=True)
class _Logits:
    """Non-target logits: ``z = scale·c`` or, circle, ``z = γ[c + m]_+ (c − m)`` (weight detached)."""

    kind: str  # "scaled" | "circle"
    scale: float
    margin: float = 0.0

    def values(self, cos: Tensor) -> Tensor:
        if self.kind == "scaled":
            return torch.mul(cos, self.scale)
        return (cos + self.margin).clamp_min_(0.0).mul_(cos - self.margin).mul_(self.scale)

    def slope(self, cos: Tensor) -> Tensor | float:
        if self.kind == "scaled":
            return self.scale
        return (cos + self.margin).clamp_min(0.0).mul_(self.scale)


class _ShardedSoftmaxCE(torch.autograd.Function):
    """Per-example ``-log p_y`` over all ranks' classes, ``[B]``, identical on every rank."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        cos: Tensor,
        owned: Tensor,
        col: Tensor,
        logits: _Logits,
        target_fn: Callable[[Tensor], Tensor],
        flags: Tensor,
        sc: ShardedCosines,
    ) -> Tensor:
        n = cos.shape[0]
        neg_inf = torch.full_like(cos[:, 0], -math.inf)
        c_y = torch.where(owned, cos.gather(1, col.unsqueeze(1)).squeeze(1), neg_inf)
        buf = logits.values(cos)
        _write_owned(buf, col, owned, neg_inf)  # target column out of the non-target max/sum
        packed = torch.cat([buf.amax(dim=1), c_y, flags])
        if sc.distributed:
            _all_reduce(packed, "max", sc.group)
        _raise_flags(packed[2 * n :])
        rest_max, c_y = packed[:n], packed[n : 2 * n]
        with torch.enable_grad():  # the margin's derivative: autograd on the [B] target cosines
            leaf = c_y.detach().requires_grad_(True)
            t_val = target_fn(leaf)
            (dt,) = torch.autograd.grad(t_val, leaf, torch.ones_like(t_val))
        t = t_val.detach()
        shift = torch.maximum(rest_max, t)  # the exact row max of all logits, target included
        buf.sub_(shift.unsqueeze(1)).exp_()  # the target column is exp(-inf) = 0
        rest = buf.sum(dim=1)
        if sc.distributed:
            _all_reduce(rest, "sum", sc.group)
        z = rest.log() + shift - t
        loss = torch.logaddexp(z, torch.zeros_like(z))  # exact softplus, as the unsharded loss
        inv_total = (rest + torch.exp(t - shift)).reciprocal()
        d_target = torch.sigmoid(z) * dt  # (1 − p_y)·t'(c_y)
        ctx.save_for_backward(cos, owned, col, shift, inv_total, d_target)
        ctx.logits = logits
        ctx.buf = buf if ctx.needs_input_grad[0] else None
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        cos, owned, col, shift, inv_total, d_target = ctx.saved_tensors
        logits: _Logits = ctx.logits
        grad = grad.to(cos.dtype)
        buf, ctx.buf = ctx.buf, None
        if buf is None:  # second backward (retain_graph): recompute exp(z_j − shift)
            buf = logits.values(cos).sub_(shift.unsqueeze(1)).exp_()
        grad_cos = buf.mul_((grad * inv_total).unsqueeze(1))  # p_j·g
        grad_cos.mul_(logits.slope(cos))
        _write_owned(grad_cos, col, owned, -grad * d_target)
        return grad_cos, None, None, None, None, None, None


def _softmax_type(
    sc: ShardedCosines,
    labels: Any,
    logits: _Logits,
    target_fn: Callable[[Tensor], Tensor],
    clamp: bool = False,
) -> Tensor:
    y = sc.gather_labels(labels)
    cos, owned, col = sc._block(y)
    if y.numel() == 0:
        return cos.sum(dim=1)
    flags = _flags_buffer(cos.detach(), sc.rank, sc.world_size)  # before any clamp
    if clamp:
        cos = cos.clamp(-1.0, 1.0)
    return _ShardedSoftmaxCE.apply(cos, owned, col, logits, target_fn, flags, sc)


# --------------------------------------------------------------------------------------------
# Alpha losses: a global τ
# --------------------------------------------------------------------------------------------


def _offset(logq: Tensor | float, beta: float) -> Tensor | float:
    """``E(q) = (q^{-β} − 1)/β`` from ``log q`` (as :func:`marginkit.ops.alpha._offset`)."""
    if isinstance(logq, Tensor):
        return torch.expm1(-beta * logq) / beta
    return math.expm1(-beta * logq) / beta


class _Candidates:
    """This rank's candidate entries (flat): row, flat index, θ, β·θ, ``log q`` (label override)."""

    def __init__(self, row: Tensor, flat: Tensor, theta: Tensor, logq: Tensor | None, beta: float, n: int):
        self.row, self.flat, self.theta, self.logq = row, flat, theta, logq
        self.beta, self.n = beta, n
        self.btheta = theta * beta

    def support(self, tau: Tensor) -> tuple[Tensor, Tensor]:
        """Unnormalised ``p_j`` and ``w_j = −∂p_j/∂τ`` at the per-row ``tau`` (zero off the support)."""
        t = (self.btheta - (self.beta * tau).index_select(0, self.row)).clamp_min_(-1.0)
        e = torch.log1p(t).mul_(1.0 / self.beta)
        if self.logq is not None:
            e += self.logq
        p = e.exp_()
        w = torch.div(p, t.add_(1.0)).nan_to_num_(nan=0.0, posinf=math.inf)
        return p, w

    def stats(self, tau: Tensor, theta_y: Tensor) -> Tensor:
        """Per row ``[n, 4]``: mass, slope, Σ p_j(θ_j − θ_y), support size (this rank's part)."""
        p, w = self.support(tau)
        on = p > 0
        spread = torch.where(on, self.theta - theta_y.index_select(0, self.row), 0.0)
        cols = torch.stack([p, w, p * spread, on.to(p.dtype)], dim=1)
        return p.new_zeros(self.n, 4).index_add_(0, self.row, cols)


class _ShardedAlphaFY(torch.autograd.Function):
    """Alpha-divergence Fenchel–Young loss on θ = s·c with q_y = e^{log_q_y}, over all ranks."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        cos: Tensor,
        owned: Tensor,
        col: Tensor,
        alpha: float,
        scale: float,
        log_q_y: float,
        flags: Tensor,
        sc: ShardedCosines,
    ) -> tuple[Tensor, Tensor]:
        n, n_local = cos.shape
        beta = alpha - 1.0
        cdt = cos.dtype
        neg_inf = torch.full_like(cos[:, 0], -math.inf)
        c_y = torch.where(owned, cos.gather(1, col.unsqueeze(1)).squeeze(1), neg_inf)
        # Largest non-target cosine of the slice without a [B, C] temporary: the row max unless
        # the (owned) label holds it; only those rows need the second largest.
        top = cos.amax(dim=1)
        label_is_max = owned & (c_y >= top)
        others = top
        if bool(label_is_max.any()):
            second = cos.topk(2, dim=1).values[:, 1] if n_local > 1 else neg_inf
            others = torch.where(label_is_max, second, top)
        packed = torch.cat([others, c_y, flags])
        if sc.distributed:
            _all_reduce(packed, "max", sc.group)
        _raise_flags(packed[2 * n :])
        theta_others, theta_y = packed[:n] * scale, packed[n : 2 * n] * scale
        e_y = _offset(log_q_y, beta)  # ≥ 0: the label's p_y reaches 1 at τ = θ_y − E(q_y)
        lo = torch.maximum(theta_others, theta_y - e_y)
        # τ_hi = max θ − E(Σ q) with Σ q = C − 1 + q_y (any larger total is a valid bound too,
        # e.g. when the head samples classes): the mass at τ_hi is ≤ 1.
        total_q = torch.tensor(sc.num_classes - 1 + math.exp(log_q_y), dtype=cdt, device=cos.device)
        hi = torch.maximum(torch.maximum(theta_others, theta_y) - _offset(total_q.log(), beta), lo)

        # Exact candidates θ_j > τ_lo − 1/β, threshold lowered by a few ulps (as ops.alpha).
        eps = torch.finfo(cdt).eps
        thr = (lo - 1.0 / beta) / scale
        thr = thr - 8 * eps * (thr.abs() + 1.0 / (beta * scale))
        flat = (cos > thr.unsqueeze(1)).reshape(-1).nonzero().squeeze(1)
        row = flat // n_local
        theta = cos.reshape(-1).index_select(0, flat) * scale
        logq = None
        if log_q_y != 0.0:
            target = owned.index_select(0, row) & (flat - row * n_local == col.index_select(0, row))
            logq = target.to(cdt).mul_(log_q_y)
        cand = _Candidates(row, flat, theta, logq, beta, n)
        tau, stats = _global_newton(cand, lo, hi, theta_y, beta, sc)
        mass, inner, support = stats[:, 0], stats[:, 2], stats[:, 3]
        inv_alpha = 1.0 / alpha
        loss = ((1.0 - inv_alpha) * inner / mass + (tau - theta_y + e_y) * inv_alpha).clamp_min_(0.0)
        p, _ = cand.support(tau)
        p = p / mass.index_select(0, row)
        ctx.save_for_backward(p, flat, row, owned, col)
        ctx.shape, ctx.scale = cos.shape, scale
        support = support.round().long()
        ctx.mark_non_differentiable(support)
        return loss, support

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor, _grad_support: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        p, flat, row, owned, col = ctx.saved_tensors
        gs = grad.to(p.dtype) * ctx.scale
        grad_cos = p.new_zeros(ctx.shape)
        grad_cos.view(-1).index_copy_(0, flat, p * gs.index_select(0, row))  # s·g·p_j
        grad_cos.scatter_add_(1, col.unsqueeze(1), torch.where(owned, -gs, 0.0).unsqueeze(1))  # −s·g·e_y
        return grad_cos, None, None, None, None, None, None, None


def _global_newton(
    cand: _Candidates, lo: Tensor, hi: Tensor, theta_y: Tensor, beta: float, sc: ShardedCosines
) -> tuple[Tensor, Tensor]:
    r"""Safeguarded Newton for :math:`M(\tau) = 1` on every rank at once (``marginkit.ops.alpha._find_tau``).

    Each evaluation SUM-all-reduces ``[B, 4]`` (mass, slope, inner sum, support) plus the number
    of unconverged rows, so every rank takes the same steps and leaves the loop together.
    For ``α > 2`` a row whose bracket did not halve in three iterations is bisected.
    Returns τ and the all-reduced statistics at τ.
    """
    n = lo.shape[0]
    eps = torch.finfo(lo.dtype).eps
    max_iter = 100 if lo.dtype != torch.float64 else 200
    tol = _TOL_ULPS * eps
    hybrid = beta > 1
    done = torch.zeros_like(lo, dtype=torch.bool)

    def evaluate(x: Tensor) -> tuple[Tensor, Tensor]:
        local = cand.stats(x, theta_y).reshape(-1)
        packed = torch.cat([local, (~done).sum().to(local.dtype).reshape(1)])
        if sc.distributed:
            _all_reduce(packed, "sum", sc.group)
        return packed[:-1].reshape(n, 4), packed[-1]

    x = lo
    stats, _ = evaluate(x)
    force = torch.zeros_like(done)
    width_ref = hi - lo
    for it in range(1, max_iter + 1):
        mass, slope = stats[:, 0], stats[:, 1]
        step = mass * (-torch.expm1(-beta * mass.log()) / beta) / slope  # −h/h′
        proposal = x + step
        bisect = ~((proposal >= lo) & (proposal <= hi)) | force
        proposal = torch.where(bisect, 0.5 * (lo + hi), proposal)
        tol_x = tol * (1.0 + x.abs())
        converged = ((step.abs() <= tol_x) & ~bisect) | (hi - lo <= tol_x)
        done = done | converged
        x = torch.where(done, x, proposal)
        stats, unconverged = evaluate(x)
        above = stats[:, 0] >= 1
        lo = torch.where(above & ~done, x, lo)
        hi = torch.where(~above & ~done, x, hi)
        if hybrid and it % 3 == 0:
            width = hi - lo
            force = width > 0.5 * width_ref
            width_ref = width
        if it >= _FIRST_CHECK and (it - _FIRST_CHECK) % _CHECK_EVERY == 0 and float(unconverged) == 0:
            break
    return x, stats


def _alpha_type(
    sc: ShardedCosines, labels: Any, alpha: float, scale: float, margin: float
) -> tuple[Tensor, Tensor]:
    y = sc.gather_labels(labels)
    cos, owned, col = sc._block(y)
    if y.numel() == 0:
        return cos.sum(dim=1), torch.zeros(0, dtype=torch.long, device=cos.device)
    flags = _flags_buffer(cos.detach(), sc.rank, sc.world_size)
    if alpha == 1.0:  # softmax(θ + log q): CosFace with scale s and margin m
        loss = _ShardedSoftmaxCE.apply(
            cos, owned, col, _Logits("scaled", scale), lambda c: scale * c - scale * margin, flags, sc
        )
        return loss, torch.full_like(y, sc.num_classes)
    from marginkit.ops.alpha import _offset_overflows

    if _offset_overflows(cos.dtype, alpha - 1.0, -scale * margin):  # as the single-process loss
        cos = cos.double()  # the same decision on every rank (it depends on hyper-parameters only)
    return _ShardedAlphaFY.apply(cos, owned, col, float(alpha), scale, -scale * margin, flags, sc)


# --------------------------------------------------------------------------------------------
# Dispatch from the loss modules
# --------------------------------------------------------------------------------------------


def supports_sharding(module: Any) -> bool:
    """Whether :func:`sharded_loss` accepts ``module`` (the class-level losses listed there)."""
    from marginkit.losses.alpha import _AlphaCosineLoss
    from marginkit.losses.circle import ClassCircleLoss
    from marginkit.losses.margin_softmax import _MarginSoftmaxBase

    return isinstance(module, (_MarginSoftmaxBase, _AlphaCosineLoss, ClassCircleLoss))


def sharded_loss(module: Any, cosines: ShardedCosines, labels: Any) -> Tensor:
    """Run ``module`` (a class-level loss of :mod:`marginkit.losses`) on a sharded head's output.

    Returns the single-process loss on the concatenated batch, identical on every rank: a scalar
    for ``reduction="mean"``/``"sum"``, ``[B_global]`` for ``"none"``. A collective: every rank
    of the head's group must call it.
    """
    from marginkit.losses.alpha import _AlphaCosineLoss
    from marginkit.losses.circle import ClassCircleLoss
    from marginkit.losses.margin_softmax import _MarginSoftmaxBase

    if isinstance(module, _MarginSoftmaxBase):
        module._check_hyper()
        scale = float(module.scale)
        target = module.target
        loss = _softmax_type(cosines, labels, _Logits("scaled", scale), lambda c: scale * target(c))
    elif isinstance(module, _AlphaCosineLoss):
        alpha, scale, margin = module._check_hyper()
        loss, support = _alpha_type(cosines, labels, alpha, scale, margin)
        module.last_support_size = support
    elif isinstance(module, ClassCircleLoss):
        margin = positive_float(module.margin, "margin", allow_zero=True)
        gamma = positive_float(module.gamma, "gamma")

        def circle_target(c: Tensor) -> Tensor:
            return gamma * (1.0 + margin - c.detach()).clamp_min(0.0) * (c - (1.0 - margin))

        loss = _softmax_type(cosines, labels, _Logits("circle", gamma, margin), circle_target, clamp=True)
    else:
        raise TypeError(
            f"{type(module).__name__} does not support a ShardedCosineHead's output; the class-level "
            "losses NormSoftmaxLoss, CosFaceLoss, ArcFaceLoss, QMarginLoss, EntmaxLoss, SparsemaxLoss "
            "and ClassCircleLoss do"
        )
    return reduce(loss, module.reduction)
