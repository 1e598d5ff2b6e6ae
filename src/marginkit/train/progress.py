"""A minimal progress bar on stderr: epoch, step, running loss, throughput and ETA.

No dependency (no tqdm). It draws only when the stream is a terminal and ``enabled`` is
true; otherwise every call is a no-op, so logs and pipes stay clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar", "format_duration"]


def format_duration(seconds: float) -> str:
    """``75.3`` → ``'1:15'``; ``3725`` → ``'1:02:05'``."""
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?:??"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressBar:
    """Progress over ``total`` steps (all epochs together) drawn on one terminal line.

    Args:
        total: number of steps in the whole run (for the ETA).
        stream: where to draw (default ``sys.stderr``).
        enabled: draw at all; drawing also requires ``stream.isatty()``.
        width: bar width in characters.
        min_interval: seconds between redraws.
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        width: int = 24,
        min_interval: float = 0.1,
        initial: int = 0,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.active = bool(enabled and callable(isatty) and isatty())
        self.total = max(1, int(total))
        self.done = int(initial)
        self._start_done = self.done
        self.width = width
        self.min_interval = min_interval
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._samples = 0
        self._loss: float | None = None
        self.prefix = ""

    def update(
        self, steps: int = 1, *, samples: int = 0, loss: float | None = None, prefix: str = ""
    ) -> None:
        """Advance by ``steps``; ``loss`` feeds an exponential moving average (0.9)."""
        self.done += steps
        self._samples += samples
        if loss is not None:
            self._loss = loss if self._loss is None else 0.9 * self._loss + 0.1 * loss
        if prefix:
            self.prefix = prefix
        if not self.active:
            return
        now = time.perf_counter()
        if now - self._last_draw >= self.min_interval or self.done >= self.total:
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._t0, 1e-9)
        frac = min(1.0, self.done / self.total)
        filled = round(frac * self.width)
        bar = "█" * filled + "·" * (self.width - filled)
        rate = self._samples / elapsed
        steps_done = self.done - self._start_done
        eta = (self.total - self.done) * elapsed / steps_done if steps_done else float("nan")
        loss = f" loss {self._loss:.4f}" if self._loss is not None else ""
        line = (
            f"\r{self.prefix} |{bar}| {100 * frac:5.1f}%{loss} {rate:,.0f} samples/s "
            f"ETA {format_duration(eta)}"
        )
        self.stream.write(line + "\x1b[K")
        self.stream.flush()

    def close(self, *, clear: bool = False) -> None:
        """Finish the line (only if anything was drawn), or erase it with ``clear``."""
        if self.active and self._last_draw:
            self.stream.write("\r\x1b[K" if clear else "\n")
            self.stream.flush()
            self._last_draw = 0.0
