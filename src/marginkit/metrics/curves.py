r"""Curve points for reports: DET (miss against false alarm) and the normal-deviate axes.

A DET curve (Martin, Doddington, Kamm, Ordowski, Przybocki, "The DET curve in assessment of
detection task performance", Eurospeech 1997) plots the miss rate against the false-alarm rate,
both on normal-deviate axes :math:`\Phi^{-1}(p)`, so that Gaussian score distributions give
straight lines and the low-error corner is spread out. Every point returned here is an exact
operating point ``(FAR(t), FRR(t))`` at a threshold ``t`` that is one of the scores (or
``-inf``): nothing is interpolated.
"""

from __future__ import annotations

import torch

from marginkit._validation import accepts_arrays, positive_int
from marginkit.metrics._roc import Side, check_pairs, rates_at, sides


@accepts_arrays(p="float")
def normal_deviate(p: torch.Tensor) -> torch.Tensor:
    r"""The standard normal quantile :math:`\Phi^{-1}(p)` in float64 (``-inf`` at 0, ``+inf`` at 1).

    Example:
        >>> import torch
        >>> normal_deviate(torch.tensor([0.5, 0.0])).tolist()
        [0.0, -inf]
    """
    return torch.special.ndtri(p.to(torch.float64))


def _rate_grid(n: int, points: int, device: torch.device) -> torch.Tensor:
    """``points`` rates evenly spaced in normal deviate between ``1/n`` and ``1 - 1/n``."""
    if n < 2:
        return torch.empty(0, dtype=torch.float64, device=device)
    z = float(torch.special.ndtri(torch.tensor(1.0 / n, dtype=torch.float64)))
    return torch.special.ndtr(torch.linspace(z, -z, points, dtype=torch.float64, device=device))


def det_points(genuine: Side, impostor: Side, num_points: int | None) -> dict[str, torch.Tensor]:
    """Operating points of two unweighted sides: all of them, or about ``num_points`` spread on DET axes.

    With ``num_points``, the thresholds are the order statistics at which FAR, and those at
    which FRR, pass ``num_points // 2`` rates evenly spaced in normal deviate (between one
    score's share and its complement), plus ``-inf`` and the largest score.
    """
    gv, iv = genuine.values, impostor.values
    ninf = torch.tensor([-torch.inf], dtype=gv.dtype, device=gv.device)
    top = torch.maximum(gv[-1:], iv[-1:])
    if num_points is None:
        t = torch.unique(torch.cat([ninf, gv, iv]))
    else:
        half = max(1, num_points // 2)
        r_fa = _rate_grid(impostor.count, half, iv.device)
        # (counts within 1e-6 of an integer are that integer: the grid's ends are exactly 1/n, 1 - 1/n)
        j_fa = torch.ceil(impostor.count * (1 - r_fa) - 1e-6).long().clamp(1, impostor.count) - 1
        r_miss = _rate_grid(genuine.count, half, gv.device)
        j_miss = torch.ceil(genuine.count * r_miss - 1e-6).long().clamp(1, genuine.count) - 1
        t = torch.unique(torch.cat([ninf, iv[j_fa], gv[j_miss], top]))
    far, frr = rates_at(genuine, impostor, t)
    return {"threshold": t.to(torch.float64), "p_fa": far, "p_miss": frr}


@accepts_arrays(scores="float", is_genuine="bool")
def det_curve(
    scores: torch.Tensor, is_genuine: torch.Tensor, *, num_points: int | None = 200
) -> dict[str, torch.Tensor]:
    """DET-curve points of pair scores (accept iff score > threshold), thresholds ascending.

    Args:
        scores: ``[P]`` pair scores; is_genuine: ``[P]`` bool, both kinds present.
        num_points: about this many points spread evenly on the normal-deviate axes (for a
            plot of millions of trials); ``None`` for every operating point.

    Returns:
        ``{"threshold", "p_fa", "p_miss"}``: float64 tensors of one length; ``p_fa``
        non-increasing, ``p_miss`` non-decreasing. Plot ``normal_deviate(p_fa)`` against
        ``normal_deviate(p_miss)``; rates of 0 or 1 map to infinities, which a plot clips.

    Example:
        >>> import torch
        >>> d = det_curve(torch.tensor([0.9, 0.4, 0.6, 0.1]), torch.tensor([1, 1, 0, 0]), num_points=None)
        >>> d["p_fa"].tolist(), d["p_miss"].tolist()
        ([1.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5, 1.0])
    """
    scores, is_genuine = check_pairs(scores, is_genuine)
    if num_points is not None:
        num_points = positive_int(num_points, "num_points", minimum=2)
    return det_points(*sides(scores, is_genuine), num_points)
