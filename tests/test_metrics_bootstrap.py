"""Subject-bootstrap intervals against the bootstrap samples built explicitly by repeating pairs."""

import math

import numpy as np
import pytest
import torch

from marginkit.metrics import pair_scores, verification_metrics
from marginkit.metrics.bootstrap import subject_multiplicities


def _embeddings(gen, subjects, per_subject, spread=0.8, subject_effect=0.0):
    centres = torch.randn(subjects, 8, generator=gen, dtype=torch.float64)
    labels = torch.arange(subjects).repeat_interleave(per_subject)
    # A per-subject noise level: pairs of one subject share it, so they are dependent.
    noise = spread * (1 + subject_effect * torch.rand(subjects, 1, generator=gen, dtype=torch.float64))
    x = centres[labels] + noise[labels] * torch.randn(len(labels), 8, generator=gen, dtype=torch.float64)
    return x, labels


def _explicit_replicates(scores, is_genuine, groups, fars, replicates, seed):
    """Each replicate built as data: every pair repeated by how many copies of it the draw creates."""
    subjects, codes = torch.unique(groups, return_inverse=True)
    out = []
    for m in subject_multiplicities(subjects.numel(), replicates, seed):
        a, b = codes[:, 0], codes[:, 1]
        repeat = torch.where(a == b, m[a], m[a] * m[b])
        s = torch.repeat_interleave(scores, repeat)
        g = torch.repeat_interleave(is_genuine, repeat)
        if not bool(g.any()) or bool(g.all()):
            continue
        v = verification_metrics(s, g, fars)
        out.append(v)
    return out


@pytest.mark.parametrize("one_column", [False, True])
def test_intervals_equal_percentiles_of_explicit_replicates(gen, one_column):
    x, labels = _embeddings(gen, 12, 4)
    scores, is_genuine, pairs = pair_scores(x, labels, return_pairs=True)
    groups = labels[pairs]
    fars = (0.3, 0.1, 0.01, 1e-3)
    m = verification_metrics(scores, is_genuine, fars, bootstrap=40, groups=groups, seed=7)
    ci = m["confidence_intervals"]
    ref = _explicit_replicates(scores, is_genuine, groups, fars, 40, seed=7)
    assert ci["valid_replicates"] == len(ref) and ci["replicates"] == 40 and ci["num_subjects"] == 12
    assert ci["level"] == 0.95 and ci["seed"] == 7
    eers = [r["eer"] for r in ref]
    np.testing.assert_allclose(ci["eer"], np.percentile(eers, [2.5, 97.5]), rtol=0, atol=1e-12)
    for far in fars:
        tars = [r["tar_at_far"][far] for r in ref]
        if any(t is None for t in tars):
            assert ci["tar_at_far"][far] is None
        else:
            np.testing.assert_allclose(
                ci["tar_at_far"][far], np.percentile(tars, [2.5, 97.5]), rtol=0, atol=1e-12
            )
    assert ci["tar_at_far"][0.1] is not None and ci["tar_at_far"][1e-3] is None  # ~1000 impostor pairs
    if one_column:  # one subject per pair (here: the first side's) is also accepted
        m1 = verification_metrics(scores, is_genuine, fars, bootstrap=5, groups=groups[:, 0], seed=1)
        assert m1["confidence_intervals"]["valid_replicates"] <= 5


def test_interval_brackets_the_estimate_and_narrows_with_more_subjects(gen):
    widths = []
    for subjects in (10, 80):
        x, labels = _embeddings(gen, subjects, 5)
        scores, is_genuine, pairs = pair_scores(x, labels, return_pairs=True)
        m = verification_metrics(scores, is_genuine, (0.01,), bootstrap=200, groups=labels[pairs], seed=0)
        lo, hi = m["confidence_intervals"]["eer"]
        assert lo <= m["eer"] <= hi
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 1.5


def test_subjects_not_pairs_are_resampled(gen):
    # With a strong subject effect, resampling pairs as if independent gives a far narrower (wrong)
    # interval than resampling subjects.
    x, labels = _embeddings(gen, 30, 6, spread=0.6, subject_effect=3.0)
    scores, is_genuine, pairs = pair_scores(x, labels, return_pairs=True)
    by_subject = verification_metrics(scores, is_genuine, bootstrap=200, groups=labels[pairs], seed=0)
    by_pair = verification_metrics(
        scores, is_genuine, bootstrap=200, groups=torch.arange(len(scores)), seed=0
    )
    w_subject = np.diff(by_subject["confidence_intervals"]["eer"])[0]
    w_pair = np.diff(by_pair["confidence_intervals"]["eer"])[0]
    assert w_subject > 2 * w_pair


@pytest.mark.slow
def test_coverage_of_the_subject_bootstrap():
    # Simulated populations whose EER is known from a very large sample of subjects: the 90 %
    # interval from 40 subjects must cover it about 90 % of the time.
    gen = torch.Generator().manual_seed(11)
    x, labels = _embeddings(gen, 2000, 3, spread=0.9, subject_effect=1.0)
    scores, is_genuine = pair_scores(x, labels, max_impostors=2_000_000, seed=0)
    true_eer = verification_metrics(scores, is_genuine)["eer"]
    covered, runs = 0, 30
    for _ in range(runs):
        x, labels = _embeddings(gen, 40, 3, spread=0.9, subject_effect=1.0)
        scores, is_genuine, pairs = pair_scores(x, labels, return_pairs=True)
        ci = verification_metrics(
            scores, is_genuine, bootstrap=150, groups=labels[pairs], confidence=0.9, seed=0
        )["confidence_intervals"]["eer"]
        covered += ci[0] <= true_eer <= ci[1]
    assert covered >= 22, covered  # 29 measured; binomial(30, 0.9) gives <= 21 with p = 0.002


def test_errors(gen):
    s, g = torch.tensor([0.1, 0.5, 0.6, 0.9]), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match="bootstrap needs groups"):
        verification_metrics(s, g, bootstrap=10)
    with pytest.raises(ValueError, match=r"groups must have shape \(4, 2\)"):
        verification_metrics(s, g, bootstrap=10, groups=torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="groups must be an integer tensor"):
        verification_metrics(s, g, bootstrap=10, groups=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="bootstrap must be >= 0"):
        verification_metrics(s, g, bootstrap=-1, groups=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="confidence must lie in"):
        verification_metrics(s, g, bootstrap=3, groups=torch.zeros(4, dtype=torch.long), confidence=1.0)
    with pytest.raises(TypeError, match="seed must be an int"):
        verification_metrics(s, g, bootstrap=3, groups=torch.zeros(4, dtype=torch.long), seed=math.pi)
