"""marginkit serve: every endpoint through TestClient and a real uvicorn process; bad inputs; auth."""

from __future__ import annotations

import ast
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from PIL import Image

from marginkit.cli import main
from marginkit.distributed import find_free_port
from marginkit.gallery import Gallery
from marginkit.serve import Limits, create_app
from marginkit.train.trainer import load_run, load_splits
from test_readme import on_a_free_port

TOKEN = "s3cret-token-for-tests-0123456789"
LIMITS = Limits(max_body_bytes=1_000_000, max_batch=64, max_image_pixels=10_000)


@pytest.fixture(scope="module")
def samples(tiny_run) -> np.ndarray:
    """40 test images [40, 1, 8, 8] in [0, 1] (float32)."""
    splits = load_splits(load_run(tiny_run)["config"])
    return splits.test.x[:40].numpy()


@pytest.fixture
def served(onnx_bundle, tmp_path):
    gallery = Gallery(tmp_path / "g.db", onnx_bundle, far=1e-2)
    with TestClient(create_app(onnx_bundle, gallery, limits=LIMITS)) as client:
        yield client, gallery


def npz_file(**arrays) -> dict:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return {"file": ("x.npz", buf.getvalue(), "application/octet-stream")}


def png_file(pixels: np.ndarray) -> dict:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return {"file": ("x.png", buf.getvalue(), "image/png")}


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def test_embed_from_json_npz_and_image(served, onnx_bundle, samples):
    client, _ = served
    want = onnx_bundle.embed(samples[:5]).numpy()
    r = client.post("/embed", json={"inputs": samples[:5].tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["dim"] == 16 and body["model_fingerprint"] == onnx_bundle.model_fingerprint
    np.testing.assert_allclose(body["embeddings"], want, atol=1e-6)
    r = client.post("/embed", files=npz_file(x=samples[:5]))
    np.testing.assert_allclose(r.json()["embeddings"], want, atol=1e-6)
    pixels = np.round(samples[0, 0] * 255).astype(np.uint8)
    r = client.post("/embed", files=png_file(pixels))
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["embeddings"], onnx_bundle.embed(pixels[None]).numpy(), atol=1e-6)


def test_enroll_verify_identify_classify_match_the_library(served, onnx_bundle, samples):
    client, gallery = served
    emb = unit(onnx_bundle.embed(samples))
    r = client.post(
        "/enroll", json={"identity": "p0", "inputs": samples[0:2].tolist(), "metadata": {"team": "a"}}
    )
    assert r.status_code == 200 and r.json()["enrolled"] == [{"identity": "p0", "added": 2, "templates": 2}]
    names = [f"p{i // 2}" for i in range(2, 10)]  # p1..p4, two samples each, one request
    r = client.post("/enroll", files=npz_file(x=samples[2:10]), data={"identities": json.dumps(names)})
    assert r.status_code == 200, r.text
    assert sorted(e["identity"] for e in r.json()["enrolled"]) == ["p1", "p2", "p3", "p4"]
    assert gallery.identities() == ["p0", "p1", "p2", "p3", "p4"] and gallery.metadata("p0") == {"team": "a"}

    probes = emb[10:20]
    owner = torch.arange(10) // 2
    brute = torch.stack([(probes @ emb[:10].T)[:, owner == i].max(1).values for i in range(5)], 1)  # [10, 5]
    claims = [f"p{i % 5}" for i in range(10)]
    r = client.post("/verify", json={"embeddings": probes.tolist(), "identities": claims})
    assert r.status_code == 200, r.text
    for i, res in enumerate(r.json()["results"]):
        assert res["identity"] == claims[i]
        assert res["score"] == pytest.approx(float(brute[i, i % 5]), abs=1e-5)
        assert res["match"] == (res["score"] > gallery.threshold) and res["threshold"] == gallery.threshold
    r = client.post("/verify", json={"inputs": samples[10:12].tolist(), "identity": "p3"})
    assert [v["score"] for v in r.json()["results"]] == pytest.approx(brute[:2, 3].tolist(), abs=1e-5)

    r = client.post("/identify", files=npz_file(x=samples[10:20]), data={"k": "3"})
    assert r.status_code == 200, r.text
    for i, res in enumerate(r.json()["results"]):
        order = torch.argsort(brute[i], descending=True)[:3].tolist()
        assert [c["identity"] for c in res["candidates"]] == [f"p{j}" for j in order]
        best = float(brute[i, order[0]])
        assert res["decision"] == ("match" if best > gallery.threshold else "unknown")
        assert res["identity"] == (f"p{order[0]}" if best > gallery.threshold else None)

    r = client.post("/classify", json={"inputs": samples[10:20].tolist()})
    want = onnx_bundle.knn().predict(onnx_bundle.embed(samples[10:20])).tolist()
    assert [c["label"] for c in r.json()["results"]] == want
    assert [c["name"] for c in r.json()["results"]] == [str(c) for c in want]
    r = client.post("/classify", json={"embeddings": probes.tolist(), "index": "gallery"})
    assert [c["name"] for c in r.json()["results"]] == [c.identity for c in gallery.classify(probes)]

    assert client.delete("/identities/p3").json() == {"removed": "p3"}
    assert client.delete("/identities/p3").status_code == 404
    r = client.post("/identify", json={"embeddings": probes.tolist(), "k": 5})
    assert all(c["identity"] != "p3" for res in r.json()["results"] for c in res["candidates"])


def npy_body(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


NPY = {"content-type": "application/x-npy"}


def test_binary_npy_bodies_answer_as_json_does(served, onnx_bundle, samples):
    client, gallery = served
    emb = unit(onnx_bundle.embed(samples[:6])).numpy()
    r = client.post(
        "/enroll?kind=embeddings&identities=" + json.dumps(["a", "a", "b"]),
        content=npy_body(emb[:3]),
        headers=NPY,
    )
    assert r.status_code == 200, r.text
    assert sorted((e["identity"], e["templates"]) for e in r.json()["enrolled"]) == [("a", 2), ("b", 1)]
    as_json = client.post("/identify", json={"embeddings": emb[3:].tolist(), "k": 2}).json()
    as_npy = client.post("/identify?kind=embeddings&k=2", content=npy_body(emb[3:]), headers=NPY).json()
    assert as_npy == as_json and len(as_npy["results"]) == 3
    r = client.post("/verify?kind=inputs&identity=b", content=npy_body(samples[3:5]), headers=NPY)
    want = gallery.verify(emb[3:5], "b")
    assert [v["score"] for v in r.json()["results"]] == pytest.approx([v.score for v in want], abs=1e-5)
    r = client.post("/embed?kind=inputs", content=npy_body(samples[:2]), headers=NPY)
    np.testing.assert_allclose(r.json()["embeddings"], onnx_bundle.embed(samples[:2]).numpy(), atol=1e-6)
    refusals = [
        ("/identify", b"", 422, "kind=inputs"),  # no kind
        ("/identify?kind=probes", npy_body(emb[:1]), 422, "kind=inputs"),
        ("/identify?kind=embeddings&kind=inputs", npy_body(emb[:1]), 422, "twice"),
        ("/identify?kind=embeddings", b"", 422, "empty"),
        ("/identify?kind=embeddings", npy_body(emb[:1]) + b"x", 422, "bytes follow"),
        ("/identify?kind=embeddings", b"not an array", 422, "not a valid .npy"),
        ("/identify?kind=embeddings", npy_body(np.array([object()], dtype=object)), 422, "not allowed"),
        ("/identify?kind=embeddings", npy_body(np.full((1, 16), np.nan, np.float32)), 422, "NaN"),
        ("/identify?kind=embeddings", npy_body(np.zeros((0, 16), np.float32)), 422, "no number"),
        ("/identify?kind=embeddings&embeddings=[1]", npy_body(emb[:1]), 422, "cannot be a parameter"),
        ("/identify?kind=embeddings&k=many", npy_body(emb[:1]), 422, "integer"),
        ("/verify?kind=embeddings&identity=nobody", npy_body(emb[:1]), 404, "unknown identity"),
        ("/verify?kind=embeddings&identity=a&colour=1", npy_body(emb[:1]), 422, "colour"),
    ]
    for url, body, status, match in refusals:
        r = client.post(url, content=body, headers=NPY)
        assert r.status_code == status and re.search(match, r.json()["detail"]), (url, r.text)


def test_json_integer_pixels_are_8_bit_images(served, onnx_bundle, samples):
    client, _ = served
    pixels = np.round(samples[:3] * 255).astype(np.uint8)  # [3, 1, 8, 8]
    want = onnx_bundle.embed(pixels).numpy()
    r = client.post("/embed", json={"inputs": pixels.tolist()})  # JSON integers 0..255
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["embeddings"], want, atol=1e-6)
    floats = client.post("/embed", json={"inputs": (pixels / 255.0).tolist()}).json()["embeddings"]
    np.testing.assert_allclose(floats, want, atol=1e-5)  # the same images as floats in [0, 1]
    r = client.post("/embed", files=npz_file(x=pixels.astype(np.int64)))  # integer .npz: 8-bit too
    np.testing.assert_allclose(r.json()["embeddings"], want, atol=1e-6)
    for bad in ([[[[300] * 8] * 8]], [[[[-1] * 8] * 8]]):
        r = client.post("/embed", json={"inputs": bad})
        assert r.status_code == 422 and "0..255" in r.json()["detail"], r.text
    r = client.post("/embed", json={"inputs": [[[["0.5"] * 8] * 8]]})
    assert r.status_code == 422 and "numbers" in r.json()["detail"]


def test_event_loop_and_thread_pool_give_the_same_answers(served, onnx_bundle, samples, monkeypatch):
    import marginkit.serve.app as app_module

    client, gallery = served
    emb = unit(onnx_bundle.embed(samples[:12]))
    gallery.enroll_many([f"p{i % 4}" for i in range(8)], emb[:8])
    bodies = [
        ("/verify", {"embeddings": emb[8:].tolist(), "identity": "p1"}),
        ("/identify", {"embeddings": emb[8:].tolist(), "k": 3}),
        ("/classify", {"embeddings": emb[8:].tolist(), "index": "gallery"}),
        ("/classify", {"embeddings": emb[8:].tolist()}),
    ]
    inline = [client.post(path, json=body).json() for path, body in bodies]
    monkeypatch.setattr(app_module, "INLINE_SCORES", 0)  # every request through the thread pool
    pooled = [client.post(path, json=body).json() for path, body in bodies]
    assert pooled == inline and all("results" in r for r in inline)


def test_answers_match_their_documented_models(served, onnx_bundle, samples):
    from marginkit.serve import schemas

    client, _ = served
    emb = unit(onnx_bundle.embed(samples[:4]))
    calls = [
        (
            "post",
            "/enroll",
            {"json": {"identity": "a", "embeddings": emb[:2].tolist()}},
            schemas.EnrollResponse,
        ),
        ("post", "/embed", {"json": {"inputs": samples[:2].tolist()}}, schemas.EmbedResponse),
        (
            "post",
            "/verify",
            {"json": {"identity": "a", "embeddings": emb[2:].tolist()}},
            schemas.VerifyResponse,
        ),
        ("post", "/identify", {"json": {"embeddings": emb[2:].tolist(), "k": 1}}, schemas.IdentifyResponse),
        ("post", "/classify", {"json": {"embeddings": emb[2:].tolist()}}, schemas.ClassifyResponse),
        ("get", "/health", {}, schemas.HealthResponse),
        ("get", "/metrics", {}, schemas.MetricsResponse),
        ("delete", "/identities/a", {}, schemas.RemoveResponse),
    ]
    spec = client.get("/openapi.json").json()
    for method, path, kwargs, model in calls:
        r = getattr(client, method)(path, **kwargs)
        assert r.status_code == 200, (path, r.text)
        model.model_validate(r.json(), strict=True)
        doc_path = "/identities/{identity}" if path.startswith("/identities/") else path
        answers = spec["paths"][doc_path][method]["responses"]
        assert answers["200"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model.__name__}"
        }, path
        refusals = [code for code in answers if code.startswith("4")]
        assert refusals or path == "/health", path
        for code in refusals:
            ref = answers[code]["content"]["application/json"]["schema"]
            assert ref == {"$ref": "#/components/schemas/ErrorResponse"}, (path, code)
    assert set(spec["paths"]["/verify"]["post"]["requestBody"]["content"]) == {
        "application/json",
        "multipart/form-data",
        "application/x-npy",
    }


def test_docs_pages_load_nothing_from_another_host(served):
    client, _ = served
    for page in ("/docs", "/redoc"):
        r = client.get(page)
        assert r.status_code == 200
        urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", r.text)
        urls += re.findall(r"""url: ['"]([^'"]+)['"]""", r.text)
        assert urls, r.text[:500]
        for url in urls:
            assert not re.match(r"(https?:)?//", url), (page, url)  # no CDN, no other host
            assert client.get(url).status_code == 200, (page, url)
    assert "swagger-ui-bundle.js" in client.get("/docs").text


def test_health_metrics_and_docs(served):
    client, _ = served
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["gallery"] == {"identities": 0, "templates": 0}
    assert health["far"] == 1e-2 and health["model"]["embedding_dim"] == 16
    client.post("/verify", json={"embeddings": [[1.0] * 16], "identity": "nobody"})
    client.get("/nowhere")
    stats = client.get("/metrics").json()["requests"]
    assert stats["POST /verify"]["count"] == 1 and stats["POST /verify"]["status"] == {"404": 1}
    assert set(stats["POST /verify"]["latency_ms"]) == {"window", "mean", "p50", "p99", "max"}
    assert stats["GET /health"]["count"] == 1 and "(unmatched)" in " ".join(stats)
    spec = client.get("/openapi.json").json()
    assert {
        "/embed",
        "/classify",
        "/verify",
        "/identify",
        "/enroll",
        "/identities/{identity}",
        "/health",
        "/metrics",
    } <= set(spec["paths"])
    assert "multipart/form-data" in spec["paths"]["/verify"]["post"]["requestBody"]["content"]
    assert client.get("/docs").status_code == 200


def _pickled_npz() -> dict:
    buf = io.BytesIO()
    np.save(buf, np.array([object()], dtype=object), allow_pickle=True)
    z = io.BytesIO()
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("x.npy", buf.getvalue())
    return {"file": ("x.npz", z.getvalue())}


def _bad_requests(samples):
    img = samples[:2].tolist()
    big_png = png_file(np.zeros((200, 200), np.uint8))
    return [
        ("post", "/verify", {"json": {"inputs": [[0.5] * 5], "identity": "a"}}, 422, "shape"),
        ("post", "/verify", {"content": b'{"inputs": [[NaN]], "identity": "a"}'}, 422, "NaN"),
        (
            "post",
            "/verify",
            {"json": {"embeddings": [[1.0] * 16], "identity": "nobody"}},
            404,
            "unknown identity",
        ),
        ("post", "/verify", {"json": {"embeddings": [[1.0] * 17], "identity": "a"}}, 422, r"\[B, 16\]"),
        ("post", "/verify", {"json": {"embeddings": [[0.0] * 16], "identity": "a"}}, 422, "all zeros"),
        (
            "post",
            "/verify",
            {"json": {"embeddings": [[1.0] * 16, [1.0]], "identity": "a"}},
            422,
            "rectangular",
        ),
        (
            "post",
            "/verify",
            {"json": {"inputs": img, "embeddings": [[1.0] * 16], "identity": "a"}},
            422,
            "not both",
        ),
        ("post", "/verify", {"json": {"identity": "a"}}, 422, "no samples"),
        ("post", "/verify", {"json": {"inputs": img}}, 422, "exactly one"),
        ("post", "/verify", {"json": {"inputs": img, "identity": "a", "colour": 1}}, 422, "colour"),
        ("post", "/verify", {"json": {"inputs": img, "identity": 5}}, 422, "identity"),
        ("post", "/verify", {"json": {"embeddings": [[1.0] * 16] * 65, "identity": "a"}}, 413, "batch of 65"),
        (
            "post",
            "/verify",
            {"json": {"embeddings": [[1.0] * 16] * 20000, "identity": "a"}},
            413,
            "body exceeds",
        ),
        ("post", "/verify", {"content": b"{not json"}, 422, "not valid JSON"),
        ("post", "/verify", {"content": b"[1, 2]"}, 422, "JSON object"),
        ("post", "/verify", {"content": b""}, 422, "empty"),
        (
            "post",
            "/verify",
            {"content": b"x", "headers": {"content-type": "text/plain"}},
            415,
            "content type",
        ),
        ("post", "/verify", {"files": _pickled_npz(), "data": {"identity": "a"}}, 422, "dtype object"),
        ("post", "/verify", {"files": npz_file(y=np.ones(3)), "data": {"identity": "a"}}, 422, "array 'x'"),
        (
            "post",
            "/verify",
            {"files": png_file(np.zeros((16, 16), np.uint8)), "data": {"identity": "a"}},
            422,
            "8x8",
        ),
        ("post", "/verify", {"files": big_png, "data": {"identity": "a"}}, 413, "pixels"),
        (
            "post",
            "/verify",
            {"files": {"file": ("x.bin", b"\x00garbage")}, "data": {"identity": "a"}},
            415,
            "image",
        ),
        ("post", "/identify", {"json": {"inputs": img, "k": 0}}, 422, "k"),
        ("post", "/identify", {"files": npz_file(x=samples[:2]), "data": {"k": "many"}}, 422, "integer"),
        ("post", "/enroll", {"json": {"identity": "x" * 300, "inputs": img}}, 422, "256"),
        ("post", "/enroll", {"json": {"identity": "a", "inputs": img, "metadata": [1]}}, 422, "metadata"),
        (
            "post",
            "/enroll",
            {"files": npz_file(x=samples[:2]), "data": {"identity": "a", "metadata": "{"}},
            422,
            "JSON",
        ),
        ("post", "/enroll", {"json": {"identities": ["a"], "inputs": img}}, 422, "must match"),
        ("post", "/embed", {"json": {"embeddings": [[1.0] * 16]}}, 422, "embeddings"),
        ("post", "/classify", {"json": {"embeddings": [[1.0] * 16], "index": "gallery"}}, 409, "empty"),
        ("post", "/classify", {"json": {"embeddings": [[1.0] * 16], "index": "other"}}, 422, "index"),
        ("delete", "/identities/nobody", {}, 404, "unknown identity"),
    ]


def test_every_bad_input_is_a_4xx_with_a_message(served, samples):
    client, _ = served
    for method, path, kwargs, status, match in _bad_requests(samples):
        if "content" in kwargs:
            kwargs = {"headers": {"content-type": "application/json"}, **kwargs}
        r = getattr(client, method)(path, **kwargs)
        assert r.status_code == status, (path, kwargs.get("json", kwargs.get("data")), r.text[:300])
        assert re.search(match, r.json()["detail"]), (match, r.json()["detail"])
    assert client.get("/health").json()["gallery"]["identities"] == 0


json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=40, deadline=None)
@given(
    path=st.sampled_from(["/verify", "/identify", "/enroll", "/classify", "/embed"]),
    body=st.one_of(
        st.binary(max_size=200),
        st.dictionaries(
            st.sampled_from(["inputs", "embeddings", "identity", "identities", "k", "metadata", "index"]),
            json_values,
            max_size=4,
        ).map(lambda d: json.dumps(d).encode()),
    ),
)
def test_fuzzed_bodies_never_fail_the_server(onnx_bundle, tmp_path_factory, path, body):
    app = _fuzz_app(onnx_bundle, tmp_path_factory)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body[:200], r.text[:300])


_FUZZ: dict = {}


def _fuzz_app(bundle, factory):
    if "app" not in _FUZZ:
        gallery = Gallery(factory.mktemp("fuzz") / "g.db", bundle, far=1e-2)
        gallery.enroll("a", torch.ones(16))
        _FUZZ["app"] = create_app(bundle, gallery, limits=LIMITS)
    return _FUZZ["app"]


def test_bearer_token(onnx_bundle, tmp_path):
    app = create_app(
        onnx_bundle, Gallery(tmp_path / "g.db", onnx_bundle, far=1e-2), token=TOKEN, limits=LIMITS
    )
    with TestClient(app) as client:
        body = {"embeddings": [[1.0] * 16], "k": 1}
        assert client.post("/identify", json=body).status_code == 401
        r = client.post("/identify", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.get("/metrics").status_code == 401
        assert (
            client.post("/identify", json=body, headers={"Authorization": f"Bearer {TOKEN}"}).status_code
            == 200
        )
        assert client.get("/health").status_code == 200
        spec = client.get("/openapi.json").json()  # the docs name the scheme, Swagger UI can send it
        assert spec["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
        assert spec["paths"]["/identify"]["post"]["security"] == [{"bearer": []}]
        assert "security" not in spec["paths"]["/health"]["get"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_a_real_uvicorn_process(onnx_bundle, samples, tmp_path):
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cmd = [
        sys.executable, "-m", "marginkit.cli", "serve", str(onnx_bundle.path),
        "--gallery", str(tmp_path / "g.db"), "--port", str(port), "--far", "1e-2",
        "--token-file", str(token_file), "--max-body-mb", "0.5",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.communicate()[1][-2000:]
            try:
                status, health = http("GET", f"{url}/health")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "server did not come up in 120 s"
                time.sleep(0.25)
        assert status == 200 and health["model"]["model_fingerprint"] == onnx_bundle.model_fingerprint
        enroll = json.dumps({"identity": "alice", "inputs": samples[:2].tolist()}).encode()
        assert http("POST", f"{url}/enroll", enroll)[0] == 401
        status, body = http("POST", f"{url}/enroll", enroll, TOKEN)
        assert status == 200 and body["enrolled"][0]["templates"] == 2
        probe = json.dumps({"inputs": samples[:1].tolist(), "k": 1}).encode()
        status, body = http("POST", f"{url}/identify", probe, TOKEN)
        assert status == 200 and body["results"][0]["identity"] == "alice"
        huge = json.dumps({"embeddings": [[1.0] * 16] * 40000, "identity": "alice"}).encode()
        status, body = http("POST", f"{url}/verify", huge, TOKEN)
        assert status == 413 and "exceeds" in body["detail"]
        assert http("GET", f"{url}/metrics", token=TOKEN)[1]["requests"]["POST /identify"]["count"] == 1
    finally:
        server.terminate()
        try:
            out = server.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:  # pragma: no cover
            server.kill()
            out = server.communicate(timeout=30)[0]
    with Gallery(tmp_path / "g.db", onnx_bundle, far=1e-2) as g:  # the enrollment persisted
        assert g.identities() == ["alice"]
    # uvicorn's access log: one line per request, with its status
    assert re.search(r'"POST /enroll HTTP/1.1" 401', out) and re.search(
        r'"POST /enroll HTTP/1.1" 200', out
    ), out
    assert len(re.findall(r'"(GET|POST) /\S* HTTP/1.1" \d{3}', out)) >= 6, out


def start_server(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "marginkit.cli", "serve", *args, "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert server.poll() is None, server.communicate()[0][-2000:]
        try:
            http("GET", f"{url}/health")
            return server, url
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline, "server did not come up in 180 s"
            time.sleep(0.25)


@pytest.mark.slow
def test_two_worker_processes_share_one_gallery_file(onnx_bundle, samples, tmp_path):
    """Each worker opens the gallery; an enrollment answered by one is seen by the other before
    its next query. Connections are not kept alive, so requests spread over both workers."""
    args = [str(onnx_bundle.path), "--gallery", str(tmp_path / "g.db"), "--far", "1e-2"]
    server, url = start_server([*args, "--workers", "2", "--no-access-log"], tmp_path)
    try:
        for i in range(12):
            body = json.dumps({"identity": f"p{i}", "inputs": samples[i : i + 1].tolist()}).encode()
            assert http("POST", f"{url}/enroll", body)[0] == 200
            status, answer = http("GET", f"{url}/health")
            assert status == 200 and answer["gallery"]["identities"] == i + 1  # any worker sees them all
        probe = json.dumps({"inputs": samples[:12].tolist(), "k": 1}).encode()
        for _ in range(6):
            status, answer = http("POST", f"{url}/identify", probe)
            assert [r["candidates"][0]["identity"] for r in answer["results"]] == [f"p{i}" for i in range(12)]
    finally:
        server.terminate()
        out = server.communicate(timeout=60)[0]
    assert out.count("Started server process") == 2, out  # two workers ran
    assert "POST /identify" not in out  # --no-access-log


def test_cli_serve_refuses_bad_setups(onnx_bundle, tmp_path, capsys):
    gallery = str(tmp_path / "g.db")
    assert main(["serve", str(tmp_path / "nope"), "--gallery", gallery]) == 2
    assert "no bundle directory" in capsys.readouterr().err
    assert main(["serve", str(onnx_bundle.path), "--gallery", gallery, "--far", "1e-4"]) == 2
    assert "no threshold at FAR 0.0001" in capsys.readouterr().err
    (tmp_path / "short").write_text("abc")
    assert (
        main(["serve", str(onnx_bundle.path), "--gallery", gallery, "--token-file", str(tmp_path / "short")])
        == 2
    )
    assert "at least 16" in capsys.readouterr().err
    other = Gallery(tmp_path / "other.db", model_fingerprint="sha256:" + "0" * 64, embedding_dim=16)
    other.close()
    assert (
        main(["serve", str(onnx_bundle.path), "--gallery", str(tmp_path / "other.db"), "--far", "1e-2"]) == 2
    )
    assert "another space" in capsys.readouterr().err
    # --gallery-dtype makes a new gallery with that storage; an existing one keeps its own
    from marginkit.serve import build_app

    build_app(onnx_bundle.path, tmp_path / "int8.db", far=1e-2, gallery_dtype="int8")
    assert Gallery(tmp_path / "int8.db", threshold=0.5).dtype == "int8"
    assert main(["serve", str(onnx_bundle.path), "--gallery", str(tmp_path / "int8.db"), "--far", "1e-2",
                 "--gallery-dtype", "float16"]) == 2  # fmt: skip
    assert "stores its templates as int8, not float16" in capsys.readouterr().err
    # --gallery-backend: the template search; an approximate one over int8 templates is refused
    app = build_app(onnx_bundle.path, tmp_path / "ivf.db", far=1e-2, gallery_backend="ivf")
    assert app.state.gallery.backend == "ivf"
    assert main(["serve", str(onnx_bundle.path), "--gallery", str(tmp_path / "int8.db"), "--far", "1e-2",
                 "--gallery-backend", "hnsw"]) == 2  # fmt: skip
    assert "backend 'hnsw' searches float32 templates" in capsys.readouterr().err


README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_deploy_example_runs_and_shows_a_match_an_unknown_and_a_rejection(tmp_path):
    """The README's train -> export -> serve block, then its Python client, run by bash in a
    scratch directory: the printed answers are the ones the README explains."""
    text = README.read_text(encoding="utf-8")
    found = re.search(
        r"<!-- deploy -->\s*```bash\n(.*?)```.*?```python\n(.*?)```\s*```text\n(.*?)```", text, re.S
    )
    assert found, "README has no deploy block followed by its client and the client's output"
    script, client, shown = found.groups()
    assert script.count("marginkit ") == 3 and "/health" in script
    port = find_free_port()  # the README's port 8000 may be taken (another suite, a server running)
    script, moved = on_a_free_port(script, port)
    client, moved_client = on_a_free_port(client, port)
    assert moved >= 2 and moved_client >= 1, script  # the server's --port and the clients' URLs
    (tmp_path / "client.py").write_text(client, encoding="utf-8")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", f"{script}\npython client.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    health = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"status"')))
    assert health["gallery"] == {"identities": 0, "templates": 0} and health["far"] == 1e-3
    printed = [line for line in done.stdout.splitlines() if not line.startswith(("INFO", "serving", '{"'))]
    printed = printed[-3:]
    words = [line.split()[:2] for line in printed[:2]]
    assert words == [["match", "three"], ["unknown", "None"]], printed
    assert [line.split()[:2] for line in shown.strip().splitlines()[:2]] == words
    verdict = ast.literal_eval(printed[2])  # the dict the README prints
    assert verdict["identity"] == "seven" and verdict["match"] is False
    assert verdict["score"] < verdict["threshold"] == pytest.approx(health["threshold"])
    assert re.search(r"POST /enroll HTTP/1.1\" 200", done.stdout + done.stderr)  # the access log


def test_probe_embeddings_at_any_scale_and_beyond_float32(served, onnx_bundle, samples):
    # issue 28: probes were normalised by vector_norm (inf at 1e30 in float32, every score 0), and
    # float64 probes beyond float32's range became inf silently (then were refused; a direction
    # at any finite scale has its cosines, as in the library)
    client, _ = served
    emb = unit(onnx_bundle.embed(samples))
    client.post("/enroll", json={"identity": "p0", "embeddings": emb[:2].tolist()})
    client.post("/enroll", json={"identity": "p1", "embeddings": emb[2:4].tolist()})
    probes = emb[4:8]
    base = client.post("/identify", json={"embeddings": probes.tolist(), "k": 2}).json()["results"]
    for scale in (1e30, 1e-30, 1e300, 1e-300):
        got = client.post("/identify", json={"embeddings": (probes.double() * scale).tolist(), "k": 2})
        assert got.status_code == 200, got.text
        for a, b in zip(got.json()["results"], base, strict=True):
            assert [c["identity"] for c in a["candidates"]] == [c["identity"] for c in b["candidates"]]
            scores = [c["score"] for c in b["candidates"]]
            # float32 cosines of one direction normalised from another scale: a few ulps apart
            assert [c["score"] for c in a["candidates"]] == pytest.approx(scores, abs=1e-6)
    npy = io.BytesIO()
    np.save(npy, np.full((1, probes.shape[1]), np.inf))
    r = client.post(
        "/identify", content=npy.getvalue(), params={"kind": "embeddings"},
        headers={"content-type": "application/x-npy"},
    )  # fmt: skip
    assert r.status_code == 422 and "contains NaN or infinite values" in r.json()["detail"], r.text


def test_the_direct_dispatch_answers_exactly_as_fastapis_stack(onnx_bundle, samples, tmp_path):
    """The raw POST routes skip FastAPI's router and exception middleware (``_Direct``): every
    answer and refusal, headers included, equals the one FastAPI's own stack gives."""
    from marginkit.serve.app import _Direct

    emb = unit(onnx_bundle.embed(samples))
    npy = io.BytesIO()
    np.save(npy, emb[:2].numpy())
    requests = [
        ("post", "/enroll", {"json": {"identity": "a", "embeddings": emb[:2].tolist()}}),
        ("post", "/verify", {"json": {"identity": "a", "embeddings": emb[2].tolist()}}),
        ("post", "/verify", {"json": {"identity": "nobody", "embeddings": emb[2].tolist()}}),
        ("post", "/verify", {"json": {"embeddings": emb[2].tolist()}}),
        ("post", "/verify", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
        ("post", "/verify", {"content": b"x", "headers": {"content-type": "text/plain"}}),
        ("post", "/identify", {"json": {"embeddings": emb[2:5].tolist(), "k": 2}}),
        ("post", "/identify", {"json": {"embeddings": emb[2:5].tolist(), "k": 0}}),
        (
            "post",
            "/identify",
            {
                "content": npy.getvalue(),
                "params": {"kind": "embeddings"},
                "headers": {"content-type": "application/x-npy"},
            },
        ),
        ("post", "/classify", {"json": {"inputs": samples[:3].tolist()}}),
        ("post", "/embed", {"json": {"embeddings": emb[:1].tolist()}}),
        ("get", "/verify", {}),
        ("post", "/verify/", {"json": {}}),
        ("post", "/metrics", {}),
    ]

    def answers(direct: bool, token: str | None) -> list[tuple[int, bytes, dict]]:
        gallery = Gallery(tmp_path / f"{direct}-{token}.db", onnx_bundle, far=1e-2)
        app = create_app(onnx_bundle, gallery, limits=LIMITS, token=token)
        if not direct:
            app.user_middleware = [m for m in app.user_middleware if m.cls is not _Direct]
        assert (_Direct in [m.cls for m in app.user_middleware]) == direct
        out = []
        with TestClient(app, follow_redirects=False) as client:
            auth = {"authorization": f"Bearer {token}"} if token else {}
            for method, path, kw in requests:
                kw = {**kw, "headers": {**kw.get("headers", {}), **auth}}
                r = getattr(client, method)(path, **kw)
                out.append((r.status_code, r.content, {k: v for k, v in r.headers.items() if k != "date"}))
            r = client.post("/verify", json={"identity": "a", "embeddings": emb[2].tolist()})
            out.append((r.status_code, r.content, dict(r.headers)))  # without the token, when one is set
            metrics = client.get("/metrics", headers=auth).json()["requests"]
            out.append({k: (v["count"], v["status"]) for k, v in metrics.items()})
        gallery.close()
        return out

    for token in (None, "s3cret-token-of-16+"):
        fast, stack = answers(True, token), answers(False, token)
        assert fast == stack
    statuses = [status for status, *_ in fast[:-1]]
    assert statuses == [200, 200, 404, 422, 422, 415, 200, 422, 200, 200, 422, 405, 307, 405, 401]
