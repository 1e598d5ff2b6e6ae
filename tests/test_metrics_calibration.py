"""Calibration, Cllr, min Cllr (PAV) and actual DCF against scikit-learn and brute force."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.isotonic import IsotonicRegression
from sklearn.linear_model import LogisticRegression

from marginkit.metrics import (
    actual_dcf,
    bayes_threshold,
    calibrate,
    cllr,
    min_cllr,
    min_dcf,
    verification_metrics,
)
from score_data import trial_scores


@pytest.mark.parametrize("prior", [0.5, 0.1, 0.9])
def test_calibrate_equals_sklearn_prior_weighted_logistic_regression(prior):
    s, y = trial_scores(0, 400, 3000)
    c = calibrate(s, y, prior=prior)
    n_g, n_i = int(y.sum()), int((~y).sum())
    w = np.where(y.numpy(), prior / n_g, (1 - prior) / n_i) * (n_g + n_i)
    lr = LogisticRegression(C=1e15, tol=1e-13, max_iter=100_000).fit(
        s.numpy()[:, None], y.numpy(), sample_weight=w
    )
    assert c.slope == pytest.approx(lr.coef_[0, 0], rel=1e-6)
    assert c.offset == pytest.approx(lr.intercept_[0] - math.log(prior / (1 - prior)), abs=1e-6)
    assert (c.prior, c.num_genuine, c.num_impostor) == (prior, n_g, n_i)


def test_calibration_is_affine_invariant_and_its_far_threshold_is_the_order_statistic():
    s, y = trial_scores(1, 300, 2000)
    c = calibrate(s, y)
    c2 = calibrate(3.0 * s - 7.0, y)
    torch.testing.assert_close(c2.llr(3.0 * s - 7.0), c.llr(s), rtol=0, atol=1e-9)
    assert c.score_at_llr(float(c.llr(s[:1])[0])) == pytest.approx(float(s[0]), abs=1e-12)
    m = verification_metrics(s, y, fars=(0.1, 0.01, 1e-4))
    for far in (0.1, 0.01, 1e-4):
        assert c.threshold_at_far(far) == m["thresholds"][far]
    assert c.threshold_at_far(1e-4) is None  # 2000 impostors cannot resolve 1e-4


def test_calibration_recovers_the_true_llr_of_gaussian_scores():
    # Genuine ~ N(mu, 1), impostor ~ N(0, 1): the true llr is mu s - mu^2 / 2.
    mu = 2.0
    s, y = trial_scores(2, 100_000, 100_000, shift=mu)
    c = calibrate(s, y)
    assert c.slope == pytest.approx(mu, abs=0.03) and c.offset == pytest.approx(-(mu**2) / 2, abs=0.03)
    true_llr = mu * s - mu**2 / 2
    # Calibrated llrs lose (almost) nothing to the optimal monotone map; raw scores do.
    assert cllr(c.llr(s), y) == pytest.approx(cllr(true_llr, y), abs=2e-4)
    assert cllr(c.llr(s), y) - min_cllr(s, y) < 2e-3
    assert cllr(s * 5, y) - min_cllr(s, y) > 0.1


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_gen=st.integers(1, 80),
    n_imp=st.integers(1, 200),
    round_to=st.sampled_from([None, 2, 5]),
)
def test_cllr_and_actual_dcf_equal_loops(seed, n_gen, n_imp, round_to):
    llr, y = trial_scores(seed, n_gen, n_imp, round_to)
    gen = [v for v, f in zip(llr.tolist(), y.tolist(), strict=True) if f]
    imp = [v for v, f in zip(llr.tolist(), y.tolist(), strict=True) if not f]
    ref = 0.5 * (
        np.mean([math.log2(1 + math.exp(-v)) for v in gen])
        + np.mean([math.log2(1 + math.exp(v)) for v in imp])
    )
    assert cllr(llr, y) == pytest.approx(ref, rel=1e-12)
    for p, cm, cf in ((0.01, 1.0, 1.0), (0.5, 1.0, 1.0), (0.05, 10.0, 1.0)):
        theta = -math.log(p / (1 - p) * cm / cf)
        p_miss = np.mean([v <= theta for v in gen])  # accept iff llr > theta
        p_fa = np.mean([v > theta for v in imp])
        ref_dcf = (cm * p * p_miss + cf * (1 - p) * p_fa) / min(cm * p, cf * (1 - p))
        assert actual_dcf(llr, y, p, cm, cf) == pytest.approx(ref_dcf, abs=1e-12)
        # The Bayes threshold is one threshold: the minimum over all of them is never worse.
        assert min_dcf(llr, y, p, cm, cf)[0] <= actual_dcf(llr, y, p, cm, cf) + 1e-12
        assert bayes_threshold(p, cm, cf) == pytest.approx(theta)


def _pav(scores, labels):
    """Pool-adjacent-violators by hand: blocks of tied scores, merged while the genuine share falls."""
    order = np.argsort(scores, kind="stable")
    s, y = scores[order], labels[order]
    blocks = []  # [sum_y, count]
    i = 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        blocks.append([float(y[i:j].sum()), j - i])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] >= blocks[-1][0] / blocks[-1][1]:
            a, b = blocks.pop(), blocks.pop()
            blocks.append([a[0] + b[0], a[1] + b[1]])
        i = j
    return blocks


def _cllr_of_pools(blocks, n_g, n_i):
    total = 0.0
    for g_count, count in blocks:
        i_count = count - g_count
        if g_count and i_count:
            llr = math.log(g_count / i_count) - math.log(n_g / n_i)
            total += g_count / n_g * math.log2(1 + math.exp(-llr)) + i_count / n_i * math.log2(
                1 + math.exp(llr)
            )
    return total / 2


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_gen=st.integers(1, 120),
    n_imp=st.integers(1, 300),
    round_to=st.sampled_from([None, 1, 3, 10]),
)
def test_min_cllr_equals_pav_by_hand_and_sklearn_isotonic(seed, n_gen, n_imp, round_to):
    s, y = trial_scores(seed, n_gen, n_imp, round_to, shift=1.0)
    ours = min_cllr(s, y)
    assert ours == pytest.approx(_cllr_of_pools(_pav(s.numpy(), y.numpy()), n_gen, n_imp), abs=1e-12)
    p = IsotonicRegression(increasing=True).fit_transform(s.numpy(), y.numpy().astype(float))
    with np.errstate(divide="ignore"):
        llr = np.log(p) - np.log1p(-p) - math.log(n_gen / n_imp)
    yy = y.numpy()
    gen_cost = np.where(np.isposinf(llr[yy]), 0.0, np.logaddexp(0, -llr[yy]) / math.log(2))
    imp_cost = np.where(np.isneginf(llr[~yy]), 0.0, np.logaddexp(0, llr[~yy]) / math.log(2))
    assert ours == pytest.approx(0.5 * (gen_cost.mean() + imp_cost.mean()), abs=1e-9)
    assert 0.0 <= ours <= 1.0 + 1e-12  # a constant map (one pool, llr 0, Cllr 1) is monotone too
    assert min_cllr(torch.exp(s), y) == pytest.approx(ours, abs=1e-12)  # any increasing map: same


def test_min_cllr_hand_made():
    y = torch.tensor([0, 0, 1, 1])
    assert min_cllr(torch.tensor([0.1, 0.2, 0.3, 0.4]), y) == 0.0  # separable: pools of one class
    assert min_cllr(torch.tensor([0.5, 0.5, 0.5, 0.5]), y) == pytest.approx(1.0)  # one tie: llr 0
    # Reversed ranking: PAV pools everything into one block, again llr 0 and Cllr 1.
    assert min_cllr(torch.tensor([0.4, 0.3, 0.2, 0.1]), y) == pytest.approx(1.0)


def test_errors():
    s, y = torch.tensor([0.1, 0.5, 0.6, 0.9]), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match="separate genuine from impostor trials perfectly"):
        calibrate(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="separate genuine from impostor trials perfectly"):
        calibrate(
            torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([0, 0, 1, 1])
        )  # reversed, also no finite optimum
    with pytest.raises(ValueError, match="scores contains NaN"):
        calibrate(torch.tensor([0.1, math.nan, 0.4, 0.9]), y)
    with pytest.raises(ValueError, match="genuine must have one entry per score"):
        calibrate(s, y[:3])
    with pytest.raises(ValueError, match="genuine has no impostor pair"):
        calibrate(s, torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="prior must lie in"):
        calibrate(s, y, prior=1.0)
    c = calibrate(s, y)
    with pytest.raises(ValueError, match="far must lie in"):
        c.threshold_at_far(1.0)
    with pytest.raises(ValueError, match="llr contains NaN"):
        cllr(torch.tensor([0.1, math.nan, 0.4, 0.9]), y)
    with pytest.raises(ValueError, match="genuine must have one entry per score"):
        min_cllr(s, y[:2])
    with pytest.raises(ValueError, match="p_target must lie in"):
        actual_dcf(s, y, p_target=1.0)
    with pytest.raises(ValueError, match="c_fa must be a finite number > 0"):
        actual_dcf(s, y, c_fa=-1.0)
