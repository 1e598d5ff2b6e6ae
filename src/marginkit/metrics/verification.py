"""Verification metrics (TAR@FAR, EER, AUC, minDCF, subject-bootstrap intervals) and pair scores."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from marginkit._validation import accepts_arrays, compute_dtype, positive_float, positive_int
from marginkit.knn._search import check_embeddings, check_labels, prepare
from marginkit.metrics import _roc
from marginkit.metrics._roc import check_pairs
from marginkit.metrics.bootstrap import check_groups, subject_bootstrap

DEFAULT_FARS = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)


def _check_dcf(p_target: float, c_miss: float, c_fa: float) -> tuple[float, float, float]:
    p_target = positive_float(p_target, "p_target")
    if p_target >= 1:
        raise ValueError(f"p_target must lie in (0, 1), got {p_target}")
    return p_target, positive_float(c_miss, "c_miss"), positive_float(c_fa, "c_fa")


@accepts_arrays(scores="float", is_genuine="bool")
def eer(scores: torch.Tensor, is_genuine: torch.Tensor) -> float:
    r"""Equal error rate of pair scores (accept iff score > t).

    The ROC polyline through the operating points ``(FAR(t), FRR(t))``, ``t`` over ``-inf``
    and every distinct score, intersected with ``FAR = FRR`` by linear interpolation.

    Example:
        >>> import torch
        >>> eer(torch.tensor([0.6, 0.8, 0.2, 0.7]), torch.tensor([True, True, False, False]))
        0.5
    """
    scores, is_genuine = check_pairs(scores, is_genuine)
    if _roc.numpy_path(scores):  # no sort: a histogram of the float bits, then the crossing bin
        return _roc.eer_by_histogram(scores, is_genuine)
    return _roc.eer(*_roc.sides(scores, is_genuine))


@accepts_arrays(scores="float", is_genuine="bool")
def tar_at_far(
    scores: torch.Tensor, is_genuine: torch.Tensor, far: float
) -> tuple[float | None, float | None]:
    r"""TAR at one FAR and its threshold (accept iff score > t): ``(tar, threshold)``.

    The threshold is the exact order statistic of :func:`verification_metrics`: with ``n``
    impostor scores, the smallest impostor score ``t`` with at most ``far * n`` impostors above
    it (ties at ``t`` lie at or below it); TAR is the share of genuine scores above ``t``. Both
    are ``None`` when ``far * n < 1`` (a FAR finer than one impostor cannot be measured). On the
    CPU the order statistic is selected without sorting the scores; the values are identical to
    ``verification_metrics(..., fars=(far,))``'s.

    Example:
        >>> import torch
        >>> scores = torch.tensor([0.9, 0.4, 0.8, 0.3, 0.5])
        >>> tar_at_far(scores, torch.tensor([True, True, False, False, False]), 0.4)
        (0.5, 0.5)
    """
    scores, is_genuine = check_pairs(scores, is_genuine)
    far = positive_float(far, "far")
    if far >= 1:
        raise ValueError(f"far must lie in (0, 1), got {far}")
    if _roc.numpy_path(scores):
        return _roc.tar_at_far_by_histogram(scores, is_genuine, far)
    thresholds, tars = _roc.rates_at_targets(*_roc.sides(scores, is_genuine), (far,))
    return tars[far], thresholds[far]


@accepts_arrays(scores="float", is_genuine="bool")
def min_dcf(
    scores: torch.Tensor,
    is_genuine: torch.Tensor,
    p_target: float = 0.01,
    c_miss: float = 1.0,
    c_fa: float = 1.0,
) -> tuple[float, float]:
    r"""Normalised minimum detection cost (NIST SRE) and the smallest threshold attaining it.

    .. math::
        \text{minDCF} = \min_t \frac{c_\text{miss}\, p\, \text{FRR}(t)
        + c_\text{fa} (1 - p)\, \text{FAR}(t)}{\min(c_\text{miss} p,\ c_\text{fa} (1 - p))}

    over ``t`` in ``-inf`` and every distinct score (accept iff score > t).

    Returns:
        ``(min_dcf, threshold)``.

    Example:
        >>> import torch
        >>> min_dcf(torch.tensor([0.9, 0.8, 0.1]), torch.tensor([True, True, False]), p_target=0.5)
        (0.0, 0.10000000149011612)
    """
    scores, is_genuine = check_pairs(scores, is_genuine)
    p_target, c_miss, c_fa = _check_dcf(p_target, c_miss, c_fa)
    return _roc.min_dcf(*_roc.sides(scores, is_genuine), p_target, c_miss, c_fa)


@accepts_arrays(scores="float", is_genuine="bool", groups="int")
def verification_metrics(
    scores: torch.Tensor,
    is_genuine: torch.Tensor,
    fars: Sequence[float] = DEFAULT_FARS,
    *,
    p_target: float = 0.01,
    c_miss: float = 1.0,
    c_fa: float = 1.0,
    bootstrap: int = 0,
    groups: torch.Tensor | None = None,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, object]:
    r"""TAR at fixed FARs (with thresholds), EER, ROC AUC and minDCF of pair scores.

    Decision rule: a pair is *accepted iff score > t* (strictly). For ``n`` impostor scores,

    .. math::
        \text{FAR}(t) = \tfrac{1}{n}\#\{\text{impostor} > t\},\qquad
        \text{TAR}(t) = \tfrac{1}{n_g}\#\{\text{genuine} > t\}.

    TAR@FAR (exact order statistics, ties counted honestly): with ``m = floor(FAR n)`` false
    accepts allowed, ``t`` is the (m+1)-th largest impostor score, the smallest threshold with
    ``FAR(t) <= FAR`` (impostors tied with it are rejected with it, so the realised FAR may be
    below the target). A target ``FAR < 1/n`` cannot be measured with ``n`` impostor pairs:
    its TAR and threshold are ``None``, not a number.

    EER: see :func:`eer`. AUC: the Mann-Whitney statistic ``P(g > i) + P(g = i)/2`` (equal to
    the trapezoidal ROC area). minDCF: see :func:`min_dcf`. Each class of scores is sorted
    once; every metric is then binary searches over the two sorted copies.

    Confidence intervals (``bootstrap=N`` with ``groups``): percentile intervals at level
    ``confidence`` for TAR@FAR and EER from ``N`` replicates that resample *subjects*, see
    :mod:`marginkit.metrics.bootstrap` (a pair is kept iff both its subjects are drawn, with
    multiplicity). ``pair_scores(..., return_pairs=True)`` gives the pairs; ``labels[pairs]``
    are their subjects.

    Args:
        scores: ``[P]`` pair scores, larger meaning more likely genuine (e.g. cosines).
        is_genuine: ``[P]`` bool (or 0/1) tensor; both kinds of pair must be present.
        fars: target false-accept rates in ``(0, 1)``.
        p_target, c_miss, c_fa: detection-cost parameters (stated in the output).
        bootstrap: number of bootstrap replicates (0: no intervals).
        groups: ``[P, 2]`` integer subject ids of each pair's two sides (or ``[P]``, one
            subject per pair); required with ``bootstrap``.
        seed: seed of the bootstrap draws.
        confidence: interval level in ``(0, 1)``.

    Returns:
        ``{"tar_at_far": {far: float | None}, "thresholds": {far: float | None}, "eer",
        "auc", "min_dcf", "min_dcf_threshold": float, "dcf_params": {...},
        "num_genuine", "num_impostor": int, "decision": "accept iff score > threshold"}``,
        plus ``"confidence_intervals"`` with ``bootstrap`` (``{"level", "method",
        "replicates", "valid_replicates", "num_subjects", "seed", "tar_at_far": {far: (lo,
        hi) | None}, "eer": (lo, hi)}``).

    Example:
        >>> import torch
        >>> s = torch.tensor([0.9, 0.8, 0.7, 0.3, 0.2, 0.85])
        >>> g = torch.tensor([True, True, True, False, False, False])
        >>> m = verification_metrics(s, g, fars=(0.5, 0.1))
        >>> m["tar_at_far"], m["thresholds"][0.5]
        ({0.5: 1.0, 0.1: None}, 0.30000001192092896)
    """
    scores, is_genuine = check_pairs(scores, is_genuine)
    fars = tuple(float(f) for f in fars)
    for far in fars:
        if not 0 < far < 1:
            raise ValueError(f"fars must lie in (0, 1), got {far}")
    p_target, c_miss, c_fa = _check_dcf(p_target, c_miss, c_fa)
    bootstrap = positive_int(bootstrap, "bootstrap", minimum=0)
    if bootstrap:
        if groups is None:
            raise ValueError("bootstrap needs groups: the subject ids of each pair (e.g. labels[pairs])")
        groups = check_groups(groups, scores.numel()).to(scores.device)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        confidence = positive_float(confidence, "confidence")
        if confidence >= 1:
            raise ValueError(f"confidence must lie in (0, 1), got {confidence}")

    genuine, impostor = _roc.sides(scores, is_genuine)
    thresholds, tar_at_far = _roc.rates_at_targets(genuine, impostor, fars)
    best, best_t = _roc.min_dcf(genuine, impostor, p_target, c_miss, c_fa)
    out: dict[str, object] = {
        "tar_at_far": tar_at_far,
        "thresholds": thresholds,
        "eer": _roc.eer(genuine, impostor),
        "auc": _roc.auc(genuine, impostor),
        "min_dcf": best,
        "min_dcf_threshold": best_t,
        "dcf_params": {"p_target": p_target, "c_miss": c_miss, "c_fa": c_fa, "normalized": True},
        "num_genuine": genuine.count,
        "num_impostor": impostor.count,
        "decision": "accept iff score > threshold",
    }
    if bootstrap:
        assert groups is not None
        out["confidence_intervals"] = subject_bootstrap(
            scores, is_genuine, groups, fars, bootstrap, seed=seed, level=confidence
        )
    return out


@accepts_arrays(embeddings="float", labels="int")
def pair_scores(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    max_impostors: int | None = None,
    seed: int = 0,
    *,
    memory_limit_mb: float = 256.0,
    return_pairs: bool = False,
) -> tuple[torch.Tensor, ...]:
    r"""Cosine scores of all genuine pairs and all (or a seeded sample of) impostor pairs.

    Pairs are unordered, ``i < j``; genuine iff ``labels[i] == labels[j]``. The N x N
    similarity matrix is never held: genuine pairs come from row blocks against their own
    class only (rows sorted by label, so a block's partners are one contiguous range), and
    all impostor pairs from row blocks against the later rows, each block's score matrix
    under ``memory_limit_mb``. With ``max_impostors`` smaller than the number of impostor
    pairs, a uniform sample without replacement of that many impostor pairs is drawn with a
    ``torch.Generator`` seeded by ``seed`` (same inputs and seed, same pairs): by rejection
    from uniform random pairs when the sample is under half of the impostor pairs, else as a
    subset of all of them.

    Args:
        embeddings: ``[N, D]``, ``N >= 2``; rows are L2-normalised (zero rows are an error).
        labels: ``[N]`` integer identities.
        max_impostors: cap on the number of impostor pairs (``None``: all of them).
        seed: seed of the impostor sample.
        memory_limit_mb: budget of one block's score matrix.
        return_pairs: also return the ``[P, 2]`` (i, j) indices of the pairs.

    Returns:
        ``(scores, is_genuine)`` (``[P]`` float32, or float64 for float64 input, and bool),
        genuine pairs first, each group in increasing ``(i, j)`` order; plus ``pairs`` with
        ``return_pairs=True``, whose subjects ``labels[pairs]`` are the ``groups`` of
        :func:`verification_metrics`' subject bootstrap.

    Example:
        >>> import torch
        >>> e = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
        >>> s, g = pair_scores(e, torch.tensor([0, 0, 1]))
        >>> s.tolist(), g.tolist()
        ([1.0, 0.0, 0.0], [True, False, False])
    """
    check_embeddings(embeddings, "embeddings")
    check_labels(labels, "labels", embeddings.shape[0], "embeddings")
    n = embeddings.shape[0]
    if n < 2:
        raise ValueError(f"embeddings must have at least 2 rows to form a pair, got {n}")
    if max_impostors is not None:
        max_impostors = positive_int(max_impostors, "max_impostors")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    budget = max(1, int(positive_float(memory_limit_mb, "memory_limit_mb") * 2**20) // 32)  # cells
    e = prepare(embeddings.detach(), "cosine", "embeddings", compute_dtype(embeddings.dtype))
    device = e.device
    labels = labels.to(device)

    # Genuine pairs: rows sorted by label; a row's partners are the later rows of its class.
    sorted_labels, order = torch.sort(labels, stable=True)
    _, group, counts = torch.unique_consecutive(sorted_labels, return_inverse=True, return_counts=True)
    end_of_class = counts.cumsum(0)[group]  # per sorted row: the end of its class's rows
    class_end = end_of_class.tolist()
    es = e[order]
    # Outputs allocated once and written block by block: a small tensor kept per block, allocated
    # between the blocks' large temporaries, pins glibc's heap, which then grows at every block.
    # The genuine pairs whose first (sorted) row is below s: the later rows of each row's class.
    later = end_of_class - torch.arange(1, n + 1, device=device)
    before = [0, *later.cumsum(0).tolist()]
    num_genuine = before[-1]
    g_scores = e.new_empty(num_genuine)
    g_i = torch.empty(num_genuine, dtype=torch.long, device=device)
    g_j = torch.empty_like(g_i)
    s = 0
    while s < n:
        # Grow the block while (rows x width) fits; width = end of the last row's class - s.
        lo, hi = s + 1, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if (mid - s) * (class_end[mid - 1] - s) <= budget else (lo, mid - 1)
        stop = lo
        width = class_end[stop - 1] - s
        block = es[s:stop] @ es[s : s + width].T
        rows = torch.arange(s, stop, device=device)[:, None]
        cols = torch.arange(s, s + width, device=device)[None, :]
        mask = (cols > rows) & (cols < end_of_class[s:stop, None])
        r, c = mask.nonzero(as_tuple=True)
        at = slice(before[s], before[stop])
        g_scores[at] = block[r, c]
        a, b = order[r + s], order[c + s]
        torch.minimum(a, b, out=g_i[at])
        torch.maximum(a, b, out=g_j[at])
        del block, mask, r, c, a, b
        s = stop
    perm = torch.argsort(g_i * n + g_j)
    g_scores, g_i, g_j = g_scores[perm], g_i[perm], g_j[perm]

    total_impostors = n * (n - 1) // 2 - num_genuine
    if max_impostors is None or 2 * max_impostors >= total_impostors:
        # All impostor pairs (then, for a large sample, a seeded subset of them).
        i_scores = e.new_empty(total_impostors)  # written block by block, as above
        i_i = torch.empty(total_impostors, dtype=torch.long, device=device)
        i_j = torch.empty_like(i_i)
        rows_per_block = max(1, budget // n)
        at = 0
        for s in range(0, n, rows_per_block):
            block = e[s : s + rows_per_block] @ e[s:].T
            rows = torch.arange(s, s + block.shape[0], device=device)[:, None]
            cols = torch.arange(s, n, device=device)[None, :]
            mask = (cols > rows) & (labels[s : s + block.shape[0], None] != labels[None, s:])
            r, c = mask.nonzero(as_tuple=True)
            done = at + r.numel()
            i_scores[at:done] = block[r, c]
            torch.add(r, s, out=i_i[at:done])
            torch.add(c, s, out=i_j[at:done])
            at = done
            del block, mask, r, c
        if max_impostors is not None and max_impostors < total_impostors:
            gen = torch.Generator().manual_seed(seed)
            keep = torch.randperm(total_impostors, generator=gen)[:max_impostors]
            keep = torch.sort(keep).values.to(device)
            i_scores, i_i, i_j = i_scores[keep], i_i[keep], i_j[keep]
    else:
        codes = _sample_impostor_codes(labels, max_impostors, total_impostors, seed).to(device)
        i_i, i_j = codes // n, codes % n
        chunk = max(1, budget // e.shape[1])
        i_scores = e.new_empty(codes.numel())  # written chunk by chunk, as above
        for s in range(0, codes.numel(), chunk):
            torch.sum(e[i_i[s : s + chunk]] * e[i_j[s : s + chunk]], dim=1, out=i_scores[s : s + chunk])
    scores = torch.cat([g_scores, i_scores])
    is_genuine = torch.arange(scores.numel(), device=device) < num_genuine
    if return_pairs:
        pairs = torch.stack([torch.cat([g_i, i_i]), torch.cat([g_j, i_j])], dim=1)
        return scores, is_genuine, pairs
    return scores, is_genuine


def _sample_impostor_codes(labels: torch.Tensor, count: int, total: int, seed: int) -> torch.Tensor:
    """``count`` distinct impostor pairs ``i < j``, uniform, encoded ``i * n + j`` (sorted).

    Draws uniform ordered pairs ``i != j`` (batches, a seeded CPU generator), keeps the
    impostors, de-duplicates, and repeats until ``count`` distinct ones are found; a seeded
    uniform subset of exactly ``count`` is then returned. Every distinct set is equally likely
    because the draws are exchangeable.
    """
    n = labels.shape[0]
    lab = labels.cpu()
    gen = torch.Generator().manual_seed(seed)
    found = torch.empty(0, dtype=torch.long)
    impostor_share = total / (n * (n - 1) / 2)
    while found.numel() < count:
        missing = count - found.numel()
        draws = int(min(1 << 24, math.ceil(missing / impostor_share * 1.25) + 64))
        i = torch.randint(0, n, (draws,), generator=gen)
        j = torch.randint(0, n - 1, (draws,), generator=gen)
        j = j + (j >= i)
        a, b = torch.minimum(i, j), torch.maximum(i, j)
        keep = lab[a] != lab[b]
        found = torch.unique(torch.cat([found, a[keep] * n + b[keep]]))
    if found.numel() > count:
        found = torch.sort(found[torch.randperm(found.numel(), generator=gen)[:count]]).values
    return found
