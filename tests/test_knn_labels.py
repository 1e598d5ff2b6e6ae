"""K-NN labels as identifiers, with scikit-learn's conventions (issue 28).

Any integers (an identity id of 10**12 included) and strings; ``classes_`` sorted;
``predict`` returns the labels themselves; ``predict_proba`` has one column per class, in
``classes_`` order — checked against scikit-learn's ``KNeighborsClassifier``.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.neighbors import KNeighborsClassifier

from marginkit.knn import IndexFileError, KNNClassifier
from marginkit.metrics import knn_accuracy


def _data(gen, n=120, q=40, d=6, c=5):
    ref = torch.randn(n, d, generator=gen, dtype=torch.float64)
    codes = torch.arange(n) % c
    return ref, codes, torch.randn(q, d, generator=gen, dtype=torch.float64)


def _sklearn(ref, labels, k, weights="uniform"):
    sk = KNeighborsClassifier(k, weights=weights, metric="cosine", algorithm="brute")
    return sk.fit(ref.numpy(), labels)


def test_an_identity_id_of_10_to_the_12_costs_nothing(gen):
    ref, codes, q = _data(gen)
    ids = torch.tensor([7, 10**12, 42, 10**12 + 1, -3])[codes]  # max(label) + 1 columns was 40 TB
    clf = KNNClassifier(k=3).fit(ref, ids)
    assert clf.classes_.tolist() == [-3, 7, 42, 10**12, 10**12 + 1]
    proba = clf.predict_proba(q)
    assert proba.shape == (40, 5)
    pred = clf.predict(q)
    assert pred.dtype == torch.int64 and set(pred.tolist()) <= set(clf.classes_.tolist())
    sk = _sklearn(ref, ids.numpy(), 3)
    np.testing.assert_array_equal(sk.classes_, clf.classes_)
    np.testing.assert_array_equal(pred.numpy(), sk.predict(q.numpy()))
    np.testing.assert_allclose(proba.numpy(), sk.predict_proba(q.numpy()), atol=1e-12)


def test_ids_1001_to_9001_give_nine_columns(gen):
    ref, codes, q = _data(gen, c=9)
    ids = codes * 1000 + 1001
    clf = KNNClassifier(k=4, weights="distance").fit(ref, ids)
    assert clf.num_classes == 9 and clf.predict_proba(q).shape == (40, 9)  # was 9002
    sk = _sklearn(ref, ids.numpy(), 4, "distance")
    np.testing.assert_allclose(clf.predict_proba(q).numpy(), sk.predict_proba(q.numpy()), atol=1e-12)
    np.testing.assert_array_equal(clf.predict(q).numpy(), sk.predict(q.numpy()))
    assert clf.score(q, torch.from_numpy(sk.predict(q.numpy()))) == 1.0


def test_string_labels_as_scikit_learn(gen, tmp_path):
    ref, codes, q = _data(gen)
    names = np.array(["zoe", "alice", "bob", "Émile", "carol"])[codes.numpy()]
    clf = KNNClassifier(k=3).fit(ref, names.tolist())  # a list of str, as scikit-learn takes
    sk = _sklearn(ref, names, 3)
    np.testing.assert_array_equal(clf.classes_, sk.classes_)
    pred = clf.predict(q)
    assert isinstance(pred, np.ndarray) and pred.dtype.kind == "U"
    np.testing.assert_array_equal(pred, sk.predict(q.numpy()))
    np.testing.assert_allclose(clf.predict_proba(q).numpy(), sk.predict_proba(q.numpy()), atol=1e-12)
    np.testing.assert_array_equal(clf.reference_labels, names)
    assert clf.score(q, sk.predict(q.numpy())) == 1.0
    assert clf.score(q, ["nobody"] * 40) == 0.0  # a label outside classes_ is a miss, not an error
    path = tmp_path / "names.npz"
    clf.save(path)
    with np.load(path, allow_pickle=False) as z:  # strings as a unicode array: no pickle
        assert z["classes"].dtype.kind == "U" and json.loads(str(z["metadata"]))["version"] == 3
    back = KNNClassifier.load(path)
    np.testing.assert_array_equal(back.classes_, clf.classes_)
    np.testing.assert_array_equal(back.predict(q), pred)
    with pytest.raises(TypeError, match="labels are integers, but this classifier's classes are strings"):
        back.add(ref[:2], torch.tensor([1, 2]))


def test_add_inserts_new_classes_in_sorted_order(gen):
    ref, codes, q = _data(gen)
    ids = torch.tensor([50, 60, 70, 80, 90])[codes]
    ids[100:] = 5  # a class that sorts first, arriving with add()
    full = KNNClassifier(k=5).fit(ref, ids)
    grown = KNNClassifier(k=5).fit(ref[:100], ids[:100])
    assert grown.classes_.tolist() == [50, 60, 70, 80, 90]
    grown.add(ref[100:], ids[100:])
    assert grown.classes_.tolist() == [5, 50, 60, 70, 80, 90]
    assert torch.equal(grown.predict_proba(q), full.predict_proba(q))
    assert torch.equal(grown.predict(q), full.predict(q))
    assert torch.equal(grown.reference_labels, ids)


@pytest.mark.parametrize("backend", ["exact", "faiss", "hnsw"])
def test_save_load_keeps_identifier_labels(gen, tmp_path, backend):
    ref, codes, q = _data(gen)
    ids = torch.tensor([10**15, -(10**15), 3, 2**62, 0])[codes]
    clf = KNNClassifier(k=3, backend=backend).fit(ref.float(), ids)
    path = tmp_path / "ids.npz"
    clf.save(path)
    back = KNNClassifier.load(path)
    assert back.classes_.dtype == np.int64 and back.classes_.tolist() == sorted(set(ids.tolist()))
    assert torch.equal(back.predict(q.float()), clf.predict(q.float()))
    assert torch.equal(back.predict_proba(q.float()), clf.predict_proba(q.float()))


def test_damaged_classes_are_refused_by_name(gen, tmp_path):
    ref, codes, _ = _data(gen)
    path = tmp_path / "ok.npz"
    KNNClassifier(k=3).fit(ref.float(), codes * 10).save(path)
    with np.load(path, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    meta = arrays.pop("metadata")
    cases = [
        ("unsorted", arrays["classes"][::-1].copy(), "'classes' must be sorted and distinct"),
        ("floats", arrays["classes"].astype(np.float64), "'classes' must be 5 integers or strings"),
        ("short", arrays["classes"][:4], "'classes' must be 5 integers or strings"),
        ("objects", arrays["classes"].astype(object), "dtype object is not allowed"),
    ]
    for name, classes, message in cases:
        bad = tmp_path / f"{name}.npz"
        np.savez(bad, **{**arrays, "classes": classes}, metadata=meta)
        with pytest.raises(IndexFileError, match=message) as info:
            KNNClassifier.load(bad)
        assert str(bad) in str(info.value)
    bad = tmp_path / "missing.npz"
    np.savez(bad, **{k: v for k, v in arrays.items() if k != "classes"}, metadata=meta)
    with pytest.raises(IndexFileError, match="holds arrays"):
        KNNClassifier.load(bad)


def test_bad_labels_are_refused_by_name(gen):
    ref, codes, _ = _data(gen, n=4)
    cases = [
        ([0.5, 1.0, 2.0, 3.0], TypeError, "labels must be integers or strings .* got dtype float64"),
        ([True, False, True, False], TypeError, "got dtype bool"),
        (["a", 1, "b", 2], TypeError, "all integers or all strings, got a mix of int, str"),
        ([2**64, 1, 2, 3], ValueError, "must fit in 64-bit integers"),
        (np.array([2**63, 1, 2, 3], dtype=np.uint64), ValueError, "must fit in 64-bit integers"),
        (["a", "b"], ValueError, r"labels must have shape \(4,\)"),
        ([[0], [1], [2], [3]], ValueError, r"labels must have shape \(4,\)"),
    ]
    for labels, error, message in cases:
        with pytest.raises(error, match=message):
            KNNClassifier(k=1).fit(ref, labels)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, num_classes=3\)"):
        KNNClassifier(k=1, num_classes=3).fit(ref, codes * 3)


def test_declared_classes_keep_their_columns(gen):
    ref, codes, q = _data(gen, c=3)
    clf = KNNClassifier(k=3, num_classes=6).fit(ref, codes)
    assert clf.classes_.tolist() == list(range(6)) and clf.predict_proba(q).shape == (40, 6)
    assert bool((clf.predict_proba(q)[:, 3:] == 0).all())


def test_leave_one_out_accuracy_with_identifier_labels(gen):
    ref, codes, _ = _data(gen)
    ids = torch.tensor([-1, 3, 8, 10**12, 10**13])[codes]  # order kept: vote ties go the same way
    assert knn_accuracy(ref, ids, k=3) == knn_accuracy(ref, codes, k=3)
    names = np.array(list("vwxyz"))[codes.numpy()]
    assert knn_accuracy(ref, names, k=3) == knn_accuracy(ref, codes, k=3)


def test_the_docs_labels_example_prints_what_its_comments_say(capsys):
    text = (Path(__file__).parents[1] / "docs" / "knn_and_metrics.md").read_text(encoding="utf-8")
    section = text[text.index("### Labels are identifiers") :]
    start = section.index("```python") + len("```python")
    code = section[start : section.index("```", start)]
    exec(compile(code, "docs/knn_and_metrics.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    promised = [line.split("# ", 1)[1] for line in code.splitlines() if line.startswith("print(")]
    assert printed == promised
