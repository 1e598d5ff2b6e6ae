r"""Score calibration into log-likelihood ratios, and the costs that judge it: Cllr, min Cllr, actual DCF.

Logistic-regression calibration (Brümmer, du Preez, "Application-independent evaluation of
speaker detection", CSL 2006; the FoCal / BOSARIS toolkits): ``llr = a s + b`` minimising the
prior-weighted cross-entropy

.. math::
    \frac{P}{N_g} \sum_\text{gen} \log(1 + e^{-(a s + b + \text{logit} P)})
    + \frac{1 - P}{N_i} \sum_\text{imp} \log(1 + e^{a s + b + \text{logit} P}),

whose minimiser makes ``a s + b`` a log-likelihood ratio (the prior odds ``logit P`` are
removed from it). Its cost,

.. math::
    C_\text{llr} = \frac12 \Big[\frac{1}{N_g}\sum_\text{gen} \log_2(1 + e^{-\ell})
    + \frac{1}{N_i}\sum_\text{imp} \log_2(1 + e^{\ell})\Big],

is 1 for the useless ``llr = 0`` and 0 for a perfect, perfectly calibrated system. ``min Cllr``
is the Cllr after the best monotone re-mapping of the scores: the pool-adjacent-violators (PAV)
isotonic fit of the genuine share, turned into llrs by removing the empirical prior odds
``N_g / N_i``. ``Cllr - min Cllr`` is the calibration loss. The actual DCF applies the Bayes
decision "accept iff ``llr > -log(p/(1 - p) · c_miss/c_fa)``" and normalises its cost as
:func:`~marginkit.metrics.min_dcf` does, so ``actual_dcf >= min_dcf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from marginkit._validation import accepts_arrays, data_tensor, float_tensor, positive_float, to_caller
from marginkit.metrics._roc import Side, check_pairs, sides, sort_values, threshold_at_rate

_CHUNK = 1 << 20  # scores per pass of the Newton sums (bounds the float64 temporaries)
_MAX_NEWTON = 100


def bayes_threshold(p_target: float = 0.01, c_miss: float = 1.0, c_fa: float = 1.0) -> float:
    """The llr above which accepting costs less: ``-log(p_target/(1 - p_target) * c_miss/c_fa)``.

    Example:
        >>> bayes_threshold(0.5)
        -0.0
    """
    p_target = _prior(p_target, "p_target")
    c_miss, c_fa = positive_float(c_miss, "c_miss"), positive_float(c_fa, "c_fa")
    return -math.log(p_target / (1 - p_target) * c_miss / c_fa)


def _prior(p: float, name: str) -> float:
    p = positive_float(p, name)
    if p >= 1:
        raise ValueError(f"{name} must lie in (0, 1), got {p}")
    return p


@dataclass(frozen=True)
class Calibration:
    """An affine score-to-llr map fitted by :func:`calibrate`, and the impostor scores it saw.

    Attributes:
        slope, offset: ``llr = slope * score + offset``.
        prior: the target prior ``P`` the fit was weighted for.
        num_genuine, num_impostor: the training trials.
    """

    slope: float
    offset: float
    prior: float
    num_genuine: int
    num_impostor: int
    impostor_scores: torch.Tensor = field(repr=False)  # sorted ascending

    def llr(self, scores: torch.Tensor) -> torch.Tensor:
        """``slope * scores + offset`` in float64 (a numpy array for numpy ``scores``)."""
        as_numpy = not isinstance(scores, torch.Tensor)
        scores = data_tensor(scores, "scores")
        float_tensor(scores, "scores", min_dim=0)
        return to_caller(scores.detach().to(torch.float64) * self.slope + self.offset, as_numpy)

    def score_at_llr(self, llr: float) -> float:
        """The raw score mapped to ``llr`` (e.g. to :func:`bayes_threshold`)."""
        return (float(llr) - self.offset) / self.slope

    def threshold_at_far(self, far: float) -> float | None:
        """The raw-score threshold at which the training impostors' FAR is at most ``far``.

        The exact order statistic of :func:`~marginkit.metrics.verification_metrics` (accept
        iff score > threshold); ``None`` when ``far < 1/num_impostor`` (not measurable).
        """
        far = positive_float(far, "far")
        if far >= 1:
            raise ValueError(f"far must lie in (0, 1), got {far}")
        return threshold_at_rate(Side(self.impostor_scores), far)


def _newton_sums(
    s: torch.Tensor, is_genuine: torch.Tensor, w: tuple[float, float], params: torch.Tensor, with_grad: bool
) -> tuple[float, torch.Tensor | None, torch.Tensor | None]:
    """Weighted cross-entropy (nats) of ``z = params[0] s + params[1]``, its gradient and Hessian."""
    loss = 0.0
    grad = torch.zeros(2, dtype=torch.float64)
    hess = torch.zeros(2, 2, dtype=torch.float64)
    for c in range(0, s.numel(), _CHUNK):
        x = s[c : c + _CHUNK]
        g = is_genuine[c : c + _CHUNK]
        z = x * params[0] + params[1]
        weight = torch.where(g, w[0], w[1])
        signed = torch.where(g, -z, z)
        loss += float((weight * torch.nn.functional.softplus(signed)).sum())
        if with_grad:
            p = torch.sigmoid(z)
            r = weight * (p - g.to(torch.float64))  # d loss / d z
            h = weight * p * (1 - p)
            grad += torch.stack([(r * x).sum(), r.sum()]).cpu()
            hess += (
                torch.stack([(h * x * x).sum(), (h * x).sum(), (h * x).sum(), h.sum()]).reshape(2, 2).cpu()
            )
    return loss, (grad if with_grad else None), (hess if with_grad else None)


@accepts_arrays(scores="float", is_genuine="bool")
def calibrate(scores: torch.Tensor, is_genuine: torch.Tensor, *, prior: float = 0.5) -> Calibration:
    r"""Fit ``llr = a s + b`` by prior-weighted logistic regression (see the module docstring).

    Solved by Newton's method with backtracking on standardised scores, in float64, until a
    Newton step changes the parameters by less than 1e-13 (relative). Perfectly separated
    scores (every genuine score on one side of every impostor score) have no finite solution:
    that is an error.

    Args:
        scores: ``[P]`` trial scores (larger: more likely genuine).
        is_genuine: ``[P]`` bool (or 0/1), both kinds present.
        prior: the target prior ``P`` in ``(0, 1)`` the cross-entropy is weighted for.

    Example:
        >>> import torch
        >>> c = calibrate(torch.tensor([0.9, 0.6, 0.7, 0.2, 0.4, 0.65]), torch.tensor([1, 1, 1, 0, 0, 0]))
        >>> round(c.slope, 3), round(c.offset, 3), c.threshold_at_far(0.5)
        (14.806, -8.931, 0.4000000059604645)
    """
    scores, is_genuine = check_pairs(scores, is_genuine, ("scores", "is_genuine"))
    prior = _prior(prior, "prior")
    gen_side, imp_side = sides(scores, is_genuine)
    gv, iv = gen_side.values, imp_side.values
    if iv[-1] <= gv[0] or gv[-1] <= iv[0]:
        raise ValueError(
            "scores separate genuine from impostor trials perfectly: logistic calibration has no finite "
            "solution (the slope grows without bound); calibrate on held-out trials that overlap"
        )
    s = scores.detach().to(torch.float64)
    mu, sd = float(s.mean()), float(s.std())
    s = (s - mu) / sd
    n_g, n_i = gen_side.count, imp_side.count
    w = (prior / n_g, (1 - prior) / n_i)
    params = torch.tensor([0.0, math.log(prior / (1 - prior))], dtype=torch.float64)
    loss, grad, hess = _newton_sums(s, is_genuine, w, params, True)
    for _ in range(_MAX_NEWTON):
        assert grad is not None and hess is not None
        step = torch.linalg.solve(hess, grad)
        decrement = float(grad @ step)
        if decrement <= 0 or float(step.abs().max()) <= 1e-13 * (1 + float(params.abs().max())):
            break  # the step no longer changes the parameters
        t = 1.0
        # Backtracking while the predicted decrease (decrement / 2) is resolvable in the loss;
        # below that, Newton's full steps converge quadratically and the loss cannot judge them.
        while decrement > 1e-12 * loss:
            if _newton_sums(s, is_genuine, w, params - t * step, False)[0] <= loss - 0.25 * t * decrement:
                break
            t /= 2
        params = params - t * step
        loss, grad, hess = _newton_sums(s, is_genuine, w, params, True)
    else:
        raise RuntimeError("calibrate: Newton's method did not converge (scores nearly separated?)")
    alpha, beta = float(params[0]), float(params[1]) - math.log(prior / (1 - prior))
    return Calibration(alpha / sd, beta - alpha * mu / sd, prior, n_g, n_i, iv)


def _check_llr(llr: object, is_genuine: object) -> tuple[torch.Tensor, torch.Tensor]:
    llr, is_genuine = check_pairs(llr, is_genuine, ("llr", "is_genuine"))
    return llr.detach().to(torch.float64), is_genuine


@accepts_arrays(llr="float", is_genuine="bool")
def cllr(llr: torch.Tensor, is_genuine: torch.Tensor) -> float:
    r"""Log-likelihood-ratio cost :math:`C_\text{llr}` in bits (module docstring); finite llrs.

    Example:
        >>> import torch
        >>> cllr(torch.zeros(4), torch.tensor([1, 1, 0, 0]))
        1.0
    """
    llr, is_genuine = _check_llr(llr, is_genuine)
    softplus = torch.nn.functional.softplus
    gen = softplus(-llr[is_genuine]).mean()
    imp = softplus(llr[~is_genuine]).mean()
    return float((gen + imp) / (2 * math.log(2)))


def _lower_hull(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Vertices (ascending indices) of the lower convex hull of integer points with increasing ``x``.

    Quickhull, vectorised per round: every hull segment takes at once its candidate farthest
    below it; candidates not strictly below their segment are dropped for good. Exact in int64.
    """
    n = x.numel()
    hull = torch.tensor([0, n - 1], device=x.device)
    k = torch.arange(1, n - 1, device=x.device)
    # A vertex lies strictly below the chord of its neighbours: one vectorised pass keeps only those.
    local = (x[k + 1] - x[k - 1]) * (y[k] - y[k - 1]) - (y[k + 1] - y[k - 1]) * (x[k] - x[k - 1])
    cand = k[local < 0]
    del k, local
    while cand.numel():
        seg = torch.searchsorted(hull, cand) - 1
        a, b = hull[seg], hull[seg + 1]
        cross = (x[b] - x[a]) * (y[cand] - y[a]) - (y[b] - y[a]) * (x[cand] - x[a])
        below = cross < 0
        cand, seg, cross = cand[below], seg[below], cross[below]
        if not cand.numel():
            break
        nseg = hull.numel() - 1
        deepest = torch.zeros(nseg, dtype=cross.dtype, device=x.device).scatter_reduce(0, seg, cross, "amin")
        is_deepest = cross == deepest[seg]
        pick = torch.full((nseg,), n, device=x.device).scatter_reduce(
            0, seg[is_deepest], cand[is_deepest], "amin"
        )
        new = pick[pick < n]
        hull = torch.sort(torch.cat([hull, new])).values
        cand = cand[~(is_deepest & (cand == pick[seg]))]
    return hull


@accepts_arrays(scores="float", is_genuine="bool")
def min_cllr(scores: torch.Tensor, is_genuine: torch.Tensor) -> float:
    r"""Cllr after the optimal monotone transform of ``scores`` (PAV), in bits.

    The PAV fit of the genuine share is the slope sequence of the lower convex hull of the
    cumulative (trials, genuine) counts over the distinct scores, ascending (tied scores are
    one point: they share one llr). A hull segment pooling ``G`` genuine and ``I`` impostor
    trials has ``llr = log((G/N_g) / (I/N_i))``; with ``g = G/N_g``, ``i = I/N_i`` it adds
    ``g log2((g+i)/g) + i log2((g+i)/i)`` to ``2 min Cllr`` (``0 log 0 = 0``), so pools of one
    class (infinite llr, no error) cost nothing.

    Example:
        >>> import torch
        >>> min_cllr(torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0, 0, 1, 1]))
        0.0
    """
    scores, is_genuine = check_pairs(scores, is_genuine, ("scores", "is_genuine"))
    gen_side, imp_side = sides(scores, is_genuine)
    merged = sort_values(torch.cat([gen_side.values, imp_side.values]))
    distinct = merged[torch.cat([merged[1:] != merged[:-1], merged.new_ones(1, dtype=torch.bool)])]
    zero = torch.zeros(1, dtype=torch.long, device=merged.device)
    g = torch.cat([zero, gen_side.mass_le(distinct)])
    n = torch.cat([zero, g[1:] + imp_side.mass_le(distinct)])
    hull = _lower_hull(n, g)
    dg = (g[hull[1:]] - g[hull[:-1]]).to(torch.float64) / gen_side.count
    di = ((n - g)[hull[1:]] - (n - g)[hull[:-1]]).to(torch.float64) / imp_side.count
    both = dg + di
    gen_cost = torch.where(dg > 0, dg * torch.log2(both / dg), 0.0)
    imp_cost = torch.where(di > 0, di * torch.log2(both / di), 0.0)
    return float((gen_cost.sum() + imp_cost.sum()) / 2)


@accepts_arrays(llr="float", is_genuine="bool")
def actual_dcf(
    llr: torch.Tensor,
    is_genuine: torch.Tensor,
    p_target: float = 0.01,
    c_miss: float = 1.0,
    c_fa: float = 1.0,
) -> float:
    r"""Normalised detection cost of the Bayes decision on llrs: accept iff ``llr > bayes_threshold``.

    .. math::
        \frac{c_\text{miss}\, p\, P_\text{miss}(\theta) + c_\text{fa} (1 - p)\, P_\text{fa}(\theta)}
        {\min(c_\text{miss} p,\ c_\text{fa} (1 - p))},\qquad
        \theta = -\log\frac{p\, c_\text{miss}}{(1 - p)\, c_\text{fa}}.

    Example:
        >>> import torch
        >>> actual_dcf(torch.tensor([3.0, -1.0, -5.0, 0.5]), torch.tensor([1, 1, 0, 0]), p_target=0.5)
        1.0
    """
    llr, is_genuine = _check_llr(llr, is_genuine)
    theta = bayes_threshold(p_target, c_miss, c_fa)
    gen_side, imp_side = sides(llr, is_genuine)
    t = torch.tensor([theta], dtype=torch.float64, device=llr.device)
    p_miss = float(gen_side.mass_le(t)[0]) / gen_side.count
    p_fa = float(imp_side.count - imp_side.mass_le(t)[0]) / imp_side.count
    cost = c_miss * p_target * p_miss + c_fa * (1 - p_target) * p_fa
    return cost / min(c_miss * p_target, c_fa * (1 - p_target))
