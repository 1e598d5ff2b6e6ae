"""Clustering quality of embeddings: NMI and AMI of a k-means clustering (scikit-learn).

As pytorch-metric-learning's ``AccuracyCalculator``: k-means with as many clusters as there
are distinct labels, then the normalised / adjusted mutual information between the labels
and the cluster assignment (Vinh, Epps, Bailey, "Information Theoretic Measures for
Clusterings Comparison", JMLR 2010). scikit-learn (``pip install 'marginkit[cli]'``) runs
both the clustering and the scores; it is imported on first use only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from marginkit._validation import accepts_arrays, positive_int
from marginkit.knn._search import check_embeddings, check_labels, check_metric, prepare

__all__ = ["clustering_metrics"]


def _sklearn() -> Any:
    try:
        import sklearn.cluster
        import sklearn.metrics
    except ImportError as err:  # pragma: no cover - scikit-learn ships with the cli/test extras
        raise ImportError(
            "nmi/ami need scikit-learn, which is not installed: pip install 'marginkit[cli]'"
        ) from err
    return sklearn


@accepts_arrays(embeddings="float", labels="int")
def clustering_metrics(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    metric: str = "cosine",
    *,
    seed: int = 0,
    n_init: int = 10,
) -> dict[str, Any]:
    """NMI and AMI between ``labels`` and a k-means clustering of ``embeddings``.

    The embeddings are L2-normalised first for ``metric="cosine"`` (k-means on the unit
    sphere's chords, the geometry the cosine ranks by) and used as they are for ``"l2"``.
    k-means: scikit-learn's ``KMeans(n_clusters=#labels, n_init=n_init, random_state=seed)``;
    scores: ``normalized_mutual_info_score`` (arithmetic normalisation) and
    ``adjusted_mutual_info_score``.

    Args:
        embeddings: ``[N, D]`` float tensor.
        labels: ``[N]`` integer labels; their number of distinct values is the ``k`` of k-means.
        metric: ``"cosine"`` or ``"l2"``.
        seed: k-means seed (the result is deterministic for a given seed).
        n_init: k-means restarts (the best inertia is kept).

    Returns:
        ``{"nmi": float, "ami": float, "num_clusters": int}``.

    Example:
        >>> import torch
        >>> e = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> clustering_metrics(e, torch.tensor([0, 0, 1, 1]))["nmi"]
        1.0
    """
    check_embeddings(embeddings, "embeddings")
    check_labels(labels, "labels", embeddings.shape[0], "embeddings")
    metric = check_metric(metric)
    n_init = positive_int(n_init, "n_init")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    y = labels.detach().cpu().numpy()
    num_clusters = int(np.unique(y).size)
    if num_clusters < 2 or num_clusters >= embeddings.shape[0]:
        raise ValueError(
            f"labels must have between 2 and {embeddings.shape[0] - 1} distinct values (one fewer than the "
            f"number of embeddings) for a clustering score, got {num_clusters}"
        )
    sk = _sklearn()
    x = prepare(embeddings.detach(), metric, "embeddings", torch.float64).cpu().numpy()
    assignment = sk.cluster.KMeans(n_clusters=num_clusters, n_init=n_init, random_state=seed).fit_predict(x)
    return {
        "nmi": float(sk.metrics.normalized_mutual_info_score(y, assignment)),
        "ami": float(sk.metrics.adjusted_mutual_info_score(y, assignment)),
        "num_clusters": num_clusters,
    }
