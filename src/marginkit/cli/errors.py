"""User-facing errors of the command line: one line, exit code 2, no traceback (unless --debug).

A missing optional dependency is one of them: :func:`marginkit.cli.main` reports a
:class:`~marginkit._lazy.MissingExtraError` (or a bare ``ModuleNotFoundError`` of a module of an
extra, :func:`~marginkit._lazy.missing_extra`) with the extra to install, exit code 2.
"""

from __future__ import annotations

import contextlib
import pickle
import zipfile
from collections.abc import Iterator

__all__ = ["EXIT_INTERRUPTED", "EXIT_TRAINING", "EXIT_USAGE", "UserError", "user_errors"]

EXIT_USAGE = 2  # bad input: unknown names, missing/corrupt files, unwritable output, a missing extra, ...
EXIT_TRAINING = 1  # training diverged / internal error (a bug)
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """A problem with the user's input; printed as ``marginkit: error: <message>``."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, KeyError) and text.startswith(("'", '"')):
        text = text[1:-1]
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def user_errors(context: str = "") -> Iterator[None]:
    """Turn the input-checking exceptions raised inside the block into :class:`UserError`.

    Used around steps whose failures are the user's input (reading data and files,
    building a model for the data's shape) — not around the training loop itself, so a bug
    there still shows a traceback with ``--debug``.
    """
    try:
        yield
    except UserError:
        raise
    except FileNotFoundError as exc:
        name = exc.filename if exc.filename else _first_line(exc)
        msg = f"file not found: {name}" if exc.filename else _first_line(exc)
        raise UserError(f"{context}{msg}") from exc
    except PermissionError as exc:
        raise UserError(f"{context}permission denied: {exc.filename or _first_line(exc)}") from exc
    except (
        ValueError,
        TypeError,
        KeyError,
        OSError,
        pickle.UnpicklingError,
        zipfile.BadZipFile,
        EOFError,
    ) as exc:
        raise UserError(f"{context}{_first_line(exc)}") from exc
