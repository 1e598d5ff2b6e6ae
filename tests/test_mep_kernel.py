"""The compiled MEP L2 kernel (marginkit.ops._mep_kernel): the torch reference's bits, or a row left
to the sorting path — never a different value."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marginkit.ops import mep, projection, selection

pytest.importorskip("numba", reason="the compiled kernel needs numba (pip install marginkit[fast])")
from marginkit.ops import _mep_kernel  # (after the skip)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def reference(*args, **kwargs) -> torch.Tensor:
    """The torch path (the fast path off)."""
    selection.FAST_CPU = False
    try:
        return mep(*args, **kwargs)
    finally:
        selection.FAST_CPU = True


def kernel_rows(
    x: torch.Tensor, positives: torch.Tensor, margin, norm: str = "l2"
) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's own output and its rows left to the sorting path."""
    n = x.shape[-1]
    mask = labels = None
    if positives.dtype == torch.bool:
        mask = positives.numpy().reshape(-1, n)
    else:
        labels = positives.numpy().reshape(-1, 1)
    m = margin.numpy().reshape(-1, 1).astype(np.float32) if isinstance(margin, torch.Tensor) else margin
    if norm == "l1":
        return _mep_kernel.project_l1_mask(x.numpy().reshape(-1, n), mask, m)
    return _mep_kernel.project_l2(x.numpy().reshape(-1, n), mask, labels, m)


@st.composite
def problems(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(2, 40))
    kind = draw(st.sampled_from(["grid", "moderate", "wide"]))
    if kind == "grid":  # ties within and across classes, both zeros
        value = st.sampled_from([-2.0, -1.0, -0.5, -0.0, 0.0, 0.25, 0.5, 1.0, 1.5, 3.0])
    elif kind == "moderate":  # the kernel's rows: magnitudes within a few powers of two
        value = st.floats(-64, 64, width=32).filter(lambda v: v == 0 or abs(v) > 1e-3)
    else:  # spreads beyond the exact sums' bound: rows left to the sorting path
        value = st.floats(-1e6, 1e6, width=32)
    x = torch.tensor(draw(st.lists(value, min_size=rows * cols, max_size=rows * cols)), dtype=torch.float32)
    if draw(st.booleans()):
        positives = torch.tensor(draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols)))
        positives = positives.reshape(rows, cols)
    else:
        positives = torch.tensor(draw(st.lists(st.integers(0, cols - 1), min_size=rows, max_size=rows)))
    if draw(st.booleans()):
        margin = draw(st.sampled_from([0.25, 0.5, 1.0]) if kind == "grid" else st.floats(1e-3, 10.0))
    else:
        per_row = st.lists(st.floats(0.0009765625, 10.0, width=32), min_size=rows, max_size=rows)
        margin = torch.tensor(draw(per_row), dtype=torch.float32)
    return x.reshape(rows, cols), positives, margin


@settings(max_examples=300, deadline=None)
@given(prob=problems(), norm=st.sampled_from(["l2", "l1"]))
def test_the_kernel_gives_the_reference_bits(prob, norm):
    x, positives, margin = prob
    ref = reference(x, positives, margin, norm)
    assert torch.equal(bits(mep(x, positives, margin, norm)), bits(ref))
    if norm == "l1" and positives.dtype != torch.bool:
        return  # (L1 with labels needs no sort: a top-2, no kernel)
    z, redo = kernel_rows(x, positives, margin, norm)
    assert np.array_equal(z[~redo].view(np.int32), ref.numpy()[~redo].view(np.int32))


@pytest.mark.parametrize("family", ["scores", "cosines", "ties", "dominant"])
@pytest.mark.parametrize(("one_hot", "norm"), [(False, "l2"), (True, "l2"), (False, "l1")])
def test_the_kernel_projects_nearly_every_row_itself(family, one_hot, norm):
    """Not a vacuous test: the rows of realistic batches are the kernel's (exact sums), not the
    sorting path's."""
    g = torch.Generator().manual_seed(3)
    rows, n = 256, 1000
    x = {
        "scores": 3 * torch.randn(rows, n, generator=g),
        "cosines": 30 * (torch.rand(rows, n, generator=g) * 1.6 - 0.8),
        "ties": torch.round(4 * torch.randn(rows, n, generator=g)) / 4,
        "dominant": torch.randn(rows, n, generator=g),
    }[family]
    if one_hot:
        positives = torch.randint(0, n, (rows,), generator=g)
        if family == "dominant":
            x[torch.arange(rows), positives] += 4.0
    else:
        positives = torch.rand(rows, n, generator=g) < 0.1
        if family == "dominant":
            x[positives] += 2.0
    z, redo = kernel_rows(x, positives, 0.5, norm)
    assert redo.mean() < 0.02, redo.sum()
    ref = reference(x, positives, 0.5, norm).numpy()
    assert np.array_equal(z[~redo].view(np.int32), ref[~redo].view(np.int32))
    assert torch.equal(bits(mep(x, positives, 0.5, norm)), bits(torch.from_numpy(ref)))


def test_rows_the_kernel_cannot_vouch_for_take_the_sorting_path():
    """A NaN, an infinity, magnitudes too far apart for exact float64 sums: such rows are flagged,
    and ``mep`` gives them the sorting path's bits; the others stay the kernel's."""
    g = torch.Generator().manual_seed(5)
    x = 3 * torch.randn(6, 200, generator=g)
    mask = torch.rand(6, 200, generator=g) < 0.2
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    x[3, 11], mask[3, 11] = 1e-9, True  # a positive's breakpoint ~2^-33 times the row's largest
    mask[4] = False  # no positive: copied
    _, redo = kernel_rows(x, mask, 1.0)
    assert redo.tolist() == [False, True, True, True, False, False]
    _, redo = kernel_rows(x, mask, 1.0, "l1")  # (L1 sums nothing: the spread is no matter)
    assert redo.tolist() == [False, True, True, False, False, False]
    for norm in ("l2", "l1"):
        fast = mep(x, mask, 1.0, norm, validate=False)
        assert torch.equal(bits(fast), bits(reference(x, mask, 1.0, norm, validate=False)))
        assert torch.equal(fast[4], x[4])


def test_without_numba_the_numpy_path_gives_the_same_bits(monkeypatch):
    g = torch.Generator().manual_seed(6)
    x = 3 * torch.randn(32, 300, generator=g)
    mask = torch.rand(32, 300, generator=g) < 0.1
    with_kernel = mep(x, mask, 1.0)
    monkeypatch.setattr(projection.KERNEL, "loaded", False)
    called = []
    original = projection._project_numpy
    monkeypatch.setattr(projection, "_project_numpy", lambda *a, **k: called.append(1) or original(*a, **k))
    assert torch.equal(bits(mep(x, mask, 1.0)), bits(with_kernel))
    assert called == [1]  # the numpy path, once (no kernel, no rows left over)


def test_a_kernel_numba_cannot_compile_falls_back_with_a_warning(monkeypatch):
    from numba.core.errors import TypingError

    def broken(*args):
        raise TypingError("no implementation")

    g = torch.Generator().manual_seed(7)
    x, labels = 3 * torch.randn(8, 50, generator=g), torch.randint(0, 50, (8,), generator=g)
    expected = reference(x, labels, 1.0)
    monkeypatch.setattr(projection.KERNEL, "loaded", SimpleNamespace(project_l2=broken))
    with pytest.warns(RuntimeWarning, match="compiled kernel is unavailable .*no implementation"):
        assert torch.equal(bits(mep(x, labels, 1.0)), bits(expected))
    assert projection.KERNEL.get() is None  # said once: the numpy path from now on


def test_other_errors_of_the_kernel_call_are_not_swallowed(monkeypatch):
    def failing(*args):
        raise ValueError("a bug")

    monkeypatch.setattr(projection.KERNEL, "loaded", SimpleNamespace(project_l2=failing))
    with pytest.raises(ValueError, match="a bug"):
        mep(torch.randn(2, 5), torch.tensor([0, 1]), 1.0)


def test_labels_out_of_range_without_validation_fail_as_without_the_kernel(monkeypatch):
    """The compiled loop does not check indices: such rows go to the numpy path, which fails as
    it did before (validate=False skips the clear check)."""
    x, labels = torch.randn(4, 10), torch.tensor([1, 10, -1, 3])

    def outcome():
        try:
            return bits(mep(x, labels, 1.0, validate=False))
        except Exception as error:  # (compared below, not swallowed)
            return type(error)

    with_kernel = outcome()
    monkeypatch.setattr(projection, "COMPILED", False)
    without = outcome()
    assert isinstance(with_kernel, type) and with_kernel is without, (with_kernel, without)
    _, redo = _mep_kernel.project_l2(x.numpy(), None, labels.numpy().reshape(-1, 1), 1.0)
    assert redo[1] and redo[2]


def test_under_torch_compile_the_reference_runs():
    """Dynamo cannot trace into numba's dispatcher, nor the numpy path's uint32 keys (a mask): while
    it traces, the torch path runs, with the same bits (both once broke ``torch.compile`` of a
    function that calls ``mep`` on the CPU)."""
    g = torch.Generator().manual_seed(8)
    x, labels = 3 * torch.randn(16, 50, generator=g), torch.randint(0, 50, (16,), generator=g)
    mask = torch.rand(16, 50, generator=g) < 0.2
    for positives in (labels, mask):
        compiled = torch.compile(lambda x, p: mep(x, p, 1.0), backend="eager")
        assert torch.equal(bits(compiled(x, positives)), bits(mep(x, positives, 1.0)))
