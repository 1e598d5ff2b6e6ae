"""marginkit.gallery: answers against brute force, persistence, processes, crashes and faults."""

from __future__ import annotations

import collections
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from marginkit.gallery import Gallery, GalleryError, UnknownIdentityError
from marginkit.gallery.quantize import dequantize, quantize
from marginkit.gallery.store import Store
from proc_utils import acks_then_kill

FP = "sha256:" + "ab" * 32
DIM = 8


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def population(gen: torch.Generator, identities: int = 12, max_templates: int = 3):
    """Identities with 1..max_templates noisy templates around a random centre each."""
    centres = unit(torch.randn(identities, DIM, generator=gen))
    counts = torch.randint(1, max_templates + 1, (identities,), generator=gen)
    owner = torch.repeat_interleave(torch.arange(identities), counts)
    templates = unit(centres[owner] + 0.3 * torch.randn(len(owner), DIM, generator=gen))
    return [f"id{i:03d}" for i in range(identities)], owner, templates, centres


def new_gallery(path: Path, **kw) -> Gallery:
    kw.setdefault("threshold", 0.5)
    return Gallery(path, model_fingerprint=FP, embedding_dim=DIM, **kw)


def fill(g: Gallery, names, owner, templates) -> None:
    for i, name in enumerate(names):
        g.enroll(name, templates[owner == i], metadata={"row": i})


def brute_scores(probes: torch.Tensor, owner: torch.Tensor, templates: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n] largest template cosine per identity, by a plain loop."""
    out = torch.full((len(probes), n), -2.0)
    p = unit(probes)
    for b in range(len(p)):
        for t in range(len(templates)):
            out[b, owner[t]] = max(float(out[b, owner[t]]), float(p[b] @ templates[t]))
    return out


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("exact", "float32"), ("faiss", "float32"), ("exact", "float16"), ("exact", "int8")],
)
def test_verify_identify_classify_equal_brute_force(tmp_path, gen, backend, dtype):
    names, owner, templates, centres = population(gen)
    g = new_gallery(tmp_path / "g.db", backend=backend, k=3, dtype=dtype)
    fill(g, names, owner, templates)
    templates = dequantize(*quantize(templates, dtype))  # the gallery answers from what it stores
    probes = unit(centres + 0.4 * torch.randn(centres.shape, generator=gen))
    probes = torch.cat([probes, unit(torch.randn(5, DIM, generator=gen))])
    want = brute_scores(probes, owner, templates, len(names))

    claimed = [names[(b * 5) % len(names)] for b in range(len(probes))]
    ver = g.verify(probes, claimed)
    for b, v in enumerate(ver):
        s = float(want[b, names.index(claimed[b])])
        assert v.identity == claimed[b] and v.score == pytest.approx(s, abs=1e-5)
        assert v.match == (v.score > 0.5) and v.threshold == 0.5

    ident = g.identify(probes, k=4)
    for b, res in enumerate(ident):
        ranked = torch.argsort(want[b], descending=True)[:4].tolist()
        assert [c.identity for c in res.candidates] == [names[i] for i in ranked]
        assert [c.score for c in res.candidates] == pytest.approx(want[b, ranked].tolist(), abs=1e-5)
        assert res.identity == (names[ranked[0]] if float(want[b, ranked[0]]) > 0.5 else None)
        assert res.unknown == (res.identity is None)

    # K-NN over templates: 3 nearest templates vote, ties to the smallest identity index
    cls = g.classify(probes)
    sims = unit(probes) @ templates.T
    for b, c in enumerate(cls):
        near = torch.argsort(sims[b], descending=True)[:3]
        votes = torch.bincount(owner[near], minlength=len(names))
        assert c.identity == names[int(votes.argmax())]
        assert c.share == pytest.approx(float(votes.max()) / 3)

    single = g.verify(probes[0], names[0])
    assert single.score == pytest.approx(float(want[0, 0]), abs=1e-5)
    assert g.identify(probes[0], k=2).candidates[0].identity == ident[0].candidates[0].identity


@pytest.mark.parametrize("backend", ["hnsw", "ivf"])
def test_approximate_search_finds_the_exact_answers_on_separated_identities(tmp_path, gen, backend):
    # ivf: enough templates (>= 39²) that its cells are trained, not the exact start-up search
    names, owner, templates, centres = population(gen, identities=60 if backend == "hnsw" else 800)
    exact, hnsw = (new_gallery(tmp_path / f"{b}.db", backend=b) for b in ("exact", backend))
    for g in (exact, hnsw):
        g.enroll_many([names[i] for i in owner.tolist()], templates)
    if backend == "ivf":
        assert hnsw._knn._index.nlist is not None
    probes = unit(centres + 0.2 * torch.randn(centres.shape, generator=gen))
    a, b = exact.identify(probes, k=3), hnsw.identify(probes, k=3)
    same = sum(x.candidates[0].identity == y.candidates[0].identity for x, y in zip(a, b, strict=True))
    assert same / len(a) >= 0.95
    assert [v.score for v in exact.verify(probes, names)] == pytest.approx(
        [v.score for v in hnsw.verify(probes, names)]
    )  # verification never goes through the approximate index


def test_persists_across_reopen_and_refuses_another_model(tmp_path, gen):
    names, owner, templates, centres = population(gen)
    path = tmp_path / "g.db"
    with new_gallery(path) as g:
        fill(g, names, owner, templates)
        before = g.identify(centres, k=3)
    with Gallery(path, threshold=0.5) as g:  # adopts the stored fingerprint and dimension
        assert g.identities() == names and g.num_templates == len(templates)
        assert g.identify(centres, k=3) == before
        assert g.metadata(names[4]) == {"row": 4}
        assert torch.allclose(g.templates(names[2]), templates[owner == 2], atol=1e-6)
        assert g.integrity_check() == "ok"
    with pytest.raises(GalleryError, match="another space"):
        Gallery(path, model_fingerprint="sha256:" + "cd" * 32, threshold=0.5)
    with pytest.raises(GalleryError, match="dimension"):
        Gallery(path, model_fingerprint=FP, embedding_dim=DIM + 1)
    with pytest.raises(GalleryError, match="needs the model fingerprint"):
        Gallery(tmp_path / "new.db")


def test_remove_and_a_second_connection_stays_in_step(tmp_path, gen):
    names, owner, templates, centres = population(gen)
    path = tmp_path / "g.db"
    a, b = new_gallery(path), new_gallery(path)
    fill(a, names[:6], owner[owner < 6], templates[owner < 6])
    assert b.identities() == names[:6]  # b saw a's commits (PRAGMA data_version)
    b.enroll(names[6], templates[owner == 6])
    assert a.identify(centres[6]).candidates[0].identity == names[6]
    a.remove(names[6])
    a.remove(names[0])
    assert names[0] not in b and len(b) == 5
    with pytest.raises(UnknownIdentityError, match="id000"):
        b.verify(centres[0], names[0])
    with pytest.raises(UnknownIdentityError):
        b.remove(names[0])
    got = b.identify(centres, k=5)
    assert all(c.identity in names[1:6] for r in got for c in r.candidates)
    b.enroll(names[0], templates[owner == 0])  # re-enrolled after removal: a fresh identity
    assert a.identities() == [*names[1:6], names[0]]
    # enrolling again adds templates to the same identity
    assert a.enroll(names[1], centres[1]).templates == int((owner == 1).sum()) + 1
    assert b.verify(centres[1], names[1]).score == pytest.approx(1.0, abs=1e-6)


def test_enroll_many_is_one_transaction(tmp_path, gen):
    g = new_gallery(tmp_path / "g.db")
    emb = unit(torch.randn(6, DIM, generator=gen))
    res = g.enroll_many(["a", "b", "a", "c", "b", "a"], emb)
    assert {r.identity: (r.added, r.templates) for r in res} == {"a": (3, 3), "b": (2, 2), "c": (1, 1)}
    with pytest.raises(ValueError, match="must match"):
        g.enroll_many(["x", "y"], emb)
    assert len(g) == 3


def test_bad_inputs_are_clear_errors(tmp_path, gen):
    g = new_gallery(tmp_path / "g.db")
    g.enroll("a", torch.ones(DIM))
    for bad, match in [
        (torch.full((DIM,), float("nan")), "NaN"),
        (torch.zeros(DIM), "all-zero"),
        (torch.ones(DIM + 1), "D = 8"),
        (torch.ones(2, 2, DIM), "D = 8"),
    ]:
        with pytest.raises(ValueError, match=match):
            g.enroll("b", bad)
        with pytest.raises(ValueError, match=match):
            g.identify(bad)
    with pytest.raises(TypeError, match="must hold numbers"):
        g.enroll("b", ["x"] * DIM)
    with pytest.raises(TypeError, match="identity must be a str"):
        g.enroll(3, torch.ones(DIM))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="control characters"):
        g.enroll("a\nb", torch.ones(DIM))
    with pytest.raises(ValueError, match="JSON"):
        g.enroll("a", torch.ones(DIM), metadata={"x": float("nan")})
    with pytest.raises(ValueError, match="raw inputs need"):
        g.enroll("a", torch.ones(DIM), kind="inputs")
    with pytest.raises(ValueError, match="one per probe"):
        g.verify(torch.ones(3, DIM), ["a", "a"])
    assert len(g) == 1 and g.num_templates == 1
    no_threshold = Gallery(tmp_path / "g.db")
    with pytest.raises(GalleryError, match="threshold"):
        no_threshold.verify(torch.ones(DIM), "a")
    empty = new_gallery(tmp_path / "empty.db")
    assert empty.identify(torch.ones(DIM)).unknown and empty.identify(torch.ones(DIM)).candidates == ()
    with pytest.raises(GalleryError, match="empty"):
        empty.classify(torch.ones(DIM))


def test_hostile_files_are_refused(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(GalleryError, match="junk.db"):
        new_gallery(junk)
    path = tmp_path / "g.db"
    new_gallery(path).enroll("a", torch.ones(DIM))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE templates SET vector = ? WHERE id = 1", (b"\x00" * 12,))
    with pytest.raises(GalleryError, match="corrupted"):
        new_gallery(path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE templates SET vector = ?", (np.full(DIM, np.nan, np.float32).tobytes(),))
    with pytest.raises(GalleryError, match="NaN"):
        new_gallery(path)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("INSERT INTO meta VALUES ('format', 'something.else')")
    with pytest.raises(GalleryError, match="not a marginkit gallery"):
        new_gallery(other)


def test_template_storage_is_the_files_own(tmp_path, gen):
    """float16 / int8 storage: fixed when the file is made, kept on reopen, bytes as documented,
    scores within the stated bounds of the float32 gallery's, hostile rows refused."""
    names, owner, _, _ = population(gen, identities=40)
    dim = 64
    templates = unit(torch.randn(len(owner), dim, generator=gen))
    probes = unit(torch.randn(30, dim, generator=gen))
    galleries = {}
    for dtype in ("float32", "float16", "int8"):
        g = Gallery(
            tmp_path / f"{dtype}.db", model_fingerprint=FP, embedding_dim=dim, threshold=0.5, dtype=dtype
        )
        g.enroll_many([names[int(o)] for o in owner], templates)
        assert g.dtype == dtype
        galleries[dtype] = g
    exact = galleries["float32"].verify(probes, names[:30])
    for dtype, bound in (("float16", 1e-3), ("int8", dim**0.5 / 254)):
        g = galleries[dtype]
        got = g.verify(probes, names[:30])
        assert max(abs(a.score - b.score) for a, b in zip(got, exact, strict=True)) <= bound
        stored = g.templates(names[0])
        assert stored.dtype == torch.float32 and stored.shape == (int((owner == 0).sum()), dim)
        g.close()
        with Gallery(tmp_path / f"{dtype}.db", threshold=0.5) as again:  # the file says its dtype
            assert again.dtype == dtype and [v.score for v in again.verify(probes, names[:30])] == [
                v.score for v in got
            ]
        with pytest.raises(GalleryError, match=f"stores its templates as {dtype}, not float32"):
            Gallery(tmp_path / f"{dtype}.db", dtype="float32")
        with sqlite3.connect(tmp_path / f"{dtype}.db") as conn:
            sizes = {len(r[0]) for r in conn.execute("SELECT vector FROM templates")}
        assert sizes == {dim * 2 if dtype == "float16" else dim + 4}
    with pytest.raises(ValueError, match="dtype must be one of"):
        new_gallery(tmp_path / "x.db", dtype="int4")
    with pytest.raises(ValueError, match="backend 'faiss' searches float32 templates"):
        new_gallery(tmp_path / "y.db", dtype="int8", backend="faiss")
    # A scale that is not a positive finite number, an infinite float16: a corrupted file.
    path = tmp_path / "int8.db"
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE templates SET vector = ? WHERE id = 1", (np.float32(-1).tobytes() + b"\x01" * dim,)
        )
    with pytest.raises(GalleryError, match="scale"):
        Gallery(path)
    with sqlite3.connect(tmp_path / "float16.db") as conn:
        conn.execute(
            "UPDATE templates SET vector = ? WHERE id = 1", (np.full(dim, np.inf, np.float16).tobytes(),)
        )
    with pytest.raises(GalleryError, match="NaN or infinite"):
        Gallery(tmp_path / "float16.db")


def test_float64_beyond_float32s_range_is_a_direction_not_an_error(tmp_path):
    # Cosines do not depend on the scale: 1e39 (finite in float64, inf in float32) and 1e-320
    # (subnormal) are scored by their direction; inf itself stays an error.
    g = new_gallery(tmp_path / "g.db")
    g.enroll("a", np.eye(DIM)[0])
    g.enroll("huge", np.eye(DIM)[1] * 1e300)
    for scale in (1e39, 1e-320, 1.0):
        probe = (np.eye(DIM)[0] + np.eye(DIM)[1]) * scale
        assert g.verify(probe, "a").score == pytest.approx(2**-0.5)
        assert g.verify(probe, "huge").score == pytest.approx(2**-0.5)
    with pytest.raises(ValueError, match="probe contains NaN or infinite values"):
        g.verify(np.full(DIM, np.inf), "a")


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_failure_at_any_write_step_leaves_nothing_behind(tmp_path, gen, monkeypatch, dtype):
    """Fault injection: the enrollment's n-th statement fails; the gallery is as before."""
    path = tmp_path / "g.db"
    g = new_gallery(path, dtype=dtype)
    g.enroll("kept", torch.ones(DIM), metadata={"v": 1})
    calls = []
    real_execute, real_many = Store.execute, Store.executemany

    def counting(real):
        def run(self, *args, **kwargs):
            calls.append(1)
            if fault["at"] is not None and len(calls) == fault["at"]:
                raise Boom(f"injected at write step {fault['at']}")
            return real(self, *args, **kwargs)

        return run

    monkeypatch.setattr(Store, "execute", counting(real_execute))
    monkeypatch.setattr(Store, "executemany", counting(real_many))
    fault: dict[str, int | None] = {"at": None}
    emb = unit(torch.randn(3, DIM, generator=gen))
    g.enroll("probe-steps", emb)
    steps = len(calls)
    g.remove("probe-steps")
    assert steps >= 3
    for step in range(1, steps + 1):
        fault["at"] = step
        for args in [("kept", emb, {"v": 2}), ("new", emb, {"v": 3})]:
            calls.clear()
            with pytest.raises(Boom):
                g.enroll(*args)
            for view in (g, Gallery(path, threshold=0.5)):
                assert view.identities() == ["kept"] and view.num_templates == 1
                assert view.metadata("kept") == {"v": 1}
    fault["at"] = None
    assert Gallery(path).integrity_check() == "ok"


CHILD = textwrap.dedent(
    """
    import sys, torch
    from marginkit.gallery import Gallery
    path, prefix, count, fp = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    g = Gallery(path, model_fingerprint=fp, embedding_dim=8)
    gen = torch.Generator().manual_seed(abs(hash(prefix)) % 2**31)
    for i in range(count):
        name = f"{prefix}-{i}"
        g.enroll(name, torch.randn(8, generator=gen) + 0.1)
        g.enroll("shared", torch.randn(8, generator=gen) + 0.1)
        print(name, flush=True)
    """
)


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def test_concurrent_enrollment_from_processes_loses_and_duplicates_nothing(tmp_path):
    path = tmp_path / "g.db"
    reader = new_gallery(path)  # creates the file; then reads while the others write
    per, procs = 15, 3
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), f"p{i}", str(per), FP],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for i in range(procs)
    ]
    errors: list[BaseException] = []

    def read_until_done() -> None:
        probe = torch.ones(DIM)
        while any(c.poll() is None for c in children):
            try:
                reader.identify(probe, k=3)
                len(reader)
            except BaseException as exc:  # pragma: no cover - a failure is reported below
                errors.append(exc)
                return
            time.sleep(0.01)

    t = threading.Thread(target=read_until_done)
    t.start()
    outs = [c.communicate(timeout=240) for c in children]
    t.join(timeout=60)
    assert all(c.returncode == 0 for c in children), [o[1][-2000:] for o in outs]
    assert not errors
    expected = {f"p{i}-{j}" for i in range(procs) for j in range(per)} | {"shared"}
    g = Gallery(path, threshold=0.5)
    names = g.identities()
    assert len(names) == len(set(names)) and set(names) == expected
    assert set(reader.identities()) == expected
    counts = collections.Counter(g._owner.tolist())
    assert counts[g._index_of["shared"]] == per * procs
    assert all(counts[g._index_of[n]] == 1 for n in expected - {"shared"})
    assert g.integrity_check() == "ok"


@pytest.mark.parametrize("acks", [1, 12])
def test_kill_9_loses_no_acknowledged_enrollment(tmp_path, acks):
    path = tmp_path / "g.db"
    new_gallery(path).close()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), "k", "100000", FP],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    acknowledged = acks_then_kill(child, acks, 180)
    assert len(acknowledged) == acks, child.stderr.read() if child.stderr else ""
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    g = Gallery(path, threshold=0.5)
    assert set(acknowledged) <= set(g.identities())
    assert g.integrity_check() == "ok"
    # every identity present is complete: one template of its own (the transaction was whole)
    counts = collections.Counter(g._owner.tolist())
    assert all(counts[g._index_of[n]] == 1 for n in g.identities() if n != "shared")


class LinearEmbedder:
    """A small real embedder (a fixed linear map) standing in for a bundle."""

    input_shape = (3, 4)
    embedding_dim = DIM
    model_fingerprint = FP

    def __init__(self) -> None:
        self.weight = torch.randn(12, DIM, generator=torch.Generator().manual_seed(3))

    def embed(self, x) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(x), dtype=torch.float32)
        return unit(x.reshape(len(x), -1) @ self.weight)

    def threshold(self, far: float) -> float:
        if far == 1e-3:
            return 0.25
        raise ValueError(f"no threshold at FAR {far:g}")


def test_raw_inputs_go_through_the_embedder(tmp_path, gen):
    e = LinearEmbedder()
    g = Gallery(tmp_path / "g.db", e)
    assert g.threshold == 0.25
    x = torch.randn(4, 3, 4, generator=gen)
    g.enroll("a", x[:2])
    g.enroll("b", x[2])  # one raw sample
    assert torch.allclose(g.templates("a"), e.embed(x[:2]), atol=1e-6)
    assert g.identify(x[3]).candidates[0].identity == "b"
    assert g.verify(x[0], "a").score == pytest.approx(1.0, abs=1e-5)
    assert g.verify(e.embed(x[:1])[0], "a").score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match=r"\[B, 3, 4\]"):
        g.enroll("c", torch.randn(2, 4, 3, generator=gen), kind="inputs")
    assert Gallery(tmp_path / "g.db", e, far=1e-2).threshold is None
    with pytest.raises(GalleryError, match="FAR 0.01"):
        Gallery(tmp_path / "g.db", e, far=1e-2).verify(x[0], "a")
