"""Progress on stderr: a tqdm bar on a terminal, plain lines (or nothing) elsewhere.

- :class:`ProgressBar` — the steps of one training run (epoch, running loss, throughput, ETA).
- :class:`StepMeter` — what the training steps report (loss sum, first non-finite step), kept on
  the device and read back only at the read points.
- :class:`RunsProgress` — the runs of a comparison, demo or study: one overall bar with ETA
  that advances with every finished epoch of any run (read from the runs' ``metrics.jsonl``,
  so it also sees runs trained in worker processes), and one line per finished run. Off a
  terminal only the lines are written, each with the elapsed time and the ETA.

Bars are drawn only when the stream is a terminal, so logs and pipes stay clean.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TextIO, TypeVar

import torch

__all__ = ["MeterReading", "ProgressBar", "RunsProgress", "StepMeter", "format_duration"]

T = TypeVar("T")


def format_duration(seconds: float) -> str:
    """``75.3`` → ``'1:15'``; ``3725`` → ``'1:02:05'``."""
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?:??"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _tqdm(**kwargs: Any) -> Any:
    try:
        from tqdm import tqdm
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("training needs tqdm for its progress bars: pip install 'marginkit[cli]'") from exc
    return tqdm(**kwargs)


def _width(stream: Any) -> dict[str, Any]:
    """tqdm's width options: follow the terminal, or 100 columns where it reports none (a
    terminal of size 0, as ``script`` or some ``docker exec -t`` give, would hide the bar)."""
    try:
        if os.get_terminal_size(stream.fileno()).columns > 0:
            return {"dynamic_ncols": True}
    except (AttributeError, OSError, ValueError):
        pass
    return {"ncols": 100}


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(callable(isatty) and isatty())
    except ValueError:  # a closed stream
        return False


class ProgressBar:
    """Progress over ``total`` steps (all epochs of one run together) on one terminal line.

    Args:
        total: number of steps in the whole run (for the ETA).
        stream: where to draw (default ``sys.stderr``).
        enabled: draw at all; drawing also requires ``stream.isatty()``.
        width: bar width in characters.
        min_interval: seconds between redraws.
        initial: steps already done (a resumed run); the ETA counts only the steps from here.
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
        self.active = bool(enabled and _is_terminal(self.stream))
        self._loss: float | None = None
        self._samples = 0
        self._t0 = time.perf_counter()
        self._bar = _tqdm(
            total=max(1, int(total)),
            initial=int(initial),
            file=self.stream,
            disable=not self.active,
            mininterval=min_interval,
            delay=min_interval,  # nothing drawn at creation: a log line may come first
            **_width(self.stream),
            bar_format=f"{{desc}} |{{bar:{width}}}| {{percentage:5.1f}}%{{postfix}} ETA {{remaining}}",
        )

    def update(
        self, steps: int = 1, *, samples: int = 0, loss: float | None = None, prefix: str = ""
    ) -> None:
        """Advance by ``steps``; ``loss`` feeds an exponential moving average (0.9)."""
        if not self.active:
            return
        self._samples += samples
        if loss is not None:
            self._loss = loss if self._loss is None else 0.9 * self._loss + 0.1 * loss
        if prefix:
            self._bar.desc = prefix
        rate = self._samples / max(time.perf_counter() - self._t0, 1e-9)
        loss_text = f"loss {self._loss:.4f} " if self._loss is not None else ""
        self._bar.postfix = f"{loss_text}{rate:,.0f} samples/s"
        self._bar.update(steps)

    def show_loss(self, loss: float) -> None:
        """Show ``loss`` (the mean since the last read point) as the running loss."""
        if self.active and loss == loss:
            self._loss = loss
            rate = self._samples / max(time.perf_counter() - self._t0, 1e-9)
            self._bar.postfix = f"loss {loss:.4f} {rate:,.0f} samples/s"

    def close(self, *, clear: bool = False) -> None:
        """Finish the line (only if anything was drawn), or erase it with ``clear``."""
        self._bar.leave = not clear
        self._bar.close()


class MeterReading(NamedTuple):
    """A :class:`StepMeter` read back: the loss sum of the epoch so far and of the steps since the
    previous read, and the first non-finite step (0-based, ``None`` if none), what was non-finite
    there (``"embeddings"`` or ``"loss"``) and the loss's value at it."""

    loss_sum: float
    window_sum: float
    window_steps: int
    first_bad: int | None
    what: str
    value: float


class StepMeter:
    """What the training steps report, kept on the device without a host read.

    Per step :meth:`add` keeps the loss (a 0-d tensor, detached) and the embeddings' extremes (one
    ``aminmax``, in which a NaN or an infinity shows): the step's bookkeeping is one kernel.
    :meth:`read` is the one place the host waits for them: one copy of the steps' losses and
    extremes, every ``sync_every`` steps and at the epoch's end. The host then finds the index of the
    first step whose embeddings or loss were not finite, which of the two, and the loss there, and
    adds the losses to float64 sums in step order (the same sums, bit for bit, as adding each
    step's float32 loss on the host). Under data parallelism ``gather`` (one collective) puts every
    rank's row in one tensor first (every rank has taken the same steps), and the earliest bad step
    of any rank is reported on all of them. After ``FOLD`` steps without a read the pending steps
    are folded on the device (float64 sums and the first bad step, by ``torch.where``; no read),
    so memory stays bounded whatever ``sync_every``.
    """

    _EMBEDDINGS, _LOSS = 0, 1
    FOLD = 1024

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.loss_sum = 0.0
        self.steps = 0
        self._window_start = 0
        self._losses: list[torch.Tensor] = []
        self._lows: list[torch.Tensor] = []
        self._highs: list[torch.Tensor] = []
        self._folded: torch.Tensor | None = None  # [loss sum, window sum, first bad, what, value]

    @torch.no_grad()
    def add(self, loss: torch.Tensor, embeddings: torch.Tensor) -> None:
        """Account for one step (``loss`` a scalar, ``embeddings`` the model's output)."""
        loss = loss.detach()
        self._losses.append(loss if loss._base is None else loss.clone())
        low, high = torch.aminmax(embeddings.detach())
        self._lows.append(low)
        self._highs.append(high)
        self.steps += 1
        if len(self._losses) >= self.FOLD:
            self._fold()

    def _fold(self) -> None:
        f64 = {"dtype": torch.float64, "device": self._losses[0].device}
        if self._folded is None:  # (fills, not a copy from the host: no wait on the device)
            self._folded = torch.stack(
                [torch.full((), v, **f64) for v in (self.loss_sum, 0.0, -1.0, 0.0, 0.0)]
            )
        loss_sum, window_sum, first_bad, what, value = self._folded.unbind()
        start = self.steps - len(self._losses)
        for i, (loss, low, high) in enumerate(zip(self._losses, self._lows, self._highs, strict=True)):
            v = loss.to(torch.float64)
            emb_ok = torch.isfinite(low) & torch.isfinite(high)
            first = (first_bad < 0) & ~(emb_ok & torch.isfinite(loss))
            first_bad = torch.where(first, float(start + i), first_bad)
            what = torch.where(first, torch.where(emb_ok, float(self._LOSS), float(self._EMBEDDINGS)), what)
            value = torch.where(first, v, value)
            loss_sum = loss_sum + v
            window_sum = window_sum + v
        self._folded = torch.stack([loss_sum, window_sum, first_bad, what, value])
        self._losses, self._lows, self._highs = [], [], []

    @torch.no_grad()
    def read(
        self, gather: Callable[[torch.Tensor], torch.Tensor] | None = None, rank: int = 0
    ) -> MeterReading:
        """The steps since the last read on the host (the read point); the window starts anew.
        ``gather`` maps this rank's packed 1-D row to every rank's ``[world, length]`` (one collective)."""
        k = len(self._losses)
        parts = [] if self._folded is None else [self._folded]
        if k:
            parts += [
                torch.stack(self._losses).to(torch.float64),
                torch.stack(self._lows).to(torch.float64),
                torch.stack(self._highs).to(torch.float64),
            ]
        packed = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=self.device)
        rows = (gather(packed) if gather is not None else packed[None]).cpu().tolist()
        folded = self._folded is not None
        start = self.steps - k
        window_start = self._window_start
        self._losses, self._lows, self._highs, self._folded = [], [], [], None
        self._window_start = self.steps
        bad: list[tuple[int, int, str, float]] = []  # (step, rank, what, value)
        for r, row in enumerate(rows):
            found = _first_bad(row, folded, k, start, self._EMBEDDINGS)
            if found is not None:
                bad.append((found[0], r, found[1], found[2]))
        own = rows[rank if gather is not None else 0]
        window_sum = 0.0
        if folded:  # the fold's sums continued this one and a window from 0.0, step by step
            self.loss_sum, window_sum = own[0], own[1]
            own = own[5:]
        for v in own[:k]:  # in step order, as the steps would have added them
            self.loss_sum += v
            window_sum += v
        first = min(bad) if bad else None
        return MeterReading(
            self.loss_sum,
            window_sum,
            self.steps - window_start,
            None if first is None else first[0],
            "loss" if first is None else first[2],
            0.0 if first is None else first[3],
        )


def _first_bad(
    row: list[float], folded: bool, k: int, start: int, embeddings: int
) -> tuple[int, str, float] | None:
    """The first non-finite step of one rank's read-back row: ``(step, what, loss value)``."""
    if folded:
        if row[2] >= 0:
            return int(row[2]), "embeddings" if int(row[3]) == embeddings else "loss", row[4]
        row = row[5:]
    losses, lows, highs = row[:k], row[k : 2 * k], row[2 * k : 3 * k]
    for i in range(k):
        if not (math.isfinite(lows[i]) and math.isfinite(highs[i])):
            return start + i, "embeddings", losses[i]
        if not math.isfinite(losses[i]):
            return start + i, "loss", losses[i]
    return None


class RunsProgress:
    """Overall progress of a set of runs trained one after another or in worker processes.

    ``tasks`` maps each run's key to ``(units, log)``: its amount of work (its epochs) and the
    ``metrics.jsonl`` it appends one line to per finished epoch (``None``: the run counts
    only when finished). A running run counts at most ``units - 1``: its last unit is its
    evaluation, done when :meth:`finish` is called. Lines of those files written before this
    object was made (an earlier run in the same directory) are not counted. Iterate over the
    work through :meth:`wrap` (which also closes the bar, whatever ends the loop) and call
    :meth:`finish` for every run that ends.

    Runs of very different costs (a study's jobs) can name a cost group each: the ETA is then
    the sum, over the runs not finished, of the mean duration of the finished runs of their
    group, divided by ``workers``. A group is a tuple, most specific last; a run whose group
    has no timed run yet takes the mean of the longest prefix that has one, and one with no
    timed prefix at all is counted and shown as not timed yet, not guessed.

    Args:
        tasks: key → ``(units, metrics.jsonl path or None)``.
        desc: label of the bar.
        unit: name of the units (``"epochs"``).
        enabled: show anything at all (``False`` for ``--quiet``).
        stream: where to draw and write (default ``sys.stderr``).
        write: where the per-run lines go instead of ``stream`` (e.g. a logger).
        poll_interval: seconds between looks at the runs' logs (terminal only).
        groups: key → cost group (a tuple, e.g. ``(kind, data, loss)``); ``None``: the ETA
            assumes every unit costs the same.
        workers: how many runs are computed at once (with ``groups``).
    """

    def __init__(
        self,
        tasks: Mapping[Hashable, tuple[int, Path | None]],
        *,
        desc: str,
        unit: str = "epochs",
        enabled: bool = True,
        stream: TextIO | None = None,
        write: Callable[[str], None] | None = None,
        poll_interval: float = 0.5,
        groups: Mapping[Hashable, tuple[Hashable, ...]] | None = None,
        workers: int = 1,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.active = bool(enabled and _is_terminal(self.stream))
        self._tasks = {k: (max(1, int(u)), None if p is None else Path(p)) for k, (u, p) in tasks.items()}
        self._write = write
        self._unit = unit
        self._poll_interval = poll_interval
        self._since = time.time() - 0.1  # file systems stamp with a coarse clock
        self._t0 = time.perf_counter()
        self._finished: dict[Hashable, int] = {}  # key -> units it counted for when it ended
        self._skipped = 0  # units of reused runs: no work, so not in the ETA
        self._runs_done = 0
        if groups is not None and (missing := [k for k in self._tasks if k not in groups]):
            raise ValueError(f"groups must name a cost group for every task; missing {missing[:3]!r}")
        self._groups = None if groups is None else {k: tuple(groups[k]) for k in self._tasks}
        self._workers = max(1, int(workers))
        self._seconds: dict[Hashable, float] = {}  # key -> how long the finished run took
        self._estimate: tuple[float | None, int, float] = (None, len(self._tasks), time.perf_counter())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = _tqdm(
            total=self.total_units,
            file=self.stream,
            disable=not self.active,
            desc=desc,
            unit=unit,
            **_width(self.stream),
            mininterval=0.2,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit}{postfix} "
            + ("[{elapsed}]" if self._groups is not None else "[{elapsed}<{remaining}]"),
            postfix=self._postfix(),
        )

    @property
    def total_units(self) -> int:
        return sum(u for u, _ in self._tasks.values())

    def _runs_text(self) -> str:
        if all(u == 1 and p is None for u, p in self._tasks.values()):
            return ""  # one unit per run: the count is the bar itself
        return f"{self._runs_done}/{len(self._tasks)} runs done"

    def _postfix(self) -> str:
        parts = [self._runs_text(), self._grouped_eta_text() if self._groups is not None else ""]
        return ", ".join(p for p in parts if p)

    def grouped_eta(self) -> tuple[float | None, int]:
        """``(seconds left, runs not timed yet)`` from the finished runs' durations per cost group.

        ``None`` seconds until a run has been timed. Only with ``groups``.
        """
        if self._groups is None:
            raise ValueError("grouped_eta needs the runs' cost groups (groups=...)")
        sums: dict[tuple[Hashable, ...], list[float]] = {}
        for key, seconds in self._seconds.items():
            group = self._groups[key]
            for depth in range(1, len(group) + 1):
                total = sums.setdefault(group[:depth], [0.0, 0.0])
                total[0] += seconds
                total[1] += 1
        if not sums:
            return None, sum(1 for k in self._tasks if k not in self._finished)
        work, untimed = 0.0, 0
        for key in self._tasks:
            if key in self._finished:
                continue
            group = self._groups[key]
            known = next((sums[group[:d]] for d in range(len(group), 0, -1) if group[:d] in sums), None)
            if known is None:
                untimed += 1
            else:
                work += known[0] / known[1]
        return work / self._workers, untimed

    def _grouped_eta_text(self) -> str:
        left, untimed, at = self._estimate
        if left is None:
            return "ETA after the first run"
        left = max(0.0, left - (time.perf_counter() - at))  # counts down between finished runs
        # one unit per run (a study's jobs): the runs are the units, named as the bar names them
        word = self._unit if all(u == 1 for u, _ in self._tasks.values()) else "runs"
        word = word[:-1] if untimed == 1 and word.endswith("s") else word
        more = f" + {untimed} {word} not timed yet" if untimed else ""
        return f"ETA {format_duration(left)}{more}"

    def _units_of(self, key: Hashable) -> int:
        if key in self._finished:
            return self._finished[key]
        units, log = self._tasks[key]
        if log is None:
            return 0
        try:
            if log.stat().st_mtime < self._since:
                return 0
            with log.open("rb") as fh:
                lines = fh.read().count(b"\n")  # complete lines only
        except OSError:
            return 0
        # a run's last unit counts when it ends: its evaluation follows its last epoch
        return min(units - 1, lines)

    def units_done(self) -> int:
        """Units finished so far (finished runs, and the epochs logged by running ones)."""
        return sum(self._units_of(k) for k in self._tasks)

    def _sync(self) -> None:
        with self._lock:
            done = self.units_done() - self._skipped
            self._bar.total = max(1, self.total_units - self._skipped)
            if self._groups is not None:
                self._bar.postfix = self._postfix()
            if done > self._bar.n:
                self._bar.update(done - self._bar.n)
            else:
                self._bar.refresh()  # the elapsed time moves on

    def _poll(self) -> None:
        while not self._stop.wait(self._poll_interval):
            self._sync()

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable`` while the bar is shown; closes it when the loop ends."""
        if self.active and self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="marginkit-progress", daemon=True)
            self._thread.start()
        try:
            yield from iterable
        finally:
            self.close()

    def finish(self, key: Hashable, text: str, *, reused: bool = False, seconds: float | None = None) -> None:
        """Record that run ``key`` ended and write ``[i/N] text`` (plus elapsed and ETA off a terminal).

        ``seconds``: how long the run took (for a reused run, when it was computed): with
        ``groups``, what the ETA is estimated from.
        """
        units = self._tasks[key][0]
        with self._lock:
            self._finished[key] = units
            self._runs_done += 1
            if reused:
                self._skipped += units
            if seconds is not None:
                self._seconds[key] = float(seconds)
            if self._groups is not None:
                self._estimate = (*self.grouped_eta(), time.perf_counter())
            self._bar.postfix = self._postfix()
        line = f"[{self._runs_done}/{len(self._tasks)}] {text}"
        if not self.enabled:
            return
        if self.active:
            self._sync()
            if self._write is None:
                self._bar.write(line, file=self.stream)
            else:
                with self._bar.external_write_mode(file=self.stream):
                    self._write(line)
            return
        elapsed = time.perf_counter() - self._t0
        done = self.units_done() - self._skipped
        left = self.total_units - self._skipped - done
        if not left:
            eta = "ETA 0:00"
        elif self._groups is not None:
            eta = self._grouped_eta_text()
        else:
            eta = f"ETA {format_duration(elapsed * left / done if done > 0 else float('nan'))}"
        line += f" · {format_duration(elapsed)} elapsed, {eta}"
        if self._write is None:
            print(line, file=self.stream, flush=True)
        else:
            self._write(line)

    def close(self) -> None:
        """Stop watching the runs and finish the bar's line (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self.active and not self._bar.disable:
            self._sync()
        self._bar.close()

    def __enter__(self) -> RunsProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
