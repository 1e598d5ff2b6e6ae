"""The ``marginkit`` command line: ``train``, ``eval``, ``embed``, ``predict``, ``report``,
``compare``, ``demo``, ``losses``, ``datasets``. See docs/cli.md.

``main(argv=None) -> int`` is the console-script entry point (``marginkit = "marginkit.cli:main"``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``marginkit`` command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    from marginkit.cli.app import main as _main

    return _main(argv)
