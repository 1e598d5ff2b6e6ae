"""Retrieval metrics of Musgrave et al.: Precision@1, R-Precision, MAP@R, Recall@k."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from marginkit._validation import compute_dtype, positive_float, positive_int
from marginkit.knn._search import (
    check_embeddings,
    check_labels,
    check_metric,
    neg_sqnorms,
    plan_chunks,
    prepare,
    topk_keys,
)

_METRIC_BYTES_PER_CELL = 48  # labels gather, relevance, cumsum, precision terms per [query, rank]


def _relevant_counts(query_labels: torch.Tensor, reference_labels: torch.Tensor) -> torch.Tensor:
    """Number of references sharing each query's label (``R``), without a loop over classes."""
    classes, counts = torch.unique(reference_labels, return_counts=True)
    pos = torch.searchsorted(classes, query_labels).clamp_max(classes.numel() - 1)
    return torch.where(classes[pos] == query_labels, counts[pos], 0)


def retrieval_metrics(
    query: torch.Tensor,
    query_labels: torch.Tensor,
    reference: torch.Tensor | None = None,
    reference_labels: torch.Tensor | None = None,
    metric: str = "cosine",
    ks: Sequence[int] = (1, 5, 10),
    *,
    memory_limit_mb: float = 512.0,
) -> dict[str, object]:
    r"""Precision@1, R-Precision, MAP@R and Recall@k of nearest-neighbour retrieval.

    For each query, references are ranked by cosine similarity (decreasing) or Euclidean
    distance (increasing), equal values by increasing reference index. With ``R`` the number
    of references sharing the query's label and ``rel(i)`` whether rank ``i`` shares it
    (Musgrave, Belongie, Lim, "A Metric Learning Reality Check", ECCV 2020):

    .. math::
        \text{P@1} = rel(1),\qquad
        \text{R-Precision} = \frac{1}{R}\sum_{i \le R} rel(i),\qquad
        \text{MAP@R} = \frac{1}{R}\sum_{i \le R} P(i)\,rel(i),\quad
        P(i) = \frac{1}{i}\sum_{j \le i} rel(j),

    and ``recall_at_k[k]`` the hit rate: the fraction of queries with a relevant reference
    among their ``k`` nearest. Each is averaged over the queries with ``R >= 1``; queries
    whose label has no reference are left out (as pytorch-metric-learning's
    ``AccuracyCalculator`` does) and counted in ``num_queries_without_relevant``.

    When ``reference`` is None the queries are the references and each query is excluded
    from its own ranking *by index* (a duplicate of it elsewhere still counts), so
    ``R = count(label) - 1``. The search is exact, chunked (``memory_limit_mb`` bounds the
    score-matrix chunks) and stops at ``max(max R, max ks)`` neighbours.

    Args:
        query: ``[Q, D]`` query embeddings (any float dtype; computed in float32 or float64).
        query_labels: ``[Q]`` integer labels.
        reference, reference_labels: ``[N, D]`` and ``[N]``, both or neither.
        metric: ``"cosine"`` or ``"l2"``.
        ks: cut-offs of ``recall_at_k``; each must be at most the number of references
            available to a query.
        memory_limit_mb: budget of the search's temporaries.

    Returns:
        ``{"precision_at_1", "r_precision", "map_at_r": float, "recall_at_k": {k: float},
        "num_queries": int, "num_queries_without_relevant": int}``.

    Example:
        >>> import torch
        >>> e = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> m = retrieval_metrics(e, torch.tensor([0, 0, 1, 1]), ks=(1,))
        >>> m["precision_at_1"], m["map_at_r"]
        (1.0, 1.0)
    """
    check_embeddings(query, "query")
    check_labels(query_labels, "query_labels", query.shape[0], "query")
    metric = check_metric(metric)
    limit = int(positive_float(memory_limit_mb, "memory_limit_mb") * 2**20)
    ks = tuple(positive_int(k, "ks") for k in ks)
    if not ks:
        raise ValueError("ks must contain at least one cut-off")
    if (reference is None) != (reference_labels is None):
        raise ValueError("reference and reference_labels must be given together (or both None)")
    self_offset: int | None = None
    if reference is None:
        reference, reference_labels, self_offset = query, query_labels, 0
    else:
        check_embeddings(reference, "reference")
        check_labels(reference_labels, "reference_labels", reference.shape[0], "reference")
        if reference.shape[1] != query.shape[1]:
            raise ValueError(
                f"reference has dimension {reference.shape[1]} but query has dimension {query.shape[1]}"
            )
    assert reference_labels is not None
    device = reference.device
    available = reference.shape[0] - int(self_offset is not None)
    if max(ks) > available:
        raise ValueError(f"ks must be <= the {available} references available to each query, got {max(ks)}")

    dtype = torch.promote_types(compute_dtype(query.dtype), compute_dtype(reference.dtype))
    refs = prepare(reference, metric, "reference", dtype)
    ref_bias = neg_sqnorms(refs) if metric == "l2" else None
    ref_labels = reference_labels.to(device)
    q_labels_all = query_labels.to(device)
    r_all = _relevant_counts(q_labels_all, ref_labels) - int(self_offset is not None)
    valid_all = r_all > 0
    num_valid = int(valid_all.sum())
    if num_valid == 0:
        raise ValueError(
            "no query has a relevant reference (a reference sharing its label, other than itself)"
        )
    depth = min(available, max(int(r_all.max()), max(ks)))

    # Query chunks: half of the budget for the search, half for the [chunk, depth] metric terms.
    rows = max(1, min(query.shape[0], (limit // 2) // (depth * _METRIC_BYTES_PER_CELL)))
    plan = plan_chunks(rows, refs.shape[0], refs.shape[1], depth, refs.element_size(), limit // 2)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    hits = torch.zeros(len(ks), dtype=torch.float64, device=device)
    ranks = torch.arange(1, depth + 1, device=device)
    for s in range(0, query.shape[0], rows):
        _, idx, _ = topk_keys(
            query[s : s + rows],
            refs,
            depth,
            metric=metric,
            memory_limit_bytes=limit // 2,
            ref_neg_sqnorms=ref_bias,
            self_offset=None if self_offset is None else s,
            plan=plan,
        )
        valid = valid_all[s : s + rows]
        rel = ref_labels[idx[valid]] == q_labels_all[s : s + rows][valid, None]
        r = r_all[s : s + rows][valid].to(torch.float64)
        within_r = ranks[None, :] <= r[:, None]
        rel_r = rel & within_r
        precision_at_i = rel_r.cumsum(dim=1).to(torch.float64) / ranks
        totals[0] += rel[:, 0].sum()
        totals[1] += (rel_r.sum(dim=1) / r).sum()
        totals[2] += ((precision_at_i * rel_r).sum(dim=1) / r).sum()
        for j, k in enumerate(ks):
            hits[j] += rel[:, :k].any(dim=1).sum()
    totals, hits = (totals / num_valid).tolist(), (hits / num_valid).tolist()
    return {
        "precision_at_1": totals[0],
        "r_precision": totals[1],
        "map_at_r": totals[2],
        "recall_at_k": dict(zip(ks, hits, strict=True)),
        "num_queries": num_valid,
        "num_queries_without_relevant": query.shape[0] - num_valid,
    }
