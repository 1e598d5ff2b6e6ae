"""Paired comparisons over seeds and the verdict rules of the study, fixed before any run.

A *comparison* pits a claim's side ``a`` against ``b`` on the same seeds (same data subset,
initialisation and batch order), so the unit of evidence is the per-seed difference
``d_i = a_i - b_i``. Its 95 % interval is the percentile bootstrap over seeds (Efron &
Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13): resample the ``n`` differences
with replacement ``n_boot`` times (seeded), take the 2.5 % and 97.5 % quantiles of the means.

Rules (:func:`outcome`, :func:`grade`):

- a comparison is **won** when its interval lies above zero (``lo > 0``), **lost** when it
  lies below (``hi < 0``), **tied** otherwise — a higher mean inside the noise is a tie;
- a claim is **supported** when it wins at least 80 % of its comparisons and loses none,
  **contradicted** when it loses at least half of them, **not supported** when it wins none,
  and **mixed** otherwise; with no measurable comparison it is **not measured**.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["MIN_SEEDS", "Comparison", "compare", "grade", "outcome", "paired_bootstrap"]

#: Fewer paired seeds than this and a comparison is not measured.
MIN_SEEDS = 3
N_BOOT = 10_000


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], *, n_boot: int = N_BOOT, seed: int = 0
) -> tuple[float, float, float]:
    """Mean per-seed difference ``a - b`` and its 95 % percentile-bootstrap interval.

    >>> m, lo, hi = paired_bootstrap([0.9, 0.8, 0.85], [0.7, 0.7, 0.7])
    >>> round(m, 3), lo > 0
    (0.15, True)
    """
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"a and b must be equal-length non-empty sequences, got {len(a)} and {len(b)}")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(d.mean()), float(lo), float(hi)


@dataclass
class Comparison:
    """One paired comparison: ``a`` vs ``b`` on ``n`` seeds, difference and interval in a's units."""

    label: str
    a: str
    b: str
    n: int
    mean_a: float | None
    mean_b: float | None
    diff: float | None
    lo: float | None
    hi: float | None
    result: str  # "win" | "loss" | "tie" | "not measured"

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self, scale: float = 100.0, unit: str = " pts") -> str:
        if self.diff is None:
            return f"{self.label}: not measured ({self.n} paired seeds)"
        return (
            f"{self.label}: {self.a} {self.mean_a * scale:.1f} vs {self.b} {self.mean_b * scale:.1f}, "
            f"Δ {self.diff * scale:+.1f}{unit} [{self.lo * scale:+.1f}, {self.hi * scale:+.1f}] "
            f"→ {self.result}"
        )


def outcome(lo: float, hi: float) -> str:
    """``"win"`` if the interval is above zero, ``"loss"`` if below, else ``"tie"``."""
    if lo > 0:
        return "win"
    if hi < 0:
        return "loss"
    return "tie"


def compare(
    label: str, a_name: str, a: dict[int, float | None], b_name: str, b: dict[int, float | None]
) -> Comparison:
    """Pair ``a`` and ``b`` (``{seed: value}``) on their common measured seeds and bootstrap."""
    seeds = sorted(
        s
        for s in set(a) & set(b)
        if a[s] is not None and b[s] is not None and math.isfinite(a[s]) and math.isfinite(b[s])
    )
    if len(seeds) < MIN_SEEDS:
        return Comparison(label, a_name, b_name, len(seeds), None, None, None, None, None, "not measured")
    va, vb = [float(a[s]) for s in seeds], [float(b[s]) for s in seeds]
    diff, lo, hi = paired_bootstrap(va, vb)
    return Comparison(
        label,
        a_name,
        b_name,
        len(seeds),
        float(np.mean(va)),
        float(np.mean(vb)),
        diff,
        lo,
        hi,
        outcome(lo, hi),
    )


def grade(comparisons: Sequence[Comparison]) -> str:
    """The claim's verdict from its comparisons (rules in the module docstring)."""
    measured = [c for c in comparisons if c.result != "not measured"]
    if not measured:
        return "not measured"
    wins = sum(c.result == "win" for c in measured)
    losses = sum(c.result == "loss" for c in measured)
    if wins >= 0.8 * len(measured) and losses == 0:
        return "supported"
    if losses >= 0.5 * len(measured):
        return "contradicted"
    if wins == 0:
        return "not supported"
    return "mixed"


#: standard errors the best tuning trial must clear (:func:`tuned_beats_defaults`)
RULE_Z = 1.96


def difference_se(p1: float, p2: float, n: int) -> float:
    """Standard error of a difference of two proportions on ``n`` samples each,
    ``sqrt((p1 (1 - p1) + p2 (1 - p2)) / n)``."""
    return math.sqrt((p1 * (1 - p1) + p2 * (1 - p2)) / n)


def tuned_beats_defaults(best: float, defaults: float, n: int, z: float = RULE_Z) -> bool:
    """The rule that moves a registry default: the best tuning trial's validation accuracy
    exceeds the defaults' by more than ``z`` standard errors of a difference of two
    proportions on ``n`` validation samples (:func:`difference_se`).

    Conservative on purpose: the best of several noisy trials is biased upwards (the
    winner's curse), and one development draw is one draw.
    """
    return best - defaults > z * difference_se(best, defaults, n)
