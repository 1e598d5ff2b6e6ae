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
