"""The Milvus gallery (milvus-lite): the SQLite gallery's answers, refusals, crashes and recall."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from proc_utils import acks_then_kill

pytest.importorskip(
    "milvus_lite", reason="the Milvus gallery's tests need milvus-lite: pip install 'marginkit[milvus]'"
)

from marginkit.gallery import Gallery, GalleryError, UnknownIdentityError
from marginkit.gallery.milvus import MilvusGallery

FP = "sha256:" + "cd" * 32
DIM = 8


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def pair(tmp_path, **kw):
    kw = {"model_fingerprint": FP, "embedding_dim": DIM, "threshold": 0.6, **kw}
    return Gallery(tmp_path / "g.db", **kw), Gallery(tmp_path / "g.milvus.db", **kw)


def test_a_milvus_path_opens_a_milvus_gallery(tmp_path):
    sqlite, milvus = pair(tmp_path)
    assert type(sqlite) is Gallery and type(milvus) is MilvusGallery and isinstance(milvus, Gallery)
    for g in (sqlite, milvus):
        g.close()


def test_same_enrollment_stream_gives_the_same_answers_as_sqlite(tmp_path):
    gen = torch.Generator().manual_seed(7)
    centres = unit(torch.randn(40, DIM, generator=gen))
    counts = torch.randint(1, 4, (40,), generator=gen)
    owner = torch.repeat_interleave(torch.arange(40), counts)
    templates = unit(centres[owner] + 0.3 * torch.randn(len(owner), DIM, generator=gen))
    names = [f'id{i:02d}"\\' if i % 7 == 0 else f"id{i:02d}" for i in range(40)]  # quotes cannot inject
    galleries = pair(tmp_path, k=3, threshold=0.75)
    for g in galleries:  # one stream: single enrollments, a batch, a second enrollment, a removal
        for i in range(20):
            g.enroll(names[i], templates[owner == i], metadata={"row": i})
        rows = (owner >= 20).nonzero().squeeze(1)
        g.enroll_many([names[int(owner[r])] for r in rows], templates[rows])
        g.enroll(names[3], centres[3] + 0.01)
        g.remove(names[5])
    sqlite, milvus = galleries
    assert milvus.identities() == sqlite.identities() and len(milvus) == 39
    assert milvus.num_templates == sqlite.num_templates
    assert milvus.metadata(names[2]) == {"row": 2} and milvus.metadata(names[30]) is None
    torch.testing.assert_close(
        milvus.templates(names[3]).sort(0).values, sqlite.templates(names[3]).sort(0).values
    )
    probes = torch.cat(
        [unit(centres + 0.25 * torch.randn(40, DIM, generator=gen)), torch.randn(10, DIM, generator=gen)]
    )
    a, b = sqlite.identify(probes, k=4), milvus.identify(probes, k=4)
    for x, y in zip(a, b, strict=True):
        assert [c.identity for c in x.candidates] == [c.identity for c in y.candidates]
        assert [c.score for c in x.candidates] == pytest.approx([c.score for c in y.candidates], abs=1e-5)
        assert x.identity == y.identity
    assert sum(x.identity is None for x in a) >= 3 and sum(x.identity is not None for x in a) >= 15
    claims = [names[(i * 3) % 40] for i in range(50)]
    claims = [n if n != names[5] else names[6] for n in claims]
    va, vb = sqlite.verify(probes, claims), milvus.verify(probes, claims)
    assert [v.match for v in va] == [v.match for v in vb]
    assert [v.score for v in va] == pytest.approx([v.score for v in vb], abs=1e-5)
    ca, cb = sqlite.classify(probes), milvus.classify(probes)
    assert [(c.identity, round(c.share, 6)) for c in ca] == [(c.identity, round(c.share, 6)) for c in cb]
    with pytest.raises(UnknownIdentityError):
        milvus.verify(probes[0], names[5])
    assert milvus.integrity_check() == "ok"
    for g in galleries:
        g.close()


def test_refusals_and_reopen(tmp_path):
    path = tmp_path / "r.milvus.db"
    g = Gallery(path, model_fingerprint=FP, embedding_dim=DIM, threshold=0.5)
    with pytest.raises(GalleryError, match="empty"):
        g.classify(torch.ones(DIM))
    assert g.identify(torch.ones(DIM)).unknown
    g.enroll("a", torch.ones(DIM))
    with pytest.raises(ValueError, match="D = 8"):
        g.verify(torch.ones(DIM + 1), "a")
    g.close()
    with pytest.raises(GalleryError, match="another space"):
        Gallery(path, model_fingerprint="sha256:other", embedding_dim=DIM)
    with pytest.raises(GalleryError, match="dimension 8"):
        Gallery(path, model_fingerprint=FP, embedding_dim=DIM + 1)
    with pytest.raises(GalleryError, match="FLAT; open it with backend='exact'"):
        Gallery(path, model_fingerprint=FP, embedding_dim=DIM, backend="hnsw")
    with pytest.raises(ValueError, match="backend"):
        Gallery(path, model_fingerprint=FP, embedding_dim=DIM, backend="faiss")  # an in-memory search
    with pytest.raises(GalleryError, match="needs the model fingerprint"):
        Gallery(tmp_path / "new.milvus.db")
    g = Gallery(path, threshold=0.5)  # adopts the stored fingerprint and dimension
    assert g.model_fingerprint == FP and g.identities() == ["a"] and g.verify(torch.ones(DIM), "a").match
    other = subprocess.run(  # a milvus-lite file belongs to one process at a time
        [sys.executable, "-c", f"from marginkit.gallery import Gallery; Gallery({str(path)!r})"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert other.returncode != 0 and "one process at a time" in other.stderr, other.stderr[-800:]
    g.close()


CHILD = textwrap.dedent(
    """
    import sys, torch
    from marginkit.gallery import Gallery
    g = Gallery(sys.argv[1], model_fingerprint=sys.argv[2], embedding_dim=8, threshold=0.5)
    gen = torch.Generator().manual_seed(0)
    for i in range(100000):
        g.enroll(f"p{i}", torch.randn(3, 8, generator=gen))   # 3 templates, one enrollment
        print(f"p{i}", flush=True)                             # acknowledged: enroll returned
    """
)


def test_kill_9_during_enrollment_loses_no_acknowledged_enrollment(tmp_path):
    """Fault injection, not timing: the child is killed after it has printed 30 acknowledgements."""
    path = tmp_path / "k.milvus.db"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), FP],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acknowledged = acks_then_kill(child, 30)
    assert len(acknowledged) == 30, child.stderr.read() if child.stderr else ""
    g = Gallery(path, threshold=0.5)
    present = g.identities()
    assert set(acknowledged) <= set(present)
    # The documented guarantee: every acknowledged enrollment whole; the one in flight (if any)
    # listed with all of its templates or none, and no template without its identity.
    for name in acknowledged:
        assert len(g.templates(name)) == 3
    assert all(len(g.templates(n)) in (0, 3) for n in set(present) - set(acknowledged))
    assert g.integrity_check() == "ok"
    g.close()


@pytest.mark.parametrize("backend", ["hnsw", "ivf"])
def test_approximate_indexes_recall_against_flat(tmp_path, backend):
    gen = torch.Generator().manual_seed(1)
    templates = unit(torch.randn(3000, DIM, generator=gen))
    probes = unit(templates[:300] + 0.2 * torch.randn(300, DIM, generator=gen))
    names = [f"t{i}" for i in range(3000)]
    answers = {}
    for b in ("exact", backend):
        g = Gallery(
            tmp_path / f"{b}.milvus.db", model_fingerprint=FP, embedding_dim=DIM, threshold=0.5, backend=b
        )
        g.enroll_many(names, templates)
        answers[b] = [r.candidates[0].identity for r in g.identify(probes, k=1)]
        g.close()
    brute = [names[i] for i in (unit(probes) @ templates.T).argmax(1).tolist()]
    assert answers["exact"] == brute
    recall = sum(x == y for x, y in zip(answers[backend], brute, strict=True)) / len(brute)
    print(f"{backend} recall@1 against exact: {recall:.3f}")
    assert recall >= 0.9


def test_the_server_answers_from_a_milvus_gallery(onnx_bundle, tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from marginkit.cli import main
    from marginkit.serve import create_app

    gallery = Gallery(tmp_path / "s.milvus.db", onnx_bundle, far=1e-2)
    emb = unit(torch.randn(4, onnx_bundle.embedding_dim, generator=torch.Generator().manual_seed(2)))
    with TestClient(create_app(onnx_bundle, gallery)) as client:
        r = client.post("/enroll", json={"identities": ["a", "b", "c", "d"], "embeddings": emb.tolist()})
        assert r.status_code == 200, r.text
        r = client.post("/identify", json={"embeddings": emb.tolist(), "k": 2})
        assert [x["identity"] for x in r.json()["results"]] == ["a", "b", "c", "d"]
        assert client.get("/health").json()["gallery"] == {"identities": 4, "templates": 4}
    gallery.close()
    args = ["serve", str(onnx_bundle.path), "--gallery", str(tmp_path / "s.milvus.db"), "--workers", "2"]
    assert main(args) == 2  # one process per milvus-lite file
