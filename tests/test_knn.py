"""KNNClassifier and its index backends against scikit-learn, float64 brute force and FAISS."""

import copy
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.neighbors import KNeighborsClassifier

from marginkit.knn import KNNClassifier, model_fingerprint
from marginkit.knn._search import _estimate, exact_search, plan_chunks, prepare

SK_METRIC = {"l2": "euclidean", "cosine": "cosine"}


def _data(gen, n=300, q=120, d=12, c=5, dtype=torch.float64):
    ref = torch.randn(n, d, generator=gen, dtype=dtype)
    lab = torch.randint(0, c, (n,), generator=gen)
    lab[:c] = torch.arange(c)  # every class present, so sklearn's columns are 0..C-1
    return ref, lab, torch.randn(q, d, generator=gen, dtype=dtype)


def _brute(queries, refs, k, metric):
    """float64 numpy brute force: values, indices, ties to the lower index (lexsort)."""
    q, r = queries.double().numpy(), refs.double().numpy()
    if metric == "cosine":
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
        r = r / np.linalg.norm(r, axis=1, keepdims=True)
        key = q @ r.T
    else:
        key = -np.sqrt(((q[:, None, :] - r[None, :, :]) ** 2).sum(-1))
    cols = np.arange(r.shape[0])
    idx = np.stack([np.lexsort((cols, -row))[:k] for row in key])
    vals = np.take_along_axis(key, idx, 1)
    return (vals if metric == "cosine" else -vals), idx


# ---------------------------------------------------------------- scikit-learn equality
@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("weights", ["uniform", "distance"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_matches_sklearn_float64(gen, metric, weights, k):
    ref, lab, q = _data(gen)
    clf = KNNClassifier(k, metric, weights).fit(ref, lab)
    sk = KNeighborsClassifier(k, weights=weights, metric=SK_METRIC[metric], algorithm="brute")
    sk.fit(ref.numpy(), lab.numpy())
    np.testing.assert_allclose(clf.predict_proba(q).numpy(), sk.predict_proba(q.numpy()), atol=1e-12)
    np.testing.assert_array_equal(clf.predict(q).numpy(), sk.predict(q.numpy()))
    dist, idx = sk.kneighbors(q.numpy(), k)
    values, indices = clf.kneighbors(q)
    np.testing.assert_array_equal(indices.numpy(), idx)
    expected = 1 - dist if metric == "cosine" else dist
    np.testing.assert_allclose(values.numpy(), expected, atol=1e-12)
    assert clf.score(q, torch.from_numpy(sk.predict(q.numpy()))) == 1.0


@pytest.mark.parametrize("backend", ["faiss", "hnsw"])
@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("weights", ["uniform", "distance"])
def test_faiss_backends_match_sklearn_float32(gen, backend, metric, weights):
    ref, lab, q = _data(gen, dtype=torch.float32)
    clf = KNNClassifier(5, metric, weights, backend, hnsw_ef_search=300).fit(ref, lab)
    sk = KNeighborsClassifier(5, weights=weights, metric=SK_METRIC[metric], algorithm="brute")
    sk.fit(ref.double().numpy(), lab.numpy())
    np.testing.assert_allclose(clf.predict_proba(q).numpy(), sk.predict_proba(q.double().numpy()), atol=2e-5)
    np.testing.assert_array_equal(clf.predict(q).numpy(), sk.predict(q.double().numpy()))


@settings(max_examples=25)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(3, 40), k=st.integers(1, 6), c=st.integers(1, 4))
def test_vote_ties_match_sklearn(seed, n, k, c):
    # Small k and few classes make vote ties frequent; both break them to the smallest class id.
    g = torch.Generator().manual_seed(seed)
    k, c = min(k, n), min(c, n)
    ref = torch.randn(n, 3, generator=g, dtype=torch.float64)
    lab = torch.randint(0, c, (n,), generator=g)
    lab[torch.randperm(n, generator=g)[:c]] = torch.arange(c)
    q = torch.randn(25, 3, generator=g, dtype=torch.float64)
    for weights in ("uniform", "distance"):
        clf = KNNClassifier(k, "l2", weights).fit(ref, lab)
        sk = KNeighborsClassifier(k, weights=weights, algorithm="brute").fit(ref.numpy(), lab.numpy())
        np.testing.assert_array_equal(clf.predict(q).numpy(), sk.predict(q.numpy()))
        np.testing.assert_allclose(clf.predict_proba(q).numpy(), sk.predict_proba(q.numpy()), atol=1e-12)


def test_zero_distance_neighbour_takes_the_vote_like_sklearn():
    ref = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.2], [2.0, 2.0]], dtype=torch.float64)
    lab = torch.tensor([2, 0, 0, 1])
    q = ref[:1].clone()
    clf = KNNClassifier(3, "l2", "distance").fit(ref, lab)
    sk = KNeighborsClassifier(3, weights="distance", algorithm="brute").fit(ref.numpy(), lab.numpy())
    np.testing.assert_array_equal(clf.predict_proba(q).numpy(), sk.predict_proba(q.numpy()))
    assert clf.predict(q).item() == 2


# ---------------------------------------------------------------- exact search
@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("limit_mb", [0.05, 512])
def test_exact_search_matches_float64_brute_force(gen, metric, limit_mb):
    ref, _, q = _data(gen, n=700, q=90, d=6)
    plan = plan_chunks(90, 700, 6, 9, 8, int(limit_mb * 2**20))
    if limit_mb < 1:
        assert plan.reference_cols < 700  # the merge across reference chunks is exercised
    values, idx = exact_search(
        q, prepare(ref, metric, "r"), 9, metric=metric, memory_limit_bytes=int(limit_mb * 2**20)
    )
    bv, bi = _brute(q, ref, 9, metric)
    np.testing.assert_array_equal(idx.numpy(), bi)
    np.testing.assert_allclose(values.numpy(), bv, atol=1e-10)


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_concentrated_embeddings_are_certified_by_float64_keys(monkeypatch, metric):
    # A barely trained model's embeddings: one direction plus 1e-3 noise. The float32 keys'
    # rounding (~1e-5 of |x|^2) exceeds the gaps between neighbours, so the float32 pass cannot
    # certify any row; the float64 pass must, with the same number of candidates (before it,
    # rows widened to thousands of candidates: minutes at 25,000 rows).
    from marginkit.knn import _search

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 24, generator=g) * 4 + 1e-3 * torch.randn(3000, 24, generator=g)
    calls = []
    inner = _search.topk_keys

    def spy(*args, **kwargs):
        calls.append((args[2], kwargs.get("key_dtype")))
        return inner(*args, **kwargs)

    monkeypatch.setattr(_search, "topk_keys", spy)
    refs = prepare(x, metric, "r")
    values, idx = exact_search(x, refs, 5, metric=metric, memory_limit_bytes=64 << 20, self_offset=0)
    widths = {w for w, _ in calls}
    assert calls[0][1] is None and calls[-1][1] == torch.float64, calls
    assert widths == {5 + _search.candidate_margin(5)}, calls  # never widened
    # float64 brute force on the prepared float32 rows, leave-one-out, ties to the lower index
    r = refs.double().numpy()
    sq = ((r[:, None, :] - r[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(sq, np.inf)
    cols = np.arange(3000)
    expected = np.stack([np.lexsort((cols, row))[:5] for row in sq])
    np.testing.assert_array_equal(idx.numpy(), expected)
    best = np.take_along_axis(sq, expected, 1)
    want = 1 - best / 2 if metric == "cosine" else np.sqrt(best)
    np.testing.assert_allclose(values.numpy(), want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("backend", ["exact", "faiss"])
@pytest.mark.parametrize("limit_mb", [0.02, 512])
def test_ties_go_to_the_lower_reference_index(backend, limit_mb):
    # Integer coordinates: equal distances are exactly equal in float32.
    base = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 3.0]])
    ref = base.repeat(60, 1)  # reference i is base[i % 4]; 60 copies of each spread over chunks
    perm = torch.randperm(240, generator=torch.Generator().manual_seed(1))
    ref = ref[perm]
    lab = torch.arange(240) % 3
    clf = KNNClassifier(5, "l2", backend=backend, memory_limit_mb=limit_mb).fit(ref, lab)
    q = torch.tensor([[1.0, 0.0], [0.0, 3.0], [0.5, 0.5]])
    values, idx = clf.kneighbors(q, k=70)
    bv, bi = _brute(q, ref, 70, "l2")
    np.testing.assert_array_equal(idx.numpy(), bi)
    np.testing.assert_allclose(values.numpy(), bv, atol=1e-6)
    # The k-th place is contested by 60 equal copies: the lowest indices must win.
    first = (ref == q[0]).all(dim=1).nonzero().squeeze(1)
    assert idx[0, :60].tolist() == first.tolist()


def test_vote_tie_goes_to_smallest_class():
    ref = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 5.0]])
    clf = KNNClassifier(2, "l2").fit(ref, torch.tensor([3, 1, 0]))
    assert clf.predict(torch.tensor([[0.0, 0.0]])).item() == 1
    clf = KNNClassifier(2, "l2").fit(ref, torch.tensor([1, 3, 0]))
    assert clf.predict(torch.tensor([[0.0, 0.0]])).item() == 1


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_faiss_flat_equals_exact(gen, metric):
    ref, lab, q = _data(gen, n=3000, q=400, d=32, c=20, dtype=torch.float32)
    exact = KNNClassifier(10, metric).fit(ref, lab)
    flat = KNNClassifier(10, metric, backend="faiss").fit(ref, lab)
    ve, ie = exact.kneighbors(q)
    vf, i_f = flat.kneighbors(q)
    assert (ie == i_f).float().mean() > 0.999  # float32 rounding may swap near-ties
    torch.testing.assert_close(vf, ve, atol=1e-5, rtol=1e-5)
    assert torch.equal(exact.predict(q), flat.predict(q))


def _clustered(gen, n, d=32, centres=50, noise=0.3):
    c = torch.randn(centres, d, generator=gen)
    a = torch.randint(0, centres, (n,), generator=gen)
    return c[a] + noise * torch.randn(n, d, generator=gen), a


def test_hnsw_recall_helper(gen):
    ref, lab = _clustered(gen, 4000)
    q, _ = _clustered(gen, 300)
    clf = KNNClassifier(10, "l2", backend="hnsw", hnsw_m=8, hnsw_ef_construction=40).fit(ref, lab)
    recalls = {}
    for ef in (1, 10, 400):
        clf.hnsw_ef_search = ef
        recalls[ef] = clf.recall_at_k(q)
    assert 0 <= recalls[1] <= recalls[400] <= 1
    assert recalls[400] > 0.95
    # The helper equals the set overlap computed here from the two backends' neighbours.
    clf.hnsw_ef_search = 10
    _, approx = clf.kneighbors(q)
    _, exact = KNNClassifier(10, "l2").fit(ref, lab).kneighbors(q)
    overlap = np.mean(
        [len(set(a) & set(e)) / 10 for a, e in zip(approx.tolist(), exact.tolist(), strict=True)]
    )
    assert clf.recall_at_k(q) == pytest.approx(overlap)
    assert KNNClassifier(10, "l2").fit(ref, lab).recall_at_k(q) == 1.0


# ---------------------------------------------------------------- exact distances, duplicates, ties
def _lexsort_brute(queries, refs, k):
    """Exact squared distances (float64 of the stored vectors), ties to the lower index."""
    sq = ((queries.double()[:, None, :] - refs.double()[None, :, :]) ** 2).sum(-1).numpy()
    cols = np.arange(refs.shape[0])
    idx = np.stack([np.lexsort((cols, row))[:k] for row in sq])
    return np.take_along_axis(sq, idx, 1), idx


@pytest.mark.parametrize("backend", ["exact", "faiss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("limit_mb", [0.05, 512])
def test_integer_grid_duplicates_and_ties(gen, backend, dtype, limit_mb):
    # Small integers: every distance is exact, so ties are true ties (600 neighbour slots).
    if backend == "faiss" and dtype == torch.float64:
        pytest.skip("FAISS works in float32")
    ref = torch.randint(-3, 4, (200, 5), generator=gen).to(dtype)
    q = torch.randint(-3, 4, (120, 5), generator=gen).to(dtype)
    q[:20] = ref[:20]  # exact duplicates of references
    lab = torch.randint(0, 4, (200,), generator=gen)
    clf = KNNClassifier(5, "l2", "distance", backend, memory_limit_mb=limit_mb).fit(ref, lab)
    values, idx = clf.kneighbors(q)
    sq, brute = _lexsort_brute(q, ref, 5)
    np.testing.assert_array_equal(idx.numpy(), brute)  # the lowest-index rule, slot by slot
    np.testing.assert_allclose(values.double().numpy(), np.sqrt(sq), rtol=torch.finfo(dtype).eps, atol=0)
    assert (values[:20, 0] == 0).all()
    # An exact match takes all the weight (shared among the references at distance 0).
    proba = clf.predict_proba(q[:20])
    zero = (ref[None, :, :] == q[:20, None, :]).all(-1)
    expected = torch.zeros(20, 4, dtype=proba.dtype)
    for row in range(20):
        at_zero = idx[row][values[row] == 0]
        expected[row] = torch.bincount(lab[at_zero], minlength=4).to(proba.dtype) / len(at_zero)
        assert zero[row, at_zero].all()
    assert torch.equal(proba, expected)


@pytest.mark.parametrize("backend", ["exact", "faiss", "hnsw"])
@pytest.mark.parametrize("scale", [12.0, 1e3])
def test_float32_self_distance_is_zero_at_large_norms(gen, backend, scale):
    # Key-based distances cancel: at |x| ~ 12 a reference's distance to itself was 1e-2.
    ref = scale * torch.randn(300, 16, generator=gen)
    q = ref + 0.05 * scale * torch.randn(300, 16, generator=gen)
    clf = KNNClassifier(3, "l2", "distance", backend, hnsw_ef_search=300).fit(ref, torch.arange(300) % 7)
    values, idx = clf.kneighbors(ref)
    assert (values[:, 0] == 0).all() and torch.equal(idx[:, 0], torch.arange(300))
    sq, brute = _lexsort_brute(q, ref, 3)
    values, idx = clf.kneighbors(q)
    np.testing.assert_array_equal(idx.numpy(), brute)
    np.testing.assert_allclose(values.double().numpy(), np.sqrt(sq), rtol=2e-6)
    cos = KNNClassifier(3, "cosine", "distance", backend, hnsw_ef_search=300).fit(ref, torch.arange(300) % 7)
    sims, idx = cos.kneighbors(ref)
    assert (sims[:, 0] == 1).all() and torch.equal(idx[:, 0], torch.arange(300))


def _near_ties(gen, n_near=40, dim=8):
    """A query at |x| = 100·sqrt(D) with 40 references at distances 1 + j·1e-3 (shuffled), 500 far ones.

    The keys' rounding (~0.1 in squared distance) is far above the gaps (~2e-3): the candidates
    by key are wrong, and only the recomputed, certified search gets the order right.
    """
    centre = torch.full((1, dim), 100.0, dtype=torch.float64)
    u = torch.nn.functional.normalize(torch.randn(n_near, dim, generator=gen, dtype=torch.float64), dim=1)
    radius = 1 + 1e-3 * torch.randperm(n_near, generator=gen, dtype=torch.float64)
    far = centre + 3 + torch.rand(500, dim, generator=gen, dtype=torch.float64)
    ref = torch.cat([far[:250], centre + u * radius[:, None], far[250:]]).float()
    return ref, centre.float()


@pytest.mark.parametrize("backend", ["exact", "faiss"])
@pytest.mark.parametrize("exhaustive_fallback", [False, True])
def test_near_ties_beyond_the_keys_precision_are_resolved(gen, monkeypatch, backend, exhaustive_fallback):
    from marginkit.knn import _search

    if exhaustive_fallback:  # as if the budget could not hold more candidates
        monkeypatch.setattr(_search, "_fits", lambda *a, **kw: False)
    ref, q = _near_ties(gen)
    clf = KNNClassifier(5, "l2", backend=backend).fit(ref, torch.arange(ref.shape[0]) % 3)
    values, idx = clf.kneighbors(q, k=12)
    sq, brute = _lexsort_brute(q, ref, 12)
    np.testing.assert_array_equal(idx.numpy(), brute)
    np.testing.assert_allclose(values.double().numpy(), np.sqrt(sq), rtol=1e-5)


def test_exhaustive_search_matches_brute_force_with_exclusion(gen):
    from marginkit.knn._search import exhaustive_search

    ref = torch.randint(-2, 3, (90, 3), generator=gen).float()
    for limit in (2**10, 2**20):  # one reference column at a time, and whole rows
        values, idx = exhaustive_search(
            ref, ref, 7, metric="l2", memory_limit_bytes=limit, exclude=torch.arange(90)
        )
        sq = ((ref[:, None].double() - ref[None].double()) ** 2).sum(-1)
        sq.fill_diagonal_(math.inf)
        cols = np.arange(90)
        brute = np.stack([np.lexsort((cols, row))[:7] for row in sq.numpy()])
        np.testing.assert_array_equal(idx.numpy(), brute)
        expected = np.sqrt(np.take_along_axis(sq.numpy(), brute, 1)).astype(np.float32)
        np.testing.assert_array_equal(values.numpy(), expected)


def test_overflowing_squared_norms_are_an_error():
    ref = torch.tensor([[3e19, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="squared norm overflows float32"):
        KNNClassifier(1, "l2").fit(ref, torch.tensor([0, 1]))
    clf = KNNClassifier(1, "l2").fit(ref[1:], torch.tensor([1]))
    with pytest.raises(ValueError, match="queries has rows whose squared norm overflows"):
        clf.kneighbors(ref[:1])


# ---------------------------------------------------------------- growing, saving, fingerprints
def _seeded(module, gen):
    """Overwrite a module's parameters from the seeded generator (no global RNG)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return module


@pytest.mark.parametrize("backend", ["exact", "faiss", "hnsw", "ivf"])
def test_add_equals_fit_on_everything(gen, backend):
    ref, lab, q = _data(gen, n=400, dtype=torch.float32)
    lab[300:] = 7  # a class that only arrives with add()
    full = KNNClassifier(5, backend=backend, hnsw_ef_search=400).fit(ref, lab)
    grown = KNNClassifier(5, backend=backend, hnsw_ef_search=400).fit(ref[:300], lab[:300])
    assert grown.num_classes == 5
    grown.add(ref[300:], lab[300:])
    # labels are identifiers (issue 28): the classes are the distinct labels, not 0 .. max(label)
    assert grown.classes_.tolist() == [0, 1, 2, 3, 4, 7] and grown.num_references == 400
    assert grown.num_classes == 6 and torch.equal(grown.predict_proba(q), full.predict_proba(q))
    if backend != "hnsw":  # the HNSW graph depends on insertion batches; compare outcomes only
        assert torch.equal(full.kneighbors(q)[1], grown.kneighbors(q)[1])
    assert torch.equal(full.predict(q), grown.predict(q))


@pytest.mark.parametrize("backend", ["exact", "faiss", "hnsw", "ivf"])
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_save_load_round_trip(gen, tmp_path, backend, metric):
    ref, lab, q = _data(gen, n=500, dtype=torch.float32)
    model = _seeded(torch.nn.Linear(12, 12), gen)
    clf = KNNClassifier(3, metric, "distance", backend, num_classes=9).fit(ref, lab, model_fingerprint=model)
    path = tmp_path / "index.npz"
    clf.save(path)
    with np.load(path, allow_pickle=False) as z:  # no pickle anywhere in the file
        meta = json.loads(str(z["metadata"]))
    assert meta["dimension"] == 12 and meta["metric"] == metric
    assert meta["normalization"] == ("l2" if metric == "cosine" else "none")
    assert meta["model_fingerprint"] == model_fingerprint(model)
    back = KNNClassifier.load(path, expected_fingerprint=model)
    assert (
        back.num_classes == 9 and back.backend == backend and back.model_fingerprint == clf.model_fingerprint
    )
    v1, i1 = clf.kneighbors(q)
    v2, i2 = back.kneighbors(q)
    assert torch.equal(i1, i2) and torch.equal(v1, v2)
    assert torch.equal(clf.predict_proba(q), back.predict_proba(q))
    back.add(ref[:10], lab[:10])  # a loaded index keeps growing
    assert back.num_references == 510


def test_load_refuses_another_model(gen, tmp_path):
    ref, lab, _ = _data(gen, dtype=torch.float32)
    model = _seeded(torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.BatchNorm1d(12)), gen)
    path = tmp_path / "index.npz"
    KNNClassifier().fit(ref, lab, model_fingerprint=model_fingerprint(model)).save(path)
    KNNClassifier.load(path, expected_fingerprint=copy.deepcopy(model))  # same weights: fine
    retrained = copy.deepcopy(model)
    with torch.no_grad():
        retrained[0].weight[0, 0] += 1e-3
    with pytest.raises(ValueError, match="model fingerprint mismatch"):
        KNNClassifier.load(path, expected_fingerprint=retrained)
    with pytest.raises(ValueError, match="model fingerprint mismatch"):
        KNNClassifier.load(path, expected_fingerprint="sha256:" + "0" * 64)
    unfingerprinted = tmp_path / "bare.npz"
    KNNClassifier().fit(ref, lab).save(unfingerprinted)
    with pytest.raises(ValueError, match="model fingerprint mismatch"):
        KNNClassifier.load(unfingerprinted, expected_fingerprint=model)
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a saved KNNClassifier"):
        KNNClassifier.load(tmp_path / "other.npz")


def _saved(gen, tmp_path, metric="cosine", backend="exact", **kw):
    ref, lab, _ = _data(gen, n=60, dtype=torch.float32)
    path = tmp_path / f"{backend}-{metric}.npz"
    KNNClassifier(3, metric, backend=backend, **kw).fit(ref, lab).save(path)
    with np.load(path, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    return path, json.loads(str(arrays.pop("metadata"))), arrays


def _rewrite(path, meta, arrays):
    text = meta if isinstance(meta, str) else json.dumps(meta)
    np.savez(path, **arrays, metadata=np.array(text))
    return path


def _bad_index_cases(meta, arrays):
    """(name, metadata, arrays) of damaged variants of a valid cosine 'exact' index."""
    labels, x = arrays["labels"], arrays["embeddings"]
    return [
        ("not json", "{'k': 3", arrays, "not valid JSON"),
        ("a list", [1, 2], arrays, "must be a JSON object, got list"),
        ("missing key", {k: v for k, v in meta.items() if k != "k"}, arrays, "metadata lacks 'k'"),
        ("k too big", {**meta, "k": 61}, arrays, r"'k' must be an integer in \[1, 60\]"),
        ("bad metric", {**meta, "metric": "dot"}, arrays, "'metric' must be"),
        ("bad limit", {**meta, "memory_limit_mb": -1}, arrays, "invalid setting: memory_limit_mb"),
        ("bool dim", {**meta, "dimension": True}, arrays, "'dimension' must be an integer"),
        ("int dtype", meta, {**arrays, "embeddings": x.astype(np.int32)}, "'embeddings' must be float32"),
        ("few classes", {**meta, "num_classes": 2}, arrays, r"must lie in \[0, num_classes=2\)"),
        ("negative", meta, {**arrays, "labels": labels - 1}, r"got values in \[-1, "),
        ("fractional", meta, {**arrays, "labels": labels + 0.5}, "'labels' must be 60 integers"),
        ("nan", meta, {**arrays, "embeddings": np.where(x > 0.5, np.nan, x)}, "NaN, infinite"),
        ("not unit", meta, {**arrays, "embeddings": 2 * x}, "must be unit-norm"),
        ("rows", {**meta, "num_references": 59}, arrays, r"'labels' must be 59 integers"),
        ("extra", meta, {**arrays, "faiss_index": np.zeros(3, np.uint8)}, "holds arrays"),
        ("objects", meta, {**arrays, "labels": labels.astype(object)}, "dtype object is not allowed"),
        ("version", {**meta, "version": 7}, arrays, "version 7"),
        ("fingerprint", {**meta, "model_fingerprint": 3}, arrays, "'model_fingerprint' must be a string"),
    ]


def test_load_refuses_damaged_files_with_one_error(gen, tmp_path):
    from marginkit.knn import IndexFileError

    path, meta, arrays = _saved(gen, tmp_path, num_classes=None)
    meta["fixed_num_classes"] = True
    for name, bad_meta, bad_arrays, message in _bad_index_cases(meta, arrays):
        bad = _rewrite(tmp_path / f"{name}.npz", bad_meta, bad_arrays)
        with pytest.raises(IndexFileError, match=message) as info:
            KNNClassifier.load(bad)
        assert str(bad) in str(info.value), name
    data = path.read_bytes()
    (tmp_path / "truncated.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(IndexFileError, match="truncated.npz: not an .npz archive"):
        KNNClassifier.load(tmp_path / "truncated.npz")
    meta["fixed_num_classes"] = False  # then num_classes is max(label) + 1 exactly
    _rewrite(tmp_path / "classes.npz", {**meta, "num_classes": 9}, arrays)
    with pytest.raises(IndexFileError, match="'num_classes' is 9 but the largest label is 4"):
        KNNClassifier.load(tmp_path / "classes.npz")
    with pytest.raises(FileNotFoundError, match="no such K-NN index"):
        KNNClassifier.load(tmp_path / "nowhere.npz")
    assert issubclass(IndexFileError, ValueError)  # the CLI reports it as a user error


def test_load_checks_headers_before_reading(gen, tmp_path, monkeypatch):
    import zipfile

    from marginkit.knn import IndexFileError

    path, meta, arrays = _saved(gen, tmp_path)
    claims = tmp_path / "claims.npz"
    np.savez(claims, labels=arrays["labels"], metadata=np.array(json.dumps(meta)))
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 128), }".ljust(118) + "\n"
    with zipfile.ZipFile(claims, "a") as z:  # 512 GB claimed in a few bytes
        z.writestr(
            "embeddings.npy", b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
        )
    with pytest.raises(IndexFileError, match=r"'embeddings': array of shape \[1000000000, 128\].*exceeds"):
        KNNClassifier.load(claims)
    monkeypatch.setenv("MARGINKIT_MAX_INPUT_MB", "0.001")
    with pytest.raises(IndexFileError, match="above the input memory limit"):
        KNNClassifier.load(path)


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_ivf_is_exact_until_trained_then_recalls_and_retrains_as_it_grows(gen, metric):
    ref, lab = _clustered(gen, 6000)
    q, _ = _clustered(gen, 300)
    clf = KNNClassifier(10, metric, backend="ivf", ivf_nprobe=4).fit(ref[:1000], lab[:1000])
    assert clf._index.nlist is None  # 1000 references < 39 x 31 cells: still exact
    assert clf.recall_at_k(q) == 1.0
    clf.add(ref[1000:1500], lab[1000:1500])
    assert clf._index.nlist == 38  # trained at 1500 references: floor(sqrt(1500)) cells
    clf.add(ref[1500:5999], lab[1500:5999])
    assert clf._index.nlist == 38  # 5999 < 4 x 1500: the same cells
    clf.add(ref[5999:], lab[5999:])
    assert clf._index.nlist == 77 and clf._index.index.ntotal == 6000  # grown 4x: cells chosen again
    recalls = {}
    for nprobe in (1, 8, 77):
        clf.ivf_nprobe = nprobe
        recalls[nprobe] = clf.recall_at_k(q)
    assert recalls[1] <= recalls[8] <= recalls[77] and recalls[1] < 1
    assert recalls[77] > 0.97  # every cell scanned: only the 8-bit codes' rounding misses
    # Neighbours come back re-scored exactly, ordered by value: the values are the exact ones.
    exact = KNNClassifier(10, metric).fit(ref, lab)
    values, idx = clf.kneighbors(q)
    refs = exact.reference_embeddings()
    qq = torch.nn.functional.normalize(q, dim=1) if metric == "cosine" else q
    diff = qq[:, None, :] - refs[idx]
    direct = (qq[:, None, :] * refs[idx]).sum(2) if metric == "cosine" else diff.norm(dim=2)
    torch.testing.assert_close(values, direct, atol=1e-5, rtol=1e-5)
    assert ((values[:, 1:] - values[:, :-1]) * (1 if metric == "l2" else -1) >= 0).all()
    assert (clf.predict(q) == exact.predict(q)).float().mean() > 0.95


def test_ivf_rows_whose_cells_are_too_small_are_answered_exactly(gen):
    ref, lab = _clustered(gen, 2000, centres=200, noise=0.05)
    q, _ = _clustered(gen, 100, centres=200, noise=0.05)
    clf = KNNClassifier(40, "l2", backend="ivf", ivf_nlist=50, ivf_nprobe=1).fit(ref, lab)
    assert clf._index.nlist == 50
    _, raw = clf._index.index.search(q.numpy(), 40)
    assert (raw < 0).any()  # some probed cells hold fewer than 40 references
    short = torch.from_numpy((raw < 0).any(axis=1))
    _, idx = clf.kneighbors(q)
    _, exact = KNNClassifier(40, "l2").fit(ref, lab).kneighbors(q)
    assert torch.equal(idx[short], exact[short])
    assert (idx >= 0).all() and all(len(set(row)) == 40 for row in idx.tolist())


def test_ivf_settings_are_checked(gen, tmp_path):
    from marginkit.knn import IndexFileError

    with pytest.raises(ValueError, match="ivf_nlist"):
        KNNClassifier(backend="ivf", ivf_nlist=0)
    with pytest.raises(ValueError, match="ivf_nprobe"):
        KNNClassifier(backend="ivf").ivf_nprobe = 0
    path, meta, arrays = _saved(gen, tmp_path, backend="ivf", ivf_nlist=7, ivf_nprobe=3)
    back = KNNClassifier.load(path)
    assert (back.ivf_nlist, back.ivf_nprobe) == (7, 3) and meta["ivf"] == {"nlist": 7, "nprobe": 3}
    for i, bad in enumerate([{"nlist": 0, "nprobe": 3}, {"nlist": 7, "nprobe": "3"}, [7], {"cells": 7}]):
        with pytest.raises(IndexFileError, match="ivf|nlist|nprobe"):
            KNNClassifier.load(_rewrite(tmp_path / f"ivf{i}.npz", {**meta, "ivf": bad}, arrays))


def test_load_refuses_a_damaged_hnsw_graph(gen, tmp_path):
    from marginkit.knn import IndexFileError

    path, meta, arrays = _saved(gen, tmp_path, backend="hnsw")
    KNNClassifier.load(path)
    neighbors, offsets, levels = arrays["hnsw_neighbors"], arrays["hnsw_offsets"], arrays["hnsw_levels"]
    top = int(np.flatnonzero(levels == levels.max())[0])
    low = int(np.flatnonzero(levels == levels.min())[0])
    cases = [
        (
            {**arrays, "hnsw_neighbors": np.where(neighbors == neighbors.max(), 60, neighbors)},
            meta,
            "node ids",
        ),
        ({**arrays, "hnsw_neighbors": neighbors[:-1]}, meta, "'hnsw_neighbors' must be int32"),
        ({**arrays, "hnsw_offsets": offsets + np.uint64(1)}, meta, "do not match the nodes' levels"),
        ({**arrays, "hnsw_levels": levels * 0}, meta, r"must lie in \[1, "),
        ({**arrays, "hnsw_levels": levels.astype(np.int64)}, meta, "'hnsw_levels' must be int32"),
        (arrays, {**meta, "hnsw": {**meta["hnsw"], "entry_point": low}}, "entry point"),
        (arrays, {**meta, "hnsw": {**meta["hnsw"], "entry_point": 60}}, "'entry_point' must be"),
        ({k: v for k, v in arrays.items() if k != "hnsw_offsets"}, meta, "holds arrays"),
        (arrays, {**meta, "version": 1}, "version-1 HNSW index"),
    ]
    assert top != low
    for i, (bad_arrays, bad_meta, message) in enumerate(cases):
        bad = _rewrite(tmp_path / f"hnsw{i}.npz", bad_meta, bad_arrays)
        with pytest.raises(IndexFileError, match=message):
            KNNClassifier.load(bad)


@pytest.mark.parametrize("version", [1, 2])
def test_version_1_exact_files_still_load(gen, tmp_path, version):
    path, meta, arrays = _saved(gen, tmp_path, metric="l2")
    # versions 1 and 2 stored the class ids themselves, and no 'classes' (labels 0..4: codes = ids)
    legacy = {name: a for name, a in arrays.items() if name != "classes"}
    old = _rewrite(tmp_path / f"v{version}.npz", {**meta, "version": version}, legacy)
    q = _data(gen, n=60, dtype=torch.float32)[2]
    assert torch.equal(KNNClassifier.load(old).predict(q), KNNClassifier.load(path).predict(q))


def test_model_fingerprint_sees_weights_buffers_architecture(gen):
    model = _seeded(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)), gen)
    fp = model_fingerprint(model)
    assert fp == model_fingerprint(copy.deepcopy(model))
    buffers = copy.deepcopy(model)
    buffers[1].running_mean += 1
    wider = copy.deepcopy(model)
    wider[1].eps = 1e-3  # no tensor changes, the architecture repr does
    half = copy.deepcopy(model).half()
    assert len({fp, model_fingerprint(buffers), model_fingerprint(wider), model_fingerprint(half)}) == 4
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        model_fingerprint("model")


# ---------------------------------------------------------------- precision and devices
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_upcast(gen, dtype):
    ref, lab, q = _data(gen, dtype=torch.float32)
    ref, q = ref.to(dtype), q.to(dtype)
    half = KNNClassifier(5, "cosine", "distance").fit(ref, lab)
    single = KNNClassifier(5, "cosine", "distance").fit(ref.float(), lab)
    values, _ = half.kneighbors(q)
    assert values.dtype == torch.float32
    assert torch.equal(half.predict_proba(q), single.predict_proba(q.float()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_exact_backend_on_cuda_matches_cpu(gen):
    ref, lab, q = _data(gen, dtype=torch.float32)
    cpu = KNNClassifier(5, "l2").fit(ref, lab)
    cuda = KNNClassifier(5, "l2").fit(ref.cuda(), lab.cuda())
    torch.testing.assert_close(cuda.predict_proba(q.cuda()).cpu(), cpu.predict_proba(q), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- memory limit
@given(
    nq=st.integers(1, 10**5),
    n=st.integers(1, 10**7),
    d=st.integers(1, 2048),
    k=st.integers(1, 1000),
    limit_mb=st.floats(0.5, 4096),
    itemsize=st.sampled_from([4, 8]),
)
def test_plan_keeps_its_estimate_under_the_limit(nq, n, d, k, limit_mb, itemsize):
    k = min(k, n)
    limit = int(limit_mb * 2**20)
    try:
        plan = plan_chunks(nq, n, d, k, itemsize, limit)
    except ValueError as err:
        assert "too small" in str(err)
        assert _estimate(1, min(k + 1, n), 1, d, k, itemsize, torch.get_num_threads()) > limit
        return
    assert plan.estimated_bytes <= limit
    assert 1 <= plan.query_rows <= nq and min(k + 1, n) <= plan.reference_cols <= n
    assert plan.query_rows * plan.reference_cols * itemsize <= limit  # the largest temporary


def _run_rss_script(script: str) -> dict:
    """Run a peak-RSS script in a fresh process; its last stdout line as JSON. glibc is told to
    mmap every allocation over 64 KiB and to trim freed memory, so RSS follows live memory."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True, timeout=300
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


_RSS_SCRIPT = textwrap.dedent(
    """
    import gc, json, sys, torch
    from marginkit.knn import KNNClassifier
    torch.set_num_threads(2)

    def kib(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(50_000, 32, generator=g)
    q = torch.randn(1_000, 32, generator=g)
    lab = torch.randint(0, 10, (50_000,), generator=g)
    out = {}
    for metric in ("cosine", "l2"):
        for limit in (8, 512):
            clf = KNNClassifier(10, metric, memory_limit_mb=limit).fit(ref, lab)
            clf.kneighbors(q)  # warm-up: thread pools and one-off buffers
            gc.collect()
            base = kib("VmRSS:")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak-RSS counter VmHWM
            result = clf.kneighbors(q)
            out[f"{metric}-{limit}"] = (kib("VmHWM:") - base) / 1024
            del result, clf
    print(json.dumps(out))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux peak-RSS reset")
def test_exact_backend_peak_memory_stays_under_limit():
    # Peak RSS growth of one search, measured in a fresh process. glibc is told to mmap every
    # allocation over 64 KiB and to trim freed memory, so RSS follows live memory (otherwise
    # freed blocks are kept in the heap and the measurement under-reports).
    growth = _run_rss_script(_RSS_SCRIPT)
    result_mb = 1_000 * 10 * (4 + 8) / 2**20  # the returned values and indices are not temporaries
    for metric in ("cosine", "l2"):
        assert growth[f"{metric}-8"] <= 8 + result_mb + 0.5, growth
        # The measurement sees the search's memory: with a large budget the peak is far above 8 MB
        # (whole-reference chunks of thousands of queries).
        assert growth[f"{metric}-512"] > 64, growth


_TIES_RSS_SCRIPT = textwrap.dedent(
    """
    import gc, json, torch
    from marginkit.metrics import knn_accuracy
    torch.set_num_threads(2)

    def kib(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    g = torch.Generator().manual_seed(0)
    # 6,000 rows that are copies of 5 points: every row's neighbours are ties, widened to all rows
    x = torch.randn(5, 32, generator=g)[torch.randint(0, 5, (6_000,), generator=g)]
    y = torch.arange(2_000).repeat_interleave(3)  # 2,000 classes: the votes' [N, C] is 96 MB
    knn_accuracy(x[:100], y[:100], k=3, memory_limit_mb=8)  # warm-up
    gc.collect()
    base, files = kib("VmRSS:"), kib("RssFile:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    acc = knn_accuracy(x, y, k=3, memory_limit_mb=8)
    # less the library code first run by this call (file pages, mapped for good): 1 MB alone,
    # more beside a loaded suite, as the page cache and fault-around decide
    growth = kib("VmHWM:") - base - (kib("RssFile:") - files)
    print(json.dumps({"growth_mb": growth / 1024, "accuracy": acc}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux peak-RSS reset")
def test_leave_one_out_accuracy_with_ties_and_many_classes_stays_under_limit():
    # Duplicate embeddings make every row uncertified until its candidates are all the rows
    # ([6000, 6000] lists, 288 MB at once before they were made row chunk by row chunk), and
    # 2,000 classes make the vote matrix 96 MB: both must stay under the 8 MB budget.
    out = _run_rss_script(_TIES_RSS_SCRIPT)
    result_mb = 6_000 * 3 * (4 + 8 + 8) / 2**20  # values, indices, their labels
    data_mb = 6_000 * 32 * 4 / 2**20  # the normalised copy of the rows that the search reads
    assert out["growth_mb"] <= 8 + result_mb + data_mb + 1.0, out
    assert 0.0 <= out["accuracy"] <= 1.0


def test_vote_winners_is_the_argmax_of_vote_proba_in_row_chunks(gen):
    from marginkit.knn.classifier import vote_proba, vote_winners

    for weights, metric in (("uniform", "cosine"), ("distance", "cosine"), ("distance", "l2")):
        values = torch.rand(300, 7, generator=gen, dtype=torch.float64)
        values[:50] = values[:50, :1]  # tied votes: the smallest code wins
        values[50:60, 0] = 1.0 if metric == "cosine" else 0.0  # a neighbour at distance 0
        labels = torch.randint(0, 40, (300, 7), generator=gen)
        proba = vote_proba(values, labels, metric=metric, weights=weights, num_classes=40)
        for limit in (1, 3 * 8 * 40 * 7, 2**20):  # one row, seven rows, all rows per chunk
            winners = vote_winners(
                values, labels, metric=metric, weights=weights, num_classes=40, memory_limit_bytes=limit
            )
            assert torch.equal(winners, proba.argmax(dim=1))


# ---------------------------------------------------------------- errors
def test_bad_input_errors(gen):
    ref, lab, q = _data(gen, n=20, dtype=torch.float32)
    with pytest.raises(ValueError, match="k must be >= 1"):
        KNNClassifier(k=0)
    with pytest.raises(ValueError, match="k=30 exceeds the number of references"):
        KNNClassifier(k=30).fit(ref, lab)
    clf = KNNClassifier(3)
    with pytest.raises(RuntimeError, match="not fitted"):
        clf.predict(q)
    with pytest.raises(RuntimeError, match="not fitted"):
        clf.add(ref, lab)
    with pytest.raises(ValueError, match="embeddings must contain at least one row"):
        clf.fit(torch.empty(0, 12), torch.empty(0, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must have shape"):
        clf.fit(ref, lab[:-1])
    with pytest.raises(ValueError, match="embeddings contains NaN"):
        clf.fit(torch.where(ref > 2, math.nan, ref), lab)
    with pytest.raises(ValueError, match="all-zero row"):
        clf.fit(torch.cat([ref, torch.zeros(1, 12)]), torch.cat([lab, lab[:1]]))
    # negative integers are identifiers like any other (issue 28); floats are refused by name
    assert clf.fit(ref, lab - 1).classes_.tolist() == sorted(set((lab - 1).tolist()))
    with pytest.raises(TypeError, match="labels must be an integer"):
        clf.fit(ref, lab.float())
    with pytest.raises(TypeError, match="model_fingerprint must be a str or an nn.Module"):
        clf.fit(ref, lab, model_fingerprint=3)
    clf.fit(ref, lab)
    with pytest.raises(ValueError, match="embeddings contains NaN"):
        clf.fit(torch.full((3, 12), math.nan), lab[:3])
    assert clf.num_references == 20 and clf.dimension == 12  # a failed refit changes nothing
    with pytest.raises(ValueError, match="x contains NaN"):
        clf.predict(torch.full((2, 12), math.nan))
    with pytest.raises(ValueError, match="x has dimension 5, but the index holds 12"):
        clf.predict(q[:, :5])
    with pytest.raises(ValueError, match="embeddings have dimension 5"):
        clf.add(ref[:, :5], lab)
    with pytest.raises(ValueError, match="k=21 exceeds the number of references"):
        clf.kneighbors(q, k=21)
    with pytest.raises(ValueError, match="y must have shape"):
        clf.score(q, lab[:3])
    with pytest.raises(ValueError, match="metric must be one of"):
        KNNClassifier(metric="dot")
    with pytest.raises(ValueError, match="backend must be one of"):
        KNNClassifier(backend="annoy")
    with pytest.raises(ValueError, match="weights must be one of"):
        KNNClassifier(weights="rank")
    with pytest.raises(ValueError, match="labels must lie in"):
        KNNClassifier(num_classes=2).fit(ref, lab)
    with pytest.raises(ValueError, match="memory_limit_mb=.* is too small"):
        KNNClassifier(3, memory_limit_mb=1e-4).fit(ref, lab).predict(q)


def test_missing_faiss_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # makes `import faiss` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'marginkit\[faiss\]'"):
        KNNClassifier(backend="faiss")
    with pytest.raises(ImportError, match=r"pip install 'marginkit\[faiss\]'"):
        KNNClassifier(backend="hnsw")
    KNNClassifier(backend="exact")  # the default needs nothing extra


@pytest.mark.parametrize("backend", ["exact", "faiss", "hnsw", "ivf"])
def test_reference_embeddings_copy_or_the_index_own_storage(gen, backend):
    ref, lab, _ = _data(gen, n=100, dtype=torch.float32)
    clf = KNNClassifier(3, backend=backend).fit(ref, lab)
    own, copied = clf.reference_embeddings(copy=False), clf.reference_embeddings()
    assert torch.equal(own, copied) and own.data_ptr() != copied.data_ptr()
    assert own.data_ptr() == clf.reference_embeddings(copy=False).data_ptr()  # no copy
    torch.testing.assert_close(own, torch.nn.functional.normalize(ref, dim=1))


def test_reference_rows_grow_geometrically_not_by_a_copy_per_add(gen):
    from marginkit.knn._backends import _Rows

    rows, x = _Rows((3,), torch.float32, "cpu"), torch.randn(1000, 3, generator=gen)
    rows.append(x[:10])
    assert rows._buf.shape[0] == 10  # a fit gets exactly its size
    moves = 0
    for i in range(10, 1000):
        before = rows._buf.data_ptr()
        rows.append(x[i : i + 1])
        moves += rows._buf.data_ptr() != before
    assert torch.equal(rows.view, x) and moves <= 25  # log_1.25(100) ≈ 21 moves, not 990 copies
    assert rows._buf.shape[0] <= 1.25 * 1000 + 1
    # One reference at a time gives the index a fit on all of them gives, for each backend.
    ref, lab, q = _data(gen, n=200, dtype=torch.float32)
    for backend in ("exact", "ivf"):
        grown = KNNClassifier(3, backend=backend).fit(ref[:3], lab[:3])
        for i in range(3, 200):
            grown.add(ref[i : i + 1], lab[i : i + 1])
        full = KNNClassifier(3, backend=backend).fit(ref, lab)
        assert torch.equal(grown.reference_embeddings(), full.reference_embeddings())
        assert torch.equal(grown.kneighbors(q)[1], full.kneighbors(q)[1])


@pytest.mark.parametrize("backend", ["exact", "faiss"])
def test_float64_queries_beyond_float32s_range_are_directions(gen, backend):
    # float32 references, float64 queries of 1e300 / 1e-300: cast first, they became inf / 0 and
    # every similarity NaN (or an "all-zero row" error); `prepare` now normalises them in float64.
    ref, lab, q = _data(gen, n=60, dtype=torch.float32)
    clf = KNNClassifier(3, backend=backend).fit(ref, lab)
    base = clf.kneighbors(q.double())
    for scale in (1e300, 1e-300):
        values, idx = clf.kneighbors(q.double() * scale)
        assert torch.equal(idx, base[1])
        torch.testing.assert_close(values, base[0], atol=1e-6, rtol=1e-6)
