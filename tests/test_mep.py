"""Tests of marginkit.ops.mep / margin_gap (SPEC §1).

References used here are independent of the implementation (prefix sums after one sort):
- a convex-program solver (cvxpy + Clarabel for L2, scipy's HiGHS LP for L1),
- the source's O(n²) interval scan written plainly in numpy float64,
- a brute-force L1 objective over all candidate levels.
"""

from __future__ import annotations

import math

import cvxpy as cp
import numpy as np
import pytest
import scipy.optimize
import scipy.sparse
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from marginkit.ops import margin_gap, mep

# ----------------------------------------------------------------------------- references


def scan_l2(x: np.ndarray, pos: np.ndarray, m: float) -> np.ndarray:
    """The source's algorithm in plain float64: f'(ℓ) at every breakpoint (O(n) each), then
    linear interpolation between the last negative and the first non-negative value."""
    x = np.asarray(x, dtype=np.float64)
    if pos.all() or not pos.any() or x[~pos].max() + m <= x[pos].min():
        return x.copy()
    xp, bn = x[pos], x[~pos] + m

    def deriv(level: float) -> float:
        return np.maximum(level - xp, 0).sum() - np.maximum(bn - level, 0).sum()

    cands = np.unique(np.concatenate([xp, bn]))
    vals = np.array([deriv(c) for c in cands])
    i = int(np.argmax(vals >= 0))
    if vals[i] == 0 or i == 0:
        level = cands[i]
    else:
        lo, hi, flo, fhi = cands[i - 1], cands[i], vals[i - 1], vals[i]
        level = lo - flo * (hi - lo) / (fhi - flo)
    z = x.copy()
    z[pos] = np.maximum(xp, level)
    z[~pos] = np.minimum(x[~pos], level - m)
    return z


def l1_optimum(x: np.ndarray, pos: np.ndarray, m: float) -> float:
    """min_z ‖z − x‖₁ s.t. the margin: brute force over ℓ at every breakpoint (g is piecewise
    linear and convex in ℓ, so a breakpoint is optimal)."""
    if pos.all() or not pos.any():
        return 0.0
    xp, bn = x[pos], x[~pos] + m
    levels = np.concatenate([xp, bn])
    g = np.maximum(levels[:, None] - xp[None], 0).sum(1) + np.maximum(bn[None] - levels[:, None], 0).sum(1)
    return max(float(g.min()), 0.0)


def cvxpy_l2(x: np.ndarray, pos: np.ndarray, m: float) -> np.ndarray:
    """Euclidean projection by cvxpy's OSQP with solution polishing (an active-set refinement:
    agreement ~1e-11 here; Clarabel's interior point stops ~1e-6 away on degenerate rows)."""
    z = cp.Variable(len(x))
    cons = []
    if pos.any() and not pos.all():
        level = cp.Variable()
        cons = [z[np.flatnonzero(pos)] >= level, z[np.flatnonzero(~pos)] <= level - m]
    prob = cp.Problem(cp.Minimize(cp.sum_squares(z - x)), cons)
    prob.solve(solver="OSQP", eps_abs=1e-10, eps_rel=1e-10, polishing=True, max_iter=200000)
    assert prob.status == "optimal"
    return np.asarray(z.value)


def highs_l1(x: np.ndarray, pos: np.ndarray, m: float) -> float:
    """L1 objective by an LP (HiGHS): variables (z, t, ℓ), min Σt, |z − x| ≤ t, margin."""
    n = len(x)
    if pos.all() or not pos.any():
        return 0.0
    eye = scipy.sparse.identity(n, format="csr")
    zero_col = scipy.sparse.csr_matrix((n, 1))
    sign = np.where(pos, -1.0, 1.0)  # -z_i + ℓ <= 0 (P),  z_j - ℓ <= -m (N)
    a_ub = scipy.sparse.vstack(
        [
            scipy.sparse.hstack([eye, -eye, zero_col]),
            scipy.sparse.hstack([-eye, -eye, zero_col]),
            scipy.sparse.hstack([scipy.sparse.diags(sign), scipy.sparse.csr_matrix((n, n)), -sign[:, None]]),
        ]
    )
    b_ub = np.concatenate([x, -x, np.where(pos, 0.0, -m)])
    c = np.concatenate([np.zeros(n), np.ones(n), [0.0]])
    res = scipy.optimize.linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=(None, None), method="highs")
    assert res.status == 0
    return float(res.fun)


# ----------------------------------------------------------------------------- random rows


def random_rows(rng: np.random.Generator, count: int) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """Rows with n in [2, 200], continuous / tied / duplicated scores, masks of every density
    (one positive, one negative, random, empty, full) and margins log-uniform in [0.01, 10]."""
    rows = []
    for r in range(count):
        n = int(np.exp(rng.uniform(np.log(2), np.log(201))))
        kind = r % 4
        if kind == 0:
            x = rng.normal(0, rng.choice([0.1, 1.0, 5.0]), n)
        elif kind == 1:  # integer grid: many ties
            x = rng.integers(-3, 4, n).astype(np.float64)
        elif kind == 2:  # duplicated values drawn from a small pool
            x = rng.choice(rng.normal(0, 2, max(1, n // 5)), n)
        else:  # a clear shift plus noise, some rows end up feasible
            x = rng.normal(0, 1, n)
        density = rng.choice(["one", "all_but_one", "uniform", "sparse", "dense", "empty", "full"])
        pos = np.zeros(n, dtype=bool)
        if density == "one":
            pos[rng.integers(n)] = True
        elif density == "all_but_one":
            pos[:] = True
            pos[rng.integers(n)] = False
        elif density == "uniform":
            pos = rng.random(n) < rng.uniform()
        elif density == "sparse":
            pos = rng.random(n) < 0.05
        elif density == "dense":
            pos = rng.random(n) < 0.9
        elif density == "full":
            pos[:] = True
        margin = float(np.exp(rng.uniform(np.log(0.01), np.log(10))))
        if kind == 3:
            x[pos] += rng.choice([0.0, margin, 3 * margin])
        if kind == 1 and rng.random() < 0.5:
            margin = float(rng.integers(1, 4))  # margins on the grid: breakpoints tie too
        rows.append((x, pos, margin))
    return rows


def run_mep(x: np.ndarray, pos: np.ndarray, m: float, norm: str, dtype: torch.dtype) -> np.ndarray:
    return mep(torch.tensor(x, dtype=dtype), torch.tensor(pos), m, norm).double().numpy()


# ----------------------------------------------------------------------------- vs solvers


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_l2_matches_cvxpy(dtype):
    rng = np.random.default_rng(1 if dtype == torch.float64 else 2)
    rows = random_rows(rng, 300)
    # The reference solves the problem for the scores and margin as the op sees them.
    rows = [
        (np.asarray(torch.tensor(x, dtype=dtype).double()), p, float(torch.tensor(m, dtype=dtype)))
        for x, p, m in rows
    ]
    n_moved = 0
    for x, pos, m in rows:
        ref = cvxpy_l2(x, pos, m)
        got = run_mep(x, pos, m, "l2", dtype)
        scale = 1.0 + np.abs(x).max() + m
        tol = 1e-9 * scale if dtype == torch.float64 else 5e-7 * scale
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol, err_msg=f"n={len(x)} m={m} pos={pos.sum()}")
        n_moved += not np.array_equal(got, x)
    assert n_moved > 150  # most rows really needed projecting


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_l1_objective_matches_highs(dtype):
    rng = np.random.default_rng(3 if dtype == torch.float64 else 4)
    rows = random_rows(rng, 200)
    for x, pos, m in rows:
        x = np.asarray(torch.tensor(x, dtype=dtype).double())
        m = float(torch.tensor(m, dtype=dtype))
        z = run_mep(x, pos, m, "l1", dtype)
        ref = highs_l1(x, pos, m)
        scale = 1.0 + np.abs(x).max() + m
        tol = 1e-9 * scale * len(x) if dtype == torch.float64 else 1e-5 * scale * len(x)
        assert abs(np.abs(z - x).sum() - ref) <= tol, (len(x), m, pos.sum())
        if pos.any() and not pos.all():  # the L1 answer is feasible
            assert z[~pos].max() + m <= z[pos].min() + tol


def test_l2_matches_scan_and_l1_bruteforce_many_rows():
    rng = np.random.default_rng(5)
    for x, pos, m in random_rows(rng, 400):
        np.testing.assert_allclose(run_mep(x, pos, m, "l2", torch.float64), scan_l2(x, pos, m), atol=1e-9)
        z1 = run_mep(x, pos, m, "l1", torch.float64)
        assert abs(np.abs(z1 - x).sum() - l1_optimum(x, pos, m)) <= 1e-9 * len(x) * (1 + np.abs(x).max())


def test_worked_example():
    # x = (2, 1.5, 0), P = {0}, m = 1: f'(ℓ)/2 = (ℓ − 2) − (2.5 − ℓ) on [2, 2.5] → ℓ = 2.25.
    x = torch.tensor([2.0, 1.5, 0.0])
    torch.testing.assert_close(mep(x, torch.tensor(0), 1.0), torch.tensor([2.25, 1.25, 0.0]))
    # L1: breakpoints (2, 2.5, 1), |N| = 2 → ℓ = u_(2) = 2.
    torch.testing.assert_close(mep(x, torch.tensor(0), 1.0, "l1"), torch.tensor([2.0, 1.0, 0.0]))


# ----------------------------------------------------------------------------- properties

values = st.one_of(
    st.floats(-20, 20, allow_nan=False, width=64),
    st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0]),  # ties
)


@st.composite
def problems(draw, max_n: int = 30, rows: int = 1):
    n = draw(st.integers(1, max_n))
    x = np.array([[draw(values) for _ in range(n)] for _ in range(rows)])
    pos = np.array([[draw(st.booleans()) for _ in range(n)] for _ in range(rows)])
    margin = draw(st.one_of(st.floats(0.01, 10), st.sampled_from([0.5, 1.0, 2.0])))
    return x, pos, margin


def same_bits(t: torch.Tensor) -> torch.Tensor:
    """The IEEE patterns of ``t``: equal patterns are bit-identity (a -0.0 differs from +0.0)."""
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def breakpoint_feasible(z: torch.Tensor, pos: torch.Tensor, m: float) -> torch.Tensor:
    """x_j + m <= x_i for all i ∈ P, j ∈ N, evaluated exactly in z's dtype (the op's test)."""
    inf = torch.tensor(math.inf, dtype=z.dtype)
    hi = torch.where(pos, -inf, z + m).amax(-1)
    lo = torch.where(pos, z, inf).amin(-1)
    return hi <= lo


@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@given(prob=problems(rows=4))
@example(  # found by hypothesis: float32 gap 1.5e-6 (relative) below m, within one ulp of |z| ~ 2.1
    prob=(
        np.array([[0.0, 0, 0, -9, -2, -2, -2, -2, -2, 0, 0, 0, 0]]),
        np.array([[False] * 3 + [True] + [False] * 5 + [True] * 4]),
        0.05310686556304269,
    )
)
def test_feasible_and_exactly_idempotent(norm, dtype, prob):
    x, pos, m = prob
    xt, pt = torch.tensor(x, dtype=dtype), torch.tensor(pos)
    z = mep(xt, pt, m, norm)
    assert z.dtype == dtype and z.shape == xt.shape
    assert bool(breakpoint_feasible(z, pt, m).all())  # z_j + m <= z_i exactly, in the dtype
    # The computed gap z_i - z_j can still round below m, by up to an ulp of the scores (not of m).
    gap = margin_gap(z, pt)
    slack = torch.finfo(dtype).eps * z.abs().amax(-1)
    assert bool((gap >= m - slack).all())
    assert torch.equal(mep(z, pt, m, norm), z)


@given(prob=problems(rows=3))
def test_l2_optimal_against_scan(prob):
    x, pos, m = prob
    z = mep(torch.tensor(x), torch.tensor(pos), m)
    ref = np.stack([scan_l2(x[r], pos[r], m) for r in range(len(x))])
    np.testing.assert_allclose(z.numpy(), ref, atol=1e-9 * (1 + np.abs(x).max()))


@given(prob=problems(rows=3))
def test_l1_optimal_objective(prob):
    x, pos, m = prob
    z = mep(torch.tensor(x), torch.tensor(pos), m, "l1").numpy()
    for r in range(len(x)):
        ref = l1_optimum(x[r], pos[r], m)
        assert abs(np.abs(z[r] - x[r]).sum() - ref) <= 1e-9 * len(x[r]) * (1 + np.abs(x).max())
    # L1's answer is no farther (in L1) than L2's feasible answer, and vice versa in L2.
    z2 = mep(torch.tensor(x), torch.tensor(pos), m, "l2").numpy()
    assert np.all(np.abs(z - x).sum(1) <= np.abs(z2 - x).sum(1) + 1e-9 * (1 + np.abs(x).max()) * x.shape[1])
    assert np.all(((z2 - x) ** 2).sum(1) <= ((z - x) ** 2).sum(1) + 1e-9 * (1 + np.abs(x).max()) ** 2)


@pytest.mark.parametrize("norm", ["l2", "l1"])
@given(prob=problems(rows=2), shift=st.floats(-100, 100))
def test_translation_equivariance(norm, prob, shift):
    x, pos, m = prob
    xt, pt = torch.tensor(x), torch.tensor(pos)
    # Shifted scores as the op sees them (rounded); compare against the unrounded shift.
    shifted = xt + shift
    got = mep(shifted, pt, m, norm) - shift
    want = mep(shifted - shift, pt, m, norm)
    if norm == "l2":
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9 * (1 + abs(shift) + float(xt.abs().max())))
    else:  # the L1 solution can jump between optimal levels: compare objective values
        obj = lambda z, base: (z - base).abs().sum(-1)  # noqa: E731
        torch.testing.assert_close(
            obj(mep(shifted, pt, m, "l1"), shifted),
            obj(want, shifted - shift),
            rtol=0,
            atol=1e-9 * x.shape[1] * (1 + abs(shift) + float(xt.abs().max())),
        )


@pytest.mark.parametrize("norm", ["l2", "l1"])
@given(prob=problems(rows=5), scale=st.floats(0.1, 10))
def test_positive_scaling(norm, prob, scale):
    """mep(a·x, P, a·m) = a·mep(x, P, m) for a > 0 (the problem is positively homogeneous)."""
    x, pos, m = prob
    xt, pt = torch.tensor(x), torch.tensor(pos)
    got = mep(scale * xt, pt, scale * m, norm)
    want = scale * mep(xt, pt, m, norm)
    if norm == "l2":
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * scale * (1 + float(xt.abs().max())))
    else:
        torch.testing.assert_close(
            (got - scale * xt).abs().sum(-1),
            (want - scale * xt).abs().sum(-1),
            rtol=1e-9,
            atol=1e-9 * scale * 40,
        )


@pytest.mark.parametrize("norm", ["l2", "l1"])
@given(prob=problems(rows=6))
def test_batched_equals_row_by_row(norm, prob):
    x, pos, m = prob
    xt, pt = torch.tensor(x, dtype=torch.float32), torch.tensor(pos)
    batched = mep(xt, pt, m, norm)
    rows = torch.stack([mep(xt[r], pt[r], m, norm) for r in range(len(x))])
    torch.testing.assert_close(batched, rows, rtol=1e-6, atol=1e-6)
    # per-row margins as a tensor equal separate calls with each margin
    margins = torch.linspace(0.5 * m, 2 * m, len(x), dtype=torch.float64)
    batched = mep(xt, pt, margins, norm)
    rows = torch.stack([mep(xt[r], pt[r], float(margins[r]), norm) for r in range(len(x))])
    torch.testing.assert_close(batched, rows, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", ["l2", "l1"])
@given(prob=problems(rows=3), slack=st.one_of(st.just(0.0), st.floats(0, 5)))
def test_feasible_rows_bit_identical(norm, prob, slack):
    x, pos, m = prob
    pos[:, 0], pos[:, -1] = True, False
    assume(x.shape[1] >= 2)
    # Lift the positives so that min positive - max negative = m + slack (exactly m on the
    # integer grid with slack 0: the boundary counts as feasible).
    for r in range(len(x)):
        x[r, pos[r]] += x[r, ~pos[r]].max() + m + slack - x[r, pos[r]].min()
    xt, pt = torch.tensor(x), torch.tensor(pos)
    keep = breakpoint_feasible(xt, pt, m)
    assume(bool(keep.any()))
    z = mep(xt, pt, m, norm)
    assert torch.equal(same_bits(z[keep]), same_bits(xt[keep]))  # -0.0 included


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_negative_zero_on_the_level_kept(dtype):
    """A feasible row whose positive -0.0 ties with the level (a negative at -m has breakpoint +0.0)
    comes back bit-identical on every path; an infeasible row moves only what must move."""
    x = torch.full((2, 40), -3.0, dtype=dtype)  # 40 columns: the -0.0 sits in a SIMD lane, not a tail
    x[:, 0], x[0, 1], x[1, 1] = -0.0, -1.0, -0.5
    y = torch.tensor([0, 0])
    mask = y[:, None] == torch.arange(40)
    for positives in (y, mask):
        for norm in ("l2", "l1"):
            for grad in (False, True):
                xr = x.clone().requires_grad_(grad)
                z = mep(xr, positives, 1.0, norm).detach()
                assert torch.equal(same_bits(z[0]), same_bits(x[0])), (positives.dtype, norm, grad)
                assert z[1, 2] == -3.0 and z[1, 1] < -0.5 and bool(breakpoint_feasible(z, mask, 1.0).all())


@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@given(prob=problems(rows=4))
def test_degenerate_rows_bit_identical(norm, dtype, prob):
    x, pos, m = prob
    pos[0], pos[1] = True, False  # all positive / no positive
    xt = torch.tensor(x).to(dtype)
    z = mep(xt, torch.tensor(pos), m, norm)
    assert torch.equal(same_bits(z[:2]), same_bits(xt[:2]))


@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@given(prob=problems(rows=4), data=st.data())
def test_labels_path_equals_mask_path_with_ties(norm, dtype, prob, data):
    """Integer labels take their own code path (no mask scan; top-2 for L1, the negatives' sorted
    breakpoints for L2): the one-hot mask's answer, exact feasibility, exact idempotence, feasible
    rows bit-identical. L1 equals the mask path bit for bit; L2 up to the rounding of the level
    (the labels' float64 mean sums the active breakpoints only, the mask path's adds and subtracts
    the inactive negatives' sum: about n ulps of the scores' magnitude apart, at most)."""
    x, _, m = prob
    n = x.shape[1]
    y = torch.tensor([data.draw(st.integers(0, n - 1)) for _ in range(len(x))])
    mask = torch.nn.functional.one_hot(y, n).bool()
    xt = torch.tensor(x, dtype=dtype)
    zl, zm = mep(xt, y, m, norm), mep(xt, mask, m, norm)
    if norm == "l1":
        assert torch.equal(zl, zm)
    else:
        ulp = torch.finfo(dtype).eps * (float(xt.abs().max()) + m)
        torch.testing.assert_close(zl, zm, rtol=0, atol=(n + 8) * ulp)
    assert bool(breakpoint_feasible(zl, mask, m).all())
    assert torch.equal(mep(zl, y, m, norm), zl)
    keep = breakpoint_feasible(xt, mask, m)
    assert torch.equal(zl[keep], xt[keep])


def test_labels_equal_one_hot_mask(gen):
    x = torch.randn(64, 9, generator=gen)
    y = torch.randint(0, 9, (64,), generator=gen)
    mask = torch.nn.functional.one_hot(y, 9).bool()
    for norm in ("l2", "l1"):
        a, b = mep(x, y, 0.7, norm), mep(x, mask, 0.7, norm)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert torch.equal(margin_gap(x, y), margin_gap(x, mask))


@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_leading_batch_dims_and_margin_broadcast(gen, norm):
    x = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    pos = torch.rand(2, 3, 11, generator=gen) < 0.3
    y = torch.randint(0, 11, (2, 3), generator=gen)
    for positives in (pos, y):
        flat_pos = positives.reshape(6, -1) if positives.dtype == torch.bool else positives.reshape(6)
        z = mep(x, positives, 0.8, norm)
        assert z.shape == (2, 3, 11)
        torch.testing.assert_close(z.reshape(6, 11), mep(x.reshape(6, 11), flat_pos, 0.8, norm))
        for margins in (torch.tensor([0.1, 1.0, 3.0]), torch.tensor([[0.5], [2.0]]), torch.tensor(1.5)):
            z = mep(x, positives, margins, norm)
            full = margins.expand(2, 3)
            for i in range(2):
                for j in range(3):
                    p = positives[i, j]
                    torch.testing.assert_close(z[i, j], mep(x[i, j], p, float(full[i, j]), norm))
    assert margin_gap(x, pos).shape == (2, 3)


def test_empty_batch_and_single_class():
    assert mep(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), 1.0).shape == (0, 5)
    assert mep(torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool), 1.0, "l1").shape == (0, 5)
    x = torch.randn(4, 1, generator=torch.Generator().manual_seed(1))
    for norm in ("l1", "l2"):
        assert torch.equal(mep(x, torch.zeros(4, dtype=torch.long), 1.0, norm), x)


def test_large_rows_float32_vs_float64(gen):
    """n = 20000 in float32 agrees with float64 (the centring keeps the prefix sums accurate)."""
    x = 50 + 3 * torch.randn(4, 20000, generator=gen, dtype=torch.float64)
    pos = torch.rand(4, 20000, generator=gen) < torch.tensor([[0.001], [0.1], [0.5], [0.99]])
    z64 = mep(x, pos, 2.0)
    z32 = mep(x.float(), pos, 2.0)
    torch.testing.assert_close(z32.double(), z64, rtol=0, atol=2e-5)


# ----------------------------------------------------------------------------- margin_gap


@given(prob=problems(rows=4))
def test_margin_gap_bruteforce(prob):
    x, pos, _ = prob
    got = margin_gap(torch.tensor(x), torch.tensor(pos)).numpy()
    for r in range(len(x)):
        if pos[r].all() or not pos[r].any():
            assert got[r] == math.inf
        else:
            pairs = x[r][pos[r]][:, None] - x[r][~pos[r]][None, :]
            assert got[r] == pairs.min()


def test_margin_gap_dtypes_and_grad():
    x = torch.tensor([[3.0, 1.0, 0.5], [0.0, 1.0, 2.0]], requires_grad=True)
    gap = margin_gap(x, torch.tensor([0, 2]))
    torch.testing.assert_close(gap, torch.tensor([2.0, 1.0]))
    gap.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[1.0, -1.0, 0.0], [0.0, -1.0, 1.0]]))
    half = margin_gap(x.detach().half(), torch.tensor([[True, False, False], [True, True, True]]))
    assert half.dtype == torch.float16 and half[1] == math.inf


# ----------------------------------------------------------------------------- autograd


def _rows_without_ties(gen, rows=3, n=7):
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    pos = torch.zeros(rows, n, dtype=torch.bool)
    pos[0, :2] = pos[1, 3] = True
    pos[2, 1:6] = True
    return x, pos


@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_gradcheck_scores_and_margin(gen, norm):
    x, pos = _rows_without_ties(gen)
    x.requires_grad_(True)
    margin = torch.tensor([0.7, 1.3, 0.9], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, mm: mep(s, pos, mm, norm), (x, margin))
    y = torch.tensor([2, 0, 5])
    assert torch.autograd.gradcheck(lambda s: mep(s, y, 1.1, norm), (x,))


def test_l2_jacobian_structure(gen):
    """On the current piece: identity on inactive entries; the active entries (positives below
    ℓ, negatives above ℓ − m) all move to ℓ (resp. ℓ − m), so their Jacobian rows are 1/|A|
    on the active set."""
    x = torch.randn(12, generator=gen, dtype=torch.float64)
    pos = torch.zeros(12, dtype=torch.bool)
    pos[[0, 4, 7]] = True
    m = 2.5
    z = mep(x, pos, m)
    level = z[pos].min()
    active = (pos & (x < level)) | (~pos & (x > level - m))
    assert 2 <= int(active.sum()) < 12
    jac = torch.autograd.functional.jacobian(lambda s: mep(s, pos, m), x)
    want = torch.diag((~active).double())
    want[active.nonzero()[:, 0].unsqueeze(1), active.nonzero()[:, 0]] = 1.0 / int(active.sum())
    torch.testing.assert_close(jac, want)


def test_feasible_rows_have_identity_gradient():
    x = torch.tensor([[5.0, 1.0, 0.0], [1.0, 0.9, 0.0]], requires_grad=True)
    z = mep(x, torch.tensor([0, 0]), 1.0)
    (z * torch.arange(1.0, 7.0).view(2, 3)).sum().backward()
    assert torch.equal(x.grad[0], torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_half_precision(gen, dtype, norm):
    x = (3 * torch.randn(16, 50, generator=gen)).to(dtype)
    pos = torch.rand(16, 50, generator=gen) < 0.2
    z = mep(x, pos, 1.0, norm)
    assert z.dtype == dtype
    # computed in float32 and rounded once at the end
    assert torch.equal(z, mep(x.float(), pos, 1.0, norm).to(dtype))
    gap = margin_gap(z.float(), pos)
    assert bool((gap >= 1.0 - 0.05).all())
    xr = x.clone().requires_grad_(True)
    mep(xr, pos, 1.0, norm).float().square().sum().backward()
    assert xr.grad.dtype == dtype and bool(torch.isfinite(xr.grad).all())


# ----------------------------------------------------------------------------- bad input


def test_bad_input_messages():
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3])
    cases = [
        (TypeError, "scores must be a floating", lambda: mep(torch.ones(4, 5, dtype=torch.long), y, 1.0)),
        (TypeError, "scores must be a torch.Tensor", lambda: mep([[1.0, 2.0]], torch.tensor(0), 1.0)),
        (ValueError, "scores must have a non-empty last", lambda: mep(torch.ones(4, 0), y, 1.0)),
        (ValueError, "scores must have at least 1", lambda: mep(torch.tensor(1.0), torch.tensor(0), 1.0)),
        (ValueError, "scores contains NaN", lambda: mep(x.clone().index_fill_(1, y[:1], math.nan), y, 1.0)),
        (ValueError, "scores contains NaN or inf", lambda: mep(x.clone().fill_(math.inf), y, 1.0)),
        (
            ValueError,
            "positives .bool mask. must have the shape",
            lambda: mep(x, torch.ones(4, 6).bool(), 1.0),
        ),
        (TypeError, "positives must be a bool mask", lambda: mep(x, torch.ones(4, 5), 1.0)),
        (
            TypeError,
            "a mask must have dtype torch.bool",
            lambda: mep(x, torch.ones(4, 5, dtype=torch.long), 1.0),
        ),
        (ValueError, "positives must have shape", lambda: mep(x, torch.tensor([0, 1, 2]), 1.0)),
        (ValueError, r"positives must lie in \[0, 5\)", lambda: mep(x, torch.tensor([0, 1, 2, 5]), 1.0)),
        (ValueError, r"positives must lie in \[0, 5\)", lambda: mep(x, torch.tensor([0, -1, 2, 3]), 1.0)),
        (TypeError, "positives must be a torch.Tensor", lambda: mep(x, [0, 1, 2, 3], 1.0)),
        (ValueError, "margin must be a finite number > 0", lambda: mep(x, y, 0.0)),
        (ValueError, "margin must be a finite number > 0", lambda: mep(x, y, -1.0)),
        (ValueError, "margin must be a finite number > 0", lambda: mep(x, y, math.nan)),
        (ValueError, "margin must be a finite number > 0", lambda: mep(x, y, math.inf)),
        (ValueError, "margin must be finite and > 0", lambda: mep(x, y, torch.tensor([1.0, 0.0, 1.0, 1.0]))),
        (ValueError, "margin must be finite and > 0", lambda: mep(x, y, torch.tensor(math.nan))),
        (ValueError, "margin 1e-50 is not a finite number > 0 in torch.float32", lambda: mep(x, y, 1e-50)),
        (ValueError, "margin tensor must be broadcastable", lambda: mep(x, y, torch.ones(5))),
        (TypeError, "margin must be a real number", lambda: mep(x, y, "1.0")),
        (TypeError, "margin must be a real number", lambda: mep(x, y, True)),
        (ValueError, "norm must be one of 'l1', 'l2'", lambda: mep(x, y, 1.0, norm="linf")),
        (ValueError, "scores contains NaN", lambda: margin_gap(x.clone().fill_(math.nan), y)),
        (ValueError, "positives must have shape", lambda: margin_gap(x, y[:2])),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
