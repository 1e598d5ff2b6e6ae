"""CombinedMargin / SubCenterArcFace / AdaFace / ProxyAnchor against independent references.

References: F.cross_entropy on explicitly built float64 logits (arcface_torch's combined margin
``cos(m1·arccos c + m2) − m3`` and the AdaFace authors' head, both re-written here with
``torch.arccos`` from their published formulas), pytorch-metric-learning's SubCenterArcFaceLoss
and ProxyAnchorLoss (which own their weights: copied from our heads), a per-proxy Python loop
for Proxy-Anchor, and finite differences (gradcheck). Sharded == one process: in
tests/test_distributed_losses.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from marginkit.heads import CosineHead, NormedCosines, ShardedCosineHead
from marginkit.heads.cosine import cosine_similarity_matrix
from marginkit.losses import (
    AdaFaceLoss,
    ArcFaceLoss,
    CombinedMarginLoss,
    CosFaceLoss,
    ProxyAnchorLoss,
    SubCenterArcFaceLoss,
)
from marginkit.ops import subcenter_cosines
from marginkit.ops.margins import combined_margin_target

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")

TOL = {"rtol": 1e-9, "atol": 1e-12}


def rand_cos(gen, b, c, lim=0.95):
    return (torch.rand(b, c, generator=gen, dtype=torch.float64) * 2 - 1) * lim


def ce_with_target(cos, labels, scale, target):
    """CE of s·c with the label column replaced by s·target (float64, plain autograd)."""
    onehot = F.one_hot(labels, cos.shape[1]).to(cos.dtype)
    logits = scale * (cos * (1 - onehot) + target.unsqueeze(1) * onehot)
    return F.cross_entropy(logits, labels, reduction="none")


def value_and_grad(fn, cos, labels):
    x = cos.detach().clone().requires_grad_(True)
    out = fn(x, labels)
    (g,) = torch.autograd.grad(out.sum(), x)
    return out.detach(), g


# ---------------------------------------------------------------------------------------------
# CombinedMarginLoss
# ---------------------------------------------------------------------------------------------
def arcface_torch_combined(cos, labels, m1, m2, m3, scale):
    """arcface_torch's formula: target cos(m1·arccos(c) + m2) − m3 (valid while m1·θ + m2 ≤ π)."""
    c_y = cos.gather(1, labels[:, None]).squeeze(1)
    return ce_with_target(cos, labels, scale, torch.cos(m1 * torch.arccos(c_y) + m2) - m3)


@pytest.mark.parametrize("margins", [(1.0, 0.3, 0.2), (0.9, 0.4, 0.15), (1.2, 0.2, 0.1), (1.0, 0.5, 0.0)])
def test_combined_margin_equals_arcface_torch_formula(gen, margins):
    m1, m2, m3 = margins
    cos, y = rand_cos(gen, 40, 17), torch.randint(0, 17, (40,), generator=gen)
    target = torch.rand(40, 1, generator=gen, dtype=torch.float64) * 1.5 - 0.55  # c_y in [-0.55, 0.95]
    cos.scatter_(1, y[:, None], target)
    theta = torch.arccos(cos.gather(1, y[:, None]))
    assert bool((m1 * theta + m2 < math.pi).all())  # the formula's own domain
    ours = value_and_grad(CombinedMarginLoss(m1, m2, m3, scale=32.0, reduction="none"), cos, y)
    ref = value_and_grad(lambda x, t: arcface_torch_combined(x, t, m1, m2, m3, 32.0), cos, y)
    torch.testing.assert_close(ours[0], ref[0], **TOL)
    torch.testing.assert_close(ours[1], ref[1], **TOL)


def test_combined_margin_past_the_switch_angle(gen):
    m1, m2, m3 = 0.9, 0.4, 0.15
    switch = (math.pi - m2) / m1
    c = torch.cos(torch.linspace(switch + 1e-3, math.pi, 50, dtype=torch.float64))
    expected = c - m3 - (math.pi - switch) * math.sin(switch)
    torch.testing.assert_close(combined_margin_target(c, m1, m2, m3), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("margins", [(1.0, 0.3, 0.2), (0.9, 0.4, 0.15), (1.5, 0.2, 0.0), (0.5, 0.0, 0.1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_combined_margin_target_monotone_with_finite_gradient(margins, dtype):
    c = torch.linspace(-1, 1, 20001, dtype=torch.float64).to(dtype).requires_grad_(True)
    f = combined_margin_target(c, *margins)
    assert bool((f.diff() >= 0).all()), "target must be non-decreasing in c"
    (g,) = torch.autograd.grad(f.sum(), c)
    assert bool(torch.isfinite(g).all())


@given(
    margin=st.floats(0.0, math.pi / 2),
    scale=st.floats(1.0, 64.0),
    seed=st.integers(0, 2**16),
)
def test_combined_margin_reduces_to_cosface_and_arcface_exactly(margin, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.float64):
        cos = rand_cos(gen, 6, 9, lim=1.0).to(dtype)
        y = torch.randint(0, 9, (6,), generator=gen)
        pairs = [
            (CombinedMarginLoss(1.0, 0.0, margin, scale, "none"), CosFaceLoss(scale, margin, "none")),
            (CombinedMarginLoss(1.0, margin, 0.0, scale, "none"), ArcFaceLoss(scale, margin, "none")),
        ]
        for combined, special in pairs:
            a, b = value_and_grad(combined, cos, y), value_and_grad(special, cos, y)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_combined_margin_gradcheck(gen):
    cos, y = rand_cos(gen, 5, 7).requires_grad_(True), torch.randint(0, 7, (5,), generator=gen)
    for margins in ((0.9, 0.4, 0.15), (1.0, 0.3, 0.2)):
        loss = CombinedMarginLoss(*margins, scale=8.0, reduction="none")
        assert torch.autograd.gradcheck(lambda x, lo=loss: lo(x, y), (cos,))


def test_combined_margin_bad_hyperparameters():
    with pytest.raises(ValueError, match="m1"):
        CombinedMarginLoss(m1=0.0)
    with pytest.raises(ValueError, match=r"m2 must be an angle in radians in \[0, π/2\]"):
        CombinedMarginLoss(m2=28.6)
    with pytest.raises(ValueError, match="m1 must be at most"):
        CombinedMarginLoss(m1=4.0, m2=0.0)  # SphereFace's m = 4 would not be monotone
    with pytest.raises(ValueError, match="m3"):
        CombinedMarginLoss(m3=-0.1)
    with pytest.raises(ValueError, match="m3"):
        CombinedMarginLoss(m3=math.nan)
    with pytest.raises(ValueError, match="scale"):
        CombinedMarginLoss(scale=0.0)
    loss = CombinedMarginLoss()
    loss.m2 = 3.0  # a schedule went too far: caught at the next call
    with pytest.raises(ValueError, match="m2"):
        loss(torch.zeros(2, 3), torch.tensor([0, 1]))


# ---------------------------------------------------------------------------------------------
# Sub-centres: the head and SubCenterArcFaceLoss
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3])
def test_subcenter_arcface_against_pytorch_metric_learning(gen, k):
    num_classes, dim, b = 30, 10, 48
    head = CosineHead(num_classes, dim, sub_centers=k, dtype=torch.float64)
    e = torch.randn(b, dim, generator=gen, dtype=torch.float64)
    y = torch.randint(0, num_classes, (b,), generator=gen)
    peer = pml_losses.SubCenterArcFaceLoss(
        num_classes=num_classes, embedding_size=dim, margin=math.degrees(0.5), scale=64, sub_centers=k
    )
    # PML's W [D, C·K] is class-major (column c·K + k): our [C, K, D] weight, flattened, transposed
    peer.W.data = head.weight.detach().reshape(num_classes * k, dim).t().clone()
    e_ours, e_peer = e.clone().requires_grad_(True), e.clone().requires_grad_(True)
    value = SubCenterArcFaceLoss(scale=64.0, margin=0.5, sub_centers=k)(head(e_ours), y)
    value.backward()
    peer_value = peer(e_peer, y)
    peer_value.backward()
    torch.testing.assert_close(value, peer_value, **TOL)
    torch.testing.assert_close(e_ours.grad, e_peer.grad, **TOL)
    torch.testing.assert_close(head.weight.grad.reshape(num_classes * k, dim), peer.W.grad.t(), **TOL)


@given(margin=st.floats(0.0, math.pi / 2), seed=st.integers(0, 2**16))
def test_subcenter_with_one_center_is_arcface(margin, seed):
    torch.manual_seed(seed)
    plain = CosineHead(7, 5, dtype=torch.float64)
    one = CosineHead(7, 5, sub_centers=1, dtype=torch.float64)
    one.load_state_dict(plain.state_dict())
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 7, (9,), generator=gen)
    assert one.weight.shape == (7, 5) and torch.equal(one(e), plain(e))
    a = SubCenterArcFaceLoss(16.0, margin, sub_centers=1)(one(e), y)
    b = ArcFaceLoss(16.0, margin)(plain(e), y)
    assert torch.equal(a, b)


def test_subcenter_head_is_the_max_over_its_centres(gen):
    head = CosineHead(6, 4, sub_centers=3, dtype=torch.float64)
    e = torch.randn(11, 4, generator=gen, dtype=torch.float64)
    every = cosine_similarity_matrix(e, head.weight.detach().reshape(18, 4)).reshape(11, 6, 3)
    # one [B, C] product per sub-centre (marginkit.ops.subcenter_cosines): the same dot products,
    # rounded in another blocking than the [B, C·K] product's
    torch.testing.assert_close(head(e), every.amax(dim=2), rtol=0, atol=1e-15)
    assert torch.equal(head.predict(e), every.amax(dim=2).argmax(dim=1))
    assert "sub_centers=3" in repr(head)
    torch.testing.assert_close(
        torch.linalg.vector_norm(head.weight.detach(), dim=-1), torch.ones(6, 3, dtype=torch.float64)
    )
    # only the best sub-centre of each (row, class) receives gradient
    head(e)[:, 2].sum().backward()
    best = every[:, 2].argmax(dim=1)
    touched = head.weight.grad[2].abs().sum(dim=1) > 0
    assert torch.equal(touched, torch.isin(torch.arange(3), best))
    with pytest.raises(ValueError, match="sub_centers"):
        CosineHead(6, 4, sub_centers=0)
    with pytest.raises(ValueError, match="sub_centers"):
        SubCenterArcFaceLoss(sub_centers=0)


def _max_of_every_centre(e, w):
    """The reference: cosines to all ``C·K`` centres, then autograd's max over ``k``."""
    c, k, d = w.shape
    return cosine_similarity_matrix(e, w.reshape(c * k, d)).unflatten(-1, (c, k)).max(dim=-1).values


@pytest.mark.parametrize("k", [1, 2, 5])
def test_subcenter_cosines_gradcheck_and_reference(gen, k):
    e = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, k, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(subcenter_cosines, (e, w), eps=1e-6, atol=1e-8)
    w.data[1, 0] = 0.0  # a zero centre (norm floored at eps) and a zero embedding: cosine 0,
    e.data[0, 1] = 0.0  # finite gradients equal to the reference's
    out, ref = subcenter_cosines(e, w), _max_of_every_centre(e, w)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-15)
    assert torch.equal(out[0, 1], torch.zeros(6, dtype=torch.float64))
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    theirs = torch.autograd.grad(ref, (e, w), g)
    for mine, peer in zip(torch.autograd.grad(out, (e, w), g), theirs, strict=True):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, peer, rtol=1e-13, atol=1e-14)  # the zero centre: ~1e12
    # the gradient w.r.t. one input only
    (ge,) = torch.autograd.grad(subcenter_cosines(e, w.detach()), e, g)
    (gw,) = torch.autograd.grad(subcenter_cosines(e.detach(), w), w, g)
    torch.testing.assert_close(ge, theirs[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(gw, theirs[1], rtol=0, atol=1e-14)


def test_subcenter_cosines_keep_no_per_centre_tensor(gen):
    """The backward keeps the inputs, the class cosines [B, C] and a uint8 index; nothing [B, C·K]."""
    b, c, k, d = 16, 50, 3, 8
    e = torch.randn(b, d, generator=gen, requires_grad=True)
    w = torch.randn(c, k, d, generator=gen, requires_grad=True)
    saved = CosineHead(c, d, sub_centers=k)(e).grad_fn.saved_tensors
    big = [t for t in saved if t.numel() >= b * c and t.shape != w.shape]
    assert sorted(str(t.dtype) for t in big) == ["torch.float32", "torch.uint8"]
    assert all(t.numel() == b * c for t in big)
    assert subcenter_cosines(e, w).grad_fn.saved_tensors[-1].dtype == torch.uint8
    assert subcenter_cosines(e, torch.randn(c, 300, d)).grad_fn.saved_tensors[-1].dtype == torch.int32
    with pytest.raises(ValueError, match="weight"):
        subcenter_cosines(e, torch.randn(c, d))


def test_subcenter_cosines_ties_go_to_the_lowest_centre():
    w = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]], requires_grad=True)  # centres 0, 1 equal
    e = torch.tensor([[2.0, 1.0]])
    torch.testing.assert_close(subcenter_cosines(e, w), torch.tensor([[2 / 5**0.5]]))
    subcenter_cosines(e, w).sum().backward()
    assert w.grad[0, 0].abs().sum() > 0.1
    assert torch.equal(w.grad[0, 1:], torch.zeros(2, 2))


def test_sharded_head_with_sub_centres_in_one_process(gen):
    sharded = ShardedCosineHead(9, 4, seed=3, sub_centers=2, dtype=torch.float64)
    state = sharded.full_state_dict()
    assert state["weight"].shape == (9, 2, 4)
    plain = CosineHead(9, 4, sub_centers=2, dtype=torch.float64)
    plain.load_state_dict(state)
    e = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 9, (5,), generator=gen)
    loss = SubCenterArcFaceLoss(16.0, 0.3, sub_centers=2)
    torch.testing.assert_close(loss(sharded(e), y), loss(plain(e), y), rtol=1e-14, atol=0)
    with pytest.raises(RuntimeError, match="weight"):
        ShardedCosineHead(9, 4, seed=3).load_state_dict(state)  # shapes named, not silently sliced


# ---------------------------------------------------------------------------------------------
# AdaFaceLoss
# ---------------------------------------------------------------------------------------------
def adaface_reference(e, w, y, m, h, s, mean, std, eps=1e-3):
    """The AdaFace authors' head (head.py), re-written: clamps, arccos, both margins, CE."""
    norms = torch.linalg.vector_norm(e, dim=1, keepdim=True)
    cos = (e / norms) @ (w / torch.linalg.vector_norm(w, dim=1, keepdim=True)).t()
    cos = cos.clamp(-1 + eps, 1 - eps)
    safe = norms.clamp(0.001, 100).detach()
    scaler = ((safe - mean) / (std + eps) * h).clamp(-1, 1)
    onehot = F.one_hot(y, w.shape[0]).to(e.dtype)
    theta = (cos.acos() + onehot * (-m * scaler)).clamp(eps, math.pi - eps)
    logits = theta.cos() - onehot * (m + m * scaler)
    return F.cross_entropy(s * logits, y), cos, theta


@pytest.mark.parametrize("t_alpha", [1.0, 0.01])
def test_adaface_equals_the_authors_formula(gen, t_alpha):
    num_classes, dim, b = 25, 8, 40
    with torch.random.fork_rng():  # the head's initial weights: fixed, not the global stream's state
        torch.manual_seed(0)
        head = CosineHead(num_classes, dim, dtype=torch.float64)
    y = torch.randint(0, num_classes, (b,), generator=gen)
    scale_rows = torch.rand(b, 1, generator=gen, dtype=torch.float64) * 30 + 2  # norms 2..32
    e = scale_rows * (head.weight.detach()[y] + 0.8 * torch.randn(b, dim, generator=gen, dtype=torch.float64))
    loss = AdaFaceLoss(scale=64.0, margin=0.4, h=0.333, t_alpha=t_alpha)
    norms = torch.linalg.vector_norm(e, dim=1)
    mean = t_alpha * norms.mean() + (1 - t_alpha) * 20.0
    std = t_alpha * norms.std() + (1 - t_alpha) * 100.0
    e_ours, e_ref = e.clone().requires_grad_(True), e.clone().requires_grad_(True)
    w_ref = head.weight.detach().clone().requires_grad_(True)
    value = loss(head(e_ours, with_norms=True), y)
    value.backward()
    ref, cos, theta = adaface_reference(e_ref, w_ref, y, 0.4, 0.333, 64.0, mean, std)
    ref.backward()
    # the authors' clamps are inactive on this data (ours clip at 0 and π exactly)
    assert bool((cos.abs() < 1 - 1e-3 - 1e-9).all())
    assert bool(((theta > 1e-3) & (theta < math.pi - 1e-3)).all())
    torch.testing.assert_close(value, ref, **TOL)
    torch.testing.assert_close(e_ours.grad, e_ref.grad, **TOL)
    torch.testing.assert_close(head.weight.grad, w_ref.grad, **TOL)
    torch.testing.assert_close(loss.batch_mean, mean, **TOL)
    torch.testing.assert_close(loss.batch_std, std, **TOL)


def test_adaface_running_statistics_and_eval_mode(gen):
    cos, y = rand_cos(gen, 6, 5), torch.randint(0, 5, (6,), generator=gen)
    loss = AdaFaceLoss(t_alpha=0.5)
    for norms in (torch.full((6,), 10.0), torch.full((6,), 30.0)):
        loss(cos, y, norms=norms.double())
    assert float(loss.batch_mean) == pytest.approx(0.5 * 30 + 0.5 * (0.5 * 10 + 0.5 * 20))
    loss.eval()
    before = loss.batch_mean.clone()
    loss(cos, y, norms=torch.full((6,), 99.0, dtype=torch.float64))
    assert torch.equal(loss.batch_mean, before)
    loss.train()
    loss(cos[:1], y[:1], norms=torch.ones(1, dtype=torch.float64))  # one row: no NaN std
    assert bool(torch.isfinite(loss.batch_std))


def test_adaface_margin_regimes(gen):
    """ẑ = 0 is CosFace with margin m; ẑ = 1 is ArcFace's angle with no additive term − 2m."""
    cos, y = rand_cos(gen, 8, 6), torch.randint(0, 6, (8,), generator=gen)
    loss = AdaFaceLoss(scale=16.0, margin=0.3, t_alpha=1.0, reduction="none")
    same = torch.full((8,), 7.0, dtype=torch.float64)  # std 0: every ẑ = 0
    torch.testing.assert_close(loss(cos, y, norms=same), CosFaceLoss(16.0, 0.3, "none")(cos, y), **TOL)
    c_y = cos.gather(1, y[:, None]).squeeze(1)
    from marginkit.ops.margins import adaface_target

    one = torch.ones(8, dtype=torch.float64)
    theta = torch.arccos(c_y)
    expected = torch.cos((theta - 0.3).clamp(0, math.pi)) - 0.6
    torch.testing.assert_close(adaface_target(c_y, 0.3, one), expected, rtol=0, atol=1e-12)
    expected = torch.cos((theta + 0.3).clamp(0, math.pi)) - 0.0
    torch.testing.assert_close(adaface_target(c_y, 0.3, -one), expected, rtol=0, atol=1e-12)
    c = torch.linspace(-1, 1, 4001, dtype=torch.float64, requires_grad=True)
    for z in (-1.0, -0.3, 0.0, 0.5, 1.0):
        f = adaface_target(c, 0.4, torch.full_like(c, z))
        assert bool((f.diff() >= -1e-15).all())
        (g,) = torch.autograd.grad(f.sum(), c)
        assert bool(torch.isfinite(g).all())


def test_adaface_gradcheck(gen):
    cos, y = rand_cos(gen, 6, 5).requires_grad_(True), torch.randint(0, 5, (6,), generator=gen)
    norms = torch.rand(6, generator=gen, dtype=torch.float64) * 20 + 1
    loss = AdaFaceLoss(scale=8.0, t_alpha=1.0, reduction="none")
    assert torch.autograd.gradcheck(lambda x: loss(x, y, norms=norms), (cos,))


def test_adaface_bad_inputs(gen):
    cos, y = rand_cos(gen, 4, 6), torch.randint(0, 6, (4,), generator=gen)
    loss = AdaFaceLoss()
    with pytest.raises(ValueError, match="needs the embedding norms"):
        loss(cos, y)
    with pytest.raises(ValueError, match=r"norms must have shape \(4,\)"):
        loss(cos, y, norms=torch.ones(3))
    with pytest.raises(ValueError, match="norms must be non-negative"):
        loss(cos, y, norms=-torch.ones(4))
    with pytest.raises(ValueError, match="norms"):
        loss(cos, y, norms=torch.tensor([1.0, math.nan, 1.0, 1.0]))
    with pytest.raises(TypeError, match="norms"):
        loss(cos, y, norms=[1.0] * 4)
    bad = cos.clone()
    bad[0, 0] = 1.5
    with pytest.raises(ValueError, match="cosines"):
        loss(NormedCosines(bad, torch.ones(4)), y)
    with pytest.raises(ValueError, match="labels must lie in"):
        loss(cos, torch.tensor([0, 1, 2, 6]), norms=torch.ones(4))
    for kwargs in ({"h": 0.0}, {"t_alpha": 0.0}, {"t_alpha": 1.5}, {"eps": -1.0}, {"margin": -0.1}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            AdaFaceLoss(**kwargs)


# ---------------------------------------------------------------------------------------------
# ProxyAnchorLoss
# ---------------------------------------------------------------------------------------------
def proxy_anchor_loop(cos, y, alpha, delta):
    """The paper's eq. 4 with an explicit loop over the proxies."""
    pos_terms, neg_terms = [], []
    for p in range(cos.shape[1]):
        pos, neg = cos[y == p, p], cos[y != p, p]
        if pos.numel():
            pos_terms.append(torch.log1p(torch.exp(-alpha * (pos - delta)).sum()))
        neg_terms.append(torch.log1p(torch.exp(alpha * (neg + delta)).sum()))
    return sum(pos_terms) / len(pos_terms) + sum(neg_terms) / cos.shape[1]


@pytest.mark.parametrize("alpha, margin", [(32.0, 0.1), (8.0, 0.0), (64.0, 0.3)])
def test_proxy_anchor_equals_the_loop_reference(gen, alpha, margin):
    cos, y = rand_cos(gen, 30, 12, lim=1.0), torch.randint(0, 12, (30,), generator=gen)
    y[:3] = 11  # a class with several positives
    ours = value_and_grad(ProxyAnchorLoss(alpha, margin), cos, y)
    ref = value_and_grad(lambda x, t: proxy_anchor_loop(x, t, alpha, margin), cos, y)
    torch.testing.assert_close(ours[0], ref[0], **TOL)
    torch.testing.assert_close(ours[1], ref[1], **TOL)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_proxy_anchor_against_pytorch_metric_learning(gen, dtype):
    num_classes, dim, b = 40, 12, 64
    head = CosineHead(num_classes, dim, dtype=dtype)
    y = torch.randint(0, num_classes, (b,), generator=gen)
    noise = torch.randn(b, dim, generator=gen, dtype=torch.float64)
    e = (head.weight.detach()[y].double() + 0.7 * noise).to(dtype)
    peer = pml_losses.ProxyAnchorLoss(num_classes, dim, margin=0.1, alpha=32)
    peer.proxies.data = head.weight.detach().clone()
    e_ours, e_peer = e.clone().requires_grad_(True), e.clone().requires_grad_(True)
    value = ProxyAnchorLoss(alpha=32.0, margin=0.1)(head(e_ours), y)
    value.backward()
    peer_value = peer(e_peer, y)
    peer_value.backward()
    tol = TOL if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(value, peer_value.to(value.dtype), **tol)
    torch.testing.assert_close(e_ours.grad, e_peer.grad, **tol)
    torch.testing.assert_close(head.weight.grad, peer.proxies.grad, **tol)


def test_proxy_anchor_gradcheck_and_second_backward(gen):
    cos, y = rand_cos(gen, 7, 5).requires_grad_(True), torch.randint(0, 5, (7,), generator=gen)
    loss = ProxyAnchorLoss(alpha=4.0, margin=0.1)
    assert torch.autograd.gradcheck(lambda x: loss(x, y), (cos,))
    out = loss(cos, y)
    (g1,) = torch.autograd.grad(out, cos, retain_graph=True)
    (g2,) = torch.autograd.grad(out, cos)
    assert torch.equal(g1, g2)


def test_proxy_anchor_edge_cases(gen):
    loss = ProxyAnchorLoss()
    empty = torch.zeros(0, 4, requires_grad=True)
    out = loss(empty, torch.zeros(0, dtype=torch.long))
    assert float(out.detach()) == 0.0
    out.backward()
    one = torch.tensor([[0.3]], dtype=torch.float64)  # one class, no negatives
    expected = torch.log1p(torch.exp(-32 * (one - 0.1))).reshape(())
    torch.testing.assert_close(loss(one, torch.tensor([0])), expected)
    x = rand_cos(gen, 6, 4).float()
    assert loss(x, torch.randint(0, 4, (6,), generator=gen)).dtype == torch.float32
    assert loss(x.half(), torch.randint(0, 4, (6,), generator=gen)).dtype == torch.float32


def test_proxy_anchor_bad_inputs(gen):
    loss = ProxyAnchorLoss()
    cos, y = rand_cos(gen, 4, 6), torch.randint(0, 6, (4,), generator=gen)
    for v in (1.5, math.nan, math.inf):
        bad = cos.clone()
        bad[1, 2] = v
        with pytest.raises(ValueError, match="cosines"):
            loss(bad, y)
    with pytest.raises(ValueError, match="labels must lie in"):
        loss(cos, torch.tensor([0, 1, 2, 6]))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        loss(cos, y.float())
    with pytest.raises(ValueError, match=r"cosines must have shape \[batch, num_classes\]"):
        loss(cos[0], y)
    with pytest.raises(TypeError, match="cosines must be a torch.Tensor"):
        loss(cos.tolist(), y)
    with pytest.raises(ValueError, match="alpha"):
        ProxyAnchorLoss(alpha=0.0)
    with pytest.raises(ValueError, match="margin"):
        ProxyAnchorLoss(margin=-0.1)


# ---------------------------------------------------------------------------------------------
# Numerical safety of the head (float16 gradients, huge embeddings)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0.0, 1e-6, 1e-3])
def test_float16_embeddings_never_get_an_infinite_gradient(gen, value):
    head = CosineHead(7, 4)
    e = torch.full((3, 4), value, dtype=torch.float16)
    e[1] = torch.randn(4, generator=gen).half()
    e.requires_grad_(True)
    y = torch.tensor([0, 1, 2])
    for loss in (CosFaceLoss(), ArcFaceLoss(), ProxyAnchorLoss(), CombinedMarginLoss(0.9, 0.4, 0.15)):
        e.grad, head.weight.grad = None, None
        loss(head(e), y).backward()
        assert e.grad.dtype == torch.float16
        assert bool(torch.isfinite(e.grad).all()), (loss, e.grad)
        assert bool(torch.isfinite(head.weight.grad).all())


def test_float16_gradient_is_the_float32_gradient_where_it_fits(gen):
    head = CosineHead(5, 4)
    e = torch.randn(6, 4, generator=gen).half()
    y = torch.randint(0, 5, (6,), generator=gen)
    grads = []
    for x in (e.clone().requires_grad_(True), e.float().requires_grad_(True)):
        CosFaceLoss(scale=16.0)(head(x), y).backward()
        grads.append(x.grad.float())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("big", [1e30, 1e38 / 4])
def test_huge_embeddings_give_their_cosines(gen, big):
    head = CosineHead(6, 5)
    e = torch.randn(4, 5, generator=gen)
    e = e / e.abs().amax(dim=1, keepdim=True)  # entries in [-1, 1]: e·big stays finite in float32
    y = torch.tensor([0, 1, 2, 3])
    x = (e * big).requires_grad_(True)
    cos = head(x)
    torch.testing.assert_close(cos, head(e), rtol=1e-5, atol=1e-6)
    assert bool((cos.abs() > 0).all())
    ArcFaceLoss()(cos, y).backward()
    ref = e.clone().requires_grad_(True)
    ArcFaceLoss()(head(ref), y).backward()
    torch.testing.assert_close(x.grad * big, ref.grad, rtol=1e-4, atol=1e-5)
    norms = head(x, with_norms=True).norms
    torch.testing.assert_close(norms / big, torch.linalg.vector_norm(e, dim=1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("mining", ["batch_all", "batch_hard", "semi_hard"])
def test_triplet_losses_on_huge_embeddings(gen, mining):
    from marginkit.losses import LocalMarginTripletLoss, TripletMarginLoss

    e = torch.randn(8, 4, generator=gen)
    y = torch.arange(8) % 2
    for distance in ("l2", "squared_l2"):  # raw squared distances of 1e60 do not fit float32
        with pytest.raises(ValueError, match="embeddings are too large: their .* distances overflow"):
            TripletMarginLoss(mining=mining, distance=distance, normalize=False)(e * 1e30, y)
    with pytest.raises(ValueError, match="embeddings are too large"):
        LocalMarginTripletLoss(k=2, normalize=False)(e * 1e30, y)
    cosine = TripletMarginLoss(mining=mining, distance="cosine", normalize=False)
    scale_free = (TripletMarginLoss(mining=mining), cosine)
    for loss in scale_free:
        x = (e * 1e30).requires_grad_(True)
        value = loss(x, y)
        value.backward()
        torch.testing.assert_close(value, loss(e, y), rtol=1e-5, atol=1e-6)  # scale-free: same answer
        assert bool(torch.isfinite(x.grad).all())
