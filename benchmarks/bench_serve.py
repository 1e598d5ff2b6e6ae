"""``marginkit serve`` over loopback against the same calls made in-process on the library.

For galleries of 10⁴ and 10⁵ identities (one random unit template each, D = 64), a real
``marginkit serve`` (uvicorn, 1 and 2 worker processes, access log on, written to a file)
answers ``POST /verify`` (one probe embedding against one claimed identity) and
``POST /identify`` (one probe, k = 5) sent by 1, 8 and 32 client threads (``http.client``,
one keep-alive connection each; ``--body json``: the embedding as a JSON list, ``npy``: an
``application/x-npy`` body). The same calls are then made in this process on a
:class:`~marginkit.gallery.Gallery` opened on the same file, by the same number of threads.
Printed: requests/s and p50 / p99 latency of both, and their ratios (server / library). The
floor of any server here comes first: the same client and bodies against uvicorn (as ``serve``
runs it) answering a constant — a bare ASGI app, and one FastAPI route — beside the library's
``verify``.
Then the bundle's ONNX model against PyTorch eager on one batch of
256 inputs: embeddings per second and their ratio. Both runtimes use ``--threads`` threads.

Side by side: each cell runs the server and the library alternately ``--rounds`` times and
keeps the best round of each (a shared machine's load changes from one second to the next).
Bounded: every round stops after ``--requests`` requests or ``--seconds`` seconds, whichever
comes first; the server listens on 127.0.0.1 only and is stopped at the end. ``--quick``:
galleries of 10³ and 10⁴, 60 requests per cell, one round.

    python benchmarks/bench_serve.py [--quick] [--threads 1] [--requests 400] [--seconds 20] [--rounds 3]
                                     [--workers 1,2] [--body json|npy]
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

DIM = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small galleries and few requests (smoke run)")
    p.add_argument("--threads", type=int, default=1, help="model / torch threads of server and library")
    p.add_argument("--requests", type=int, default=400, help="requests per cell (at most)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds per cell (at most)")
    p.add_argument("--rounds", type=int, default=3, help="server / library alternations per cell (best kept)")
    p.add_argument("--workers", default="1,2", help="server worker processes to measure (comma-separated)")
    p.add_argument("--body", choices=("json", "npy"), default="json", help="how the probe is sent")
    p.add_argument(
        "--client", choices=("socket", "http.client"), default="socket",
        help="HTTP client: a bare keep-alive socket (request bytes made once) or Python's http.client",
    )  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_bundle(root: Path) -> Path:
    """A tiny trained run (digits, 1 epoch) exported as ONNX: the benchmark's model."""
    from marginkit.export import export_model
    from marginkit.train.config import TrainConfig
    from marginkit.train.trainer import train

    config = TrainConfig(
        data="digits", loss="cosface", model="mlp", embedding_dim=DIM, epochs=1, num_threads=1
    )
    train(config, root / "run", quiet=True, report=False)
    export_model(root / "run", "onnx", root / "bundle")
    return root / "bundle"


def make_gallery(path: Path, bundle: Any, n: int, rng: np.random.Generator) -> np.ndarray:
    from marginkit.gallery import Gallery

    emb = rng.normal(size=(n, DIM)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    with Gallery(path, bundle, far=1e-2) as g:
        g.enroll_many([f"id{i}" for i in range(n)], emb, kind="embeddings")
    return emb


def run_threads(concurrency: int, call: Any, requests: int, seconds: float) -> dict[str, float]:
    """``call(worker, i)`` from ``concurrency`` threads until ``requests`` or ``seconds`` run out."""
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(requests))
    deadline = time.perf_counter() + seconds

    def worker(w: int) -> None:
        state: dict[str, Any] = {}
        while time.perf_counter() < deadline:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            t0 = time.perf_counter()
            call(state, w, i)
            with lock:
                latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ms = np.array(latencies) * 1e3
    return {
        "requests": len(ms),
        "rps": len(ms) / wall,
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
    }


def library_calls(gallery: Any, probes: np.ndarray, claims: list[str]) -> dict[str, Any]:
    def verify(state: dict[str, Any], worker: int, i: int) -> None:
        gallery.verify(probes[i % len(probes)], claims[i % len(probes)], kind="embeddings")

    def identify(state: dict[str, Any], worker: int, i: int) -> None:
        gallery.identify(probes[i % len(probes)], k=5, kind="embeddings")

    return {"/verify": verify, "/identify": identify}


def interleaved(
    server_call: Any, library_call: Any, concurrency: int, requests: int, seconds: float, rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Server and library cells alternated ``rounds`` times; the best round (by req/s) of each."""
    best: list[dict[str, float] | None] = [None, None]
    for _ in range(rounds):
        for side, call in enumerate((server_call, library_call)):
            cell = run_threads(concurrency, call, requests, seconds)
            if best[side] is None or cell["rps"] > best[side]["rps"]:  # type: ignore[index]
                best[side] = cell
    assert best[0] is not None and best[1] is not None
    return best[0], best[1]


def http_call(port: int, path: str, bodies: list[tuple[str, bytes]], ctype: str) -> Any:
    def call(state: dict[str, Any], worker: int, i: int) -> None:
        conn = state.get("conn")
        if conn is None:
            conn = state["conn"] = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        url, body = bodies[i % len(bodies)]
        conn.request("POST", url, body=body, headers={"Content-Type": ctype})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:200]!r}")

    return call


def socket_call(port: int, path: str, bodies: list[tuple[str, bytes]], ctype: str) -> Any:
    """As :func:`http_call` on a bare keep-alive socket: the request bytes are made once, and
    the response is read by its ``Content-Length`` (or chunked framing). Python's http.client
    spends about as long on each request as uvicorn does, which is the client's cost, not the
    server's."""
    requests = [
        (
            f"POST {url} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
        for url, body in bodies
    ]

    def call(state: dict[str, Any], worker: int, i: int) -> None:
        sock = state.get("sock")
        if sock is None:
            sock = state["sock"] = socket.create_connection(("127.0.0.1", port), timeout=60)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            state["buf"] = b""
        sock.sendall(requests[i % len(requests)])
        buf = state["buf"]
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += _recv(sock)
        head, buf = buf[:end].lower(), buf[end + 4 :]
        status = int(head[9:12])
        at = head.find(b"\ncontent-length:")
        if at >= 0:
            stop = head.find(b"\r", at + 1)
            length = int(head[at + 16 : stop if stop >= 0 else None])
            while len(buf) < length:
                buf += _recv(sock)
            data, buf = buf[:length], buf[length:]
        else:  # chunked: the body ends with a zero-length chunk
            while (stop := buf.find(b"\r\n0\r\n\r\n")) < 0 and not buf.startswith(b"0\r\n\r\n"):
                buf += _recv(sock)
            stop = 0 if stop < 0 else stop + 2
            data, buf = buf[:stop], buf[stop + 5 :]
        state["buf"] = buf
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {data[:200]!r}")

    return call


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(1 << 16)
    if not chunk:
        raise RuntimeError("the server closed the connection")
    return chunk


def request_bodies(
    kind: str, probes: np.ndarray, claims: list[str]
) -> tuple[dict[str, list[tuple[str, bytes]]], str]:
    """Per endpoint, ``(url, body)`` of each probe, and the content type."""
    if kind == "json":
        return {
            "/verify": [
                ("/verify", json.dumps({"embeddings": [p.tolist()], "identity": c}).encode())
                for p, c in zip(probes, claims, strict=True)
            ],
            "/identify": [
                ("/identify", json.dumps({"embeddings": [p.tolist()], "k": 5}).encode()) for p in probes
            ],
        }, "application/json"

    def npy(p: np.ndarray) -> bytes:
        buf = io.BytesIO()
        np.save(buf, p[None].astype(np.float32))
        return buf.getvalue()

    return {
        "/verify": [
            (f"/verify?kind=embeddings&identity={c}", npy(p)) for p, c in zip(probes, claims, strict=True)
        ],
        "/identify": [("/identify?kind=embeddings&k=5", npy(p)) for p in probes],
    }, "application/x-npy"


def wait_for(port: int, server: subprocess.Popen, seconds: float = 120.0, log: Path | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:] if log else ''}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"server did not answer /health within {seconds} s")


# What an HTTP round trip costs here at all: uvicorn (httptools, uvloop, access log written,
# as `marginkit serve` runs it) answering every POST with a constant, read after the whole body —
# as a bare ASGI app and as one FastAPI route.
FLOOR_APPS = {
    "bare ASGI app": """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok":true}'})
""",
    "FastAPI route": """
from fastapi import FastAPI, Request, Response
app = FastAPI()
@app.get("/health")
async def health():
    return {"ok": True}
@app.post("/{path}")
async def answer(path: str, request: Request) -> Response:
    await request.body()
    return Response(b'{"ok":true}', media_type="application/json")
""",
}


def floor_server(code: str, port: int, log: Any) -> subprocess.Popen:
    script = (
        code + f"\nimport uvicorn\nuvicorn.run(app, host='127.0.0.1', port={port}, http='httptools', "
        "loop='uvloop', log_level='info', access_log=True)\n"
    )
    return subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, text=True)


def wait_for_port(port: int, server: subprocess.Popen, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("floor server exited")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"floor server did not listen within {seconds} s")


def bench_model(bundle: Any, threads: int, repeats: int) -> dict[str, float]:
    import torch

    from marginkit.train.trainer import load_run, load_splits

    run = load_run(bundle.manifest["run"]["run_dir"])
    x = load_splits(run["config"]).test.x[:256]
    model = run["model"]
    torch.set_num_threads(threads)
    arr = x.numpy()
    best = {"onnx": float("inf"), "eager": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        bundle.embed(arr, preprocessed=True, batch_size=256)
        best["onnx"] = min(best["onnx"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x)
        best["eager"] = min(best["eager"], time.perf_counter() - t0)
    onnx, eager = len(x) / best["onnx"], len(x) / best["eager"]
    return {"batch": len(x), "onnx_per_s": onnx, "eager_per_s": eager, "ratio": onnx / eager}


def main() -> int:
    args = parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from marginkit.export import load_bundle
    from marginkit.gallery import Gallery

    torch.set_num_threads(args.threads)
    sizes = (1_000, 10_000) if args.quick else (10_000, 100_000)
    requests = 60 if args.quick else args.requests
    seconds = 5.0 if args.quick else args.seconds
    rounds = 1 if args.quick else args.rounds
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    client = socket_call if args.client == "socket" else http_call
    print(f"client: {args.client}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bundle_path = make_bundle(root)
        bundle = load_bundle(bundle_path, threads=args.threads)
        for n in sizes:
            db = root / f"gallery-{n}.db"
            emb = make_gallery(db, bundle, n, rng)
            probes = emb[rng.integers(0, n, 256)] + 0.05 * rng.normal(size=(256, DIM)).astype(np.float32)
            claims = [f"id{i}" for i in rng.integers(0, n, 256)]
            bodies, ctype = request_bodies(args.body, probes, claims)
            gallery = Gallery(db, bundle, far=1e-2)
            library = library_calls(gallery, probes, claims)
            for name, code in FLOOR_APPS.items() if n == sizes[0] else ():
                port = free_port()
                log = (root / "floor.log").open("w")
                server = floor_server(code, port, log)
                try:
                    wait_for_port(port, server)
                    served, local = interleaved(
                        client(port, "/verify", bodies["/verify"], ctype), library["/verify"], 1,
                        requests, seconds, rounds,
                    )  # fmt: skip
                finally:
                    server.terminate()
                    server.wait(timeout=30)
                    log.close()
                lines = (root / "floor.log").read_text().count('"POST /')
                print(f"  (access log: {lines} request lines)", flush=True)
                rows.append(
                    {
                        "endpoint": f"floor: {name}", "gallery": n, "workers": 1, "concurrency": 1,
                        "body": args.body, "server": served, "library": local,
                    }
                )  # fmt: skip
                print(
                    f"floor ({name}): {served['rps']:7.1f} req/s p50 {served['p50']:6.2f} ms | library "
                    f"/verify {local['rps']:8.1f} req/s | ratio {served['rps'] / local['rps']:.3f}",
                    flush=True,
                )
            for workers in [int(w) for w in args.workers.split(",")]:
                port = free_port()
                cmd = [
                    sys.executable, "-m", "marginkit.cli", "serve", str(bundle_path), "--gallery", str(db),
                    "--port", str(port), "--far", "1e-2", "--threads", str(args.threads), "--quiet",
                    "--workers", str(workers),
                ]  # fmt: skip
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
                log = (root / f"access-{n}-{workers}.log").open("w")
                server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
                try:
                    wait_for(port, server, log=root / f"access-{n}-{workers}.log")
                    for path in ("/verify", "/identify"):
                        for c in (1, 8, 32):
                            served, local = interleaved(
                                client(port, path, bodies[path], ctype), library[path], c, requests,
                                seconds, rounds,
                            )  # fmt: skip
                            rows.append(
                                {
                                    "endpoint": path, "gallery": n, "workers": workers, "concurrency": c,
                                    "body": args.body, "server": served, "library": local,
                                }
                            )  # fmt: skip
                            print(
                                f"{path:9s} n={n:>6} w={workers} c={c:>2}  server {served['rps']:7.1f} req/s "
                                f"p50 {served['p50']:6.2f} p99 {served['p99']:7.2f} ms | "
                                f"library {local['rps']:8.1f} req/s p50 {local['p50']:6.3f} ms | "
                                f"ratio req/s {served['rps'] / local['rps']:.3f}",
                                flush=True,
                            )
                finally:
                    server.terminate()
                    try:
                        server.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        server.kill()
                        server.wait(timeout=30)
                    log.close()
                lines = (root / f"access-{n}-{workers}.log").read_text().count('"POST /')
                print(f"  (access log: {lines} request lines)", flush=True)
            gallery.close()
        model = bench_model(bundle, args.threads, repeats=5 if args.quick else 20)
    print(
        f"\nembedding throughput, batch {model['batch']}: ONNX (onnxruntime) {model['onnx_per_s']:.0f}/s, "
        f"PyTorch eager {model['eager_per_s']:.0f}/s, ratio {model['ratio']:.2f}"
    )
    print(
        "\n| endpoint | gallery | workers | clients | server req/s | p50 / p99 ms | library req/s | p50 ms "
        "| ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s, lib = r["server"], r["library"]
        print(
            f"| `{r['endpoint']}` | {r['gallery']:,} | {r['workers']} | {r['concurrency']} | "
            f"{s['rps']:.0f} | "
            f"{s['p50']:.1f} / {s['p99']:.1f} | {lib['rps']:.0f} | {lib['p50']:.2f} | "
            f"{s['rps'] / lib['rps']:.3f} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "model": model}, indent=2) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
