"""The CPU fast path of marginkit.ops.selection and its users: bit-identical to the torch reference.

Reference: ``torch.sort(..., stable=True)``, and each op with the fast path switched off
(``selection.FAST_CPU = False``), which runs the device-agnostic torch code on the CPU.
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch_counts import DispatchCounter
from marginkit import _validation
from marginkit.ops import mep, projection, selection

POOL = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, math.inf, -math.inf, math.nan, -math.nan, 1e-40, -3e38]


@pytest.fixture(autouse=True, scope="module")
def _numpy_path():
    """These tests are the numpy path's: MEP's compiled kernel (tests/test_mep_kernel.py) is off."""
    projection.COMPILED = False
    yield
    projection.COMPILED = True


def bits(t: torch.Tensor) -> torch.Tensor:
    """The IEEE patterns: equality of these is bit-identity (signed zeros, NaN payloads)."""
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


@st.composite
def matrices(draw, special: bool = True, max_rows: int = 4, max_cols: int = 24):
    rows, cols = draw(st.integers(1, max_rows)), draw(st.integers(1, max_cols))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    width = 32 if dtype == torch.float32 else 64
    value = st.floats(width=width, allow_nan=special, allow_infinity=special)
    if special:
        value = st.one_of(st.sampled_from(POOL), value)
    data = draw(st.lists(value, min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(data, dtype=dtype).reshape(rows, cols)


def reference(f, *args, **kwargs):
    """``f(*args, **kwargs)`` with the fast path switched off (the device-agnostic torch code)."""
    selection.FAST_CPU = False
    try:
        return f(*args, **kwargs)
    finally:
        selection.FAST_CPU = True


@settings(max_examples=150, deadline=None)
@given(x=matrices(), descending=st.booleans())
def test_sorts_equal_torch_stable_sort_bitwise(x, descending):
    ref = torch.sort(x, dim=-1, descending=descending, stable=True)
    assert torch.equal(bits(selection.sort_values(x, descending=descending)), bits(ref.values))
    values, indices = selection.stable_sort(x, descending=descending)
    assert torch.equal(indices, ref.indices)
    assert torch.equal(bits(values), bits(ref.values))


def test_sorts_many_ties_and_leading_dims():
    g = torch.Generator().manual_seed(0)
    x = torch.tensor(POOL)[torch.randint(0, len(POOL), (3, 5, 300), generator=g)]
    for descending in (False, True):
        ref = torch.sort(x, dim=-1, descending=descending, stable=True)
        values, indices = selection.stable_sort(x, descending=descending)
        assert torch.equal(indices, ref.indices) and torch.equal(bits(values), bits(ref.values))
        assert torch.equal(bits(selection.sort_values(x, descending=descending)), bits(ref.values))


@settings(max_examples=150, deadline=None)
@given(x=matrices(), data=st.data())
def test_values_at_ranks_equal_the_stable_sort_bitwise(x, data):
    """One order statistic per row (np.sort and a pick; zero and NaN picks from the stable runs)
    has the bits of the stable sort's value at that rank, and the NaN flag is the row's."""
    a = x.numpy()
    index = np.array(
        data.draw(st.lists(st.integers(0, a.shape[1] - 1), min_size=a.shape[0], max_size=a.shape[0]))
    )
    index = index.reshape(-1, 1)
    ref = torch.sort(x, dim=-1, stable=True).values.gather(-1, torch.from_numpy(index))
    for work in (None, np.empty_like(a)):
        picked, nan = selection.values_at_ranks(a, index, work=work)
        assert torch.equal(bits(torch.from_numpy(picked)), bits(ref))
        assert np.array_equal(nan, np.isnan(a).any(-1, keepdims=True))


def test_fast_path_only_where_it_applies():
    x = torch.randn(3, 4)
    assert selection.fast_path(x)
    assert not selection.fast_path(x.half())
    assert not selection.fast_path(torch.randn(3, 4, requires_grad=True))
    with torch.no_grad():
        assert selection.fast_path(torch.randn(3, 4, requires_grad=True))
    assert not selection.fast_path(torch.empty(0, 4))


def test_histogram_bins_are_ordered_disjoint_intervals():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        a = torch.cat([torch.randn(5000, generator=g) * 10, torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
        a = a.to(dtype).numpy()
        codes, counts, order = selection.histogram(a, bits=12)
        assert counts.sum() == a.size
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        r = rank[codes]
        srt = np.argsort(a, kind="stable")
        assert np.all(np.diff(r[srt]) >= 0)  # ascending values never go to a lower bin
        assert np.array_equal(np.bincount(r, minlength=order.size), counts)
        assert r[-4] == r[-3]  # -0.0 and +0.0 share a bin


# ------------------------------------------------------------------------------------------- MEP
@st.composite
def mep_problems(draw):
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(2, 20))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    grid = draw(st.booleans())  # a coarse grid: many ties, across classes too
    if grid:
        value = st.sampled_from([-2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 1.5, 3.0])
    else:
        value = st.floats(-1e6, 1e6, width=32 if dtype == torch.float32 else 64)
    x = torch.tensor(draw(st.lists(value, min_size=rows * cols, max_size=rows * cols)), dtype=dtype)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols)))
    labels = torch.tensor(draw(st.lists(st.integers(0, cols - 1), min_size=rows, max_size=rows)))
    margin = draw(st.sampled_from([0.5, 1.0]) if grid else st.floats(1e-3, 10.0))
    return x.reshape(rows, cols), mask.reshape(rows, cols), labels, margin


@settings(max_examples=120, deadline=None)
@given(prob=mep_problems(), norm=st.sampled_from(["l2", "l1"]), one_hot=st.booleans())
def test_mep_fast_path_equals_reference_bitwise(prob, norm, one_hot):
    x, mask, labels, m = prob
    positives = labels if one_hot else mask
    fast = mep(x, positives, m, norm)
    ref = reference(mep, x, positives, m, norm)
    assert torch.equal(bits(fast), bits(ref))


@settings(max_examples=60, deadline=None)
@given(prob=mep_problems(), norm=st.sampled_from(["l2", "l1"]), one_hot=st.booleans())
def test_mep_differentiable_path_gives_the_same_values(prob, norm, one_hot):
    """With a gradient, the level goes through gathers and the ties through ``where`` (identity
    Jacobian): the values are those of the no-gradient paths, bit for bit."""
    x, mask, labels, m = prob
    positives = labels if one_hot else mask
    xr = x.clone().requires_grad_(True)
    assert torch.equal(bits(mep(xr, positives, m, norm).detach()), bits(mep(x, positives, m, norm)))


def test_mep_mask_fast_path_branches_equal_reference(monkeypatch):
    """The mask path's shortcuts, each forced and compared with the torch path bit for bit: the L1
    clamp computed on some rows only (where fl(fl(level - m) + m) moves the level, a NaN, no
    negative), and the output's one-comparison select against the two-select form that rows with
    a zero level take."""
    from marginkit.ops import projection

    g = torch.Generator().manual_seed(8)
    x = torch.randn(200, 64, generator=g) * 3  # levels that fl(fl(l - m) + m) moves, in about 1 row in 7
    x[100:] = torch.round(x[100:] * 2) / 2  # ties across classes, zeros
    mask = torch.rand(200, 64, generator=g) < torch.linspace(0.1, 0.9, 200)[:, None]
    mask[0] = True  # no negative
    x[1, 3] = math.nan
    x[3:60] += 30 * mask[3:60]  # rows that keep the margin: the clamp returns max_N u
    m = torch.rand(200, generator=g) * 3 + 0.01
    # a feasible row whose level is a zero (the breakpoint of a negative at -m): the two-select form
    x[2], mask[2] = -3.0 - m[2], False
    x[2, 0], x[2, 1], mask[2, 0] = -0.0, -m[2], True
    calls = {"clamped rows": 0, "zero level": 0}
    clamp, select_in_place = projection._l1_clamp, projection._select_in_place

    def counting_clamp(level, unrounded, unsure, *rest):
        calls["clamped rows"] += int(
            ((level.view(rest[0].dtype) != unrounded.view(rest[0].dtype)) | unsure).sum()
        )
        return clamp(level, unrounded, unsure, *rest)

    def counting_select(*args, **kwargs):
        calls["zero level"] += 1
        return select_in_place(*args, **kwargs)

    monkeypatch.setattr(projection, "_l1_clamp", counting_clamp)
    monkeypatch.setattr(projection, "_select_in_place", counting_select)
    for rows in (slice(None), slice(3, 100)):  # with and without a zero level
        for norm in ("l1", "l2"):
            fast = mep(x[rows], mask[rows], m[rows], norm, validate=False)
            assert torch.equal(
                bits(fast), bits(reference(mep, x[rows], mask[rows], m[rows], norm, validate=False))
            )
    assert calls["clamped rows"] > 10 and calls["zero level"] == 2, calls


@pytest.mark.filterwarnings("error")
def test_mep_fast_path_non_finite_scores_without_validation():
    """``validate=False`` with ±inf and NaN scores: the numpy path propagates them as the torch path
    does, bit for bit, and warns no more than torch (numpy's floating-point warnings stay inside)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 50, generator=g) * 3
    x[0, 0], x[1, 1], x[2, 2], x[3, :5] = math.inf, -math.inf, math.nan, math.inf
    mask = torch.rand(6, 50, generator=g) < 0.2
    labels = torch.randint(0, 50, (6,), generator=g)
    for dtype in (torch.float32, torch.float64):
        for positives in (mask, labels):
            for norm in ("l1", "l2"):
                args = (x.to(dtype), positives, 1.0, norm)
                fast = mep(*args, validate=False)
                assert torch.equal(bits(fast), bits(reference(mep, *args, validate=False)))


def test_mep_fast_path_equals_reference_large_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 700, generator=g) * 3
    x[0, 0, :50] = torch.round(x[0, 0, :50])  # some ties
    mask = torch.rand(2, 3, 700, generator=g) < 0.1
    labels = torch.randint(0, 700, (2, 3), generator=g)
    margins = torch.rand(2, 3, generator=g) + 0.1
    for positives in (mask, labels):
        for norm in ("l2", "l1"):
            for dtype in (torch.float32, torch.float64):
                xd = x.to(dtype)
                fast = mep(xd, positives, margins, norm)
                assert torch.equal(bits(fast), bits(reference(mep, xd, positives, margins, norm)))


def test_mep_labels_l2_windows_equal_reference():
    """The labels' L2 level on the CPU sums the first 64 sorted columns, wider windows only for
    the rows that need them, and reads the descending order off an ascending sort unless a window
    holds a zero or a NaN: rows with every negative active (the whole row), signed zeros on the
    level's window, per-row margins, and a NaN row (``validate=False``) equal the torch path."""
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.float64):
        x = torch.round(torch.randn(6, 300, generator=g, dtype=dtype) * 4) / 2
        x[0] = 5.0  # every negative above the positive: K = n - 1, the window grows to the row
        x[0, 7] = 0.0
        x[1, :100] = 3.0 + torch.arange(100, dtype=dtype) / 64  # 100 active negatives
        x[2, torch.rand(300, generator=g) < 0.3] = -0.0
        labels = torch.tensor([7, 150, 3, 0, 299, 42])
        margins = torch.tensor([0.5, 1.0, 1.5, 0.5, 2.0, 1.0], dtype=dtype)
        x[2, :5] = -margins[2]  # breakpoints of exactly +0.0 beside the -0.0 scores
        for m in (margins, 1.0):
            assert torch.equal(bits(mep(x, labels, m)), bits(reference(mep, x, labels, m)))
        x[4, 10] = math.nan
        fast = mep(x, labels, margins, validate=False)
        assert torch.equal(bits(fast), bits(reference(mep, x, labels, margins, validate=False)))


@pytest.fixture
def sorted_rows(monkeypatch) -> list[int]:
    """The row counts of the labels' whole-row sorts (``_l2_level_labels_sorted``) in call order."""
    from marginkit.ops import projection

    calls: list[int] = []
    real = projection._l2_level_labels_sorted
    monkeypatch.setattr(
        projection, "_l2_level_labels_sorted", lambda b, *a: calls.append(len(b)) or real(b, *a)
    )
    return calls


def test_mep_labels_l2_candidates_equal_reference(monkeypatch, sorted_rows):
    """The labels' L2 level on the CPU sorts only the breakpoints above about (x_p + max_N u) / 2
    where the first failing comparison lies among them: random rows take that path; rows with
    every candidate active, a zero among the candidates or at the top, and feasible rows are
    handled as the module doc says; all equal the torch path bit for bit (float32 and float64,
    per-row margins), and a NaN anywhere sends the whole batch to the sorted path."""
    from marginkit.ops import projection

    monkeypatch.setattr(projection, "_CANDIDATE_MIN_COLUMNS", 64)  # (500 columns are sorted whole by default)
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):
        x = 3 * torch.randn(40, 500, generator=g, dtype=dtype)
        labels = torch.randint(0, 500, (40,), generator=g)
        x[0] = torch.linspace(-1, 1, 500, dtype=dtype)  # all negatives within the margin: all active
        x[0, labels[0]] = -2.0
        x[1, torch.arange(500) != labels[1]] = -0.0  # every breakpoint +margin; a zero at the top below
        x[1, labels[1]] = 9.0  # a feasible row
        x[2, labels[2]] = x[2].max() + 5  # feasible
        x[3, :3] = torch.tensor([-1.0, -1.0, -1.0], dtype=dtype)  # breakpoints of exactly +0.0 (m = 1)
        x[3, labels[3]] = -5.0
        x[4, labels[4]] = x[4].max()  # feasible by less than the margin: infeasible
        x[5] = -10.0  # at m = 1, zeros among the few candidates: the sorted path
        x[5, :4], x[5, 4], labels[5], x[5, 100] = -1.0, -0.5, 100, -3.0
        margins = 0.5 + torch.rand(40, generator=g, dtype=dtype)
        for m in (1.0, margins):
            sorted_rows.clear()
            fast = mep(x, labels, m)
            assert torch.equal(bits(fast), bits(reference(mep, x, labels, m)))
            assert (2 if isinstance(m, float) else 1) <= sorted_rows[0] < 10, sorted_rows  # most: candidates
        y = x.clone()
        y[7, 3] = math.nan
        sorted_rows.clear()
        fast = mep(y, labels, 1.0, validate=False)
        assert torch.equal(bits(fast), bits(reference(mep, y, labels, 1.0, validate=False)))
        assert sorted_rows == [40]


@given(
    st.integers(1, 6),
    st.integers(64, 300),
    st.floats(0.05, 4.0),
    st.sampled_from([0.5, 3.0]),
    st.integers(0, 2**32 - 1),
)
@settings(max_examples=40, deadline=None)
def test_mep_labels_l2_candidates_hypothesis(rows, n, margin, scale, seed):
    """The candidate selection (forced on these short rows) and the whole-row sort both give the
    torch path's bits."""
    from marginkit.ops import projection

    g = torch.Generator().manual_seed(seed)
    x = torch.round(scale * torch.randn(rows, n, generator=g) * 8) / 8  # ties and zeros
    labels = torch.randint(0, n, (rows,), generator=g)
    want = bits(reference(mep, x, labels, margin))
    for shortest in (64, projection._CANDIDATE_MIN_COLUMNS):
        with pytest.MonkeyPatch.context() as mp:  # (hypothesis: no function-scoped fixture)
            mp.setattr(projection, "_CANDIDATE_MIN_COLUMNS", shortest)
            assert torch.equal(bits(mep(x, labels, margin)), want), shortest


def test_mep_labels_l2_short_rows_are_sorted_whole(sorted_rows):
    """Below ``_CANDIDATE_MIN_COLUMNS`` columns every row takes the whole-row sort (cheaper there);
    from it on, most random rows take the candidate selection. Both equal the torch path."""
    from marginkit.ops import projection

    g = torch.Generator().manual_seed(5)
    shortest = projection._CANDIDATE_MIN_COLUMNS
    for n, expect_all in ((shortest - 1, True), (shortest, False)):
        x = 3 * torch.randn(32, n, generator=g)
        labels = torch.randint(0, n, (32,), generator=g)
        sorted_rows.clear()
        assert torch.equal(bits(mep(x, labels, 1.0)), bits(reference(mep, x, labels, 1.0)))
        assert (sorted_rows == [32]) if expect_all else (sum(sorted_rows) < 16), (n, sorted_rows)


def test_mep_fast_path_odd_inputs_equal_reference():
    """Under ``no_grad`` with inputs that require a gradient, a non-contiguous view, half
    precision, float64 margins per row: the numpy path still equals the torch path bit for bit."""
    g = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(9, 40, generator=g)).requires_grad_(True)
    mask = torch.rand(9, 40, generator=g) < 0.2
    labels = torch.randint(0, 40, (9,), generator=g)
    margins = (torch.rand(9, generator=g, dtype=torch.float64) + 0.1).requires_grad_(True)
    with torch.no_grad():
        for scores in (x, x.t().contiguous().t(), x.half()):
            for positives in (mask, labels):
                for norm in ("l2", "l1"):
                    for m in (margins, 0.7):
                        fast = mep(scores, positives, m, norm)
                        ref = reference(mep, scores, positives, m, norm)
                        assert not fast.requires_grad and fast.dtype == scores.dtype
                        assert torch.equal(fast, ref) and torch.equal(torch.signbit(fast), torch.signbit(ref))


def test_mep_dispatch_counts():
    """The device-agnostic path (numpy off) on 256 x 1000 float32: no device read with
    ``validate=False``, a fixed number of aten ops whatever the data (feasible rows, ties), and
    L2 in 25 ops with labels (issue 36's bound), 34 with a mask (L1: 16 / 20; before issue 36's
    work 49 / 50, 22 / 24).

    Labels, L2 (25): the breakpoints (unsqueeze, add, gather, scatter of -inf at the positive),
    one stable descending sort of the negatives' breakpoints, the candidate levels (x_p + S_k) /
    (k + 2) from float64 prefix sums (cumsum, add, arange, div), the first failing comparison
    (gt, slice, _to_copy, argmin), the level (gather), t = fl(level - m) and level = fl(t + m)
    (sub, _to_copy, add: every output row exactly feasible), the clamp into [x_p, max_N u] that
    returns feasible rows bit-identical (slice, fmax, fmin), and the output (le, where, lt, where,
    scatter).

    Mask, L2 (34; the tightest exact sequence found): the breakpoints (add, where), one stable
    sort, the signs in sorted order (gather), the signed values (neg, where), their float64 prefix
    sums plus sum_N u (masked_fill, cumsum, sum, add), the exact integer active counts (cumsum,
    arange, slice, sub, add), the candidate levels and the bracket (div, lt, slice, sum, gather),
    t and level as above (sub, _to_copy, add), the clamp into [min_P u, max_N u] (masked_fill,
    amax, where, amin, fmax, fmin), and the output (lt, where, le, where, where). What each
    cheaper variant breaks: without the float64 sums and integer counts the level is no longer
    the exact root in the working precision; without the clamp a feasible row's level is max_N u
    only up to the rounding of the prefix sums, so its top negative could move by an ulp; clamp
    instead of fmax / fmin propagates the 0 / 0 level a feasible row can have; clamp / maximum
    instead of the output's where return +0.0 for a -0.0 positive tied with the level (and which
    zero depends on the SIMD lane).
    """
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(256, 1000, generator=g)
    mask = torch.rand(256, 1000, generator=g) < 0.1
    labels = torch.randint(0, 1000, (256,), generator=g)
    lifted = torch.where(mask, x + 30, x)  # with the mask, every row keeps the margin
    tied = torch.round(x)  # ties within and across classes
    bounds = {
        ("l2", torch.bool): 34,
        ("l2", torch.int64): 25,
        ("l1", torch.bool): 20,
        ("l1", torch.int64): 16,
    }
    selection.FAST_CPU = False
    try:
        for positives in (mask, labels):
            for norm in ("l2", "l1"):
                counts = set()
                for scores in (x, lifted, tied):
                    with DispatchCounter() as c:
                        mep(scores, positives, 1.0, norm, validate=False)
                    assert c.reads == 0, c.read_names
                    counts.add(c.ops)
                assert counts == {bounds[norm, positives.dtype]}, (norm, positives.dtype, counts, c.by_name)
                # validated: the reads of the checks only (a device's: on the CPU the finiteness
                # check reads the tensor through numpy, which no dispatch mode sees)
                with mock.patch.object(_validation, "_numpy_values", lambda x: None), DispatchCounter() as c:
                    mep(x, positives, 1.0, norm)
                assert 1 <= c.reads <= 2
    finally:
        selection.FAST_CPU = True


def test_mep_validate_false_keeps_type_checks():
    with pytest.raises(TypeError, match="positives"):
        mep(torch.randn(2, 3), torch.randn(2, 3), 1.0, validate=False)
    with pytest.raises(ValueError, match="scores"):
        mep(torch.tensor([[math.nan, 1.0]]), torch.tensor([0]), 1.0)


# --------------------------------------------------------------------------------------- metrics
def without_bins_kernel(f, *args, **kwargs):
    """``f`` with the histogram's numpy path (no compiled kernel, as without numba)."""
    saved, selection.BINS_KERNEL.loaded = selection.BINS_KERNEL.loaded, False
    try:
        return f(*args, **kwargs)
    finally:
        selection.BINS_KERNEL.loaded = saved


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_compiled_histogram_counts_and_takes_as_numpy(dtype):
    pytest.importorskip("numba", reason="the compiled histogram needs numba")
    rng = np.random.default_rng(4)
    special = np.array([0.0, -0.0, 1e-40, -1e-40, 5e-324, 3e38, -3e38, 1.0, np.nextafter(1.0, 2.0)])
    a = np.concatenate([rng.normal(0, 3, 5000), special.astype(dtype)]).astype(dtype)
    flags = rng.random(a.size) < 0.2
    fast = selection.flagged_histogram(a, flags)
    slow = without_bins_kernel(selection.flagged_histogram, a, flags)
    assert fast[0] is None and slow[0] is not None  # (the kernel ran: the test is not vacuous)
    for f, s_ in zip(fast[1:], slow[1:], strict=True):
        assert np.array_equal(f, s_)
    counts, order = fast[1], fast[3]
    for r in (int(np.argmax(counts)), int(np.flatnonzero(counts)[0]), int(np.flatnonzero(counts)[-1])):
        for other in (r, int(np.flatnonzero(counts)[1])):
            wanted, size = (order[r], order[other]), int(counts[r] + (counts[other] if other != r else 0))
            got = selection.take_bins(a, flags, None, wanted, size)
            ref = selection.take_bins(a, flags, slow[0], wanted, size)
            assert all(
                np.array_equal(g.view(np.uint8), e.view(np.uint8)) for g, e in zip(got, ref, strict=True)
            )


@st.composite
def trials(draw):
    n = draw(st.integers(2, 60))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    kind = draw(st.sampled_from(["grid", "close", "wide"]))
    if kind == "grid":  # ties within and across the classes
        value = st.sampled_from([-1.0, -0.0, 0.0, 0.25, 0.5, 0.75, 1.0])
    elif kind == "close":  # neighbouring floats: one histogram bin holds them all
        base = 1.0 if dtype == torch.float64 else float(np.float32(1.0))
        value = st.integers(0, 6).map(lambda k: base + k * 2.0**-40 if dtype == torch.float64 else base)
        value = st.one_of(value, st.sampled_from([1.0, 1.0000001, 1.0000002, 1.0000005]))
    else:
        value = st.floats(-(2.0**100), 2.0**100, width=32 if dtype == torch.float32 else 64)
    s = torch.tensor(draw(st.lists(value, min_size=n, max_size=n)), dtype=dtype)
    y = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    y[0], y[1] = True, False
    return s, y


@settings(max_examples=200, deadline=None)
@given(t=trials(), far=st.sampled_from([1e-3, 0.05, 0.1, 0.25, 0.5, 0.9]))
def test_eer_and_tar_at_far_by_histogram_equal_the_sorted_path(t, far):
    from marginkit.metrics import _roc
    from marginkit.metrics.verification import eer, tar_at_far, verification_metrics

    s, y = t
    fast = eer(s, y)
    assert fast == without_bins_kernel(eer, s, y)  # (the compiled histogram and numpy's agree)
    assert fast == reference(eer, s, y)  # the sorted path (torch.sort)
    assert fast == _roc.eer(*_roc.sides(s, y))  # the sorted path (numpy sort)
    tar, threshold = tar_at_far(s, y, far)
    ref = reference(verification_metrics, s, y, fars=(far,))
    assert tar == ref["tar_at_far"][far] and threshold == ref["thresholds"][far]
    assert (tar, threshold) == reference(tar_at_far, s, y, far)
    assert (tar, threshold) == without_bins_kernel(tar_at_far, s, y, far)


def test_eer_and_tar_of_many_scores_equal_the_sorted_path():
    from marginkit.metrics import _roc
    from marginkit.metrics.verification import eer, tar_at_far

    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64):
        y = torch.rand(200_000, generator=g) < 0.01
        s = (torch.randn(200_000, generator=g, dtype=torch.float64) + 2.5 * y).to(dtype)
        s[:1000] = torch.round(s[:1000] * 4) / 4  # ties
        sides = _roc.sides(s, y)
        assert eer(s, y) == _roc.eer(*sides) == without_bins_kernel(eer, s, y)
        for far in (1e-5, 1e-3, 0.01, 0.3):
            thresholds, tars = _roc.rates_at_targets(*sides, (far,))
            assert tar_at_far(s, y, far) == (tars[far], thresholds[far])
            assert without_bins_kernel(tar_at_far, s, y, far) == (tars[far], thresholds[far])
    assert tar_at_far(s, y, 1e-7) == (None, None)


@settings(max_examples=100, deadline=None)
@given(x=matrices(), k=st.integers(1, 30), block=st.integers(1, 3))
def test_topk_stable_equals_the_stable_sort_cut(x, k, block):
    ref = torch.sort(x, dim=-1, descending=True, stable=True)
    values, indices = selection.topk_stable(x, k, block_rows=block)
    assert torch.equal(indices, ref.indices[:, :k])
    assert torch.equal(bits(values), bits(ref.values[:, :k]))


def test_knn_and_local_triplet_fast_path_equal_reference():
    from marginkit.knn._search import _ordered_topk
    from marginkit.losses import LocalMarginTripletLoss

    g = torch.Generator().manual_seed(7)
    s = torch.round(torch.randn(40, 300, generator=g) * 3) / 3  # many ties across the cut
    for k in (1, 5, 17, 300):
        fast = _ordered_topk(s, k, tie_rows=7)
        ref = reference(_ordered_topk, s, k, 7)
        assert torch.equal(fast[1], ref[1]) and torch.equal(bits(fast[0]), bits(ref[0]))
    emb = torch.round(torch.randn(64, 8, generator=g) * 2) / 2  # tied distances
    labels = torch.arange(64) % 5
    for k in (1, 3, 20):
        loss = LocalMarginTripletLoss(k=k)
        x1, x2 = emb.clone().requires_grad_(), emb.clone().requires_grad_()
        v1 = loss(x1, labels)
        v1.backward()
        v2 = reference(loss, x2, labels)
        v2.backward()
        assert torch.equal(v1, v2) and torch.equal(x1.grad, x2.grad)


@settings(max_examples=100, deadline=None)
@given(x=matrices(), data=st.data())
def test_sort_with_flags_equals_the_stable_sort_and_gather(x, data):
    x = x.float()
    flags = torch.tensor(data.draw(st.lists(st.booleans(), min_size=x.numel(), max_size=x.numel())))
    flags = flags.reshape(x.shape)
    ref = torch.sort(x, dim=-1, stable=True)
    values, moved = selection.sort_with_flags(x, flags)
    assert torch.equal(bits(torch.from_numpy(values)), bits(ref.values))
    assert torch.equal(torch.from_numpy(moved), flags.gather(-1, ref.indices))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kth_smallest_column_with_nan_and_zeros(dtype):
    x = torch.tensor([[1.0, math.nan, -0.0, 0.0, math.inf, math.nan, -1.0]], dtype=dtype)
    ref = torch.sort(x, dim=-1, stable=True).indices[0]
    for i in range(x.shape[1]):
        assert int(selection.kth_smallest_column(x, torch.tensor([i]), x.shape[1])) == int(ref[i])


@settings(max_examples=150, deadline=None)
@given(x=matrices(), data=st.data())
def test_kth_smallest_column_equals_the_stable_sort(x, data):
    ref = torch.sort(x, dim=-1, stable=True).indices
    bound = data.draw(st.integers(1, x.shape[1]))
    index = torch.tensor([data.draw(st.integers(0, bound - 1)) for _ in range(x.shape[0])])
    want = ref.gather(-1, index[:, None]).squeeze(-1)
    assert torch.equal(selection.kth_smallest_column(x, index, bound), want)
    assert torch.equal(
        selection.kth_smallest_column(x.float(), index, bound),
        torch.sort(x.float(), dim=-1, stable=True).indices.gather(-1, index[:, None]).squeeze(-1),
    )


@settings(max_examples=100, deadline=None)
@given(x=matrices(), descending=st.booleans())
def test_packed_column_keys_order_is_the_stable_sort(x, descending):
    # distinct keys whose ascending order is the stable sort's order, NaN / ±0 / ties included
    x = x.float()
    keys = selection.packed_column_keys(x, descending=descending)
    ordered = keys.sort(dim=-1).values
    assert (ordered[:, 1:] > ordered[:, :-1]).all()  # distinct (a diff would overflow int64)
    want = torch.sort(x, dim=-1, descending=descending, stable=True).indices
    assert torch.equal(keys.argsort(dim=-1), want)


def test_packed_column_keys_refuses_float64():
    with pytest.raises(ValueError, match="float32"):
        selection.packed_column_keys(torch.zeros(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("k", [1, 7, 500, 1999, 2000, 3000])
def test_topk_stable_float64_ties_in_column_order(k):
    # few distinct values (±0 among them): the cut falls inside a run of equal values, which must
    # contribute its first columns
    g = torch.Generator().manual_seed(k)
    pool = torch.tensor([-0.0, 0.0, 1.5, -2.25, 1e-300], dtype=torch.float64)
    x = pool[torch.randint(0, len(pool), (40, 2000), generator=g)]
    ref = torch.sort(x, dim=-1, descending=True, stable=True)
    values, indices = selection.topk_stable(x, k, block_rows=16)
    assert torch.equal(indices, ref.indices[:, :k])
    assert torch.equal(bits(values), bits(ref.values[:, :k]))
