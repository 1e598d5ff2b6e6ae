"""Options of the alpha and margin-softmax losses (issue 16), and extreme values (issue 14).

- a learnable alpha: gradients w.r.t. alpha against ``entmax_bisect``'s and against autograd on
  the textbook Fenchel–Young loss, gradcheck in float64, alpha < 1 refused by name;
- ``ignore_index`` with ``F.cross_entropy``'s semantics;
- raw logits (``logits=True``) against ``entmax``'s losses and ``F.cross_entropy``;
- ``alpha_softargmax`` in float32 against the float64 answer for large logits (shift invariance);
- Q-Margin beyond float64's range refused, a reference measure of 1e30 finite and exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from marginkit.losses import ArcFaceLoss, CosFaceLoss, EntmaxLoss, NormSoftmaxLoss, QMarginLoss, SparsemaxLoss
from marginkit.ops import alpha_divergence_loss, alpha_softargmax
from marginkit.ops.alpha import qmargin_loss
from marginkit.ops.classes import class_block

entmax = pytest.importorskip("entmax")

F64 = torch.float64


def textbook_loss(theta, y, alpha, q=None):
    """⟨p, θ⟩ − D_f(p, q) + D_f(e_y, q) − θ_y with p from entmax_bisect (q ≡ 1) or its q-form, autograd."""
    a = alpha.unsqueeze(-1)
    b = a - 1
    if q is None:
        p = entmax.entmax_bisect(theta, a, n_iter=400)
        q = torch.ones_like(theta)
    else:  # with a measure entmax has no counterpart: our p (checked in tests/test_alpha_softargmax.py)
        p = alpha_softargmax(theta, alpha, q=q)

    def div(p):
        t = p / q
        return (q * (t.clamp_min(0) ** a - 1 - a * (t - 1)) / (a * b)).sum(-1)

    e = F.one_hot(y, theta.shape[-1]).to(theta.dtype)
    return (p * theta).sum(-1) - div(p) + div(e) - theta.gather(-1, y.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------- learnable alpha
@pytest.mark.parametrize("alpha", [1.02, 1.25, 1.5, 2.0, 3.0, 4.0])
def test_softargmax_alpha_gradient_equals_entmax_bisect(alpha):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9, generator=g, dtype=F64)
    a = torch.full((5, 1), alpha, dtype=F64, requires_grad=True)
    upstream = torch.randn(5, 9, generator=g, dtype=F64)
    (alpha_softargmax(x, a) * upstream).sum().backward()
    ours = a.grad.clone()
    a.grad = None
    (entmax.entmax_bisect(x, a, n_iter=400) * upstream).sum().backward()
    torch.testing.assert_close(ours, a.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("alpha", [1.01, 1.3, 2.0, 2.7])
def test_loss_alpha_gradient_equals_textbook_autograd(alpha):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g, dtype=F64)
    y = torch.randint(0, 8, (6,), generator=g)
    a = torch.full((6,), alpha, dtype=F64, requires_grad=True)
    ours = alpha_divergence_loss(x, y, a)
    (ga,) = torch.autograd.grad(ours.sum(), a)
    ref = textbook_loss(x, y, a)
    (gr,) = torch.autograd.grad(ref.sum(), a)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ga, gr, rtol=1e-8, atol=1e-9)


def test_alpha_gradchecks_float64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, generator=g, dtype=F64)
    y = torch.randint(0, 7, (3,), generator=g)
    q = torch.rand(3, 7, generator=g, dtype=F64) + 0.2
    for alpha in (1.1, 1.5, 2.5):
        a_row = torch.full((3,), alpha, dtype=F64)
        a_row[1] += 0.2
        shared = torch.tensor(alpha, dtype=F64)
        for a in (a_row, shared):
            inputs = (x.clone().requires_grad_(), a.clone().requires_grad_())
            assert gradcheck(lambda t, b: alpha_softargmax(t, b.unsqueeze(-1) if b.dim() else b), inputs)
            assert gradcheck(lambda t, b: alpha_divergence_loss(t, y, b), inputs)
            per_row = (inputs[0], a_row.clone().requires_grad_())
            assert gradcheck(lambda t, b: alpha_softargmax(t, b, q=q), per_row)
            assert gradcheck(lambda t, b: alpha_divergence_loss(t, y, b, q=q), inputs)


@pytest.mark.parametrize("margin", [0.0, 0.2])
def test_qmargin_alpha_gradcheck_and_reference(margin):
    g = torch.Generator().manual_seed(3)
    cos = torch.rand(4, 11, generator=g, dtype=F64) * 1.6 - 0.8
    y = torch.randint(0, 11, (4,), generator=g)
    scale = 6.0

    def loss(c, a):
        return qmargin_loss(class_block(c, y), a, scale, margin)[0]

    for a in (torch.tensor(1.4, dtype=F64), torch.tensor([1.2, 1.5, 2.0, 2.6], dtype=F64)):
        assert gradcheck(loss, (cos.clone().requires_grad_(), a.clone().requires_grad_()))
    # against the textbook loss with q_y = e^{−sm} (the margin in the measure)
    a = torch.tensor([1.2, 1.5, 2.0, 2.6], dtype=F64, requires_grad=True)
    q_y = torch.full((4, 1), torch.e ** (-scale * margin), dtype=F64)
    q = torch.ones_like(cos).scatter(1, y[:, None], q_y)
    ours = loss(cos, a)
    (ga,) = torch.autograd.grad(ours.sum(), a)
    ref = textbook_loss(scale * cos, y, a, q=q if margin else None)
    (gr,) = torch.autograd.grad(ref.sum(), a)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ga, gr, rtol=1e-7, atol=1e-9)


def test_learnable_alpha_in_the_loss_modules_trains():
    g = torch.Generator().manual_seed(4)
    cos = (torch.rand(16, 10, generator=g) * 2 - 1).requires_grad_()
    y = torch.randint(0, 10, (16,), generator=g)
    for make in (
        lambda a: EntmaxLoss(alpha=a, scale=8.0),
        lambda a: QMarginLoss(alpha=a, scale=8.0, margin=0.1),
    ):
        alpha = torch.nn.Parameter(torch.tensor(1.5))
        loss_fn = make(alpha)
        assert any(p is alpha for p in loss_fn.parameters())  # registered: the optimiser sees it
        loss_fn(cos, y).backward()
        assert alpha.grad is not None and torch.isfinite(alpha.grad) and alpha.grad != 0
        # the same gradient as the op on the scaled cosines (one shared alpha: the sum of per-row ones)
        a = torch.tensor(1.5, dtype=F64, requires_grad=True)
        margin = getattr(loss_fn, "margin", 0.0)
        ref = qmargin_loss(class_block(cos.detach().double(), y), a, 8.0, margin)[0].mean()
        ref.backward()
        torch.testing.assert_close(alpha.grad.double(), a.grad, rtol=1e-4, atol=1e-6)


def test_alpha_below_one_refused_by_name():
    x = torch.randn(2, 5)
    y = torch.tensor([0, 1])
    for bad in (0.5, torch.tensor([1.5, 0.9]), torch.tensor(0.8, requires_grad=True)):
        with pytest.raises(ValueError, match="alpha must be >= 1.*alpha < 1 is not supported"):
            alpha_softargmax(x, bad)
        with pytest.raises(ValueError, match="alpha must be >= 1"):
            alpha_divergence_loss(x, y, bad)
    with pytest.raises(ValueError, match="alpha must be >= 1"):
        EntmaxLoss(alpha=0.5)
    with pytest.raises(ValueError, match="alpha must be >= 1"):
        QMarginLoss(alpha=torch.nn.Parameter(torch.tensor(0.7)))(torch.rand(2, 5), y)


# -------------------------------------------------------------------------------- ignore_index
def _reference_ignoring(loss_fn, cos, y, ignore):
    """The loss on the kept rows only, as ``F.cross_entropy`` defines ``ignore_index``."""
    keep = y != ignore
    reduction = loss_fn.reduction
    loss_fn.reduction = "none"
    per_row = loss_fn(cos[keep], y[keep])
    loss_fn.reduction = reduction
    if reduction == "none":
        return torch.zeros(y.shape, dtype=per_row.dtype).masked_scatter(keep, per_row)
    return per_row.sum() if reduction == "sum" else per_row.mean()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "make",
    [
        lambda r, i: NormSoftmaxLoss(scale=10.0, reduction=r, ignore_index=i),
        lambda r, i: CosFaceLoss(scale=10.0, margin=0.3, reduction=r, ignore_index=i),
        lambda r, i: ArcFaceLoss(scale=10.0, margin=0.4, reduction=r, ignore_index=i),
        lambda r, i: QMarginLoss(alpha=1.3, scale=10.0, margin=0.2, reduction=r, ignore_index=i),
        lambda r, i: EntmaxLoss(alpha=1.5, scale=8.0, reduction=r, ignore_index=i),
        lambda r, i: SparsemaxLoss(reduction=r, ignore_index=i),
    ],
)
def test_ignore_index_equals_the_kept_rows(make, reduction):
    g = torch.Generator().manual_seed(5)
    cos = torch.rand(9, 6, generator=g, dtype=F64) * 2 - 1
    y = torch.randint(0, 6, (9,), generator=g)
    y[[1, 4, 5]] = -100
    leaf = cos.clone().requires_grad_()
    value = make(reduction, -100)(leaf, y)
    value.backward(torch.ones_like(value))
    ref_leaf = cos.clone().requires_grad_()
    ref = _reference_ignoring(make(reduction, -100), ref_leaf, y, -100)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(value, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-12, atol=1e-12)
    assert bool((leaf.grad[[1, 4, 5]] == 0).all())


def test_ignore_index_matches_cross_entropy_including_all_ignored():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 4, generator=g, dtype=F64) * 3
    for y in (torch.tensor([0, -100, 3, 2, -100]), torch.full((5,), -100), torch.tensor([1, 2, 2, 2, 0])):
        for reduction in ("mean", "sum", "none"):
            a = logits.clone().requires_grad_()
            b = logits.clone().requires_grad_()
            ours = NormSoftmaxLoss(reduction=reduction, ignore_index=-100, logits=True)(a, y)
            ref = F.cross_entropy(b, y, reduction=reduction, ignore_index=-100)
            torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12, equal_nan=True)
            ours.sum().backward()
            ref.sum().backward()
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    # an ignore_index inside [0, C) ignores that class's rows, as in torch
    y = torch.tensor([0, 1, 2, 1, 3])
    ours = NormSoftmaxLoss(ignore_index=1, logits=True)(logits, y)
    torch.testing.assert_close(ours, F.cross_entropy(logits, y, ignore_index=1))


def test_ignore_index_still_rejects_other_bad_labels():
    cos = torch.rand(3, 4) * 2 - 1
    with pytest.raises(ValueError, match="labels"):
        EntmaxLoss(ignore_index=-100)(cos, torch.tensor([0, -1, 2]))
    with pytest.raises(TypeError, match="ignore_index"):
        NormSoftmaxLoss(ignore_index=1.5)
    with pytest.raises(TypeError, match="ignore_index"):
        EntmaxLoss(ignore_index="x")(cos, torch.tensor([0, 1, 2]))


# ------------------------------------------------------------------------------------ raw logits
def test_raw_logits_equal_entmax_losses_and_cross_entropy():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 9, generator=g, dtype=F64) * 4  # far outside [-1, 1]
    y = torch.randint(0, 9, (6,), generator=g)
    pairs = [
        (EntmaxLoss(alpha=1.5, logits=True), entmax.EntmaxBisectLoss(alpha=1.5, n_iter=400)),
        (SparsemaxLoss(logits=True), entmax.SparsemaxLoss()),
        (NormSoftmaxLoss(logits=True), torch.nn.CrossEntropyLoss()),
    ]
    for ours_fn, ref_fn in pairs:
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours, ref = ours_fn(a, y), ref_fn(b, y)
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)
        ours.backward()
        ref.backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-9)
    assert EntmaxLoss(logits=True).scale == 1.0 and EntmaxLoss().scale == 32.0
    assert NormSoftmaxLoss(logits=True).scale == 1.0 and NormSoftmaxLoss().scale == 30.0


def test_cosines_still_checked_without_the_flag_and_logits_checked_for_finiteness():
    x = torch.randn(3, 5) * 4
    y = torch.tensor([0, 1, 2])
    for loss_fn in (EntmaxLoss(), SparsemaxLoss(), NormSoftmaxLoss()):
        with pytest.raises(ValueError, match="cosines in \\[-1, 1\\]"):
            loss_fn(x, y)
    bad = x.clone()
    bad[1, 2] = float("nan")
    for loss_fn in (EntmaxLoss(logits=True), SparsemaxLoss(logits=True), NormSoftmaxLoss(logits=True)):
        with pytest.raises(ValueError, match="logits contains NaN or infinite"):
            loss_fn(bad, y)
    with pytest.raises(TypeError, match="logits must be a bool"):
        NormSoftmaxLoss(logits=1)


# ------------------------------------------------------------------- float32 and extreme values
@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0, 4.0])
def test_softargmax_float32_is_shift_invariant(alpha):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(32, 60, generator=g) + 1000.0
    exact = alpha_softargmax(x.double(), alpha)
    err = (alpha_softargmax(x, alpha).double() - exact).abs().max()
    assert err < 1e-6, err  # before the shift: sparsemax 2e-5 (issue: 6e-4), alpha = 4: 6e-3
    shifted = alpha_softargmax(x - 1000.0, alpha)  # exact in float32 (Sterbenz)
    assert (alpha_softargmax(x, alpha) - shifted).abs().max() < 1e-6


def test_softargmax_float32_alpha_three_near_the_support_edge():
    x = torch.tensor([[1.9609, 1.4624]])
    exact = alpha_softargmax(x.double(), 3.0)
    assert (alpha_softargmax(x, 3.0).double() - exact).abs().max() < 1e-7  # was 7e-4


def test_qmargin_beyond_float64_is_refused_clearly():
    cos = torch.rand(4, 10) * 2 - 1
    y = torch.arange(4)
    for kwargs in ({"alpha": 3.0, "scale": 1e4}, {"alpha": 1000.0}):
        with pytest.raises(ValueError, match="exceeds float64's range.*alpha"):
            QMarginLoss(**kwargs)(cos, y)
    # just inside the range the loss is finite (and float64)
    value = QMarginLoss(alpha=3.0, scale=1e3, margin=0.3)(cos, y)
    assert torch.isfinite(value) and value.dtype == F64


def test_entmax_loss_with_a_very_large_alpha_is_finite_and_exact():
    g = torch.Generator().manual_seed(9)
    cos = torch.rand(4, 10, generator=g, dtype=F64) * 2 - 1
    y = torch.arange(4)
    ours = EntmaxLoss(alpha=1000.0, reduction="none")(cos, y)
    ref = textbook_loss(32.0 * cos, y, torch.full((4,), 1000.0, dtype=F64))
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.0])
def test_huge_reference_measure_is_finite_and_exact(alpha):
    g = torch.Generator().manual_seed(10)
    theta = torch.randn(3, 6, generator=g, dtype=F64)
    q = torch.full((3, 6), 1e30, dtype=F64)
    q[:, 0] = 1e29
    # p(θ; c·q̃) = p(c^β θ; q̃): the reference from the rescaled problem
    c = 1e30
    expected = alpha_softargmax(theta * c ** (alpha - 1), alpha, q=q / c)
    for dtype in (torch.float32, F64):
        p = alpha_softargmax(theta.to(dtype), alpha, q=q.to(dtype))
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.double(), expected, rtol=1e-5, atol=1e-6)
    y = torch.tensor([0, 2, 5])
    a = torch.full((3,), alpha, dtype=F64)
    # a moderate measure: the textbook loss is still accurate in float64
    moderate = q / 1e27
    torch.testing.assert_close(
        alpha_divergence_loss(theta, y, alpha, q=moderate), textbook_loss(theta, y, a, q=moderate)
    )
    # at 1e30 p is the one-hot of argmax θ (logits scaled by c^β ≥ 1e15), so
    # ℓ = θ_k − θ_y + c^{−β}(D_f(e_y, q̃) − D_f(e_k, q̃)), with D_f(e_j, q̃) exact in float64
    loss = alpha_divergence_loss(theta, y, alpha, q=q)
    assert torch.isfinite(loss).all()
    k = theta.argmax(-1)
    qt, b = q / c, alpha - 1

    def div_onehot(j):
        t = F.one_hot(j, 6).to(F64) / qt
        return (qt * (t**alpha - 1 - alpha * (t - 1)) / (alpha * b)).sum(-1)

    ref = theta.gather(1, k[:, None]).squeeze(1) - theta.gather(1, y[:, None]).squeeze(1)
    ref = ref + c ** (-b) * (div_onehot(y) - div_onehot(k))
    torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="q is too large for alpha"):
        alpha_softargmax(theta, 1000.0, q=q)
