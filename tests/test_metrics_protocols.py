"""Seeded open-set splits, random templates and IJB template pooling against loops."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marginkit.metrics import open_set_split, random_templates, template_features


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 200),
    n_subjects=st.integers(1, 30),
    fraction=st.sampled_from([0.1, 0.5, 0.9, 1.0]),
    per_subject=st.integers(1, 4),
)
def test_open_set_split_is_a_seeded_partition(seed, n, n_subjects, fraction, per_subject):
    labels = torch.randint(0, n_subjects, (n,), generator=torch.Generator().manual_seed(seed)) * 3 - 7
    gallery, probes = open_set_split(
        labels, enrolled_fraction=fraction, gallery_per_subject=per_subject, seed=seed
    )
    assert sorted(gallery.tolist() + probes.tolist()) == list(range(n))  # disjoint and covering
    assert gallery.tolist() == sorted(gallery.tolist()) and probes.tolist() == sorted(probes.tolist())
    subjects = set(labels.tolist())
    enrolled = set(labels[gallery].tolist())
    expected = min(
        max(1, round(fraction * len(subjects))),
        len(subjects) - 1 if fraction < 1 and len(subjects) >= 2 else len(subjects),
    )
    assert len(enrolled) == expected
    for s in subjects:
        count = int((labels == s).sum())
        in_gallery = int((labels[gallery] == s).sum())
        assert in_gallery == (min(per_subject, count) if s in enrolled else 0)
    again = open_set_split(labels, enrolled_fraction=fraction, gallery_per_subject=per_subject, seed=seed)
    assert torch.equal(again[0], gallery) and torch.equal(again[1], probes)


def test_open_set_split_depends_on_the_seed():
    labels = torch.arange(100).repeat_interleave(3)
    splits = {tuple(open_set_split(labels, seed=s)[0].tolist()) for s in range(5)}
    assert len(splits) == 5
    gallery, probes = open_set_split(labels, seed=0)
    assert len(gallery) == 50 and len(probes) == 250  # 50 enrolled x 1, the rest probes
    mated = torch.isin(labels[probes], labels[gallery])
    assert int(mated.sum()) == 100 and int((~mated).sum()) == 150


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 150),
    n_subjects=st.integers(1, 20),
    size=st.integers(1, 7),
)
def test_random_templates(seed, n, n_subjects, size):
    labels = torch.randint(0, n_subjects, (n,), generator=torch.Generator().manual_seed(seed))
    tid, tlab = random_templates(labels, size=size, seed=seed)
    assert tid.shape == labels.shape and sorted(set(tid.tolist())) == list(range(len(tlab)))
    for t in range(len(tlab)):
        members = labels[tid == t]
        assert 1 <= len(members) <= size and bool((members == tlab[t]).all())
    for s in set(labels.tolist()):  # ceil(count / size) templates per subject, all but one full
        count = int((labels == s).sum())
        sizes = sorted(int((tid == t).sum()) for t in torch.nonzero(tlab == s)[:, 0].tolist())
        assert (
            len(sizes) == math.ceil(count / size)
            and sum(sizes) == count
            and all(z == size for z in sizes[1:])
        )
    assert torch.equal(random_templates(labels, size=size, seed=seed)[0], tid)


def _pool_reference(emb, template_ids, media_ids):
    x = emb.double().numpy()
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    out = {}
    for t in sorted(set(template_ids.tolist())):
        rows = [i for i in range(len(x)) if template_ids[i] == t]
        media = sorted({int(media_ids[i]) for i in rows})
        means = [np.mean([x[i] for i in rows if media_ids[i] == m], axis=0) for m in media]
        f = np.mean(means, axis=0)
        out[t] = f / np.linalg.norm(f)
    return out


@pytest.mark.parametrize("with_media", [True, False])
def test_template_features_equal_the_ijb_loop(gen, with_media):
    emb = torch.randn(120, 6, generator=gen, dtype=torch.float64) * torch.rand(
        120, 1, generator=gen, dtype=torch.float64
    )
    template_ids = torch.randint(0, 15, (120,), generator=gen) * 10 + 3
    media_ids = torch.randint(0, 8, (120,), generator=gen) if with_media else torch.arange(120)
    ids, feats = template_features(emb, template_ids, media_ids if with_media else None)
    ref = _pool_reference(emb, template_ids, media_ids)
    assert ids.tolist() == list(ref)
    np.testing.assert_allclose(feats.numpy(), np.stack(list(ref.values())), rtol=0, atol=1e-12)
    perm = torch.randperm(120, generator=gen)  # row order and row scale do not matter
    ids2, feats2 = template_features(
        emb[perm] * 7.0, template_ids[perm], media_ids[perm] if with_media else None
    )
    assert torch.equal(ids2, ids)
    torch.testing.assert_close(feats2, feats, rtol=0, atol=1e-12)


def test_template_pooling_weighs_media_not_frames():
    # A template of one still (direction e0) and one 3-frame video (direction e1): the media count
    # equally, so the template lies at 45 degrees, not at the frame average's 71.6 degrees.
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 2.0], [0.0, 3.0]])
    _, f = template_features(e, torch.zeros(4, dtype=torch.long), torch.tensor([0, 1, 1, 1]))
    torch.testing.assert_close(f, torch.tensor([[1.0, 1.0]]) / math.sqrt(2))
    _, frames = template_features(e, torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(frames, torch.tensor([[1.0, 3.0]]) / math.sqrt(10))


def test_protocol_errors(gen):
    labels = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="enrolled_fraction must lie in"):
        open_set_split(labels, enrolled_fraction=1.5)
    with pytest.raises(ValueError, match="enrolled_fraction must be a finite number > 0"):
        open_set_split(labels, enrolled_fraction=0.0)
    with pytest.raises(ValueError, match="gallery_per_subject must be >= 1"):
        open_set_split(labels, gallery_per_subject=0)
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        open_set_split(labels.float())
    with pytest.raises(ValueError, match="labels must be a non-empty 1-D tensor"):
        random_templates(torch.zeros(0, dtype=torch.long), size=2)
    with pytest.raises(ValueError, match="size must be >= 1"):
        random_templates(labels, size=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        random_templates(labels, size=2, seed=1.5)
    emb = torch.randn(4, 3, generator=gen)
    with pytest.raises(ValueError, match="template_ids must have shape"):
        template_features(emb, labels[:3])
    with pytest.raises(ValueError, match="media_ids must have shape"):
        template_features(emb, labels, labels[:2])
    with pytest.raises(ValueError, match="all-zero row"):
        template_features(torch.zeros(4, 3), labels)
    with pytest.raises(ValueError, match="emb contains NaN"):
        template_features(torch.full((4, 3), math.nan), labels)
    with pytest.raises(ValueError, match="template 0: its media features cancel out"):
        template_features(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]), torch.tensor([0, 0]))


def test_the_docs_example_runs_and_its_numbers_make_sense(capsys):
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "knn_and_metrics.md").read_text()
    section = text[text.index("## Evaluation protocols of the field") :]
    code = section[
        section.index("```python") + len("```python") : section.index("```\n", section.index("```python") + 9)
    ]
    ns: dict = {}
    exec(compile(code, "docs/knn_and_metrics.md", "exec"), ns)
    assert ns["ident"]["num_mated"] == 30 * 6 and ns["ident"]["num_nonmated"] == 30 * 8
    assert ns["low"] <= ns["ver"]["eer"] <= ns["high"]
    assert len(ns["t_scores"]) == len(ns["ids"]) * (len(ns["ids"]) - 1) // 2
    c, mc, dcf = map(float, capsys.readouterr().out.split())
    assert 0 <= mc <= c < 1 and 0 < dcf <= 1  # calibrated on held-out subjects: informative, not perfect
