"""Retrieval metrics of pytorch-metric-learning's ``AccuracyCalculator`` (Musgrave et al. 2020).

Precision@1, R-Precision, MAP@R, full MAP (or MAP@k), MRR, Precision@k and Recall@k from
one exact chunked search, per query, then averaged over the queries, over the classes
(``avg_of_avgs``) or reported per class; NMI and AMI of a k-means clustering of the queries
(:mod:`marginkit.metrics.clustering`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from marginkit._validation import accepts_arrays, compute_dtype, label_tensor, positive_float, positive_int
from marginkit.knn._search import (
    check_embeddings,
    check_labels,
    check_metric,
    neg_sqnorms,
    plan_chunks,
    prepare,
    search_keys,
    topk_keys,
)

__all__ = ["CLUSTERING_METRICS", "RANKING_METRICS", "retrieval_metrics"]

#: Metrics from the ranking of the references, in the order of the result dict.
RANKING_METRICS = (
    "precision_at_1",
    "r_precision",
    "map_at_r",
    "mean_average_precision",
    "mrr",
    "precision_at_k",
    "recall_at_k",
)
#: Metrics of a k-means clustering of the queries (scikit-learn).
CLUSTERING_METRICS = ("nmi", "ami")

_METRIC_BYTES_PER_CELL = 48  # labels gather, relevance, cumsum, precision terms per [query, rank]


def _match_counts(reference_keys: torch.Tensor, query_keys: torch.Tensor) -> torch.Tensor:
    """For each query key (a scalar, or a row of ``[Q, m]``), how many reference keys equal it."""
    both = torch.cat([reference_keys.long(), query_keys.long()])
    _, inverse = torch.unique(both, dim=0 if both.dim() > 1 else None, return_inverse=True)
    n = reference_keys.shape[0]
    counts = torch.bincount(inverse[:n], minlength=int(inverse.max()) + 1 if inverse.numel() else 0)
    return counts[inverse[n:]]


def _check_ids(
    query_ids: Any, reference_ids: Any, query: torch.Tensor, reference: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if query_ids is None and reference_ids is None:
        return None
    if query_ids is None or reference_ids is None:
        raise ValueError("query_ids and reference_ids must be given together (or both None)")
    if reference is None:
        raise ValueError(
            "query_ids/reference_ids need reference: without it the queries are the references and "
            "each query is already excluded from its own ranking"
        )
    label_tensor(query_ids, "query_ids", shape=(query.shape[0],))
    label_tensor(reference_ids, "reference_ids", shape=(reference.shape[0],))
    return query_ids.to(reference.device), reference_ids.to(reference.device)


def _check_include(include: Sequence[str] | None) -> tuple[str, ...]:
    if include is None:
        return RANKING_METRICS
    if isinstance(include, str):
        include = (include,)
    valid = RANKING_METRICS + CLUSTERING_METRICS
    unknown = [m for m in include if m not in valid]
    if unknown:
        raise ValueError(f"include has unknown metric(s) {unknown}; valid: {', '.join(valid)}")
    if not include:
        raise ValueError("include must name at least one metric")
    return tuple(dict.fromkeys(include))


def _per_query_terms(
    rel: torch.Tensor, r: torch.Tensor, ks: tuple[int, ...], cut: int, wanted: tuple[str, ...]
) -> torch.Tensor:
    """``[c, M]`` float64 per-query values of the ranking metrics (``M`` columns, in order).

    ``rel [c, depth]``: relevance of each rank (excluded references already removed);
    ``r [c]``: the number of relevant references of each query (``>= 1``).
    """
    most = int(r.max()) if r.numel() else 0  # a chunk may hold no query with a relevant reference
    width = min(rel.shape[1], max(most, cut if "mean_average_precision" in wanted else 0))
    ranks = torch.arange(1, rel.shape[1] + 1, device=rel.device, dtype=torch.float64)
    precision_at_i = rel[:, :width].cumsum(dim=1, dtype=torch.float64) / ranks[:width]  # P(i)
    r = r.to(torch.float64)
    cols: list[torch.Tensor] = []
    for name in wanted:
        if name == "precision_at_1":
            cols.append(rel[:, 0].to(torch.float64))
        elif name in ("r_precision", "map_at_r"):
            top = most
            rel_r = rel[:, :top] & (ranks[None, :top] <= r[:, None])
            if name == "r_precision":
                cols.append(rel_r.sum(dim=1) / r)
            else:
                cols.append((precision_at_i[:, :top] * rel_r).sum(dim=1) / r)
        elif name == "mean_average_precision":
            cols.append((precision_at_i[:, :cut] * rel[:, :cut]).sum(dim=1) / r)
        elif name == "mrr":
            first = rel[:, :cut].to(torch.uint8).argmax(dim=1)
            found = rel[:, :cut].any(dim=1)
            cols.append(torch.where(found, 1.0 / (first + 1).to(torch.float64), 0.0))
        elif name == "precision_at_k":
            cols.extend(rel[:, :k].sum(dim=1, dtype=torch.float64) / k for k in ks)
        elif name == "recall_at_k":
            cols.extend(rel[:, :k].any(dim=1).to(torch.float64) for k in ks)
    return torch.stack(cols, dim=1)


def _unpack(values: list[float], wanted: tuple[str, ...], ks: tuple[int, ...]) -> dict[str, Any]:
    """Column values back into ``{metric: float}`` / ``{metric: {k: float}}``."""
    out: dict[str, Any] = {}
    it = iter(values)
    for name in wanted:
        if name in ("precision_at_k", "recall_at_k"):
            out[name] = {k: next(it) for k in ks}
        else:
            out[name] = next(it)
    return out


@accepts_arrays(
    query="float",
    query_labels="int",
    reference="float",
    reference_labels="int",
    query_ids="int",
    reference_ids="int",
)
def retrieval_metrics(
    query: torch.Tensor,
    query_labels: torch.Tensor,
    reference: torch.Tensor | None = None,
    reference_labels: torch.Tensor | None = None,
    metric: str = "cosine",
    ks: Sequence[int] = (1, 5, 10),
    *,
    k: int | None = None,
    include: Sequence[str] | None = None,
    avg_of_avgs: bool = False,
    per_class: bool = False,
    query_ids: torch.Tensor | None = None,
    reference_ids: torch.Tensor | None = None,
    seed: int = 0,
    memory_limit_mb: float = 512.0,
) -> dict[str, Any]:
    r"""Retrieval metrics of nearest-neighbour search, as pytorch-metric-learning defines them.

    For each query, references are ranked by cosine similarity (decreasing) or Euclidean
    distance (increasing), equal values by increasing reference index. With ``R`` the number
    of references sharing the query's label, ``rel(i)`` whether rank ``i`` shares it and
    ``P(i) = (1/i) Σ_{j≤i} rel(j)`` (Musgrave, Belongie, Lim, "A Metric Learning Reality
    Check", ECCV 2020; pytorch-metric-learning's ``AccuracyCalculator`` since v1.6.1):

    .. math::
        \text{P@1} = rel(1),\quad
        \text{R-Precision} = \frac{1}{R}\sum_{i \le R} rel(i),\quad
        \text{MAP@R} = \frac{1}{R}\sum_{i \le R} P(i)\,rel(i),

        \text{MAP} = \frac{1}{R}\sum_{i \le K} P(i)\,rel(i),\quad
        \text{MRR} = \frac{1}{\min\{i \le K : rel(i)\}}\ (0\text{ if none}),\quad
        \text{P@}k = \frac{1}{k}\sum_{i \le k} rel(i),

    with ``K = k`` (the cut-off) or every reference (``k=None``: full MAP), and
    ``recall_at_k[k]`` the hit rate (a relevant reference among the first ``k``). Each is
    averaged over the queries with ``R >= 1`` (queries whose label has no other reference are
    left out, as PML does, and counted in ``num_queries_without_relevant``), or per class first
    with ``avg_of_avgs`` (the mean over the classes of the per-class means).

    Self-matches are excluded **by identity, never by distance** (a duplicate elsewhere still
    counts): with ``reference=None`` the queries are the references and each query is removed
    from its own ranking by index; with ``query_ids`` and ``reference_ids`` a query is removed
    from the ranking of every reference with its id — for references that contain the queries
    plus more items (PML's ``ref_includes_query=True`` is ``query_ids = arange(Q)``,
    ``reference_ids = arange(N)``). ``R`` then counts the remaining references.

    ``nmi`` / ``ami`` (only when listed in ``include``): the normalised / adjusted mutual
    information between the query labels and a k-means clustering of the queries
    (:func:`marginkit.metrics.clustering_metrics`; needs scikit-learn).

    The search is exact and chunked (``memory_limit_mb`` bounds its temporaries) and stops at
    the depth the requested metrics need: ``max R`` and ``max ks`` for the R-metrics and
    ``P@k``/``recall@k``, ``k`` (or every reference) for MAP and MRR.

    Args:
        query: ``[Q, D]`` query embeddings (any float dtype; computed in float32 or float64).
        query_labels: ``[Q]`` integer labels.
        reference, reference_labels: ``[N, D]`` and ``[N]``, both or neither.
        metric: ``"cosine"`` or ``"l2"``.
        ks: cut-offs of ``precision_at_k`` and ``recall_at_k``; each at most the number of
            references available to every query.
        k: cut-off of ``mean_average_precision`` and ``mrr`` (PML's ``k``); ``None`` ranks
            every reference.
        include: metric names (:data:`RANKING_METRICS`, :data:`CLUSTERING_METRICS`); default
            all ranking metrics.
        avg_of_avgs: average per class first (PML's ``avg_of_avgs``).
        per_class: add ``"per_class"``: ``{label: {metric: value, "num_queries": n}}`` over
            the classes of the queries with ``R >= 1`` (PML's ``return_per_class``).
        query_ids, reference_ids: ``[Q]`` / ``[N]`` integer identities, both or neither (with
            ``reference``): a reference with a query's id is not in that query's ranking.
        seed: seed of the k-means of ``nmi`` / ``ami``.
        memory_limit_mb: budget of the search's temporaries.

    Returns:
        The requested metrics (floats; ``precision_at_k`` and ``recall_at_k`` as ``{k: float}``),
        ``"num_queries"`` (with ``R >= 1``), ``"num_queries_without_relevant"``, and
        ``"per_class"`` when asked.

    Example:
        >>> import torch
        >>> e = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> m = retrieval_metrics(e, torch.tensor([0, 0, 1, 1]), ks=(1,))
        >>> m["precision_at_1"], m["map_at_r"], m["mean_average_precision"], m["mrr"]
        (1.0, 1.0, 1.0, 1.0)
    """
    check_embeddings(query, "query")
    check_labels(query_labels, "query_labels", query.shape[0], "query")
    metric = check_metric(metric)
    limit = int(positive_float(memory_limit_mb, "memory_limit_mb") * 2**20)
    ks = tuple(positive_int(v, "ks") for v in ks)
    if not ks:
        raise ValueError("ks must contain at least one cut-off")
    cut_k = None if k is None else positive_int(k, "k")
    wanted_all = _check_include(include)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if (reference is None) != (reference_labels is None):
        raise ValueError("reference and reference_labels must be given together (or both None)")
    ids = _check_ids(query_ids, reference_ids, query, reference)
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
    n_ref = reference.shape[0]
    ref_labels = reference_labels.to(device)
    q_labels_all = query_labels.to(device)

    # excluded references per query (E) and relevant ones left (R)
    if ids is None:
        excluded = torch.full_like(q_labels_all, int(self_offset is not None))
        r_all = _match_counts(ref_labels, q_labels_all) - excluded
    else:
        q_ids, r_ids = ids
        excluded = _match_counts(r_ids, q_ids)
        same_pair = _match_counts(
            torch.stack([r_ids.long(), ref_labels.long()], 1),
            torch.stack([q_ids.long(), q_labels_all.long()], 1),
        )
        r_all = _match_counts(ref_labels, q_labels_all) - same_pair
    valid_all = r_all > 0
    num_valid = int(valid_all.sum())
    out: dict[str, Any] = {}
    wanted = tuple(m for m in wanted_all if m in RANKING_METRICS)
    if wanted:
        available = n_ref - int(excluded.max())
        if max(ks) > available:
            raise ValueError(
                f"ks must be <= the {available} references available to each query, got {max(ks)}"
            )
        if cut_k is not None and cut_k > available:
            raise ValueError(f"k must be <= the {available} references available to each query, got {cut_k}")
        if num_valid == 0:
            raise ValueError(
                "no query has a relevant reference (a reference sharing its label, other than itself)"
            )
        values, per_class_values = _ranking(
            query, q_labels_all, reference, ref_labels, metric, ks, cut_k, wanted,
            r_all, valid_all, excluded, ids, self_offset, avg_of_avgs, per_class, limit,
        )  # fmt: skip
        out.update(values)
    if any(m in CLUSTERING_METRICS for m in wanted_all):
        from marginkit.metrics.clustering import clustering_metrics

        clusters = clustering_metrics(query, query_labels, metric=metric, seed=seed)
        out.update({m: clusters[m] for m in wanted_all if m in CLUSTERING_METRICS})
    out["num_queries"] = num_valid
    out["num_queries_without_relevant"] = query.shape[0] - num_valid
    if per_class and wanted:
        out["per_class"] = per_class_values
    return out


#: Full MAP / MRR of float32 keys are counted (:func:`_full_rank_terms`); the tests and
#: ``benchmarks/bench_metrics.py`` switch it off to run the full sort they replace.
COUNT_FULL_RANKS = True
_COUNT_BYTES_PER_CELL = 40  # scores, packed keys, bucket, flat bucket, bincount index per [query, reference]
#: Metrics that rank every reference (``k=None``): counted, not sorted, for float32 keys.
_FULL_METRICS = ("mean_average_precision", "mrr")


@dataclass(frozen=True)
class _Ranking:
    """One ranking problem: the queries against the prepared references, ``R`` per query and which
    queries count (``R >= 1``), the query's own row (``self_offset``) and the memory budget."""

    query: torch.Tensor
    q_labels: torch.Tensor
    refs: torch.Tensor  # prepared (:func:`prepare`)
    ref_labels: torch.Tensor
    ref_bias: torch.Tensor | None  # ``l2`` key biases
    metric: str
    r_all: torch.Tensor
    valid_all: torch.Tensor
    self_offset: int | None
    limit: int


def _full_rank_terms(problem: _Ranking, wanted: tuple[str, ...]) -> torch.Tensor:
    r"""``[valid queries, len(wanted)]`` float64 full MAP / MRR (``k=None``), without ranking.

    Only the ranks of a query's ``R`` relevant references enter them: with ``rank_j`` the rank of
    its ``j``-th best relevant reference, ``AP = (1/R) Σ_j j / rank_j`` and ``RR = 1 / rank_1``.
    ``rank_j - 1`` counts the references that precede it in the stable order (key descending,
    index ascending). Each score becomes a unique int64 key in that order
    (:func:`marginkit.ops.selection.packed_column_keys`), the ``R`` relevant keys are sorted,
    and one ``searchsorted`` places every reference between them; a histogram of the places and
    its prefix sums are the counts. ``O(N log R)`` per query instead of a sort of ``N``, with the
    same keys as the search (float32 ``refs``, prepared; the excluded query itself counted never).
    """
    from marginkit.ops.selection import packed_column_keys

    p = problem
    device = p.refs.device
    n_ref = p.refs.shape[0]
    by_label = torch.sort(p.ref_labels, stable=True)
    classes, counts = torch.unique_consecutive(by_label.values, return_counts=True)
    starts = counts.cumsum(0) - counts
    rows = max(1, (p.limit // 2) // (n_ref * _COUNT_BYTES_PER_CELL))
    last = torch.iinfo(torch.int64).max  # above every packed key: excluded references, padding
    # one output, written chunk by chunk: a small tensor kept per chunk would pin the heap between
    # the chunks' large temporaries, and glibc's heap then grows by a chunk at every step
    out = torch.empty(int(p.valid_all.sum()), len(wanted), dtype=torch.float64, device=device)
    at = 0
    for s in range(0, p.query.shape[0], rows):
        valid = p.valid_all[s : s + rows]
        if not bool(valid.any()):
            continue
        q = prepare(p.query[s : s + rows][valid].to(device), p.metric, "query", p.refs.dtype)
        keys = packed_column_keys(search_keys(q, p.refs, p.ref_bias), descending=True)
        if p.self_offset is not None:
            own = (torch.arange(s, s + valid.shape[0], device=device) + p.self_offset)[valid]
            keys.scatter_(1, own[:, None], last)
        place = torch.searchsorted(classes, p.q_labels[s : s + rows][valid])
        size = counts[place]
        width = int(size.max())
        slot = torch.arange(width, device=device)
        column = by_label.indices[(starts[place, None] + slot).clamp_max(n_ref - 1)]
        relevant = keys.gather(1, column).masked_fill_(slot >= size[:, None], last).sort(dim=1).values
        # place[m] = how many relevant keys are <= reference m's key: m precedes exactly the
        # relevant references from there on, so a prefix sum of the places' histogram counts
        # the references ahead of each relevant one
        bucket = torch.searchsorted(relevant, keys, right=True)
        del keys
        bucket += (torch.arange(bucket.shape[0], device=device) * (width + 1))[:, None]
        hist = torch.bincount(bucket.view(-1), minlength=bucket.shape[0] * (width + 1))
        ahead = hist.view(-1, width + 1).cumsum(1)[:, :width].to(torch.float64)
        r = p.r_all[s : s + rows][valid].to(torch.float64)
        cols = []
        for name in wanted:
            if name == "mean_average_precision":
                real = slot[None, :] < r[:, None]
                cols.append(torch.where(real, (slot + 1).to(torch.float64) / (ahead + 1), 0.0).sum(1) / r)
            else:  # mrr
                cols.append(1.0 / (ahead[:, 0] + 1))
        done = at + cols[0].shape[0]
        torch.stack(cols, dim=1, out=out[at:done])
        at = done
    return out


def _ranking(
    query: torch.Tensor,
    q_labels_all: torch.Tensor,
    reference: torch.Tensor,
    ref_labels: torch.Tensor,
    metric: str,
    ks: tuple[int, ...],
    cut_k: int | None,
    wanted: tuple[str, ...],
    r_all: torch.Tensor,
    valid_all: torch.Tensor,
    excluded: torch.Tensor,
    ids: tuple[torch.Tensor, torch.Tensor] | None,
    self_offset: int | None,
    avg_of_avgs: bool,
    per_class: bool,
    limit: int,
) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The ranking metrics: per-query terms (one chunked search; full MAP / MRR of float32 keys
    counted), then the averages."""
    device = reference.device
    n_ref = reference.shape[0]
    dtype = torch.promote_types(compute_dtype(query.dtype), compute_dtype(reference.dtype))
    refs = prepare(reference, metric, "reference", dtype)
    ref_bias = neg_sqnorms(refs) if metric == "l2" else None
    # full MAP / MRR over float32 keys are counted (``_full_rank_terms``); the search below then
    # only goes as deep as the other metrics need
    counted = COUNT_FULL_RANKS and cut_k is None and ids is None and dtype == torch.float32 and n_ref < 2**31
    problem = _Ranking(
        query, q_labels_all, refs, ref_labels, ref_bias, metric, r_all, valid_all, self_offset, limit
    )
    full_terms: torch.Tensor | None = None
    ranked = wanted
    if counted and any(m in _FULL_METRICS for m in wanted):
        full_wanted = tuple(m for m in wanted if m in _FULL_METRICS)
        full_terms = _full_rank_terms(problem, full_wanted)
        ranked = tuple(m for m in wanted if m not in _FULL_METRICS)
    per_query = _ranked_terms(problem, ks, cut_k, ranked, excluded, ids)
    if full_terms is not None:
        per_query = _merge_columns(wanted, ks, ranked, per_query, full_wanted, full_terms)
    labels = q_labels_all[valid_all]
    classes, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    class_sums = torch.zeros(classes.numel(), per_query.shape[1], dtype=torch.float64, device=device)
    class_sums.index_add_(0, inverse, per_query)
    class_means = class_sums / counts[:, None].to(torch.float64)
    overall = class_means.mean(dim=0) if avg_of_avgs else per_query.mean(dim=0)
    values = _unpack(overall.tolist(), wanted, ks)
    table: dict[int, dict[str, Any]] = {}
    if per_class:
        for label, n, row in zip(classes.tolist(), counts.tolist(), class_means.tolist(), strict=True):
            table[label] = {**_unpack(row, wanted, ks), "num_queries": n}
    return values, table


def _merge_columns(
    wanted: tuple[str, ...],
    ks: tuple[int, ...],
    first: tuple[str, ...],
    first_terms: torch.Tensor,
    second: tuple[str, ...],
    second_terms: torch.Tensor,
) -> torch.Tensor:
    """The columns of two per-query blocks (metrics ``first`` and ``second``) in ``wanted``'s order."""

    def columns(names: tuple[str, ...], terms: torch.Tensor) -> dict[str, torch.Tensor]:
        out, at = {}, 0
        for name in names:
            width = len(ks) if name in ("precision_at_k", "recall_at_k") else 1
            out[name], at = terms[:, at : at + width], at + width
        return out

    found = {**columns(first, first_terms), **columns(second, second_terms)}
    return torch.cat([found[name] for name in wanted], dim=1)


def _ranked_terms(
    problem: _Ranking,
    ks: tuple[int, ...],
    cut_k: int | None,
    wanted: tuple[str, ...],
    excluded: torch.Tensor,
    ids: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """``[valid queries, columns]`` per-query terms of ``wanted`` from one chunked top-``depth`` search."""
    p = problem
    query, q_labels_all, refs, ref_labels = p.query, p.q_labels, p.refs, p.ref_labels
    r_all, valid_all, self_offset, limit = p.r_all, p.valid_all, p.self_offset, p.limit
    n_ref = refs.shape[0]
    if not wanted:
        return torch.zeros(int(valid_all.sum()), 0, dtype=torch.float64, device=refs.device)
    most_excluded = int(excluded.max())
    available = n_ref - most_excluded
    full = any(m in _FULL_METRICS for m in wanted)
    need = max(ks)
    if any(m in ("r_precision", "map_at_r") for m in wanted):
        need = max(need, int(r_all.max()))
    if full:
        need = max(need, available if cut_k is None else cut_k)
    # the search skips the query itself (self_offset) or fetches the excluded ids as extra rows
    depth = min(n_ref, need + (most_excluded if ids is not None else 0))
    cut = depth if cut_k is None else cut_k
    # a full ranking is one stable sort; without the query itself that would be a top-(N-1)
    # (topk + re-sorts), so fetch all N and drop the query, ranked last at -inf
    fetch = n_ref if (self_offset is not None and depth == n_ref - 1) else depth

    # query chunks: half of the budget for the search, half for the [chunk, depth] metric terms
    rows = max(1, min(query.shape[0], (limit // 2) // (fetch * _METRIC_BYTES_PER_CELL)))
    plan = plan_chunks(rows, refs.shape[0], refs.shape[1], fetch, refs.element_size(), limit // 2)
    terms: torch.Tensor | None = None  # written chunk by chunk, as in _full_rank_terms
    at = 0
    for s in range(0, query.shape[0], rows):
        valid = valid_all[s : s + rows]
        _, idx, _ = topk_keys(
            query[s : s + rows],
            refs,
            fetch,
            metric=p.metric,
            memory_limit_bytes=limit // 2,
            ref_neg_sqnorms=p.ref_bias,
            self_offset=None if self_offset is None else s,
            plan=plan,
        )
        idx = idx[valid, :depth]
        rel = ref_labels[idx] == q_labels_all[s : s + rows][valid, None]
        if ids is not None:
            # move the query's own ids behind every other reference (stable: ranks kept)
            own = ids[1][idx] == ids[0][s : s + rows][valid, None]
            order = torch.sort(own.to(torch.uint8), dim=1, stable=True).indices
            rel = (rel & ~own).gather(1, order)
        chunk = _per_query_terms(rel, r_all[s : s + rows][valid], ks, cut, wanted)
        if terms is None:
            terms = chunk.new_empty(int(valid_all.sum()), chunk.shape[1])
        terms[at : at + chunk.shape[0]] = chunk
        at += chunk.shape[0]
    assert terms is not None  # the loop runs at least once: a query set is never empty here
    return terms
