"""numpy arrays (and anything ``numpy.asarray`` takes) wherever the public API takes arrays of data.

Issue 27: ``TypeError: embeddings must be a torch.Tensor, got ndarray`` from the metrics and K-NN.
The rule (``marginkit._validation.accepts_arrays``): numpy in, numpy out (scikit-learn's
convention) for the arrays a function returns; tensors in, tensors out; figures and result
objects unchanged. Each case below compares the numpy call with the tensor call.
"""

import numpy as np
import pytest
import torch

from marginkit import metrics as M
from marginkit.gallery import Gallery
from marginkit.knn import KNNClassifier


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(60, 8)).astype(np.float32)
    return emb, np.arange(60) % 6


def _same(a, b):
    """``a`` from numpy inputs equals ``b`` from tensors, and is numpy wherever ``b`` is a tensor."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, np.ndarray), type(a)
        np.testing.assert_array_equal(a, b.numpy())
    elif isinstance(b, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(b, dict):
        assert a.keys() == b.keys()
        for key in b:
            _same(a[key], b[key])
    else:
        assert a == b or (a != a and b != b), (a, b)  # (NaN equals NaN here)


def test_the_issue_case_numpy_embeddings_in_metrics(data):
    emb, lab = data
    scores, genuine = M.pair_scores(emb, lab)  # was: TypeError: embeddings must be a torch.Tensor
    assert isinstance(scores, np.ndarray) and scores.dtype == np.float32 and genuine.dtype == np.bool_


def test_every_metric_takes_numpy_and_returns_numpy_for_numpy(data):
    emb, lab = data
    t_emb, t_lab = torch.from_numpy(emb), torch.from_numpy(lab)
    s, g = M.pair_scores(t_emb, t_lab)
    sn, gn = s.numpy(), g.numpy()
    cal = M.calibrate(s, g)
    trials = torch.stack([torch.arange(10), torch.arange(10)], 1)
    stats = M.cohort_stats(t_emb[:10], t_emb[10:])
    cases = [
        (M.pair_scores, (emb, lab), (t_emb, t_lab)),
        (M.eer, (sn, gn), (s, g)),
        (M.min_dcf, (sn, gn), (s, g)),
        (M.verification_metrics, (sn, gn), (s, g)),
        (M.det_curve, (sn, gn), (s, g)),
        (M.normal_deviate, (np.array([0.1, 0.5]),), (torch.tensor([0.1, 0.5], dtype=torch.float64),)),
        (M.calibrate(sn, gn).llr, (sn,), (s,)),
        (M.cllr, (cal.llr(s).numpy(), gn), (cal.llr(s), g)),
        (M.min_cllr, (sn, gn), (s, g)),
        (M.actual_dcf, (cal.llr(s).numpy(), gn), (cal.llr(s), g)),
        (M.retrieval_metrics, (emb, lab), (t_emb, t_lab)),
        (M.clustering_metrics, (emb, lab), (t_emb, t_lab)),
        (M.knn_accuracy, (emb, lab), (t_emb, t_lab)),
        (M.per_class_recall, (lab, lab, 6), (t_lab, t_lab, 6)),
        (M.template_features, (emb, lab), (t_emb, t_lab)),
        (
            M.identification_metrics,
            (emb[:30], lab[:30], emb[30:], lab[30:]),
            (t_emb[:30], t_lab[:30], t_emb[30:], t_lab[30:]),
        ),
        (M.open_set_split, (lab,), (t_lab,)),
        (M.random_templates, (lab,), (t_lab,)),
        (M.cohort_stats, (emb[:10], emb[10:]), (t_emb[:10], t_emb[10:])),
    ]
    for fn, numpy_args, torch_args in cases:
        kwargs = {"size": 2} if fn is M.random_templates else {}
        got, want = fn(*numpy_args, **kwargs), fn(*torch_args, **kwargs)
        if fn is M.cohort_stats:
            torch.testing.assert_close(got.mean, want.mean, rtol=0, atol=0)
        else:
            _same(got, want)
    got = M.normalize_scores(sn[:10], stats, stats, trials=trials.numpy())
    _same(got, M.normalize_scores(s[:10], stats, stats, trials=trials))
    search = M.search_gallery(emb[:30], lab[:30], emb[30:], lab[30:])
    want = M.search_gallery(t_emb[:30], t_lab[:30], t_emb[30:], t_lab[30:])
    torch.testing.assert_close(search.rank, want.rank)


def test_lists_and_integer_features_are_arrays_too(data):
    emb, lab = data
    want = M.retrieval_metrics(torch.from_numpy(emb).double(), torch.from_numpy(lab))
    assert M.retrieval_metrics(emb.astype(np.float64).tolist(), lab.tolist()) == want
    ints = np.rint(emb * 4).astype(np.int64)  # integer features are numbers, as in scikit-learn
    assert M.knn_accuracy(ints, lab, k=3) == M.knn_accuracy(torch.from_numpy(ints).double(), lab, k=3)


def test_non_numeric_arrays_are_refused_by_name(data):
    emb, lab = data
    with pytest.raises(TypeError, match="embeddings must be a tensor or an array of numbers, got dtype <U"):
        M.pair_scores(np.array([["a", "b"]] * 60), lab)
    with pytest.raises(TypeError, match="labels must be a tensor or an array of integers, got dtype float64"):
        M.pair_scores(emb, lab + 0.5)
    with pytest.raises(TypeError, match="is_genuine must be a tensor or an array of bools"):
        M.eer(np.zeros(4), np.array(["x"] * 4))
    with pytest.raises(TypeError, match="query must be a tensor or an array of numbers, got list"):
        M.retrieval_metrics([[1.0, 2.0], [3.0]], lab[:2])


def test_knn_follows_scikit_learn_numpy_in_numpy_out(data):
    emb, lab = data
    clf = KNNClassifier(k=3).fit(emb, lab)  # numpy references
    ref = KNNClassifier(k=3).fit(torch.from_numpy(emb), torch.from_numpy(lab))
    q = emb[:7]
    pred = clf.predict(q)
    assert isinstance(pred, np.ndarray) and pred.dtype == np.int64
    np.testing.assert_array_equal(pred, ref.predict(torch.from_numpy(q)).numpy())
    assert isinstance(clf.predict(torch.from_numpy(q)), torch.Tensor)  # tensors in, tensors out
    proba = clf.predict_proba(q.tolist())  # a list is an array too
    assert isinstance(proba, np.ndarray)
    np.testing.assert_array_equal(proba, ref.predict_proba(torch.from_numpy(q)).numpy())
    values, indices = clf.kneighbors(q)
    assert isinstance(values, np.ndarray) and isinstance(indices, np.ndarray)
    np.testing.assert_array_equal(indices, ref.kneighbors(torch.from_numpy(q))[1].numpy())
    assert clf.score(emb, lab) == ref.score(torch.from_numpy(emb), torch.from_numpy(lab))
    names = KNNClassifier(k=1).fit(emb, np.array(list("abcdef"))[lab])
    assert names.predict(q).dtype.kind == "U"
    clf.add(emb[:3] * 2, lab[:3])  # and add() too
    assert clf.num_references == 63


def test_gallery_takes_numpy(tmp_path, data):
    emb, _ = data
    g = Gallery(tmp_path / "g.db", model_fingerprint="sha256:" + "ab" * 32, embedding_dim=8, threshold=0.5)
    g.enroll("alice", emb[:3])
    g.enroll("bob", emb[3:6].tolist())
    assert g.identify(emb[1]).identity == "alice" and g.identify(emb[4]).identity == "bob"
    assert g.classify(emb[4:6]) == g.classify(torch.from_numpy(emb[4:6]))
    assert g.verify(emb[0], "alice").match


def test_the_docs_example_runs(capsys):
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "knn_and_metrics.md").read_text(encoding="utf-8")
    section = text[text.index("**Arrays in, arrays out.**") :]
    start = section.index("```python") + len("```python")
    exec(compile(section[start : section.index("```", start)], "docs/knn_and_metrics.md", "exec"), {})
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("ndarray ") and second.startswith("[")
