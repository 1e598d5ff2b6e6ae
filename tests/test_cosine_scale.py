"""Cosine similarity does not depend on the scale of the vectors: K-NN, metrics, templates, gallery.

Issue 28: ``KNNClassifier(metric="cosine")`` fitted on float32 references scaled by 1e30 predicted
wrongly (the norm overflowed to inf, every cosine became 0), and at 1e-30 refused the rows as
all-zero (the squares underflowed). Every cosine normalisation goes through
``marginkit.knn._search.prepare``, which divides each row by its largest magnitude first.
"""

import pytest
import torch

from marginkit.gallery import Gallery
from marginkit.knn import KNNClassifier
from marginkit.knn._search import prepare
from marginkit.metrics import knn_accuracy, pair_scores, retrieval_metrics, search_gallery
from marginkit.metrics.templates import template_features

SCALES = [1e30, 1e-30, 1e-40, 1e37]  # 1e-40: subnormal in float32; 1e37·randn: near float32's largest


def _data(gen, n=60, q=25, d=8, c=4):
    ref = torch.randn(n, d, generator=gen)
    lab = torch.arange(n) % c
    return ref, lab, torch.randn(q, d, generator=gen)


@pytest.mark.parametrize("scale", SCALES)
def test_prepare_gives_the_same_unit_rows_at_any_scale(gen, scale):
    x = torch.randn(20, 16, generator=gen) * scale  # (subnormals keep fewer digits of randn)
    x64 = x.double()
    expected = x64 / torch.linalg.vector_norm(x64, dim=1, keepdim=True)  # float64 squares do not overflow
    unit = prepare(x, "cosine", "x")
    assert unit.dtype == torch.float32
    torch.testing.assert_close(unit.double(), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="all-zero row"):
        prepare(torch.zeros(2, 3), "cosine", "x")


@pytest.mark.parametrize("backend", ["exact", "faiss"])
@pytest.mark.parametrize("scale", SCALES)
def test_knn_cosine_on_float32_at_any_scale_matches_float64(gen, backend, scale):
    ref, lab, q = _data(gen)
    ref, q = ref * scale, q * scale
    scaled = KNNClassifier(5, "cosine", backend=backend).fit(ref, lab)
    exact64 = KNNClassifier(5, "cosine").fit(ref.double(), lab)  # float64 squares neither overflow nor vanish
    for queries in (q, q / scale):
        expected_values, expected_idx = exact64.kneighbors(queries.double())
        values, idx = scaled.kneighbors(queries)
        torch.testing.assert_close(idx, expected_idx, rtol=0, atol=0)
        torch.testing.assert_close(values.double(), expected_values, rtol=0, atol=1e-6)
        torch.testing.assert_close(scaled.predict(queries), exact64.predict(queries.double()), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["exact", "faiss", "hnsw"])
@pytest.mark.parametrize("scale", [2.0**100, 2.0**-100, 2.0**120])
def test_knn_cosine_answers_do_not_change_with_the_scale(gen, backend, scale):
    # a power of two scales float32 exactly: the answers must be those at scale 1, to the bit
    ref, lab, q = _data(gen)
    base = KNNClassifier(5, "cosine", backend=backend).fit(ref, lab)
    scaled = KNNClassifier(5, "cosine", backend=backend).fit(ref * scale, lab)
    expected_values, expected_idx = base.kneighbors(q)
    for queries in (q, q * scale):
        values, idx = scaled.kneighbors(queries)
        torch.testing.assert_close(idx, expected_idx, rtol=0, atol=0)
        torch.testing.assert_close(values, expected_values, rtol=0, atol=0)
        torch.testing.assert_close(scaled.predict_proba(queries), base.predict_proba(q), rtol=0, atol=0)


@pytest.mark.parametrize("scale", [2.0**100, 2.0**-100])
def test_metrics_on_cosine_do_not_depend_on_the_scale(gen, scale):
    # (1e30·randn overflowed the squares: every cosine 0; a power of two scales exactly)
    ref, lab, q = _data(gen)
    assert retrieval_metrics(ref * scale, lab) == retrieval_metrics(ref, lab)
    assert knn_accuracy(ref * scale, lab, k=3) == knn_accuracy(ref, lab, k=3)
    for a, b in zip(pair_scores(ref * scale, lab), pair_scores(ref, lab), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    probe_labels = torch.arange(q.shape[0]) % 5
    got = search_gallery(q * scale, probe_labels, ref * scale, lab)
    expected = search_gallery(q, probe_labels, ref, lab)
    for field in ("mated", "rank", "own_score", "top_score"):
        torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=0, atol=0)
    _, feats = template_features(ref * scale, lab)
    torch.testing.assert_close(feats, template_features(ref, lab)[1], rtol=0, atol=0)


def test_gallery_scores_do_not_depend_on_the_scale(tmp_path, gen):
    g = Gallery(tmp_path / "g.db", model_fingerprint="sha256:" + "ab" * 32, embedding_dim=8, threshold=0.5)
    templates = torch.randn(6, 8, generator=gen)
    g.enroll("alice", templates[:3] * 1e30)
    g.enroll("bob", templates[3:] * 1e-30)
    probe = templates[1] + 0.01 * torch.randn(8, generator=gen)
    result = g.identify(probe * 1e30)
    assert result.candidates[0].identity == "alice"
    expected = float(torch.nn.functional.cosine_similarity(probe.double(), templates[1].double(), dim=0))
    assert result.candidates[0].score == pytest.approx(expected, abs=1e-5)
