"""The run directory and its checkpoints: every file a run writes or reads goes through here.

::

    RUN_DIR/.lock           flock-ed by the one process using the directory (holds its pid)
    RUN_DIR/last.pt         the checkpoint after the latest epoch: the run's commit point
    RUN_DIR/best.pt         a copy of last.pt at the epoch with the best validation score
    RUN_DIR/metrics.jsonl   the history, one JSON row per epoch (made from last.pt)
    RUN_DIR/config.yaml     every option of the run
    RUN_DIR/eval.npz, knn_index.npz, metrics.json, report.html    the final evaluation

**Checkpoints** are plain dicts of tensors and primitive containers, so they load with
``torch.load(weights_only=True)`` (no arbitrary unpickling): the config and the history are
JSON strings, the RNG states tensors. Keys: ``format``, ``version``, ``epoch`` (completed
epochs), ``global_step``, ``config``, ``data`` (data set facts), ``model``, ``head`` (empty for
pair losses), ``optimizer``, ``scheduler``, ``rng``, ``best_metric``, ``best_epoch``,
``history``, ``fingerprint`` (:func:`marginkit.knn.model_fingerprint` of the model), ``scaler``
(the ``torch.amp.GradScaler`` state of an ``amp: fp16`` run, ``{}`` otherwise; checkpoints
written before it have no such key and resume with a fresh scaler).

**Crash consistency.** Every file is written to a temporary ``.NAME.*.tmp`` beside it,
flushed, ``fsync``-ed and renamed over ``NAME`` (``os.replace``): a file is either its old or
its new version, never torn. An epoch has one commit point, the rename of ``last.pt``, which
holds everything the epoch's other files are made from (the history rows, the best epoch).
The trainer commits ``last.pt`` first, then copies it to ``best.pt`` (at an improving epoch)
and rewrites ``metrics.jsonl``; killed between any two of these steps, or stopped by a write
error, the run resumes from ``last.pt`` and :meth:`RunDir.restore` first repairs the other two,
so the resumed run ends bit-identical to an uninterrupted one. A run commits an epoch-0
checkpoint before its first epoch, so every run that has started can be resumed; the final
evaluation's files are rewritten by every resumption that reaches the end.

**One writer.** A process holds an exclusive ``flock`` on ``.lock`` for as long as it writes
the directory (the kernel releases it when the process dies); a second process gets a clear
error at once. Under the lock, temporary files of writers that died are deleted.

Files read from a run do not choose where anything is written: a stored config loses its
``data_options.cache_dir`` (:func:`stored_config`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from marginkit.train.config import RUNTIME_KEYS, TrainConfig
from marginkit.train.errors import CheckpointError, ConfigError, RunDirError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "FORMAT",
    "VERSION",
    "RunDir",
    "atomic_save",
    "atomic_write_text",
    "checkpoint_payload",
    "config_differences",
    "load_checkpoint",
    "load_last",
    "load_run",
    "read_history",
    "scaler_state",
    "stored_config",
]

FORMAT = "marginkit.checkpoint"
VERSION = 1
_REQUIRED = ("format", "version", "epoch", "config", "model", "head", "optimizer", "scheduler", "rng")
LOCK = ".lock"
#: Files of a run (``--overwrite`` removes them).
RUN_FILES = (
    "last.pt", "best.pt", "metrics.jsonl", "config.yaml", "metrics.json", "knn_index.npz", "eval.npz",
    "report.html", "summary.json", "tracking.json",
)  # fmt: skip
#: ``data_options`` that name a place to write: never taken from a file read from a run.
WRITE_PATH_OPTIONS = ("cache_dir",)


# ---------------------------------------------------------------------- atomic writes
def _sync(fh: IO[bytes], target: Path) -> None:
    """Flush the temporary file for ``target`` to disk (a write step: fault-injection tests patch it)."""
    fh.flush()
    os.fsync(fh.fileno())


def _rename(src: str, dst: Path) -> None:
    """Move a finished temporary file over its target (a write step: tests patch it)."""
    os.replace(src, dst)


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _free_space(directory: Path) -> str:
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return "free space unknown"
    return f"{free / 2**20:.1f} MiB free there"


def write_error(exc: OSError, path: Path) -> RunDirError:
    """A one-line error naming the file and what went wrong (for a full disk: the free space)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"no space left on the device ({_free_space(path.parent)})"
    else:
        what = exc.strerror or str(exc) or type(exc).__name__
    return RunDirError(f"cannot write {str(path)!r}: {what}")


def _commit_temporary(path: Path, fill: Callable[[int, str], None]) -> None:
    """Create a temporary file beside ``path``, ``fill(fd, tmp)`` it (writes, syncs, closes
    ``fd``), then rename it over ``path``; on any failure remove it and keep ``path`` as it was."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise write_error(exc, path) from None
    try:
        fill(fd, tmp)
        os.chmod(tmp, _umask_mode())  # mkstemp creates 0600; give the usual permissions
        _rename(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise write_error(exc, path) from None
        raise


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` atomically: ``write(fh)`` into a temporary file beside it, fsync, rename.

    On any failure the temporary file is removed and ``path`` keeps its old content; an
    ``OSError`` becomes a :class:`RunDirError` naming the file (and, for a full disk, the free
    space).
    """

    def fill(fd: int, tmp: str) -> None:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            _sync(fh, Path(path))

    _commit_temporary(Path(path), fill)


def atomic_write_via_path(path: str | Path, write: Callable[[Path], Any]) -> None:
    """:func:`atomic_write` for writers that take a file name: ``write(tmp_path)``."""

    def fill(fd: int, tmp: str) -> None:
        os.close(fd)
        write(Path(tmp))
        with open(tmp, "rb") as fh:
            _sync(fh, Path(path))

    _commit_temporary(Path(path), fill)


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to ``path`` atomically (temporary file + fsync + ``os.replace``)."""
    atomic_write(path, lambda fh: torch.save(obj, fh))


def atomic_write_text(text: str, path: str | Path) -> None:
    """Write a UTF-8 text file atomically."""
    atomic_write(path, lambda fh: fh.write(text.encode("utf-8")))


# ---------------------------------------------------------------------- checkpoints
def checkpoint_payload(
    *,
    config: TrainConfig,
    facts: dict[str, Any],
    model_state: Mapping[str, torch.Tensor],
    head_state: Mapping[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
    rng: dict[str, Any],
    epoch: int,
    global_step: int,
    best_metric: float,
    best_epoch: int,
    history: list[dict[str, Any]],
    fingerprint: str,
    scaler_state: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The checkpoint dict (tensors moved to the CPU, config and history as JSON)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "epoch": int(epoch),
        "global_step": int(global_step),
        "config": config.to_json(),
        "data": facts,
        "model": {k: v.detach().cpu() for k, v in model_state.items()},
        "head": {k: v.detach().cpu() for k, v in head_state.items()},
        "optimizer": optimizer_state,
        "scheduler": scheduler_state,
        "rng": rng,
        "best_metric": float(best_metric),
        "best_epoch": int(best_epoch),
        "history": json.dumps(history),
        "fingerprint": fingerprint,
        "scaler": dict(scaler_state or {}),
        "torch_version": str(torch.__version__),
    }


#: the entries of a ``torch.amp.GradScaler`` state dict and their types
_SCALER_STATE = {
    "scale": (float, int), "growth_factor": (float, int), "backoff_factor": (float, int),
    "growth_interval": (int,), "_growth_tracker": (int,),
}  # fmt: skip


def scaler_state(ckpt: Mapping[str, Any], path: str | Path) -> dict[str, Any] | None:
    """The checked GradScaler state of a checkpoint; ``None`` if it holds none (not fp16, or older)."""
    state = ckpt.get("scaler")
    if state is None or (isinstance(state, Mapping) and not state):
        return None
    bad = not isinstance(state, Mapping) or set(state) != set(_SCALER_STATE)
    if not bad:
        bad = any(isinstance(state[k], bool) or not isinstance(state[k], t) for k, t in _SCALER_STATE.items())
        bad = bad or not (state["scale"] > 0 and state["growth_interval"] > 0)
        bad = bad or not state["_growth_tracker"] >= 0
    if bad:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds an invalid gradient-scaler state (expected the "
            f"numbers {', '.join(_SCALER_STATE)})"
        )
    return dict(state)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and check a checkpoint with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: the file is missing, truncated/corrupted, or not a marginkit
            checkpoint (the message names the file and says which).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        first = first.split(". ")[0].rstrip(".")[:160]
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupted or not a safe marginkit checkpoint "
            f"({type(exc).__name__}: {first})"
        ) from None
    if not isinstance(payload, Mapping) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a marginkit checkpoint (no {FORMAT!r} format tag)")
    missing = [k for k in _REQUIRED if k not in payload]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: missing {', '.join(missing)}")
    if payload["version"] != VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {payload['version']}; "
            f"this marginkit reads version {VERSION}"
        )
    return dict(payload)


def stored_config(ckpt: Mapping[str, Any], path: str | Path) -> TrainConfig:
    """The config stored in a checkpoint, without the options that name places to write."""
    try:
        config = TrainConfig.from_json(ckpt["config"])
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} holds an invalid config: {exc}") from None
    for key in WRITE_PATH_OPTIONS:
        config.data_options.pop(key, None)
    return config


def config_differences(stored: TrainConfig, given: TrainConfig) -> list[str]:
    """``"key (run: a, given: b)"`` for every option that changes what a run computes."""
    a, b = stored.to_dict(), given.to_dict()
    for raw in (a, b):
        for key in WRITE_PATH_OPTIONS:
            raw["data_options"].pop(key, None)
    return [
        f"{k} (run: {a[k]!r}, given: {b[k]!r})" for k in sorted(a) if k not in RUNTIME_KEYS and a[k] != b[k]
    ]


def read_history(path: str | Path, upto: int | None = None) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (epochs ``<= upto``); unreadable lines are skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line, written by an older marginkit that appended rows
        if isinstance(row, dict) and (upto is None or row.get("epoch", 0) <= upto):
            rows.append(row)
    return rows


def load_last(run_dir: str | Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """``RUN_DIR/last.pt`` with its ``history`` as a list of rows (to resume from)."""
    run_dir = Path(run_dir)
    ckpt = load_checkpoint(run_dir / "last.pt", map_location=device)
    if "history" not in ckpt:  # written by an older marginkit
        ckpt["history"] = read_history(run_dir / "metrics.jsonl", upto=int(ckpt["epoch"]))
        return ckpt
    try:
        rows = json.loads(ckpt["history"])
    except (TypeError, json.JSONDecodeError):
        rows = None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise CheckpointError(f"checkpoint {str(run_dir / 'last.pt')!r} holds an unreadable history")
    ckpt["history"] = rows
    return ckpt


def _checkpoint_path(run_dir: Path, which: str) -> Path:
    if not run_dir.is_dir():
        raise RunDirError(f"run directory {str(run_dir)!r} does not exist")
    path = run_dir / f"{which}.pt"
    if not path.is_file() and which == "best":
        path = run_dir / "last.pt"
    if not path.is_file():
        raise RunDirError(
            f"{str(run_dir)!r} holds no checkpoint (no best.pt or last.pt); train a model into it first"
        )
    return path


def load_run(
    run_dir: str | Path, which: str = "best", device: str | torch.device = "cpu", *, model: Any = None
) -> dict[str, Any]:
    """Load ``RUN_DIR/{which}.pt`` (``best`` falls back to ``last``) and rebuild the model.

    A run that trained your own module (``train(..., model=module)``, ``model: custom``) needs
    ``model``: a new instance of the same class, whose weights are replaced by the checkpoint's.

    Returns a dict with ``config`` (:func:`stored_config`), ``facts``, ``model``, ``head``,
    ``checkpoint``, ``fingerprint`` and ``path``.
    """
    from marginkit.knn import model_fingerprint
    from marginkit.train.components import build_components

    run_dir = Path(run_dir)
    path = _checkpoint_path(run_dir, which)
    ckpt = load_checkpoint(path)
    if int(ckpt["epoch"]) < 1:
        raise RunDirError(
            f"{str(run_dir)!r} holds no trained checkpoint yet (stopped before its first epoch); "
            "continue it with --resume"
        )
    config = stored_config(ckpt, path)
    facts = dict(ckpt["data"])
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    model, head, _ = build_components(config, facts, dev, model)
    try:
        model.load_state_dict(ckpt["model"])
        if head is not None:
            head.load_state_dict(ckpt["head"])
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise CheckpointError(f"checkpoint {str(path)!r} does not match its model: {first}") from None
    model.eval()
    if head is not None:
        head.eval()
    return {
        "config": config,
        "facts": facts,
        "model": model,
        "head": head,
        "checkpoint": ckpt,
        "fingerprint": model_fingerprint(model),  # of the weights actually loaded
        "path": path,
    }


def run_is_complete(run_dir: str | Path, epochs: int, *, report: bool = True) -> bool:
    """Whether ``run_dir`` holds a run trained for ``epochs`` epochs with its final evaluation."""
    run_dir = Path(run_dir)
    names = ["metrics.json", "eval.npz", "knn_index.npz", *(["report.html"] if report else [])]
    if not all((run_dir / n).is_file() for n in names):
        return False
    try:
        return int(load_checkpoint(run_dir / "last.pt")["epoch"]) >= epochs
    except CheckpointError:
        return False


# ---------------------------------------------------------------------- the directory
def _lock(directory: Path) -> int | None:
    """An exclusive ``flock`` on ``directory/.lock``, taken at once or a :class:`RunDirError`."""
    try:
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunDirError(
            f"cannot write to output directory {str(directory)!r}: {exc.strerror or exc}"
        ) from None
    if fcntl is None:  # pragma: no cover - not POSIX
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = ""
        with contextlib.suppress(OSError, ValueError):
            holder = f" (pid {int(os.pread(fd, 32, 0).decode().strip())})"
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirError(f"cannot lock {str(directory / LOCK)!r}: {exc.strerror or exc}") from None
        raise RunDirError(
            f"{str(directory)!r} is in use by another marginkit process{holder}; wait for it to "
            "finish, or use another --out"
        ) from None
    with contextlib.suppress(OSError):  # who holds it, for the message above (best effort)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class RunDir:
    """A directory this process writes: locked while open, temporary files of dead writers removed.

    Use as a context manager, or call :meth:`close` (which releases the lock).
    """

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        self._fd: int | None = None
        self.path = Path(path)
        if create:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RunDirError(
                    f"cannot write to output directory {str(self.path)!r}: {exc.strerror or exc}"
                ) from None
        elif not self.path.is_dir():
            raise RunDirError(f"run directory {str(self.path)!r} does not exist")
        self._fd = _lock(self.path)
        for stale in self.path.glob(".*.tmp"):  # under the lock: no live writer owns them
            with contextlib.suppress(OSError):
                stale.unlink()

    def close(self) -> None:
        """Release the lock (the directory may then be used by another process)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError):
            self.close()

    # ------------------------------------------------------------------ training
    @classmethod
    def for_training(cls, path: str | Path, *, resume: bool, overwrite: bool) -> RunDir:
        """Open ``path`` to train into: refuses to clobber a run unless ``overwrite``, and to
        resume one that holds no checkpoint."""
        run = cls(path)
        try:
            last = run.path / "last.pt"
            if resume and not last.is_file():
                raise RunDirError(
                    f"cannot resume: {str(run.path)!r} holds no last.pt checkpoint (a run that stopped "
                    "before committing its start leaves none; start it again without --resume)"
                )
            if not resume and last.is_file():
                if not overwrite:
                    raise RunDirError(
                        f"{str(run.path)!r} already holds a run (last.pt); use --resume to continue it, "
                        "--overwrite to replace it, or another --out"
                    )
                for name in RUN_FILES:
                    with contextlib.suppress(FileNotFoundError):
                        (run.path / name).unlink()
        except BaseException:
            run.close()
            raise
        return run

    def commit_epoch(self, payload: dict[str, Any], *, improved: bool) -> None:
        """Write the files of a finished epoch: ``last.pt`` (the commit point), then ``best.pt``
        (``improved``) and ``metrics.jsonl``; a write error says what was kept."""
        epoch = int(payload["epoch"])
        try:
            atomic_save(payload, self.path / "last.pt")
        except RunDirError as exc:
            kept = (
                f"last.pt still holds epoch {epoch - 1}, so --resume repeats epoch {epoch}"
                if epoch
                else "nothing is saved yet: start the run again"
            )
            raise RunDirError(f"{exc}; {kept}") from None
        try:
            if improved:
                self._copy("last.pt", "best.pt")
            self._write_history(json.loads(payload["history"]))
        except RunDirError as exc:
            raise RunDirError(
                f"{exc}; epoch {epoch} is saved in last.pt and --resume completes the rest"
            ) from None

    def restore(self, device: str | torch.device = "cpu") -> dict[str, Any]:
        """Load ``last.pt`` and repair what a crash after its commit left behind: ``best.pt`` (a
        copy of ``last.pt`` when that epoch was the best) and ``metrics.jsonl``. The returned
        checkpoint's ``history`` is a list of rows."""
        ckpt = load_last(self.path, device)
        epoch = int(ckpt["epoch"])
        if epoch >= 1 and int(ckpt.get("best_epoch", 0)) == epoch:
            self._copy("last.pt", "best.pt")
        self._write_history(ckpt["history"])
        return ckpt

    def write_config(self, config: TrainConfig) -> None:
        atomic_write_text(config.to_yaml(), self.path / "config.yaml")

    def _write_history(self, rows: list[dict[str, Any]]) -> None:
        atomic_write_text("".join(json.dumps(r) + "\n" for r in rows), self.path / "metrics.jsonl")

    def _copy(self, src: str, dst: str) -> None:
        with open(self.path / src, "rb") as source:
            atomic_write(self.path / dst, lambda fh: shutil.copyfileobj(source, fh))

    # ------------------------------------------------------------------ evaluation
    def write_results(
        self, metrics: dict[str, Any], arrays: dict[str, Any], knn: Any, *, report: bool
    ) -> None:
        """The final evaluation's files; ``metrics.json`` after the arrays and the index, the
        report (made from them) last."""
        import numpy as np

        atomic_write(self.path / "eval.npz", lambda fh: np.savez_compressed(fh, **arrays))
        atomic_write_via_path(self.path / "knn_index.npz", knn.save)
        atomic_write_text(json.dumps(metrics, indent=2) + "\n", self.path / "metrics.json")
        if report:
            from marginkit.report import write_run_report

            atomic_write_via_path(self.path / "report.html", lambda tmp: write_run_report(self.path, tmp))
