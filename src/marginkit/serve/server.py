"""``marginkit serve``: load a bundle and a gallery, then run the API under uvicorn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from marginkit.serve.inputs import Limits

__all__ = ["build_app", "read_token", "serve"]

SERVE_HINT = "pip install 'marginkit[serve]'"


def read_token(path: str | os.PathLike[str]) -> str:
    """The bearer token in ``path`` (first line, stripped); at least 16 characters."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"token file {str(p)!r} not found")
    if p.stat().st_size > 4096:
        raise ValueError(f"token file {str(p)!r} is larger than 4096 bytes; it should hold one token")
    lines = p.read_text(encoding="utf-8").strip().splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < 16 or any(c.isspace() for c in token):
        raise ValueError(f"token file {str(p)!r} must hold one token of at least 16 non-space characters")
    return token


def build_app(
    bundle_path: str | os.PathLike[str],
    gallery_path: str | os.PathLike[str],
    *,
    far: float = 1e-3,
    threshold: float | None = None,
    token: str | None = None,
    limits: Limits | None = None,
    trust_torchscript: bool = False,
    threads: int = 0,
) -> Any:
    """Load the bundle (checked) and open (or create) the gallery; return the FastAPI app.

    The decision threshold is ``threshold`` if given, else the bundle's calibrated threshold
    at ``far``; without either, :class:`ValueError`.
    """
    try:
        import fastapi  # noqa: F401
    except ImportError as err:
        raise ImportError(f"`marginkit serve` needs FastAPI and uvicorn: {SERVE_HINT}") from err
    from marginkit.export import load_bundle
    from marginkit.gallery import Gallery
    from marginkit.serve.app import create_app

    bundle = load_bundle(bundle_path, trust_torchscript=trust_torchscript, threads=threads)
    if threshold is None:
        bundle.threshold(far)  # fail now, with the reason, when the FAR was not measurable
    gallery = Gallery(gallery_path, bundle, far=far, threshold=threshold)
    return create_app(bundle, gallery, token=token, limits=limits)


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "warning") -> None:
    """Run ``app`` under uvicorn until interrupted (one process; torch and onnxruntime use threads)."""
    import uvicorn

    uvicorn.run(
        app, host=host, port=port, log_level=log_level, timeout_keep_alive=5, timeout_graceful_shutdown=5
    )
