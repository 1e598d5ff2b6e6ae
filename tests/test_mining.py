"""Triplet miners vs per-anchor loop references; mined indices reproduce the losses."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marginkit.losses import LocalMarginTripletLoss, TripletMarginLoss
from marginkit.mining import batch_hard_triplets, local_triplets


def _batch(gen, n=20, dim=5, classes=4, dtype=torch.float64):
    return torch.randn(n, dim, generator=gen, dtype=dtype), torch.randint(0, classes, (n,), generator=gen)


def _sq(u, v):
    return float(((u - v) ** 2).sum())


def _dist(u, v, distance):
    if distance == "cosine":
        return float(1 - (u @ v) / (u.norm() * v.norm()))
    return math.sqrt(_sq(u, v)) if distance == "l2" else _sq(u, v)


def loop_local_triplets(emb, labels, k, margin, normalize=True, ref=None, ref_labels=None):
    self_ref = ref is None
    x = emb / emb.norm(dim=1, keepdim=True) if normalize else emb
    if self_ref:
        y, ref_labels = x, labels
    else:
        y = ref / ref.norm(dim=1, keepdim=True) if normalize else ref
    out = []
    for a in range(len(x)):
        pos = [j for j in range(len(y)) if ref_labels[j] == labels[a] and not (self_ref and j == a)]
        neg = [j for j in range(len(y)) if ref_labels[j] != labels[a]]
        if not pos or not neg:
            continue
        p = sorted(pos, key=lambda j: (_sq(x[a], y[j]), j))[min(k, len(pos)) - 1]
        n = min(neg, key=lambda j: (_sq(x[a], y[j]), j))
        if _sq(x[a], y[n]) < _sq(x[a], y[p]) + margin:
            out.append((a, p, n))
    return out


def loop_batch_hard(emb, labels, distance, margin=None):
    x = emb / emb.norm(dim=1, keepdim=True)
    out = []
    for a in range(len(x)):
        pos = [j for j in range(len(x)) if labels[j] == labels[a] and j != a]
        neg = [j for j in range(len(x)) if labels[j] != labels[a]]
        if not pos or not neg:
            continue
        p = max(pos, key=lambda j: (_dist(x[a], x[j], distance), -j))
        n = min(neg, key=lambda j: (_dist(x[a], x[j], distance), j))
        if margin is None or _dist(x[a], x[p], distance) - _dist(x[a], x[n], distance) + margin > 0:
            out.append((a, p, n))
    return out


def _as_list(idx):
    assert all(t.dtype == torch.int64 and t.dim() == 1 for t in idx)
    assert not any(t.requires_grad for t in idx)
    return list(zip(*(t.tolist() for t in idx), strict=True))


@pytest.mark.parametrize("k", [1, 3, 40])
@pytest.mark.parametrize("margin", [0.0, 0.3, 5.0])
def test_local_triplets_equal_loop(gen, k, margin):
    emb, labels = _batch(gen, n=22, classes=4)
    labels[3] = 17  # a singleton anchor is skipped
    got = _as_list(local_triplets(emb, labels, k, margin))
    assert got == loop_local_triplets(emb, labels, k, margin)
    if margin == 5.0:  # every anchor with a positive and a negative violates a huge margin
        assert [a for a, _, _ in got] == [a for a in range(22) if a != 3 and (labels == labels[a]).sum() > 1]


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 14), classes=st.integers(1, 4), k=st.integers(1, 5))
def test_local_triplets_property(seed, n, classes, k):
    gen = torch.Generator().manual_seed(seed)
    emb, labels = _batch(gen, n=n, dim=3, classes=classes)
    assert _as_list(local_triplets(emb, labels, k, 0.2, normalize=False)) == loop_local_triplets(
        emb, labels, k, 0.2, normalize=False
    )


def test_local_triplets_with_reference_set(gen):
    emb, labels = _batch(gen, n=9, classes=3)
    ref, ref_labels = _batch(gen, n=14, classes=3)
    got = _as_list(local_triplets(emb, labels, 2, 0.5, ref_embeddings=ref, ref_labels=ref_labels))
    assert got == loop_local_triplets(emb, labels, 2, 0.5, ref=ref, ref_labels=ref_labels)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_local_triplets_reproduce_local_margin_loss(gen, k):
    # the mined (active) triplets, fed back as indices, give the loss's sum and gradient
    emb, labels = _batch(gen, n=24, classes=4)
    idx = local_triplets(emb, labels, k, 0.3)
    a, b = emb.clone().requires_grad_(True), emb.clone().requires_grad_(True)
    full = LocalMarginTripletLoss(k=k, margin=0.3, reduction="sum")(a, labels)
    mined = LocalMarginTripletLoss(k=k, margin=0.3, reduction="sum")(b, labels, indices=idx)
    full.backward()
    mined.backward()
    torch.testing.assert_close(full, mined)
    torch.testing.assert_close(a.grad, b.grad)
    via_triplet = TripletMarginLoss(0.3, distance="squared_l2", reduction="sum")(emb, labels, indices=idx)
    torch.testing.assert_close(via_triplet, full.detach())


@pytest.mark.parametrize("distance", ["squared_l2", "l2", "cosine"])
@pytest.mark.parametrize("margin", [None, 0.1])
def test_batch_hard_triplets_equal_loop(gen, distance, margin):
    emb, labels = _batch(gen, n=18, classes=4)
    got = _as_list(batch_hard_triplets(emb, labels, distance=distance, margin=margin))
    assert got == loop_batch_hard(emb, labels, distance, margin)


def test_miners_do_not_track_gradients(gen):
    emb, labels = _batch(gen)
    emb.requires_grad_(True)
    for idx in (local_triplets(emb, labels, 3, 0.2), batch_hard_triplets(emb, labels)):
        assert not any(t.requires_grad for t in idx)


def test_miners_handle_half_precision(gen):
    emb, labels = _batch(gen, n=16, dtype=torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        a, p, n = batch_hard_triplets(emb.to(dtype), labels)
        assert (labels[a] == labels[p]).all() and (labels[a] != labels[n]).all()
        a, p, n = local_triplets(emb.to(dtype), labels, 2, 1.0)
        assert (labels[a] == labels[p]).all() and (labels[a] != labels[n]).all()


def test_miner_bad_input(gen):
    emb, labels = _batch(gen, n=6, dtype=torch.float32)
    with pytest.raises(ValueError, match="k must be >= 1"):
        local_triplets(emb, labels, 0, 0.1)
    with pytest.raises(ValueError, match="margin must be a finite number >= 0"):
        local_triplets(emb, labels, 1, -0.1)
    with pytest.raises(ValueError, match="labels must have shape"):
        local_triplets(emb, labels[:3], 1, 0.1)
    with pytest.raises(TypeError, match="labels must be an integer"):
        batch_hard_triplets(emb, labels.float())
    with pytest.raises(ValueError, match="embeddings must be 2-D"):
        batch_hard_triplets(emb[0], labels[:1])
    bad = emb.clone()
    bad[1, 1] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        batch_hard_triplets(bad, labels)
    with pytest.raises(ValueError, match="distance must be one of"):
        batch_hard_triplets(emb, labels, distance="manhattan")
    with pytest.raises(ValueError, match="ref_embeddings was given without ref_labels"):
        local_triplets(emb, labels, 1, 0.1, ref_embeddings=emb.clone())


def test_miners_with_an_empty_reference_set(gen):
    emb, labels = _batch(gen, n=6)
    for idx in (
        local_triplets(emb, labels, 2, 0.1, ref_embeddings=emb[:0], ref_labels=labels[:0]),
        batch_hard_triplets(emb, labels, ref_embeddings=emb[:0], ref_labels=labels[:0]),
    ):
        assert _as_list(idx) == []
