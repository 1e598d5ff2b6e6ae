"""ShardedCosineHead: slices, world-size-independent initialisation and checkpoints, sampling,
errors (one process and a real 3-rank gloo group), gradcheck of the sharded losses' backward."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import marginkit.heads.sharded as sharded_mod
from dist_utils import run_distributed
from marginkit.distributed import record_collectives
from marginkit.heads import CosineHead, ShardedCosineHead, ShardedCosines
from marginkit.heads.cosine import cosine_similarity_matrix
from marginkit.heads.sharded import INIT_BLOCK, balanced_slices
from marginkit.losses import (
    ArcFaceLoss,
    CircleLoss,
    ClassCircleLoss,
    CosFaceLoss,
    EntmaxLoss,
    GatheredPairLoss,
    MEPLoss,
    NormSoftmaxLoss,
    QMarginLoss,
    SparsemaxLoss,
)
from test_distributed_losses import DIM, NUM_CLASSES, SEED
from test_distributed_losses import _worker as losses_worker

# Every class-level loss reads a ShardedCosines through marginkit.ops.classes.class_block.
HOOKED = (
    NormSoftmaxLoss, CosFaceLoss, ArcFaceLoss, ClassCircleLoss, QMarginLoss, EntmaxLoss, SparsemaxLoss,
)  # fmt: skip


def _call(loss, out, labels):
    return loss(out, labels)  # the public call (e.g. MEPLoss: its own error)


def through_both_heads(gen, loss, num_classes=15, dtype=torch.float64):
    """``loss(head(e), labels)`` with a CosineHead and a one-process ShardedCosineHead holding the
    same weights: ``[(value, embedding grad, weight grad)]`` for the plain head, then the sharded."""
    sharded = ShardedCosineHead(num_classes, 6, seed=3, dtype=dtype)
    plain = CosineHead(num_classes, 6, dtype=dtype)
    plain.load_state_dict(sharded.full_state_dict())
    e = torch.randn(9, 6, generator=gen, dtype=dtype)
    y = torch.randint(0, num_classes, (9,), generator=gen)
    results = []
    for head in (plain, sharded):
        x = e.clone().requires_grad_(True)
        value = loss(head(x), y)
        value.sum().backward()
        results.append((value.detach(), x.grad, head.weight.grad))
    return results


@pytest.mark.parametrize("loss_type", HOOKED, ids=lambda t: t.__name__)
def test_one_call_site_serves_both_heads(gen, loss_type):
    """``loss(head(e), labels)`` with a CosineHead and a (one-process) ShardedCosineHead."""
    results = through_both_heads(gen, loss_type())
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("alpha", "scale", "margin"), [(3.0, 64.0, 0.7), (2.0, 64.0, 1.5)])
def test_sharded_qmargin_whose_measure_overflows_float32(gen, alpha, scale, margin):
    """Like the one-process loss, the sharded Q-Margin computes in float64 there (no inf)."""
    loss = QMarginLoss(alpha=alpha, scale=scale, margin=margin, reduction="none")
    results = through_both_heads(gen, loss, num_classes=40, dtype=torch.float32)
    for value, _, _ in results:
        assert value.dtype == torch.float64 and bool(torch.isfinite(value).all())
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-3)


def as_rank(monkeypatch, r, world):
    """Make the head believe it is rank ``r`` of ``world`` (no process group: no collectives)."""
    monkeypatch.setattr(sharded_mod, "rank", lambda group=None: r)
    monkeypatch.setattr(sharded_mod, "world_size", lambda group=None: world)


# ---------------------------------------------------------------------------- slices and init
@given(st.integers(1, 10_000), st.integers(1, 64))
def test_balanced_slices_partition_the_classes(num_classes, world):
    if num_classes < world:
        return
    slices = balanced_slices(num_classes, world)
    assert [size for _, size in slices] == [
        num_classes // world + (r < num_classes % world) for r in range(world)
    ]
    assert slices[0][0] == 0
    for (off, size), (nxt, _) in itertools.pairwise(slices):
        assert nxt == off + size
    assert slices[-1][0] + slices[-1][1] == num_classes


@pytest.mark.parametrize(("num_classes", "world"), [(10, 3), (2 * INIT_BLOCK + 5, 4), (7, 7)])
def test_initial_weight_does_not_depend_on_the_world_size(monkeypatch, num_classes, world):
    full = ShardedCosineHead(num_classes, 3, seed=5).weight.detach()
    parts = []
    for r in range(world):
        as_rank(monkeypatch, r, world)
        head = ShardedCosineHead(num_classes, 3, seed=5)
        assert (head.class_offset, head.num_local) == balanced_slices(num_classes, world)[r]
        parts.append(head.weight.detach())
    monkeypatch.undo()
    assert torch.equal(torch.cat(parts), full)
    torch.testing.assert_close(full.norm(dim=1), torch.ones(num_classes), rtol=0, atol=1e-6)
    other = ShardedCosineHead(num_classes, 3, seed=6).weight.detach()
    assert not torch.allclose(other, full)


def test_unseeded_heads_differ_and_use_the_global_generator():
    torch.manual_seed(0)
    a = ShardedCosineHead(20, 4).weight.detach()
    b = ShardedCosineHead(20, 4).weight.detach()
    torch.manual_seed(0)
    c = ShardedCosineHead(20, 4).weight.detach()
    assert not torch.equal(a, b) and torch.equal(a, c)


# ---------------------------------------------------------------------------- one process
def test_one_process_head_is_a_cosine_head(gen):
    head = ShardedCosineHead(12, 5, seed=1, dtype=torch.float64)
    e = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    out = head(e)
    assert isinstance(out, ShardedCosines) and head.logits(e).global_batch == 7
    assert (out.class_offset, out.num_local, out.num_classes, out.local_rows) == (0, 12, 12, slice(0, 7))
    torch.testing.assert_close(out.cosines, cosine_similarity_matrix(e, head.weight), rtol=0, atol=0)
    torch.testing.assert_close(out.gather_cosines(), out.cosines.detach())
    plain = CosineHead(12, 5, dtype=torch.float64)
    plain.load_state_dict(head.full_state_dict())
    assert torch.equal(head.predict(e), plain.predict(e))
    assert "ShardedCosines(global_batch=7" in repr(out) and "classes=[0, 12)" in repr(head)
    with record_collectives() as stats:  # nothing to communicate with one process
        _call(CosFaceLoss(), head(e), torch.arange(7)).backward()
    assert stats.total_calls == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_embeddings(gen, dtype):
    head = ShardedCosineHead(30, 16, seed=0)
    e = torch.randn(6, 16, generator=gen).to(dtype).requires_grad_(True)
    y = torch.arange(6) * 4
    loss = _call(CosFaceLoss(scale=16.0), head(e), y)
    assert loss.dtype == torch.float32
    loss.backward()
    assert e.grad.dtype == dtype and torch.isfinite(e.grad.float()).all()
    ref = CosFaceLoss(scale=16.0)(cosine_similarity_matrix(e.detach(), head.weight.detach()), y)
    torch.testing.assert_close(loss.detach(), ref)


LOSSES = [
    NormSoftmaxLoss(scale=4.0, reduction="none"),
    CosFaceLoss(scale=4.0, margin=0.2, reduction="none"),
    ArcFaceLoss(scale=4.0, margin=0.3, reduction="none"),
    QMarginLoss(alpha=1.25, scale=4.0, margin=0.1, reduction="none"),
    EntmaxLoss(alpha=1.5, scale=3.0, reduction="none"),
    SparsemaxLoss(scale=3.0, reduction="none"),
]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda m: type(m).__name__)
def test_gradcheck_of_sharded_losses(gen, loss):
    """float64 gradcheck of the custom backward passes (embeddings and centres).

    ClassCircleLoss is left out on purpose: its weights ``[·]_+`` are detached (Sun et al.), so its
    gradient is not the derivative of its value; it is compared with the one-process loss instead.
    """
    head = ShardedCosineHead(6, 3, seed=2, dtype=torch.float64)
    e = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = head.weight.detach().clone().requires_grad_(True)
    y = torch.tensor([0, 3, 5, 3])

    def fn(e, w):
        return _call(loss, torch.func.functional_call(head, {"weight": w}, (e,)), y)

    assert torch.autograd.gradcheck(fn, (e, w))


def test_empty_batch_gives_a_connected_zero(gen):
    head = ShardedCosineHead(9, 4, seed=0)
    for loss in (CosFaceLoss(), QMarginLoss(), ClassCircleLoss(reduction="sum")):
        e = torch.zeros(0, 4, requires_grad=True)
        value = _call(loss, head(e), torch.zeros(0, dtype=torch.long))
        assert value.shape == () and float(value.detach()) == 0.0
        value.backward()
        assert e.grad.shape == (0, 4)


def test_second_backward_with_retain_graph(gen):
    head = ShardedCosineHead(9, 4, seed=0, dtype=torch.float64)
    e = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    loss = _call(ArcFaceLoss(scale=8.0), head(e), torch.arange(5))
    (g1,) = torch.autograd.grad(loss, e, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, e)
    assert torch.equal(g1, g2)


def test_sampling_keeps_positives_and_equals_the_restricted_loss(gen):
    head = ShardedCosineHead(50, 6, sample_rate=0.3, seed=4, dtype=torch.float64)
    e = torch.randn(8, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([3, 3, 17, 40, 41, 0, 49, 17])
    loss_fn = CosFaceLoss(scale=10.0, margin=0.2)
    out = head(e)
    with pytest.raises(RuntimeError, match="computed by the loss"):
        _ = out.cosines
    value = _call(loss_fn, out, y)
    index = out.class_index
    assert index.shape == (15,) and torch.equal(index, index.unique())  # sorted, distinct
    assert bool(torch.isin(y, index).all())
    value.backward()
    e_ref = e.detach().clone().requires_grad_(True)
    w_ref = head.weight.detach().clone().requires_grad_(True)
    ref = loss_fn(cosine_similarity_matrix(e_ref, w_ref)[:, index], torch.searchsorted(index, y))
    ref.backward()
    torch.testing.assert_close(value, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(e.grad, e_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(head.weight.grad, w_ref.grad, rtol=1e-12, atol=1e-12)
    unsampled = torch.ones(50, dtype=torch.bool)
    unsampled[index] = False
    assert bool((head.weight.grad[unsampled] == 0).all())
    # a new step samples new negatives; the same labels in another loss call reuse the columns
    second = head(e.detach())
    _call(loss_fn, second, y)
    assert not torch.equal(second.class_index, index)
    _call(QMarginLoss(), second, y)
    with pytest.raises(ValueError, match="not sampled"):
        _call(loss_fn, second, torch.tensor([c for c in range(50) if c not in second.class_index][:8]))
    # more positives than the sample size: exactly the positives
    many = torch.arange(0, 40, 2)
    assert torch.equal(_sample(head, many), many)
    head.eval()
    assert head(e).class_index is None and head(e).cosines.shape == (8, 50)


def _sample(head, labels):
    return head._sample_index(labels)


def test_full_state_dict_loads_into_any_slice_and_into_a_cosine_head(monkeypatch, gen):
    source = ShardedCosineHead(11, 4, seed=9)
    full = source.full_state_dict()
    assert set(full) == {"weight"} and torch.equal(full["weight"], source.weight.detach())
    plain = CosineHead(11, 4)
    plain.load_state_dict(full)
    assert torch.equal(plain.weight, source.weight)
    for r in range(3):
        as_rank(monkeypatch, r, 3)
        head = ShardedCosineHead(11, 4, seed=123)
        head.load_full_state_dict(full)
        off, n = balanced_slices(11, 3)[r]
        assert torch.equal(head.weight.detach(), full["weight"][off : off + n])
        head.load_state_dict({"weight": head.weight.detach() * 2})  # its own slice
        with pytest.raises(
            RuntimeError, match=r"expected the full weight \[11, 4\].*slice \[\d, 4\], got \[5, 4\]"
        ):
            head.load_state_dict({"weight": torch.zeros(5, 4)})
    momentum = torch.randn(11, 4, generator=gen)
    opt = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    source.load_full_optimizer_state(opt, {"momentum_buffer": momentum})
    assert torch.equal(source.full_optimizer_state(opt)["momentum_buffer"], momentum)
    with pytest.raises(ValueError, match="does not hold this head's weight"):
        source.load_full_optimizer_state(torch.optim.SGD(plain.parameters(), lr=0.1), {})


def test_errors_in_one_process(monkeypatch, gen):
    with pytest.raises(ValueError, match="num_classes must be at least the number of ranks"):
        as_rank(monkeypatch, 0, 4)
        ShardedCosineHead(3, 8)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"sample_rate must lie in \(0, 1\]"):
        ShardedCosineHead(10, 4, sample_rate=0.0)
    with pytest.raises(TypeError, match="sample_rate must be a real number"):
        ShardedCosineHead(10, 4, sample_rate="half")
    with pytest.raises(ValueError, match="grad_reduction must be one of"):
        ShardedCosineHead(10, 4, grad_reduction="avg")
    with pytest.raises(ValueError, match="seed must be None or a non-negative int"):
        ShardedCosineHead(10, 4, seed=-1)
    head = ShardedCosineHead(10, 4, seed=0)
    e = torch.randn(3, 4, generator=gen)
    with pytest.raises(
        ValueError, match=r"embeddings must have shape \[batch, embedding_dim=4\], got \(3, 5\)"
    ):
        head(torch.randn(3, 5, generator=gen))
    with pytest.raises(ValueError, match="embeddings contain NaN"):
        head(torch.full((2, 4), math.nan))
    with pytest.raises(TypeError, match="embeddings must be a torch.Tensor, got list"):
        head([[1.0] * 4])
    with pytest.raises(TypeError, match="floating-point"):
        head(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"labels must lie in \[0, 10\).*\[0, 10\]; the first one out of range is on rank 0"
    ):
        _call(CosFaceLoss(), head(e), torch.tensor([0, 10, 3]))
    with pytest.raises(ValueError, match=r"labels must have shape \(3,\).*got shape \(2,\)"):
        _call(QMarginLoss(), head(e), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        _call(ClassCircleLoss(), head(e), torch.zeros(3))
    with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
        _call(CosFaceLoss(), head(e), [0, 1, 2])
    with pytest.raises(TypeError, match="MEPLoss does not support a ShardedCosineHead"):
        _call(MEPLoss(), head(e), torch.tensor([0, 1, 2]))
    with torch.no_grad():
        head.weight[2] = math.nan
    with pytest.raises(ValueError, match="finite cosines"):
        _call(EntmaxLoss(), head(e), torch.tensor([0, 1, 2]))


# ---------------------------------------------------------------------------- 3 real ranks
C, D = 13, 5


def _batches(seed, sizes, weight):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    y = torch.randint(0, C, (n,), generator=g)
    e = 2.0 * weight[y] + torch.randn(n, D, generator=g, dtype=torch.float64)
    return e, y


def _train(head, opt, e_local, y_local, steps=1):
    for _ in range(steps):
        opt.zero_grad()
        _call(CosFaceLoss(scale=8.0, margin=0.2), head(e_local), y_local).backward()
        opt.step()


def _checkpoint_worker(me, world, path_two, path_three, init_weight):
    assert world == 3
    # --- a run on 2 of the 3 ranks (subgroup {0, 1}), two SGD-momentum steps, full checkpoint
    pair = dist.new_group([0, 1])
    sizes2 = [4, 3]
    e2, y2 = _batches(1, sizes2, init_weight)
    if me in (0, 1):
        head = ShardedCosineHead(C, D, group=pair, seed=7, dtype=torch.float64)
        assert head.world_size == 2 and head.num_local == (7, 6)[me]
        opt = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9)
        rows = slice(sum(sizes2[:me]), sum(sizes2[: me + 1]))
        _train(head, opt, e2[rows], y2[rows], steps=2)
        state = {"head": head.full_state_dict(), "optimizer": head.full_optimizer_state(opt)}
        if me == 0:
            torch.save(state, path_two)
    dist.barrier()
    # --- resume on all 3 ranks with another initialisation, one more step, save again
    state = torch.load(path_two)
    head = ShardedCosineHead(C, D, seed=99, dtype=torch.float64)
    head.load_state_dict(state["head"])
    assert torch.equal(head.full_state_dict()["weight"], state["head"]["weight"])
    opt = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9)
    head.load_full_optimizer_state(opt, state["optimizer"])
    sizes3 = [2, 3, 2]
    e3, y3 = _batches(2, sizes3, init_weight)
    rows = slice(sum(sizes3[:me]), sum(sizes3[: me + 1]))
    _train(head, opt, e3[rows], y3[rows])
    resumed = {"head": head.full_state_dict(), "optimizer": head.full_optimizer_state(opt)}
    # predictions and the gathered cosines agree with the full weight
    plain = CosineHead(C, D, dtype=torch.float64)
    plain.load_state_dict(resumed["head"])
    assert torch.equal(head.predict(e3[rows]), plain.predict(e3[rows]))
    out = head(e3[rows])
    full_cos = cosine_similarity_matrix(e3, resumed["head"]["weight"])
    assert (out.gather_cosines() - full_cos).abs().max() < 1e-12
    if me == 0:
        torch.save(resumed, path_three)
    _one_class_per_rank(me, world)
    _error_checks(me, world)
    dist.barrier()


def _three_rank_worker(me, world, path_two, path_three, init_weight, loss_weight):
    """One spawn serves two test files: the checks here, and the 3-rank loss equalities."""
    _checkpoint_worker(me, world, path_two, path_three, init_weight)
    losses_worker(me, world, loss_weight)


def _one_class_per_rank(me, world):
    """C = world: every slice is one class (the target is often a rank's only column)."""
    head = ShardedCosineHead(world, D, seed=3, dtype=torch.float64)
    full = head.full_state_dict()["weight"]
    g = torch.Generator().manual_seed(8)
    y_all = torch.randint(0, world, (2 * world,), generator=g)
    e_all = full[y_all] + 0.8 * torch.randn(2 * world, D, generator=g, dtype=torch.float64)
    rows = slice(2 * me, 2 * me + 2)
    for loss in (CosFaceLoss(scale=8.0), QMarginLoss(scale=8.0), SparsemaxLoss(scale=2.0), ClassCircleLoss()):
        e = e_all[rows].clone().requires_grad_(True)
        head.zero_grad()
        value = _call(loss, head(e), y_all[rows])
        value.backward()
        e_ref, w_ref = e_all.clone().requires_grad_(True), full.clone().requires_grad_(True)
        ref = loss(cosine_similarity_matrix(e_ref, w_ref), y_all)
        ref.backward()
        torch.testing.assert_close(value, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(e.grad, world * e_ref.grad[rows], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(head.weight.grad, w_ref.grad[me : me + 1], rtol=1e-10, atol=1e-10)


def _error_checks(me, world):
    with pytest.raises(
        ValueError, match="num_classes must be at least the number of ranks.*group of 3 ranks"
    ):
        ShardedCosineHead(2, D)
    head = ShardedCosineHead(C, D, seed=0)
    e = torch.randn(2, D, generator=torch.Generator().manual_seed(me))
    # mismatched embedding dimensions: every rank raises, naming every rank's shape
    bad = torch.randn(2, D + (me == 1), generator=torch.Generator().manual_seed(0))
    with pytest.raises(
        ValueError, match=r"on every rank, got rank 0: \(2, 5\), rank 1: \(2, 6\), rank 2: \(2, 5\)"
    ):
        head(bad)
    with pytest.raises(TypeError, match="same dtype on every rank"):
        head(e.double() if me == 2 else e)
    with pytest.raises(ValueError, match="embeddings on rank 1 contain NaN"):
        head(e * math.nan if me == 1 else e)
    # labels out of range on one rank only
    labels = torch.tensor([0, C if me == 2 else 1])
    for loss in (CosFaceLoss(), QMarginLoss(), ClassCircleLoss()):
        with pytest.raises(
            ValueError, match=rf"labels must lie in \[0, {C}\).*first one out of range is on rank 2"
        ):
            _call(loss, head(e), labels)
    with pytest.raises(ValueError, match=r"labels on rank 0 must have shape \(2,\).*got shape \(3,\)"):
        _call(CosFaceLoss(), head(e), torch.tensor([0, 1, 2]) if me == 0 else torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="labels on rank 1 must be an integer tensor"):
        _call(EntmaxLoss(), head(e), torch.zeros(2) if me == 1 else torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="same dim and dtype on every rank"):
        GatheredPairLoss(CircleLoss())(torch.randn(2, D + (me == 0)), torch.tensor([0, 1]))
    # the group is still usable: a normal step succeeds on every rank
    loss = _call(CosFaceLoss(), head(e), torch.tensor([0, 1]))
    loss.backward()
    assert torch.isfinite(head.weight.grad).all()


@pytest.mark.distributed
def test_three_ranks_checkpoint_errors_and_losses(tmp_path):
    """A 2-rank checkpoint resumes on 3 ranks and on 1; errors on 3 ranks; and (one spawn for
    both files) every loss of tests/test_distributed_losses.py on 3 ranks equals one process."""
    init = ShardedCosineHead(C, D, seed=7, dtype=torch.float64).weight.detach()
    path_two, path_three = tmp_path / "two.pt", tmp_path / "three.pt"
    loss_weight = ShardedCosineHead(NUM_CLASSES, DIM, seed=SEED, dtype=torch.float64).weight.detach()
    run_distributed(_three_rank_worker, 3, str(path_two), str(path_three), init, loss_weight, timeout_s=150.0)
    two, three = torch.load(path_two), torch.load(path_three)

    # one process, plain CosineHead on the concatenated batches, the same three steps
    plain = CosineHead(C, D, dtype=torch.float64)
    plain.load_state_dict({"weight": init})
    opt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    e2, y2 = _batches(1, [4, 3], init)
    for _ in range(2):
        opt.zero_grad()
        CosFaceLoss(scale=8.0, margin=0.2)(plain(e2), y2).backward()
        opt.step()
    torch.testing.assert_close(two["head"]["weight"], plain.weight.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        two["optimizer"]["momentum_buffer"],
        opt.state[plain.weight]["momentum_buffer"],
        rtol=1e-12,
        atol=1e-12,
    )
    e3, y3 = _batches(2, [2, 3, 2], init)
    opt.zero_grad()
    CosFaceLoss(scale=8.0, margin=0.2)(plain(e3), y3).backward()
    opt.step()
    torch.testing.assert_close(three["head"]["weight"], plain.weight.detach(), rtol=1e-12, atol=1e-12)

    # the 2-rank checkpoint also resumes in one process on a (one-rank) ShardedCosineHead
    single = ShardedCosineHead(C, D, seed=1, dtype=torch.float64)
    single.load_full_state_dict(two["head"])
    opt1 = torch.optim.SGD(single.parameters(), lr=0.5, momentum=0.9)
    single.load_full_optimizer_state(opt1, two["optimizer"])
    _train(single, opt1, e3, y3)
    torch.testing.assert_close(single.weight.detach(), three["head"]["weight"], rtol=1e-12, atol=1e-12)


def test_gathered_pair_loss_in_one_process_is_the_loss_and_is_re_exported(gen):
    import marginkit.distributed

    assert marginkit.distributed.GatheredPairLoss is GatheredPairLoss
    e = torch.randn(6, 4, generator=gen)
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    loss = CircleLoss(gamma=16.0)
    assert torch.equal(GatheredPairLoss(loss)(e, y), loss(e, y))
    with pytest.raises(ValueError, match="grad_reduction must be one of"):
        GatheredPairLoss(loss, grad_reduction="avg")
    with pytest.raises(TypeError, match="loss must be a callable"):
        GatheredPairLoss(3)
