"""retrieval_metrics, knn_accuracy and per_class_recall against PML, sklearn and brute force."""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from sklearn.metrics import recall_score
from sklearn.neighbors import KNeighborsClassifier

from marginkit.metrics import clustering_metrics, knn_accuracy, per_class_recall, retrieval_metrics

PML_KEYS = {
    "precision_at_1": "precision_at_1",
    "r_precision": "r_precision",
    "map_at_r": "mean_average_precision_at_r",
}


def _labelled(gen, n, d=8, classes=15, dtype=torch.float32):
    # Uneven class sizes, including singletons (lone queries when the queries are the references).
    x = torch.randn(n, d, generator=gen, dtype=dtype)
    sizes = torch.randint(1, 30, (classes,), generator=gen)
    y = torch.repeat_interleave(torch.arange(classes), sizes)[:n]
    y = torch.cat([y, torch.randint(0, classes, (n - y.numel(),), generator=gen)])
    y[-3:] = torch.arange(classes, classes + 3)  # three singleton classes
    return x, y[torch.randperm(n, generator=gen)]


def _brute(query, qlab, ref, rlab, metric, ks, self_excluded):
    """Per-query float64 loop: ranks by (score desc, index asc), self removed by index."""
    q, r = query.double().numpy(), ref.double().numpy()
    if metric == "cosine":
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
        r = r / np.linalg.norm(r, axis=1, keepdims=True)
    sums = {"precision_at_1": 0.0, "r_precision": 0.0, "map_at_r": 0.0}
    hits = dict.fromkeys(ks, 0)
    count = 0
    for i in range(len(q)):
        score = q[i] @ r.T if metric == "cosine" else -np.linalg.norm(r - q[i], axis=1)
        order = np.lexsort((np.arange(len(r)), -score))
        if self_excluded:
            order = order[order != i]
        rel = rlab.numpy()[order] == qlab[i].item()
        big_r = int(rel.sum())
        if big_r == 0:
            continue
        count += 1
        sums["precision_at_1"] += rel[0]
        sums["r_precision"] += rel[:big_r].mean()
        precision = np.cumsum(rel[:big_r]) / np.arange(1, big_r + 1)
        sums["map_at_r"] += (precision * rel[:big_r]).sum() / big_r
        for k in ks:
            hits[k] += rel[:k].any()
    out = {key: value / count for key, value in sums.items()}
    out["recall_at_k"] = {k: hits[k] / count for k in ks}
    out["num_queries"] = count
    return out


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_queries_are_references_matches_pml(gen, metric):
    x, y = _labelled(gen, 400)
    ours = retrieval_metrics(x, y, metric=metric)
    pml_in = torch.nn.functional.normalize(x, dim=1) if metric == "cosine" else x
    calc = AccuracyCalculator(include=tuple(PML_KEYS.values()), k="max_bin_count")
    theirs = calc.get_accuracy(pml_in, y)  # reference None: PML excludes each query by index
    for ours_key, pml_key in PML_KEYS.items():
        assert ours[ours_key] == pytest.approx(theirs[pml_key], abs=1e-12)
    assert ours["num_queries_without_relevant"] == int((torch.bincount(y)[y] == 1).sum()) > 0


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_separate_references_match_pml(gen, metric):
    ref, rlab = _labelled(gen, 500)
    query, qlab = _labelled(gen, 150)
    qlab = torch.where(qlab == 3, 99, qlab)  # a label no reference has: those queries are left out
    ours = retrieval_metrics(query, qlab, ref, rlab, metric=metric, memory_limit_mb=0.3)
    norm = (lambda t: torch.nn.functional.normalize(t, dim=1)) if metric == "cosine" else (lambda t: t)
    calc = AccuracyCalculator(include=tuple(PML_KEYS.values()), k="max_bin_count")
    theirs = calc.get_accuracy(norm(query), qlab, norm(ref), rlab)
    for ours_key, pml_key in PML_KEYS.items():
        assert ours[ours_key] == pytest.approx(theirs[pml_key], abs=1e-12)


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(12, 80),
    metric=st.sampled_from(["cosine", "l2"]),
    limit=st.sampled_from([0.05, 64.0]),
)
@example(seed=33, n=33, metric="cosine", limit=0.05)  # a chunk whose queries have no relevant reference
def test_matches_brute_force_with_recall(seed, n, metric, limit):
    g = torch.Generator().manual_seed(seed)
    x, y = _labelled(g, n, d=3, classes=6, dtype=torch.float64)
    ks = (1, 2, 5, 10)
    ours = retrieval_metrics(x, y, metric=metric, ks=ks, memory_limit_mb=limit)
    expected = _brute(x, y, x, y, metric, ks, self_excluded=True)
    for key in ("precision_at_1", "r_precision", "map_at_r"):
        assert ours[key] == pytest.approx(expected[key], abs=1e-12)
    assert ours["recall_at_k"] == pytest.approx(expected["recall_at_k"], abs=1e-12)
    assert ours["num_queries"] == expected["num_queries"]


def test_self_is_excluded_by_index_not_by_distance():
    # Two identical points of class 0: each one's nearest *other* reference is its twin.
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.1, 1.0], [0.7, 0.7]])
    y = torch.tensor([0, 0, 1, 1, 2])
    m = retrieval_metrics(x, y, ks=(1, 4))
    assert m["precision_at_1"] == 1.0 and m["map_at_r"] == 1.0 and m["num_queries"] == 4
    assert m["num_queries_without_relevant"] == 1


def test_hand_computed_map_at_r():
    # Query 0 (class 0, R = 2 other members): ranking by cosine gives rel = [1, 0, 1, ...]
    x = torch.tensor([[1.0, 0.0], [0.99, 0.14], [0.9, 0.44], [0.8, 0.6], [0.0, 1.0]])
    y = torch.tensor([0, 0, 1, 0, 1])
    m = retrieval_metrics(x[:1], y[:1], x[1:], y[1:], ks=(1, 2))
    assert m["precision_at_1"] == 1.0
    assert m["r_precision"] == pytest.approx(1 / 2)  # R = 2: ranks 1-2 hold one relevant
    assert m["map_at_r"] == pytest.approx((1 / 1) / 2)  # P(1)·rel(1) + P(2)·rel(2)=0, over R
    assert m["recall_at_k"] == {1: 1.0, 2: 1.0}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(gen, dtype):
    x, y = _labelled(gen, 200)
    x = x.to(dtype)
    assert retrieval_metrics(x, y) == retrieval_metrics(x.float(), y)


def test_retrieval_errors(gen):
    x, y = _labelled(gen, 30)
    with pytest.raises(ValueError, match="both or neither|given together"):
        retrieval_metrics(x, y, reference=x)
    with pytest.raises(ValueError, match="reference has dimension 4 but query has dimension 8"):
        retrieval_metrics(x, y, x[:, :4], y)
    with pytest.raises(ValueError, match="query_labels must have shape"):
        retrieval_metrics(x, y[:-1])
    with pytest.raises(ValueError, match="reference_labels must have shape"):
        retrieval_metrics(x, y, x, y[:-2])
    with pytest.raises(ValueError, match="query contains NaN"):
        retrieval_metrics(torch.full_like(x, math.nan), y)
    with pytest.raises(ValueError, match="reference must contain at least one row"):
        retrieval_metrics(x, y, x[:0], y[:0])
    with pytest.raises(ValueError, match="ks must be <= the 29 references"):
        retrieval_metrics(x, y, ks=(1, 30))
    with pytest.raises(ValueError, match="ks must be >= 1"):
        retrieval_metrics(x, y, ks=(0,))
    with pytest.raises(ValueError, match="no query has a relevant reference"):
        retrieval_metrics(x, torch.arange(30), ks=(1,))
    with pytest.raises(ValueError, match="metric must be one of"):
        retrieval_metrics(x, y, metric="dot")


# ---------------------------------------------------------------- classification metrics
@pytest.mark.parametrize("weights", ["uniform", "distance"])
def test_knn_accuracy_matches_sklearn(gen, weights):
    ref, rlab = _labelled(gen, 300, dtype=torch.float64)
    query, qlab = _labelled(gen, 100, dtype=torch.float64)
    ours = knn_accuracy(query, qlab, ref, rlab, k=5, metric="l2", weights=weights)
    sk = KNeighborsClassifier(5, weights=weights, algorithm="brute").fit(ref.numpy(), rlab.numpy())
    assert ours == pytest.approx(sk.score(query.numpy(), qlab.numpy()), abs=1e-12)


def test_knn_accuracy_leave_one_out_matches_sklearn(gen):
    x, y = _labelled(gen, 200, dtype=torch.float64)
    ours = knn_accuracy(x, y, k=3, metric="l2")
    sk = KNeighborsClassifier(3, algorithm="brute").fit(x.numpy(), y.numpy())
    _, idx = sk.kneighbors(None, 3)  # sklearn's own leave-one-out neighbours (query excluded)
    votes = y.numpy()[idx]
    pred = np.array([np.bincount(v, minlength=18).argmax() for v in votes])  # ties -> smallest id
    assert ours == pytest.approx((pred == y.numpy()).mean(), abs=1e-12)
    with pytest.raises(ValueError, match="k=200 exceeds the 199 other queries"):
        knn_accuracy(x, y, k=200)
    with pytest.raises(ValueError, match="needs backend='exact'"):
        knn_accuracy(x.float(), y, k=3, backend="faiss")


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 60), c=st.integers(1, 8))
def test_per_class_recall_matches_sklearn(seed, n, c):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, c, (n,), generator=g)
    pred = torch.where(torch.rand(n, generator=g) < 0.6, target, torch.randint(0, c, (n,), generator=g))
    ours = per_class_recall(pred, target, c).numpy()
    theirs = recall_score(target, pred, labels=list(range(c)), average=None, zero_division=np.nan)
    np.testing.assert_allclose(ours, theirs, atol=1e-12)
    assert np.isnan(ours).tolist() == (torch.bincount(target, minlength=c) == 0).tolist()


def test_per_class_recall_errors():
    with pytest.raises(ValueError, match="pred must have shape"):
        per_class_recall(torch.tensor([0, 1]), torch.tensor([0, 1, 1]), 2)
    with pytest.raises(ValueError, match="target must lie in"):
        per_class_recall(torch.tensor([0, 1]), torch.tensor([0, 2]), 2)
    with pytest.raises(TypeError, match="pred must be an integer"):
        per_class_recall(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), 2)


# ---------------------------------------------------------------- MAP, MRR, P@k, per class, ids
def _ranked(query, ref, metric, excluded):
    """Per-query float64 ranking (score desc, index asc) without the excluded reference indices."""
    q, r = query.double().numpy(), ref.double().numpy()
    if metric == "cosine":
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
        r = r / np.linalg.norm(r, axis=1, keepdims=True)
    orders = []
    for i in range(len(q)):
        score = q[i] @ r.T if metric == "cosine" else -((r - q[i]) ** 2).sum(1)
        order = np.lexsort((np.arange(len(r)), -score))
        orders.append(order[~np.isin(order, list(excluded(i)))])
    return orders


def _brute_all(qlab, rlab, orders, ks, k, avg_of_avgs=False):
    """Every ranking metric from explicit rankings, averaged over queries (or per class first)."""
    rows, labels = [], []
    for i, order in enumerate(orders):
        rel = rlab.numpy()[order] == qlab[i].item()
        big_r = int(rel.sum())
        if big_r == 0:
            continue
        cut = len(order) if k is None else k
        precision = np.cumsum(rel) / np.arange(1, len(rel) + 1)
        first = np.flatnonzero(rel[:cut])
        row = {
            "precision_at_1": float(rel[0]),
            "r_precision": rel[:big_r].mean(),
            "map_at_r": (precision[:big_r] * rel[:big_r]).sum() / big_r,
            "mean_average_precision": (precision[:cut] * rel[:cut]).sum() / big_r,
            "mrr": 1.0 / (first[0] + 1) if first.size else 0.0,
        }
        row.update({("precision_at_k", kk): rel[:kk].sum() / kk for kk in ks})
        row.update({("recall_at_k", kk): float(rel[:kk].any()) for kk in ks})
        rows.append(row)
        labels.append(qlab[i].item())
    keys = list(rows[0])
    values = np.array([[row[key] for key in keys] for row in rows])
    if avg_of_avgs:
        labels = np.array(labels)
        values = np.stack([values[labels == c].mean(0) for c in np.unique(labels)])
    mean = dict(zip(keys, values.mean(0), strict=True))
    out = {key: mean[key] for key in keys if isinstance(key, str)}
    for name in ("precision_at_k", "recall_at_k"):
        out[name] = {kk: mean[(name, kk)] for kk in ks}
    return out


def _assert_metrics(ours, expected, tol=1e-12):
    for key, value in expected.items():
        if isinstance(value, dict):
            assert ours[key] == pytest.approx(value, abs=tol), key
        else:
            assert ours[key] == pytest.approx(value, abs=tol), key


def _tie_heavy(gen, n, classes=5):
    """Few distinct vectors, all of norm exactly 2 (entries ±1, or one ±2): duplicates and ties.

    Norms, normalised rows and every score (cosine, or the ``l2`` key ``2<q, r> − ||r||²``)
    are exact in binary floating point, so tied scores are exactly equal and the order among
    them (by index) is what is tested.
    """
    signs = torch.tensor(
        [[a, b, c, d] for a in (-1.0, 1.0) for b in (-1.0, 1.0) for c in (-1.0, 1.0) for d in (-1.0, 1.0)]
    )
    pool = torch.cat([signs, 2 * torch.eye(4), -2 * torch.eye(4)]).double()
    return pool[torch.randint(0, len(pool), (n,), generator=gen)], torch.randint(
        0, classes, (n,), generator=gen
    )


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(12, 60),
    metric=st.sampled_from(["cosine", "l2"]),
    k=st.sampled_from([None, 3, 11]),
    ties=st.booleans(),
    avg=st.booleans(),
)
def test_all_ranking_metrics_match_brute_force(seed, n, metric, k, ties, avg):
    g = torch.Generator().manual_seed(seed)
    x, y = _tie_heavy(g, n) if ties else _labelled(g, n, d=3, classes=6, dtype=torch.float64)
    ks = (1, 2, 5, 10)
    ours = retrieval_metrics(x, y, metric=metric, ks=ks, k=k, avg_of_avgs=avg, memory_limit_mb=0.05)
    orders = _ranked(x, x, metric, lambda i: {i})
    _assert_metrics(ours, _brute_all(y, y, orders, ks, k, avg))


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**31 - 1),
    nq=st.integers(4, 30),
    extra=st.integers(3, 30),
    metric=st.sampled_from(["cosine", "l2"]),
    k=st.sampled_from([None, 2, 5]),
    ties=st.booleans(),
)
def test_references_containing_the_queries_match_brute_force(seed, nq, extra, metric, k, ties):
    # references = the queries (shuffled in), some of them twice, plus other items: a query is
    # excluded from every reference carrying its id, and only from those
    g = torch.Generator().manual_seed(seed)
    make = (
        (lambda m: _tie_heavy(g, m))
        if ties
        else (lambda m: _labelled(g, m, d=3, classes=5, dtype=torch.float64))
    )
    q, ql = make(nq)
    other, ol = make(extra)
    twice = torch.randint(0, nq, (3,), generator=g)
    ref = torch.cat([q, other, q[twice]])
    rl = torch.cat([ql, ol, ql[twice]])
    rid = torch.cat([torch.arange(nq), torch.arange(nq, nq + extra), twice])
    perm = torch.randperm(len(ref), generator=g)
    ref, rl, rid = ref[perm], rl[perm], rid[perm]
    qid = torch.arange(nq)
    ks = (1, 3)
    try:
        ours = retrieval_metrics(q, ql, ref, rl, metric=metric, ks=ks, k=k, query_ids=qid, reference_ids=rid)
    except ValueError as err:
        assert "no query has a relevant reference" in str(err)
        return
    orders = _ranked(q, ref, metric, lambda i: set(torch.nonzero(rid == qid[i]).flatten().tolist()))
    _assert_metrics(ours, _brute_all(ql, rl, orders, ks, k))


def _stable_knn(query, k, reference, ref_includes_query):
    """A knn_func for PML's AccuracyCalculator ranking like ours (score desc, index asc, float64)."""
    q = torch.nn.functional.normalize(query.double(), dim=1)
    r = torch.nn.functional.normalize(reference.double(), dim=1)
    scores = q @ r.T
    if ref_includes_query:
        scores[torch.arange(len(q)), torch.arange(len(q))] = -math.inf
    values, order = torch.sort(scores, dim=1, descending=True, stable=True)
    return values[:, :k], order[:, :k]


PML_ALL = {
    "precision_at_1": "precision_at_1",
    "r_precision": "r_precision",
    "map_at_r": "mean_average_precision_at_r",
    "mean_average_precision": "mean_average_precision",
    "mrr": "mean_reciprocal_rank",
}


class _WithPrecisionAt3(AccuracyCalculator):
    """PML's documented way to add a metric: precision@3 from its own precision_at_k."""

    def calculate_precision_at_3(self, knn_labels, query_labels, not_lone_query_mask, **kwargs):
        from pytorch_metric_learning.utils import accuracy_calculator as pml_ac

        knn, lab = pml_ac.try_getting_not_lone_labels(knn_labels, query_labels, not_lone_query_mask)
        return pml_ac.precision_at_k(knn, lab[:, None], 3, self.avg_of_avgs, self.return_per_class, torch.eq)

    def requires_knn(self):
        return [*super().requires_knn(), "precision_at_3"]


def _check_against_pml(ours, theirs, per_class=False, r_metrics=True):
    for key, pml_key in PML_ALL.items():
        if key in ("r_precision", "map_at_r") and not r_metrics:
            continue  # PML's k below the largest class truncates its R-metrics (it warns); ours stay exact
        # PML computes reciprocal ranks in float32: MRR agrees to ~1e-8 only
        tol = 1e-7 if key == "mrr" else 1e-12
        if per_class:
            assert [ours["per_class"][c][key] for c in sorted(ours["per_class"])] == pytest.approx(
                theirs[pml_key], abs=tol
            ), key
        else:
            assert ours[key] == pytest.approx(theirs[pml_key], abs=tol), key
    three = (
        [ours["per_class"][c]["precision_at_k"][3] for c in sorted(ours["per_class"])] if per_class else None
    )
    assert (three if per_class else ours["precision_at_k"][3]) == pytest.approx(
        theirs["precision_at_3"], abs=1e-12
    )


@pytest.mark.parametrize("k", [None, 7])
@pytest.mark.parametrize("mode", ["plain", "avg_of_avgs", "per_class"])
@pytest.mark.parametrize("data", ["random", "ties"])
def test_ranking_metrics_match_pml(gen, k, mode, data):
    x, y = _labelled(gen, 300) if data == "random" else _tie_heavy(gen, 300, classes=8)
    x = x.float()
    calc = _WithPrecisionAt3(
        include=(*PML_ALL.values(), "precision_at_3"),
        k=k,
        avg_of_avgs=mode == "avg_of_avgs",
        return_per_class=mode == "per_class",
        knn_func=_stable_knn,
    )
    theirs = calc.get_accuracy(x, y)
    ours = retrieval_metrics(
        x.double(), y, ks=(3,), k=k, avg_of_avgs=mode == "avg_of_avgs", per_class=mode == "per_class"
    )
    _check_against_pml(ours, theirs, per_class=mode == "per_class", r_metrics=k is None)


@pytest.mark.parametrize("data", ["random", "ties"])
def test_references_containing_the_queries_match_pml(gen, data):
    make = (lambda m: _labelled(gen, m)) if data == "random" else (lambda m: _tie_heavy(gen, m, classes=8))
    q, ql = make(150)
    more, ml = make(200)
    ref, rl = torch.cat([q, more]), torch.cat([ql, ml])
    calc = _WithPrecisionAt3(include=(*PML_ALL.values(), "precision_at_3"), k=None, knn_func=_stable_knn)
    theirs = calc.get_accuracy(q.float(), ql, ref.float(), rl, ref_includes_query=True)
    ours = retrieval_metrics(
        q.double(),
        ql,
        ref.double(),
        rl,
        ks=(3,),
        query_ids=torch.arange(150),
        reference_ids=torch.arange(350),
    )
    _check_against_pml(ours, theirs)
    if data == "random":  # without the ids the queries find themselves first
        assert retrieval_metrics(q.double(), ql, ref.double(), rl, ks=(3,))["precision_at_1"] == 1.0


def test_default_pml_knn_agrees_on_random_data(gen):
    # PML's own FAISS search (not our tie order) on tie-free data
    ref, rlab = _labelled(gen, 500)
    query, qlab = _labelled(gen, 150)
    norm = torch.nn.functional.normalize
    theirs = AccuracyCalculator(include=tuple(PML_ALL.values()), k=None).get_accuracy(
        norm(query, dim=1), qlab, norm(ref, dim=1), rlab
    )
    ours = retrieval_metrics(query, qlab, ref, rlab, memory_limit_mb=0.5)
    for key, pml_key in PML_ALL.items():
        assert ours[key] == pytest.approx(theirs[pml_key], abs=1e-7 if key == "mrr" else 1e-12)


def test_hand_computed_map_and_mrr():
    # one query, ranking rel = [0, 1, 0, 1]: MAP = (1/2 + 2/4) / 2, MRR = 1/2, P@2 = 1/2
    q = torch.tensor([[1.0, 0.0]])
    ref = torch.tensor([[0.99, 0.14], [0.9, 0.44], [0.8, 0.6], [0.0, 1.0]])
    m = retrieval_metrics(q, torch.tensor([0]), ref, torch.tensor([1, 0, 1, 0]), ks=(2,))
    assert m["mean_average_precision"] == pytest.approx(0.5)
    assert m["mrr"] == pytest.approx(0.5) and m["precision_at_k"] == {2: 0.5}
    cut = retrieval_metrics(q, torch.tensor([0]), ref, torch.tensor([1, 0, 1, 0]), ks=(2,), k=3)
    assert cut["mean_average_precision"] == pytest.approx(0.25)  # (1/2) / R, R = 2 (as PML)
    assert (
        retrieval_metrics(q, torch.tensor([0]), ref, torch.tensor([1, 1, 1, 0]), ks=(1,), k=2)["mrr"] == 0.0
    )


def test_per_class_and_avg_of_avgs_are_consistent(gen):
    x, y = _labelled(gen, 200)
    m = retrieval_metrics(x, y, per_class=True)
    a = retrieval_metrics(x, y, avg_of_avgs=True)
    table = m["per_class"]
    assert sum(row["num_queries"] for row in table.values()) == m["num_queries"]
    for key in ("precision_at_1", "map_at_r", "mean_average_precision", "mrr"):
        assert a[key] == pytest.approx(np.mean([row[key] for row in table.values()]), abs=1e-12)
        weighted = sum(row[key] * row["num_queries"] for row in table.values()) / m["num_queries"]
        assert m[key] == pytest.approx(weighted, abs=1e-12)
    assert set(table) == set(torch.unique(y[torch.bincount(y)[y] > 1]).tolist())


def test_include_selects_metrics_and_depth(gen):
    x, y = _labelled(gen, 120)
    m = retrieval_metrics(x, y, include=("map_at_r",))
    assert set(m) == {"map_at_r", "num_queries", "num_queries_without_relevant"}
    assert m["map_at_r"] == retrieval_metrics(x, y)["map_at_r"]


def test_nmi_ami_match_pml_with_the_same_clustering(gen):
    from sklearn.cluster import KMeans

    centres = torch.randn(6, 8, generator=gen) * 3
    y = torch.randint(0, 6, (240,), generator=gen)
    x = centres[y] + torch.randn(240, 8, generator=gen)

    def kmeans(emb, num_clusters):
        emb = torch.nn.functional.normalize(emb.double(), dim=1).numpy()
        return torch.tensor(KMeans(n_clusters=num_clusters, n_init=10, random_state=3).fit_predict(emb))

    theirs = AccuracyCalculator(include=("NMI", "AMI"), kmeans_func=kmeans).get_accuracy(x, y)
    ours = retrieval_metrics(x, y, include=("nmi", "ami"), seed=3)
    assert ours["nmi"] == pytest.approx(theirs["NMI"], abs=1e-12)
    assert ours["ami"] == pytest.approx(theirs["AMI"], abs=1e-12)
    assert 0.5 < ours["nmi"] <= 1.0


def test_clustering_metrics_on_separated_clusters_and_errors(gen):
    y = torch.arange(40) % 4
    x = torch.nn.functional.one_hot(y, 8).double() + 0.01 * torch.randn(
        40, 8, generator=gen, dtype=torch.float64
    )
    m = clustering_metrics(x, y)
    assert m["nmi"] == pytest.approx(1.0) and m["ami"] == pytest.approx(1.0) and m["num_clusters"] == 4
    assert clustering_metrics(x, y, seed=1) == clustering_metrics(x, y, seed=1)
    with pytest.raises(ValueError, match="labels must have between 2 and 39 distinct values"):
        clustering_metrics(x, torch.zeros(40, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must have shape"):
        clustering_metrics(x, y[:3])
    with pytest.raises(TypeError, match="seed must be an int"):
        clustering_metrics(x, y, seed=0.5)


def test_sklearn_is_imported_lazily():
    import subprocess
    import sys

    code = (
        "import sys, torch; from marginkit.metrics import retrieval_metrics; "
        "retrieval_metrics(torch.randn(20, 3), torch.arange(20) % 4); "
        "assert 'sklearn' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_new_argument_errors(gen):
    x, y = _labelled(gen, 30)
    ids = torch.arange(30)
    with pytest.raises(ValueError, match="k must be >= 1"):
        retrieval_metrics(x, y, k=0)
    with pytest.raises(ValueError, match="k must be <= the 29 references"):
        retrieval_metrics(x, y, k=30)
    with pytest.raises(ValueError, match="include has unknown metric\\(s\\) \\['map'\\]"):
        retrieval_metrics(x, y, include=("map",))
    with pytest.raises(ValueError, match="include must name at least one metric"):
        retrieval_metrics(x, y, include=())
    with pytest.raises(ValueError, match="query_ids/reference_ids need reference"):
        retrieval_metrics(x, y, query_ids=ids, reference_ids=ids)
    with pytest.raises(ValueError, match="given together"):
        retrieval_metrics(x, y, x, y, query_ids=ids)
    with pytest.raises(ValueError, match="reference_ids must have shape \\(30,\\)"):
        retrieval_metrics(x, y, x, y, query_ids=ids, reference_ids=ids[:5])
    with pytest.raises(TypeError, match="query_ids must be an integer tensor"):
        retrieval_metrics(x, y, x, y, query_ids=ids.float(), reference_ids=ids)
    with pytest.raises(ValueError, match="ks must be <= the 29 references available"):
        retrieval_metrics(x, y, x, y, ks=(30,), query_ids=ids, reference_ids=ids)
    with pytest.raises(TypeError, match="seed must be an int"):
        retrieval_metrics(x, y, seed=True)


# ------------------------------------------- full MAP / MRR of float32 keys: counted, not sorted
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(12, 80),
    metric=st.sampled_from(["cosine", "l2"]),
    ties=st.booleans(),
    separate=st.booleans(),
    avg=st.booleans(),
    limit=st.sampled_from([0.1, 512.0]),
)
def test_counted_full_map_and_mrr_match_brute_force(seed, n, metric, ties, separate, avg, limit):
    # float32 keys take the counting path; the tie-heavy rows are exact in float32 too, so ties
    # broken by index are what is tested
    g = torch.Generator().manual_seed(seed)
    x, y = _tie_heavy(g, n) if ties else _labelled(g, n, d=3, classes=6, dtype=torch.float64)
    x = x.float()
    ks = (1, 2, 5)
    if separate:
        q, ql, ref, rl = x[: n // 3], y[: n // 3], x[n // 3 :], y[n // 3 :]
        try:
            ours = retrieval_metrics(
                q, ql, ref, rl, metric=metric, ks=ks, avg_of_avgs=avg, memory_limit_mb=limit
            )
        except ValueError as err:
            assert "no query has a relevant reference" in str(err)
            return
        orders = _ranked(q, ref, metric, lambda i: set())
        expected = _brute_all(ql, rl, orders, ks, None, avg)
    else:
        ours = retrieval_metrics(x, y, metric=metric, ks=ks, avg_of_avgs=avg, memory_limit_mb=limit)
        expected = _brute_all(y, y, _ranked(x, x, metric, lambda i: {i}), ks, None, avg)
    _assert_metrics(ours, expected)


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_counted_path_equals_the_full_sort(monkeypatch, metric):
    # the same float32 keys, counted and sorted: equal up to the order of the float64 sums
    from marginkit.metrics import retrieval

    g = torch.Generator().manual_seed(5)
    x, y = _labelled(g, 400, d=4, classes=30)
    counted = retrieval_metrics(x, y, metric=metric, ks=(1, 3), avg_of_avgs=True, memory_limit_mb=0.5)
    monkeypatch.setattr(retrieval, "COUNT_FULL_RANKS", False)
    ranked = retrieval_metrics(x, y, metric=metric, ks=(1, 3), avg_of_avgs=True, memory_limit_mb=0.5)
    _assert_metrics(counted, ranked, tol=1e-14)


def test_counted_path_equals_the_sorted_path_on_exact_data():
    # float64 inputs rank by a full sort, float32 inputs count: on data whose scores are exact in
    # both precisions (many ties) the two agree up to the order of the float64 sums
    g = torch.Generator().manual_seed(3)
    x, y = _tie_heavy(g, 300, classes=7)
    for metric in ("cosine", "l2"):
        wide = retrieval_metrics(x, y, metric=metric, ks=(1, 4), per_class=True)
        narrow = retrieval_metrics(
            x.float(), y, metric=metric, ks=(1, 4), per_class=True, memory_limit_mb=0.1
        )
        assert narrow.keys() == wide.keys() and narrow["per_class"].keys() == wide["per_class"].keys()
        _assert_metrics(narrow, {key: value for key, value in wide.items() if key != "per_class"}, tol=1e-14)
        for label, row in wide["per_class"].items():
            _assert_metrics(narrow["per_class"][label], row, tol=1e-14)
