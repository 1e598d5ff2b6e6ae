"""K-NN classification metrics: accuracy of a K-NN vote and per-class recall."""

from __future__ import annotations

import numpy as np
import torch

from marginkit._validation import accepts_arrays, label_tensor, positive_float, positive_int
from marginkit.knn._search import check_embeddings, check_metric, exact_search, prepare
from marginkit.knn.classifier import KNNClassifier, vote_winners
from marginkit.knn.labels import Classes, check_label_values


@accepts_arrays(pred="int", target="int")
def per_class_recall(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    r"""Recall of each class, ``#{pred = c, target = c} / #{target = c}`` (float64 ``[C]``).

    A class absent from ``target`` has no recall: its entry is NaN (by definition, not by
    accident; scikit-learn's ``recall_score(..., average=None, zero_division=np.nan)``
    agrees). ``nanmean`` of the result is the balanced accuracy.

    Example:
        >>> import torch
        >>> per_class_recall(torch.tensor([0, 1, 1, 2]), torch.tensor([0, 1, 2, 2]), 4).tolist()
        [1.0, 1.0, 0.5, nan]
    """
    num_classes = positive_int(num_classes, "num_classes")
    label_tensor(target, "target", num_classes=num_classes)
    label_tensor(pred, "pred", shape=target.shape, num_classes=num_classes)
    target = target.reshape(-1)
    pred = pred.reshape(-1).to(target.device)
    support = torch.bincount(target, minlength=num_classes).to(torch.float64)
    correct = torch.bincount(target[pred == target], minlength=num_classes).to(torch.float64)
    return torch.where(support > 0, correct / support.clamp_min(1), torch.nan)


@accepts_arrays(query="float", query_labels="labels", reference="float", reference_labels="labels")
def knn_accuracy(
    query: torch.Tensor,
    query_labels: torch.Tensor,
    reference: torch.Tensor | None = None,
    reference_labels: torch.Tensor | None = None,
    *,
    k: int = 5,
    metric: str = "cosine",
    weights: str = "uniform",
    backend: str = "exact",
    memory_limit_mb: float = 512.0,
) -> float:
    """Accuracy of a K-NN classifier fitted on the references, evaluated on the queries.

    Convenience around :class:`~marginkit.knn.KNNClassifier` (same voting and tie-breaking).
    With ``reference=None`` it is leave-one-out on the queries: each query is classified by
    the other queries, excluded from its own neighbours *by index* (exact backend).

    Example:
        >>> import torch
        >>> e = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> knn_accuracy(e, torch.tensor([0, 0, 1, 1]), k=1)
        1.0
    """
    if (reference is None) != (reference_labels is None):
        raise ValueError("reference and reference_labels must be given together (or both None)")
    if reference is not None:
        clf = KNNClassifier(k, metric, weights, backend, memory_limit_mb=memory_limit_mb)
        clf.fit(reference, reference_labels)  # type: ignore[arg-type]
        return clf.score(query, query_labels)

    check_embeddings(query, "query")
    values = check_label_values(query_labels, "query_labels", query.shape[0], "query")
    metric = check_metric(metric)
    KNNClassifier(k, metric, weights, backend)  # validates k, weights and backend
    if backend != "exact":
        raise ValueError("leave-one-out (reference=None) needs backend='exact'")
    if k > query.shape[0] - 1:
        raise ValueError(f"k={k} exceeds the {query.shape[0] - 1} other queries available (leave-one-out)")
    refs = prepare(query.detach(), metric, "query")
    limit = int(positive_float(memory_limit_mb, "memory_limit_mb") * 2**20)
    scores, idx = exact_search(
        query.detach(), refs, k, metric=metric, memory_limit_bytes=limit, self_offset=0
    )
    # labels are identifiers: votes run on their codes (positions among the distinct labels)
    classes, _ = Classes(np.zeros(0)).merged(values, "query_labels")
    labels = classes.encode(values, "query_labels")[0].to(refs.device)
    winners = vote_winners(
        scores, labels[idx], metric=metric, weights=weights, num_classes=len(classes),
        memory_limit_bytes=limit,
    )  # fmt: skip
    return float((winners == labels).to(torch.float64).mean())
