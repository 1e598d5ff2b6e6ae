"""alpha_divergence_loss and the Q-Margin / entmax / sparsemax losses: value against the
divergence definition and the entmax package, gradient p − e_y, CosFace limit, precision at a
million classes, dtypes, masking, top-K, and argument errors."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from entmax import EntmaxBisectLoss, entmax_bisect
from entmax import SparsemaxLoss as PeerSparsemaxLoss
from hypothesis import given
from hypothesis import strategies as st

from alpha_reference import brute_force
from marginkit.losses import EntmaxLoss, QMarginLoss, SparsemaxLoss
from marginkit.ops import alpha_divergence_loss, alpha_softargmax
from marginkit.ops.alpha import _candidates as candidates_impl
from marginkit.ops.alpha import _memory as memory_impl
from marginkit.ops.alpha import _solve as solve_impl


def divergence_definition(theta: np.ndarray, y: np.ndarray, alpha: float, q: np.ndarray) -> np.ndarray:
    """⟨p,θ⟩ − D_f(p,q) + D_f(e_y,q) − θ_y with the full sums of the definition, float64."""
    p = brute_force(theta, alpha, q)
    q = np.broadcast_to(q, theta.shape)
    if alpha == 1.0:
        f = lambda t: np.where(t > 0, t * np.log(np.where(t > 0, t, 1.0)), 0.0) - t + 1  # noqa: E731
    else:
        f = lambda t: (t**alpha - 1 - alpha * (t - 1)) / (alpha * (alpha - 1))  # noqa: E731
    e = np.zeros_like(theta)
    e[np.arange(len(y)), y] = 1.0
    div = lambda r: (q * f(r / q)).sum(-1)  # noqa: E731
    return (p * theta).sum(-1) - div(p) + div(e) - theta[np.arange(len(y)), y]


def cosface_inline(cos: torch.Tensor, y: torch.Tensor, s: float, m: float) -> torch.Tensor:
    """CosFace −log softmax(s(c − m e_y))_y, written out (no library code)."""
    logits = s * (cos - m * F.one_hot(y, cos.shape[-1]).to(cos.dtype))
    return -(logits.log_softmax(-1).gather(1, y[:, None]).squeeze(1))


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0, 3.0])
def test_value_matches_the_divergence_definition(alpha, gen):
    x = torch.randn(12, 15, generator=gen, dtype=torch.float64) * 2
    q = torch.exp(torch.randn(12, 15, generator=gen, dtype=torch.float64))
    y = torch.randint(0, 15, (12,), generator=gen)
    loss = alpha_divergence_loss(x, y, alpha, q=q)
    expected = divergence_definition(x.numpy(), y.numpy(), alpha, q.numpy())
    torch.testing.assert_close(loss, torch.from_numpy(expected), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("alpha", [1.1, 1.25, 1.5, 2.0, 3.0])
def test_unit_measure_matches_entmax_loss(alpha, gen):
    x = torch.randn(20, 11, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, 11, (20,), generator=gen)
    expected = EntmaxBisectLoss(alpha, n_iter=200, reduction="none")(x, y)
    torch.testing.assert_close(alpha_divergence_loss(x, y, alpha), expected, atol=1e-10, rtol=0)


@given(
    alpha=st.floats(1.0, 4.0),
    n=st.integers(1, 30),
    spread=st.floats(0.01, 20.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_nonnegative_and_gradient_is_p_minus_onehot(alpha, n, spread, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, n, generator=gen, dtype=torch.float64) * spread).requires_grad_()
    q = torch.exp(torch.randn(4, n, generator=gen, dtype=torch.float64))
    y = torch.randint(0, n, (4,), generator=gen)
    loss = alpha_divergence_loss(x, y, alpha, q=q)
    assert bool((loss >= 0).all())
    (grad,) = torch.autograd.grad(loss.sum(), x)
    p = alpha_softargmax(x.detach(), alpha, q=q)
    torch.testing.assert_close(grad, p - F.one_hot(y, n).double(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("alpha", [1.0, 1.25, 2.0, 3.0])
def test_zero_exactly_when_the_target_dominates(alpha):
    b = max(alpha - 1, 1e-12)
    q = torch.tensor([[0.3, 1.0, 2.0, 1.0]], dtype=torch.float64)
    # p = e_y needs θ_y − E(q_y) ≥ θ_j − E(q_j) + 1/β for every j ≠ y, E(q) = (q^{−β} − 1)/β
    e_q = torch.expm1(-b * q.log()) / b
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    x[0, 0] = float((x[0, 1:] - e_q[0, 1:]).max() + e_q[0, 0] + (1 / b if alpha > 1 else 10.0) + 0.5)
    loss = alpha_divergence_loss(x, torch.tensor([0]), alpha, q=q)
    if alpha == 1.0:
        assert 0 < float(loss) < 1e-3  # softmax is never one-hot
    else:
        assert float(loss) == 0.0
        assert float(alpha_divergence_loss(x, torch.tensor([1]), alpha, q=q)) > 1.0


@pytest.mark.parametrize("alpha", [1.25, 2.0, 2.5])
@pytest.mark.parametrize("path", [{}, {"candidates": False}, {"topk": 3}])
def test_gradcheck_loss_logits_and_measure(alpha, path, gen):
    x = (torch.randn(4, 7, generator=gen, dtype=torch.float64) * 1.5).requires_grad_()
    q = (torch.rand(4, 7, generator=gen, dtype=torch.float64) + 0.3).requires_grad_()
    y = torch.randint(0, 7, (4,), generator=gen)
    assert torch.autograd.gradcheck(lambda a, b: alpha_divergence_loss(a, y, alpha, q=b, **path), (x, q))


def test_gradcheck_loss_per_row_alpha(gen):
    x = (torch.randn(4, 6, generator=gen, dtype=torch.float64) * 1.5).requires_grad_()
    q = (torch.rand(6, generator=gen, dtype=torch.float64) + 0.3).requires_grad_()
    y = torch.tensor([0, 5, 2, 2])
    alphas = torch.tensor([1.0, 1.5, 2.0, 3.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: alpha_divergence_loss(a, y, alphas, q=b), (x, q))
    loss = alpha_divergence_loss(x, y, alphas, q=q)
    for i, a in enumerate(alphas.tolist()):
        row = alpha_divergence_loss(x[i : i + 1], y[i : i + 1], a, q=q)
        torch.testing.assert_close(loss[i : i + 1], row, atol=1e-10, rtol=0)


def test_alpha_one_is_cross_entropy_with_log_measure(gen):
    x = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    q = torch.rand(9, generator=gen, dtype=torch.float64) + 0.1
    y = torch.randint(0, 9, (6,), generator=gen)
    expected = F.cross_entropy(x + q.log(), y, reduction="none")
    torch.testing.assert_close(alpha_divergence_loss(x, y, 1.0, q=q), expected)


def test_topk_and_candidate_paths_equal_the_full_computation(gen):
    x = torch.randn(5, 2000, generator=gen, dtype=torch.float64)
    x[:, :10] += 5
    x[0, :40] = 6.0 + 1e-3 * torch.rand(40, generator=gen, dtype=torch.float64)  # support > K
    y = torch.tensor([0, 3, 1999, 7, 500])
    q = torch.exp(0.2 * torch.randn(2000, generator=gen, dtype=torch.float64))
    xs = x.requires_grad_()
    full = alpha_divergence_loss(xs, y, 1.5, q=q, candidates=False)
    (g_full,) = torch.autograd.grad(full.sum(), xs)
    for kwargs in ({}, {"topk": 8}, {"topk": 0.01}):
        loss = alpha_divergence_loss(xs, y, 1.5, q=q, **kwargs)
        (g,) = torch.autograd.grad(loss.sum(), xs)
        torch.testing.assert_close(loss, full, atol=1e-11, rtol=0)
        torch.testing.assert_close(g, g_full, atol=1e-12, rtol=0)


def test_neg_inf_logits_off_the_label(gen):
    x = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    x[:, 5:] = -math.inf
    xs = x.requires_grad_()
    y = torch.tensor([0, 1, 4])
    for alpha in (1.0, 1.5, 2.0):
        loss = alpha_divergence_loss(xs, y, alpha)
        (grad,) = torch.autograd.grad(loss.sum(), xs)
        torch.testing.assert_close(loss, alpha_divergence_loss(x[:, :5].detach(), y, alpha))
        assert not bool(grad.isnan().any()) and bool((grad[:, 5:] == 0).all())
    with pytest.raises(ValueError, match="finite at the labels"):
        alpha_divergence_loss(x, torch.tensor([0, 6, 1]), 1.5)


# ------------------------------------------------------------------------------- cosine losses


def random_cosines(gen: torch.Generator, b: int, c: int, dtype=torch.float64) -> torch.Tensor:
    e = F.normalize(torch.randn(b, 16, generator=gen, dtype=torch.float64), dim=1)
    w = F.normalize(torch.randn(c, 16, generator=gen, dtype=torch.float64), dim=1)
    return (e @ w.T).to(dtype)


def test_qmargin_at_alpha_one_is_cosface_value_and_gradient(gen):
    cos = random_cosines(gen, 8, 20).requires_grad_()
    y = torch.randint(0, 20, (8,), generator=gen)
    loss = QMarginLoss(alpha=1.0, scale=30.0, margin=0.35, reduction="none")(cos, y)
    ref = cosface_inline(cos, y, 30.0, 0.35)
    torch.testing.assert_close(loss, ref)
    g1 = torch.autograd.grad(loss.sum(), cos)[0]
    g2 = torch.autograd.grad(ref.sum(), cos)[0]
    torch.testing.assert_close(g1, g2)
    # and the alpha family is continuous there
    near = QMarginLoss(alpha=1.0 + 1e-7, scale=30.0, margin=0.35, reduction="none")(cos, y)
    torch.testing.assert_close(near, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
def test_qmargin_equals_the_loss_with_an_explicit_measure(alpha, gen):
    s, m = 32.0, 0.2
    cos = random_cosines(gen, 10, 50).requires_grad_()
    y = torch.randint(0, 50, (10,), generator=gen)
    loss_fn = QMarginLoss(alpha=alpha, scale=s, margin=m, reduction="none")
    loss = loss_fn(cos, y)
    q = torch.ones(10, 50, dtype=torch.float64)
    q[torch.arange(10), y] = math.exp(-s * m)
    ref = alpha_divergence_loss(s * cos, y, alpha, q=q)
    torch.testing.assert_close(loss, ref, atol=1e-10, rtol=1e-12)
    (grad,) = torch.autograd.grad(loss.sum(), cos)
    p = alpha_softargmax(s * cos.detach(), alpha, q=q)
    torch.testing.assert_close(grad, s * (p - F.one_hot(y, 50).double()), atol=1e-10, rtol=0)
    assert loss_fn.last_support_size is not None
    torch.testing.assert_close(loss_fn.last_support_size, (p > 0).sum(-1))
    expected = divergence_definition((s * cos).detach().numpy(), y.numpy(), alpha, q.numpy())
    torch.testing.assert_close(loss.detach(), torch.from_numpy(expected), atol=1e-8, rtol=1e-10)


@pytest.mark.parametrize("margin", [0.2, 1.5])
def test_qmargin_float32_large_rows_against_an_explicit_measure_in_float64(margin, gen):
    # 20k classes: the block-maxima bound, the candidate gather and the product form of p = q·u^4
    # with q_y = e^{-s m}; s·m = 96 puts q_y below the product form's headroom in float32 (the log
    # domain takes over) but not in float64
    s, n = 64.0, 20_000
    cos = (torch.randn(16, n, generator=gen, dtype=torch.float64) / 512**0.5).clamp(-1, 1)
    y = torch.randint(0, n, (16,), generator=gen)
    cos[torch.arange(16), y] = torch.linspace(-0.2, 0.95, 16, dtype=torch.float64)
    q = torch.ones(16, n, dtype=torch.float64)
    q[torch.arange(16), y] = math.exp(-s * margin)
    ref = alpha_divergence_loss(s * cos, y, 1.25, q=q, candidates=False)
    ref_p = alpha_softargmax(s * cos, 1.25, q=q, candidates=False)
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-4)):
        x = cos.to(dtype).requires_grad_()
        loss = QMarginLoss(alpha=1.25, scale=s, margin=margin, reduction="none")(x, y)
        (grad,) = torch.autograd.grad(loss.sum(), x)
        torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
        expected_grad = s * (ref_p - F.one_hot(y, n).double())
        torch.testing.assert_close(grad.double(), expected_grad, rtol=0, atol=tol * s)


def test_solver_restores_the_thread_count(gen):
    # the compact solve runs on one intra-op thread (CPU) and must hand the pool back, also on error
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cos = torch.randn(32, 5000, generator=gen) / 512**0.5
        y = torch.randint(0, 5000, (32,), generator=gen)
        QMarginLoss()(cos.requires_grad_(), y).backward()
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"), memory_impl._serial(10, torch.device("cpu")):
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_qmargin_when_label_holds_the_maximum(gen):
    # the lower bound then needs the largest *other* cosine: exercise both branches and ties
    cos = random_cosines(gen, 6, 30)
    y = cos.argmax(-1)
    y[0] = (y[0] + 1) % 30
    cos[1, 3] = cos[1, y[1]]  # a tie with the label
    q = torch.ones(6, 30, dtype=torch.float64)
    q[torch.arange(6), y] = math.exp(-35.0 * 0.2)
    loss = QMarginLoss(reduction="none")(cos, y)
    torch.testing.assert_close(loss, alpha_divergence_loss(35.0 * cos, y, 1.25, q=q), atol=1e-10, rtol=0)


@pytest.mark.parametrize("topk", [None, 5, 0.05])
def test_qmargin_float32_at_a_million_classes(topk, gen):
    c = 1_000_000
    cos = torch.rand(2, c, generator=gen, dtype=torch.float64) * 0.6 - 0.3
    y = torch.tensor([5, 77])
    cos[0, 5], cos[1, 77] = 0.25, 0.05
    loss_fn = QMarginLoss(alpha=1.25, scale=35.0, margin=0.2, reduction="none", topk=topk)
    l64 = loss_fn(cos, y)
    l32 = loss_fn(cos.float(), y)
    assert bool(((l32.double() - l64).abs() / l64).max() < 1e-4)
    assert bool((loss_fn.last_support_size < c // 20).all())


def test_entmax_and_sparsemax_losses_match_the_peer_package(gen):
    cos = random_cosines(gen, 12, 40)
    y = torch.randint(0, 40, (12,), generator=gen)
    ours = EntmaxLoss(alpha=1.5, scale=20.0, reduction="none")(cos, y)
    torch.testing.assert_close(ours, EntmaxBisectLoss(1.5, n_iter=200, reduction="none")(20.0 * cos, y))
    ours = SparsemaxLoss(scale=8.0, reduction="sum")(cos, y)
    torch.testing.assert_close(ours, PeerSparsemaxLoss(reduction="sum")(8.0 * cos, y))
    assert EntmaxLoss().alpha == 1.25 and EntmaxLoss().scale == 32.0 and SparsemaxLoss().scale == 8.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_cosines(dtype, gen):
    cos32 = random_cosines(gen, 16, 300, torch.float32)
    y = torch.randint(0, 300, (16,), generator=gen)
    cos = cos32.to(dtype).requires_grad_()
    for loss_fn in (
        QMarginLoss(),
        QMarginLoss(topk=0.1),
        EntmaxLoss(),
        SparsemaxLoss(),
        QMarginLoss(alpha=1.0),
    ):
        loss = loss_fn(cos, y)
        ref = loss_fn(cos.detach().float(), y)
        assert loss.dtype == torch.float32 and bool(torch.isfinite(loss))
        torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-4)
        (grad,) = torch.autograd.grad(loss, cos)
        assert grad.dtype == dtype and bool(torch.isfinite(grad).all())
    # entmax computes in the input dtype (an open issue of its users); ours does not
    assert bool(torch.isfinite(alpha_softargmax(cos.detach() * 35, 1.25)).all())
    peer = entmax_bisect(cos.detach() * 35, 1.25)
    assert peer.dtype == dtype


def test_reductions_attributes_and_support_size(gen):
    cos = random_cosines(gen, 6, 25, torch.float32)
    y = torch.randint(0, 25, (6,), generator=gen)
    none = QMarginLoss(reduction="none")(cos, y)
    torch.testing.assert_close(QMarginLoss(reduction="mean")(cos, y), none.mean())
    torch.testing.assert_close(QMarginLoss(reduction="sum")(cos, y), none.sum())
    loss_fn = QMarginLoss(reduction="none")
    loss_fn.scale, loss_fn.margin = 20.0, 0.1  # a schedule changes plain attributes
    torch.testing.assert_close(loss_fn(cos, y), QMarginLoss(scale=20.0, margin=0.1, reduction="none")(cos, y))
    support = loss_fn.last_support_size
    assert isinstance(support, torch.Tensor) and support.shape == (6,) and support.dtype == torch.long
    assert bool((support >= 1).all())
    # leading dimensions
    out = QMarginLoss(reduction="none")(cos.reshape(2, 3, 25), y.reshape(2, 3))
    torch.testing.assert_close(out, none.reshape(2, 3))
    assert "alpha=1.25" in repr(QMarginLoss())


def test_losses_reject_bad_input():
    cos = torch.rand(3, 5) * 2 - 1
    y = torch.tensor([0, 1, 4])
    loss_fn = QMarginLoss()
    QMarginLoss()(torch.full((3, 5), 1.0005), y)  # rounding is tolerated
    with pytest.raises(ValueError, match=r"cosines must be cosines in \[-1, 1\]"):
        loss_fn(torch.full((3, 5), 1.01), y)
    with pytest.raises(ValueError, match="cosines contains NaN"):  # NaN at fixed places: cos is unseeded
        loss_fn(cos.masked_fill(torch.arange(15).view(3, 5) % 4 == 0, math.nan), y)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        loss_fn(cos, torch.tensor([0, 1, 5]))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        loss_fn(cos, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="labels must have one entry per row of cosines"):
        loss_fn(cos, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="cosines must be a floating-point"):
        loss_fn(torch.ones(3, 5, dtype=torch.long), y)
    with pytest.raises(ValueError, match="reduction must be one of"):
        QMarginLoss(reduction="avg")
    with pytest.raises(ValueError, match="alpha must be >= 1, got 0.5: alpha < 1 is not supported"):
        QMarginLoss(alpha=0.5)
    bad = QMarginLoss()
    bad.alpha = math.nan
    with pytest.raises(ValueError, match="alpha must be a finite number >= 1"):
        bad(cos, y)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        QMarginLoss(scale=0.0)
    with pytest.raises(ValueError, match="margin must be a finite number >= 0"):
        QMarginLoss(margin=-0.1)
    for topk in (0, 6):
        with pytest.raises(ValueError, match=r"topk must lie in \[1, 5\]"):
            QMarginLoss(topk=topk)(cos, y)
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="labels must have one entry per row of logits"):
        alpha_divergence_loss(x, torch.tensor([0, 1]), 1.5)
    with pytest.raises(ValueError, match="logits contains NaN"):
        alpha_divergence_loss(x.masked_fill(x > 0, math.nan), y, 1.5)
    with pytest.raises(ValueError, match="q must be strictly positive"):
        alpha_divergence_loss(x, y, 1.5, q=-torch.ones(5))
    with pytest.raises(ValueError, match="alpha must be >= 1, got 0.99"):
        alpha_divergence_loss(x, y, 0.99)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
def test_qmargin_candidate_paths_with_many_near_equal_cosines(alpha, gen):
    # "Start of training": random unit vectors in 512-d give cosines ~N(0, 1/512); the first
    # bound is loose, the block-maxima bound and the block pre-filter do the work.
    c = 20_003
    cos = torch.randn(16, c, generator=gen) / 512**0.5
    y = torch.randint(0, c, (16,), generator=gen)
    y[:4] = cos[:4].argmax(-1)  # the label holds the row maximum
    xs = cos.clone().requires_grad_()
    results = []
    for kwargs in ({}, {"candidates": False}, {"topk": 0.02}):
        # scale ∝ 1/(α − 1): the support window 1/((α − 1)s) stays 0.11 in cosine units
        loss_fn = QMarginLoss(alpha=alpha, scale=8.75 / (alpha - 1), margin=0.2, reduction="none", **kwargs)
        loss = loss_fn(xs, y)
        (grad,) = torch.autograd.grad(loss.sum(), xs)
        results.append((loss, grad, loss_fn.last_support_size))
    for loss, grad, support in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(grad, results[0][1], atol=1e-4, rtol=0)
        assert torch.equal(support, results[0][2])
    # the path under test: the first bound leaves most blocks as candidates (dense pre-filter),
    # the block-maxima bound removes most candidates
    blocks, beta = candidates_impl._Blocks(cos), torch.full((16,), alpha - 1)
    scale, log_qy = 8.75 / (alpha - 1), torch.full((16,), -8.75 / (alpha - 1) * 0.2)
    lo, hi = candidates_impl._row_bounds(cos, blocks, scale, beta, torch.float32, None, y, log_qy)
    thr = candidates_impl._threshold(lo, beta, scale)
    assert not blocks.sparse(thr)
    refined = solve_impl._block_subset_bound(blocks, cos, scale, beta, alpha - 1, y, log_qy, lo, hi)
    exact = solve_impl._solve_dense(cos.double(), scale, beta.double(), alpha - 1, None, y, log_qy.double())
    assert bool((refined >= lo).all()) and bool((refined.double() <= exact.tau).all())
    thr_refined = candidates_impl._threshold(refined, beta, scale)
    assert int((cos > thr_refined[:, None]).sum()) < 0.5 * int((cos > thr[:, None]).sum())


def test_one_class_and_empty_batches():
    x = torch.randn(3, 1, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(alpha_softargmax(x, 1.5, topk=1), torch.ones(3, 1, dtype=torch.float64))
    loss = alpha_divergence_loss(x, torch.zeros(3, dtype=torch.long), 1.5)
    loss.sum().backward()
    assert bool((loss == 0).all()) and bool((x.grad == 0).all())
    empty = torch.rand(0, 5, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long)
    assert alpha_softargmax(empty, 1.5).shape == (0, 5)
    for loss_fn in (QMarginLoss(), QMarginLoss(alpha=1.0), SparsemaxLoss(reduction="sum")):
        out = loss_fn(empty, labels)
        out.backward()  # an empty batch still backpropagates (zero gradient)
        assert float(out.detach()) == 0.0 and empty.grad is not None and empty.grad.shape == (0, 5)
    assert alpha_divergence_loss(empty, labels, 1.5).shape == (0,)


@pytest.mark.parametrize(("alpha", "scale", "margin"), [(2.0, 64.0, 1.5), (3.0, 64.0, 0.7), (3.0, 64.0, 1.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qmargin_whose_measure_overflows_float32_is_computed_in_float64(alpha, scale, margin, dtype, gen):
    # E(q_y) = (e^{(α-1)s m} - 1)/(α-1) exceeds float32 here (e^{89.6} and beyond): the loss is
    # computed in float64 (finite; its value can exceed float32's range) instead of inf / NaN
    cos = (torch.randn(6, 3000, generator=gen, dtype=torch.float64) / 16).clamp(-1, 1)
    y = torch.randint(0, 3000, (6,), generator=gen)
    cos[torch.arange(3), y[:3]] = 0.95  # dominant labels, still inside the margin
    loss_fn = QMarginLoss(alpha=alpha, scale=scale, margin=margin, reduction="none")
    ref_x = cos.clone().requires_grad_()
    ref = loss_fn(ref_x, y)
    (ref_grad,) = torch.autograd.grad(ref.sum(), ref_x)
    x = cos.to(dtype).requires_grad_()
    loss = loss_fn(x, y)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    assert loss.dtype == torch.float64 and grad.dtype == dtype and bool(torch.isfinite(loss).all())
    x_rounded = cos.to(dtype).double()  # the float64 computation sees the rounded input
    expected = loss_fn(x_rounded, y)
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=0)
    torch.testing.assert_close(
        grad.double(), ref_grad, rtol=0, atol=scale * (1e-2 if dtype == torch.float16 else 1e-4)
    )
    one_class = loss_fn(torch.tensor([[0.3]], dtype=dtype), torch.tensor([0]))
    assert float(one_class) == 0.0


def test_large_gradient_comes_from_calloc_and_is_an_ordinary_tensor(gen):
    # ≥ 32 MiB: the dense gradient is allocated zeroed by calloc (numpy) and written sparsely;
    # it must behave as any gradient (values, in-place accumulation, dtype, device)
    n = (32 << 20) // (4 * 8) + 64  # 8 rows of float32 just above the threshold
    cos = (torch.randn(8, n, generator=gen) / 22.6).clamp_(-1, 1)
    y = torch.randint(0, n, (8,), generator=gen)
    x = cos.clone().requires_grad_()
    loss_fn = QMarginLoss(reduction="sum")
    loss_fn(x, y).backward()
    grad = x.grad.clone()
    assert x.grad.dtype == torch.float32 and x.grad.is_contiguous()
    p = alpha_softargmax(
        35.0 * cos.double(),
        1.25,
        q=torch.ones(8, n, dtype=torch.float64).scatter_(1, y[:, None], math.exp(-35.0 * 0.2)),
    )
    expected = 35.0 * (p - F.one_hot(y, n).double())
    torch.testing.assert_close(grad.double(), expected, rtol=0, atol=1e-4)
    loss_fn(x, y).backward()  # accumulates in place into the calloc-backed .grad
    torch.testing.assert_close(x.grad, 2 * grad, rtol=0, atol=1e-6)
    x.grad.zero_()
    assert float(x.grad.abs().max()) == 0.0
