"""verification_metrics and pair_scores against order statistics, scikit-learn and brute force."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.interpolate import interp1d
from scipy.optimize import brentq
from scipy.stats import chisquare
from sklearn.metrics import roc_auc_score, roc_curve
from torch.profiler import ProfilerActivity, profile

from marginkit.metrics import pair_scores, verification_metrics


def _scores(gen, n_gen, n_imp, round_to=None):
    genuine = 0.5 + 0.25 * torch.randn(n_gen, generator=gen, dtype=torch.float64)
    impostor = 0.25 * torch.randn(n_imp, generator=gen, dtype=torch.float64)
    scores = torch.cat([genuine, impostor])
    if round_to is not None:  # coarse scores: many ties, also across genuine and impostor
        scores = torch.round(scores * round_to) / round_to
    is_genuine = torch.arange(n_gen + n_imp) < n_gen
    perm = torch.randperm(n_gen + n_imp, generator=gen)
    return scores[perm], is_genuine[perm]


def _order_statistic_tar(scores, is_genuine, far):
    """Smallest threshold t among the scores (and -inf) with #{imp > t} <= far * n; TAR there."""
    s, g = scores.numpy(), is_genuine.numpy()
    imp, gen = s[~g], s[g]
    if far * len(imp) < 1:
        return None, None
    best = None
    for t in np.concatenate([[-np.inf], np.unique(s)]):  # ascending: the first admissible wins
        if (imp > t).sum() <= far * len(imp) * (1 + 1e-12):
            best = t
            break
    return (gen > best).mean(), best


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_gen=st.integers(1, 200),
    n_imp=st.integers(1, 3000),
    round_to=st.sampled_from([None, 4, 20]),
)
def test_tar_at_far_equals_order_statistics(seed, n_gen, n_imp, round_to):
    g = torch.Generator().manual_seed(seed)
    scores, is_genuine = _scores(g, n_gen, n_imp, round_to)
    fars = (0.5, 1e-1, 3e-2, 1e-2, 1e-3, 1e-4)
    m = verification_metrics(scores, is_genuine, fars)
    for far in fars:
        tar, t = _order_statistic_tar(scores, is_genuine, far)
        assert m["tar_at_far"][far] == tar
        assert m["thresholds"][far] == t
        if t is not None:  # the realised FAR never exceeds the target, ties included
            imp = scores[~is_genuine]
            assert (imp > t).double().mean() <= far + 1e-15


def test_unmeasurable_far_is_none_not_a_number():
    scores = torch.tensor([0.9, 0.8, 0.1, 0.2, 0.3])
    is_genuine = torch.tensor([True, True, False, False, False])
    m = verification_metrics(scores, is_genuine, fars=(1 / 3, 0.3, 1e-6))
    assert m["tar_at_far"] == {1 / 3: 1.0, 0.3: None, 1e-6: None}  # 3 impostors: FAR < 1/3 unmeasurable
    assert m["thresholds"][1 / 3] == pytest.approx(0.2)


def test_ties_at_the_threshold_are_counted_honestly():
    # Four impostors tied at 0.5: at FAR = 0.25 the threshold must reject all of them.
    scores = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.1, 0.1, 0.1, 0.1, 0.5, 0.6, 0.7, 0.4])
    is_genuine = torch.tensor([False] * 8 + [True] * 4)
    m = verification_metrics(scores, is_genuine, fars=(0.25, 0.375, 0.5))
    # FAR 0.25 and 0.375 allow 2 and 3 false accepts, but the tied block holds 4: all rejected.
    for far in (0.25, 0.375):
        assert m["thresholds"][far] == 0.5 and m["tar_at_far"][far] == 0.5  # genuine 0.5 rejected too
    assert m["thresholds"][0.5] == pytest.approx(0.1) and m["tar_at_far"][0.5] == 1.0  # 4 accepted
    assert m["decision"] == "accept iff score > threshold"


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_gen=st.integers(1, 300),
    n_imp=st.integers(1, 300),
    round_to=st.sampled_from([None, 3, 10]),
)
def test_auc_matches_sklearn(seed, n_gen, n_imp, round_to):
    g = torch.Generator().manual_seed(seed)
    scores, is_genuine = _scores(g, n_gen, n_imp, round_to)
    m = verification_metrics(scores, is_genuine)
    assert m["auc"] == pytest.approx(roc_auc_score(is_genuine.numpy(), scores.numpy()), abs=1e-12)


@settings(max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), n_gen=st.integers(2, 300), n_imp=st.integers(2, 300))
def test_eer_matches_brentq_on_the_sklearn_roc(seed, n_gen, n_imp):
    # The classic recipe: brentq on 1 - x - TPR(x), TPR linearly interpolated on sklearn's ROC.
    g = torch.Generator().manual_seed(seed)
    scores, is_genuine = _scores(g, n_gen, n_imp)
    fpr, tpr, _ = roc_curve(is_genuine.numpy(), scores.numpy(), drop_intermediate=False)
    expected = brentq(lambda x: 1.0 - x - interp1d(fpr, tpr)(x), 0.0, 1.0, xtol=1e-13)
    assert verification_metrics(scores, is_genuine)["eer"] == pytest.approx(expected, abs=1e-9)


def test_eer_hand_computed():
    # Genuine {0.6, 0.8}, impostors {0.2, 0.7}: FAR = FRR = 0.5 at t in [0.6, 0.7).
    m = verification_metrics(torch.tensor([0.6, 0.8, 0.2, 0.7]), torch.tensor([1, 1, 0, 0]))
    assert m["eer"] == 0.5
    separable = verification_metrics(torch.tensor([0.9, 0.8, 0.1]), torch.tensor([True, True, False]))
    assert separable["eer"] == 0.0 and separable["auc"] == 1.0 and separable["min_dcf"] == 0.0


@pytest.mark.parametrize(
    ("p_target", "c_miss", "c_fa"), [(0.01, 1.0, 1.0), (0.5, 10.0, 1.0), (0.05, 1.0, 3.0)]
)
def test_min_dcf_matches_brute_force(gen, p_target, c_miss, c_fa):
    scores, is_genuine = _scores(gen, 150, 900, round_to=30)
    m = verification_metrics(scores, is_genuine, p_target=p_target, c_miss=c_miss, c_fa=c_fa)
    s, g = scores.numpy(), is_genuine.numpy()
    best = math.inf
    for t in np.concatenate([[-np.inf], np.unique(s), [np.inf]]):
        p_miss, p_fa = (s[g] <= t).mean(), (s[~g] > t).mean()
        best = min(best, c_miss * p_target * p_miss + c_fa * (1 - p_target) * p_fa)
    assert m["min_dcf"] == pytest.approx(best / min(c_miss * p_target, c_fa * (1 - p_target)), abs=1e-12)
    assert m["dcf_params"] == {"p_target": p_target, "c_miss": c_miss, "c_fa": c_fa, "normalized": True}


def test_verification_errors():
    s, g = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([True, False, True])
    with pytest.raises(ValueError, match="is_genuine must have one entry per score"):
        verification_metrics(s, g[:2])
    with pytest.raises(ValueError, match="no genuine pair"):
        verification_metrics(s, torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no impostor pair"):
        verification_metrics(s, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="scores contains NaN"):
        verification_metrics(torch.tensor([0.1, math.nan, 0.3]), g)
    with pytest.raises(ValueError, match="fars must lie in"):
        verification_metrics(s, g, fars=(0.0,))
    with pytest.raises(ValueError, match="only 0/1"):
        verification_metrics(s, torch.tensor([0, 2, 1]))
    with pytest.raises(TypeError, match="is_genuine must be a bool"):
        verification_metrics(s, g.float())
    with pytest.raises(ValueError, match="p_target must lie in"):
        verification_metrics(s, g, p_target=1.0)


# ---------------------------------------------------------------- pair_scores
def _all_pairs(x, y):
    e = torch.nn.functional.normalize(x.double(), dim=1)
    i, j = torch.triu_indices(len(x), len(x), offset=1)
    return {
        (a, b): (float(e[a] @ e[b]), bool(y[a] == y[b])) for a, b in zip(i.tolist(), j.tolist(), strict=True)
    }


@pytest.mark.parametrize("limit_mb", [0.001, 256])
def test_pair_scores_equal_all_pairs_brute_force(gen, limit_mb):
    x = torch.randn(90, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 7, (90,), generator=gen)
    scores, is_genuine, pairs = pair_scores(x, y, memory_limit_mb=limit_mb, return_pairs=True)
    expected = _all_pairs(x, y)
    assert len(scores) == len(expected) == len(set(map(tuple, pairs.tolist())))
    for (a, b), s, gen_flag in zip(pairs.tolist(), scores.tolist(), is_genuine.tolist(), strict=True):
        assert a < b
        assert s == pytest.approx(expected[(a, b)][0], abs=1e-12)
        assert gen_flag == expected[(a, b)][1]
    n_gen = int(is_genuine.sum())
    assert is_genuine[:n_gen].all() and not is_genuine[n_gen:].any()  # genuine pairs first


@pytest.mark.parametrize("share", [0.03, 0.4, 0.7, 0.999])  # rejection sampling / subset of all
def test_pair_scores_impostor_sample(gen, share):
    x = torch.randn(60, 5, generator=gen)
    y = torch.randint(0, 6, (60,), generator=gen)
    expected = _all_pairs(x, y)
    n_gen = sum(flag for _, flag in expected.values())
    max_impostors = int(share * (len(expected) - n_gen))
    scores, is_genuine, pairs = pair_scores(x, y, max_impostors=max_impostors, seed=3, return_pairs=True)
    assert int(is_genuine.sum()) == n_gen
    imp = pairs[~is_genuine].tolist()
    assert len(imp) == max_impostors == len(set(map(tuple, imp)))
    assert imp == sorted(imp)
    for (a, b), s in zip(imp, scores[~is_genuine].tolist(), strict=True):
        assert not expected[(a, b)][1]
        assert s == pytest.approx(expected[(a, b)][0], abs=1e-6)
    again = pair_scores(x, y, max_impostors=max_impostors, seed=3, return_pairs=True)[2]
    other = pair_scores(x, y, max_impostors=max_impostors, seed=4, return_pairs=True)[2]
    assert torch.equal(again, pairs) and not torch.equal(other, pairs)


def test_pair_scores_sample_is_uniform(gen):
    # 10 points, 2 classes of 5: 25 impostor pairs; sample 5 per seed: each pair equally often.
    x = torch.randn(10, 3, generator=gen)
    y = torch.tensor([0] * 5 + [1] * 5)
    counts = torch.zeros(10, 10)
    seeds = 300
    for seed in range(seeds):
        _, g, p = pair_scores(x, y, max_impostors=5, seed=seed, return_pairs=True)
        a, b = p[~g].T
        counts[a, b] += 1
    observed = counts[:5, 5:].flatten().numpy()
    assert observed.sum() == 5 * seeds and (counts[:5, :5] == 0).all()
    # Pearson chi-square against the uniform 1/25 per pair (24 degrees of freedom).
    assert chisquare(observed).pvalue > 1e-4


def test_pair_scores_never_builds_the_n_by_n_matrix(gen):
    # torch's profiler records every allocation: no matrix product may exceed the block budget.
    x = torch.randn(3000, 16, generator=gen)
    y = torch.randint(0, 300, (3000,), generator=gen)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        scores, _ = pair_scores(x, y, max_impostors=20_000, memory_limit_mb=1)
    products = [e.cpu_memory_usage for e in prof.events() if e.name in ("aten::mm", "aten::matmul")]
    assert products and max(products) <= 2**20  # an N x N float32 matrix would be 36 MB
    assert len(scores) > 20_000


def test_pair_scores_errors(gen):
    x = torch.randn(5, 3, generator=gen)
    with pytest.raises(ValueError, match="labels must have shape"):
        pair_scores(x, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="at least 2 rows"):
        pair_scores(x[:1], torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="embeddings contains NaN"):
        pair_scores(torch.full((5, 3), math.nan), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="all-zero row"):
        pair_scores(torch.zeros(5, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="max_impostors must be >= 1"):
        pair_scores(x, torch.arange(5), max_impostors=0)
