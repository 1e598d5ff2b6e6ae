"""Tests of marginkit.losses.MEPLoss (SPEC §1: loss = ‖x − stopgrad(MEP(x))‖², grad 2(x − MEP(x)))."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marginkit.losses import MEPLoss
from marginkit.ops import margin_gap, mep


def _batch(gen, b=8, c=6, dtype=torch.float64):
    x = 2 * torch.randn(b, c, generator=gen, dtype=dtype)
    y = torch.randint(0, c, (b,), generator=gen)
    x[: b // 2, :] -= 10.0
    x[torch.arange(b // 2), y[: b // 2]] += 25.0  # first half: already far past the margin
    return x, y


@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_value_and_gradient(gen, norm, reduction):
    x, y = _batch(gen)
    target = mep(x, y, 1.5, norm)
    per_row = ((x - target) ** 2).sum(-1)
    xr = x.clone().requires_grad_(True)
    loss = MEPLoss(1.5, norm, reduction)(xr, y)
    if reduction == "none":
        assert loss.shape == (8,)
        torch.testing.assert_close(loss, per_row)
        weights = torch.arange(1.0, 9.0, dtype=torch.float64)
        (loss * weights).sum().backward()
        torch.testing.assert_close(xr.grad, 2 * (x - target) * weights[:, None])
        return
    scale = 1.0 / 8 if reduction == "mean" else 1.0
    torch.testing.assert_close(loss, per_row.sum() * scale)
    loss.backward()
    torch.testing.assert_close(xr.grad, 2 * (x - target) * scale)
    # rows that keep the margin: exactly zero loss and gradient
    assert bool((margin_gap(x[:4], y[:4]) > 1.5).all())
    assert torch.equal(xr.grad[:4], torch.zeros(4, 6, dtype=torch.float64))
    assert bool((xr.grad[4:].abs().sum(-1) > 0).all())


@given(seed=st.integers(0, 2**31 - 1), margin=st.floats(0.05, 5), norm=st.sampled_from(["l2", "l1"]))
def test_gradient_is_two_times_residual(seed, margin, norm):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(5, 7, generator=g) < 0.4
    xr = x.clone().requires_grad_(True)
    MEPLoss(margin, norm)(xr, mask).backward()
    want = 2 * (x - mep(x, mask, margin, norm)) / 5
    torch.testing.assert_close(xr.grad, want)
    keeps = margin_gap(x, mask) >= margin
    assert torch.equal(xr.grad[keeps], torch.zeros_like(xr.grad[keeps]))


def test_l2_loss_is_squared_distance_to_the_feasible_set(gen):
    """For L2 the loss is dist² to the convex set: no feasible point is closer (random feasible
    candidates, built by projecting perturbations), and the loss grows under scaling away."""
    x, y = _batch(gen, b=4, c=5)
    loss = MEPLoss(1.0, reduction="none")(x, y)
    for _ in range(50):
        cand = mep(x + torch.randn(x.shape, generator=gen, dtype=torch.float64), y, 1.0)
        assert bool((((cand - x) ** 2).sum(-1) >= loss - 1e-12).all())


def test_single_label_equals_multi_label_one_hot(gen):
    x, y = _batch(gen, b=16, c=9, dtype=torch.float32)
    mask = torch.nn.functional.one_hot(y, 9).bool()
    for norm in ("l2", "l1"):
        for reduction in ("mean", "sum", "none"):
            a = x.clone().requires_grad_(True)
            b = x.clone().requires_grad_(True)
            la = MEPLoss(0.8, norm, reduction)(a, y)
            lb = MEPLoss(0.8, norm, reduction)(b, mask)
            torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
            la.sum().backward()
            lb.sum().backward()
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_multi_label_rows(gen):
    x = torch.randn(6, 10, generator=gen)
    mask = torch.rand(6, 10, generator=gen) < 0.3
    mask[0] = False  # no positive: no constraint, no loss
    mask[1] = True  # no negative: no constraint, no loss
    loss = MEPLoss(1.0, reduction="none")(x, mask)
    assert loss[0] == 0 and loss[1] == 0
    torch.testing.assert_close(loss, ((x - mep(x, mask, 1.0)) ** 2).sum(-1))


def test_one_gradient_step_lands_on_the_projection(gen):
    """With sum reduction, x ← x − ½∇L is exactly MEP(x); afterwards the loss is exactly zero
    (the "brakes": nothing pushes further once the margin holds)."""
    x, y = _batch(gen, b=8, c=6, dtype=torch.float32)
    xr = x.clone().requires_grad_(True)
    crit = MEPLoss(1.0, reduction="sum")
    crit(xr, y).backward()
    with torch.no_grad():
        stepped = xr - 0.5 * xr.grad
    torch.testing.assert_close(stepped, mep(x, y, 1.0), rtol=0, atol=1e-6)
    z = mep(x, y, 1.0)
    zr = z.clone().requires_grad_(True)
    loss = crit(zr, y)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(zr.grad, torch.zeros_like(z))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(gen, dtype):
    x, y = _batch(gen, b=8, c=6, dtype=torch.float32)
    xh = x.to(dtype).requires_grad_(True)
    loss = MEPLoss(1.0)(xh, y)
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    loss.backward()
    assert xh.grad.dtype == dtype
    x32 = xh.detach().float()
    want = 2 * (x32 - mep(x32, y, 1.0)) / 8
    torch.testing.assert_close(xh.grad.float(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(loss, MEPLoss(1.0)(x32, y))


def test_leading_dims(gen):
    x = torch.randn(2, 3, 5, generator=gen)
    y = torch.randint(0, 5, (2, 3), generator=gen)
    crit = MEPLoss(0.5, reduction="none")
    assert crit(x, y).shape == (2, 3)
    torch.testing.assert_close(MEPLoss(0.5)(x, y), MEPLoss(0.5)(x.reshape(6, 5), y.reshape(6)))


def test_repr_and_bad_arguments():
    assert "margin=2.0" in repr(MEPLoss(2.0))
    with pytest.raises(ValueError, match="margin must be a finite number > 0"):
        MEPLoss(0.0)
    with pytest.raises(ValueError, match="margin must be a finite number > 0"):
        MEPLoss(math.inf)
    with pytest.raises(ValueError, match="norm must be one of"):
        MEPLoss(norm="l3")
    with pytest.raises(ValueError, match="reduction must be one of"):
        MEPLoss(reduction="avg")
    crit = MEPLoss()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"target must lie in \[0, 3\)"):
        crit(x, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="target must have shape"):
        crit(x, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="target must be a bool mask"):
        crit(x, torch.ones(4, 3))
    with pytest.raises(TypeError, match="scores must be a floating"):
        crit(torch.ones(4, 3, dtype=torch.long), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="scores contains NaN"):
        crit(torch.full((4, 3), math.nan), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="scores must have at least 1 dimension"):
        crit(torch.tensor(1.0), torch.tensor(0))
