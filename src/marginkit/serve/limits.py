"""ASGI middleware: the request body limit and the request statistics of ``GET /metrics``."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from typing import Any

import numpy as np

__all__ = ["BodyLimit", "Recorder", "RequestStats"]

Scope = dict[str, Any]


async def _reply(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _drain(receive: Any, budget: int) -> None:
    """Read and discard the rest of a refused body, up to ``budget`` bytes, so that a client
    still sending it reads the 413 instead of a broken pipe (beyond that the connection closes)."""
    seen = 0
    while seen <= budget:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class BodyLimit:
    """Refuse bodies over ``max_bytes`` with 413 before the application reads them.

    A declared ``Content-Length`` over the limit is refused without holding the body, one
    within it is passed on untouched (the server delivers no more than it declares); a body
    without one (chunked) is read first (at most ``max_bytes + 1`` bytes are held) and handed
    on whole. A refused body is discarded as it arrives, up to ``drain_bytes``, before the reply.
    """

    def __init__(self, app: Any, max_bytes: int, drain_bytes: int = 64 * 2**20) -> None:
        self.app, self.max_bytes, self.drain_bytes = app, int(max_bytes), int(drain_bytes)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = f"request body exceeds the limit of {self.max_bytes} bytes"
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                if not value.isdigit():
                    await _reply(send, 400, "malformed Content-Length header")
                    return
                if int(value) > self.max_bytes:
                    await _drain(receive, self.drain_bytes)
                    await _reply(send, 413, too_big)
                    return
                # The server delivers no more than the declared length (HTTP/1.1 framing).
                await self.app(scope, receive, send)
                return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                if more:
                    await _drain(receive, self.drain_bytes)
                await _reply(send, 413, too_big)
                return
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class Recorder:
    """Counts and latencies per route (``METHOD /path template``) for ``GET /metrics``.

    Latencies are kept for the last ``window`` requests of each route; the percentiles are
    over that window.
    """

    def __init__(self, window: int = 10_000) -> None:
        self.window = window
        self.started = time.time()
        self._lock = threading.Lock()
        self._routes: dict[str, dict[str, Any]] = {}

    def record(self, key: str, status: int, seconds: float) -> None:
        with self._lock:
            entry = self._routes.setdefault(
                key, {"count": 0, "status": {}, "latency": deque(maxlen=self.window)}
            )
            entry["count"] += 1
            entry["status"][str(status)] = entry["status"].get(str(status), 0) + 1
            entry["latency"].append(seconds)

    def snapshot(self) -> dict[str, Any]:
        """``{"uptime_s", "requests": {route: {"count", "status", "latency_ms": {...}}}}``."""
        with self._lock:
            routes = {
                k: (v["count"], dict(v["status"]), np.array(v["latency"])) for k, v in self._routes.items()
            }
        out: dict[str, Any] = {}
        for key, (count, status, lat) in sorted(routes.items()):
            ms = lat * 1e3
            out[key] = {
                "count": count,
                "status": status,
                "latency_ms": {
                    "window": int(ms.size),
                    "mean": float(ms.mean()),
                    "p50": float(np.percentile(ms, 50)),
                    "p99": float(np.percentile(ms, 99)),
                    "max": float(ms.max()),
                },
            }
        return {"uptime_s": time.time() - self.started, "requests": out}


class RequestStats:
    """ASGI middleware that times every HTTP request into a :class:`Recorder`.

    Requests that match no route (or are refused before routing) count as ``(unmatched)``,
    so that random paths cannot grow the table.
    """

    def __init__(self, app: Any, recorder: Recorder) -> None:
        self.app, self.recorder = app, recorder

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.perf_counter()

        async def record_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "(unmatched)"
            self.recorder.record(f"{scope.get('method', '')} {path}", status, time.perf_counter() - t0)
