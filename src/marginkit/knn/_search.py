"""Exact k-nearest-neighbour search in pure torch, chunked under a memory budget.

This is the engine of the ``exact`` backend of :class:`~marginkit.knn.KNNClassifier` and of
the retrieval metrics. It works on any device and in the working precision of the
references (float32, or float64 when the references are float64).

Scores. Every search ranks references by a *key*, larger meaning closer:

- ``metric="cosine"``: ``key = <q, r>`` on L2-normalised rows (the cosine similarity);
- ``metric="l2"``: ``key = 2<q, r> - ||r||²``, so that ``||q - r||² = ||q||² - key``
  (the query norm is a per-row constant and is added back only to the ``k`` winners).

Tie-breaking (documented contract). Neighbours are returned in order of decreasing key and,
among *equal computed keys*, increasing reference index; the set of ``k`` neighbours is
the first ``k`` in that order. This holds across reference chunks too: per-chunk winners
are merged with a stable sort in which earlier chunks (lower indices) come first.

Memory. The query x reference score matrix is never formed whole: the search walks over
query chunks (and reference chunks when even a few query rows against all references would
not fit), keeps one reusable score buffer, and merges per-chunk top-k lists. The chunk sizes
come from :func:`plan_chunks`, whose estimate of the peak temporary memory stays under
``memory_limit_bytes`` (``tests/test_knn.py`` measures the real peak RSS in a subprocess).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from marginkit._validation import choice, compute_dtype, float_tensor, label_tensor

METRICS = ("cosine", "l2")
_INDEX_BYTES = 8  # int64 indices
_MIN_QUERY_ROWS = 16  # below this, split the references instead of the queries
_MAX_QUERY_ROWS = 4096  # larger chunks bring no speed, only a larger buffer


def check_embeddings(x: object, name: str) -> torch.Tensor:
    """Check a 2-D floating tensor ``[N, D]`` with ``N >= 1``, ``D >= 1`` and finite values."""
    float_tensor(x, name, min_dim=2)
    assert isinstance(x, torch.Tensor)
    if x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [N, D], got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} must contain at least one row, got shape {tuple(x.shape)}")
    return x


def check_labels(labels: object, name: str, num_rows: int, rows_name: str) -> torch.Tensor:
    """Check a 1-D integer label tensor with one entry per row of ``rows_name``."""
    label_tensor(labels, name)
    assert isinstance(labels, torch.Tensor)
    if labels.dim() != 1 or labels.shape[0] != num_rows:
        raise ValueError(
            f"{name} must have shape ({num_rows},), one label per row of {rows_name}; "
            f"got shape {tuple(labels.shape)}"
        )
    return labels


def check_metric(metric: object) -> str:
    """Check ``metric`` is ``"cosine"`` or ``"l2"``."""
    return choice(metric, "metric", METRICS)


def prepare(x: torch.Tensor, metric: str, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cast to the working precision and L2-normalise rows for ``metric="cosine"``.

    A zero row has no direction, so its cosine similarity is undefined: it is an error.
    """
    x = x.to(dtype=dtype or compute_dtype(x.dtype))
    if metric == "cosine":
        norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        zero = norms == 0
        if bool(zero.any()):
            raise ValueError(
                f"{name} has {int(zero.sum())} all-zero row(s): cosine similarity is undefined for them"
            )
        x = x / norms
    return x.contiguous()


def neg_sqnorms(references: torch.Tensor) -> torch.Tensor:
    """``-||r||²`` per reference row: the bias of the ``l2`` key (no ``[N, D]`` temporary)."""
    return torch.linalg.vector_norm(references, dim=1).square_().neg_()


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk sizes of one search and the estimated peak of its temporaries (bytes)."""

    query_rows: int
    reference_cols: int
    tie_rows: int
    estimated_bytes: int


def _estimate(qc: int, rc: int, tie_rows: int, dim: int, k: int, itemsize: int, threads: int) -> int:
    pair = itemsize + _INDEX_BYTES
    score_buffer = qc * rc * itemsize
    query_chunk = 2 * qc * dim * itemsize  # the cast and the normalised copy
    topk_lists = 12 * qc * (k + 1) * pair  # chunk top-(k+1), re-sorts, running merge (2k wide)
    topk_scratch = threads * rc * pair  # torch.topk's per-thread row queue on CPU
    tie_sort = 2 * tie_rows * rc * pair  # stable sort of rows whose k-th key is tied
    return score_buffer + query_chunk + topk_lists + topk_scratch + tie_sort


def plan_chunks(
    num_queries: int,
    num_references: int,
    dim: int,
    k: int,
    itemsize: int,
    memory_limit_bytes: int,
    *,
    threads: int | None = None,
) -> ChunkPlan:
    """Choose query/reference chunk sizes whose estimated temporaries fit the budget.

    Prefers whole reference rows (no merge) with up to 4096 query rows; splits the
    references only when fewer than 16 query rows would fit. Raises ``ValueError`` when not
    even one query row against ``k + 1`` references fits.
    """
    threads = threads or torch.get_num_threads()
    budget = int(memory_limit_bytes)
    pair = itemsize + _INDEX_BYTES
    n = num_references
    k1 = min(k + 1, n)

    def tie_rows_for(qc: int, rc: int) -> int:
        # Tied rows are re-sorted in groups no larger than a quarter of the budget.
        return max(1, min(qc, (budget // 4) // max(1, 2 * rc * pair)))

    def best_qc(rc: int) -> int:
        lo, hi = 0, min(num_queries, _MAX_QUERY_ROWS)
        while lo < hi:  # largest qc with _estimate <= budget (monotone in qc)
            mid = (lo + hi + 1) // 2
            if _estimate(mid, rc, tie_rows_for(mid, rc), dim, k, itemsize, threads) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    want_q = min(num_queries, _MIN_QUERY_ROWS)
    rc = n
    qc = best_qc(rc)
    if qc < want_q:
        # Largest reference chunk (>= k + 1) with which want_q, or at least 1, query rows fit.
        for target in (want_q, 1):
            lo, hi = k1, n
            while lo < hi:
                mid = (lo + hi + 1) // 2
                fits = _estimate(target, mid, tie_rows_for(target, mid), dim, k, itemsize, threads) <= budget
                lo, hi = (mid, hi) if fits else (lo, mid - 1)
            if _estimate(target, lo, tie_rows_for(target, lo), dim, k, itemsize, threads) <= budget:
                rc = lo
                qc = best_qc(rc)
                break
        else:
            need = _estimate(1, k1, 1, dim, k, itemsize, threads)
            raise ValueError(
                f"memory_limit_mb={memory_limit_bytes / 2**20:.4g} is too small for a k={k} search in "
                f"dimension {dim}: at least {math.ceil(need / 2**20 * 1000) / 1000} MB are needed"
            )
    tie_rows = tie_rows_for(qc, rc)
    return ChunkPlan(qc, rc, tie_rows, _estimate(qc, rc, tie_rows, dim, k, itemsize, threads))


def _ordered_topk(scores: torch.Tensor, k: int, tie_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` per row by (key descending, column ascending), exactly, without a full sort.

    ``torch.topk`` leaves the choice among tied keys unspecified, so it takes ``k + 1``: when
    the (k+1)-th key differs from the k-th the winning *set* is unambiguous and is merely
    re-ordered; rows where they are equal (a tie straddling the cut) fall back to a stable
    full sort of that row.
    """
    n = scores.shape[1]
    if k >= n:
        return torch.sort(scores, dim=1, descending=True, stable=True)
    vals, idx = torch.topk(scores, k + 1, dim=1, largest=True, sorted=True)
    tied = vals[:, k] == vals[:, k - 1]
    vals, idx = vals[:, :k], idx[:, :k]
    idx, perm = idx.sort(dim=1)
    vals, perm2 = vals.gather(1, perm).sort(dim=1, descending=True, stable=True)
    idx = idx.gather(1, perm2)
    if bool(tied.any()):
        for rows in tied.nonzero().squeeze(1).split(tie_rows):
            v, i = torch.sort(scores[rows], dim=1, descending=True, stable=True)
            vals[rows] = v[:, :k]
            idx[rows] = i[:, :k]
    return vals, idx


def topk_keys(
    queries: torch.Tensor,
    references: torch.Tensor,
    k: int,
    *,
    metric: str,
    memory_limit_bytes: int,
    ref_neg_sqnorms: torch.Tensor | None = None,
    self_offset: int | None = None,
    plan: ChunkPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact top-``k`` keys, reference indices and query working copies' squared norms.

    ``queries`` are raw (validated) rows, prepared chunk by chunk; ``references`` are
    prepared (:func:`prepare`). With ``self_offset = s``, query row ``i`` *is* reference
    ``s + i`` and is excluded by index (never by distance). Returns ``(keys, indices,
    query_sqnorms)`` on the references' device, keys in the references' dtype; for
    ``metric="cosine"`` the squared norms are ones.
    """
    device, dtype = references.device, references.dtype
    nq, n = queries.shape[0], references.shape[0]
    if metric == "l2" and ref_neg_sqnorms is None:
        ref_neg_sqnorms = neg_sqnorms(references)
    if plan is None:
        plan = plan_chunks(nq, n, references.shape[1], k, references.element_size(), memory_limit_bytes)
    qc, rc = plan.query_rows, plan.reference_cols
    keys = torch.empty(nq, k, dtype=dtype, device=device)
    indices = torch.empty(nq, k, dtype=torch.long, device=device)
    q_sqnorms = torch.ones(nq, dtype=dtype, device=device)
    buffer = torch.empty(qc * min(rc, n), dtype=dtype, device=device)
    for qs in range(0, nq, qc):
        q = prepare(queries[qs : qs + qc].to(device), metric, "queries", dtype)
        m = q.shape[0]
        if metric == "l2":
            q_sqnorms[qs : qs + m] = (q * q).sum(dim=1)
        best_v: torch.Tensor | None = None
        best_i: torch.Tensor | None = None
        for rs in range(0, n, rc):
            r = references[rs : rs + rc]
            w = r.shape[0]
            s = buffer[: m * w].view(m, w)
            if metric == "l2":
                assert ref_neg_sqnorms is not None
                torch.addmm(ref_neg_sqnorms[rs : rs + w], q, r.T, beta=1, alpha=2, out=s)
            else:
                torch.mm(q, r.T, out=s)
            if self_offset is not None:
                rows = torch.arange(m, device=device)
                cols = self_offset + qs + rows - rs
                inside = (cols >= 0) & (cols < w)
                s[rows[inside], cols[inside]] = -math.inf
            v, i = _ordered_topk(s, min(k, w), plan.tie_rows)
            i = i + rs
            if best_v is None:
                best_v, best_i = v, i
            else:
                assert best_i is not None
                # Earlier chunks hold lower indices and come first: a stable sort keeps
                # (key desc, index asc) across chunks.
                v = torch.cat([best_v, v], dim=1)
                i = torch.cat([best_i, i], dim=1)
                v, perm = v.sort(dim=1, descending=True, stable=True)
                best_v, best_i = v[:, :k], i.gather(1, perm[:, :k])
        assert best_v is not None and best_i is not None
        keys[qs : qs + m] = best_v
        indices[qs : qs + m] = best_i
    return keys, indices, q_sqnorms


def keys_to_values(keys: torch.Tensor, q_sqnorms: torch.Tensor, metric: str) -> torch.Tensor:
    """Cosine similarities (``metric="cosine"``) or Euclidean distances (``"l2"``) from keys."""
    if metric == "cosine":
        return keys
    return (q_sqnorms[:, None] - keys).clamp_min(0).sqrt()


def exact_search(
    queries: torch.Tensor,
    references: torch.Tensor,
    k: int,
    *,
    metric: str,
    memory_limit_bytes: int,
    ref_neg_sqnorms: torch.Tensor | None = None,
    self_offset: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``k``-NN: ``(values, indices)``, values as in :func:`keys_to_values`."""
    keys, indices, q_sqnorms = topk_keys(
        queries,
        references,
        k,
        metric=metric,
        memory_limit_bytes=memory_limit_bytes,
        ref_neg_sqnorms=ref_neg_sqnorms,
        self_offset=self_offset,
    )
    return keys_to_values(keys, q_sqnorms, metric), indices
