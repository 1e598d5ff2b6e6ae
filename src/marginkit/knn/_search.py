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

Exact distances (:func:`exact_search`). The keys cancel: ``||q||² - key`` loses about
``D·eps·(||q||² + ||r||²)``, so a point's distance to its own duplicate comes out as 1e-2
at ``|x| ≈ 12`` in float32, and equal distances compare unequal. :func:`exact_search`
therefore uses the keys only to pick candidates (``k`` plus a margin): it recomputes their
squared distances from the differences, ``||q - r||²`` (relative error a few eps of the
distance itself, exactly 0 for a duplicate, exact on small-integer data), orders them by
that value then index, and
*certifies* each row: every reference left out has a key-based squared distance at least
that of the last candidate, so when that exceeds the k-th recomputed one by more than the
keys' worst-case rounding error (:func:`key_error_bound`), nothing left out can be nearer.
Rows that cannot be certified (near-ties at the cut) are searched again, first with float64
keys of the same float32 rows (their rounding is about 10⁻⁹ of float32's), then with more
candidates, up to all references, so the result is the exact k-NN of the prepared vectors
under the contract above, with distances as accurate as the differences allow.

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
from marginkit.ops.selection import stable_sort, topk_stable

METRICS = ("cosine", "l2")
_INDEX_BYTES = 8  # int64 indices
_MIN_QUERY_ROWS = 16  # below this, split the references instead of the queries
_MAX_QUERY_ROWS = 4096  # larger chunks bring no speed, only a larger buffer
# [rows, candidates] arrays alive at once in a pass of exact_search (topk_keys' and rerank's
# outputs and rerank's sorts): int64 candidates, their sort and two permutations, and the keys,
# approximate and recomputed squared distances
_CANDIDATE_INDEX_ARRAYS = 4
_CANDIDATE_VALUE_ARRAYS = 4


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

    The one place where K-NN, the metrics and the gallery normalise rows for cosine similarity.
    Each row is divided by its largest magnitude before its norm is taken: the squares of a row
    of 1e30 overflow float32 (norm ``inf``, every cosine 0) and those of a row of 1e-30
    underflow (norm 0), while cosine similarity does not depend on the scale. A row that the
    working precision cannot hold (float64 1e300 or 1e-300 for float32: ``inf`` or 0 once cast)
    is normalised in its own precision first, then cast. A zero row has no direction, so its
    cosine similarity is undefined: it is an error.
    """
    dtype = dtype or compute_dtype(x.dtype)
    if metric == "cosine" and _beyond_range(x, dtype):
        return _unit_rows(x, name).to(dtype).contiguous()
    x = x.to(dtype=dtype)
    if metric == "cosine":
        x = _unit_rows(x, name)
    return x.contiguous()


def _beyond_range(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a row's largest magnitude lies outside ``dtype``'s normal range, for ``x`` of a
    floating type whose range is wider (no work otherwise)."""
    if not (x.is_floating_point() and dtype.is_floating_point and x.numel()):
        return False
    have, want = torch.finfo(x.dtype), torch.finfo(dtype)
    if have.max <= want.max and have.tiny >= want.tiny:
        return False
    low, high = torch.aminmax(x.abs().amax(dim=1))
    return bool(high > want.max) or bool((low > 0) & (low < want.tiny))


def _unit_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """Rows of ``x`` divided by their largest magnitude, then by their norm (see :func:`prepare`)."""
    if x.numel() == 0:
        return x
    low, high = torch.aminmax(x, dim=1, keepdim=True)
    top = torch.maximum(high, low.neg())
    zero = top == 0
    if bool(zero.any()):
        raise ValueError(
            f"{name} has {int(zero.sum())} all-zero row(s): cosine similarity is undefined for them"
        )
    x = x / top  # (one copy, as the division by the norm was; normalised in place below)
    return x.div_(torch.linalg.vector_norm(x, dim=1, keepdim=True))


_SQNORM_ROWS = 1 << 16  # rows squared at once: bounds the temporary of sqnorms()


def sqnorms(x: torch.Tensor, name: str = "embeddings") -> torch.Tensor:
    """``||x_i||²`` per row as a sum of squares (not a norm squared: exact on integer data).

    Chunked, so the ``[rows, D]`` temporary stays small; a row whose square overflows the
    working precision is an error (its distances would be inf or NaN).
    """
    out = torch.cat([(c * c).sum(dim=1) for c in x.split(_SQNORM_ROWS)]) if x.shape[0] else x.new_zeros(0)
    if not bool(torch.isfinite(out).all()):
        raise ValueError(
            f"{name} has rows whose squared norm overflows {str(x.dtype).removeprefix('torch.')}; "
            "rescale them (or use float64)"
        )
    return out


def neg_sqnorms(references: torch.Tensor) -> torch.Tensor:
    """``-||r||²`` per reference row: the bias of the ``l2`` key (see :func:`sqnorms`)."""
    return sqnorms(references, "references").neg_()


def search_keys(
    queries: torch.Tensor,
    references: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ranking keys of prepared rows, larger first: ``<q, r>`` (cosine, ``bias=None``) or the
    ``l2`` key ``2<q, r> - ||r||²`` (``bias`` = :func:`neg_sqnorms`), one matrix product."""
    if bias is None:
        return torch.mm(queries, references.T, out=out)
    return torch.addmm(bias, queries, references.T, beta=1, alpha=2, out=out)


def wide_neg_sqnorms(references: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`neg_sqnorms` of the rows copied into the wider ``dtype``, chunk by chunk (no
    ``[N, D]`` copy)."""
    parts = [sqnorms(c.to(dtype), "references") for c in references.split(_SQNORM_ROWS)]
    return torch.cat(parts).neg_() if parts else references.new_zeros(0, dtype=dtype)


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
    upcast: bool = False,
) -> ChunkPlan:
    """Choose query/reference chunk sizes whose estimated temporaries fit the budget.

    Prefers whole reference rows (no merge) with up to 4096 query rows; splits the
    references only when fewer than 16 query rows would fit. Raises ``ValueError`` when not
    even one query row against ``k + 1`` references fits. ``upcast``: the chunks are copied
    into the wider ``itemsize`` first (:func:`topk_keys`' ``key_dtype``), which counts too.
    """
    threads = threads or torch.get_num_threads()
    budget = int(memory_limit_bytes)

    def estimate(qc: int, rc: int, tie_rows: int, dim: int, k: int, itemsize: int, threads: int) -> int:
        copies = (qc + rc) * dim * itemsize if upcast else 0
        return _estimate(qc, rc, tie_rows, dim, k, itemsize, threads) + copies

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
            if estimate(mid, rc, tie_rows_for(mid, rc), dim, k, itemsize, threads) <= budget:
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
                fits = estimate(target, mid, tie_rows_for(target, mid), dim, k, itemsize, threads) <= budget
                lo, hi = (mid, hi) if fits else (lo, mid - 1)
            if estimate(target, lo, tie_rows_for(target, lo), dim, k, itemsize, threads) <= budget:
                rc = lo
                qc = best_qc(rc)
                break
        else:
            need = estimate(1, k1, 1, dim, k, itemsize, threads)
            raise ValueError(
                f"memory_limit_mb={memory_limit_bytes / 2**20:.4g} is too small for a k={k} search in "
                f"dimension {dim}: at least {math.ceil(need / 2**20 * 1000) / 1000} MB are needed"
            )
    tie_rows = tie_rows_for(qc, rc)
    return ChunkPlan(qc, rc, tie_rows, estimate(qc, rc, tie_rows, dim, k, itemsize, threads))


def _ordered_topk(scores: torch.Tensor, k: int, tie_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` per row by (key descending, column ascending), exactly, without a full sort.

    ``torch.topk`` leaves the choice among tied keys unspecified, so it takes ``k + 1``: when
    the (k+1)-th key differs from the k-th the winning *set* is unambiguous and is merely
    re-ordered; rows where they are equal (a tie straddling the cut) fall back to the first
    ``k`` of a stable sort (:func:`marginkit.ops.selection.topk_stable`: on the CPU a selection
    of packed (key, column) integers, exact with ties; elsewhere a stable full sort). On wide
    rows ``torch.topk`` of a small ``k`` is a fast selection itself (about 10x numpy's partition
    of packed keys on ``[1024, 20000]`` float32, one thread), so only the tied rows take the
    packed path.
    """
    n = scores.shape[1]
    if k >= n:
        return stable_sort(scores, descending=True)
    vals, idx = torch.topk(scores, k + 1, dim=1, largest=True, sorted=True)
    tied = vals[:, k] == vals[:, k - 1]
    vals, idx = vals[:, :k], idx[:, :k]
    idx, perm = idx.sort(dim=1)
    vals, perm2 = vals.gather(1, perm).sort(dim=1, descending=True, stable=True)
    idx = idx.gather(1, perm2)
    if bool(tied.any()):
        for rows in tied.nonzero().squeeze(1).split(tie_rows):
            vals[rows], idx[rows] = topk_stable(scores[rows], k)
    return vals, idx


def topk_keys(
    queries: torch.Tensor,
    references: torch.Tensor,
    k: int,
    *,
    metric: str,
    memory_limit_bytes: int,
    ref_neg_sqnorms: torch.Tensor | None,
    self_offset: int | None = None,
    exclude: torch.Tensor | None = None,
    plan: ChunkPlan | None = None,
    key_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact top-``k`` keys, reference indices and query working copies' squared norms.

    ``queries`` are raw (validated) rows, prepared chunk by chunk; ``references`` are
    prepared (:func:`prepare`). With ``self_offset = s``, query row ``i`` *is* reference
    ``s + i`` and is excluded by index (never by distance); ``exclude`` (``[Q]`` int64)
    names the excluded reference of each row explicitly. ``ref_neg_sqnorms`` are the
    references' ``l2`` key biases (:func:`neg_sqnorms`; ``None`` for cosine, or to compute them
    here): a required argument, so that callers searching chunk by chunk compute them once.
    Returns ``(keys, indices, query_sqnorms)`` on the references' device, keys in the
    references' dtype; for ``metric="cosine"`` the squared norms are ones.

    ``key_dtype`` (wider than the references', e.g. float64 for float32 references): the
    prepared rows are copied into it chunk by chunk and ranked by ``l2`` keys there, whatever
    the metric (``ref_neg_sqnorms`` then in ``key_dtype``, from :func:`wide_neg_sqnorms`); the
    keys and squared norms come back in ``key_dtype``. Near-ties that the working precision's
    keys cannot separate (concentrated embeddings) are separated there.
    """
    device, dtype = references.device, references.dtype
    nq, n = queries.shape[0], references.shape[0]
    wide = key_dtype is not None and key_dtype != dtype
    kd, key_metric = (key_dtype, "l2") if wide else (dtype, metric)
    if wide and ref_neg_sqnorms is None:
        ref_neg_sqnorms = wide_neg_sqnorms(references, kd)
    exclude, ref_neg_sqnorms = _exclude_and_bias(
        references, key_metric, ref_neg_sqnorms, nq, self_offset, exclude
    )
    if plan is None:
        itemsize = torch.finfo(kd).bits // 8
        plan = plan_chunks(nq, n, references.shape[1], k, itemsize, memory_limit_bytes, upcast=wide)
    qc, rc = plan.query_rows, plan.reference_cols
    keys = torch.empty(nq, k, dtype=kd, device=device)
    indices = torch.empty(nq, k, dtype=torch.long, device=device)
    q_sqnorms = torch.ones(nq, dtype=kd, device=device)
    buffer = torch.empty(qc * min(rc, n), dtype=kd, device=device)
    for qs in range(0, nq, qc):
        q = prepare(queries[qs : qs + qc].to(device), metric, "queries", dtype).to(kd)
        m = q.shape[0]
        if key_metric == "l2":
            q_sqnorms[qs : qs + m] = sqnorms(q, "queries")
        best: tuple[torch.Tensor, torch.Tensor] | None = None
        for rs in range(0, n, rc):
            r = references[rs : rs + rc].to(kd)
            w = r.shape[0]
            s = buffer[: m * w].view(m, w)
            bias = None
            if key_metric == "l2":
                assert ref_neg_sqnorms is not None
                bias = ref_neg_sqnorms[rs : rs + w]
            search_keys(q, r, bias, out=s)
            if exclude is not None:
                rows = torch.arange(m, device=device)
                cols = exclude[qs : qs + m] - rs
                inside = (cols >= 0) & (cols < w)
                s[rows[inside], cols[inside]] = -math.inf
            v, i = _ordered_topk(s, min(k, w), plan.tie_rows)
            best = _keep_best(best, v, i + rs, k, descending=True, ordered=True)
        assert best is not None
        keys[qs : qs + m], indices[qs : qs + m] = best
    return keys, indices, q_sqnorms


def _exclude_and_bias(
    refs: torch.Tensor,
    metric: str,
    biases: torch.Tensor | None,
    nq: int,
    self_offset: int | None,
    exclude: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each query row's excluded reference (``self_offset`` or ``exclude``) on the references'
    device, and the references' ``l2`` key biases (computed when not given)."""
    if self_offset is not None:
        exclude = torch.arange(self_offset, self_offset + nq, device=refs.device)
    elif exclude is not None:
        exclude = exclude.to(refs.device)
    return exclude, neg_sqnorms(refs) if metric == "l2" and biases is None else biases


def _keep_best(
    best: tuple[torch.Tensor, torch.Tensor] | None, values: torch.Tensor, indices: torch.Tensor, k: int,
    *, descending: bool, ordered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The first ``k`` per row of the ``best`` so far followed by a new chunk of reference columns.

    Earlier chunks hold lower indices and come first: a stable sort keeps (value, index
    ascending) across chunks. ``ordered``: a first chunk is already in that order.
    """
    if best is not None:
        values, indices = torch.cat([best[0], values], dim=1), torch.cat([best[1], indices], dim=1)
    elif ordered:
        return values, indices
    values, perm = values.sort(dim=1, descending=descending, stable=True)
    return values[:, :k], indices.gather(1, perm[:, :k])


def keys_to_values(keys: torch.Tensor, q_sqnorms: torch.Tensor, metric: str) -> torch.Tensor:
    """Cosine similarities (``metric="cosine"``) or Euclidean distances (``"l2"``) from keys."""
    if metric == "cosine":
        return keys
    return (q_sqnorms[:, None] - keys).clamp_min(0).sqrt()


def sqdist_to_values(sq: torch.Tensor, metric: str) -> torch.Tensor:
    """Cosine similarities ``1 - d²/2`` (unit rows) or Euclidean distances ``d`` from ``d²``."""
    return 1 - sq / 2 if metric == "cosine" else sq.sqrt()


def key_error_bound(dim: int, dtype: torch.dtype, device: torch.device) -> float:
    r"""Relative bound ``c`` on the rounding of a key-based squared distance.

    ``|fl(||q||² - 2<q, r> + ||r||²) - ||q - r||²| <= c (||q||² + ||r||²)`` with
    ``c = 2 (2 γ_D + 4 u)``, ``γ_D = D u / (1 - D u)`` (the dot product's worst case for any
    summation order, Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1) and ``u``
    the unit roundoff of the matrix product — TF32's or bfloat16's when CUDA runs float32
    products in them (``torch.set_float32_matmul_precision``); the factor 2 is a margin for
    the normalisation of cosine rows.
    """
    u = torch.finfo(dtype).eps / 2
    if dtype == torch.float32 and device.type == "cuda":
        precision = torch.get_float32_matmul_precision()
        u = {"high": 2.0**-11, "medium": 2.0**-8}.get(precision, u)
    gamma = dim * u / max(1e-300, 1 - dim * u)
    return 2 * (2 * gamma + 4 * u)


def rerank(
    queries: torch.Tensor,
    references: torch.Tensor,
    candidates: torch.Tensor,
    approx_sq: torch.Tensor,
    k: int,
    *,
    metric: str,
    memory_limit_bytes: int,
    exhaustive: bool,
    q_sqnorms: torch.Tensor | None = None,
    max_ref_sqnorm: float = 1.0,
    key_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` nearest of each row's ``candidates`` by recomputed ``||q - r||²``; certified rows.

    ``queries`` are raw rows (prepared here, chunk by chunk), ``references`` prepared,
    ``candidates`` ``[Q, C]`` reference indices and ``approx_sq`` their key-based squared
    distances (any order); ``q_sqnorms`` (``l2``) and ``max_ref_sqnorm`` scale the keys' error
    bound. Returns ``(values, indices, certified)``: values as :func:`sqdist_to_values` in
    increasing distance, equal ones by increasing index, and whether each row provably holds
    the exact k-NN (see the module docstring) — always when ``exhaustive`` (the candidates are
    all the references). ``key_dtype``: the candidates were ranked by ``l2`` keys in that wider
    precision (:func:`topk_keys`), so the keys' error bound is its own, scaled by the squared
    norms whatever the metric.
    """
    device, dtype = references.device, references.dtype
    nq, c = candidates.shape
    dim = references.shape[1]
    candidates = candidates.to(device)
    sq = torch.empty(nq, c, dtype=dtype, device=device)
    rows = max(1, (memory_limit_bytes // 2) // max(1, (c + 2) * dim * references.element_size()))
    for s in range(0, nq, rows):
        q = prepare(queries[s : s + rows].to(device), metric, "queries", dtype)
        diff = references[candidates[s : s + rows]]  # [rows, C, D], a copy
        sq[s : s + rows] = diff.sub_(q[:, None, :]).square_().sum(dim=2)
        del diff
    by_index, perm = candidates.sort(dim=1)
    sq, perm = sq.gather(1, perm).sort(dim=1, stable=True)
    indices, sq = by_index.gather(1, perm)[:, :k], sq[:, :k]
    if exhaustive:
        certified = torch.ones(nq, dtype=torch.bool, device=device)
    else:
        by_l2 = key_dtype is not None or metric == "l2"
        scale = q_sqnorms.to(device) + max_ref_sqnorm if by_l2 and q_sqnorms is not None else 2.0
        wide = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        bound = key_error_bound(dim, key_dtype or dtype, device) * scale
        left_out = approx_sq.to(device=device, dtype=wide).amax(dim=1) - bound
        certified = sq[:, -1].to(wide) * (1 + (dim + 4) * torch.finfo(dtype).eps) < left_out
    return sqdist_to_values(sq, metric), indices, certified


def candidate_margin(k: int) -> int:
    """Candidates fetched beyond ``k``: enough that a near-tie at the cut rarely needs a retry."""
    return max(4, k // 8)


def exact_search(
    queries: torch.Tensor,
    references: torch.Tensor,
    k: int,
    *,
    metric: str,
    memory_limit_bytes: int,
    ref_neg_sqnorms: torch.Tensor | None = None,
    self_offset: int | None = None,
    exclude: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``k``-NN: ``(values, indices)``, values as in :func:`sqdist_to_values`.

    Candidates by key (:func:`topk_keys`), then :func:`rerank`. Rows that are not certified
    are searched again: first with the same number of candidates ranked by float64 keys
    (float32 references, not on MPS), whose rounding error is about 10⁻⁹ of float32's, which
    certifies the near-ties of concentrated embeddings (a barely trained model's); then, in the
    working precision again, with four times the candidates until certified or exhaustive
    (exact duplicates). The
    ``[rows, candidates]`` lists of a pass are made for as many rows at a time as a quarter of
    the budget holds, so that rows full of ties stay under ``memory_limit_bytes`` too.
    """
    device = references.device
    nq, n = queries.shape[0], references.shape[0]
    exclude, ref_neg_sqnorms = _exclude_and_bias(
        references, metric, ref_neg_sqnorms, nq, self_offset, exclude
    )
    available = n - int(exclude is not None)
    max_ref_sqnorm = 1.0 if metric == "cosine" else float(-ref_neg_sqnorms.min())  # type: ignore[union-attr]
    values = torch.empty(nq, k, dtype=references.dtype, device=device)
    indices = torch.empty(nq, k, dtype=torch.long, device=device)
    rows = torch.arange(nq, device=device)  # rows still to answer

    def pass_budget(num_rows: int, width: int, key_dtype: torch.dtype | None) -> tuple[int, int]:
        # rows per chunk (their candidate lists within a quarter of the budget) and what is left
        # of the budget for topk_keys' and rerank's temporaries
        key_size = torch.finfo(key_dtype or references.dtype).bits // 8
        per_row = width * (_CANDIDATE_INDEX_ARRAYS * _INDEX_BYTES + _CANDIDATE_VALUE_ARRAYS * key_size)
        lists = min(num_rows, max(1, (memory_limit_bytes // 4) // per_row))
        return lists, max(memory_limit_bytes - lists * per_row, memory_limit_bytes // 2)

    width = min(available, k + candidate_margin(k))
    if not _fits(*pass_budget(nq, width, None), references=references, k=width):
        width = k  # no margin within the budget: rows that cannot be certified are retried
    wider_keys = references.dtype != torch.float64 and device.type != "mps"
    key_dtype: torch.dtype | None = None
    biases, max_sq = ref_neg_sqnorms, max_ref_sqnorm
    first = True
    while True:
        lists, inner = pass_budget(rows.shape[0], width, key_dtype)
        if not first and not _fits(lists, inner, references=references, k=width, key_dtype=key_dtype):
            sub_exclude = None if exclude is None else exclude[rows]
            v, i = exhaustive_search(
                queries[rows.to(queries.device)], references, k, metric=metric,
                memory_limit_bytes=memory_limit_bytes, exclude=sub_exclude,
            )  # fmt: skip
            values[rows], indices[rows] = v, i
            return values, indices
        # which rows to retry, as one mask: a small tensor kept per part would pin glibc's heap
        # between the parts' large temporaries
        retry = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
        at = 0
        for part in rows.split(lists):
            whole = first and part.shape[0] == nq
            sub = queries if whole else queries[part.to(queries.device)]
            sub_exclude = exclude if exclude is None or whole else exclude[part]
            keys, cand, q_sq = topk_keys(
                sub, references, width, metric=metric, memory_limit_bytes=inner,
                ref_neg_sqnorms=biases, exclude=sub_exclude, key_dtype=key_dtype,
            )  # fmt: skip
            approx_sq = 2 - 2 * keys if metric == "cosine" and key_dtype is None else q_sq[:, None] - keys
            del keys
            v, i, ok = rerank(
                sub, references, cand, approx_sq, k, metric=metric, memory_limit_bytes=inner,
                exhaustive=width >= available, q_sqnorms=q_sq, max_ref_sqnorm=max_sq, key_dtype=key_dtype,
            )  # fmt: skip
            del cand, approx_sq
            if whole and bool(ok.all()):
                return v, i
            values[part[ok]], indices[part[ok]] = v[ok], i[ok]
            torch.logical_not(ok, out=retry[at : at + part.shape[0]])
            at += part.shape[0]
        rows, first = rows[retry], False
        if rows.shape[0] == 0:
            return values, indices
        if wider_keys and width < available:  # one float64 pass, at the first width only
            key_dtype, wider_keys = torch.float64, False
            biases = wide_neg_sqnorms(references, key_dtype)
            max_sq = float(-biases.min())
        else:
            # what float64 keys cannot certify are ties within their rounding (duplicates): the
            # working precision's keys find those as well, at half the cost
            key_dtype, biases, max_sq = None, ref_neg_sqnorms, max_ref_sqnorm
            width = min(available, 4 * width)


def _fits(
    num_queries: int,
    memory_limit_bytes: int,
    *,
    references: torch.Tensor,
    k: int,
    key_dtype: torch.dtype | None = None,
) -> bool:
    wide = key_dtype is not None and key_dtype != references.dtype
    itemsize = torch.finfo(key_dtype).bits // 8 if wide else references.element_size()  # type: ignore[arg-type]
    try:
        plan_chunks(num_queries, references.shape[0], references.shape[1], k, itemsize, memory_limit_bytes,
                    upcast=wide)  # fmt: skip
    except ValueError:
        return False
    return True


def exhaustive_search(
    queries: torch.Tensor,
    references: torch.Tensor,
    k: int,
    *,
    metric: str,
    memory_limit_bytes: int,
    exclude: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k-NN by ``||q - r||²`` from the differences against every reference (no keys, no BLAS).

    The fallback of :func:`exact_search` for rows whose near-ties need more candidates than
    the memory budget allows: ``O(N D)`` work per row, in chunks of ``[rows, cols, D]`` under
    half the budget, merged by (distance, index) as :func:`topk_keys` merges keys.
    """
    device, dtype = references.device, references.dtype
    nq, (n, dim) = queries.shape[0], references.shape
    itemsize = references.element_size()
    # per (row, column) cell: the difference vector, its squared norm, and the merge's sort of
    # values with their indices (concatenated, sorted, permutation)
    cells = max(1, (memory_limit_bytes // 2) // ((dim + 3) * itemsize + 3 * _INDEX_BYTES))
    rows = max(1, min(nq, cells // n)) if cells >= n else 1
    cols = n if cells >= n else max(k, cells)
    values = torch.empty(nq, k, dtype=dtype, device=device)
    indices = torch.empty(nq, k, dtype=torch.long, device=device)
    for qs in range(0, nq, rows):
        q = prepare(queries[qs : qs + rows].to(device), metric, "queries", dtype)
        best: tuple[torch.Tensor, torch.Tensor] | None = None
        for rs in range(0, n, cols):
            diff = references[None, rs : rs + cols, :] - q[:, None, :]
            sq = diff.square_().sum(dim=2)
            del diff
            if exclude is not None:
                own = exclude[qs : qs + rows].to(device) - rs
                inside = (own >= 0) & (own < sq.shape[1])
                sq[inside.nonzero().squeeze(1), own[inside]] = math.inf
            idx = torch.arange(rs, rs + sq.shape[1], device=device).expand_as(sq)
            best = _keep_best(best, sq, idx, k, descending=False)
        assert best is not None
        values[qs : qs + rows] = sqdist_to_values(best[0], metric)
        indices[qs : qs + rows] = best[1]
    return values, indices
