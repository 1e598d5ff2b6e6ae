"""EER, minDCF, DET points on sorted copies: brute force over every threshold, scikit-learn, memory."""

import doctest
import importlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm
from sklearn.metrics import roc_curve

from marginkit.metrics import det_curve, eer, min_dcf, normal_deviate, verification_metrics
from marginkit.metrics._roc import _first_true
from rss_utils import HAS_PEAK_RESET, run_measured
from score_data import trial_scores


def _all_operating_points(s, y):
    """(t, FAR, FRR) for t in -inf and every distinct score, by counting (accept iff score > t)."""
    s, y = s.numpy(), y.numpy()
    ts = np.concatenate([[-np.inf], np.unique(s)])
    far = np.array([(s[~y] > t).mean() for t in ts])
    frr = np.array([(s[y] <= t).mean() for t in ts])
    return ts, far, frr


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_gen=st.integers(1, 100),
    n_imp=st.integers(1, 300),
    round_to=st.sampled_from([None, 2, 5, 20]),
)
def test_eer_and_min_dcf_equal_the_brute_force_over_every_threshold(seed, n_gen, n_imp, round_to):
    s, y = trial_scores(seed, n_gen, n_imp, round_to)
    ts, far, frr = _all_operating_points(s, y)
    d = far - frr
    j = int(np.nonzero(d <= 0)[0][0])
    expected = far[j] if d[j] == 0 else far[j - 1] + d[j - 1] / (d[j - 1] - d[j]) * (far[j] - far[j - 1])
    assert eer(s, y) == pytest.approx(expected, abs=1e-12)
    for p, cm, cf in ((0.01, 1.0, 1.0), (0.5, 1.0, 1.0), (0.1, 5.0, 1.0)):
        dcf = (cm * p * frr + cf * (1 - p) * far) / min(cm * p, cf * (1 - p))
        value, threshold = min_dcf(s, y, p, cm, cf)
        assert value == pytest.approx(dcf.min(), abs=1e-12)
        best = ts[np.isclose(dcf, dcf.min(), rtol=1e-12, atol=0)]
        assert threshold == best[0]  # the smallest minimising threshold (equal up to rounding)
    m = verification_metrics(s, y, p_target=0.1, c_miss=5.0)
    assert (m["min_dcf"], m["min_dcf_threshold"]) == min_dcf(s, y, 0.1, 5.0, 1.0)
    assert m["eer"] == eer(s, y)


@settings(max_examples=40)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(0, 3000), cut=st.floats(0, 1))
def test_first_true_is_the_first_index_of_a_monotone_predicate(seed, n, cut):
    values = torch.sort(torch.rand(n, generator=torch.Generator().manual_seed(seed))).values
    expected = int((values < cut).sum())
    assert _first_true(values, lambda v: v >= cut) == expected


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_gen=st.integers(1, 80),
    n_imp=st.integers(1, 200),
    round_to=st.sampled_from([None, 3]),
)
def test_det_points_are_the_sklearn_roc_points(seed, n_gen, n_imp, round_to):
    s, y = trial_scores(seed, n_gen, n_imp, round_to)
    d = det_curve(s, y, num_points=None)
    ts, far, frr = _all_operating_points(s, y)
    assert d["threshold"].tolist() == ts.tolist()
    assert d["p_fa"].tolist() == pytest.approx(far.tolist(), abs=1e-15)
    assert d["p_miss"].tolist() == pytest.approx(frr.tolist(), abs=1e-15)
    fpr, tpr, _ = roc_curve(y.numpy(), s.numpy(), drop_intermediate=False)  # accept iff score >= t
    ours = {
        (round(a, 12), round(b, 12)) for a, b in zip(d["p_fa"].tolist(), d["p_miss"].tolist(), strict=True)
    }
    theirs = {(round(a, 12), round(1 - b, 12)) for a, b in zip(fpr.tolist(), tpr.tolist(), strict=True)}
    assert ours == theirs | {(1.0, 0.0)}  # the same operating points; sklearn's start (0, 1) is ours too


def test_thinned_det_curve_spreads_its_points_on_the_deviate_axes(gen):
    s, y = trial_scores(0, 20_000, 200_000)
    full = det_curve(s, y, num_points=None)
    few = det_curve(s, y, num_points=100)
    assert len(few["threshold"]) <= 102
    assert set(few["threshold"].tolist()) <= set(full["threshold"].tolist())  # exact operating points
    assert bool(
        (few["p_fa"][1:] <= few["p_fa"][:-1]).all() and (few["p_miss"][1:] >= few["p_miss"][:-1]).all()
    )
    for rate, n in (("p_fa", 200_000), ("p_miss", 20_000)):
        z = normal_deviate(few[rate])
        z = z[torch.isfinite(z)]
        # 50 target rates evenly spaced in deviate between 1/n and 1 - 1/n: the points span that
        # range with gaps of at most two grid steps (one score's share quantises the tails).
        span = 2 * abs(float(norm.ppf(1 / n)))
        assert float(z.max() - z.min()) == pytest.approx(span, rel=0.01)
        assert float(z.diff().abs().max()) <= 2 * span / 49


def test_normal_deviate_equals_scipy():
    p = torch.tensor([1e-12, 1e-4, 0.1, 0.5, 0.77, 1 - 1e-9])
    np.testing.assert_allclose(normal_deviate(p).numpy(), norm.ppf(p.double().numpy()), rtol=1e-12)
    assert normal_deviate(torch.tensor([0.0, 1.0])).tolist() == [-math.inf, math.inf]


def test_errors():
    s, y = torch.tensor([0.1, 0.5, 0.6]), torch.tensor([0, 1, 1])
    with pytest.raises(ValueError, match="num_points must be >= 2"):
        det_curve(s, y, num_points=1)
    with pytest.raises(ValueError, match="is_genuine must have one entry per score"):
        eer(s, y[:2])
    with pytest.raises(ValueError, match="scores contains NaN"):
        min_dcf(torch.tensor([0.1, math.nan, 0.3]), y)
    with pytest.raises(ValueError, match="p_target must lie in"):
        min_dcf(s, y, p_target=1.5)


@pytest.mark.parametrize(
    "module",
    [
        "verification",
        "identification",
        "templates",
        "protocols",
        "normalization",
        "calibration",
        "curves",
    ],
)
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"marginkit.metrics.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


_MEASURE = """
from marginkit.metrics import verification_metrics

g = torch.Generator().manual_seed(0)
n, n_gen = 10_000_000, 100_000
scores = torch.cat([0.5 + 0.2 * torch.randn(n_gen, generator=g), 0.2 * torch.randn(n - n_gen, generator=g)])
is_genuine = torch.arange(n) < n_gen
verification_metrics(scores[n_gen - 500 : n_gen + 500], is_genuine[n_gen - 500 : n_gen + 500])  # warm-up
growth, m = peak_growth(lambda: verification_metrics(scores, is_genuine))
print(json.dumps({"growth": growth, "eer": m["eer"]}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAS_PEAK_RESET, reason="needs Linux peak-RSS reset")
def test_verification_of_ten_million_scores_needs_one_copy_of_them():
    # Selected and sorted in place, the scores of each class are copied once (4 bytes a float32
    # score); the negated genuine flags take 1 byte a pair; blocks of 2^18 candidate thresholds and
    # the searches add a bounded amount. (scikit-learn's roc_curve: a stable argsort and float64
    # cumulative counts, ~50 bytes a score.) Peak RSS growth in a fresh process (tests/rss_utils.py).
    out = run_measured(_MEASURE)
    n = 10_000_000
    assert out["growth"] <= (4 + 1) * n / 2**20 + 16, out  # measured 47.7 MB
    assert 0.05 < out["eer"] < 0.2


def test_torch_paths_equal_the_numpy_fast_paths(gen, monkeypatch):
    # CPU tensors sort and select through numpy; other devices through torch.sort / torch.topk.
    # Both paths on the same CPU data must give the same metrics.
    from marginkit.metrics import _roc, cohort_stats, min_cllr, normalize_scores

    s, y = trial_scores(5, 300, 3000, round_to=50)
    emb, cohort = torch.randn(50, 6, generator=gen), torch.randn(40, 6, generator=gen)
    raw = torch.randn(50, generator=gen)

    def everything():
        m = verification_metrics(s, y, fars=(0.1, 0.01))
        st = cohort_stats(emb, cohort, top_k=7)
        return (
            m["eer"],
            m["min_dcf"],
            m["auc"],
            m["thresholds"],
            m["tar_at_far"],
            min_cllr(s, y),
            det_curve(s, y, num_points=50)["threshold"].tolist(),
            normalize_scores(raw, st, st, method="as-norm").tolist(),
            st.std.tolist(),
        )

    fast = everything()
    monkeypatch.setattr(_roc, "NUMPY_ON_CPU", False)
    slow = everything()
    assert slow[:7] == fast[:7]  # order statistics: exactly equal
    # the top-k come in another order, so their float64 sums may differ in the last bit
    np.testing.assert_allclose(slow[7:], fast[7:], rtol=1e-12, atol=0)
