"""``marginkit serve``: an HTTP API (FastAPI + uvicorn) over an exported bundle and a gallery.

Needs ``pip install 'marginkit[serve]'``. See docs/deploy.md.
"""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "create_app": "app",
        "build_app": "server",
        "serve": "server",
        "read_token": "server",
        "Limits": "inputs",
    },
)
