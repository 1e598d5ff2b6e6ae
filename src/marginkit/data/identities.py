"""An open-set identity simulator for verification experiments (a simulation, not real faces).

Real face/speaker verification data cannot be shipped here, so ``identities`` *simulates*
the structure that matters for open-set verification: many identities, several samples per
identity that differ by nuisance factors, and test identities never seen in training.

Generative model (all draws from seeded :class:`numpy.random.Generator` streams):

.. math::

    u_i \\sim \\mathcal N(0, I_{d_u}) \\quad\\text{(identity latent)},\\qquad
    v_{ij} \\sim \\mathcal N(0, s^2 I_{d_v}) \\quad\\text{(nuisance: pose stand-in)},

    x_{ij} = e^{\\sigma_g g_{ij}}\\, R([u_i; v_{ij}]) + \\sigma_\\varepsilon \\varepsilon_{ij},
    \\qquad g_{ij}, \\varepsilon_{ij} \\sim \\mathcal N(0, 1)
    \\quad\\text{(illumination gain, sensor noise)},

where the renderer :math:`R` is a FIXED random MLP
:math:`R(z) = W_3 \\tanh(W_2 \\tanh(W_1 z + b_1) + b_2)` (weights drawn once from the
simulator's seed with variance-preserving scales, outputs rescaled to unit average
variance). Because the identity and nuisance latents are mixed by the nonlinear renderer,
the nuisance cannot be removed by a linear projection of ``x``: an embedding has to learn
to be invariant to it. Knobs: ``nuisance_strength`` (:math:`s`), ``illumination``
(:math:`\\sigma_g`), ``noise`` (:math:`\\sigma_\\varepsilon`), latent sizes and the output
dimension.

Training, validation and test identities are drawn from independent streams, so they are
disjoint (their labels are disjoint ranges too): train ``0..T-1``, validation
``T..T+V-1``, test ``T+V..T+V+S-1``. Everything is vectorised and deterministic per seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from marginkit._validation import positive_float, positive_int

__all__ = ["IdentitySample", "IdentitySimulator"]

_STREAMS = {"renderer": 0, "train": 1, "val": 2, "test": 3}


@dataclass(frozen=True)
class IdentitySample:
    """Samples of one split: ``x`` ``[N, dim]`` float32, ``y`` ``[N]`` int64 identity ids,
    ``identity_latents`` ``[num_identities, identity_dim]`` (row ``k`` is identity ``first_id + k``)."""

    x: np.ndarray
    y: np.ndarray
    identity_latents: np.ndarray
    first_id: int


class IdentitySimulator:
    """Fixed random nonlinear renderer of identity and nuisance latents (see module docstring).

    Args:
        dim: output (observation) dimension.
        identity_dim: size of the identity latent :math:`u_i`.
        nuisance_dim: size of the nuisance latent :math:`v_{ij}` (pose stand-in).
        hidden_dim: width of the renderer's two hidden layers.
        nuisance_strength: standard deviation :math:`s` of the nuisance latent (0 = none).
        illumination: standard deviation :math:`\\sigma_g` of the log gain (0 = none).
        noise: standard deviation :math:`\\sigma_\\varepsilon` of additive noise (0 = none).
        seed: seeds the renderer and every split's stream.

    Example:
        >>> sim = IdentitySimulator(dim=32, seed=0)
        >>> s = sim.sample("train", num_identities=5, samples_per_identity=3)
        >>> s.x.shape, s.y.tolist()[:4]
        ((15, 32), [0, 0, 0, 1])
    """

    def __init__(
        self,
        *,
        dim: int = 64,
        identity_dim: int = 16,
        nuisance_dim: int = 8,
        hidden_dim: int = 128,
        nuisance_strength: float = 1.5,
        illumination: float = 0.3,
        noise: float = 0.3,
        seed: int = 0,
    ) -> None:
        self.dim = positive_int(dim, "dim")
        self.identity_dim = positive_int(identity_dim, "identity_dim")
        self.nuisance_dim = positive_int(nuisance_dim, "nuisance_dim")
        self.hidden_dim = positive_int(hidden_dim, "hidden_dim")
        self.nuisance_strength = positive_float(nuisance_strength, "nuisance_strength", allow_zero=True)
        self.illumination = positive_float(illumination, "illumination", allow_zero=True)
        self.noise = positive_float(noise, "noise", allow_zero=True)
        self.seed = positive_int(seed, "seed", minimum=0)
        rng = self._rng("renderer")
        d_in = self.identity_dim + self.nuisance_dim
        gain = 1.5  # keeps tanh units in their nonlinear range
        self._w1 = rng.standard_normal((d_in, hidden_dim)) * (gain / np.sqrt(d_in))
        self._b1 = rng.standard_normal(hidden_dim) * 0.5
        self._w2 = rng.standard_normal((hidden_dim, hidden_dim)) * (gain / np.sqrt(hidden_dim))
        self._b2 = rng.standard_normal(hidden_dim) * 0.5
        self._w3 = rng.standard_normal((hidden_dim, dim)) / np.sqrt(hidden_dim)
        # rescale so that a clean rendering of random latents has unit average variance per output
        calibration = self._render(rng.standard_normal((2048, d_in)))
        self._w3 /= np.sqrt(calibration.var(axis=0).mean())

    def _rng(self, stream: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, _STREAMS[stream]])

    def _render(self, z: np.ndarray) -> np.ndarray:
        h = np.tanh(z @ self._w1 + self._b1)
        h = np.tanh(h @ self._w2 + self._b2)
        return h @ self._w3

    def render(self, identity_latents: np.ndarray, nuisance_latents: np.ndarray) -> np.ndarray:
        """Noise-free rendering :math:`R([u; v])` of paired latent rows (``[N, d_u]``, ``[N, d_v]``)."""
        u = np.asarray(identity_latents, dtype=np.float64)
        v = np.asarray(nuisance_latents, dtype=np.float64)
        if u.ndim != 2 or u.shape[1] != self.identity_dim:
            raise ValueError(
                f"identity_latents must have shape [N, {self.identity_dim}], got {list(u.shape)}"
            )
        if v.ndim != 2 or v.shape[1] != self.nuisance_dim or len(v) != len(u):
            raise ValueError(
                f"nuisance_latents must have shape [{len(u)}, {self.nuisance_dim}], got {list(v.shape)}"
            )
        return self._render(np.concatenate([u, v], axis=1))

    def sample(
        self, split: str, num_identities: int, samples_per_identity: int, *, first_id: int = 0
    ) -> IdentitySample:
        """Draw ``num_identities`` new identities from ``split``'s stream and ``samples_per_identity`` each.

        ``split`` is ``"train"``, ``"val"`` or ``"test"``: each has its own random stream, so
        identities of different splits are distinct draws. Labels are ``first_id + k``.
        """
        if split not in ("train", "val", "test"):
            raise ValueError(f"split must be one of 'train', 'val', 'test'; got {split!r}")
        n_id = positive_int(num_identities, "num_identities", minimum=0)
        per = positive_int(samples_per_identity, "samples_per_identity")
        rng = self._rng(split)
        u = rng.standard_normal((n_id, self.identity_dim))
        n = n_id * per
        v = rng.standard_normal((n, self.nuisance_dim)) * self.nuisance_strength
        log_gain = rng.standard_normal((n, 1)) * self.illumination
        eps = rng.standard_normal((n, self.dim)) * self.noise
        index = np.repeat(np.arange(n_id), per)
        x = np.exp(log_gain) * self.render(u[index], v) + eps
        return IdentitySample(
            x=x.astype(np.float32),
            y=(index + first_id).astype(np.int64),
            identity_latents=u,
            first_id=first_id,
        )

    def splits(
        self,
        *,
        num_train_identities: int = 200,
        train_samples_per_identity: int = 20,
        num_val_identities: int = 50,
        num_test_identities: int = 100,
        test_samples_per_identity: int = 10,
    ) -> dict[str, IdentitySample]:
        """Train, validation and test samples with disjoint identities and disjoint label ranges.

        Validation identities use ``test_samples_per_identity`` samples each.
        """
        t = positive_int(num_train_identities, "num_train_identities", minimum=2)
        v = positive_int(num_val_identities, "num_val_identities", minimum=0)
        s = positive_int(num_test_identities, "num_test_identities", minimum=2)
        per_test = positive_int(test_samples_per_identity, "test_samples_per_identity", minimum=2)
        return {
            "train": self.sample("train", t, train_samples_per_identity, first_id=0),
            "val": self.sample("val", v, per_test, first_id=t),
            "test": self.sample("test", s, per_test, first_id=t + v),
        }
