"""Cohort score normalisation against a per-trial float64 loop; its memory bound, measured."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marginkit.metrics import CohortStats, cohort_stats, normalize_scores
from rss_utils import HAS_PEAK_RESET, run_measured


def _mu_sigma(row, top_k):
    kept = sorted(row, reverse=True)[:top_k] if top_k else list(row)
    mu = sum(kept) / len(kept)
    return mu, math.sqrt(sum((v - mu) ** 2 for v in kept) / len(kept))


def _reference(scores, enroll, test, method, top_k):
    """One trial at a time, straight from the formulas."""
    out = []
    for i, s in enumerate(scores.tolist()):
        z = t = None
        if method != "t-norm":
            mu, sd = _mu_sigma(enroll[i].tolist(), top_k)
            z = (s - mu) / sd
        if method != "z-norm":
            mu, sd = _mu_sigma(test[i].tolist(), top_k)
            t = (s - mu) / sd
        out.append(z if t is None else t if z is None else (z + t) / 2)
    return np.array(out)


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    trials=st.integers(1, 50),
    cohort=st.integers(2, 40),
    method=st.sampled_from(["s-norm", "as-norm", "z-norm", "t-norm"]),
    adaptive=st.booleans(),
    limit=st.sampled_from([0.01, 256.0]),  # 0.01 MB: chunks of a few trials
)
def test_matches_the_per_trial_loop(seed, trials, cohort, method, adaptive, limit):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(trials, generator=g, dtype=torch.float64)
    enroll = torch.randn(trials, cohort, generator=g, dtype=torch.float64)
    test = 0.3 * torch.randn(trials, cohort, generator=g, dtype=torch.float64) + 0.1
    top_k = None
    if method == "as-norm" or (adaptive and method in ("z-norm", "t-norm")):
        top_k = int(torch.randint(2, cohort + 1, (1,), generator=g))
    ours = normalize_scores(scores, enroll, test, method=method, top_k=top_k, memory_limit_mb=limit)
    ref = _reference(scores, enroll, test, method, top_k)
    np.testing.assert_allclose(ours.numpy(), ref, rtol=1e-12, atol=1e-12)
    # The same through statistics computed first, and through trials indexing shared rows.
    stats = [CohortStats.from_scores(c, top_k=top_k, memory_limit_mb=limit) for c in (enroll, test)]
    np.testing.assert_allclose(
        normalize_scores(scores, *stats, method=method).numpy(), ref, rtol=1e-12, atol=1e-12
    )
    rows = torch.randint(0, trials, (3 * trials, 2), generator=g)
    many = scores[rows[:, 0]] + scores[rows[:, 1]]
    by_index = normalize_scores(
        many, enroll, test, method=method, top_k=top_k, trials=rows, memory_limit_mb=limit
    )
    expanded = normalize_scores(many, enroll[rows[:, 0]], test[rows[:, 1]], method=method, top_k=top_k)
    torch.testing.assert_close(by_index, expanded, rtol=1e-12, atol=1e-12)


def test_as_norm_keeps_the_top_k_and_one_side_may_be_absent():
    enroll = torch.tensor([[0.0, 1.0, 2.0, 3.0, 10.0]])  # top-2: {10, 3}: mu 6.5, sigma 3.5
    test = torch.tensor([[4.0, 4.0, 6.0, -9.0, 0.0]])  # top-2: {6, 4}: mu 5, sigma 1
    s = torch.tensor([13.5])
    assert normalize_scores(s, enroll, test, method="as-norm", top_k=2).tolist() == [(2.0 + 8.5) / 2]
    assert normalize_scores(s, enroll, None, method="z-norm", top_k=2).tolist() == [2.0]
    assert normalize_scores(s, None, test, method="t-norm", top_k=2).tolist() == [8.5]
    assert normalize_scores(s.double(), enroll, test, method="as-norm", top_k=2).dtype == torch.float64


@pytest.mark.parametrize("numpy_path", [True, False])  # the product through numpy's BLAS or torch.mm
def test_cohort_stats_equal_the_score_matrix_statistics(gen, monkeypatch, numpy_path):
    from marginkit.metrics import _roc

    monkeypatch.setattr(_roc, "NUMPY_ON_CPU", numpy_path)
    emb = torch.randn(300, 12, generator=gen, dtype=torch.float64)
    cohort = torch.randn(80, 12, generator=gen, dtype=torch.float64)
    scores = torch.nn.functional.normalize(emb, dim=1) @ torch.nn.functional.normalize(cohort, dim=1).T
    for top_k in (None, 2, 17, 80):
        a = cohort_stats(emb, cohort, top_k=top_k, memory_limit_mb=0.05)  # many chunks
        b = cohort_stats(emb, cohort, top_k=top_k)
        ref = np.array([_mu_sigma(r, top_k) for r in scores.tolist()])
        np.testing.assert_allclose(a.mean.numpy(), ref[:, 0], rtol=0, atol=1e-12)
        np.testing.assert_allclose(a.std.numpy(), ref[:, 1], rtol=0, atol=1e-12)
        torch.testing.assert_close(a.mean, b.mean, rtol=0, atol=1e-14)
        assert a.top_k == top_k and a.cohort_size == 80 and len(a) == 300


@pytest.mark.parametrize("threads", [2, 3])
def test_the_selection_split_over_threads_keeps_the_statistics(gen, monkeypatch, threads):
    # every block split over the threads (3: uneven parts), the moments in tiles of one row
    from marginkit.metrics import normalization

    monkeypatch.setattr(normalization, "_PARALLEL_MIN", 1)
    monkeypatch.setattr(normalization, "_TILE_BYTES", 8)
    emb = torch.randn(301, 12, generator=gen, dtype=torch.float64)
    cohort = torch.randn(80, 12, generator=gen, dtype=torch.float64)
    scores = torch.nn.functional.normalize(emb, dim=1) @ torch.nn.functional.normalize(cohort, dim=1).T
    given = scores.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for top_k in (None, 2, 17, 80):
            ref = np.array([_mu_sigma(r, top_k) for r in scores.tolist()])
            for st in (
                cohort_stats(emb, cohort, top_k=top_k, memory_limit_mb=0.05),
                CohortStats.from_scores(given, top_k=top_k),
            ):
                np.testing.assert_allclose(st.mean.numpy(), ref[:, 0], rtol=0, atol=1e-12)
                np.testing.assert_allclose(st.std.numpy(), ref[:, 1], rtol=0, atol=1e-12)
            assert torch.equal(given, scores)  # a given score matrix is not reordered
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("numpy_path", [True, False])  # the worker thread's chunks, or one at a time
def test_a_flat_row_in_a_later_chunk_is_named(gen, monkeypatch, numpy_path):
    from marginkit.metrics import _roc

    monkeypatch.setattr(_roc, "NUMPY_ON_CPU", numpy_path)
    cohort = torch.cat([torch.randn(80, 6, generator=gen), torch.zeros(80, 6)], dim=1)
    emb = torch.randn(300, 12, generator=gen)
    emb[250, :6] = 0.0  # orthogonal to the whole cohort: 80 scores of 0
    with pytest.raises(ValueError, match=r"embeddings row 250: its 5 cohort scores are all equal"):
        cohort_stats(emb, cohort, top_k=5, memory_limit_mb=0.05)  # many chunks


@pytest.mark.parametrize("numpy_path", [True, False])
def test_ties_at_the_top_k_boundary_give_the_statistics_of_the_sorted_rows(gen, monkeypatch, numpy_path):
    from marginkit.metrics import _roc

    monkeypatch.setattr(_roc, "NUMPY_ON_CPU", numpy_path)
    scores = torch.randint(0, 4, (60, 40), generator=gen).to(torch.float32)  # ties everywhere
    scores[:, 0] = 5.0  # no row is flat
    for top_k in (2, 7, 13, 39):
        st = CohortStats.from_scores(scores, top_k=top_k)
        ref = np.array([_mu_sigma(r, top_k) for r in scores.tolist()])
        np.testing.assert_allclose(st.mean.numpy(), ref[:, 0], rtol=0, atol=1e-12)
        np.testing.assert_allclose(st.std.numpy(), ref[:, 1], rtol=0, atol=1e-12)


def test_errors(gen):
    s = torch.randn(4, generator=gen)
    c = torch.randn(4, 6, generator=gen)
    with pytest.raises(ValueError, match="enroll_cohort must have one row per trial"):
        normalize_scores(s, c[:3], c)
    with pytest.raises(ValueError, match="scores contains NaN"):
        normalize_scores(torch.tensor([0.1, math.nan, 0.2, 0.3]), c, c)
    with pytest.raises(ValueError, match="test_cohort contains NaN"):
        normalize_scores(s, c, torch.where(c > 1, math.nan, c))
    with pytest.raises(ValueError, match="enroll_cohort is an empty cohort"):
        normalize_scores(s, torch.empty(4, 0), c)
    with pytest.raises(ValueError, match="top_k=7 exceeds the cohort size of enroll_cohort"):
        normalize_scores(s, c, c, method="as-norm", top_k=7)
    with pytest.raises(ValueError, match="top_k must be >= 2"):
        normalize_scores(s, c, c, method="as-norm", top_k=1)
    with pytest.raises(ValueError, match="method='as-norm' needs top_k"):
        normalize_scores(s, c, c, method="as-norm")
    with pytest.raises(ValueError, match="that is adaptive S-norm"):
        normalize_scores(s, c, c, method="s-norm", top_k=3)
    with pytest.raises(ValueError, match="method must be one of"):
        normalize_scores(s, c, c, method="x-norm")
    with pytest.raises(ValueError, match="test_cohort is required for method='s-norm'"):
        normalize_scores(s, c, None)
    with pytest.raises(ValueError, match="trials must have shape"):
        normalize_scores(s, c, c, trials=torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"trials\[:, 1\] must index rows of test_cohort in \[0, 4\)"):
        normalize_scores(s, c, c, trials=torch.tensor([[0, 0], [1, 1], [2, 2], [3, 4]]))
    with pytest.raises(ValueError, match="standard deviation 0"):
        normalize_scores(s, torch.ones(4, 6), c)
    with pytest.raises(ValueError, match="memory_limit_mb=.* is too small"):
        cohort_stats(c, torch.randn(1000, 6, generator=gen), memory_limit_mb=0.01)
    stats = CohortStats.from_scores(c, top_k=3)
    with pytest.raises(ValueError, match="top_k=4 but enroll_cohort holds statistics of top_k=3"):
        normalize_scores(s, stats, stats, method="as-norm", top_k=4)
    with pytest.raises(ValueError, match="enroll_cohort and test_cohort keep different top_k"):
        normalize_scores(s, stats, CohortStats.from_scores(c, top_k=2), method="as-norm")
    with pytest.raises(ValueError, match="embeddings have dimension 6 but cohort has 5"):
        cohort_stats(c, torch.randn(3, 5, generator=gen))
    with pytest.raises(ValueError, match="top_k=9 exceeds the cohort size of cohort"):
        cohort_stats(c, c, top_k=9)


_MEASURE = """
from marginkit.metrics import cohort_stats, normalize_scores

g = torch.Generator().manual_seed(0)
enroll = torch.randn(10_000, 32, generator=g)
test = torch.randn(10_000, 32, generator=g)
cohort = torch.randn(10_000, 32, generator=g)
trials = torch.randint(0, 10_000, (10_000_000, 2), generator=g)
scores = torch.randn(10_000_000, generator=g)
cohort_stats(enroll[:100], cohort, top_k=300, memory_limit_mb=16)  # warm-up
normalize_scores(scores[:1000], enroll[:1000] @ cohort[:20].T, test[:1000] @ cohort[:20].T)
res = {}
res["stats"], se = peak_growth(lambda: cohort_stats(enroll, cohort, top_k=300, memory_limit_mb=16))
res["stats-512"], st = peak_growth(lambda: cohort_stats(test, cohort, top_k=300, memory_limit_mb=512))
res["norm-16"], out = peak_growth(
    lambda: normalize_scores(scores, se, st, method="as-norm", trials=trials, memory_limit_mb=16)
)
print(json.dumps(res))
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAS_PEAK_RESET, reason="needs Linux peak-RSS reset")
def test_as_norm_of_ten_million_trials_stays_in_its_memory_bound():
    # 10^7 trials against a 10^4 cohort (as score matrices: 400 GB), peak RSS growth measured in a
    # fresh process (tests/rss_utils.py). Measured: 14.8, 132 and 40.5 MB.
    growth = run_measured(_MEASURE)
    output_mb = 10_000_000 * 4 / 2**20  # the returned float32 scores are not temporaries
    stats_mb = 10_000 * 16 / 2**20
    assert growth["stats"] <= 16 + stats_mb + 1, growth
    assert growth["norm-16"] <= 16 + output_mb + 1, growth
    assert growth["stats-512"] > 64, growth  # the measurement sees the chunks' memory (128 MB blocks)


@pytest.mark.parametrize("numpy_path", [True, False])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_bad_score_outside_the_top_k_is_still_caught(gen, monkeypatch, numpy_path, bad):
    # NaN and +inf sort above every number in numpy and torch alike: they are always among the
    # kept scores, so they show in the statistics (no separate pass over the matrix is needed).
    from marginkit.metrics import _roc

    monkeypatch.setattr(_roc, "NUMPY_ON_CPU", numpy_path)
    c = torch.randn(5, 50, generator=gen)
    c[3, 17] = bad
    with pytest.raises(ValueError, match=r"enroll_cohort contains NaN or infinite values \(row 3\)"):
        normalize_scores(torch.zeros(5), c, c.abs(), method="as-norm", top_k=4)
    with pytest.raises(ValueError, match=r"cohort_scores contains NaN or infinite values \(row 3\)"):
        CohortStats.from_scores(c, top_k=2)
