"""Open-set identification against a float64 loop over probes and thresholds, and hand-made cases."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marginkit.metrics import identification_metrics, search_gallery


def _score(p, g, metric):
    if metric == "cosine":
        return float(p @ g / (np.linalg.norm(p) * np.linalg.norm(g)))
    return -float(np.sqrt(((p - g) ** 2).sum()))


def _reference(probes, probe_labels, gallery, gallery_labels, ranks, fpirs, metric):
    """Every definition spelled out: loops over probes, labels and candidate thresholds, float64."""
    probes, gallery = probes.double().numpy(), gallery.double().numpy()
    labels = sorted(set(gallery_labels.tolist()))
    mated, rank, own, top = [], [], [], []
    for p, y in zip(probes, probe_labels.tolist(), strict=True):
        label_score = {}
        for g, lab in zip(gallery, gallery_labels.tolist(), strict=True):
            label_score[lab] = max(label_score.get(lab, -math.inf), _score(p, g, metric))
        top.append(max(label_score.values()))
        if y in label_score:
            mated.append(True)
            own.append(label_score[y])
            rank.append(sum(1 for lab in labels if label_score[lab] >= label_score[y]))  # ties count against
        else:
            mated.append(False)
            own.append(-math.inf)
            rank.append(0)
    m_rank = [r for r, m in zip(rank, mated, strict=True) if m]
    m_own = [o for o, m in zip(own, mated, strict=True) if m]
    nonmated_top = [t for t, m in zip(top, mated, strict=True) if not m]
    if not m_rank:
        return {"num_mated": 0}, (mated, rank, own, top)
    cmc = {k: (np.mean([r <= k for r in m_rank]) if k <= len(labels) else None) for k in ranks}
    dir_at, thresholds = {}, {}
    for f in fpirs:
        n = len(nonmated_top)
        best = None
        if n and f * n >= 1:
            for t in sorted(set(nonmated_top)):  # ascending: the first admissible is the smallest
                if sum(x > t for x in nonmated_top) <= f * n * (1 + 1e-12):
                    best = t
                    break
        thresholds[f] = best
        dir_at[f] = (
            None
            if best is None
            else np.mean([r == 1 and o > best for r, o in zip(m_rank, m_own, strict=True)])
        )
    return {
        "cmc": cmc,
        "dir_at_fpir": dir_at,
        "thresholds": thresholds,
        "num_mated": len(m_rank),
        "num_nonmated": len(nonmated_top),
    }, (mated, rank, own, top)


def _problem(seed, n_probe, n_gallery, n_labels, dim, integer):
    g = torch.Generator().manual_seed(seed)
    if integer:  # small integers: exact distances in float64, hence many exact ties
        gallery = torch.randint(-2, 3, (n_gallery, dim), generator=g).double()
        probes = torch.randint(-2, 3, (n_probe, dim), generator=g).double()
    else:
        gallery = torch.randn(n_gallery, dim, generator=g, dtype=torch.float64)
        probes = torch.randn(n_probe, dim, generator=g, dtype=torch.float64)
    gallery_labels = torch.randint(0, n_labels, (n_gallery,), generator=g)
    probe_labels = torch.randint(0, n_labels + 3, (n_probe,), generator=g)  # some labels unenrolled
    return probes, probe_labels, gallery, gallery_labels


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_probe=st.integers(1, 60),
    n_gallery=st.integers(1, 40),
    n_labels=st.integers(1, 12),
    metric=st.sampled_from(["cosine", "l2"]),
    integer=st.booleans(),
    limit=st.sampled_from([1e-4, 256.0]),
)
def test_matches_the_reference_loop(seed, n_probe, n_gallery, n_labels, metric, integer, limit):
    # Exact ties need exact scores: integer rows under l2 (cosines of them are rounded differently
    # by a matrix product and by the reference's loop).
    integer = integer and metric == "l2"
    probes, probe_labels, gallery, gallery_labels = _problem(seed, n_probe, n_gallery, n_labels, 3, integer)
    ranks, fpirs = (1, 2, 5, 10), (0.5, 0.3, 0.1, 0.01)
    ref, (mated, rank, own, top) = _reference(
        probes, probe_labels, gallery, gallery_labels, ranks, fpirs, metric
    )
    if ref["num_mated"] == 0:
        with pytest.raises(ValueError, match="no probe label occurs in gallery_labels"):
            identification_metrics(probes, probe_labels, gallery, gallery_labels, metric=metric)
        return
    search = search_gallery(
        probes, probe_labels, gallery, gallery_labels, metric=metric, memory_limit_mb=limit
    )
    assert search.mated.tolist() == mated and search.rank.tolist() == rank
    np.testing.assert_allclose(search.own_score.numpy(), own, rtol=0, atol=1e-12)
    np.testing.assert_allclose(search.top_score.numpy(), top, rtol=0, atol=1e-12)
    m = search.metrics(ranks, fpirs)
    assert m["cmc"] == ref["cmc"]
    assert m["dir_at_fpir"] == ref["dir_at_fpir"]
    assert m["num_mated"] == ref["num_mated"] and m["num_nonmated"] == ref["num_nonmated"]
    for f, t in ref["thresholds"].items():
        assert (m["thresholds"][f] is None) == (t is None)
        if t is not None:
            assert m["thresholds"][f] == pytest.approx(t, abs=1e-12)


def test_hand_made_ties_unenrolled_and_several_entries_per_label():
    e = torch.eye(3, dtype=torch.float64)
    #   label 0 has two entries (e0 and e1), label 1 one (e2): a label scores with its best entry.
    gallery = torch.stack([e[0], e[1], e[2]])
    gallery_labels = torch.tensor([0, 0, 1])
    probes = torch.stack(
        [
            e[1] + 0.1 * e[2],  # label 0 via its second entry: rank 1
            e[0] + e[2],  # label 1, tied with label 0: rank 2 (ties count against), not identified
            e[2] + 0.2 * e[0],  # label 1: rank 1
            e[0] + 0.05 * e[2],  # label 9 is not enrolled: non-mated, top score ~0.999
            e[2] + 0.5 * e[1],  # label 8: non-mated, top score ~0.894
        ]
    )
    labels = torch.tensor([0, 1, 1, 9, 8])
    s = search_gallery(probes, labels, gallery, gallery_labels)
    assert s.mated.tolist() == [True, True, True, False, False]
    assert s.rank.tolist() == [1, 2, 1, 0, 0]
    assert s.own_score[0] == pytest.approx(1 / math.sqrt(1.01))  # the best of label 0's two entries
    m = s.metrics(ranks=(1, 2, 3), fpir=(0.5, 0.4))
    assert m["cmc"] == {1: 2 / 3, 2: 1.0, 3: None}  # 2 gallery labels: rank 3 is not measurable
    assert m["num_mated"] == 3 and m["num_nonmated"] == 2  # denominators: mated, non-mated counts
    # FPIR 0.5 of 2 non-mated probes allows one above the threshold: t = the smaller top score.
    assert m["thresholds"][0.5] == pytest.approx(1 / math.sqrt(1.25))
    assert m["dir_at_fpir"][0.5] == 2 / 3  # both rank-1 probes score above 0.894
    assert m["dir_at_fpir"][0.4] is None and m["thresholds"][0.4] is None  # 0.4 * 2 < 1
    ranks, rates = s.cmc_curve()
    assert ranks.tolist() == [1, 2] and rates.tolist() == [2 / 3, 1.0]


def test_closed_set_has_no_fpir_and_label_order_does_not_matter(gen):
    gallery = torch.randn(6, 4, generator=gen)
    labels = torch.tensor([5, 3, 3, 9, 5, 1])
    probes = gallery + 0.3 * torch.randn(6, 4, generator=gen)
    m = identification_metrics(probes, labels, gallery, labels, ranks=(1, 4), fpir=(0.1,))
    assert m["num_nonmated"] == 0 and m["dir_at_fpir"] == {0.1: None} and m["thresholds"] == {0.1: None}
    assert m["cmc"][4] == 1.0
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    again = identification_metrics(probes, labels, gallery[perm], labels[perm], ranks=(1, 4), fpir=(0.1,))
    assert again == m


def test_curves_agree_with_the_summary(gen):
    probes, probe_labels, gallery, gallery_labels = _problem(3, 400, 60, 20, 8, False)
    s = search_gallery(probes, probe_labels, gallery, gallery_labels)
    m = s.metrics(ranks=(1, 3, 7), fpir=(0.2, 0.05, 0.01))
    ranks, rates = s.cmc_curve()
    assert ranks.tolist() == list(range(1, s.num_labels + 1)) and rates[-1] == 1.0
    assert bool((rates[1:] >= rates[:-1]).all())
    for k in (1, 3, 7):
        assert rates[k - 1] == pytest.approx(m["cmc"][k], abs=1e-15)
    assert s.cmc_curve(max_rank=3)[1].tolist() == rates[:3].tolist()
    full = s.det_curve(num_points=None)
    nm_top = s.top_score[~s.mated]
    hits = s.mated & (s.rank == 1)
    for t, fpir, fnir in zip(*(full[k].tolist() for k in ("threshold", "fpir", "fnir")), strict=True):
        assert fpir == float((nm_top > t).double().mean())
        assert fnir == pytest.approx(1 - float((hits & (s.own_score > t)).sum()) / s.num_mated, abs=1e-15)
    assert m["dir_at_fpir"][0.01] is None  # 52 non-mated probes cannot resolve 1 %
    for f, d in m["dir_at_fpir"].items():  # the summary's operating points lie on the curve
        if d is None:
            continue
        i = int(torch.nonzero(full["threshold"] == m["thresholds"][f])[0, 0])
        assert full["fpir"][i] <= f and full["fnir"][i] == pytest.approx(1 - d, abs=1e-15)
    few = s.det_curve(num_points=20)
    assert len(few["threshold"]) <= 22 and set(few["threshold"].tolist()) <= set(full["threshold"].tolist())


def test_errors(gen):
    g = torch.randn(4, 3, generator=gen)
    lab = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="probe_labels must have shape"):
        identification_metrics(g, lab[:3], g, lab)
    with pytest.raises(ValueError, match="gallery_labels must have shape"):
        identification_metrics(g, lab, g, lab[:2])
    with pytest.raises(ValueError, match="probe_emb has dimension 2 but gallery_emb has 3"):
        identification_metrics(g[:, :2], lab, g, lab)
    with pytest.raises(ValueError, match="probe_emb contains NaN"):
        identification_metrics(torch.full((4, 3), math.nan), lab, g, lab)
    with pytest.raises(ValueError, match="fpir must lie in"):
        identification_metrics(g, lab, g, lab, fpir=(1.0,))
    with pytest.raises(ValueError, match="fpir must lie in"):
        identification_metrics(g, lab, g, lab, fpir=(0.0,))
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        identification_metrics(g, lab, g, lab, ranks=(0,))
    with pytest.raises(ValueError, match="metric must be one of"):
        identification_metrics(g, lab, g, lab, metric="dot")
    with pytest.raises(ValueError, match="no probe label occurs"):
        identification_metrics(g, lab + 10, g, lab)
    with pytest.raises(ValueError, match="every probe is mated"):
        search_gallery(g, lab, g, lab).det_curve()
