"""Operating points of sorted genuine and impostor scores: the engine of the verification metrics.

Each class of scores is sorted once, values only (:func:`sort_values`); every operating point is
then a binary search, so TAR@FAR, EER, minDCF and AUC cost ``O(n log n)`` time and ``O(n)``
memory, the sorted copies being the only full-size temporaries. Decision rule throughout:
*accept iff score > t*.

A metric that needs a few order statistics only — the EER (:func:`eer_by_histogram`), a TAR at
one FAR (:func:`tar_at_far_by_histogram`) — needs no sort on the CPU: a histogram of the scores'
float bits (:func:`marginkit.ops.selection.histogram`, one pass to code and one to count) finds
the bins that hold the answer, and only their values are sorted. Every count is the same integer
as the sorted path's and every rate the same float64 expression of it, so the results are
bit-identical to :func:`eer` / :func:`threshold_at_rate` on the sorted sides (tests compare them).

A :class:`Side` may carry integer multiplicities (the subject bootstrap weights pairs by how
often their subjects were drawn) as cumulative sums; without them every score counts once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from marginkit._validation import compute_dtype, float_tensor
from marginkit.ops import selection

_BLOCK = 1 << 18  # candidate thresholds evaluated per step (bounds their temporaries to ~12 MB)
_PROBES = 256  # evaluations per round of the k-ary search
_COST_TIES = 1e-12  # relative: detection costs this close are equal (they differ by rounding only)


def check_pairs(
    scores: object, is_genuine: object, names: tuple[str, str] = ("scores", "is_genuine")
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``[P]`` pair scores and their genuine flags (both kinds present); flags as bool."""
    sn, gn = names
    float_tensor(scores, sn, check_values=False)
    assert isinstance(scores, torch.Tensor)
    if scores.numel() and not all(math.isfinite(float(v)) for v in torch.aminmax(scores)):
        raise ValueError(f"{sn} contains NaN or infinite values")  # min/max propagate NaN: no temporary
    if scores.dim() != 1:
        raise ValueError(f"{sn} must be a 1-D tensor of pair scores, got shape {tuple(scores.shape)}")
    if not isinstance(is_genuine, torch.Tensor):
        raise TypeError(f"{gn} must be a torch.Tensor of bools, got {type(is_genuine).__name__}")
    if is_genuine.dtype != torch.bool:
        if torch.is_floating_point(is_genuine) or torch.is_complex(is_genuine):
            raise TypeError(f"{gn} must be a bool (or 0/1 integer) tensor, got dtype {is_genuine.dtype}")
        if is_genuine.numel() and not 0 <= int(is_genuine.min()) <= int(is_genuine.max()) <= 1:
            raise ValueError(f"{gn} must contain only 0/1 (or bool) values")
        is_genuine = is_genuine.to(torch.bool)
    if is_genuine.shape != scores.shape:
        raise ValueError(
            f"{gn} must have one entry per score: got {sn} of shape {tuple(scores.shape)} "
            f"and {gn} of shape {tuple(is_genuine.shape)}"
        )
    n_gen = int(torch.count_nonzero(is_genuine))  # (a bool sum would widen to int64 first)
    if n_gen == 0:
        raise ValueError(f"{gn} has no genuine pair (no True): TAR, EER and AUC are undefined")
    if n_gen == is_genuine.numel():
        raise ValueError(f"{gn} has no impostor pair (all True): FAR, EER and AUC are undefined")
    return scores, is_genuine


NUMPY_ON_CPU = True  # the CPU fast paths below; tests switch it off to run the torch paths on CPU


def numpy_path(x: torch.Tensor) -> bool:
    """Whether ``x``'s values-only sorts and selections go through numpy (CPU tensors)."""
    return NUMPY_ON_CPU and selection.FAST_CPU and x.device.type == "cpu"


def sort_values(x: torch.Tensor) -> torch.Tensor:
    """A sorted (ascending) copy of 1-D ``x`` in its working precision (float32 or float64).

    :func:`marginkit.ops.selection.sort_values`: on CPU numpy's sort, values only and
    vectorised, where ``torch.sort`` also computes the permutation. Elsewhere ``torch.sort``.
    """
    x = x.detach().to(compute_dtype(x.dtype))
    if not numpy_path(x):
        return torch.sort(x, stable=True).values
    return selection.sort_values(x)


@dataclass(frozen=True)
class Side:
    """Sorted scores of one class; ``cum[j]`` is the weight of the first ``j`` (``None``: 1 each)."""

    values: torch.Tensor
    cum: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return self.values.numel()

    @property
    def total(self) -> int:
        return self.count if self.cum is None else int(self.cum[-1])

    def _mass(self, j: torch.Tensor) -> torch.Tensor:
        return j if self.cum is None else self.cum[j]

    def mass_le(self, t: torch.Tensor) -> torch.Tensor:
        """Weight of the scores ``<= t`` (int64, elementwise in ``t``)."""
        return self._mass(torch.searchsorted(self.values, t, right=True))

    def mass_lt(self, t: torch.Tensor) -> torch.Tensor:
        """Weight of the scores ``< t``."""
        return self._mass(torch.searchsorted(self.values, t, right=False))

    def first_index_with_mass(self, target: int) -> int:
        """Smallest ``j`` with (weight of the first ``j`` scores) ``>= target``, ``0 <= target <= total``."""
        if self.cum is None:
            return target
        return int(torch.searchsorted(self.cum, torch.tensor([target], device=self.cum.device))[0])


def _sorted_selection(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sort_values(x[mask])`` with one copy: the selection is fresh, so it is sorted in place."""
    x = x.detach().to(compute_dtype(x.dtype))
    if numpy_path(x):  # numpy selects without materialising indices (torch: 8 bytes each)
        picked = x.numpy()[mask.numpy()]
        picked.sort()
        return torch.from_numpy(picked)
    return torch.sort(x[mask]).values


def sides(scores: torch.Tensor, is_genuine: torch.Tensor) -> tuple[Side, Side]:
    """Genuine and impostor :class:`Side` of validated pair scores."""
    return Side(_sorted_selection(scores, is_genuine)), Side(_sorted_selection(scores, ~is_genuine))


def threshold_at_rate(side: Side, rate: float) -> float | None:
    r"""Smallest score ``t`` of ``side`` with weight above it ``<= rate * total`` (exact order statistic).

    With ``n`` scores and ``m = floor(rate n)`` allowed above, ``t`` is the (m+1)-th largest;
    scores tied with it lie at or below it. ``-inf`` when every score may lie above; ``None``
    when ``rate * total < 1``: a rate finer than one score cannot be resolved.
    """
    total = side.total
    allowed = rate * total * (1 + 1e-12)  # rate * total an integer up to rounding counts as one
    if allowed < 1:
        return None
    j = side.first_index_with_mass(max(0, math.ceil(total - allowed)))
    return -math.inf if j == 0 else float(side.values[j - 1])


def rates_at_targets(
    accepted: Side, rejected: Side, targets: tuple[float, ...]
) -> tuple[dict[float, float | None], dict[float, float | None]]:
    """At each target rate of ``rejected`` scores above the threshold (FAR, FPIR): the exact
    order-statistic threshold (:func:`threshold_at_rate`) and the share of ``accepted`` scores
    above it (TAR, DIR); both ``None`` where the target cannot be resolved."""
    thresholds: dict[float, float | None] = {}
    rates: dict[float, float | None] = {}
    for rate in targets:
        t = threshold_at_rate(rejected, rate) if rejected.count else None
        thresholds[rate] = t
        if t is None:
            rates[rate] = None
        else:
            tt = torch.tensor([t], dtype=accepted.values.dtype, device=accepted.values.device)
            rates[rate] = float(accepted.total - accepted.mass_le(tt)[0]) / accepted.total
    return thresholds, rates


def rates_at(genuine: Side, impostor: Side, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(FAR(t), FRR(t))`` in float64: impostor weight ``> t`` and genuine weight ``<= t``, as shares."""
    far = (impostor.total - impostor.mass_le(t)).to(torch.float64) / impostor.total
    frr = genuine.mass_le(t).to(torch.float64) / genuine.total
    return far, frr


def _first_true(values: torch.Tensor, pred: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """First index ``i`` of sorted ``values`` with ``pred(values[i])`` (``len`` if none); ``pred`` monotone.

    A k-ary search: each round evaluates ``pred`` at up to 256 positions at once.
    """
    lo, hi = 0, values.numel()  # the answer lies in [lo, hi]
    while lo < hi:
        width = hi - lo
        if width <= _PROBES:
            pos = torch.arange(lo, hi, device=values.device)
        else:
            pos = lo + torch.arange(_PROBES, device=values.device) * width // _PROBES
        ok = pred(values[pos])
        if width <= _PROBES:
            hit = torch.nonzero(ok)
            return lo + int(hit[0, 0]) if hit.numel() else hi
        hit = torch.nonzero(ok)
        if not hit.numel():
            lo = int(pos[-1]) + 1
            continue
        i = int(hit[0, 0])
        if i == 0:
            return lo
        lo, hi = int(pos[i - 1]) + 1, int(pos[i])
    return lo


def eer(genuine: Side, impostor: Side) -> float:
    """Equal error rate: the ROC polyline through ``(FAR(t), FRR(t))``, ``t`` over ``-inf`` and
    every distinct score, intersected with ``FAR = FRR`` by linear interpolation.

    ``d(t) = FAR(t) - FRR(t)`` falls from 1 to -1 as ``t`` rises; the crossing lies between the
    first candidate threshold with ``d <= 0`` and the one before it, both found by search.
    """

    def crossed(t: torch.Tensor) -> torch.Tensor:
        far, frr = rates_at(genuine, impostor, t)
        return far - frr <= 0

    inf = torch.tensor([math.inf], dtype=genuine.values.dtype, device=genuine.values.device)
    firsts = []
    for side in (genuine, impostor):
        i = _first_true(side.values, crossed)
        firsts.append(side.values[i : i + 1] if i < side.count else inf)
    t_j = torch.minimum(*firsts)  # at the largest score FAR = 0 and FRR = 1: it exists
    before = []
    for side in (genuine, impostor):
        i = int(torch.searchsorted(side.values, t_j)[0])
        before.append(side.values[i - 1 : i] if i > 0 else -inf)
    t_prev = torch.maximum(*before)
    far, frr = rates_at(genuine, impostor, torch.cat([t_prev, t_j]))
    d = far - frr
    if d[1] == 0:
        return float(far[1])
    a = d[0] / (d[0] - d[1])
    return float(far[0] + a * (far[1] - far[0]))


def min_dcf(
    genuine: Side, impostor: Side, p_target: float, c_miss: float, c_fa: float
) -> tuple[float, float]:
    r"""``(minDCF, threshold)``: the minimum over ``t`` of ``c_miss p FRR(t) + c_fa (1 - p) FAR(t)``,
    normalised by ``min(c_miss p, c_fa (1 - p))``; the smallest minimising ``t`` (costs equal up
    to a relative 1e-12 count as equal: crossing a tie of both classes can leave the cost
    unchanged mathematically, and rounding must not pick the threshold).

    Only ``t = -inf`` and, for every genuine score ``g``, the largest impostor score below
    ``g`` (and the largest impostor score) can minimise it: raising ``t`` through impostor
    scores only lowers FAR, through genuine scores only raises FRR. ``O(n_genuine log
    n_impostor)`` after the sorts, in blocks.
    """
    imp = impostor.values
    best, best_t = math.inf, -math.inf
    heads = torch.tensor([-math.inf], dtype=imp.dtype, device=imp.device)
    for s in range(0, genuine.count + 1, _BLOCK):
        j = torch.searchsorted(imp, genuine.values[s : s + _BLOCK])  # impostors below each genuine
        t = torch.where(j > 0, imp[(j - 1).clamp_min(0)], -math.inf)
        if s + _BLOCK > genuine.count:  # the last block also takes the largest impostor score
            t = torch.cat([t, imp[-1:]])
        if s == 0:
            t = torch.cat([heads, t])
        far, frr = rates_at(genuine, impostor, t)
        dcf = c_miss * p_target * frr + c_fa * (1 - p_target) * far
        low = float(dcf.min())
        if low < best * (1 - _COST_TIES):  # costs within rounding of each other count as equal
            i = int(torch.nonzero(dcf <= low + _COST_TIES * low)[0, 0])
            best, best_t = float(dcf[i]), float(t[i])
    return best / min(c_miss * p_target, c_fa * (1 - p_target)), best_t


def auc(genuine: Side, impostor: Side) -> float:
    """Mann-Whitney AUC ``P(g > i) + P(g = i)/2`` (unweighted sides), in blocks of genuine scores."""
    total = 0
    for s in range(0, genuine.count, _BLOCK):
        g = genuine.values[s : s + _BLOCK]
        total += int((impostor.mass_lt(g) + impostor.mass_le(g)).sum())
    return total / (2 * genuine.count * impostor.count)


# ------------------------------------------------------------------ order statistics without a sort
def _working_numpy(scores: torch.Tensor, is_genuine: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    return scores.detach().to(compute_dtype(scores.dtype)).numpy(), is_genuine.numpy()


def _rate(count: int, total: int) -> float:
    """``count / total`` in float64, as :func:`rates_at` computes it (int64 -> float64, divided)."""
    return float(np.float64(count) / np.float64(total))


def eer_by_histogram(scores: torch.Tensor, is_genuine: torch.Tensor) -> float:
    """:func:`eer` of validated CPU pair scores without sorting them; the same float.

    The ROC crossing ``t_j`` (the smallest score with ``FAR(t) - FRR(t) <= 0``) lies in the first
    non-empty bin whose cumulative counts cross (the bins are value intervals, the rates monotone
    in the counts); its predecessor ``t_prev`` in that bin or the last value of the previous
    non-empty bin. Those two bins' values are extracted and sorted; counts below them come from
    the histogram.
    """
    a, y = _working_numpy(scores, is_genuine)
    codes, counts, g_counts, order = selection.flagged_histogram(a, y)
    i_counts = counts - g_counts
    g_cum, i_cum = np.cumsum(g_counts), np.cumsum(i_counts)
    n_gen, n_imp = int(g_cum[-1]), int(i_cum[-1])
    d = (n_imp - i_cum).astype(np.float64) / n_imp - g_cum.astype(np.float64) / n_gen
    r = int(np.argmax((d <= 0) & (counts > 0)))  # the top bin crosses (FAR 0, FRR 1)
    earlier = np.flatnonzero(counts[:r])
    first = int(earlier[-1]) if earlier.size else r  # the bins [first, r] hold both points
    size = int(counts[r] + (counts[first] if first != r else 0))
    vals, gen = selection.take_bins(a, y, codes, (order[r], order[first]), size)
    srt = np.argsort(vals, kind="stable")
    vals, gen = vals[srt], gen[srt]
    g_le = int(g_cum[first] - g_counts[first]) + np.cumsum(gen)
    i_le = int(i_cum[first] - i_counts[first]) + np.cumsum(~gen)
    last = np.r_[vals[1:] != vals[:-1], True]  # counts "<= t" at the last of equal values
    cand_d = (n_imp - i_le[last]).astype(np.float64) / n_imp - g_le[last].astype(np.float64) / n_gen
    j = int(np.argmax(cand_d <= 0))
    points = [(0, 0) if j == 0 else (int(i_le[last][j - 1]), int(g_le[last][j - 1]))]  # (-inf: none)
    points.append((int(i_le[last][j]), int(g_le[last][j])))
    far = [_rate(n_imp - i, n_imp) for i, _ in points]
    frr = [_rate(g, n_gen) for _, g in points]
    d0, d1 = far[0] - frr[0], far[1] - frr[1]
    if d1 == 0:
        return far[1]
    step = d0 / (d0 - d1)
    return float(far[0] + step * (far[1] - far[0]))


def tar_at_far_by_histogram(
    scores: torch.Tensor, is_genuine: torch.Tensor, far: float
) -> tuple[float | None, float | None]:
    """``(TAR, threshold)`` at one FAR of validated CPU pair scores without sorting them.

    The same order statistic as :func:`threshold_at_rate` (the ``j``-th smallest impostor score,
    ``j = ceil(n - far n)``) and the same TAR as :func:`rates_at_targets`: the bin holding the
    ``j``-th impostor is found from the histogram, its values partitioned; ``(None, None)`` when
    the FAR is finer than one impostor.
    """
    a, y = _working_numpy(scores, is_genuine)
    n_imp = int(y.size - np.count_nonzero(y))
    n_gen = int(y.size - n_imp)
    allowed = far * n_imp * (1 + 1e-12)
    if allowed < 1:
        return None, None
    j = max(0, math.ceil(n_imp - allowed))
    if j == 0:
        return 1.0, -math.inf
    codes, counts, g_counts, order = selection.flagged_histogram(a, y)
    i_cum = np.cumsum(counts - g_counts)
    r = int(np.searchsorted(i_cum, j))  # first bin with j impostors at or below it
    vals, gen = selection.take_bins(a, y, codes, (order[r], order[r]), int(counts[r]))
    imp = vals[~gen]
    q = j - int(i_cum[r - 1] if r else 0) - 1
    t = np.partition(imp, q)[q]
    g_le = int(np.sum(g_counts[:r])) + int(np.count_nonzero(vals[gen] <= t))
    return float(n_gen - g_le) / n_gen, float(t)
