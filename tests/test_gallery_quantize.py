"""marginkit.gallery.quantize: the error bounds of float16 and per-vector int8 storage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marginkit.gallery.quantize import dequantize, quantize, scores, search


@given(
    rows=st.integers(1, 6),
    dim=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    spread=st.floats(1e-3, 1e3),
)
def test_int8_error_is_at_most_half_a_step_per_coordinate(rows, dim, seed, spread):
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * spread
    codes, scale = quantize(x, "int8")
    assert codes.dtype == torch.int8 and scale.shape == (rows,) and int(codes.abs().max()) <= 127
    # the largest coordinate of each row is coded exactly at +-127
    assert bool((codes.abs().amax(dim=1) == 127).all())
    err = (dequantize(codes, scale).double() - x).abs()
    assert bool((err <= scale.double()[:, None] / 2 * (1 + 1e-5) + 1e-12).all())


def test_float16_and_zero_rows_and_refusals():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 0.25]])
    codes, scale = quantize(x, "int8")
    assert codes[0].tolist() == [0, 0, 0] and float(scale[0]) == 1.0  # an all-zero row stays zero
    half, none = quantize(x, "float16")
    assert half.dtype == torch.float16 and none is None
    torch.testing.assert_close(dequantize(half, None), x)
    with pytest.raises(ValueError, match="dtype must be one of"):
        quantize(x, "int4")


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_chunked_scores_equal_a_plain_product_and_keep_the_nearest(dtype):
    gen = torch.Generator().manual_seed(0)
    refs = torch.randn(1000, 64, generator=gen)
    refs = refs / refs.norm(dim=1, keepdim=True)
    probes = refs[:200] + 0.3 * torch.randn(200, 64, generator=gen)
    codes, scale = quantize(refs, dtype)
    got = scores(probes, codes, scale, chunk=97)
    torch.testing.assert_close(got, probes @ dequantize(codes, scale).T, rtol=1e-5, atol=1e-5)
    exact = probes @ refs.T
    assert float((got - exact).abs().max()) < {"float32": 1e-5, "float16": 5e-3, "int8": 5e-2}[dtype]
    agree = (got.argmax(1) == exact.argmax(1)).float().mean()
    assert float(agree) >= 0.99


@given(
    rows=st.integers(1, 60),
    queries=st.integers(1, 5),
    k=st.integers(1, 60),
    chunk=st.integers(1, 17),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(["float32", "float16", "int8"]),
)
def test_search_is_a_stable_sort_of_the_scores(rows, queries, k, chunk, levels, seed, dtype):
    # Few distinct values (duplicated templates): ties everywhere, also at the k-th place.
    gen = torch.Generator().manual_seed(seed)
    refs = torch.randint(-levels, levels + 1, (rows, 3), generator=gen).float()
    probes = torch.randint(-levels, levels + 1, (queries, 3), generator=gen).float()
    codes, scale = quantize(refs, dtype)
    k = min(k, rows)
    values, indices = search(probes, codes, scale, k, chunk=chunk)
    full = scores(probes, codes, scale, chunk=chunk)
    want_v, want_i = torch.sort(full, dim=1, descending=True, stable=True)
    assert torch.equal(indices, want_i[:, :k])
    assert torch.equal(values, want_v[:, :k])


def test_search_refuses_k_outside_the_rows():
    codes, scale = quantize(torch.eye(3), "int8")
    with pytest.raises(ValueError, match=r"k must be in 1\.\.3"):
        search(torch.ones(1, 3), codes, scale, 4)
