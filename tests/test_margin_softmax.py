"""NormSoftmaxLoss / CosFaceLoss / ArcFaceLoss against independent references.

References: ``F.cross_entropy`` on explicitly built float64 logits (the target column from
``torch.arccos`` for ArcFace), pytorch-metric-learning's ArcFaceLoss/CosFaceLoss (which own
their weights), and finite differences (gradcheck).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from marginkit.heads import CosineHead
from marginkit.heads.cosine import cosine_similarity_matrix
from marginkit.losses import ArcFaceLoss, CosFaceLoss, NormSoftmaxLoss

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")


def rand_cos(gen: torch.Generator, b: int, c: int, dtype=torch.float64, lim: float = 0.999) -> torch.Tensor:
    return ((torch.rand(b, c, generator=gen, dtype=torch.float64) * 2 - 1) * lim).to(dtype)


def ref_arc_target(c: torch.Tensor, m: float) -> torch.Tensor:
    """Independent float64 reference: arccos, add the margin, cos; the classic switch rule."""
    theta = torch.arccos(c.double().clamp(-1, 1))
    return torch.where(theta + m < math.pi, torch.cos(theta + m), c.double() - m * math.sin(m))


def ref_loss(cos: torch.Tensor, labels: torch.Tensor, scale: float, target: torch.Tensor, reduction="mean"):
    """CE on explicitly built logits: s·c with the target column replaced by s·target."""
    logits = scale * cos
    onehot = F.one_hot(labels, cos.shape[1]).to(cos.dtype)
    logits = logits * (1 - onehot) + scale * target.unsqueeze(1) * onehot
    return F.cross_entropy(logits, labels, reduction=reduction)


def value_and_grad(loss_fn, cos: torch.Tensor, labels: torch.Tensor):
    x = cos.detach().clone().requires_grad_(True)
    out = loss_fn(x, labels)
    (g,) = torch.autograd.grad(out.sum(), x)
    return out.detach(), g


# ---------------------------------------------------------------------------------------------
# Values and gradients against plain references
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normsoftmax_is_scaled_cross_entropy(gen, reduction, dtype):
    cos, y = rand_cos(gen, 13, 29, dtype), torch.randint(0, 29, (13,), generator=gen)
    ours = value_and_grad(NormSoftmaxLoss(scale=17.0, reduction=reduction), cos, y)
    ref = value_and_grad(lambda x, t: F.cross_entropy(17.0 * x, t, reduction=reduction), cos, y)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(ours[0], ref[0], **tol)
    torch.testing.assert_close(ours[1], ref[1], **tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cosface_equals_plain_reference(gen, reduction, dtype):
    cos, y = rand_cos(gen, 16, 50, dtype), torch.randint(0, 50, (16,), generator=gen)
    s, m = 64.0, 0.4

    def plain(x, t):
        return F.cross_entropy(s * (x - m * F.one_hot(t, x.shape[1]).to(x.dtype)), t, reduction=reduction)

    ours = value_and_grad(CosFaceLoss(scale=s, margin=m, reduction=reduction), cos, y)
    ref = value_and_grad(plain, cos, y)
    tol = {"rtol": 1e-11, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 1e-5}
    torch.testing.assert_close(ours[0], ref[0], **tol)
    torch.testing.assert_close(ours[1], ref[1], **tol)


@pytest.mark.parametrize("margin", [0.0, 0.2, 0.5, 1.0, math.pi / 2])
def test_arcface_equals_float64_arccos_reference(gen, margin):
    # Target cosines spread over the whole range, both branches, away from ±1 (arccos' slope).
    b, c, s = 64, 40, 30.0
    cos = rand_cos(gen, b, c, lim=0.995)
    y = torch.randint(0, c, (b,), generator=gen)
    cos[torch.arange(b), y] = torch.linspace(-0.995, 0.995, b, dtype=torch.float64)

    def ref(x, t):
        return ref_loss(x, t, s, ref_arc_target(x[torch.arange(b), t], margin), reduction="none")

    ours = value_and_grad(ArcFaceLoss(scale=s, margin=margin, reduction="none"), cos, y)
    expected = value_and_grad(ref, cos, y)
    torch.testing.assert_close(ours[0], expected[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours[1], expected[1], rtol=1e-8, atol=1e-10)
    # float32 against the same float64 reference
    ours32 = value_and_grad(ArcFaceLoss(scale=s, margin=margin, reduction="none"), cos.float(), y)
    torch.testing.assert_close(ours32[0].double(), expected[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ours32[1].double(), expected[1], rtol=1e-3, atol=2e-4)


@pytest.mark.parametrize("margin", [0.1, 0.5, 1.0, math.pi / 2])
def test_arcface_target_matches_arccos_where_theta_plus_m_le_pi(margin):
    theta = torch.linspace(0, math.pi - margin, 20001, dtype=torch.float64)[:-1]  # θ + m < π
    c = torch.cos(theta)
    loss = ArcFaceLoss(scale=1.0, margin=margin)
    expected = torch.cos(torch.arccos(c) + margin)
    torch.testing.assert_close(loss.target(c), expected, rtol=0, atol=2e-8)  # eps clamp near c=1
    inner = (c < 1 - 1e-6) & (c > -1 + 1e-6)
    torch.testing.assert_close(loss.target(c)[inner], expected[inner], rtol=0, atol=1e-13)
    # float32: a few ulps from the float64 value on the same (rounded) inputs, except at c = 1
    # exactly, where the clamp stands in for the nearest float below 1: sqrt(eps)·sin(m)
    c32 = c.float()
    err32 = (loss.target(c32).double() - torch.cos(torch.arccos(c32.double()) + margin)).abs()
    assert err32[c32 < 1].max() < 3e-7
    assert err32[c32 == 1].max() <= math.sqrt(torch.finfo(torch.float32).eps) * math.sin(margin) + 1e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("margin", [0.0, 0.2, 0.5, 0.9, 1.3, math.pi / 2])
def test_arcface_target_logit_monotone_on_whole_angle_range(dtype, margin):
    theta = torch.linspace(0, math.pi, 400001, dtype=torch.float64)
    c = torch.cos(theta).to(dtype)
    logit = ArcFaceLoss(scale=64.0, margin=margin).target(c) * 64.0
    assert torch.isfinite(logit).all()
    assert (logit[1:] <= logit[:-1]).all(), "target logit must not increase with the angle"
    # and the loss itself is monotone in the angle (2 classes, the other fixed)
    cos = torch.stack([c, torch.full_like(c, 0.3)], dim=1)[::50]
    loss = ArcFaceLoss(scale=64.0, margin=margin, reduction="none")(
        cos, torch.zeros(len(cos), dtype=torch.long)
    )
    assert (loss[1:] >= loss[:-1]).all()


def test_arcface_switch_is_the_classic_rule():
    m = 0.5
    c_star = math.cos(math.pi - m)
    loss = ArcFaceLoss(margin=m)
    c = torch.tensor([c_star - 1e-9, c_star + 1e-9, -1.0, 1.0], dtype=torch.float64)
    t = loss.target(c)
    assert t[0].item() == pytest.approx(c_star - 1e-9 - m * math.sin(m), abs=1e-12)
    assert t[1].item() == pytest.approx(-1.0, abs=1e-6)
    assert t[2].item() == pytest.approx(-1.0 - m * math.sin(m), abs=1e-12)
    assert t[3].item() == pytest.approx(math.cos(m), abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("margin", [0.5, math.pi / 2])
def test_arcface_gradient_finite_at_pm1_and_switch(dtype, margin):
    c_star = math.cos(math.pi - margin)
    specials = [1.0, -1.0, 1.0 + 5e-4, -1.0 - 5e-4, c_star, 0.0, 1 - 1e-7, -1 + 1e-7]
    base = torch.tensor(specials, dtype=torch.float64)
    # also the two representable neighbours of the switch point in this dtype
    cs = torch.tensor(c_star, dtype=dtype)
    neighbours = torch.stack([torch.nextafter(cs, cs - 1), torch.nextafter(cs, cs + 1)]).double()
    targets = torch.cat([base, neighbours])
    b = len(targets)
    cos = torch.zeros(b, 3, dtype=torch.float64)
    cos[:, 0] = targets
    cos[:, 1] = 0.2
    cos[:, 2] = -1.0
    x = cos.to(dtype).requires_grad_(True)
    out = ArcFaceLoss(scale=64.0, margin=margin, reduction="none")(x, torch.zeros(b, dtype=torch.long))
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert torch.isfinite(x.grad).all()
    assert x.grad.dtype == dtype


def test_arcface_gradient_flows_through_the_margin():
    # d loss / d c_y must be -(1 - p_y)·s·d cos(θ+m)/dc, not -(1 - p_y)·s (margin under no_grad).
    m, s = 0.5, 10.0
    c_y = torch.tensor([0.9], dtype=torch.float64)
    cos = torch.cat([c_y, torch.tensor([0.1], dtype=torch.float64)]).unsqueeze(0).requires_grad_(True)
    loss = ArcFaceLoss(scale=s, margin=m)(cos, torch.tensor([0]))
    loss.backward()
    theta = math.acos(0.9)
    t = math.cos(theta + m)
    p_y = math.exp(s * t) / (math.exp(s * t) + math.exp(s * 0.1))
    dt_dc = math.sin(theta + m) / math.sin(theta)  # d cos(θ+m)/dc = sin(θ+m)/sin θ
    assert cos.grad[0, 0].item() == pytest.approx(-(1 - p_y) * s * dt_dc, rel=1e-10)
    assert abs(dt_dc - 1) > 0.3  # the no_grad variant would be visibly different


@pytest.mark.parametrize(
    "loss",
    [NormSoftmaxLoss(scale=3.0), CosFaceLoss(scale=4.0, margin=0.3), ArcFaceLoss(scale=4.0, margin=0.5)],
)
def test_gradcheck_float64(gen, loss):
    cos = rand_cos(gen, 6, 7, lim=0.95).requires_grad_(True)
    y = torch.randint(0, 7, (6,), generator=gen)
    cos.data[torch.arange(6), y] = torch.tensor([-0.95, -0.9, -0.5, 0.0, 0.5, 0.95], dtype=torch.float64)
    loss.reduction = "none"
    assert torch.autograd.gradcheck(lambda x: loss(x, y), (cos,))


@pytest.mark.parametrize("loss_cls", [NormSoftmaxLoss, CosFaceLoss, ArcFaceLoss])
def test_gradcheck_head_plus_loss_float64(gen, loss_cls):
    head = CosineHead(9, 5, dtype=torch.float64)
    e = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 9, (7,), generator=gen)
    loss = loss_cls(scale=5.0)
    assert torch.autograd.gradcheck(lambda a, w: loss(cosine_similarity_matrix(a, w), y), (e, head.weight))


# ---------------------------------------------------------------------------------------------
# Against pytorch-metric-learning (which owns its weights: W [D, C] = our centres transposed)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cosface", "arcface"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_against_pytorch_metric_learning(gen, kind, dtype):
    num_classes, dim, b = 40, 12, 24
    head = CosineHead(num_classes, dim, dtype=dtype)
    e = torch.randn(b, dim, generator=gen, dtype=dtype)
    y = torch.randint(0, num_classes, (b,), generator=gen)
    if kind == "cosface":
        ours = CosFaceLoss(scale=64.0, margin=0.35)
        peer = pml_losses.CosFaceLoss(num_classes, dim, margin=0.35, scale=64)
    else:  # PML's ArcFace margin is in DEGREES (default 28.6 ≈ 0.5 rad); ours in radians
        ours = ArcFaceLoss(scale=64.0, margin=0.5)
        peer = pml_losses.ArcFaceLoss(num_classes, dim, margin=math.degrees(0.5), scale=64)
    peer.W.data = head.weight.detach().t().clone()
    # Make some targets hard (θ + m > π branch) and some easy, so both ArcFace branches are hit.
    e_ours = e.clone().requires_grad_(True)
    e_peer = e.clone().requires_grad_(True)
    value = ours(head(e_ours), y)  # mean over the batch, like PML's default MeanReducer
    value.backward()
    peer_value = peer(e_peer, y)
    peer_value.backward()
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(value, peer_value.to(value.dtype), **tol)
    torch.testing.assert_close(e_ours.grad, e_peer.grad, **tol)
    torch.testing.assert_close(head.weight.grad, peer.W.grad.t(), **tol)


def test_against_pml_arcface_second_branch(gen):
    # Embeddings pointing away from their class centre: θ_y > π - m, PML's "cos θ - m sin m".
    num_classes, dim, b, m = 6, 4, 8, 0.5
    head = CosineHead(num_classes, dim, dtype=torch.float64)
    y = torch.arange(b) % num_classes
    e = -head.weight.detach()[y] + 0.05 * torch.randn(b, dim, generator=gen, dtype=torch.float64)
    assert (head(e)[torch.arange(b), y] < math.cos(math.pi - m)).all()
    peer = pml_losses.ArcFaceLoss(num_classes, dim, margin=math.degrees(m), scale=16)
    peer.W.data = head.weight.detach().t().clone()
    torch.testing.assert_close(ArcFaceLoss(scale=16.0, margin=m)(head(e), y), peer(e, y), rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------
# Precision, dtypes, edge cases
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("loss_cls", [NormSoftmaxLoss, CosFaceLoss, ArcFaceLoss])
def test_half_precision_inputs(gen, dtype, loss_cls):
    cos = rand_cos(gen, 10, 300, dtype)
    y = torch.randint(0, 300, (10,), generator=gen)
    loss = loss_cls(reduction="none")
    x = cos.clone().requires_grad_(True)
    out = loss(x, y)
    out.sum().backward()
    assert out.dtype == torch.float32 and x.grad.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    # computed in float32 on the upcast values: equal to the float64 computation on them
    ref = loss(cos.double(), y)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_scale_and_margin_stay_accurate(gen, dtype):
    # s·m = 300: the target column is far below s·c_y; a shift of s·max(c) would underflow
    # every other term. The exact row max keeps value and gradient accurate.
    b, c = 8, 20
    cos = rand_cos(gen, b, c, lim=0.5)
    y = torch.randint(0, c, (b,), generator=gen)
    cos[torch.arange(b), y] = torch.linspace(0.6, 1.0, b, dtype=torch.float64)  # target is the max
    s, m = 256.0, 1.2
    ours = value_and_grad(CosFaceLoss(scale=s, margin=m, reduction="none"), cos.to(dtype), y)
    ref = value_and_grad(lambda x, t: ref_loss(x, t, s, x[torch.arange(b), t] - m, "none"), cos, y)
    assert torch.isfinite(ours[0]).all() and torch.isfinite(ours[1]).all()
    rtol = 1e-10 if dtype == torch.float64 else 2e-4
    torch.testing.assert_close(ours[0].double(), ref[0], rtol=rtol, atol=1e-30)
    torch.testing.assert_close(ours[1].double(), ref[1], rtol=rtol, atol=rtol * ref[1].abs().max().item())


def test_confident_target_loss_is_accurate_in_float32():
    # p_y → 1: loss ≈ Σ_rest exp(s(c_j - c_y + m)) must keep its relative precision (log1p form).
    cos = torch.tensor([[1.0, 0.0, -0.2]])
    out = CosFaceLoss(scale=64.0, margin=0.2)(cos, torch.tensor([0]))
    expected = math.log1p(math.exp(64 * (0.0 - 0.8)) + math.exp(64 * (-0.2 - 0.8)))
    assert out.item() == pytest.approx(expected, rel=1e-5)
    assert out.item() > 0


def test_single_class_and_empty_batch():
    cos = torch.tensor([[0.3], [-0.7]], requires_grad=True)
    out = CosFaceLoss(reduction="none")(cos, torch.tensor([0, 0]))
    out.sum().backward()
    assert torch.equal(out.detach(), torch.zeros(2)) and torch.equal(cos.grad, torch.zeros(2, 1))
    empty = torch.zeros(0, 5, requires_grad=True)
    assert ArcFaceLoss()(empty, torch.zeros(0, dtype=torch.long)).item() == 0.0
    assert ArcFaceLoss(reduction="none")(empty, torch.zeros(0, dtype=torch.long)).shape == (0,)


@pytest.mark.parametrize("label_dtype", [torch.int32, torch.int16, torch.uint8])
def test_any_integer_label_dtype(gen, label_dtype):
    cos, y = rand_cos(gen, 5, 9), torch.randint(0, 9, (5,), generator=gen)
    loss = ArcFaceLoss(scale=20.0)
    torch.testing.assert_close(loss(cos, y.to(label_dtype)), loss(cos, y), rtol=0, atol=0)


def test_batched_equals_per_row(gen):
    cos, y = rand_cos(gen, 9, 31), torch.randint(0, 31, (9,), generator=gen)
    loss = ArcFaceLoss(scale=30.0, margin=0.4, reduction="none")
    rows = torch.cat([loss(cos[i : i + 1], y[i : i + 1]) for i in range(9)])
    torch.testing.assert_close(loss(cos, y), rows, rtol=1e-13, atol=0)


def test_retain_graph_second_backward_gives_same_gradient(gen):
    cos = rand_cos(gen, 5, 11).requires_grad_(True)
    y = torch.randint(0, 11, (5,), generator=gen)
    out = CosFaceLoss(scale=20.0, margin=0.3)(cos, y)
    (g1,) = torch.autograd.grad(out, cos, retain_graph=True)
    (g2,) = torch.autograd.grad(out, cos)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    with pytest.raises(RuntimeError):  # once_differentiable: no silent wrong double backward
        (g,) = torch.autograd.grad(CosFaceLoss()(cos, y), cos, create_graph=True)
        g.sum().backward()


def test_hyperparameters_are_plain_attributes_a_schedule_can_change(gen):
    cos, y = rand_cos(gen, 6, 10), torch.randint(0, 10, (6,), generator=gen)
    loss = CosFaceLoss(scale=30.0, margin=0.1)
    loss.scale, loss.margin = 50.0, 0.35
    torch.testing.assert_close(loss(cos, y), CosFaceLoss(scale=50.0, margin=0.35)(cos, y), rtol=0, atol=0)
    arc = ArcFaceLoss(scale=30.0, margin=0.1)
    arc.margin = 0.45
    torch.testing.assert_close(arc(cos, y), ArcFaceLoss(scale=30.0, margin=0.45)(cos, y), rtol=0, atol=0)
    loss.margin = -0.1
    with pytest.raises(ValueError, match="margin"):
        loss(cos, y)
    arc.scale = 0.0
    with pytest.raises(ValueError, match="scale"):
        arc(cos, y)


@given(
    b=st.integers(1, 6),
    c=st.integers(1, 40),
    scale=st.floats(0.5, 128.0),
    margin=st.floats(0.0, 1.5),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_matches_float64_reference(b, c, scale, margin, seed):
    g = torch.Generator().manual_seed(seed)
    cos = rand_cos(g, b, c, lim=1.0)
    y = torch.randint(0, c, (b,), generator=g)
    rows = torch.arange(b)
    for loss, target in (
        (CosFaceLoss(scale=scale, margin=margin, reduction="none"), cos[rows, y] - margin),
        (ArcFaceLoss(scale=scale, margin=margin, reduction="none"), ref_arc_target(cos[rows, y], margin)),
    ):
        ours = loss(cos, y)
        ref = ref_loss(cos, y, scale, target, "none")
        # 1e-6 absolute near c = ±1, where our sqrt radicand is clamped at machine epsilon
        np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-9, atol=scale * 2e-8)
        ours32 = loss(cos.float(), y).double()
        np.testing.assert_allclose(ours32.numpy(), ref.numpy(), rtol=5e-5, atol=scale * 2e-6)


@pytest.mark.parametrize("loss_cls", [NormSoftmaxLoss, CosFaceLoss, ArcFaceLoss])
def test_one_call_site_serves_plain_and_sharded_heads(gen, loss_cls):
    # one process: the sharded head owns every class; loss(head(e), y) must agree in value and
    # gradient with the plain head (the sharded path itself is tested in test_sharded_head.py)
    from test_sharded_head import through_both_heads

    results = through_both_heads(gen, loss_cls(scale=8.0))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Bad input → clear errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_cls", [NormSoftmaxLoss, CosFaceLoss, ArcFaceLoss])
def test_bad_inputs(gen, loss_cls):
    loss = loss_cls()
    cos, y = rand_cos(gen, 4, 6, torch.float32), torch.randint(0, 6, (4,), generator=gen)
    bad = cos.clone()
    bad[1, 2] = 1.01
    with pytest.raises(ValueError, match=r"cosines must be cosines in \[-1, 1\]"):
        loss(bad, y)
    bad[1, 2] = -1.2
    with pytest.raises(ValueError, match="cosines"):
        loss(bad, y)
    bad = cos.clone()
    bad[0, y[0]] = 1.5  # the target column is checked too
    with pytest.raises(ValueError, match="cosines"):
        loss(bad, y)
    loss(torch.clamp(cos, -1, 1) * (1 + 5e-4), y)  # rounding beyond ±1 is accepted
    for v in (math.nan, math.inf, -math.inf):
        bad = cos.clone()
        bad[2, 3] = v
        with pytest.raises(ValueError, match="cosines"):
            loss(bad, y)
    with pytest.raises(ValueError, match="labels must lie in"):
        loss(cos, torch.tensor([0, 1, 2, 6]))
    with pytest.raises(ValueError, match="labels must lie in"):
        loss(cos, torch.tensor([0, -1, 2, 3]))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        loss(cos, y.float())
    with pytest.raises(TypeError, match="labels"):
        loss(cos, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="one entry per row"):
        loss(cos, y[:3])
    with pytest.raises(ValueError, match="labels must have shape"):
        loss(cos, y.unsqueeze(1))
    with pytest.raises(ValueError, match=r"cosines must have shape \[batch, num_classes\]"):
        loss(cos[0], y)
    with pytest.raises(TypeError, match="cosines must be a floating-point tensor"):
        loss(torch.zeros(4, 6, dtype=torch.long), y)
    with pytest.raises(TypeError, match="cosines must be a torch.Tensor"):
        loss(cos.tolist(), y)
    with pytest.raises(ValueError, match="scale"):
        loss_cls(scale=0.0)
    with pytest.raises(ValueError, match="scale"):
        loss_cls(scale=-1.0)
    with pytest.raises(ValueError, match="reduction"):
        loss_cls(reduction="avg")


def test_bad_margins():
    for cls in (CosFaceLoss, ArcFaceLoss):
        with pytest.raises(ValueError, match="margin"):
            cls(margin=-0.1)
        with pytest.raises(ValueError, match="margin"):
            cls(margin=math.nan)
        with pytest.raises(TypeError, match="margin"):
            cls(margin="0.5")
    with pytest.raises(ValueError, match=r"margin must be an angle in radians in \[0, π/2\]"):
        ArcFaceLoss(margin=28.6)  # degrees, as in pytorch-metric-learning, is caught
