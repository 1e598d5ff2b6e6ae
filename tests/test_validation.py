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
