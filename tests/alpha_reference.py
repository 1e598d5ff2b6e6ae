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


def _mp_solution(theta, alpha: float, q) -> tuple[list, list, object, int]:
    """(p, q, β, digits) of one row in mpmath, by bisection on τ to the working precision (no analytic frame).

    The precision grows with the measure's range: an entry with weight q has ``u ≤ q^{−β}``, so τ
    needs ``β·log10(q_max/q_min)`` more digits than the logits' own.
    """
    import mpmath as mp

    theta = [float(t) for t in theta]
    q = [float(v) for v in q]
    digits = 90 + int((alpha - 1) * max(0.0, np.log10(max(q) / min(q))))
    with mp.workdps(digits):
        b = mp.mpf(alpha) - 1
        rows = [(mp.mpf(t), mp.mpf(v)) for t, v in zip(theta, q, strict=True)]
        live = [(t, v) for t, v in rows if t != -mp.inf]

        def mass(tau):
            return mp.fsum(v * max(1 + b * (t - tau), 0) ** (1 / b) for t, v in live)

        lo = max(t - (v ** (-b) - 1) / b for t, v in live)
        hi = max(t for t, _ in live) + 1 / b
        while True:
            mid = (lo + hi) / 2
            if mid in (lo, hi):
                break
            lo, hi = (mid, hi) if mass(mid) >= 1 else (lo, mid)
        ps = [v * max(1 + b * (t - lo), 0) ** (1 / b) if t != -mp.inf else mp.mpf(0) for t, v in rows]
        total = mp.fsum(ps)
        return [p / total for p in ps], [v for _, v in rows], b, digits


def mp_softargmax(theta: np.ndarray, alpha: float, q: np.ndarray) -> np.ndarray:
    """The alpha softargmax of every row (α > 1) in arbitrary precision (mpmath), rounded to float64."""
    theta = np.atleast_2d(np.asarray(theta, dtype=np.float64))
    q = np.broadcast_to(np.asarray(q, dtype=np.float64), theta.shape)
    rows = [_mp_solution(t, alpha, qi)[0] for t, qi in zip(theta, q, strict=True)]
    return np.array([[float(p) for p in row] for row in rows])


def mp_jacobian(theta: np.ndarray, alpha: float, q: np.ndarray) -> np.ndarray:
    """``dp/dθ`` of one row from the optimality conditions, ``diag(w) − w wᵀ/Σw`` with ``w = q^β p^{1−β}``."""
    import mpmath as mp

    p, qs, b, digits = _mp_solution(theta, alpha, q)
    with mp.workdps(digits):
        w = [v**b * x ** (1 - b) if x > 0 else mp.mpf(0) for x, v in zip(p, qs, strict=True)]
        sw = mp.fsum(w)
        jac = [[(w[i] if i == j else 0) - w[i] * w[j] / sw for j in range(len(p))] for i in range(len(p))]
        return np.array([[float(v) for v in row] for row in jac])


def mp_fenchel_young(theta: np.ndarray, label: int, alpha: float, q: np.ndarray) -> float:
    """``⟨p, θ⟩ − D_f(p, q) + D_f(e_y, q) − θ_y`` of one row, straight from the definitions (mpmath)."""
    import mpmath as mp

    p, qs, b, digits = _mp_solution(theta, alpha, q)
    with mp.workdps(digits):
        a = b + 1
        th = [mp.mpf(float(t)) for t in theta]

        def divergence(v):
            ratios = [(x / w, w) for x, w in zip(v, qs, strict=True)]
            return mp.fsum(w * (t**a - 1 - a * (t - 1)) / (a * b) for t, w in ratios)

        e = [mp.mpf(int(j == label)) for j in range(len(p))]
        inner = mp.fsum(x * t for x, t in zip(p, th, strict=True))
        return float(inner - divergence(p) + divergence(e) - th[label])
