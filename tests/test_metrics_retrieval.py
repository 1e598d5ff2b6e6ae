"""retrieval_metrics, knn_accuracy and per_class_recall against PML, sklearn and brute force."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from sklearn.metrics import recall_score
from sklearn.neighbors import KNeighborsClassifier

from marginkit.metrics import knn_accuracy, per_class_recall, retrieval_metrics

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
