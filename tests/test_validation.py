import math

import pytest
import torch

from marginkit import _validation as v


def test_float_tensor_rejects_ints_nans_and_empty():
    with pytest.raises(TypeError, match="x must be a floating-point"):
        v.float_tensor(torch.ones(3, dtype=torch.int64), "x")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        v.float_tensor([1.0], "x")
    with pytest.raises(ValueError, match="x contains NaN"):
        v.float_tensor(torch.tensor([1.0, math.nan]), "x")
    with pytest.raises(ValueError, match="non-empty last dimension"):
        v.float_tensor(torch.ones(2, 0), "x")
    v.float_tensor(torch.tensor([1.0, -math.inf]), "x", allow_inf=True)
    with pytest.raises(ValueError, match=r"\+inf"):
        v.float_tensor(torch.tensor([1.0, math.inf]), "x", allow_inf=True)


def test_label_tensor_checks_dtype_shape_range():
    with pytest.raises(TypeError, match="labels must be an integer"):
        v.label_tensor(torch.ones(3), "labels")
    with pytest.raises(ValueError, match="labels must have shape"):
        v.label_tensor(torch.zeros(3, dtype=torch.long), "labels", shape=(4,))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        v.label_tensor(torch.tensor([0, 3]), "labels", num_classes=3)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_positive_float_rejects(bad):
    with pytest.raises(ValueError, match="margin must be a finite number"):
        v.positive_float(bad, "margin")


def test_reduce_weighted_mean_ignores_masked_rows():
    loss = torch.tensor([1.0, 100.0, 3.0])
    w = torch.tensor([1.0, 0.0, 1.0])
    assert v.reduce(loss, "mean", w).item() == 2.0
    assert v.reduce(loss, "sum", w).item() == 4.0
    assert v.reduce(torch.zeros(0), "mean").item() == 0.0
    with pytest.raises(ValueError, match="reduction"):
        v.reduce(loss, "avg")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_cosine_tensor_one_pass_check(dtype):
    ok = torch.tensor([[-1.0005, 0.3, 1.0004]], dtype=dtype)  # round-off within atol passes
    assert v.cosine_tensor(ok, "cos") is ok
    assert v.cosine_tensor(torch.empty(0, 3, dtype=dtype), "cos").shape == (0, 3)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="cos contains NaN or infinite values"):
            v.cosine_tensor(torch.tensor([[0.1, bad, 0.2]], dtype=dtype), "cos")
    with pytest.raises(ValueError, match=r"cos must be cosines in \[-1, 1\].*up to 1.5"):
        v.cosine_tensor(torch.tensor([[0.1, -1.5, 0.2]], dtype=dtype), "cos")
    with pytest.raises(ValueError, match=r"up to 2"):
        v.cosine_tensor(torch.tensor([0.1, 2.0], dtype=dtype), "cos")
    with pytest.raises(TypeError, match="cos must be a floating-point"):
        v.cosine_tensor(torch.ones(3, dtype=torch.int64), "cos")


def test_cosine_tensor_accepts_tensors_that_require_grad(recwarn):
    x = torch.rand(4, 5, requires_grad=True)
    v.cosine_tensor(x * 2 - 1, "cos")
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("allow_inf", [False, True])
def test_float_tensor_numpy_and_torch_checks_agree(monkeypatch, dtype, allow_inf):
    """A library call on the CPU checks finiteness with numpy (float32 / float64); the torch check
    (devices, deferred checks) must give the same verdict and message, on strided and grad inputs."""

    def verdict(x):
        try:
            v.float_tensor(x, "scores", allow_inf=allow_inf)
        except ValueError as error:
            return str(error)
        return None

    base = torch.arange(24, dtype=dtype).reshape(4, 6) / 7
    cases = [base, base[:, ::2], base.clone().requires_grad_(True)]
    for bad in (math.nan, math.inf, -math.inf):
        x = base.clone()
        x[2, 3] = bad
        cases += [x, x[:, 1::2], x.t()]
    numpy_side = [verdict(x) for x in cases]
    assert any(numpy_side) and not all(numpy_side)
    if dtype != torch.float16:
        assert v._numpy_values(base) is not None  # (the numpy check ran: the test is not vacuous)
    monkeypatch.setattr(v, "_numpy_values", lambda x: None)
    assert [verdict(x) for x in cases] == numpy_side
