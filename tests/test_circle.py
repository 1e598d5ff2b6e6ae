"""Circle loss: pair-wise form vs pytorch-metric-learning and a slow loop, class-level form vs CE."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from pytorch_metric_learning import losses as pml_losses

from marginkit.losses import CircleLoss, ClassCircleLoss
from marginkit.ops import circle_loss


def _batch(gen, n=24, dim=6, classes=5, dtype=torch.float64):
    emb = torch.randn(n, dim, generator=gen, dtype=dtype)
    labels = torch.randint(0, classes, (n,), generator=gen)
    return emb, labels


def _value_and_grad(fn, emb):
    x = emb.clone().requires_grad_(True)
    value = fn(x)
    value.sum().backward()
    return value.detach(), x.grad


def _loop_circle(emb, labels, margin, gamma, ref=None, ref_labels=None):
    """Slow explicit per-anchor circle loss, eq. (4) of Sun et al. with exp/log (float64)."""
    self_ref = ref is None
    ref = emb if ref is None else ref
    ref_labels = labels if ref_labels is None else ref_labels
    out = []
    for i in range(emb.shape[0]):
        sum_p = emb.sum() * 0
        sum_n = emb.sum() * 0
        n_p = n_n = 0
        for j in range(ref.shape[0]):
            if self_ref and i == j:
                continue
            s = F.cosine_similarity(emb[i], ref[j], dim=0)
            if labels[i] == ref_labels[j]:
                a = max(0.0, 1 + margin - s.item())
                sum_p = sum_p + torch.exp(-gamma * a * (s - (1 - margin)))
                n_p += 1
            else:
                a = max(0.0, s.item() + margin)
                sum_n = sum_n + torch.exp(gamma * a * (s - margin))
                n_n += 1
        out.append(torch.log1p(sum_n * sum_p) if n_p and n_n else emb.sum() * 0)
    return torch.stack(out)


# ------------------------------------------------------------------ pair-wise form


@pytest.mark.parametrize(("margin", "gamma"), [(0.25, 256.0), (0.4, 80.0), (0.25, 128.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_circle_equals_pml_value_and_grad(margin, gamma, seed):
    gen = torch.Generator().manual_seed(seed)
    emb, labels = _batch(gen, n=32, classes=6)
    ours = _value_and_grad(lambda x: CircleLoss(margin, gamma)(x, labels), emb)
    theirs = _value_and_grad(lambda x: pml_losses.CircleLoss(m=margin, gamma=gamma)(x, labels), emb)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-8, atol=1e-12)


def test_circle_equals_pml_with_reference_set(gen):
    emb, labels = _batch(gen, n=12, classes=4)
    ref, ref_labels = _batch(gen, n=20, classes=4)
    theirs = _value_and_grad(
        lambda x: pml_losses.CircleLoss(m=0.25, gamma=64.0)(x, labels, ref_emb=ref, ref_labels=ref_labels),
        emb,
    )
    ours = _value_and_grad(lambda x: CircleLoss(0.25, 64.0)(x, labels, ref, ref_labels), emb)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])


@pytest.mark.parametrize("with_ref", [False, True])
def test_circle_per_anchor_equals_slow_loop(gen, with_ref):
    emb, labels = _batch(gen, n=14, classes=4)
    labels[0] = 99  # a singleton class: no positive
    ref = ref_labels = None
    if with_ref:
        ref, ref_labels = _batch(gen, n=9, classes=4)
    loss_fn = CircleLoss(margin=0.3, gamma=8.0, reduction="none")
    ours = _value_and_grad(lambda x: loss_fn(x, labels, ref, ref_labels), emb)
    slow = _value_and_grad(lambda x: _loop_circle(x, labels, 0.3, 8.0, ref, ref_labels), emb)
    torch.testing.assert_close(ours[0], slow[0])
    torch.testing.assert_close(ours[1], slow[1])
    if not with_ref:
        assert ours[0][0] == 0


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 12), classes=st.integers(1, 5))
def test_circle_loop_property(seed, n, classes):
    gen = torch.Generator().manual_seed(seed)
    emb, labels = _batch(gen, n=n, dim=3, classes=classes)
    ours = CircleLoss(margin=0.25, gamma=4.0, reduction="none", validate=False)(emb, labels)
    torch.testing.assert_close(ours, _loop_circle(emb, labels, 0.25, 4.0))


def test_anchors_without_positive_contribute_nothing(gen):
    emb, _ = _batch(gen, n=6)
    labels = torch.tensor([0, 0, 1, 2, 3, 3])  # anchors 2 and 3 have no positive
    loss = CircleLoss(gamma=32.0, reduction="none")
    per_anchor = loss(emb, labels)
    assert per_anchor[2] == 0 and per_anchor[3] == 0
    assert (per_anchor[[0, 1, 4, 5]] > 0).all()
    mean = CircleLoss(gamma=32.0)(emb, labels)
    torch.testing.assert_close(mean, per_anchor.sum() / 4)
    assert loss.last_active_fraction.item() == pytest.approx(4 / 6)
    torch.testing.assert_close(CircleLoss(gamma=32.0, reduction="sum")(emb, labels), per_anchor.sum())


def test_circle_ref_is_batch_equals_no_ref(gen):
    emb, labels = _batch(gen)
    loss = CircleLoss(gamma=32.0, reduction="none")
    torch.testing.assert_close(loss(emb, labels, emb, labels), loss(emb, labels))
    # another tensor with equal values is a different set: self-pairs count as positives
    other = loss(emb, labels, emb.clone(), labels.clone())
    assert not torch.allclose(other, loss(emb, labels))


@pytest.mark.parametrize("gamma", [256.0, 1024.0, 4096.0])
def test_circle_stable_at_large_gamma(gen, gamma):
    emb, labels = _batch(gen, n=64, classes=4, dtype=torch.float32)
    x = emb.clone().requires_grad_(True)
    value = CircleLoss(gamma=gamma)(x, labels)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(x.grad).all()
    ref = CircleLoss(gamma=gamma)(emb.double(), labels)
    torch.testing.assert_close(value.double(), ref, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_circle_half_precision_inputs(gen, dtype):
    emb, labels = _batch(gen, n=32, classes=4, dtype=torch.float32)
    x = emb.to(dtype).requires_grad_(True)
    value = CircleLoss(gamma=64.0)(x, labels)
    value.backward()
    assert value.dtype == torch.float32
    assert x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()
    ref = CircleLoss(gamma=64.0)(x.detach().float(), labels)
    torch.testing.assert_close(value, ref)


def test_circle_warns_once_on_no_positive_and_on_collapse(gen):
    emb, _ = _batch(gen, n=5, dtype=torch.float32)
    loss = CircleLoss()
    with pytest.warns(RuntimeWarning, match="no positive pair") as record:
        first = loss(emb, torch.arange(5))
    assert first.item() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss(emb, torch.arange(5))  # once per instance
    with pytest.warns(RuntimeWarning, match="collapsed"):
        loss(emb[:1].expand(5, -1) * 3.0, torch.tensor([0, 0, 1, 1, 2]))
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CircleLoss()(emb, torch.tensor([0, 0, 1, 1, 2]))  # a healthy batch never warns


def test_circle_validate_false_skips_checks(gen):
    emb, _ = _batch(gen, n=5, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CircleLoss(validate=False)(emb, torch.arange(5)).item() == 0


# ------------------------------------------------------------------ the op on similarity sets


def test_circle_op_masking_equals_slicing(gen):
    sp = torch.rand(4, 5, generator=gen, dtype=torch.float64) * 2 - 1
    sn = torch.rand(4, 7, generator=gen, dtype=torch.float64) * 2 - 1
    pos_mask = torch.tensor([True, False, True, True, False])
    neg_mask = torch.tensor([False, True, True, True, True, False, True])
    masked = circle_loss(sp, sn, 0.25, 32.0, pos_mask, neg_mask)
    sliced = circle_loss(sp[:, pos_mask], sn[:, neg_mask], 0.25, 32.0)
    torch.testing.assert_close(masked, sliced)
    # rows without any positive give 0
    row_mask = torch.ones(4, 5, dtype=torch.bool)
    row_mask[2] = False
    out = circle_loss(sp, sn, 0.25, 32.0, pos_mask=row_mask)
    assert out[2] == 0 and (out[[0, 1, 3]] > 0).all()


def test_circle_op_batched_equals_per_row_and_paper_formula(gen):
    sp = torch.rand(3, 2, 4, generator=gen, dtype=torch.float64) * 2 - 1
    sn = torch.rand(3, 2, 6, generator=gen, dtype=torch.float64) * 2 - 1
    out = circle_loss(sp, sn, 0.25, 16.0)
    assert out.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            p, n = sp[i, j], sn[i, j]
            wp = (1.25 - p).clamp_min(0)
            wn = (n + 0.25).clamp_min(0)
            paper = math.log1p(
                float(torch.exp(16.0 * wn * (n - 0.25)).sum() * torch.exp(-16.0 * wp * (p - 0.75)).sum())
            )
            assert out[i, j].item() == pytest.approx(paper, rel=1e-12)


def test_circle_op_gradient_equals_finite_differences_with_frozen_weights(gen):
    # no custom backward here; gradcheck does not apply as-is because the weights α are
    # detached by design. Check autograd against central differences of the loss in which
    # the weights are frozen at the evaluation point (an independent, explicit formula).
    sp = torch.rand(3, 4, generator=gen, dtype=torch.float64) * 1.6 - 0.8
    sn = torch.rand(3, 5, generator=gen, dtype=torch.float64) * 1.6 - 0.8
    m, g = 0.25, 4.0
    mask = torch.tensor([[True, True, False, True]] * 3)
    ap = (1 + m - sp).clamp_min(0)
    an = (sn + m).clamp_min(0)

    def frozen(p, n):
        lp = torch.where(mask, torch.exp(-g * ap * (p - (1 - m))), 0.0).sum(1)
        ln = torch.exp(g * an * (n - m)).sum(1)
        return torch.log1p(lp * ln).sum()

    a, b = sp.clone().requires_grad_(True), sn.clone().requires_grad_(True)
    circle_loss(a, b, m, g, pos_mask=mask).sum().backward()
    h = 1e-6
    for tensor, grad, which in ((sp, a.grad, 0), (sn, b.grad, 1)):
        for idx in torch.cartesian_prod(*(torch.arange(k) for k in tensor.shape)).tolist():
            plus, minus = tensor.clone(), tensor.clone()
            plus[tuple(idx)] += h
            minus[tuple(idx)] -= h
            args_p = (plus, sn) if which == 0 else (sp, plus)
            args_m = (minus, sn) if which == 0 else (sp, minus)
            numeric = (frozen(*args_p) - frozen(*args_m)) / (2 * h)
            assert grad[tuple(idx)].item() == pytest.approx(numeric.item(), rel=1e-6, abs=1e-8)


def test_circle_op_weights_are_detached():
    # d/ds_p of softplus(-γ α_p (s_p - Δ_p)) with α_p constant: -γ α_p σ(·)
    sp = torch.tensor([[0.5]], dtype=torch.float64, requires_grad=True)
    sn = torch.tensor([[-0.9]], dtype=torch.float64)  # α_n = 0 -> LSE_n = 0
    circle_loss(sp, sn, 0.25, 2.0).sum().backward()
    alpha = 1.25 - 0.5
    z = -2.0 * alpha * (0.5 - 0.75)
    expected = -2.0 * alpha * (1 / (1 + math.exp(-z)))
    assert sp.grad.item() == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ class-level form


def test_class_circle_equals_ce_on_modified_logits(gen):
    cos = (torch.rand(10, 7, generator=gen, dtype=torch.float64) * 2 - 1).requires_grad_(True)
    labels = torch.randint(0, 7, (10,), generator=gen)
    m, g = 0.25, 64.0
    ours = ClassCircleLoss(m, g)(cos, labels)
    ours.backward()
    grad_ours = cos.grad.clone()
    cos.grad = None
    # independent construction of z, class by class, weights as constants
    z = torch.empty_like(cos)
    for i in range(10):
        for j in range(7):
            s = cos[i, j]
            if j == labels[i]:
                z[i, j] = g * max(0.0, 1 + m - s.item()) * (s - (1 - m))
            else:
                z[i, j] = g * max(0.0, s.item() + m) * (s - m)
    ref = F.cross_entropy(z, labels)
    ref.backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad_ours, cos.grad)


def test_class_circle_equals_pairwise_op_with_one_positive(gen):
    cos = torch.rand(6, 5, generator=gen, dtype=torch.float64) * 2 - 1
    labels = torch.randint(0, 5, (6,), generator=gen)
    target = F.one_hot(labels, 5).bool()
    via_op = circle_loss(cos, cos, 0.3, 32.0, pos_mask=target, neg_mask=~target)
    torch.testing.assert_close(ClassCircleLoss(0.3, 32.0, reduction="none")(cos, labels), via_op)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_class_circle_half_precision(gen, dtype):
    cos = (torch.rand(8, 5, generator=gen) * 2 - 1).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 5, (8,), generator=gen)
    value = ClassCircleLoss(gamma=1024.0)(cos, labels)
    value.backward()
    assert value.dtype == torch.float32 and torch.isfinite(value)
    assert torch.isfinite(cos.grad.float()).all()
    torch.testing.assert_close(value, ClassCircleLoss(gamma=1024.0)(cos.detach().float(), labels))


# ------------------------------------------------------------------ bad input


def test_circle_bad_input_errors(gen):
    emb, labels = _batch(gen, n=6, dtype=torch.float32)
    loss = CircleLoss()
    with pytest.raises(ValueError, match="labels must have shape"):
        loss(emb, labels[:5])
    with pytest.raises(TypeError, match="labels must be an integer"):
        loss(emb, labels.float())
    with pytest.raises(ValueError, match="embeddings must be 2-D"):
        loss(emb[0], labels[:1])
    bad = emb.clone()
    bad[2, 1] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        loss(bad, labels)
    with pytest.raises(ValueError, match="ref_embeddings was given without ref_labels"):
        loss(emb, labels, emb.clone())
    with pytest.raises(ValueError, match="ref_labels was given without ref_embeddings"):
        loss(emb, labels, None, labels)
    with pytest.raises(ValueError, match="embedding dimension"):
        loss(emb, labels, emb[:, :3], labels)
    with pytest.raises(ValueError, match="gamma must be a finite number > 0"):
        CircleLoss(gamma=0.0)
    with pytest.raises(ValueError, match="margin must be a finite number >= 0"):
        CircleLoss(margin=-0.1)
    with pytest.raises(ValueError, match="reduction"):
        CircleLoss(reduction="avg")
    with pytest.raises(ValueError, match="sp must be cosine"):
        circle_loss(torch.full((2, 2), 1.5), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="leading"):
        circle_loss(torch.zeros(2, 2), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="gamma"):
        circle_loss(torch.zeros(2, 2), torch.zeros(2, 2), gamma=-1.0)
    with pytest.raises(ValueError, match="cosines must be cosines"):
        ClassCircleLoss()(torch.full((2, 3), 2.0), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        ClassCircleLoss()(torch.zeros(2, 3), torch.tensor([0, 3]))


def test_circle_against_an_empty_then_filled_memory_bank(gen):
    from marginkit.mining import MemoryBank

    bank = MemoryBank(size=16, dim=6)
    emb, labels = _batch(gen, n=8, classes=3, dtype=torch.float32)
    x = emb.clone().requires_grad_(True)
    value = CircleLoss(gamma=32.0)(x, labels, *bank.get())
    value.backward()
    assert value.item() == 0 and x.grad.abs().sum() == 0
    assert CircleLoss(gamma=32.0, reduction="none")(emb, labels, *bank.get()).shape == (8,)
    past, past_labels = _batch(gen, n=10, classes=3, dtype=torch.float32)
    bank.update(past, past_labels)
    torch.testing.assert_close(
        CircleLoss(gamma=32.0)(emb, labels, *bank.get()),
        CircleLoss(gamma=32.0)(emb, labels, past, past_labels),
    )


def test_circle_one_host_sync_per_forward(gen, monkeypatch):
    calls = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    emb, labels = _batch(gen, n=16, classes=4, dtype=torch.float32)
    x = emb.clone().requires_grad_(True)
    value = CircleLoss()(x, labels)
    assert len(calls) == 1, calls
    calls.clear()
    (value + CircleLoss(validate=False)(x, labels)).backward()
    assert calls == [], calls


def test_class_circle_on_a_cosine_head_and_a_gamma_schedule(gen):
    from marginkit.heads import CosineHead
    from marginkit.schedules import HyperparameterScheduler, LinearWarmup

    head = CosineHead(num_classes=6, embedding_dim=8)
    with torch.no_grad():  # centres from the seeded generator, not the global RNG
        head.weight.copy_(torch.randn(6, 8, generator=gen))
    emb = torch.randn(10, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 6, (10,), generator=gen)
    loss = ClassCircleLoss(margin=0.25, gamma=32.0)
    value = loss(head(emb), labels)
    value.backward()
    assert torch.isfinite(value) and head.weight.grad is not None and torch.isfinite(emb.grad).all()
    pair_loss = CircleLoss(gamma=32.0)
    schedule = HyperparameterScheduler(pair_loss, {"gamma": LinearWarmup(32.0, 64.0, 10)})
    for _ in range(10):
        schedule.step()
    assert pair_loss.gamma == pytest.approx(64.0)
    emb2, labels2 = _batch(gen, n=12, classes=3)
    torch.testing.assert_close(pair_loss(emb2, labels2), CircleLoss(gamma=64.0)(emb2, labels2))
