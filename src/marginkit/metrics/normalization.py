r"""Cohort score normalisation of speaker verification: Z-, T-, S- and adaptive S-norm (AS-norm).

For a trial ``(e, t)`` with raw score ``s``, let ``S_e`` be the scores of the enrollment side
``e`` against a cohort of impostor models and ``S_t`` those of the test side (Auckenthaler,
Carey, Lloyd-Thomas, "Score normalization for text-independent speaker verification
systems", DSP 2000; Matějka et al., "Analysis of score normalization in multilingual speaker
recognition", Interspeech 2017):

.. math::
    z = \frac{s - \mu(S_e)}{\sigma(S_e)},\qquad t = \frac{s - \mu(S_t)}{\sigma(S_t)},\qquad
    \text{S-norm} = \tfrac12 (z + t),

and AS-norm is S-norm with ``μ`` and ``σ`` taken over the ``top_k`` largest scores of ``S_e``
and of ``S_t`` only (``top_k`` with Z- or T-norm gives their adaptive forms). ``σ`` is the
population standard deviation (divisor ``k``, as numpy's default).

Memory. A score matrix of 10⁷ trials against a 10⁴ cohort (400 GB in float32) cannot be held,
but its normalisation only needs two numbers per trial side: :class:`CohortStats`. They are
computed once per enrollment and test *embedding* (:func:`cohort_stats`: chunks of rows
scored against the cohort, each chunk's scores reduced to ``μ, σ``, on CPU by a worker
thread while the next chunk is scored), and trials index into them (``trials``). Every
function here keeps its temporaries under ``memory_limit_mb``; not counted are its inputs and
its outputs (the ``[T]`` normalised scores; 16 bytes per row of ``CohortStats``). Within the
budget a chunk's score block is kept to about 128 MB (on CPU its two blocks together; at
least 256 rows). :func:`cohort_stats` with ``C`` cohort rows of dimension ``D`` and
``b``-byte values (4: float32, 8: float64) holds ``2·C·D·b`` bytes (the cohort's cast and
normalised copy) plus, per row of a chunk, ``C·b`` (its scores; ``2·C·b`` on CPU, where two
chunks are in flight), ``3·D·b`` (its normalised embedding, the next chunk's being prepared)
and at most ``8·top_k + 32``
bytes (the float64 tiles in which the kept scores' mean and deviations are taken, without
``top_k`` all ``C``; the row's statistics and their checks). Off CPU that last term is
``(24 + b)·top_k + 32`` (``torch.topk``'s values and indices, their float64 copy and
deviations). On CPU the top-k selection (numpy's introselect) reorders a chunk's scores in
place (a copy of them, for score matrices given), its rows split over the torch threads.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from marginkit._validation import (
    accepts_arrays,
    choice,
    compute_dtype,
    float_tensor,
    label_tensor,
    positive_float,
    positive_int,
)
from marginkit.knn._search import check_embeddings, prepare
from marginkit.metrics._roc import numpy_path

METHODS = ("s-norm", "as-norm", "z-norm", "t-norm")
_TRIAL_BYTES = 96  # per trial and chunk: 4 gathered float64 statistics, the score, results, indices
# Trials per chunk at most: their float64 buffers stay in cache, and torch runs an op of this
# size in one thread (its grain size): no thread wake-up per op, which costs most under load.
_TRIAL_CHUNK = 2**15
# A chunk's score blocks together (cohort_stats keeps two on CPU): each chunk is one product,
# whose BLAS wakes its threads and packs the cohort again, so not small (and at least _MIN_ROWS
# rows); beyond this size only memory grows.
_BLOCK_BYTES = 128 * 2**20
_MIN_ROWS = 256
_TILE_BYTES = 2**20  # float64 workspace of _moments per thread: a tile of rows, cache-sized
_PARALLEL_MIN = 2**20  # values of a block below which its selection stays in one thread


@dataclass(frozen=True)
class CohortStats:
    """Cohort statistics of ``N`` trial sides: ``mean``/``std`` (``[N]`` float64) of their cohort scores.

    ``top_k``: the statistics cover each side's ``top_k`` largest cohort scores (``None``: all
    ``cohort_size`` of them).
    """

    mean: torch.Tensor
    std: torch.Tensor
    top_k: int | None
    cohort_size: int

    def __len__(self) -> int:
        return self.mean.numel()

    @classmethod
    def from_scores(
        cls, cohort_scores: torch.Tensor, *, top_k: int | None = None, memory_limit_mb: float = 256.0
    ) -> CohortStats:
        """Statistics of each row of a ``[N, C]`` cohort score matrix, in row chunks."""
        return _stats_from_scores(cohort_scores, "cohort_scores", top_k, _budget(memory_limit_mb))


def _budget(memory_limit_mb: float) -> int:
    return int(positive_float(memory_limit_mb, "memory_limit_mb") * 2**20)


def _check_top_k(top_k: int | None, cohort_size: int, name: str) -> int | None:
    if top_k is None:
        return None
    top_k = positive_int(top_k, "top_k", minimum=2)  # one score has no spread
    if top_k > cohort_size:
        raise ValueError(f"top_k={top_k} exceeds the cohort size of {name} ({cohort_size} scores per row)")
    return top_k


def _row_bytes(cohort_size: int, top_k: int | None, itemsize: int, like: torch.Tensor) -> int:
    """Bytes per row of a chunk of scores reduced by :func:`_reduce` (``like``: on its device).

    The row's scores; its share of the float64 tiles of :func:`_moments` on CPU, elsewhere
    ``torch.topk``'s values and indices with their float64 copy and deviations; its statistics
    and their checks.
    """
    width = top_k or cohort_size
    return cohort_size * itemsize + width * (8 if numpy_path(like) else 24 + itemsize) + 32


def _rows_per_chunk(per_row: int, fixed: int, budget: int, what: str, block_row: int | None = None) -> int:
    """Rows per chunk under the budget; with ``block_row`` (bytes), at most a ``_BLOCK_BYTES`` block."""
    rows = (budget - fixed) // per_row
    if rows < 1:
        need = (fixed + per_row) / 2**20
        raise ValueError(
            f"memory_limit_mb={budget / 2**20:.4g} is too small for {what}: at least {need:.3g} MB"
        )
    if block_row is not None:
        rows = min(rows, max(_MIN_ROWS, _BLOCK_BYTES // block_row))
    return int(rows)


def _in_parts(fn: Callable[[int, int], None], rows: int, size: int) -> None:
    """``fn(lo, hi)`` over ``[0, rows)`` split into contiguous parts, one per torch thread.

    For numpy's selections and reductions, which release the GIL; a block of under
    ``_PARALLEL_MIN`` values runs in the calling thread (a thread costs more than it saves).
    """
    parts = min(torch.get_num_threads(), rows, size // _PARALLEL_MIN)
    if parts <= 1:
        fn(0, rows)
        return
    cuts = [rows * i // parts for i in range(parts + 1)]
    with ThreadPoolExecutor(parts - 1) as pool:
        done = [pool.submit(fn, lo, hi) for lo, hi in pairwise(cuts[1:])]
        fn(0, cuts[1])
        for f in done:
            f.result()


def _moments(kept: np.ndarray, mean: np.ndarray, std: np.ndarray) -> None:
    """``mean`` and ``std`` (float64, population) of each row of ``kept``, written in place.

    Two passes (mean, then the mean squared deviation) over a float64 copy of a tile of
    rows that stays in cache, reused: never a float64 copy of the whole block.
    """
    rows, width = kept.shape
    tile = min(rows, max(1, _TILE_BYTES // (8 * width)))
    work = np.empty((tile, width))
    for s in range(0, rows, tile):
        w = work[: min(tile, rows - s)]
        np.copyto(w, kept[s : s + tile])
        m, sd = mean[s : s + tile], std[s : s + tile]
        np.mean(w, axis=1, out=m)
        np.subtract(w, m[:, None], out=w)
        np.square(w, out=w)
        np.mean(w, axis=1, out=sd)
        np.sqrt(sd, out=sd)


def _reduce_numpy(
    block: torch.Tensor, top_k: int | None, scratch: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_reduce`'s statistics on CPU: numpy's introselect (``np.partition``), in place.

    ``scratch``: a buffer into which ``block`` is copied first (then ``block`` is not
    reordered); rows are split over the torch threads (:func:`_in_parts`).
    """
    a = block.numpy()
    rows, c = a.shape
    work = a if top_k is None or scratch is None else scratch[: a.size].numpy().reshape(a.shape)
    mean, std = np.empty(rows), np.empty(rows)

    def part(lo: int, hi: int) -> None:
        x = work[lo:hi]
        if top_k is not None:
            if work is not a:
                np.copyto(x, a[lo:hi])
            x.partition(c - top_k, axis=1)
            x = x[:, c - top_k :]
        _moments(x, mean[lo:hi], std[lo:hi])

    _in_parts(part, rows, a.size)
    return torch.from_numpy(mean), torch.from_numpy(std)


def _empty(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(size)`` of float32 or float64; on CPU numpy's, which asks for huge pages.

    numpy advises the kernel to back large arrays with transparent huge pages (``madvise``):
    a 128 MB block then costs 64 page faults instead of 32768.
    """
    if device.type == "cpu":
        return torch.from_numpy(np.empty(size, dtype=np.float64 if dtype == torch.float64 else np.float32))
    return torch.empty(size, dtype=dtype, device=device)


def _scratch(rows: int, cols: int, top_k: int | None, like: torch.Tensor) -> torch.Tensor | None:
    """The reused buffer of :func:`_reduce_numpy` for chunks of ``rows x cols`` (None when not needed)."""
    if top_k is None or not numpy_path(like):
        return None
    return _empty(rows * cols, compute_dtype(like.dtype), like.device)


def _scores(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = q @ k.T``: numpy's BLAS on CPU, ``torch.mm`` elsewhere.

    numpy's BLAS threads follow ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS``, not
    ``torch.set_num_threads``.
    """
    # Which BLAS is faster depends on the CPU; benchmarks/bench_metrics.py times both on this
    # product, and torch's (MKL) was the slower on the AMD EPYC measured (docs/knn_and_metrics.md).
    if numpy_path(out):
        np.matmul(q.numpy(), k.numpy().T, out=out.numpy())
        return out
    return torch.mm(q, k.T, out=out)


def _reduce(
    block: torch.Tensor,
    top_k: int | None,
    name: str,
    offset: int,
    scratch: torch.Tensor | None = None,
    *,
    owned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)`` in float64 of each row of ``block`` (its ``top_k`` largest entries).

    ``owned``: the block is our own product of validated rows (free to reorder); otherwise, on
    the numpy path, it is copied into ``scratch`` to be reordered. NaN and ``+inf`` sort above
    every number (numpy and torch alike), so they are always kept and show in ``μ``; a ``-inf``
    shows unless ``top_k`` other scores exceed it, when it has no effect: checking ``μ, σ``
    catches every bad value that matters without a pass over the block.
    """
    if numpy_path(block):
        mean, std = _reduce_numpy(block, top_k, None if owned else scratch)
    else:
        kept = block if top_k is None else torch.topk(block, top_k, dim=1, sorted=False).values
        kept = kept.to(torch.float64)
        mean = kept.mean(1)
        std = (kept - mean[:, None]).square_().mean(1).sqrt_()
    bad = (~torch.isfinite(mean) | ~torch.isfinite(std)).nonzero()
    if bad.numel():
        raise ValueError(f"{name} contains NaN or infinite values (row {offset + int(bad[0, 0])})")
    flat = (std == 0).nonzero()
    if flat.numel():
        raise ValueError(
            f"{name} row {offset + int(flat[0, 0])}: its {top_k or block.shape[1]} cohort scores are all "
            "equal (standard deviation 0), so the normalisation would divide by zero"
        )
    return mean, std


def _stats_from_scores(scores: object, name: str, top_k: int | None, budget: int) -> CohortStats:
    float_tensor(scores, name, min_dim=2, allow_empty=True, check_values=False)
    assert isinstance(scores, torch.Tensor)
    if scores.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [rows, cohort], got shape {tuple(scores.shape)}")
    n, c = scores.shape
    if c == 0:
        raise ValueError(f"{name} is an empty cohort: it must hold at least one cohort score per row")
    top_k = _check_top_k(top_k, c, name)
    scores = scores.detach()
    itemsize = torch.finfo(compute_dtype(scores.dtype)).bits // 8
    rows = _rows_per_chunk(_row_bytes(c, top_k, 8, scores), 0, budget, f"one row of {name}", c * itemsize)
    mean = torch.empty(n, dtype=torch.float64, device=scores.device)
    std = torch.empty_like(mean)
    scratch = _scratch(min(rows, n), c, top_k, scores)
    for s in range(0, n, rows):
        block = scores[s : s + rows].to(compute_dtype(scores.dtype))
        mean[s : s + rows], std[s : s + rows] = _reduce(block, top_k, name, s, scratch)
    return CohortStats(mean, std, top_k, c)


@accepts_arrays(embeddings="float", cohort="float")
def cohort_stats(
    embeddings: torch.Tensor,
    cohort: torch.Tensor,
    *,
    top_k: int | None = None,
    memory_limit_mb: float = 256.0,
) -> CohortStats:
    r"""Cohort statistics of each embedding: ``μ, σ`` of its cosine scores against the cohort.

    Rows are L2-normalised; chunks of rows are scored against the whole cohort and reduced
    (to the ``top_k`` largest scores first, for AS-norm; on CPU while the next chunk is
    scored), so the ``[N, C]`` score matrix never exists. The budget covers the normalised
    copy of the cohort and the chunks' temporaries.

    Args:
        embeddings: ``[N, D]`` trial sides (enrollment or test embeddings).
        cohort: ``[C, D]`` cohort embeddings (speakers disjoint from the trials').
        top_k: keep the ``top_k`` largest cohort scores of each row (``2 <= top_k <= C``).
        memory_limit_mb: budget of the temporaries.

    Example:
        >>> import torch
        >>> st = cohort_stats(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]))
        >>> st.mean.tolist(), st.std.tolist()
        ([0.0], [0.816496580927726])
    """
    check_embeddings(embeddings, "embeddings")
    check_embeddings(cohort, "cohort")
    if embeddings.shape[1] != cohort.shape[1]:
        raise ValueError(f"embeddings have dimension {embeddings.shape[1]} but cohort has {cohort.shape[1]}")
    c = cohort.shape[0]
    top_k = _check_top_k(top_k, c, "cohort")
    budget = _budget(memory_limit_mb)
    dtype = compute_dtype(cohort.dtype)
    itemsize = torch.finfo(dtype).bits // 8
    d = cohort.shape[1]
    fixed = 2 * c * d * itemsize  # the cast and the normalised copy of the cohort
    k = prepare(cohort.detach(), "cosine", "cohort", dtype)
    # On CPU a worker thread prepares the next chunk's rows and reduces the last chunk's scores
    # while the BLAS scores this one: two blocks, and no gap between products (in which the
    # BLAS threads would spin, idle).
    blocks = 2 if numpy_path(k) else 1
    per_row = _row_bytes(c, top_k, itemsize, k) + (blocks - 1) * c * itemsize + 3 * d * itemsize
    rows = _rows_per_chunk(per_row, fixed, budget, f"a cohort of {c} x {d}", blocks * c * itemsize)
    n = embeddings.shape[0]
    mean = torch.empty(n, dtype=torch.float64, device=k.device)
    std = torch.empty_like(mean)
    # reused: no fresh pages per chunk
    buffers = [_empty(min(rows, n) * c, dtype, k.device) for _ in range(blocks)]

    def load(s: int) -> torch.Tensor:
        return prepare(embeddings.detach()[s : s + rows].to(k.device), "cosine", "embeddings", dtype)

    def reduce(block: torch.Tensor, s: int) -> None:
        mean[s : s + rows], std[s : s + rows] = _reduce(
            block, top_k, "the cohort scores of embeddings", s, owned=True
        )

    def score(q: torch.Tensor, i: int) -> torch.Tensor:
        return _scores(q, k, buffers[i % blocks][: q.shape[0] * c].view(q.shape[0], c))

    if blocks == 1:
        for i, s in enumerate(range(0, n, rows)):
            reduce(score(load(s), i), s)
        return CohortStats(mean, std, top_k, c)
    with ThreadPoolExecutor(1) as worker:
        ahead, reduced = worker.submit(load, 0), None
        for i, s in enumerate(range(0, n, rows)):
            q = ahead.result()
            if s + rows < n:
                ahead = worker.submit(load, s + rows)
            block = score(q, i)
            if reduced is not None:
                reduced.result()  # the last chunk's, run during this product: the next buffer
            reduced = worker.submit(reduce, block, s)
        if reduced is not None:
            reduced.result()
    return CohortStats(mean, std, top_k, c)


def _side(
    cohort: object, name: str, method: str, top_k: int | None, rows: int | None, budget: int
) -> CohortStats | torch.Tensor:
    """A side's cohort as statistics, or as its ``[T, C]`` score matrix (reduced chunk by chunk)."""
    if cohort is None:
        raise ValueError(f"{name} is required for method={method!r}")
    if isinstance(cohort, CohortStats):
        if top_k is not None and cohort.top_k != top_k:
            raise ValueError(f"top_k={top_k} but {name} holds statistics of top_k={cohort.top_k}")
        effective = cohort.top_k
    else:
        float_tensor(cohort, name, min_dim=2, allow_empty=True, check_values=False)
        assert isinstance(cohort, torch.Tensor)
        if cohort.dim() != 2:
            raise ValueError(
                f"{name} must be a [trials, cohort] score matrix or CohortStats, "
                f"got shape {tuple(cohort.shape)}"
            )
        if cohort.shape[1] == 0:
            raise ValueError(f"{name} is an empty cohort: it must hold at least one cohort score per row")
        _check_top_k(top_k, cohort.shape[1], name)
        effective = top_k
    if method == "as-norm" and effective is None:
        raise ValueError(f"method='as-norm' needs top_k (the number of cohort scores kept); {name} has none")
    if method == "s-norm" and effective is not None:
        raise ValueError(f"{name} uses top_k={effective}: that is adaptive S-norm, method='as-norm'")
    n = len(cohort) if isinstance(cohort, CohortStats) else cohort.shape[0]
    if rows is not None and n != rows:
        raise ValueError(f"{name} must have one row per trial ({rows}), got {n}; or pass trials=")
    if rows is None and isinstance(cohort, torch.Tensor):  # rows shared by trials: reduce once
        return _stats_from_scores(cohort, name, effective, budget)
    return cohort


def _check_trials(trials: object, num: int) -> torch.Tensor:
    label_tensor(trials, "trials")
    assert isinstance(trials, torch.Tensor)
    if trials.shape != (num, 2):
        raise ValueError(
            f"trials must have shape ({num}, 2): the enrollment and test row of each score, got "
            f"{tuple(trials.shape)}"
        )
    return trials


@accepts_arrays(scores="float", enroll_cohort="float", test_cohort="float", trials="int")
def normalize_scores(
    scores: torch.Tensor,
    enroll_cohort: torch.Tensor | CohortStats | None,
    test_cohort: torch.Tensor | CohortStats | None,
    *,
    method: str = "s-norm",
    top_k: int | None = None,
    trials: torch.Tensor | None = None,
    memory_limit_mb: float = 256.0,
) -> torch.Tensor:
    r"""Normalise trial scores against a cohort: Z-, T-, S-norm or adaptive S-norm (AS-norm).

    Formulas in :mod:`marginkit.metrics.normalization`. Each side's cohort is given either as

    - a score matrix: ``enroll_cohort[i]`` are the scores of trial ``i``'s enrollment side
      against the cohort (``[T, C]``; reduced in chunks of trials, each to its ``top_k``
      largest for AS-norm), or
    - :class:`CohortStats` (from :func:`cohort_stats` or :meth:`CohortStats.from_scores`),
      whose ``top_k`` then applies,

    with one row per trial, or one row per enrollment (test) embedding together with
    ``trials[i] = (enroll_row, test_row)``. The last form scales to 10⁷ trials and beyond:
    statistics once per embedding, then ``O(T)`` work in chunks of trials.

    Memory: the temporaries stay under ``memory_limit_mb`` (not counted: the inputs, the
    returned ``[T]`` tensor, and the 16 bytes per row of the statistics into which a score
    matrix is first reduced when ``trials`` is given).

    Args:
        scores: ``[T]`` raw trial scores.
        enroll_cohort, test_cohort: the two sides' cohorts (``test_cohort`` may be ``None``
            for ``"z-norm"``, ``enroll_cohort`` for ``"t-norm"``).
        method: ``"s-norm"``, ``"as-norm"`` (needs ``top_k``), ``"z-norm"`` or ``"t-norm"``.
        top_k: cohort scores kept per side (``2 <= top_k <= C``) for score matrices.
        trials: ``[T, 2]`` integer rows of each trial's sides in the cohorts.
        memory_limit_mb: budget of the temporaries.

    Returns:
        ``[T]`` normalised scores, float32 (float64 for float64 ``scores``).

    Example:
        >>> import torch
        >>> e = torch.tensor([[0.25, 0.75], [0.0, 1.0]])  # means 0.5, deviations 0.25 and 0.5
        >>> normalize_scores(torch.tensor([1.5, 1.5]), e, e.flip(1), method="s-norm").tolist()
        [4.0, 2.0]
    """
    float_tensor(scores, "scores")
    assert isinstance(scores, torch.Tensor)
    if scores.dim() != 1:
        raise ValueError(f"scores must be a 1-D tensor of trial scores, got shape {tuple(scores.shape)}")
    method = choice(method, "method", METHODS)
    budget = _budget(memory_limit_mb)
    num = scores.numel()
    if trials is not None:
        trials = _check_trials(trials, num)
    rows = None if trials is not None else num
    uses = {"enroll_cohort": method != "t-norm", "test_cohort": method != "z-norm"}
    given = {"enroll_cohort": enroll_cohort, "test_cohort": test_cohort}
    side = {
        name: _side(given[name], name, method, top_k, rows, budget) for name, used in uses.items() if used
    }
    if len(side) == 2:
        ks = {s.top_k if isinstance(s, CohortStats) else top_k for s in side.values()}
        if len(ks) > 1:
            raise ValueError(f"enroll_cohort and test_cohort keep different top_k: {sorted(ks, key=str)}")
    if trials is not None and num:
        lows, highs = torch.aminmax(trials, dim=0)  # along the trials: no copy of a column
    for column, name in enumerate(("enroll_cohort", "test_cohort")):
        c = side.get(name)
        if trials is not None and isinstance(c, CohortStats) and num:
            lo, hi = int(lows[column]), int(highs[column])
            if lo < 0 or hi >= len(c):
                raise ValueError(
                    f"trials[:, {column}] must index rows of {name} in [0, {len(c)}), "
                    f"got values in [{lo}, {hi}]"
                )

    per_trial = _TRIAL_BYTES + sum(
        _row_bytes(s.shape[1], top_k, 8, s) for s in side.values() if isinstance(s, torch.Tensor)
    )
    chunk = min(_rows_per_chunk(per_trial, 0, budget, "one trial"), _TRIAL_CHUNK, max(num, 1))
    out = torch.empty(num, dtype=compute_dtype(scores.dtype), device=scores.device)
    scratch = {
        n: _scratch(min(chunk, num), c.shape[1], top_k, c)
        for n, c in side.items()
        if isinstance(c, torch.Tensor)
    }
    # reused per chunk: the score, its normalised sum, one side's statistics and part
    raw, total, mean, std, part = torch.empty(5, chunk, dtype=torch.float64, device=scores.device)
    for s in range(0, num, chunk):
        n = min(chunk, num - s)
        r, acc = raw[:n].copy_(scores[s : s + n].detach()), total[:n]
        for column, name in enumerate(("enroll_cohort", "test_cohort")):
            if name not in side:
                continue
            c = side[name]
            if isinstance(c, torch.Tensor):
                block = c[s : s + n].to(compute_dtype(c.dtype))
                m, sd = (v.to(r.device) for v in _reduce(block, top_k, name, s, scratch[name]))
            elif trials is None:
                m, sd = (v[s : s + n].to(r.device) for v in (c.mean, c.std))
            else:
                idx = trials[s : s + n, column].to(c.mean.device).contiguous()  # strided: 3x slower
                if c.mean.device == r.device:
                    m = torch.index_select(c.mean, 0, idx, out=mean[:n])
                    sd = torch.index_select(c.std, 0, idx, out=std[:n])
                else:
                    m, sd = c.mean[idx].to(r.device), c.std[idx].to(r.device)
            z = torch.sub(r, m, out=part[:n]).div_(sd)
            if column == 0 or "enroll_cohort" not in side:
                acc.copy_(z)
            else:
                acc.add_(z).mul_(0.5)  # (z + t) / 2, exactly: halving is exact
        out[s : s + n] = acc
    return out
