import heapq
import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marginkit.data import PKSampler


def make_labels(sizes, seed=0, ids=None):
    """Labels with the given class sizes, arbitrary (also negative) ids, in a seeded random order."""
    ids = [7 * c - 3 for c in range(len(sizes))] if ids is None else ids
    labels = np.repeat(np.asarray(ids, dtype=np.int64), sizes)
    return labels[np.random.default_rng(seed).permutation(labels.size)]


def greedy_batch_count(chunks, p):
    """Independent reference: largest-remaining-first greedy (optimal for P distinct per batch)."""
    heap = [-m for m in chunks if m > 0]
    heapq.heapify(heap)
    count = 0
    while len(heap) >= p:
        taken = [heapq.heappop(heap) for _ in range(p)]
        count += 1
        for m in taken:
            if m + 1 < 0:
                heapq.heappush(heap, m + 1)
    return count


def all_ranks(labels, p, k, seed, epoch, replicas):
    out = []
    for r in range(replicas):
        sampler = PKSampler(labels, p, k, seed=seed, num_replicas=replicas, rank=r)
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        out.append(batches)
    return out


problems = st.lists(st.integers(1, 14), min_size=1, max_size=10).flatmap(
    lambda sizes: st.tuples(
        st.just(sizes),
        st.integers(1, len(sizes)),  # P
        st.integers(1, 5),  # K
        st.integers(0, 2**32),  # seed
        st.integers(0, 50),  # epoch
    )
)


def _feasible(sizes, p, k, replicas):
    chunks = [math.ceil(n / k) for n in sizes]
    return greedy_batch_count(chunks, p) // replicas > 0


@given(problems)
def test_every_batch_has_p_distinct_classes_of_k_and_length_matches(problem):
    sizes, p, k, seed, epoch = problem
    labels = make_labels(sizes, seed % 97)
    sampler = PKSampler(labels, p, k, seed=seed)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    assert len(batches) == len(sampler) > 0
    size_of = dict(Counter(labels.tolist()))
    for batch in batches:
        assert len(batch) == p * k
        blocks = labels[np.asarray(batch)].reshape(p, k)
        assert (blocks == blocks[:, :1]).all()  # class by class
        assert len(set(blocks[:, 0].tolist())) == p  # P distinct classes
        for j, cls in enumerate(blocks[:, 0].tolist()):
            block = batch[j * k : (j + 1) * k]
            if size_of[cls] >= k:  # replacement only inside classes smaller than K
                assert len(set(block)) == k
            else:
                assert set(block) == set(np.flatnonzero(labels == cls).tolist())


@given(problems)
def test_batch_count_is_optimal_and_coverage_is_exact(problem):
    sizes, p, k, seed, epoch = problem
    labels = make_labels(sizes, seed % 89)
    chunks = [math.ceil(n / k) for n in sizes]
    sampler = PKSampler(labels, p, k, seed=seed)
    assert sampler.total_batches == len(sampler) == greedy_batch_count(chunks, p)
    sampler.set_epoch(epoch)
    batches = np.asarray(list(sampler)).reshape(len(sampler), p, k)
    uses = Counter(np.asarray(batches).reshape(-1).tolist())
    batch_classes = labels[batches[:, :, 0]]
    for cls, n in Counter(labels.tolist()).items():
        members = np.flatnonzero(labels == cls)
        in_batches = int((batch_classes == cls).sum())
        visited = [i for i in members.tolist() if uses[i] > 0]
        # A class in b batches visits min(n, b K) of its samples: nothing is skipped that fits.
        assert len(visited) == min(n, in_batches * k)
        counts = [uses[i] for i in visited] or [0]
        if n >= k:
            assert max(counts) <= 2
            assert sum(c == 2 for c in counts) <= max(0, in_batches * k - n)
        else:
            assert max(counts) <= math.ceil(k / n)
    if sum(chunks) == sampler.total_batches * p:  # nothing had to be dropped: full coverage
        assert set(uses) == set(range(labels.size))


@given(problems, st.integers(1, 4))
def test_replicas_get_disjoint_equal_shares_of_the_same_plan(problem, replicas):
    sizes, p, k, seed, epoch = problem
    labels = make_labels(sizes, seed % 83)
    if not _feasible(sizes, p, k, replicas):
        with pytest.raises(ValueError, match="num_replicas"):
            PKSampler(labels, p, k, seed=seed, num_replicas=replicas)
        return
    per_rank = all_ranks(labels, p, k, seed, epoch, replicas)
    assert len({len(b) for b in per_rank}) == 1  # same number per rank
    plan = PKSampler(labels, p, k, seed=seed).epoch_batches(epoch)
    n = len(per_rank[0])
    assert n == plan.shape[0] // replicas
    seen = [tuple(batch) for batches in per_rank for batch in batches]
    assert sorted(seen) == sorted(tuple(row) for row in plan[: n * replicas].tolist())
    for r, batches in enumerate(per_rank):  # rank r owns plan rows r, r + R, ...
        assert batches == plan[r : n * replicas : replicas].tolist()


@given(problems)
def test_deterministic_per_seed_and_epoch_and_label_container(problem):
    sizes, p, k, seed, epoch = problem
    labels = make_labels(sizes, seed % 79)
    a = PKSampler(labels, p, k, seed=seed)
    b = PKSampler(torch.from_numpy(labels), p, k, seed=seed)
    c = PKSampler(labels.tolist(), p, k, seed=seed)
    for s in (a, b, c):
        s.set_epoch(epoch)
    first = list(a)
    assert first == list(a) == list(b) == list(c)


def test_epochs_and_seeds_change_the_plan():
    labels = make_labels([20] * 30, seed=1)
    sampler = PKSampler(labels, 6, 4, seed=3)
    plans = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        plans.append(list(sampler))
    other = PKSampler(labels, 6, 4, seed=4)
    assert plans[0] != plans[1] != plans[2]
    assert list(other) != plans[0]
    sampler.set_epoch(1)
    assert list(sampler) == plans[1]  # going back reproduces


def test_class_cooccurrences_mix_within_an_epoch():
    # 100 classes × 60 samples, P=8, K=4: each class is in 15 batches with 7 partners each. Under
    # uniformly random batches it meets ~65 distinct classes; laying classes out contiguously and
    # reading columns (without per-row permutations) gives only ~14-21.
    labels = make_labels([60] * 100, seed=0)
    sampler = PKSampler(labels, 8, 4, seed=0)
    classes = labels[np.asarray(list(sampler))[:, ::4]]
    partners = {c: set() for c in np.unique(labels).tolist()}
    for row in classes.tolist():
        for a, b in itertools.permutations(row, 2):
            partners[a].add(b)
    distinct = np.mean([len(s) for s in partners.values()])
    assert distinct > 55


def test_tiny_example_and_dataloader_integration():
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    sampler = PKSampler(labels, classes_per_batch=2, samples_per_class=2)
    data = torch.utils.data.TensorDataset(torch.arange(9.0), labels)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    got = [y for _, y in loader]
    assert len(got) == len(sampler) == 2  # ceil(3/2) + ceil(2/2) + ceil(4/2) = 5 chunks -> 2 batches
    for y in got:
        assert y.shape == (4,) and y[0] == y[1] and y[2] == y[3] and y[0] != y[2]


def test_imbalanced_classes_cap_the_big_class():
    # One class with 40 samples and 5 singletons, P=2, K=2: the big class has 20 chunks, the
    # others 1 each; at most 5 batches (B with min(20, B) + 5 >= 2B), the big class in all of them.
    labels = make_labels([40, 1, 1, 1, 1, 1], seed=2)
    sampler = PKSampler(labels, 2, 2, seed=0)
    assert len(sampler) == 5
    batches = np.asarray(list(sampler))
    big = Counter(labels.tolist()).most_common(1)[0][0]
    assert ((labels[batches] == big).sum(axis=1) == 2).all()


def test_large_labels_smoke():
    labels = np.random.default_rng(0).integers(0, 10_000, size=200_000)
    sampler = PKSampler(labels, 16, 4, seed=1, num_replicas=2, rank=1)
    batches = np.asarray(list(sampler))
    assert batches.shape == (len(sampler), 64)
    blocks = labels[batches].reshape(-1, 16, 4)
    assert (blocks == blocks[..., :1]).all()
    assert (np.sort(blocks[..., 0], axis=1)[:, 1:] != np.sort(blocks[..., 0], axis=1)[:, :-1]).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"labels": [0.5, 1.0]}, TypeError, "labels must hold integer"),
        ({"labels": torch.ones(4)}, TypeError, "labels must hold integer"),
        ({"labels": torch.zeros(2, 2, dtype=torch.long)}, ValueError, "labels must be 1-D"),
        ({"labels": [True, False]}, TypeError, "labels must hold integer"),
        ({"labels": "0011"}, TypeError, "labels must be"),
        ({"labels": []}, ValueError, "classes_per_batch must be <= the number of distinct classes"),
        ({"classes_per_batch": 4}, ValueError, r"classes_per_batch must be <= .*\(3\)"),
        ({"classes_per_batch": 0}, ValueError, "classes_per_batch must be >= 1"),
        ({"classes_per_batch": 2.0}, TypeError, "classes_per_batch must be an int"),
        ({"samples_per_class": 0}, ValueError, "samples_per_class must be >= 1"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
        ({"num_replicas": 0}, ValueError, "num_replicas must be >= 1"),
        ({"num_replicas": 2, "rank": 2}, ValueError, r"rank must lie in \[0, num_replicas=2\)"),
        ({"rank": -1}, ValueError, "rank must be >= 0"),
        ({"num_replicas": 50}, ValueError, "num_replicas=50 is more than"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    args = {"labels": [0, 0, 1, 1, 2, 2], "classes_per_batch": 2, "samples_per_class": 2} | kwargs
    with pytest.raises(error, match=match):
        PKSampler(**args)


def test_set_epoch_validates():
    sampler = PKSampler([0, 1], 2, 1)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        sampler.set_epoch(-1)
    with pytest.raises(TypeError, match="epoch must be an int"):
        sampler.set_epoch(1.5)
