"""Triplet losses vs per-anchor loop references and pytorch-metric-learning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers

import marginkit.losses.triplet as triplet_module
from marginkit.losses import LocalMarginTripletLoss, TripletMarginLoss
from marginkit.ops.pairs import safe_sqrt
from pair_inputs import assert_batch_errors, assert_warns_once

# ------------------------------------------------------------------ loop references


def _d(u, v, distance):
    """One distance, computed explicitly from the difference vector (independent of the code)."""
    if distance == "cosine":
        return 1 - (u @ v) / (u.norm() * v.norm())
    sq = ((u - v) ** 2).sum()
    return sq.sqrt() if distance == "l2" else sq


def _pairs(emb, labels, normalize, ref, ref_labels):
    self_ref = ref is None
    x = emb / emb.norm(dim=1, keepdim=True) if normalize else emb
    if self_ref:
        y, ref_labels = x, labels
    else:
        y = ref / ref.norm(dim=1, keepdim=True) if normalize else ref
    return x, y, ref_labels, self_ref


def _neighbours(i, labels, ref_labels, self_ref):
    pos = [j for j in range(len(ref_labels)) if ref_labels[j] == labels[i] and not (self_ref and i == j)]
    neg = [j for j in range(len(ref_labels)) if ref_labels[j] != labels[i]]
    return pos, neg


def loop_local_margin(emb, labels, k, margin, normalize=True, ref=None, ref_labels=None):
    """Per-anchor loop of SPEC §5; ties broken by index (the smallest index first)."""
    x, y, ref_labels, self_ref = _pairs(emb, labels, normalize, ref, ref_labels)
    out, count = [], 0
    for i in range(x.shape[0]):
        pos, neg = _neighbours(i, labels, ref_labels, self_ref)
        if not pos or not neg:
            out.append(x.sum() * 0)
            continue
        dp = sorted(((_d(x[i], y[j], "squared_l2"), j) for j in pos), key=lambda t: (t[0].item(), t[1]))
        bound = dp[min(k, len(pos)) - 1][0]
        dn = min(((_d(x[i], y[j], "squared_l2"), j) for j in neg), key=lambda t: (t[0].item(), t[1]))[0]
        out.append(torch.relu(bound - dn + margin))
        count += 1
    return torch.stack(out), count


def loop_batch_hard(emb, labels, margin, distance, normalize=True, ref=None, ref_labels=None):
    x, y, ref_labels, self_ref = _pairs(emb, labels, normalize, ref, ref_labels)
    out, count = [], 0
    for i in range(x.shape[0]):
        pos, neg = _neighbours(i, labels, ref_labels, self_ref)
        if not pos or not neg:
            out.append(x.sum() * 0)
            continue
        dp = max(((_d(x[i], y[j], distance), -j) for j in pos), key=lambda t: (t[0].item(), t[1]))[0]
        dn = min(((_d(x[i], y[j], distance), j) for j in neg), key=lambda t: (t[0].item(), t[1]))[0]
        out.append(torch.relu(dp - dn + margin))
        count += 1
    return torch.stack(out), count


def loop_batch_all(emb, labels, margin, distance, normalize=True, ref=None, ref_labels=None):
    """Per-anchor sums over all triplets, number of active and of valid triplets."""
    x, y, ref_labels, self_ref = _pairs(emb, labels, normalize, ref, ref_labels)
    sums, active, valid = [], 0, 0
    for i in range(x.shape[0]):
        pos, neg = _neighbours(i, labels, ref_labels, self_ref)
        total = x.sum() * 0
        for p in pos:
            for n in neg:
                h = torch.relu(_d(x[i], y[p], distance) - _d(x[i], y[n], distance) + margin)
                total = total + h
                active += int(h.item() > 0)
                valid += 1
        sums.append(total)
    return torch.stack(sums), active, valid


def loop_semi_hard(emb, labels, margin, distance, normalize=True):
    """TF ``triplet_semihard_loss`` per anchor-positive pair, summed per anchor."""
    x, y, ref_labels, self_ref = _pairs(emb, labels, normalize, None, None)
    sums, pairs = [], 0
    for i in range(x.shape[0]):
        pos, neg = _neighbours(i, labels, ref_labels, self_ref)
        total = x.sum() * 0
        if neg:
            dneg = [(_d(x[i], y[n], distance), n) for n in neg]
            for p in pos:
                dap = _d(x[i], y[p], distance)
                farther = [t for t in dneg if t[0].item() > dap.item()]
                if farther:
                    dn = min(farther, key=lambda t: (t[0].item(), t[1]))[0]
                else:  # the farthest negative (the last index among equal values)
                    dn = max(dneg, key=lambda t: (t[0].item(), t[1]))[0]
                total = total + torch.relu(dap - dn + margin)
                pairs += 1
        sums.append(total)
    return torch.stack(sums), pairs


def _batch(gen, n=20, dim=5, classes=4, dtype=torch.float64):
    emb = torch.randn(n, dim, generator=gen, dtype=dtype)
    labels = torch.randint(0, classes, (n,), generator=gen)
    return emb, labels


def _vg(fn, emb):
    x = emb.clone().requires_grad_(True)
    value = fn(x)
    value.sum().backward()
    return value.detach(), x.grad


def _close(a, b, **kw):
    torch.testing.assert_close(a[0], b[0], **kw)
    torch.testing.assert_close(a[1], b[1], **kw)


# ------------------------------------------------------------------ local-margin triplet


@pytest.mark.parametrize("k", [1, 2, 3, 50])
@pytest.mark.parametrize("normalize", [True, False])
def test_local_margin_equals_loop(gen, k, normalize):
    emb, labels = _batch(gen, n=18, classes=4)
    labels[:2] = torch.tensor([7, 8])  # two classes with a single sample (no positive)
    loss = LocalMarginTripletLoss(k=k, margin=0.3, normalize=normalize, reduction="none")
    ours = _vg(lambda x: loss(x, labels), emb)
    ref = _vg(lambda x: loop_local_margin(x, labels, k, 0.3, normalize)[0], emb)
    _close(ours, ref)
    assert ours[0][:2].eq(0).all()
    # "mean" is over the anchors with a positive and a negative
    count = loop_local_margin(emb, labels, k, 0.3, normalize)[1]
    mean = _vg(lambda x: LocalMarginTripletLoss(k=k, margin=0.3, normalize=normalize)(x, labels), emb)
    _close(mean, _vg(lambda x: loop_local_margin(x, labels, k, 0.3, normalize)[0].sum() / count, emb))


def test_local_margin_k_selects_kth_positive():
    # anchor 0 at the origin, positives at squared distances 1, 4, 9; negative at 6.25
    emb = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [0.0, -2.5]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 0, 0, 1])
    for k, bound in ((1, 1.0), (2, 4.0), (3, 9.0), (10, 9.0)):
        loss = LocalMarginTripletLoss(k=k, margin=0.5, normalize=False, reduction="none")(emb, labels)
        assert loss[0].item() == pytest.approx(max(0.0, bound - 6.25 + 0.5))


def test_local_margin_with_reference_set(gen):
    emb, labels = _batch(gen, n=8, classes=3)
    ref, ref_labels = _batch(gen, n=15, classes=3)
    loss = LocalMarginTripletLoss(k=2, margin=0.2, reduction="none")
    _close(
        _vg(lambda x: loss(x, labels, ref, ref_labels), emb),
        _vg(lambda x: loop_local_margin(x, labels, 2, 0.2, True, ref, ref_labels)[0], emb),
    )


def _dyadic_unit_vectors(gen, n):
    """Unit vectors in 4-D with entries in {0, ±1/2, ±1}: every distance is exact (ties are ties)."""
    half = torch.tensor(
        [[a, b, c, d] for a in (-0.5, 0.5) for b in (-0.5, 0.5) for c in (-0.5, 0.5) for d in (-0.5, 0.5)]
    )
    axes = torch.cat([torch.eye(4), -torch.eye(4)])
    pool = torch.cat([half, axes]).double()
    return pool[torch.randint(0, len(pool), (n,), generator=gen)]


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_local_margin_duplicate_embeddings_equal_loop(gen, normalize, k):
    # few distinct vectors: many exact duplicates, zero distances and tied distances
    emb = _dyadic_unit_vectors(gen, 24)
    labels = torch.randint(0, 3, (24,), generator=gen)
    loss = LocalMarginTripletLoss(k=k, margin=0.25, normalize=normalize, reduction="none")
    ours = _vg(lambda x: loss(x, labels), emb)
    ref = _vg(lambda x: loop_local_margin(x, labels, k, 0.25, normalize)[0], emb)
    _close(ours, ref)
    assert torch.isfinite(ours[1]).all()


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 14), classes=st.integers(1, 5), k=st.integers(1, 6))
def test_local_margin_loop_property(seed, n, classes, k):
    gen = torch.Generator().manual_seed(seed)
    emb, labels = _batch(gen, n=n, dim=3, classes=classes)
    loss = LocalMarginTripletLoss(k=k, margin=0.2, reduction="none", validate=False)
    _close(_vg(lambda x: loss(x, labels), emb), _vg(lambda x: loop_local_margin(x, labels, k, 0.2)[0], emb))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("with_refs", [False, True])
def test_local_margin_gradcheck(reduction, normalize, with_refs):
    # the hand-written backward (selected distances, unit rows) against finite differences, float64;
    # noisy class centres: no tie or hinge kink within gradcheck's step, some anchors inside the
    # margin and some outside
    gen = torch.Generator().manual_seed(2)
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3])  # class 3: no positive
    ref_labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    centres = torch.randn(4, 4, generator=gen, dtype=torch.float64) * 2
    emb = (centres[labels] + 0.8 * torch.randn(10, 4, generator=gen, dtype=torch.float64)).requires_grad_(
        True
    )
    ref = (centres[ref_labels] + 0.8 * torch.randn(9, 4, generator=gen, dtype=torch.float64)).requires_grad_(
        True
    )
    loss = LocalMarginTripletLoss(
        k=2, margin=0.2 if normalize else 1.0, normalize=normalize, reduction=reduction
    )
    if with_refs:
        assert torch.autograd.gradcheck(lambda e, r: loss(e, labels, r, ref_labels), (emb, ref))
    else:
        assert torch.autograd.gradcheck(lambda e: loss(e, labels), (emb,))
    assert 0 < loss.last_active_fraction < 1  # some anchors inside the margin, some outside


def test_local_margin_second_derivative_is_refused(gen):
    emb, labels = _batch(gen, n=12, classes=3)
    x = emb.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(LocalMarginTripletLoss(k=2, margin=1.0)(x, labels), x, create_graph=True)


def test_local_margin_float32_keys_select_as_the_float64_reference(gen):
    # dyadic vectors: float32 and float64 distances are the same numbers, with many ties; the
    # float32 path ranks packed (distance, column) keys, float64 takes kth_smallest_column
    from marginkit.mining import local_triplets

    emb = _dyadic_unit_vectors(gen, 40)
    for k in (1, 2, 5, 40):
        for seed in range(3):
            labels = torch.randint(0, 4, (40,), generator=torch.Generator().manual_seed(seed))
            got = local_triplets(emb.float(), labels, k, 10.0, normalize=False)
            want = local_triplets(emb, labels, k, 10.0, normalize=False)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (k, seed)


@given(
    values=st.lists(
        st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.0, 2.0, 1e-40, 3e38, float("inf"), float("nan")]),
        min_size=1,
        max_size=40,
    )
)
def test_order_keys_are_the_stable_sort_order(values):
    from marginkit.mining.triplets import _order_keys

    d = torch.tensor([values], dtype=torch.float32)
    want = torch.sort(d, dim=1, stable=True).indices
    keys = _order_keys(d.clone(), torch.arange(d.shape[1]))
    assert keys.unique().numel() == keys.numel()  # distinct: topk's tie order cannot matter
    assert torch.equal(torch.sort(keys, dim=1).indices, want)


def test_local_margin_step_dispatch_budget(gen):
    # forward + backward at B = 64: the aten ops it dispatches (they dominate a small step's time),
    # none a device read; 90 at the time of writing (184 before issue 39)
    from dispatch_counts import DispatchCounter

    emb, labels = _batch(gen, n=64, classes=8, dtype=torch.float32)
    x = emb.clone().requires_grad_(True)
    loss = LocalMarginTripletLoss(k=5, margin=0.2)
    with DispatchCounter() as counter:
        loss(x, labels).backward()
    assert counter.reads == 0
    assert counter.ops <= 110, counter.by_name


# ------------------------------------------------------------------ TripletMarginLoss vs loops


@pytest.mark.parametrize("distance", ["squared_l2", "l2", "cosine"])
@pytest.mark.parametrize("normalize", [True, False])
def test_batch_hard_equals_loop(gen, distance, normalize):
    emb, labels = _batch(gen, n=16, classes=4)
    loss = TripletMarginLoss(0.3, "batch_hard", distance, normalize=normalize, reduction="none")
    ref = loop_batch_hard(emb, labels, 0.3, distance, normalize)
    _close(
        _vg(lambda x: loss(x, labels), emb),
        _vg(lambda x: loop_batch_hard(x, labels, 0.3, distance, normalize)[0], emb),
    )
    mean = TripletMarginLoss(0.3, "batch_hard", distance, normalize=normalize)(emb, labels)
    torch.testing.assert_close(mean, ref[0].sum() / ref[1])


@pytest.mark.parametrize("distance", ["squared_l2", "l2", "cosine"])
@pytest.mark.parametrize("average", ["active", "valid"])
def test_batch_all_equals_loop(gen, distance, average):
    emb, labels = _batch(gen, n=14, classes=3)
    labels[0] = 9  # a singleton
    margin = 0.5 if distance != "cosine" else 0.2
    _, active, valid = loop_batch_all(emb, labels, margin, distance)
    loss_none = TripletMarginLoss(margin, "batch_all", distance, average=average, reduction="none")
    _close(
        _vg(lambda x: loss_none(x, labels), emb),
        _vg(lambda x: loop_batch_all(x, labels, margin, distance)[0], emb),
    )
    denominator = active if average == "active" else valid
    assert loss_none.last_counts.sum().item() == denominator
    assert loss_none.last_active_fraction.item() == pytest.approx(active / valid)
    loss_mean = TripletMarginLoss(margin, "batch_all", distance, average=average)
    _close(
        _vg(lambda x: loss_mean(x, labels), emb),
        _vg(lambda x: loop_batch_all(x, labels, margin, distance)[0].sum() / denominator, emb),
    )


def test_batch_all_with_reference_set(gen):
    emb, labels = _batch(gen, n=7, classes=3)
    ref, ref_labels = _batch(gen, n=11, classes=3)
    loss = TripletMarginLoss(0.4, "batch_all", "l2", reduction="none")
    _close(
        _vg(lambda x: loss(x, labels, ref, ref_labels), emb),
        _vg(lambda x: loop_batch_all(x, labels, 0.4, "l2", True, ref, ref_labels)[0], emb),
    )


def test_batch_all_blocks_equal_one_block(gen, monkeypatch):
    emb, labels = _batch(gen, n=30, classes=3)
    whole = _vg(lambda x: TripletMarginLoss(0.3, "batch_all")(x, labels), emb)
    monkeypatch.setattr(triplet_module, "BLOCK_ELEMENTS", 7)  # one anchor per block
    _close(_vg(lambda x: TripletMarginLoss(0.3, "batch_all")(x, labels), emb), whole)


def test_batch_all_function_gradcheck(gen):
    dist = torch.rand(5, 6, generator=gen, dtype=torch.float64).requires_grad_(True)
    labels = torch.tensor([0, 0, 1, 1, 1])
    ref_labels = torch.tensor([0, 1, 1, 0, 2, 1])
    pos = labels[:, None] == ref_labels[None, :]
    npos = pos.sum(1)
    pos_idx = torch.sort(pos.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :3]
    pos_valid = torch.arange(3)[None, :] < npos[:, None]

    def fn(d):
        return triplet_module._BatchAllTriplets.apply(d, pos_idx, pos_valid, ~pos, 0.3, 2)[0]

    assert torch.autograd.gradcheck(fn, (dist,))


@pytest.mark.parametrize("distance", ["squared_l2", "l2", "cosine"])
def test_semi_hard_equals_tf_loop(gen, distance):
    emb, labels = _batch(gen, n=15, classes=3)
    sums, pairs = loop_semi_hard(emb, labels, 0.3, distance)
    loss = TripletMarginLoss(0.3, "semi_hard", distance, reduction="none")
    _close(
        _vg(lambda x: loss(x, labels), emb), _vg(lambda x: loop_semi_hard(x, labels, 0.3, distance)[0], emb)
    )
    assert loss.last_counts.sum().item() == pairs
    mean = TripletMarginLoss(0.3, "semi_hard", distance)(emb, labels)
    torch.testing.assert_close(mean, sums.sum() / pairs)


def test_semi_hard_ties_equal_loop(gen):
    emb = _dyadic_unit_vectors(gen, 20)
    labels = torch.randint(0, 3, (20,), generator=gen)
    loss = TripletMarginLoss(0.5, "semi_hard", "squared_l2", reduction="none")
    _close(
        _vg(lambda x: loss(x, labels), emb),
        _vg(lambda x: loop_semi_hard(x, labels, 0.5, "squared_l2")[0], emb),
    )


# ------------------------------------------------------------------ vs pytorch-metric-learning


@pytest.mark.parametrize(
    ("distance", "pml_distance"),
    [
        ("l2", pml_distances.LpDistance()),
        ("squared_l2", pml_distances.LpDistance(power=2)),
        ("cosine", pml_distances.CosineSimilarity()),
    ],
)
def test_batch_all_equals_pml(gen, distance, pml_distance):
    # PML's TripletMarginLoss: all triplets, AvgNonZeroReducer (mean over active triplets)
    emb, labels = _batch(gen, n=32, classes=5)
    ours = _vg(lambda x: TripletMarginLoss(0.2, "batch_all", distance)(x, labels), emb)
    theirs = _vg(lambda x: pml_losses.TripletMarginLoss(margin=0.2, distance=pml_distance)(x, labels), emb)
    _close(ours, theirs)


def test_batch_all_equals_pml_with_reference_set(gen):
    emb, labels = _batch(gen, n=10, classes=3)
    ref, ref_labels = _batch(gen, n=16, classes=3)
    ours = _vg(lambda x: TripletMarginLoss(0.2, "batch_all", "l2")(x, labels, ref, ref_labels), emb)
    theirs = _vg(
        lambda x: pml_losses.TripletMarginLoss(margin=0.2)(x, labels, ref_emb=ref, ref_labels=ref_labels), emb
    )
    _close(ours, theirs)


def test_batch_hard_equals_pml_miner(gen):
    emb, labels = _batch(gen, n=32, classes=5)
    ours = _vg(lambda x: TripletMarginLoss(0.2, "batch_hard", "l2")(x, labels), emb)

    def pml(x):
        idx = pml_miners.BatchHardMiner()(x, labels)
        return pml_losses.TripletMarginLoss(margin=0.2, reducer=pml_reducers.MeanReducer())(x, labels, idx)

    _close(ours, _vg(pml, emb))


def test_mined_indices_equal_pml(gen):
    emb, labels = _batch(gen, n=24, classes=4)
    idx = pml_miners.TripletMarginMiner(margin=0.3, type_of_triplets="semihard")(emb, labels)
    ours = _vg(lambda x: TripletMarginLoss(0.3, distance="l2", average="active")(x, labels, indices=idx), emb)
    theirs = _vg(lambda x: pml_losses.TripletMarginLoss(margin=0.3)(x, labels, idx), emb)
    _close(ours, theirs)
    per_triplet = TripletMarginLoss(0.3, distance="l2", reduction="none")(emb, indices=idx)
    assert per_triplet.shape == idx[0].shape


# ------------------------------------------------------------------ numerics and edge cases


@pytest.mark.parametrize("mining", ["batch_hard", "batch_all", "semi_hard"])
@pytest.mark.parametrize("normalize", [True, False])
def test_l2_gradient_finite_when_embeddings_coincide(gen, mining, normalize):
    emb, labels = _batch(gen, n=8, dim=3, dtype=torch.float32)
    emb[1] = emb[0]  # coinciding embeddings ...
    emb[5] = emb[4]
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])  # ... of the same class: distance exactly 0
    x = emb.clone().requires_grad_(True)
    TripletMarginLoss(1.0, mining, "l2", normalize=normalize)(x, labels).backward()
    assert torch.isfinite(x.grad).all()
    x2 = emb.clone().requires_grad_(True)
    idx = (torch.tensor([0, 4]), torch.tensor([1, 5]), torch.tensor([2, 0]))
    TripletMarginLoss(1.0, distance="l2", normalize=normalize)(x2, labels, indices=idx).backward()
    assert torch.isfinite(x2.grad).all()


def test_safe_sqrt_value_and_gradient():
    x = torch.tensor([0.0, 1e-30, 4.0], dtype=torch.float64, requires_grad=True)
    y = safe_sqrt(x)
    torch.testing.assert_close(y.detach(), x.detach().sqrt())
    y.sum().backward()
    assert x.grad[0] == 0 and torch.isfinite(x.grad).all()
    assert x.grad[2].item() == pytest.approx(0.25)
    z = (
        torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        .add(0.1)
        .requires_grad_(True)
    )
    assert torch.autograd.gradcheck(safe_sqrt, (z,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "make",
    [
        lambda: LocalMarginTripletLoss(k=3),
        lambda: TripletMarginLoss(mining="batch_all", distance="l2"),
        lambda: TripletMarginLoss(mining="semi_hard"),
        lambda: TripletMarginLoss(mining="batch_hard", distance="cosine"),
    ],
)
def test_half_precision_inputs(gen, dtype, make):
    emb, labels = _batch(gen, n=24, dim=8, classes=4, dtype=torch.float32)
    x = emb.to(dtype).requires_grad_(True)
    value = make()(x, labels)
    value.backward()
    assert value.dtype == torch.float32 and torch.isfinite(value)
    assert x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()
    torch.testing.assert_close(value, make()(x.detach().float(), labels))


def test_indices_path_equals_in_batch_selection(gen):
    emb, labels = _batch(gen, n=16, classes=4)
    loss = TripletMarginLoss(0.3, "batch_hard", "squared_l2", reduction="sum")
    from marginkit.mining import batch_hard_triplets

    idx = batch_hard_triplets(emb, labels)
    _close(_vg(lambda x: loss(x, labels), emb), _vg(lambda x: loss(x, labels, indices=idx), emb))


def test_reductions_are_consistent(gen):
    emb, labels = _batch(gen, n=16, classes=4)
    for mining in ("batch_hard", "batch_all", "semi_hard"):
        none = TripletMarginLoss(0.3, mining, reduction="none")
        per = none(emb, labels)
        assert per.shape == (16,)
        total = TripletMarginLoss(0.3, mining, reduction="sum")(emb, labels)
        mean = TripletMarginLoss(0.3, mining)(emb, labels)
        torch.testing.assert_close(total, per.sum())
        torch.testing.assert_close(mean, per.sum() / none.last_counts.sum())


def test_no_positive_gives_zero_loss_connected_graph(gen):
    emb, _ = _batch(gen, n=5)
    x = emb.clone().requires_grad_(True)
    with pytest.warns(RuntimeWarning, match="no positive pair"):
        value = TripletMarginLoss(mining="batch_all")(x, torch.arange(5))
    value.backward()
    assert value.item() == 0 and x.grad.abs().sum() == 0


@pytest.mark.parametrize(
    "make", [lambda: LocalMarginTripletLoss(), lambda: TripletMarginLoss(mining="batch_all")]
)
def test_warns_once_on_no_positive_and_collapse(gen, make):
    emb, _ = _batch(gen, n=6, dtype=torch.float32)
    loss = assert_warns_once(make, emb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss(torch.zeros(6, 3), torch.tensor([0, 0, 1, 1, 2, 2]))  # already warned


def test_bad_input_errors(gen):
    emb, labels = _batch(gen, n=6, dtype=torch.float32)
    for loss in (LocalMarginTripletLoss(), TripletMarginLoss()):
        assert_batch_errors(loss, emb, labels)
        with pytest.raises(ValueError, match="indices out of range"):
            loss(emb, labels, indices=(torch.tensor([0]), torch.tensor([6]), torch.tensor([1])))
        with pytest.raises(TypeError, match="indices"):
            loss(emb, labels, indices=(torch.tensor([0]), torch.tensor([1])))
        with pytest.raises(ValueError, match="equal lengths"):
            loss(emb, labels, indices=(torch.tensor([0]), torch.tensor([1, 2]), torch.tensor([1])))
    with pytest.raises(ValueError, match="k must be >= 1"):
        LocalMarginTripletLoss(k=0)
    with pytest.raises(TypeError, match="k must be an int"):
        LocalMarginTripletLoss(k=2.5)
    with pytest.raises(ValueError, match="margin must be a finite number >= 0"):
        LocalMarginTripletLoss(margin=-0.1)
    with pytest.raises(ValueError, match="margin must be a finite number >= 0"):
        TripletMarginLoss(margin=-1.0)
    with pytest.raises(ValueError, match="mining must be one of"):
        TripletMarginLoss(mining="hard")
    with pytest.raises(ValueError, match="distance must be one of"):
        TripletMarginLoss(distance="l1")
    loss = LocalMarginTripletLoss()
    loss.k = 0  # a schedule or a user changed the attribute: checked at forward time
    with pytest.raises(ValueError, match="k must be >= 1"):
        loss(emb, labels)


def test_last_active_fraction_is_a_tensor_without_sync(gen):
    emb, labels = _batch(gen, n=12, classes=3)
    loss = LocalMarginTripletLoss(k=2, margin=10.0)  # huge margin: every anchor active
    loss(emb, labels)
    assert isinstance(loss.last_active_fraction, torch.Tensor)
    assert loss.last_active_fraction.item() == 1.0
    loss = TripletMarginLoss(0.0, "batch_hard")
    loss(F.normalize(emb, dim=1), labels)
    assert 0.0 <= loss.last_active_fraction.item() <= 1.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: LocalMarginTripletLoss(k=2),
        lambda: TripletMarginLoss(mining="batch_all"),
        lambda: TripletMarginLoss(mining="semi_hard"),
        lambda: TripletMarginLoss(mining="batch_hard", distance="l2"),
    ],
)
def test_against_a_memory_bank(gen, make):
    from marginkit.mining import MemoryBank

    bank = MemoryBank(size=40, dim=5)
    emb, labels = _batch(gen, n=12, classes=3, dtype=torch.float32)
    x = emb.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty bank is not a "no positive pair" batch
        first = make()(x, labels, *bank.get())
    first.backward()
    assert first.item() == 0 and x.grad.abs().sum() == 0
    past, past_labels = _batch(gen, n=30, classes=3, dtype=torch.float32)
    bank.update(past, past_labels)
    ref, ref_labels = bank.get()
    torch.testing.assert_close(make()(emb, labels, ref, ref_labels), make()(emb, labels, past, past_labels))


class _SyncCounter:
    """Counts the Python-level calls that force a device -> host synchronisation."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))
        monkeypatch.setattr(torch, "equal", self._wrap("equal", torch.equal))

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)

        return counted


@pytest.mark.parametrize(
    ("make", "syncs_without_validation"),
    [
        (lambda v: LocalMarginTripletLoss(k=3, validate=v), 0),
        (lambda v: TripletMarginLoss(mining="batch_hard", validate=v), 0),
        (lambda v: TripletMarginLoss(mining="semi_hard", distance="l2", validate=v), 0),
        (lambda v: TripletMarginLoss(mining="batch_all", validate=v), 1),  # block sizing
    ],
)
def test_one_host_sync_per_forward(gen, monkeypatch, make, syncs_without_validation):
    """Counted on the path an accelerator runs: the CPU's compiled selection
    (:func:`marginkit.ops.selection.local_select`) hands CPU tensors to numpy, which reads no device."""
    from marginkit.ops import selection

    monkeypatch.setattr(selection, "FAST_CPU", False)
    emb, labels = _batch(gen, n=16, classes=4, dtype=torch.float32)
    x = emb.clone().requires_grad_(True)
    losses = (make(True), make(False))
    counter = _SyncCounter(monkeypatch)
    value = losses[0](x, labels)
    assert len(counter.calls) == 1, counter.calls  # NaN check + both warnings, read together
    counter.calls.clear()
    value = losses[1](x, labels) + value
    assert len(counter.calls) == syncs_without_validation, counter.calls
    counter.calls.clear()
    value.backward()
    assert counter.calls == []
