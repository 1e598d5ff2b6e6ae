"""Bad batches that every pair loss (``loss(embeddings, labels, ref_embeddings, ref_labels)``) must refuse."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch


def assert_batch_errors(loss: torch.nn.Module, emb: torch.Tensor, labels: torch.Tensor) -> None:
    """Wrong shapes and dtypes, NaN in either side, a half-given reference set, missing labels."""
    with pytest.raises(ValueError, match="labels must have shape"):
        loss(emb, labels[:4])
    with pytest.raises(TypeError, match="labels must be an integer"):
        loss(emb, labels.double())
    with pytest.raises(ValueError, match="embeddings must be 2-D"):
        loss(emb[0], labels[:1])
    bad = emb.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        loss(bad, labels)
    with pytest.raises(ValueError, match="NaN"):
        loss(emb, labels, bad, labels)
    with pytest.raises(ValueError, match="ref_embeddings was given without ref_labels"):
        loss(emb, labels, emb.clone())
    with pytest.raises(ValueError, match="embedding dimension"):
        loss(emb, labels, emb[:, :2], labels)
    with pytest.raises(ValueError, match="labels must be given"):
        loss(emb)


def assert_warns_once(make: Callable[[], torch.nn.Module], emb: torch.Tensor) -> torch.nn.Module:
    """A batch without a positive pair and a collapsed batch each warn once per instance."""
    loss = make()
    with pytest.warns(RuntimeWarning, match="no positive pair"):
        loss(emb, torch.arange(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss(emb, torch.arange(6))
        make()(emb, torch.tensor([0, 0, 1, 1, 2, 2]))  # healthy batch: silent
    with pytest.warns(RuntimeWarning, match="collapsed"):
        loss(emb[:1].expand(6, -1).clone(), torch.tensor([0, 0, 1, 1, 2, 2]))
    return loss
