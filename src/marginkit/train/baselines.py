"""Baselines scored beside the losses, by the same evaluation, so that a comparison shows at once
whether learning helped.

- closed set (test classes = training classes): ``raw_1nn`` — the inputs themselves, 1-NN with
  Euclidean distance (the classical baseline), scored by :func:`~marginkit.train.evaluate.evaluate_model`
  with ``k = 1`` and ``knn_metric = l2``; ``logistic`` — an L2-regularised logistic regression on
  the inputs (scikit-learn, ``C = 1``), whose test accuracy is its ``head_accuracy``;
- open set (test classes never trained on): ``raw`` — the inputs, L2-normalised (cosine scores);
  ``pca_whitened`` — whitened PCA fitted on the training split only (Eigenfaces: Turk & Pentland,
  "Eigenfaces for Recognition", J. Cognitive Neuroscience 1991; whitening divides each component by
  its standard deviation), L2-normalised. Both go through the run's own evaluation: leave-one-out
  K-NN, retrieval and verification within the test classes, with the run's ``k``, metric and
  ``--protocol``.
- audio (``audio:`` sources, open set): ``pretrained_ge2e`` — a speaker encoder a team may already
  have, Resemblyzer's pretrained GE2E LSTM (:mod:`marginkit.audio.ge2e`), scored by the run's own
  evaluation; raw waveforms are no baseline. It needs the weights file (an installed
  ``Resemblyzer``, e.g. ``pip install --no-deps resemblyzer``, or ``$MARGINKIT_GE2E_WEIGHTS``);
  without it, or for a source not at 16 kHz, there is no baseline row and a warning says why.

Nothing is fitted on validation or test data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from marginkit.train.config import TrainConfig

__all__ = ["BASELINES", "RawInputs", "WhitenedPCA", "evaluate_baselines", "fit_whitened_pca"]

#: name -> what it is (the comparison report's note)
BASELINES = {
    "raw_1nn": "the raw inputs, 1-NN with Euclidean distance",
    "logistic": "logistic regression on the raw inputs (scikit-learn, C = 1), as head_accuracy",
    "raw": "the raw inputs, L2-normalised (cosine scores)",
    "pca_whitened": "whitened PCA (Eigenfaces) fitted on the training split, L2-normalised",
    "pretrained_ge2e": "Resemblyzer's pretrained GE2E speaker encoder (not trained here)",
}
#: Components of the whitened-PCA baseline (fewer when the training split has fewer samples).
PCA_COMPONENTS = 50


class RawInputs(nn.Module):
    """The inputs flattened to ``[N, D]`` (L2-normalised with ``normalize``): an "embedding model"
    that learned nothing."""

    def __init__(self, normalize: bool = True) -> None:
        super().__init__()
        self.normalize = normalize

    def extra_repr(self) -> str:
        return f"normalize={self.normalize}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1).float()
        return F.normalize(flat, dim=1) if self.normalize else flat


class WhitenedPCA(nn.Module):
    r"""``normalize(((x - μ) V) / σ)``: projection on the leading principal axes ``V`` of the
    training inputs, each divided by its standard deviation ``σ``, then L2-normalised."""

    def __init__(self, mean: torch.Tensor, components: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean.float())
        self.register_buffer("components", components.float())
        self.register_buffer("std", std.float())

    def extra_repr(self) -> str:
        return f"components={self.components.shape[1]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x.flatten(1).float() - self.mean) @ self.components / self.std
        return F.normalize(z, dim=1)


def fit_whitened_pca(x: torch.Tensor, components: int = PCA_COMPONENTS) -> WhitenedPCA:
    """Fit :class:`WhitenedPCA` on ``x`` ``[N, ...]`` in float64: ``min(components, rank)``
    components, those with a standard deviation above ``1e-9`` of the largest."""
    flat = x.flatten(1).double()
    n, d = flat.shape
    if n < 2:
        raise ValueError(f"whitened PCA needs at least 2 training samples, got {n}")
    mean = flat.mean(0)
    centred = flat - mean
    if d <= n:  # eigenvectors of the D x D covariance
        values, vectors = torch.linalg.eigh(centred.T @ centred / (n - 1))
        values, vectors = values.flip(0), vectors.flip(1)
    else:  # through the N x N Gram matrix (few samples of many pixels: faces)
        values, u = torch.linalg.eigh(centred @ centred.T / (n - 1))
        values, u = values.flip(0), u.flip(1)
        vectors = centred.T @ u / torch.sqrt(values.clamp_min(1e-300) * (n - 1))
    std = values.clamp_min(0).sqrt()
    keep = min(components, int((std > 1e-9 * std[0]).sum()))
    return WhitenedPCA(mean, vectors[:, :keep], std[:keep])


def _logistic(splits: Any) -> dict[str, Any]:
    from sklearn.linear_model import LogisticRegression

    train, test = splits.train.x.flatten(1).double().numpy(), splits.test.x.flatten(1).double().numpy()
    model = LogisticRegression(C=1.0, max_iter=2000).fit(train, splits.train.y.numpy())
    accuracy = float((torch.from_numpy(model.predict(test)) == splits.test.y).double().mean())
    return {"head_accuracy": accuracy, "num_train": len(splits.train), "num_test": len(splits.test)}


def evaluate_baselines(
    splits: Any, config: TrainConfig, *, protocol: Any = None
) -> dict[str, dict[str, Any]]:
    """The baselines of ``splits`` (closed- or open-set, see the module doc): ``{name: metrics}``,
    the metrics as :func:`~marginkit.train.evaluate.evaluate_model` writes them for a run."""
    from marginkit.train.evaluate import _jsonable, evaluate_model

    if getattr(splits, "kind", None) == "audio":
        return _audio_baselines(splits, config, protocol)
    if splits.open_set:
        pca = fit_whitened_pca(splits.train.x)
        models = {"raw": (RawInputs(), config), "pca_whitened": (pca, config)}
    else:
        models = {"raw_1nn": (RawInputs(normalize=False), dataclasses.replace(config, k=1, knn_metric="l2"))}
    out: dict[str, dict[str, Any]] = {}
    for name, (model, cfg) in models.items():
        metrics, _, _ = evaluate_model(model, None, splits, cfg, "cpu", protocol=protocol)
        out[name] = _jsonable(metrics)
    if splits.open_set:
        out["pca_whitened"]["pca_components"] = int(pca.components.shape[1])
    else:
        out["logistic"] = _logistic(splits)
    for name, metrics in out.items():
        metrics["baseline"] = name
    return out


def _audio_baselines(splits: Any, config: TrainConfig, protocol: Any) -> dict[str, dict[str, Any]]:
    import warnings

    from marginkit.audio.ge2e import SAMPLE_RATE, WEIGHTS_ENV, GE2EEncoder, find_weights
    from marginkit.train.evaluate import _jsonable, evaluate_model

    weights = find_weights()
    rate = getattr(splits.test.data, "sample_rate", None)
    if weights is None or rate != SAMPLE_RATE:
        why = (
            f"Resemblyzer's weights not found (pip install --no-deps resemblyzer, or set {WEIGHTS_ENV})"
            if weights is None
            else f"the source's rate is {rate} Hz, the encoder's {SAMPLE_RATE} Hz"
        )
        warnings.warn(f"no pretrained_ge2e baseline: {why}", UserWarning, stacklevel=3)
        return {}
    metrics, _, _ = evaluate_model(GE2EEncoder(weights), None, splits, config, "cpu", protocol=protocol)
    out = _jsonable(metrics)
    out.update(baseline="pretrained_ge2e", weights=str(weights))
    return {"pretrained_ge2e": out}
