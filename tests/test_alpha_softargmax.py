"""alpha_softargmax: agreement with entmax and an independent brute force, exactness of the
candidate filter and of top-K (with its fallback), closed-form backward, masking and dtypes."""

import math

import pytest
import torch
from entmax import entmax_bisect
from hypothesis import example, given
from hypothesis import strategies as st

from alpha_reference import brute_force, rounding_tolerance
from marginkit.ops import alpha_divergence_loss, alpha_softargmax
from marginkit.ops.alpha import _candidates as candidates_impl
from marginkit.ops.alpha import _newton as newton_impl
from marginkit.ops.alpha import _solve as solve_impl

ALPHAS = [1.1, 1.25, 1.5, 2.0, 3.0]


@pytest.mark.parametrize("alpha", ALPHAS)
def test_matches_entmax_bisect_with_unit_measure(alpha, gen):
    x = torch.randn(40, 30, generator=gen, dtype=torch.float64) * 3
    expected = entmax_bisect(x, alpha, n_iter=200)
    p = alpha_softargmax(x, alpha)
    atol = 1e-12 if alpha <= 2 else 1e-10  # α > 2: p = u^{1/(α−1)} is steep at the support edge
    torch.testing.assert_close(p, expected, atol=atol, rtol=0)
    assert bool((p.sum(-1) - 1).abs().max() < 1e-12)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_random_reference_measure_matches_bruteforce(alpha, gen):
    x = torch.randn(16, 25, generator=gen, dtype=torch.float64) * 2
    q = torch.exp(torch.randn(16, 25, generator=gen, dtype=torch.float64))
    p = alpha_softargmax(x, alpha, q=q)
    expected = torch.from_numpy(brute_force(x.numpy(), alpha, q.numpy()))
    atol = 1e-12 if alpha <= 2 else 1e-10
    torch.testing.assert_close(p, expected, atol=atol, rtol=0)


def test_alpha_one_is_softmax_of_logits_plus_log_q(gen):
    x = torch.randn(8, 12, generator=gen, dtype=torch.float64)
    q = torch.rand(12, generator=gen, dtype=torch.float64) + 0.1
    torch.testing.assert_close(
        alpha_softargmax(x, 1.0, q=q), torch.softmax(x + q.log(), -1), atol=1e-15, rtol=0
    )
    torch.testing.assert_close(alpha_softargmax(x, 1.0), torch.softmax(x, -1), atol=1e-15, rtol=0)


@given(
    alpha=st.floats(1.05, 4.0),
    n=st.integers(1, 40),
    rows=st.integers(1, 5),
    spread=st.floats(0.01, 30.0),
    seed=st.integers(0, 2**31 - 1),
)
@example(alpha=4.0, n=28, rows=4, spread=6.0, seed=4)
def test_property_simplex_sparsity_and_bruteforce(alpha, n, rows, spread, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64) * spread
    q = torch.exp(torch.randn(rows, n, generator=gen, dtype=torch.float64))
    p = alpha_softargmax(x, alpha, q=q)
    assert bool((p >= 0).all())
    torch.testing.assert_close(p.sum(-1), torch.ones(rows, dtype=torch.float64), atol=1e-12, rtol=0)
    expected = brute_force(x.numpy(), alpha, q.numpy())
    # α > 2 is ill-conditioned at the support edge (found by hypothesis: α = 4 off by 1.5e-9 where
    # u = 2e-7; the float64 reference itself was 6.5e-10 from a 50-digit solution there).
    slack = torch.from_numpy(1e-10 + rounding_tolerance(expected, x.numpy(), alpha, q.numpy()))
    excess = (p - torch.from_numpy(expected)).abs() - slack
    assert bool((excess <= 0).all()), f"max excess {float(excess.max()):.3g} (alpha={alpha})"
    # Zero exactly off the support: θ_j ≤ τ − 1/β, τ recovered from any active entry.
    b = alpha - 1
    j = p.argmax(-1, keepdim=True)
    tau = x.gather(1, j) - ((p.gather(1, j) / q.gather(1, j)) ** b - 1) / b
    off = x <= tau - 1 / b - 1e-9 * (1 + tau.abs())
    assert bool((p[off] == 0).all())


def test_per_row_alpha_equals_per_row_calls(gen):
    x = torch.randn(5, 9, generator=gen, dtype=torch.float64) * 2
    q = torch.rand(5, 9, generator=gen, dtype=torch.float64) + 0.2
    alphas = torch.tensor([1.0, 1.25, 1.5, 2.0, 3.5], dtype=torch.float64)
    p = alpha_softargmax(x, alphas, q=q)
    for i, a in enumerate(alphas.tolist()):
        row = alpha_softargmax(x[i : i + 1], a, q=q[i : i + 1])
        torch.testing.assert_close(p[i : i + 1], row, atol=1e-10, rtol=0)
    # entmax's keepdim form (size 1 along the class dim) is accepted too
    torch.testing.assert_close(alpha_softargmax(x, alphas.unsqueeze(1), q=q), p)


def test_dim_and_leading_dimensions(gen):
    x = torch.randn(3, 7, 4, generator=gen, dtype=torch.float64)
    p = alpha_softargmax(x, 1.5, dim=1)
    expected = entmax_bisect(x.transpose(1, 2), 1.5, n_iter=200).transpose(1, 2)
    torch.testing.assert_close(p, expected, atol=1e-12, rtol=0)
    q = torch.rand(7, 1, generator=gen, dtype=torch.float64) + 0.5  # broadcast over the last dim
    p = alpha_softargmax(x, 1.25, q=q, dim=1)
    ref = brute_force(x.transpose(1, 2).reshape(-1, 7).numpy(), 1.25, q.reshape(1, 7).numpy())
    torch.testing.assert_close(p, torch.from_numpy(ref).reshape(3, 4, 7).transpose(1, 2), atol=1e-12, rtol=0)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
def test_candidate_filter_and_topk_equal_full_rows(alpha, gen):
    # A few large logits among many small ones: the candidate set is a small part of the row.
    x = torch.randn(6, 3000, generator=gen, dtype=torch.float64)
    x[:, :20] += 6 * torch.rand(6, 20, generator=gen, dtype=torch.float64)
    q = torch.exp(0.3 * torch.randn(6, 3000, generator=gen, dtype=torch.float64))
    full = alpha_softargmax(x, alpha, q=q, candidates=False)
    assert (full > 0).sum(-1).max() < 3000
    for kwargs in ({}, {"topk": 64}, {"topk": 0.05}, {"topk": 1.0}, {"topk": 3000}):
        torch.testing.assert_close(alpha_softargmax(x, alpha, q=q, **kwargs), full, atol=1e-12, rtol=0)
    # The candidate path really works on a compact set (flat or padded rows, far fewer than n).
    beta = torch.full((6,), alpha - 1, dtype=torch.float64)
    sol = solve_impl._solve(
        x, candidates_impl._Blocks(x), scale=1.0, beta=beta, beta_scalar=alpha - 1, logq=q.log()
    )
    assert sol.entries.is_flat or sol.entries.col is not None
    assert sol.p.numel() < 6 * 3000 // 4


def test_topk_is_skipped_when_the_candidates_fit(gen, monkeypatch):
    # the exact candidates are a subset of every row's top K when no row has more than K of them:
    # no top-K selection runs; with K below a row's candidate count it does (and stays exact)
    x = torch.randn(8, 4000, generator=gen, dtype=torch.float64)
    x[:, :10] += 8.0
    full = alpha_softargmax(x, 1.5, candidates=False)
    calls = []
    original = torch.Tensor.topk

    def counting_topk(self, *args, **kwargs):
        calls.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", counting_topk)
    torch.testing.assert_close(alpha_softargmax(x, 1.5, topk=0.05), full, atol=1e-12, rtol=0)
    assert calls == []
    torch.testing.assert_close(alpha_softargmax(x, 1.5, topk=2), full, atol=1e-12, rtol=0)
    assert len(calls) == 1


def test_topk_that_misses_the_support_falls_back_to_exact(gen):
    # Row 0: 50 tied logits, the support holds all 50 > K = 5, so the integrity check fails.
    # Row 1: one dominant logit, the top-5 answer is exact. Rows are merged.
    x = torch.full((2, 200), -10.0, dtype=torch.float64)
    x[0, :50] = 1.0 + 1e-3 * torch.rand(50, generator=gen, dtype=torch.float64)
    x[1, 3] = 5.0
    x[1, 10:60] = 0.0
    p = alpha_softargmax(x, 1.5, topk=5)
    expected = torch.from_numpy(brute_force(x.numpy(), 1.5))
    torch.testing.assert_close(p, expected, atol=1e-12, rtol=0)
    assert int((p[0] > 0).sum()) == 50  # more than K: only the exact fallback gives this
    # The kept-set solution alone is wrong for row 0 (what the fallback corrects).
    vals = x.topk(5, dim=-1).values
    naive = entmax_bisect(vals, 1.5, n_iter=200)
    assert float((naive[0] - p[0].topk(5).values).abs().max()) > 0.1


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.5])
@pytest.mark.parametrize("path", [{}, {"candidates": False}, {"topk": 3}])
def test_gradcheck_logits_and_measure(alpha, path, gen):
    x = (torch.randn(3, 7, generator=gen, dtype=torch.float64) * 1.5).requires_grad_()
    q = (torch.rand(3, 7, generator=gen, dtype=torch.float64) + 0.3).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: alpha_softargmax(a, alpha, q=b, **path), (x, q))


def test_gradcheck_per_row_alpha_and_broadcast_measure(gen):
    x = (torch.randn(4, 6, generator=gen, dtype=torch.float64) * 1.5).requires_grad_()
    q = (torch.rand(6, generator=gen, dtype=torch.float64) + 0.3).requires_grad_()
    alphas = torch.tensor([1.2, 1.5, 2.0, 3.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: alpha_softargmax(a, alphas, q=b), (x, q))
    assert torch.autograd.gradcheck(lambda a: alpha_softargmax(a, 1.0, q=q.detach()), (x,))


def test_backward_is_the_closed_form_jacobian(gen):
    x = torch.randn(2, 8, generator=gen, dtype=torch.float64).requires_grad_()
    q = torch.rand(2, 8, generator=gen, dtype=torch.float64) + 0.5
    g = torch.randn(2, 8, generator=gen, dtype=torch.float64)
    p = alpha_softargmax(x, 1.5, q=q)
    (grad,) = torch.autograd.grad(p, x, g)
    w = torch.where(p > 0, q**0.5 * p.detach() ** 0.5, 0.0)
    jac = torch.diag_embed(w) - w.unsqueeze(2) * w.unsqueeze(1) / w.sum(-1)[:, None, None]
    torch.testing.assert_close(grad, torch.einsum("bi,bij->bj", g, jac))


def test_neg_inf_logits_get_zero_and_no_nan(gen):
    x = torch.randn(4, 10, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 10, generator=gen) < 0.4
    mask[:, 0] = False
    xm = x.masked_fill(mask, -math.inf).requires_grad_()
    for alpha in (1.0, 1.5, 2.0, 3.0):
        for kwargs in ({}, {"candidates": False}, {"topk": 4}):
            p = alpha_softargmax(xm, alpha, **kwargs)
            assert bool((p[mask] == 0).all()) and not bool(p.isnan().any())
            (grad,) = torch.autograd.grad(p, xm, torch.randn(4, 10, generator=gen, dtype=torch.float64))
            assert not bool(grad.isnan().any()) and bool((grad[mask] == 0).all())
            for i in range(4):  # masking equals dropping the masked columns
                kept = ~mask[i]
                expected = alpha_softargmax(x[i, kept], alpha)
                torch.testing.assert_close(p[i, kept], expected.detach(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype, gen):
    x32 = torch.randn(8, 50, generator=gen) * 3
    x = x32.to(dtype).requires_grad_()
    p = alpha_softargmax(x, 1.5)
    assert p.dtype == dtype and not bool(p.isnan().any())
    expected = alpha_softargmax(x.detach().float(), 1.5)
    torch.testing.assert_close(p.float(), expected, atol=1e-2, rtol=0)
    p.float().pow(2).sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype and bool(torch.isfinite(x.grad).all())
    # the entmax package computes in the input dtype; ours stays within half-precision rounding
    p_topk = alpha_softargmax(x.detach(), 1.5, topk=5)
    torch.testing.assert_close(p_topk.float(), expected, atol=1e-2, rtol=0)


def test_large_class_count_float32_against_float64(gen):
    x = torch.randn(2, 200_000, generator=gen, dtype=torch.float64) * 2
    p64 = alpha_softargmax(x, 1.25, candidates=False)
    p32 = alpha_softargmax(x.float(), 1.25)
    torch.testing.assert_close(p32.double(), p64, atol=1e-6, rtol=0)
    assert 0 < int((p64 > 0).sum()) < 2 * 200_000 // 100


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_newton_iteration_counts(alpha, dtype, gen):
    # Regression guard for the counts documented in docs/qmargin.md (monotone Newton, α ≤ 2).
    x = (torch.randn(32, 500, generator=gen, dtype=torch.float64) * 4).to(dtype)
    beta = torch.full((32,), alpha - 1, dtype=dtype)
    entries = candidates_impl._Entries(32, 500)
    problem = newton_impl._Problem(entries, x, None, beta, alpha - 1)
    lo, hi = newton_impl._lower_bound(problem), newton_impl._upper_bound(problem)
    trace: list[torch.Tensor] = []
    newton_impl._find_tau(problem, lo, hi, hybrid=False, trace=trace)
    first_done = torch.stack(trace).int().argmax(0) + 1
    assert bool(trace[-1].all()) and int(first_done.max()) <= 8
    expected = entmax_bisect(x.double(), alpha, n_iter=80)
    # float precision: p is exact up to the rounding of θ − τ, i.e. a few ulps of max |θ|
    atol = 4 * torch.finfo(dtype).eps * (1 + float(x.abs().max()))
    torch.testing.assert_close(alpha_softargmax(x, alpha).double(), expected, atol=atol, rtol=0)


def test_alpha_above_two_uses_few_iterations(gen):
    x = torch.randn(64, 500, generator=gen, dtype=torch.float64) * 4
    beta = torch.full((64,), 2.0, dtype=torch.float64)
    problem = newton_impl._Problem(candidates_impl._Entries(64, 500), x, None, beta, 2.0)
    lo, hi = newton_impl._lower_bound(problem), newton_impl._upper_bound(problem)
    trace: list[torch.Tensor] = []
    newton_impl._find_tau(problem, lo, hi, hybrid=True, trace=trace)
    assert bool(trace[-1].all()) and len(trace) <= 30  # bisection needs ~47 from that bracket


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="alpha must be >= 1, got 0.9: alpha < 1 is not supported"):
        alpha_softargmax(x, 0.9)
    with pytest.raises(ValueError, match="alpha must be a finite number >= 1"):
        alpha_softargmax(x, math.nan)
    with pytest.raises(ValueError, match="alpha must be finite everywhere"):
        alpha_softargmax(x, torch.tensor([1.5, math.nan, 2.0]))
    with pytest.raises(ValueError, match="alpha must be a float or a tensor broadcastable"):
        alpha_softargmax(x, torch.tensor([1.5, 2.0]))
    with pytest.raises(ValueError, match="alpha must be a float or a tensor broadcastable"):
        alpha_softargmax(x, torch.tensor([1.5, 2.0], requires_grad=True))  # learnable: same check
    with pytest.raises(TypeError, match="alpha must be a real number"):
        alpha_softargmax(x, "1.5")
    with pytest.raises(ValueError, match="q must be strictly positive"):
        alpha_softargmax(x, 1.5, q=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="q must be broadcastable to the logits shape"):
        alpha_softargmax(x, 1.5, q=torch.ones(4))
    with pytest.raises(ValueError, match="q contains NaN"):
        alpha_softargmax(x, 1.5, q=torch.tensor([1.0, math.nan, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="logits contains NaN"):
        alpha_softargmax(torch.tensor([[0.0, math.nan]]), 1.5)
    with pytest.raises(ValueError, match=r"\+inf"):
        alpha_softargmax(torch.tensor([[0.0, math.inf]]), 1.5)
    with pytest.raises(ValueError, match="all -inf"):
        alpha_softargmax(torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]), 1.5)
    with pytest.raises(TypeError, match="logits must be a floating-point"):
        alpha_softargmax(torch.ones(2, 3, dtype=torch.long), 1.5)
    for bad in (0, 6, -1):
        with pytest.raises(ValueError, match=r"topk must lie in \[1, 5\]"):
            alpha_softargmax(x, 1.5, topk=bad)
    with pytest.raises(ValueError, match=r"topk as a fraction must lie in \(0, 1\]"):
        alpha_softargmax(x, 1.5, topk=1.5)
    with pytest.raises(TypeError, match="topk must be None, an int or a float"):
        alpha_softargmax(x, 1.5, topk=True)
    with pytest.raises(ValueError, match="dim must index a dimension"):
        alpha_softargmax(x, 1.5, dim=2)


@pytest.mark.parametrize("n", [40, 64, 1000, 4160, 5003])
def test_block_prefilter_and_max_excluding(n, gen):
    x = torch.randn(6, n, generator=gen)
    blocks = candidates_impl._Blocks(x)
    torch.testing.assert_close(blocks.rowmax, x.amax(-1), rtol=0, atol=0)
    for quantile in (0.5, 0.99, 0.9999):  # dense and block-sparse regimes
        thr = torch.quantile(x, quantile, dim=-1) - 1e-3 * torch.rand(6, generator=gen)
        expected = (x > thr[:, None]).reshape(-1).nonzero().squeeze(1)
        assert torch.equal(blocks.above(thr), expected)
    label = torch.randint(0, n, (6,), generator=gen)
    label[0] = n - 1  # in the partial tail block when n % 64 != 0
    label[1] = x[1].argmax()
    xt = x.clone()
    xt[2, 3] = xt[2].max() + 1  # a tie between the label and another column
    xt[2, 7] = xt[2, 3]
    label[2] = 3
    blocks = candidates_impl._Blocks(xt)
    masked = xt.scatter(1, label[:, None], -math.inf)
    torch.testing.assert_close(blocks.max_excluding(label), masked.amax(-1), rtol=0, atol=0)
    # block maxima with the label left out of its block (the subset bound's entries)
    pad = (-n) % 64
    masked_blocks = torch.nn.functional.pad(masked, (0, pad), value=-math.inf).view(6, -1, 64).amax(-1)
    torch.testing.assert_close(blocks.bmax_excluding, masked_blocks, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alpha", [1.1, 1.25, 1.5, 2.0])
def test_integer_power_support_equals_the_log_domain(alpha, dtype, gen):
    # 1/β integer: p = u^(1/β) and w = u^(1/β - 1) by products; the log-domain formula (with its
    # exponent floor) must give the same values, exact zeros off the support included
    x = (torch.randn(16, 300, generator=gen, dtype=torch.float64) * 3).to(dtype)
    x[:, :5] = -math.inf
    beta = torch.full((16,), alpha - 1, dtype=dtype)
    fast = newton_impl._Problem(candidates_impl._Entries(16, 300), x, None, beta, alpha - 1)
    assert fast.int_power == round(1 / (alpha - 1))
    slow = newton_impl._Problem(candidates_impl._Entries(16, 300), x, None, beta, alpha - 1)
    slow.int_power = None
    tau = x.amax(-1) - 0.5
    for a, b in zip(fast.support(tau), slow.support(tau), strict=True):
        # the log domain rounds log(u)/β: a relative error of a few eps times |log p| (up to ~100);
        # its exponent floor (~1e-37 in float32) leaves w = p/u up to ~1e-33 where u ~ 1e-4
        rtol, atol = (1e-5, 1e-30) if dtype == torch.float32 else (1e-12, 1e-300)
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    (p, w, u), (_, _, u_slow) = fast.support(tau), slow.support(tau)
    assert torch.equal(u == 0, u_slow == 0) and bool((u[:, :5] == 0).all())
    assert bool((p[u == 0] == 0).all()) and bool((w[u == 0] == 0).all())  # exact zeros off the support
    assert newton_impl._integer_power(0.3) is None and newton_impl._integer_power(None) is None


@pytest.mark.parametrize("alpha", [1.25, 2.0, 3.0])
def test_block_subset_bound_is_a_valid_tight_lower_bound(alpha, gen):
    # logits spread over ~ one support window 1/β: the support spans many blocks, τ_lo is loose
    scale = 1.0 / (alpha - 1)
    x = torch.randn(8, 20_000, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 20_000, (8,), generator=gen)
    log_qy = torch.full((8,), -3.0, dtype=torch.float64)
    beta = torch.full((8,), alpha - 1, dtype=torch.float64)
    blocks = candidates_impl._Blocks(x)
    lo, hi = candidates_impl._row_bounds(x, blocks, scale, beta, torch.float64, None, y, log_qy)
    refined = solve_impl._block_subset_bound(blocks, x, scale, beta, alpha - 1, y, log_qy, lo, hi)
    q = torch.ones_like(x).scatter_(1, y[:, None], log_qy.exp()[:, None])
    sol = solve_impl._solve(scale * x, None, scale=1.0, beta=beta, beta_scalar=alpha - 1, logq=q.log())
    assert bool((refined >= lo).all()) and bool((refined <= sol.tau + 1e-12).all())
    assert float((sol.tau - refined).mean()) < 0.5 * float((sol.tau - lo).mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiny_measure_with_large_alpha_is_computed_in_float64(dtype):
    # α = 3, q = 1e-30: E(q) = (q^-2 - 1)/2 = 5e59 overflows float32; computed in float64 instead
    x = torch.tensor([[2.0, 1.0, -1.0], [0.5, 0.4, 0.3], [1.0, 1.0, 1.0]], dtype=dtype)
    q = torch.tensor([[1e-30, 1.0, 1.0], [1e-30, 1e-30, 1e-30], [1e-20, 1.0, 1.0]], dtype=torch.float32)
    y = torch.tensor([0, 1, 0])
    p = alpha_softargmax(x, 3.0, q=q)
    assert p.dtype == dtype and bool(torch.isfinite(p).all())
    p64 = alpha_softargmax(x.double(), 3.0, q=q.double())
    # float16 output: entries below its range (1.7e-30 here) round to 0
    tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float16 else {"rtol": 1e-5, "atol": 0.0}
    torch.testing.assert_close(p.double(), p64, **tol)
    loss = alpha_divergence_loss(x, y, 3.0, q=q)
    assert loss.dtype == torch.float64 and bool(torch.isfinite(loss).all())
    # (log q is taken in float32 here: relative error ~ 2|log q| eps in E(q) = q^-2/2)
    torch.testing.assert_close(
        loss, alpha_divergence_loss(x.double(), y, 3.0, q=q.double()), rtol=1e-5, atol=0
    )
