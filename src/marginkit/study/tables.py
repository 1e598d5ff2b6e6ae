"""Aggregation (mean ± std over seeds) and Markdown tables of the study."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Stat", "markdown_table", "stat"]


class Stat:
    """Mean, sample standard deviation and count of the non-missing values of one cell."""

    def __init__(self, values: Iterable[float | None]) -> None:
        vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        self.n = len(vals)
        self.missing = any(v is None for v in values) if isinstance(values, list) else False
        self.mean = statistics.fmean(vals) if vals else None
        self.std = statistics.stdev(vals) if len(vals) > 1 else (0.0 if vals else None)

    def fmt(self, scale: float = 100.0, digits: int = 1) -> str:
        """``"91.2 ± 1.1"`` (values × ``scale``); ``"n/m"`` when not measurable."""
        if self.mean is None:
            return "not measurable"
        if self.n == 1:
            text = f"{self.mean * scale:.{digits}f} (1 seed)"
        else:
            text = f"{self.mean * scale:.{digits}f} ± {self.std * scale:.{digits}f}"
        return text + (" (some seeds n/m)" if self.missing else "")


def stat(values: Iterable[float | None]) -> Stat:
    return Stat(list(values))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; first column left-aligned, the rest right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
