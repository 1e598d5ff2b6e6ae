"""Multi-similarity, SupCon, NT-Xent, contrastive and smooth triplet losses vs pytorch-metric-learning.

Every loss is compared in float64, value and gradient (of the embeddings and of the reference
embeddings) within 1e-9, with PML on the same inputs: all in-batch pairs, a memory bank of
references, mined indices (PML's miners and ours), classes of one sample (anchors without a
positive) and references lacking the anchor's other classes (anchors without a negative).
Explicit per-anchor float64 loops are the second, independent reference.
"""

from __future__ import annotations

import math
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
import marginkit.ops.contrastive as contrastive_module
from marginkit.losses import (
    ContrastiveLoss,
    LocalMarginTripletLoss,
    MultiSimilarityLoss,
    NTXentLoss,
    SupConLoss,
    TripletMarginLoss,
)
from marginkit.mining import MemoryBank, multi_similarity_pairs
from marginkit.ops import contrastive_loss, multi_similarity_loss, ntxent_loss, supcon_loss
from pair_inputs import assert_batch_errors, assert_warns_once
from test_triplet import _SyncCounter

TOL = {"atol": 1e-9, "rtol": 1e-9}


def _batch(gen, n=24, dim=6, classes=5, singletons=2, dtype=torch.float64):
    emb = torch.randn(n, dim, generator=gen, dtype=dtype)
    labels = torch.randint(0, classes, (n,), generator=gen)
    labels[:singletons] = torch.arange(100, 100 + singletons)  # classes of one sample
    return emb, labels


def _values_and_grads(fn, *tensors):
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    value = fn(*leaves)
    value.sum().backward()
    return [value.detach()] + [
        leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves
    ]


def _close(ours, theirs, **tol):
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **(tol or TOL))


# (name, ours, PML) — the same hyper-parameters; PML's defaults for distance and reducer
CASES = [
    ("ms", lambda: MultiSimilarityLoss(2.0, 50.0, 0.5), lambda: pml_losses.MultiSimilarityLoss(2, 50, 0.5)),
    (
        "ms_soft",
        lambda: MultiSimilarityLoss(1.5, 8.0, 0.2),
        lambda: pml_losses.MultiSimilarityLoss(1.5, 8, 0.2),
    ),
    ("supcon", lambda: SupConLoss(0.1), lambda: pml_losses.SupConLoss(0.1)),
    ("supcon_warm", lambda: SupConLoss(0.7), lambda: pml_losses.SupConLoss(0.7)),
    ("ntxent", lambda: NTXentLoss(0.07), lambda: pml_losses.NTXentLoss(0.07)),
    ("ntxent_warm", lambda: NTXentLoss(0.5), lambda: pml_losses.NTXentLoss(0.5)),
    ("contrastive", lambda: ContrastiveLoss(0.3, 1.1), lambda: pml_losses.ContrastiveLoss(0.3, 1.1)),
    (
        "contrastive_sq",
        lambda: ContrastiveLoss(0.4, 1.5, "squared_l2"),
        lambda: pml_losses.ContrastiveLoss(0.4, 1.5, distance=pml_distances.LpDistance(power=2)),
    ),
    (
        # d = 1 − cos: [d − 0.2]_+ = [0.8 − cos]_+ and [0.6 − d]_+ = [cos − 0.4]_+
        "contrastive_cos",
        lambda: ContrastiveLoss(0.2, 0.6, "cosine"),
        lambda: pml_losses.ContrastiveLoss(0.8, 0.4, distance=pml_distances.CosineSimilarity()),
    ),
    (
        "contrastive_raw",
        lambda: ContrastiveLoss(0.5, 3.0, normalize=False),
        lambda: pml_losses.ContrastiveLoss(
            0.5, 3.0, distance=pml_distances.LpDistance(normalize_embeddings=False)
        ),
    ),
    (
        "smooth_triplet",
        lambda: TripletMarginLoss(0.2, "batch_all", "l2", smooth_loss=True),
        lambda: pml_losses.TripletMarginLoss(0.2, smooth_loss=True),
    ),
    (
        "smooth_triplet_sq",
        lambda: TripletMarginLoss(0.5, "batch_all", "squared_l2", smooth_loss=True),
        lambda: pml_losses.TripletMarginLoss(
            0.5, smooth_loss=True, distance=pml_distances.LpDistance(power=2)
        ),
    ),
    (
        "smooth_triplet_cos",
        lambda: TripletMarginLoss(0.1, "batch_all", "cosine", smooth_loss=True),
        lambda: pml_losses.TripletMarginLoss(
            0.1, smooth_loss=True, distance=pml_distances.CosineSimilarity()
        ),
    ),
]
IDS = [c[0] for c in CASES]
PAIR_CASES = [c for c in CASES if "triplet" not in c[0]]


@pytest.mark.parametrize(("name", "ours", "theirs"), CASES, ids=IDS)
def test_all_pairs_equal_pml(gen, name, ours, theirs):
    emb, labels = _batch(gen)
    _close(
        _values_and_grads(lambda x: ours()(x, labels), emb),
        _values_and_grads(lambda x: theirs()(x, labels), emb),
    )


@pytest.mark.parametrize(("name", "ours", "theirs"), CASES, ids=IDS)
def test_memory_bank_equals_pml(gen, name, ours, theirs):
    # the bank holds classes 0-2 and 100 only: anchors of classes 3-4 and 101 have no positive
    emb, labels = _batch(gen, n=14)
    ref, ref_labels = _batch(gen, n=30, classes=3, singletons=1)
    _close(
        _values_and_grads(lambda x, r: ours()(x, labels, r, ref_labels), emb, ref),
        _values_and_grads(lambda x, r: theirs()(x, labels, ref_emb=r, ref_labels=ref_labels), emb, ref),
    )


@pytest.mark.parametrize(("name", "ours", "theirs"), CASES, ids=IDS)
def test_anchors_without_negatives_equal_pml(gen, name, ours, theirs):
    # a bank of classes 0 and 1 only, mostly 0: anchors of class 0 see one negative class,
    # the bank's class-0 rows alone are positives of every class-0 anchor
    emb, labels = _batch(gen, n=12, classes=2, singletons=0)
    ref, _ = _batch(gen, n=9, classes=2, singletons=0)
    ref_labels = torch.zeros(9, dtype=torch.long)
    ref_labels[-1] = 1
    _close(
        _values_and_grads(lambda x, r: ours()(x, labels, r, ref_labels), emb, ref),
        _values_and_grads(lambda x, r: theirs()(x, labels, ref_emb=r, ref_labels=ref_labels), emb, ref),
    )
    # no negative at all for the class-0 anchors
    only_zero = torch.zeros(9, dtype=torch.long)
    _close(
        _values_and_grads(lambda x, r: ours()(x, labels, r, only_zero), emb, ref),
        _values_and_grads(lambda x, r: theirs()(x, labels, ref_emb=r, ref_labels=only_zero), emb, ref),
    )


@pytest.mark.parametrize(("name", "ours", "theirs"), PAIR_CASES, ids=[c[0] for c in PAIR_CASES])
@pytest.mark.parametrize("miner", ["ms", "pair_margin", "triplets"])
def test_mined_indices_equal_pml(gen, name, ours, theirs, miner):
    emb, labels = _batch(gen, n=28)
    if miner == "ms":
        idx = pml_miners.MultiSimilarityMiner(0.1)(emb, labels)
    elif miner == "pair_margin":
        idx = pml_miners.PairMarginMiner(pos_margin=0.4, neg_margin=1.0)(emb, labels)
    else:  # triplets (a, p, n): read as the pairs (a, p), (a, n), with repeats
        idx = pml_miners.TripletMarginMiner(margin=0.3, type_of_triplets="semihard")(emb, labels)
    assert all(len(t) > 1 for t in idx)
    _close(
        _values_and_grads(lambda x: ours()(x, indices=idx), emb),
        _values_and_grads(lambda x: theirs()(x, labels, idx), emb),
    )


@pytest.mark.parametrize("distance", ["l2", "squared_l2", "cosine"])
def test_smooth_triplet_mined_and_batch_hard_equal_pml(gen, distance):
    emb, labels = _batch(gen, n=26)
    pml_distance = {
        "l2": pml_distances.LpDistance(),
        "squared_l2": pml_distances.LpDistance(power=2),
        "cosine": pml_distances.CosineSimilarity(),
    }[distance]
    idx = pml_miners.TripletMarginMiner(margin=0.2, type_of_triplets="all")(emb, labels)
    ours = TripletMarginLoss(0.2, distance=distance, smooth_loss=True, average="active")
    theirs = pml_losses.TripletMarginLoss(0.2, smooth_loss=True, distance=pml_distance)
    _close(
        _values_and_grads(lambda x: ours(x, labels, indices=idx), emb),
        _values_and_grads(lambda x: theirs(x, labels, idx), emb),
    )

    def pml_batch_hard(x):
        mined = pml_miners.BatchHardMiner(distance=pml_distance)(x, labels)
        reducer = pml_reducers.MeanReducer()
        return pml_losses.TripletMarginLoss(0.2, smooth_loss=True, distance=pml_distance, reducer=reducer)(
            x, labels, mined
        )

    batch_hard = TripletMarginLoss(0.2, "batch_hard", distance, smooth_loss=True)
    _close(_values_and_grads(lambda x: batch_hard(x, labels), emb), _values_and_grads(pml_batch_hard, emb))


# ------------------------------------------------------------------ the multi-similarity miner


def _pair_set(a, p):
    return sorted(zip(a.tolist(), p.tolist(), strict=True))


@pytest.mark.parametrize("epsilon", [0.1, 0.0, 0.3, -0.05])
@pytest.mark.parametrize("with_bank", [False, True])
def test_multi_similarity_miner_equals_pml(gen, epsilon, with_bank):
    emb, labels = _batch(gen, n=30)
    ref, ref_labels = _batch(gen, n=40, classes=4, singletons=0) if with_bank else (None, None)
    ours = multi_similarity_pairs(emb, labels, epsilon, ref_embeddings=ref, ref_labels=ref_labels)
    theirs = pml_miners.MultiSimilarityMiner(epsilon)(emb, labels, ref, ref_labels)
    assert _pair_set(ours[0], ours[1]) == _pair_set(theirs[0], theirs[1])
    assert _pair_set(ours[2], ours[3]) == _pair_set(theirs[2], theirs[3])
    assert all(t.dtype == torch.int64 for t in ours)


def test_multi_similarity_epsilon_mines_inside_the_loss(gen):
    emb, labels = _batch(gen, n=30)
    idx = multi_similarity_pairs(emb, labels, 0.1)
    inside = _values_and_grads(lambda x: MultiSimilarityLoss(epsilon=0.1)(x, labels), emb)
    _close(inside, _values_and_grads(lambda x: MultiSimilarityLoss()(x, indices=idx), emb))
    # the paper's recipe in PML: the miner's pairs fed to the loss
    _close(
        inside,
        _values_and_grads(
            lambda x: pml_losses.MultiSimilarityLoss()(
                x, labels, pml_miners.MultiSimilarityMiner(0.1)(x, labels)
            ),
            emb,
        ),
    )


def test_miner_output_without_pairs(gen):
    emb, _ = _batch(gen, n=6)
    a1, p, a2, n = multi_similarity_pairs(emb, torch.arange(6))  # no positive: nothing is informative
    assert a1.numel() == p.numel() == a2.numel() == n.numel() == 0
    a1, p, a2, n = multi_similarity_pairs(emb, labels=torch.zeros(6, dtype=torch.long))  # no negative
    assert a1.numel() == a2.numel() == 0


# ------------------------------------------------------------------ explicit float64 loops


def _candidates(labels, ref_labels, self_ref):
    for i in range(len(labels)):
        pos = [j for j in range(len(ref_labels)) if ref_labels[j] == labels[i] and not (self_ref and i == j)]
        neg = [j for j in range(len(ref_labels)) if ref_labels[j] != labels[i]]
        yield i, pos, neg


def _cos(u, v):
    return (u @ v) / (u.norm() * v.norm())


def loop_multi_similarity(emb, labels, alpha, beta, base, ref=None, ref_labels=None):
    y, rl = (emb, labels) if ref is None else (ref, ref_labels)
    out = []
    for i, pos, neg in _candidates(labels, rl, ref is None):
        sp = sum((torch.exp(-alpha * (_cos(emb[i], y[j]) - base)) for j in pos), emb.new_zeros(()))
        sn = sum((torch.exp(beta * (_cos(emb[i], y[j]) - base)) for j in neg), emb.new_zeros(()))
        out.append(torch.log1p(sp) / alpha + torch.log1p(sn) / beta)
    return torch.stack(out)


def loop_supcon(emb, labels, tau):
    out = []
    for i, pos, neg in _candidates(labels, labels, True):
        if not pos:
            out.append(emb.sum() * 0)
            continue
        denominator = sum(torch.exp(_cos(emb[i], emb[a]) / tau) for a in pos + neg)
        out.append(
            -sum(torch.log(torch.exp(_cos(emb[i], emb[p]) / tau) / denominator) for p in pos) / len(pos)
        )
    return torch.stack(out)


def loop_ntxent(emb, labels, tau):
    """Per positive pair, in row-major order."""
    out = []
    for i, pos, neg in _candidates(labels, labels, True):
        negatives = sum((torch.exp(_cos(emb[i], emb[n]) / tau) for n in neg), emb.new_zeros(()))
        for p in pos:
            e = torch.exp(_cos(emb[i], emb[p]) / tau)
            out.append(-torch.log(e / (e + negatives)))
    return torch.stack(out)


@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(2, 12),
    classes=st.integers(1, 5),
    params=st.sampled_from([(2.0, 50.0, 0.5), (0.5, 3.0, -0.2), (4.0, 10.0, 1.0)]),
)
def test_multi_similarity_equals_loop(seed, n, classes, params):
    gen = torch.Generator().manual_seed(seed)
    emb, labels = _batch(gen, n=n, dim=3, classes=classes, singletons=0)
    loss = MultiSimilarityLoss(*params, reduction="none", validate=False)
    _close(
        _values_and_grads(lambda x: loss(x, labels), emb),
        _values_and_grads(lambda x: loop_multi_similarity(x, labels, *params), emb),
    )


def test_multi_similarity_bank_equals_loop(gen):
    emb, labels = _batch(gen, n=9)
    ref, ref_labels = _batch(gen, n=13, classes=3, singletons=0)
    loss = MultiSimilarityLoss(2.0, 20.0, 0.5, reduction="none")
    _close(
        _values_and_grads(lambda x, r: loss(x, labels, r, ref_labels), emb, ref),
        _values_and_grads(
            lambda x, r: loop_multi_similarity(x, labels, 2.0, 20.0, 0.5, r, ref_labels), emb, ref
        ),
    )


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 12), classes=st.integers(1, 5))
def test_supcon_and_ntxent_equal_loops(seed, n, classes):
    gen = torch.Generator().manual_seed(seed)
    emb, labels = _batch(gen, n=n, dim=3, classes=classes, singletons=0)
    _close(
        _values_and_grads(lambda x: SupConLoss(0.3, reduction="none", validate=False)(x, labels), emb),
        _values_and_grads(lambda x: loop_supcon(x, labels, 0.3), emb),
    )
    if (labels[:, None] == labels[None, :]).sum() > n:  # some positive pair
        mean = _values_and_grads(lambda x: NTXentLoss(0.3, validate=False)(x, labels), emb)
        _close(mean, _values_and_grads(lambda x: loop_ntxent(x, labels, 0.3).mean(), emb))


@given(seed=st.integers(0, 2**31 - 1), pairs=st.integers(2, 10), tau=st.floats(0.05, 2.0))
def test_one_positive_each_supcon_is_ntxent_is_cross_entropy(seed, pairs, tau):
    # SimCLR's setting: two views per label, so each anchor has exactly one positive
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(2 * pairs, 4, generator=gen, dtype=torch.float64)
    labels = torch.arange(pairs).repeat(2)
    supcon = _values_and_grads(lambda x: SupConLoss(tau, validate=False)(x, labels), emb)
    ntxent = _values_and_grads(lambda x: NTXentLoss(tau, validate=False)(x, labels), emb)

    def cross_entropy(x):
        z = F.normalize(x, dim=1) @ F.normalize(x, dim=1).T / tau
        z = z.masked_fill(torch.eye(2 * pairs, dtype=torch.bool), -math.inf)
        return F.cross_entropy(z, (torch.arange(2 * pairs) + pairs) % (2 * pairs))

    _close(supcon, ntxent)
    _close(ntxent, _values_and_grads(cross_entropy, emb))


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(3, 14), classes=st.integers(1, 4))
def test_losses_are_permutation_invariant(seed, n, classes):
    gen = torch.Generator().manual_seed(seed)
    emb, labels = _batch(gen, n=n, dim=3, classes=classes, singletons=1)
    perm = torch.randperm(n, generator=gen)
    for make in (
        lambda: MultiSimilarityLoss(epsilon=0.1, validate=False),
        lambda: SupConLoss(validate=False),
        lambda: NTXentLoss(validate=False),
        lambda: ContrastiveLoss(validate=False),
        lambda: TripletMarginLoss(mining="batch_all", smooth_loss=True, validate=False),
    ):
        torch.testing.assert_close(make()(emb[perm], labels[perm]), make()(emb, labels), **TOL)


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(3, 14), classes=st.integers(1, 4))
def test_all_pairs_as_indices_equal_the_labels(seed, n, classes):
    gen = torch.Generator().manual_seed(seed)
    emb, labels = _batch(gen, n=n, dim=3, classes=classes, singletons=1)
    same = labels[:, None] == labels[None, :]
    a1, p = (same & ~torch.eye(n, dtype=torch.bool)).nonzero(as_tuple=True)
    a2, neg = (~same).nonzero(as_tuple=True)
    for make in (MultiSimilarityLoss, SupConLoss, NTXentLoss, ContrastiveLoss):
        torch.testing.assert_close(
            make(validate=False)(emb, indices=(a1, p, a2, neg)), make(validate=False)(emb, labels), **TOL
        )


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(3, 14), margin=st.floats(0.0, 1.0))
def test_smooth_triplet_bounds_the_hinge(seed, n, margin):
    gen = torch.Generator().manual_seed(seed)
    emb, labels = _batch(gen, n=n, dim=3, classes=3, singletons=0)
    for mining in ("batch_all", "batch_hard", "semi_hard"):
        hinge = TripletMarginLoss(margin, mining, reduction="none", validate=False)(emb, labels)
        smooth_loss = TripletMarginLoss(
            margin, mining, smooth_loss=True, average="valid", reduction="none", validate=False
        )
        smooth = smooth_loss(emb, labels)
        # 0 <= softplus(t) − relu(t) = log(1 + e^{−|t|}) <= log 2, per triplet
        assert (smooth >= hinge - 1e-12).all()
        assert (smooth - hinge <= math.log(2) * smooth_loss.last_counts + 1e-12).all()


def test_contrastive_valid_average_equals_loop(gen):
    emb, labels = _batch(gen, n=15)
    x = F.normalize(emb, dim=1)
    pos_terms, neg_terms = [], []
    for i, pos, neg in _candidates(labels, labels, True):
        pos_terms += [torch.relu((x[i] - x[j]).norm() - 0.2) for j in pos]
        neg_terms += [torch.relu(0.9 - (x[i] - x[j]).norm()) for j in neg]
    expected = torch.stack(pos_terms).mean() + torch.stack(neg_terms).mean()
    torch.testing.assert_close(ContrastiveLoss(0.2, 0.9, average="valid")(emb, labels), expected, **TOL)


@pytest.mark.parametrize("counts", [False, True])
def test_contrastive_hinges_gradcheck(gen, counts):
    d = (torch.rand(2, 5, 7, generator=gen, dtype=torch.float64) * 1.6 + 0.05).requires_grad_(True)
    pos = torch.rand(2, 5, 7, generator=gen) < 0.4
    neg = torch.rand(2, 5, 7, generator=gen) < 0.7  # overlapping masks too (the op allows them)
    if counts:
        pos, neg = pos * torch.randint(1, 4, pos.shape, generator=gen), neg * 2
    g_pos, g_neg = torch.rand(2, 2, 5, generator=gen, dtype=torch.float64)

    def fn(x):
        s_pos, s_neg, _, _ = contrastive_module._contrastive(x, pos, neg, 0.3, 0.9)
        return (s_pos * g_pos).sum() + (s_neg * g_neg).sum()

    assert torch.autograd.gradcheck(fn, (d,))
    # the closed form equals autograd through the plain formula
    plain = ((d - 0.3).relu() * pos).sum(-1) * g_pos + ((0.9 - d).relu() * neg).sum(-1) * g_neg
    torch.testing.assert_close(
        torch.autograd.grad(fn(d), d)[0], torch.autograd.grad(plain.sum(), d)[0], **TOL
    )


def test_smooth_batch_all_function_gradcheck(gen):
    dist = torch.rand(5, 6, generator=gen, dtype=torch.float64).requires_grad_(True)
    labels = torch.tensor([0, 0, 1, 1, 1])
    ref_labels = torch.tensor([0, 1, 1, 0, 2, 1])
    pos = labels[:, None] == ref_labels[None, :]
    pos_idx = torch.sort(pos.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :3]
    pos_valid = torch.arange(3)[None, :] < pos.sum(1)[:, None]

    def fn(d):
        return triplet_module._BatchAllTriplets.apply(d, pos_idx, pos_valid, ~pos, 0.3, 2, True)[0]

    assert torch.autograd.gradcheck(fn, (dist,))


def test_smooth_batch_all_blocks_equal_one_block(gen, monkeypatch):
    emb, labels = _batch(gen, n=30)
    make = lambda: TripletMarginLoss(0.3, "batch_all", smooth_loss=True)  # noqa: E731
    whole = _values_and_grads(lambda x: make()(x, labels), emb)
    monkeypatch.setattr(triplet_module, "BLOCK_ELEMENTS", 7)  # one anchor per block
    _close(_values_and_grads(lambda x: make()(x, labels), emb), whole)


# ------------------------------------------------------------------ ops


def test_ops_match_the_modules(gen):
    emb, labels = _batch(gen, n=10)
    sim = F.normalize(emb, dim=1) @ F.normalize(emb, dim=1).T
    same = labels[:, None] == labels[None, :]
    pos, neg = same & ~torch.eye(10, dtype=torch.bool), ~same
    torch.testing.assert_close(
        multi_similarity_loss(sim, pos, neg, 2.0, 40.0, 0.5),
        MultiSimilarityLoss(2.0, 40.0, 0.5, reduction="none")(emb, labels),
        **TOL,
    )
    torch.testing.assert_close(
        supcon_loss(sim, pos, neg, 0.2), SupConLoss(0.2, reduction="none")(emb, labels), **TOL
    )
    torch.testing.assert_close(
        ntxent_loss(sim, pos, neg, 0.2).sum(1), NTXentLoss(0.2, reduction="none")(emb, labels), **TOL
    )
    dist = torch.cdist(F.normalize(emb, dim=1), F.normalize(emb, dim=1))
    torch.testing.assert_close(
        contrastive_loss(dist, pos, neg, 0.1, 1.0),
        ContrastiveLoss(0.1, 1.0, average="valid", reduction="none")(emb, labels),
        **TOL,
    )


def test_ops_are_batched_over_leading_dimensions(gen):
    sim = torch.rand(3, 4, 7, generator=gen, dtype=torch.float64) * 2 - 1
    pos = torch.rand(3, 4, 7, generator=gen) < 0.3
    neg = ~pos & (torch.rand(3, 4, 7, generator=gen) < 0.8)
    for op in (multi_similarity_loss, supcon_loss, ntxent_loss, contrastive_loss):
        whole = op(sim, pos, neg)
        rows = torch.stack([op(sim[i], pos[i], neg[i]) for i in range(3)])
        torch.testing.assert_close(whole, rows, **TOL)


def test_ntxent_op_counts_multiplicities():
    sim = torch.tensor([[0.9, 0.1, -0.3]], dtype=torch.float64)
    pos = torch.tensor([[1, 0, 0]])
    twice = torch.tensor([[0, 2, 1]])  # negative 1 listed twice
    expected = -math.log(math.exp(0.9) / (math.exp(0.9) + 2 * math.exp(0.1) + math.exp(-0.3)))
    assert ntxent_loss(sim, pos, twice, temperature=1.0)[0, 0].item() == pytest.approx(expected, abs=1e-12)


def test_empty_rows_give_zero_and_finite_gradients():
    sim = torch.tensor([[0.5, -0.2], [0.1, 0.3]], dtype=torch.float64, requires_grad=True)
    none = torch.zeros(2, 2, dtype=torch.bool)
    some = torch.tensor([[True, False], [False, False]])
    total = sum(op(sim, none, some).sum() + op(sim, some, none).sum() for op in (
        multi_similarity_loss, supcon_loss, ntxent_loss
    ))  # fmt: skip
    total.backward()
    assert torch.isfinite(sim.grad).all()
    assert supcon_loss(sim, none, some).eq(0).all() and multi_similarity_loss(sim, none, none).eq(0).all()


def test_op_errors():
    sim = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="sim must be cosines"):
        supcon_loss(sim + 2, mask, mask)
    with pytest.raises(TypeError, match="pos_mask must be a bool tensor or integer multiplicities"):
        ntxent_loss(sim, mask.float(), mask)
    with pytest.raises(ValueError, match="neg_mask of shape \\(4,\\) does not broadcast"):
        multi_similarity_loss(sim, mask, torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="neg_mask multiplicities must be >= 0"):
        ntxent_loss(sim, mask, -torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        supcon_loss(sim, mask, mask, temperature=0.0)
    with pytest.raises(ValueError, match="dist contains NaN"):
        contrastive_loss(torch.full((2, 3), math.nan), mask, mask)
    with pytest.raises(ValueError, match="base must be finite"):
        multi_similarity_loss(sim, mask, mask, base=math.inf)


# ------------------------------------------------------------------ module behaviour

MAKERS = [
    lambda **kw: MultiSimilarityLoss(**kw),
    lambda **kw: MultiSimilarityLoss(epsilon=0.1, **kw),
    lambda **kw: SupConLoss(**kw),
    lambda **kw: NTXentLoss(**kw),
    lambda **kw: ContrastiveLoss(**kw),
]
MAKER_IDS = ["ms", "ms_mined", "supcon", "ntxent", "contrastive"]


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_reductions_are_consistent(gen, make):
    emb, labels = _batch(gen, n=16)
    none = make(reduction="none")(emb, labels)
    assert none.shape == (16,)
    torch.testing.assert_close(make(reduction="sum")(emb, labels), none.sum(), **TOL)
    mean = make()(emb, labels)
    assert mean.dim() == 0 and torch.isfinite(mean)


def test_ntxent_mean_is_none_over_counts(gen):
    emb, labels = _batch(gen, n=16)
    loss = NTXentLoss(reduction="none")
    none = loss(emb, labels)
    torch.testing.assert_close(NTXentLoss()(emb, labels), none.sum() / loss.last_counts.sum(), **TOL)


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_empty_memory_bank_gives_zero_connected_loss(gen, make):
    bank = MemoryBank(size=20, dim=6)
    emb, labels = _batch(gen, n=8, dtype=torch.float32)
    x = emb.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value = make()(x, labels, *bank.get())
    value.backward()
    assert value.item() == 0 and x.grad.abs().sum() == 0
    past, past_labels = _batch(gen, n=20, dtype=torch.float32)
    bank.update(past, past_labels)
    torch.testing.assert_close(make()(emb, labels, *bank.get()), make()(emb, labels, past, past_labels))


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(gen, make, dtype):
    emb, labels = _batch(gen, n=16, dtype=torch.float32)
    x = emb.to(dtype).requires_grad_(True)
    value = make()(x, labels)
    value.backward()
    assert value.dtype == torch.float32 and x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()
    torch.testing.assert_close(value, make()(emb.to(dtype).float(), labels))


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_warns_once_on_no_positive_and_collapse(gen, make):
    assert_warns_once(make, _batch(gen, n=6, dtype=torch.float32)[0])


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_one_host_sync_per_forward(gen, monkeypatch, make):
    emb, labels = _batch(gen, n=16, dtype=torch.float32)
    x = emb.clone().requires_grad_(True)
    checked, unchecked = make(), make(validate=False)
    counter = _SyncCounter(monkeypatch)
    value = checked(x, labels)
    assert len(counter.calls) == 1, counter.calls
    counter.calls.clear()
    value = unchecked(x, labels) + value
    assert counter.calls == []
    value.backward()
    assert counter.calls == []


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_bad_inputs_name_the_argument(gen, make):
    emb, labels = _batch(gen, n=6, dtype=torch.float32)
    loss = make()
    assert_batch_errors(loss, emb, labels)
    one, two = torch.tensor([0]), torch.tensor([1])
    with pytest.raises(ValueError, match="indices out of range"):
        loss(emb, indices=(one, torch.tensor([6]), one, two))
    with pytest.raises(ValueError, match="indices out of range"):
        loss(emb, indices=(torch.tensor([-1]), two, one, two))
    with pytest.raises(TypeError, match="indices must be a tuple"):
        loss(emb, indices=(one, two))
    with pytest.raises(TypeError, match="indices\\[positive\\] must be an integer"):
        loss(emb, indices=(one, two.float(), one, two))
    with pytest.raises(ValueError, match="indices must pair up"):
        loss(emb, indices=(one, torch.tensor([1, 2]), one, two))
    with pytest.raises(ValueError, match="both as a positive and as a negative"):
        loss(emb, indices=(one, two, one, two))
    with pytest.raises(ValueError, match="reduction must be one of"):
        make(reduction="avg")


def test_bad_hyper_parameters_name_the_argument():
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        MultiSimilarityLoss(alpha=0.0)
    with pytest.raises(ValueError, match="beta must be a finite number > 0"):
        MultiSimilarityLoss(beta=-1.0)
    with pytest.raises(TypeError, match="base must be a real number"):
        MultiSimilarityLoss(base="0.5")
    with pytest.raises(ValueError, match="epsilon must be finite"):
        MultiSimilarityLoss(epsilon=math.nan)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        SupConLoss(temperature=0.0)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        NTXentLoss(temperature=-0.1)
    with pytest.raises(ValueError, match="neg_margin must be finite"):
        ContrastiveLoss(neg_margin=math.inf)
    with pytest.raises(ValueError, match="distance must be one of"):
        ContrastiveLoss(distance="l1")
    with pytest.raises(ValueError, match="average must be one of"):
        ContrastiveLoss(average="nonzero")
    with pytest.raises(ValueError, match="epsilon must be finite"):
        multi_similarity_pairs(torch.randn(4, 2), torch.tensor([0, 0, 1, 1]), math.inf)
    with pytest.raises(ValueError, match="labels must have shape"):
        multi_similarity_pairs(torch.randn(4, 2), torch.tensor([0, 0, 1]))
    loss = SupConLoss()
    loss.temperature = 0.0  # a schedule or a user changed the attribute: checked at forward time
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        loss(torch.randn(4, 2), torch.tensor([0, 0, 1, 1]))


def test_last_active_fraction_is_a_tensor(gen):
    emb, labels = _batch(gen, n=12, singletons=0)
    for loss in (MultiSimilarityLoss(epsilon=0.1), SupConLoss(), NTXentLoss(), ContrastiveLoss()):
        loss(emb, labels)
        assert isinstance(loss.last_active_fraction, torch.Tensor)
        assert 0.0 <= loss.last_active_fraction.item() <= 1.0
    loss = ContrastiveLoss(pos_margin=-1.0, neg_margin=5.0)  # every pair violates its margin
    loss(emb, labels)
    assert loss.last_active_fraction.item() == 1.0


def test_overflowing_distances_are_an_error_not_a_nan():
    emb = torch.tensor([[1e20, 0.0], [0.0, 1e20], [1e20, 1.0], [1.0, 1e20]])
    labels = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="distances overflow to infinity in torch.float32"):
        ContrastiveLoss(normalize=False, distance="squared_l2")(emb, labels)
    with pytest.raises(ValueError, match="distances overflow"):
        ContrastiveLoss(normalize=False, distance="l2")(emb * 1e18, labels)


@pytest.mark.parametrize(
    "make",
    [MultiSimilarityLoss, SupConLoss, NTXentLoss, ContrastiveLoss, TripletMarginLoss, LocalMarginTripletLoss],
)
def test_every_declared_hyperparameter_is_rechecked_at_forward(make):
    # the table each pair loss declares is what construction, forward and repr all read
    loss = make()
    names = [name for name, _ in loss.hyperparameters]
    assert names and all(f"{name}=" in repr(loss) for name in names)
    emb = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    for name in names:
        bad = make()
        setattr(bad, name, math.nan)
        with pytest.raises((TypeError, ValueError), match=name):
            bad(emb, labels)
        with pytest.raises((TypeError, ValueError), match=name):
            make(**{name: math.nan})
