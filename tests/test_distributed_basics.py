import os
import pathlib
import socket

import pytest
import torch
import torch.distributed as dist

from dist_utils import SpawnedRankError, run_distributed
from marginkit.distributed import (
    all_gather_no_grad,
    all_gather_with_grad,
    find_free_port,
    gather_sizes,
    is_distributed,
    rank,
    world_size,
)


def pair_loss_per_anchor(anchors, anchor_labels, refs, ref_labels, offset):
    """Smooth pairwise loss of each anchor against every reference except itself.

    ``log(1 + sum_pos exp(d)) + log(1 + sum_neg exp(1 - d))`` with squared L2 distances; anchor
    ``i`` is reference ``offset + i``. Written here, independent of marginkit's losses.
    """
    d = torch.cdist(anchors, refs).square()
    same = anchor_labels[:, None] == ref_labels[None, :]
    me = torch.arange(anchors.shape[0])[:, None] + offset == torch.arange(refs.shape[0])[None, :]
    pos = torch.where(same & ~me, d, -torch.inf)
    neg = torch.where(~same, 1 - d, -torch.inf)
    zero = torch.zeros(anchors.shape[0], 1, dtype=d.dtype)
    return torch.logsumexp(torch.cat([zero, pos], 1), 1) + torch.logsumexp(torch.cat([zero, neg], 1), 1)


def assert_close(actual, expected, tol):
    """Plain ``|a - b| <= tol (1 + |b|)``; torch.testing.assert_close would import DTensor (seconds
    per spawned process)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual - expected).abs() - tol * (1 + expected.abs())
    assert bool((err <= 0).all()), f"max excess {float(err.max()):.3g} over tolerance {tol}"


def _global_data(n, dtype, seed=1234):
    g = torch.Generator().manual_seed(seed)  # identical on every rank
    x = torch.randn(n, 5, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    z = torch.randn(n, 6, generator=g, dtype=torch.float64).to(dtype)
    return x, y, z


def _reference_grad(x, y):
    x = x.clone().requires_grad_()
    loss = pair_loss_per_anchor(x, y, x, y, 0).mean()
    loss.backward()
    return loss.detach(), x.grad


def _check_gather_and_gradients(me, world, dtype, tol):
    sizes = [r + 2 for r in range(world)]  # unequal local batches
    n, start = sum(sizes), sum(sizes[:me])
    stop = start + sizes[me]
    assert gather_sizes(sizes[me]) == sizes
    x_all, y_all, _ = _global_data(n, dtype)
    ref_loss, ref_grad = _reference_grad(x_all, y_all)

    # Order: rank order, every rank gets the same global batch; labels and masks too.
    x = x_all[start:stop].clone().requires_grad_()
    gathered = all_gather_with_grad(x)
    assert gathered.requires_grad and gathered.dtype == dtype
    assert torch.equal(gathered.detach(), x_all)
    labels = all_gather_no_grad(y_all[start:stop])
    assert torch.equal(labels, y_all)
    mask = all_gather_no_grad(y_all[start:stop] > 0)
    assert mask.dtype == torch.bool and torch.equal(mask, y_all > 0)

    # Share: each rank's anchors against the global batch, normalised by the global count.
    share = pair_loss_per_anchor(gathered[start:stop], labels[start:stop], gathered, labels, start).sum() / n
    share.backward()
    assert_close(x.grad, ref_grad[start:stop], tol)
    total = share.detach().clone()
    dist.all_reduce(total)
    assert_close(total, ref_loss, tol)

    # Replicated: every rank computes the whole loss; the sum over ranks is N times it.
    x2 = x_all[start:stop].clone().requires_grad_()
    g2 = all_gather_with_grad(x2)
    loss = pair_loss_per_anchor(g2, labels, g2, labels, 0).mean()
    assert_close(loss.detach(), ref_loss, tol)
    loss.backward()
    assert_close(x2.grad, world * ref_grad[start:stop], tol)


def _check_ddp_training_equals_one_process(me, world, use_ddp):
    """Two SGD steps with the replicated loss on gathered embeddings equal one process.

    With ``use_ddp`` the model is wrapped in DistributedDataParallel; otherwise its gradient
    averaging (all-reduce / N) is done by hand — same maths, without DDP's seconds-long import.
    """
    sizes = [3 + (r % 2) for r in range(world)]
    n, start = sum(sizes), sum(sizes[:me])
    stop = start + sizes[me]
    _, y_all, z_all = _global_data(n, torch.float64, seed=99)
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(5, 6, generator=g, dtype=torch.float64)

    def make():
        model = torch.nn.Linear(6, 5, bias=False, dtype=torch.float64)
        with torch.no_grad():
            model.weight.copy_(weight)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    single, single_opt = make()
    local, local_opt = make()
    ddp = torch.nn.parallel.DistributedDataParallel(local) if use_ddp else local
    labels = all_gather_no_grad(y_all[start:stop])
    for _ in range(2):
        emb = single(z_all)
        single_opt.zero_grad()
        pair_loss_per_anchor(emb, y_all, emb, y_all, 0).mean().backward()
        single_opt.step()

        emb = all_gather_with_grad(ddp(z_all[start:stop]))
        local_opt.zero_grad()
        pair_loss_per_anchor(emb, labels, emb, labels, 0).mean().backward()  # replicated: no scaling
        if not use_ddp:
            dist.all_reduce(local.weight.grad)
            local.weight.grad /= world
        assert_close(local.weight.grad, single.weight.grad, 1e-10)
        local_opt.step()
    assert_close(local.weight.detach(), single.weight.detach(), 1e-10)


def _check_errors_and_edge_cases(me, world):
    # Mismatched trailing dims / dtypes: every rank raises the same error, the group stays usable.
    with pytest.raises(ValueError, match=r"same shape beyond the first dimension.*rank 1: \(2, 4\)"):
        all_gather_with_grad(torch.zeros(2, 3 + (me == 1)))
    with pytest.raises(TypeError, match="same dtype on every rank"):
        all_gather_no_grad(torch.zeros(2, dtype=torch.float64 if me == 1 else torch.float32))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        all_gather_with_grad(torch.tensor(1.0))
    assert gather_sizes(me) == list(range(world))

    # An empty local batch takes part (and gets an empty gradient).
    x = torch.full((0 if me == 0 else 2, 3), float(me), requires_grad=True)
    out = all_gather_with_grad(x)
    assert out.shape == (2 * (world - 1), 3)
    assert out[:, 0].tolist() == [float(r) for r in range(1, world) for _ in range(2)]
    (out * torch.arange(out.shape[0], dtype=out.dtype)[:, None]).sum().backward()
    expected = [float(world * i) for i in range(2 * (me - 1), 2 * me)] if me else []
    assert x.grad.shape == x.shape and x.grad[:, 0].tolist() == expected

    # Half precision keeps its dtype through the gather and the gradient.
    h = torch.full((2, 4), 1.0 + me, dtype=torch.bfloat16, requires_grad=True)
    out = all_gather_with_grad(h)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert h.grad.dtype == torch.bfloat16 and (h.grad == world).all()

    # A subgroup: order is the group's rank order; the gradient sums over the group only.
    members = [0, world - 1]
    sub = dist.new_group(members)
    if me in members:
        y = torch.full((1, 2), float(me), requires_grad=True)
        out = all_gather_with_grad(y, group=sub)
        assert out[:, 0].tolist() == [0.0, float(world - 1)]
        assert world_size(sub) == 2 and rank(sub) == members.index(me)
        out.sum().backward()
        assert (y.grad == 2).all()
    dist.barrier()


def _worker_checks(me, world, use_ddp):
    assert rank() == me and world_size() == world and is_distributed()
    _check_gather_and_gradients(me, world, torch.float64, 1e-10)
    _check_gather_and_gradients(me, world, torch.float32, 1e-5)
    _check_ddp_training_equals_one_process(me, world, use_ddp)
    _check_errors_and_edge_cases(me, world)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_gather_order_gradients_ddp_and_errors(world):
    run_distributed(_worker_checks, world, world == 2)  # real DDP once (its import is slow)


def _worker_fails(me, world):
    if me == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1))  # blocks on the rank that died


@pytest.mark.distributed
def test_spawn_reports_the_failing_rank_without_hanging():
    # Rank 0 blocks in a collective while rank 1 raises: the helper must return (no hang) and
    # blame rank 1, whose error happened first, not rank 0's lost connection.
    with pytest.raises(SpawnedRankError, match=r"(?s)rank 1 of 2 failed first.*boom from rank 1") as info:
        run_distributed(_worker_fails, 2, timeout_s=30.0)
    assert info.value.rank == 1


def _worker_group_is_freed(me, world):
    import sys

    def gloo_threads():
        tasks = pathlib.Path("/proc/self/task")
        names = ((task / "comm").read_text().strip() for task in tasks.iterdir())
        return sorted(n for n in names if "gloo" in n)

    assert "torch.distributed.nn" in sys.modules  # imported by the helper before the group
    # The first optimizer imports torch.distributed.nn.functional (via torch._dynamo), whose
    # defaults are group.WORLD at import time: None here, not this group (which it would pin).
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert torch.distributed.nn.functional.all_reduce.__defaults__[-1] is None
    x = torch.ones(3)
    dist.all_reduce(x)
    assert x.tolist() == [float(world)] * 3 and gloo_threads()
    dist.barrier()
    dist.destroy_process_group()
    # Freed: its worker threads are joined now, not racing the interpreter's shutdown (SIGABRT).
    assert gloo_threads() == []


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
def test_destroyed_group_is_freed_after_an_optimizer_was_built():
    run_distributed(_worker_group_is_freed, 2)


def test_single_process_fallbacks(gen):
    assert (rank(), world_size(), is_distributed()) == (0, 1, False)
    x = torch.randn(3, 2, generator=gen, requires_grad=True)
    assert all_gather_with_grad(x) is x
    labels = all_gather_no_grad(x)
    assert torch.equal(labels, x) and not labels.requires_grad
    assert gather_sizes(3) == [3]
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        all_gather_with_grad([1.0])
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        all_gather_no_grad(None)
    with pytest.raises(ValueError, match="size must be a non-negative int"):
        gather_sizes(-1)


def test_find_free_port_is_bindable():
    port = find_free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_reference_loss_has_no_self_pairs_and_uses_every_row(gen):
    # Sanity of the test's own reference: a lone anchor of its class has no positive term, and
    # the gradient reaches every row (so the distributed checks above compare non-trivial values).
    x = torch.randn(5, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 1, 1, 2])
    per = pair_loss_per_anchor(x, y, x, y, 0)
    d = (x[4] - x[:4]).square().sum(1)
    expected = torch.logsumexp(torch.cat([torch.zeros(1, dtype=d.dtype), 1 - d]), 0)
    assert_close(per[4], expected, 1e-12)
    per.mean().backward()
    assert (x.grad.abs().sum(1) > 0).all()
