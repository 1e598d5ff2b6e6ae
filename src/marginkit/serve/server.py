"""``marginkit serve``: load a bundle and a gallery, then run the API under uvicorn."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from marginkit._lazy import require
from marginkit.serve.inputs import Limits

__all__ = ["app_from_env", "build_app", "read_token", "serve"]

_ENV = "MARGINKIT_SERVE_BUILD"  # build_app's arguments (JSON) for worker processes


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
    gallery_dtype: str | None = None,
    gallery_backend: str = "exact",
) -> Any:
    """Load the bundle (checked) and open (or create) the gallery; return the FastAPI app.

    The decision threshold is ``threshold`` if given, else the bundle's calibrated threshold
    at ``far``; without either, :class:`ValueError`. ``gallery_dtype``: the template storage
    of a new gallery (:class:`~marginkit.gallery.Gallery`'s ``dtype``); ``gallery_backend``:
    its template search (``backend``).
    """
    for name in ("fastapi", "fastapi_offline", "uvicorn", "orjson"):
        require(name, extra="serve", purpose="`marginkit serve`")
    from marginkit.export import load_bundle
    from marginkit.gallery import Gallery
    from marginkit.serve.app import create_app

    bundle = load_bundle(bundle_path, trust_torchscript=trust_torchscript, threads=threads)
    if threshold is None:
        bundle.threshold(far)  # fail now, with the reason, when the FAR was not measurable
    gallery = Gallery(
        gallery_path, bundle, far=far, threshold=threshold, dtype=gallery_dtype, backend=gallery_backend
    )
    return create_app(bundle, gallery, token=token, limits=limits)


def app_from_env() -> Any:
    """The app of one worker process (uvicorn's ``factory``): :func:`build_app` with the
    arguments :func:`serve` left in the environment; the token is read again from its file."""
    kwargs = json.loads(os.environ[_ENV])
    token_file = kwargs.pop("token_file")
    kwargs["limits"] = Limits(**kwargs["limits"])
    return build_app(**kwargs, token=read_token(token_file) if token_file else None)


def log_config(*, access_log: bool, quiet: bool) -> dict[str, Any]:
    """uvicorn's logging set-up with the levels ``serve`` uses: its access log (one line per
    request: client, method, path, status) at INFO when ``access_log``; its own messages at
    INFO (WARNING when ``quiet``)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    level = "WARNING" if quiet else "INFO"
    config["loggers"]["uvicorn"]["level"] = level
    config["loggers"]["uvicorn.error"]["level"] = level
    config["loggers"]["uvicorn.access"]["level"] = "INFO" if access_log else "WARNING"
    return config


def serve(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    access_log: bool = True,
    quiet: bool = False,
    workers: int = 1,
    build: dict[str, Any] | None = None,
) -> None:
    """Run ``app`` under uvicorn until interrupted.

    ``workers > 1`` starts that many worker processes (uvicorn's supervisor), each building
    its own app with :func:`build_app` from ``build`` (its keyword arguments, with
    ``token_file`` instead of ``token`` and ``limits`` as a dict) and opening the gallery
    file itself; ``app`` is then not used. Processes see each other's enrollments before
    their next query (see :class:`~marginkit.gallery.Gallery`).
    """
    import uvicorn

    options = {
        "host": host, "port": port, "access_log": access_log, "log_level": None,
        "log_config": log_config(access_log=access_log, quiet=quiet),
        "timeout_keep_alive": 5, "timeout_graceful_shutdown": 5,
    }  # fmt: skip
    if workers > 1:
        if build is None:
            raise ValueError("serve(workers > 1) needs build=, the arguments of build_app")
        os.environ[_ENV] = json.dumps(build)
        uvicorn.run("marginkit.serve.server:app_from_env", factory=True, workers=workers, **options)
    else:
        uvicorn.run(app, **options)
