"""Independent float64 reference for the alpha-divergence softargmax tests (no library code)."""

import numpy as np


def brute_force(theta: np.ndarray, alpha: float, q: np.ndarray | None = None) -> np.ndarray:
    """float64 bisection on τ for every row, with a bracket found by doubling (no analytic bounds)."""
    theta = np.atleast_2d(np.asarray(theta, dtype=np.float64))
    q = np.ones_like(theta) if q is None else np.broadcast_to(np.asarray(q, dtype=np.float64), theta.shape)
    out = np.zeros_like(theta)
    for i in range(theta.shape[0]):
        th, qi = theta[i], q[i]
        if alpha == 1.0:
            z = th + np.log(qi)
            e = np.exp(z - z.max())
            out[i] = e / e.sum()
            continue
        b = alpha - 1.0

        def mass(tau, th=th, qi=qi, b=b):
            return (qi * np.maximum(1.0 + b * (th - tau), 0.0) ** (1.0 / b)).sum()

        hi = th.max() + 1.0 / b  # nothing is active there
        width = 1.0
        while mass(hi - width) < 1.0:
            width *= 2.0
        lo = hi - width
        for _ in range(300):
            mid = 0.5 * (lo + hi)
            if mass(mid) >= 1.0:
                lo = mid
            else:
                hi = mid
        tau = 0.5 * (lo + hi)
        out[i] = qi * np.maximum(1.0 + b * (th - tau), 0.0) ** (1.0 / b)
    return out


def rounding_tolerance(
    expected: np.ndarray, theta: np.ndarray, alpha: float, q: np.ndarray | None = None, ulps: float = 16.0
) -> np.ndarray:
    """How far a float64 solution may lie from ``expected`` (α > 1) through rounding alone, per entry.

    ``p_j = q_j max(u_j, 0)^{1/β}`` with ``u_j = 1 + β(θ_j − τ)``. A τ within a few ulps moves
    every ``u_j`` by up to ``δu = β·ulps·ε·(1 + max|θ| + 1/β)``, hence ``p_j`` over the range
    ``s_j = q_j[(u_j + δu)₊^{1/β} − (u_j − δu)₊^{1/β}]``; normalising to a sum of 1 then moves
    every entry by up to ``p_j Σ_k s_k`` more. For α ≤ 2 this is a few ε. For α > 2 (1/β < 1)
    it grows without bound near the support edge (``u_j → 0⁺``): no float64 solver does better.
    """
    theta = np.atleast_2d(np.asarray(theta, dtype=np.float64))
    expected = np.atleast_2d(np.asarray(expected, dtype=np.float64))
    q = np.ones_like(theta) if q is None else np.broadcast_to(np.asarray(q, dtype=np.float64), theta.shape)
    b = alpha - 1.0
    # τ from the entry with the largest u (the best-conditioned one): u = (p/q)^β.
    u_known = (expected / q) ** b
    j = u_known.argmax(-1)[:, None]
    tau = np.take_along_axis(theta, j, -1) - (np.take_along_axis(u_known, j, -1) - 1.0) / b
    u = 1.0 + b * (theta - tau)
    du = b * ulps * np.finfo(np.float64).eps * (1.0 + np.abs(theta).max(-1, keepdims=True) + 1.0 / b)
    spread = q * (np.maximum(u + du, 0.0) ** (1.0 / b) - np.maximum(u - du, 0.0) ** (1.0 / b))
    return spread + expected * spread.sum(-1, keepdims=True)
