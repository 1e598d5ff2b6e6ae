"""Seeded evaluation protocols built from labelled test embeddings: open-set splits, templates.

Both functions are deterministic for a given ``seed`` and ``labels`` (a CPU ``torch.Generator``),
and vectorised: samples are ordered by (subject, a random key) once.
"""

from __future__ import annotations

import torch

from marginkit._validation import accepts_arrays, label_tensor, positive_float, positive_int


def _check(labels: object, seed: object) -> torch.Tensor:
    label_tensor(labels, "labels")
    assert isinstance(labels, torch.Tensor)
    if labels.dim() != 1 or labels.numel() == 0:
        raise ValueError(f"labels must be a non-empty 1-D tensor, got shape {tuple(labels.shape)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return labels.cpu()


def _shuffled_within_subjects(
    labels: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(subjects, counts, order, subject_of_sorted, position_within_subject)`` of a seeded order."""
    subjects, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    key = torch.argsort(torch.rand(labels.numel(), generator=gen))
    order = key[torch.argsort(inverse[key], stable=True)]  # by subject, randomly within
    subject = inverse[order]
    start = torch.cumsum(counts, 0) - counts
    position = torch.arange(labels.numel()) - start[subject]
    return subjects, counts, order, subject, position


@accepts_arrays(labels="int")
def open_set_split(
    labels: torch.Tensor, *, enrolled_fraction: float = 0.5, gallery_per_subject: int = 1, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split labelled samples into an open-set gallery and probe set, deterministically.

    A seeded random ``enrolled_fraction`` of the subjects (rounded; at least one, and at
    least one left out when the fraction is below 1 and there are two subjects or more) is
    enrolled: ``gallery_per_subject`` of each enrolled subject's samples (drawn at random) form
    the gallery, its remaining samples are *mated* probes. Every sample of the other
    subjects is a *non-mated* probe. An enrolled subject with no more samples than
    ``gallery_per_subject`` contributes no probe.

    Args:
        labels: ``[N]`` integer subject of each sample.
        enrolled_fraction: share of subjects enrolled, in ``(0, 1]`` (1: closed set).
        gallery_per_subject: gallery samples per enrolled subject (>= 1).
        seed: seed of the draws.

    Returns:
        ``(gallery_index, probe_index)``: int64 indices into ``labels``, ascending, disjoint,
        together covering every sample.

    Example:
        >>> import torch
        >>> g, p = open_set_split(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), seed=0)
        >>> len(g), len(p)
        (2, 6)
    """
    labels = _check(labels, seed)
    fraction = positive_float(enrolled_fraction, "enrolled_fraction")
    if fraction > 1:
        raise ValueError(f"enrolled_fraction must lie in (0, 1], got {fraction}")
    per_subject = positive_int(gallery_per_subject, "gallery_per_subject")
    gen = torch.Generator().manual_seed(seed)
    subjects, _, order, subject, position = _shuffled_within_subjects(labels, gen)
    s = subjects.numel()
    most = s - 1 if fraction < 1 and s >= 2 else s
    n_enrolled = min(max(1, round(fraction * s)), most)
    enrolled = torch.zeros(s, dtype=torch.bool)
    enrolled[torch.randperm(s, generator=gen)[:n_enrolled]] = True
    in_gallery = enrolled[subject] & (position < per_subject)
    return torch.sort(order[in_gallery]).values, torch.sort(order[~in_gallery]).values


@accepts_arrays(labels="int")
def random_templates(labels: torch.Tensor, *, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Group each subject's samples, in a seeded random order, into templates of ``size`` samples.

    The last template of a subject holds the remainder (``1..size`` samples). For the IJB-style
    protocol: ``template_features(emb, template_ids)`` then verification or search on templates.

    Returns:
        ``(template_ids, template_labels)``: ``[N]`` int64 template of each sample, numbered
        ``0..T-1`` by subject then draw order, and ``[T]`` the subject of each template.

    Example:
        >>> import torch
        >>> t, lab = random_templates(torch.tensor([4, 4, 4, 7]), size=2)
        >>> sorted(t.tolist()), lab.tolist()
        ([0, 0, 1, 2], [4, 4, 7])
    """
    labels = _check(labels, seed)
    size = positive_int(size, "size")
    gen = torch.Generator().manual_seed(seed)
    subjects, counts, order, subject, position = _shuffled_within_subjects(labels, gen)
    per_subject = (counts + size - 1) // size
    first = torch.cumsum(per_subject, 0) - per_subject
    template_ids = torch.empty_like(order)
    template_ids[order] = first[subject] + position // size
    return template_ids, torch.repeat_interleave(subjects, per_subject)
