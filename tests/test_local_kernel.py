"""The local-margin triplet's compiled selection (marginkit.ops._local_kernel): the torch reference's
bits (ties, NaN with payloads, +inf, ±0, rows without a positive or a negative), through the loss's
value and gradient too — and the reference wherever the kernel does not run."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marginkit.losses import LocalMarginTripletLoss
from marginkit.mining import local_triplets
from marginkit.mining.triplets import _local_select
from marginkit.ops import selection

pytest.importorskip("numba", reason="the compiled selection needs numba (pip install marginkit[fast])")

NAN_PAYLOADS = (0x7FC00000, 0x7FC00001, 0x7FA00000, 0xFFC00000, 0x7F800001)  # (quiet, signalling, signed)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def reference_select(*args):
    selection.FAST_CPU = False
    try:
        return _local_select(*args)
    finally:
        selection.FAST_CPU = True


def assert_same(fast, ref):
    assert fast is not None
    for name, f, r in zip(("p_idx", "n_idx", "d_pos", "d_neg", "has_pos", "has_neg"), fast, ref, strict=True):
        assert f.dtype == r.dtype and f.shape == r.shape, name
        assert torch.equal(bits(f), bits(r)), (name, f, r)


@st.composite
def selections(draw):
    self_ref = draw(st.booleans())
    rows = draw(st.integers(1, 12))
    width = rows if self_ref else draw(st.integers(1, 40))
    kind = draw(st.sampled_from(["grid", "uniform", "special"]))
    n = rows * width
    if kind == "grid":  # ties everywhere, both zeros
        d = torch.tensor(
            draw(st.lists(st.sampled_from([0.0, -0.0, 0.25, 0.5, 1.0, 2.0]), min_size=n, max_size=n))
        )
    elif kind == "uniform":
        d = torch.tensor(draw(st.lists(st.floats(0, 4, width=32), min_size=n, max_size=n)))
    else:  # +inf, and NaNs of several payloads and signs
        codes = draw(st.lists(st.integers(0, len(NAN_PAYLOADS) + 3), min_size=n, max_size=n))
        values = []
        for c in codes:
            if c < len(NAN_PAYLOADS):
                values.append(torch.tensor(NAN_PAYLOADS[c] - (1 << 32 if NAN_PAYLOADS[c] >> 31 else 0)).int())
            else:
                values.append(
                    torch.tensor([0.5, 1.0, float("inf"), 0.0][c - len(NAN_PAYLOADS)]).view(torch.int32)
                )
        d = torch.stack(values).view(torch.float32)
    classes = draw(st.integers(1, 5))
    labels = torch.tensor(draw(st.lists(st.integers(0, classes - 1), min_size=rows, max_size=rows)))
    ref_labels = (
        labels
        if self_ref
        else torch.tensor(draw(st.lists(st.integers(0, classes), min_size=width, max_size=width)))
    )
    k = draw(st.sampled_from([1, 2, 3, 5, 8, 64]))
    return d.reshape(rows, width).float(), labels, ref_labels, self_ref, k


@settings(max_examples=400, deadline=None)
@given(case=selections())
def test_the_kernel_gives_the_reference_bits(case):
    d, labels, ref_labels, self_ref, k = case
    fast = selection.local_select(d, labels, ref_labels, self_ref, k)
    assert torch.equal(bits(d), bits(case[0]))  # read, not written
    assert_same(fast, reference_select(d.clone(), labels, ref_labels, self_ref, k))


@pytest.mark.parametrize("self_ref", [True, False])
@pytest.mark.parametrize("k", [1, 5, 64])
def test_realistic_batches_and_int32_labels(self_ref, k):
    g = torch.Generator().manual_seed(k)
    x = torch.nn.functional.normalize(torch.randn(300, 64, generator=g), dim=1)
    y = x if self_ref else torch.nn.functional.normalize(torch.randn(700, 64, generator=g), dim=1)
    d = torch.cdist(x, y) ** 2
    labels = torch.randint(0, 40, (300,), generator=g, dtype=torch.int32)
    ref_labels = labels if self_ref else torch.randint(0, 40, (700,), generator=g, dtype=torch.int32)
    fast = selection.local_select(d, labels, ref_labels, self_ref, k)
    assert_same(fast, reference_select(d.clone(), labels, ref_labels, self_ref, k))


def test_the_loss_and_the_miner_are_unchanged(monkeypatch):
    g = torch.Generator().manual_seed(1)
    emb, labels = torch.randn(96, 16, generator=g), torch.randint(0, 12, (96,), generator=g)
    emb[3] = emb[5]  # a tie
    bank, bank_labels = torch.randn(50, 16, generator=g), torch.randint(0, 12, (50,), generator=g)

    def run():
        out = []
        for ref in ((), (bank, bank_labels)):
            x = emb.clone().requires_grad_(True)
            loss = LocalMarginTripletLoss(k=3)(x, labels, *ref)
            loss.backward()
            out += [bits(loss.detach()), bits(x.grad)]
        out += list(local_triplets(emb, labels, 3, 0.2))
        return out

    calls = []
    original = selection.LOCAL_KERNEL.run
    monkeypatch.setattr(selection.LOCAL_KERNEL, "run", lambda *a: calls.append(1) or original(*a))
    fast = run()
    assert len(calls) == 3  # (the kernel ran: the test is not vacuous)
    monkeypatch.setattr(selection, "FAST_CPU", False)
    for f, r in zip(fast, run(), strict=True):
        assert torch.equal(f, r)


@pytest.mark.parametrize(
    "why",
    ["float64", "k above 64", "gradient", "switched off"],
)
def test_elsewhere_the_reference_runs(monkeypatch, why):
    d = torch.rand(6, 6)
    labels, k = torch.tensor([0, 0, 1, 1, 2, 2]), 2
    if why == "float64":
        d = d.double()
    elif why == "k above 64":
        k = 65
    elif why == "gradient":
        d.requires_grad_(True)
    else:
        monkeypatch.setattr(selection, "FAST_CPU", False)
    assert selection.local_select(d, labels, labels, True, k) is None


def test_without_numba_or_with_a_broken_one_the_reference_runs(monkeypatch):
    from numba.core.errors import TypingError

    d, labels = torch.rand(8, 8), torch.tensor([0, 1] * 4)
    expected = reference_select(d.clone(), labels, labels, True, 3)
    monkeypatch.setattr(selection.LOCAL_KERNEL, "loaded", False)
    assert selection.local_select(d, labels, labels, True, 3) is None
    assert_same(_local_select(d.clone(), labels, labels, True, 3), expected)

    def broken(*args):
        raise TypingError("no implementation")

    monkeypatch.setattr(selection.LOCAL_KERNEL, "loaded", SimpleNamespace(local_select=broken))
    with pytest.warns(RuntimeWarning, match="compiled selection is unavailable .*no implementation"):
        assert_same(_local_select(d.clone(), labels, labels, True, 3), expected)
    assert selection.LOCAL_KERNEL.get() is None  # said once: the reference from now on
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(_local_select(d.clone(), labels, labels, True, 3), expected)


def test_under_torch_compile_the_reference_runs():
    """Dynamo cannot trace into numba's dispatcher: while it traces, the torch path runs (the same
    bits; the kernel once broke ``torch.compile`` of a function that calls the loss)."""
    g = torch.Generator().manual_seed(2)
    emb, labels = torch.randn(40, 8, generator=g), torch.randint(0, 5, (40,), generator=g)
    loss = LocalMarginTripletLoss(k=3)
    compiled = torch.compile(lambda x, y: loss(x, y), backend="eager")
    x1, x2 = emb.clone().requires_grad_(True), emb.clone().requires_grad_(True)
    value = compiled(x1, labels)
    value.backward()
    expected = loss(x2, labels)
    expected.backward()
    assert torch.equal(bits(value.detach()), bits(expected.detach()))
    assert torch.equal(bits(x1.grad), bits(x2.grad))
