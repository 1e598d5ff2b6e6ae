"""The open-set identity simulator and the ``identities`` data set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from marginkit.data import IdentitySimulator, load_dataset


def test_splits_have_disjoint_identities_and_label_ranges():
    sim = IdentitySimulator(dim=16, seed=3)
    parts = sim.splits(num_train_identities=30, num_val_identities=7, num_test_identities=11)
    train, val, test = parts["train"], parts["val"], parts["test"]
    assert set(train.y.tolist()) == set(range(30))
    assert set(val.y.tolist()) == set(range(30, 37))
    assert set(test.y.tolist()) == set(range(37, 48))
    assert train.x.shape == (30 * 20, 16) and test.x.shape == (11 * 10, 16)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64
    # the latent identities themselves are distinct draws, far apart on the scale of the latents
    lat = np.concatenate([train.identity_latents, val.identity_latents, test.identity_latents])
    d = np.linalg.norm(lat[:, None] - lat[None], axis=-1) + np.eye(len(lat)) * 1e9
    assert d.min() > 0.5


def test_deterministic_per_seed_and_different_across_seeds():
    a = IdentitySimulator(seed=1).sample("test", 4, 3)
    b = IdentitySimulator(seed=1).sample("test", 4, 3)
    c = IdentitySimulator(seed=2).sample("test", 4, 3)
    np.testing.assert_array_equal(a.x, b.x)
    assert not np.allclose(a.x, c.x)
    # a split's stream does not depend on how many samples other splits drew
    sim = IdentitySimulator(seed=1)
    sim.sample("train", 50, 50)
    np.testing.assert_array_equal(sim.sample("test", 4, 3).x, a.x)


def test_without_nuisance_illumination_and_noise_samples_of_an_identity_coincide():
    sim = IdentitySimulator(dim=8, nuisance_strength=0, illumination=0, noise=0, seed=0)
    s = sim.sample("train", 5, 4)
    per_identity = s.x.reshape(5, 4, 8)
    np.testing.assert_allclose(
        per_identity, np.broadcast_to(per_identity[:, :1], per_identity.shape), atol=1e-6
    )
    assert np.linalg.norm(per_identity[0, 0] - per_identity[1, 0]) > 0.1


def test_knobs_increase_within_identity_spread():
    def spread(**kw):
        s = IdentitySimulator(dim=32, seed=0, **kw).sample("train", 20, 10)
        x = s.x.reshape(20, 10, 32)
        return float(((x - x.mean(1, keepdims=True)) ** 2).sum(-1).mean())

    base = {"nuisance_strength": 0.5, "illumination": 0.1, "noise": 0.1}
    s0 = spread(**base)
    assert spread(**{**base, "nuisance_strength": 2.0}) > 2 * s0
    assert spread(**{**base, "noise": 1.0}) > 2 * s0
    assert spread(**{**base, "illumination": 0.8}) > s0


def test_render_is_batched_nonlinear_and_checks_shapes():
    sim = IdentitySimulator(dim=12, identity_dim=5, nuisance_dim=3, seed=0)
    gen = np.random.default_rng(0)
    u, v = gen.normal(size=(6, 5)), gen.normal(size=(6, 3))
    batched = sim.render(u, v)
    rows = np.stack([sim.render(u[i : i + 1], v[i : i + 1])[0] for i in range(6)])
    np.testing.assert_allclose(batched, rows, rtol=1e-12, atol=1e-12)
    # not affine: R(a) + R(b) != R(a + b) + R(0)
    zero_u, zero_v = np.zeros((1, 5)), np.zeros((1, 3))
    lhs = sim.render(u[:1], v[:1]) + sim.render(u[1:2], v[1:2])
    rhs = sim.render(u[:1] + u[1:2], v[:1] + v[1:2]) + sim.render(zero_u, zero_v)
    assert np.abs(lhs - rhs).max() > 0.1
    with pytest.raises(ValueError, match=r"identity_latents must have shape \[N, 5\]"):
        sim.render(np.zeros((2, 4)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="nuisance_latents must have shape"):
        sim.render(np.zeros((2, 5)), np.zeros((3, 3)))


def test_bad_knobs():
    with pytest.raises(ValueError, match="noise must be a finite number >= 0"):
        IdentitySimulator(noise=-1)
    with pytest.raises(ValueError, match="dim must be >= 1"):
        IdentitySimulator(dim=0)
    with pytest.raises(ValueError, match="split must be one of"):
        IdentitySimulator().sample("holdout", 2, 2)
    with pytest.raises(ValueError, match="num_test_identities must be >= 2"):
        IdentitySimulator().splits(num_test_identities=1)


def _precision_at_1(x: torch.Tensor, y: torch.Tensor) -> float:
    x = torch.nn.functional.normalize(x.double(), dim=1)
    s = x @ x.T
    s.fill_diagonal_(-2)
    return float((y[s.argmax(1)] == y).double().mean())


def test_identities_dataset_is_open_set():
    data = load_dataset("identities", num_train_identities=40, num_val_identities=10, num_test_identities=20)
    assert data.open_set and data.class_names is None and data.num_classes == 40
    assert data.input_shape == (64,) and data.kind == "vector" and data.mean is None
    assert set(data.train.y.tolist()) == set(range(40))
    assert int(data.val.y.min()) >= 40 and int(data.test.y.min()) >= 50
    assert not set(data.test.y.tolist()) & set(data.train.y.tolist())
    assert "SIMULATION" in data.info["source"]
    # raw inputs: identities are findable but far from trivially so (defaults' difficulty)
    p1 = _precision_at_1(data.test.x, data.test.y)
    assert 1 / 20 * 3 < p1 < 0.9


def test_identities_train_per_class_and_determinism():
    kw = {"num_train_identities": 10, "num_val_identities": 3, "num_test_identities": 4}
    a = load_dataset("identities", train_per_class=5, seed=1, **kw)
    b = load_dataset("identities", train_per_class=5, seed=1, **kw)
    c = load_dataset("identities", train_per_class=5, seed=2, **kw)
    assert a.train.class_counts(10).tolist() == [5] * 10
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.x, c.test.x)
    assert not torch.equal(a.train.x, c.train.x)
    d = load_dataset("identities", sim_seed=9, **kw)
    assert not torch.equal(a.test.x, d.test.x)
