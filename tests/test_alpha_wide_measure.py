"""alpha_softargmax and alpha_divergence_loss with a reference measure spanning many orders of magnitude.

Issue 28: with ``q = [1, 1e30, 1, 1, 1]`` at α = 1.5 the threshold τ must be resolved to within
1e-15 of a logit; around the row maximum no floating-point type can (float64 included), and rows
came back as valid-looking, wrong distributions. References: an mpmath bisection at a precision
that grows with the measure's range (``alpha_reference.mp_*``), independent of the solver's frame.
"""

import numpy as np
import pytest
import torch

from alpha_reference import mp_fenchel_young, mp_jacobian, mp_softargmax
from marginkit.ops import alpha_divergence_loss, alpha_softargmax
from marginkit.ops.alpha import _frame

# Error allowed against the exact answer: float32 carries log q to ~|log q| ulps (|log 1e30| = 69).
ATOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _measure(kind: str, rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    q = torch.ones(rows, n, dtype=torch.float64)
    if kind == "one-huge":  # the issue's measure
        q[:, 1] = 1e30
    elif kind == "one-tiny":
        q[:, 2] = 1e-30
    else:  # log-uniform over 1e-30 ... 1e30
        q = 10 ** (torch.rand(rows, n, generator=gen, dtype=torch.float64) * 60 - 30)
    return q


def test_issue_case_float32_and_float64_match_an_independent_solver(gen):
    x = torch.randn(32, 5, generator=gen)
    q = torch.tensor([1.0, 1e30, 1.0, 1.0, 1.0])
    expected = torch.from_numpy(mp_softargmax(x.double().numpy(), 1.5, q.double().expand(32, 5).numpy()))
    p32 = alpha_softargmax(x, 1.5, q)
    p64 = alpha_softargmax(x.double(), 1.5, q.double())
    torch.testing.assert_close(p32.double(), expected, atol=ATOL[torch.float32], rtol=0)
    torch.testing.assert_close(p64, expected, atol=ATOL[torch.float64], rtol=0)
    # before the fix some rows put mass ~0.5 on the weighted class where the answer has none
    assert bool((expected[:, 1] == 0).any()) and bool((expected[:, 1] > 0).any())


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("kind", ["one-huge", "one-tiny", "log-uniform"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wide_measures_match_the_independent_solver(alpha, kind, dtype, gen):
    x = (torch.randn(6, 6, generator=gen, dtype=torch.float64) * 2).to(dtype)
    q = _measure(kind, 6, 6, gen).to(dtype)
    expected = torch.from_numpy(mp_softargmax(x.double().numpy(), alpha, q.double().numpy()))
    p = alpha_softargmax(x, alpha, q)
    torch.testing.assert_close(p.double(), expected, atol=ATOL[dtype], rtol=0)
    ones = torch.ones(6, dtype=torch.float64)
    torch.testing.assert_close(p.sum(-1).double(), ones, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_with_a_wide_measure(dtype, gen):
    # c^β·θ (the per-row normalisation of q) overflowed float16: an IndexError from an empty candidate set
    x = torch.randn(4, 6, generator=gen).to(dtype)
    q = torch.ones(4, 6)
    q[:, 1] = 1e10
    p = alpha_softargmax(x, 1.5, q)
    expected = alpha_softargmax(x.double(), 1.5, q.double())
    assert p.dtype == dtype
    torch.testing.assert_close(p.double(), expected, atol=4e-3, rtol=0)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("kind", ["one-huge", "log-uniform"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_is_the_exact_jacobian(alpha, kind, dtype, gen):
    # one weight can exceed the others by 1e15: the centring g − ⟨w, g⟩/Σw must not cancel
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64).to(dtype)
    q = _measure(kind, 3, 5, gen).to(dtype)
    jac = torch.autograd.functional.jacobian(lambda z: alpha_softargmax(z, alpha, q), x.clone())
    for i in range(3):
        expected = torch.from_numpy(mp_jacobian(x[i].double().numpy(), alpha, q[i].double().numpy()))
        torch.testing.assert_close(jac[i, :, i, :].double(), expected, atol=10 * ATOL[dtype], rtol=0)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_value_and_gradient_with_a_wide_measure(alpha, dtype, gen):
    x = torch.randn(4, 5, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    q = _measure("log-uniform", 4, 5, gen).to(dtype)
    q[:2, 1] = 1e30
    y = torch.tensor([1, 0, 3, 4])
    loss = alpha_divergence_loss(x, y, alpha, q=q)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    x64, q64 = x.detach().double().numpy(), q.double().numpy()
    expected = torch.tensor(
        [mp_fenchel_young(x64[i], int(y[i]), alpha, q64[i]) for i in range(4)], dtype=torch.float64
    )
    torch.testing.assert_close(loss.double(), expected, atol=ATOL[dtype] * (1 + expected.abs().max()), rtol=0)
    p = torch.from_numpy(mp_softargmax(x64, alpha, q64))
    target = torch.eye(5, dtype=torch.float64)[y]
    torch.testing.assert_close(grad.double(), p - target, atol=ATOL[dtype], rtol=0)


def test_candidates_top_k_and_full_rows_agree_with_a_wide_measure(gen):
    x = torch.randn(8, 40, generator=gen)
    q = _measure("log-uniform", 8, 40, gen).float()
    expected = torch.from_numpy(mp_softargmax(x.double().numpy(), 1.5, q.double().numpy()))
    for kwargs in ({}, {"topk": 5}, {"candidates": False}):
        p = alpha_softargmax(x, 1.5, q, **kwargs)
        torch.testing.assert_close(p.double(), expected, atol=ATOL[torch.float32], rtol=0)


def test_a_row_no_frame_resolves_is_refused_by_name(monkeypatch, gen):
    monkeypatch.setattr(_frame, "_MAX_FRAMES", 0)
    monkeypatch.setattr("marginkit.ops.alpha._solve._MAX_FRAMES", 0)
    x = torch.randn(4, 5, generator=gen)
    q = torch.tensor([1.0, 1e30, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="q spans too many orders of magnitude"):
        alpha_softargmax(x, 1.5, q)
    # a measure the row maximum's frame resolves needs no second frame
    assert np.isfinite(alpha_softargmax(x, 1.5, torch.rand(5) + 0.5).numpy()).all()
