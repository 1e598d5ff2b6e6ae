r"""Target-logit margins of the margin-softmax family: ``f(c_y)`` for the label's cosine.

Each function maps the ``[B]`` label cosines ``c_y`` (and, for AdaFace, per-row margins) to the
unscaled target value ``f(c_y)`` that :func:`marginkit.ops.softmax.class_cross_entropy` puts in
the label's column (scaled by ``s``). They are differentiable by autograd, finite everywhere on
``[-1, 1]`` (no ``arccos``, whose derivative is infinite at ``c = ±1``: ``sin θ`` is
``sqrt((1 − c)(1 + c))``, whose derivative is taken with the radicand clamped at the input dtype's
machine epsilon, the value being exact) and evaluated in float64 (B values only; not on MPS),
rounded to the input dtype.

- :func:`arcface_target`: ``cos(θ + m)`` (Deng et al., CVPR 2019), extended past ``θ = π − m``.
- :func:`combined_margin_target`: ``cos(m₁·θ + m₂) − m₃`` (InsightFace's combined margin; SphereFace,
  ArcFace and CosFace are its special cases), with the same extension.
- :func:`adaface_target`: ``cos(clip(θ + g, 0, π)) − g_add`` with per-row ``g = −m·ẑ``,
  ``g_add = m·ẑ + m`` from the normalised feature norms ``ẑ`` (:func:`adaface_norm_scores`;
  Kim, Jain, Liu, CVPR 2022).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["adaface_norm_scores", "adaface_target", "arcface_target", "combined_margin_target"]


def _wide(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float64 where the device has it (not MPS): for the ``[B]`` target column only."""
    return dtype if device.type == "mps" else torch.float64


def _sin_theta(x: Tensor, eps: float) -> Tensor:
    """``sin(arccos x) = sqrt((1 − x)(1 + x))``, exact; its derivative with the radicand clamped at ``eps``.

    The clamp keeps the derivative finite at ``x = ±1``; applied to the value as well, it moved
    ``cos(θ + m)`` by up to ``sqrt(eps)·sin(m)`` (1.7e-4 in float32) at ``c = ±1``, so that the
    float32 and float64 losses disagreed there. The value carries no clamp.
    """
    radicand = (1 - x) * (1 + x)
    clamped = radicand.clamp_min(eps).sqrt()
    return clamped + (radicand.clamp_min(0.0).sqrt() - clamped).detach()


def arcface_target(c: Tensor, margin: float) -> Tensor:
    """``cos(θ + m)`` while ``c > cos(π - m)`` (``θ = arccos c``), else ``c - m·sin(m)``.

    ``cos(θ + m) = c·cos(m) - sin(θ)·sin(m)`` with ``sin(θ) = sqrt((1 - c)(1 + c))``: no
    ``arccos`` (whose derivative is infinite at ``c = ±1``). For the derivative only, the
    radicand is clamped at the INPUT dtype's machine epsilon, i.e. ``c = ±1`` is treated as its
    nearest representable neighbour: the derivative ``cos(m) + c·sin(m)/sin(θ)`` stays finite
    everywhere (at most ``≈ 1 + sin(m)/sqrt(eps)``, 1.4e3 in float32 at m = 0.5); the value is
    exact. Both branches are finite everywhere, so the unselected branch of ``torch.where``
    never leaks a NaN into the gradient.

    Evaluated in float64 (B values only) and rounded to the input dtype: rounding is monotone,
    so the float32 target logit is monotone too; a float32 evaluation is not, by an ulp or
    two, near the switch point where the slope is zero.
    """
    eps = torch.finfo(c.dtype).eps
    x = c.to(_wide(c.dtype, c.device))
    cos_m, sin_m = math.cos(margin), math.sin(margin)
    arc = x * cos_m - _sin_theta(x, eps) * sin_m
    return torch.where(x > math.cos(math.pi - margin), arc, x - margin * sin_m).to(c.dtype)


def combined_margin_target(c: Tensor, m1: float, m2: float, m3: float) -> Tensor:
    r"""InsightFace's combined margin ``f(c) = cos(m₁·θ + m₂) − m₃``, ``θ = arccos c``.

    .. math::

        f(c) = \begin{cases} \cos(m_1\theta + m_2) - m_3 & \theta < \theta_s = (\pi - m_2)/m_1 \\
                             c - m_3 - (\pi - \theta_s)\sin\theta_s & \text{otherwise} \end{cases}

    Past the switch angle ``θ_s`` (where ``m₁·θ + m₂`` reaches ``π`` and the cosine would turn
    back up) the target continues as ``cos θ`` minus the first-order margin at ``θ_s``: for
    ``m₁ = 1`` this is ArcFace's rule ``c − m·sin m``. ``f`` is decreasing in ``θ`` on all of
    ``[0, π]`` while ``θ_s ≥ π/2`` (the jump at ``θ_s`` goes down), which the losses check.

    Special cases are computed by their own formulas, so they are exactly CosFace and ArcFace:
    ``m₁ = 1, m₂ = 0`` gives ``c − m₃``; ``m₁ = 1, m₃ = 0`` gives :func:`arcface_target`.
    Otherwise ``θ = atan2(sin θ, c)`` with ``sin θ`` clamped as in :func:`arcface_target`.
    """
    if m1 == 1.0:
        base = c if m2 == 0.0 else arcface_target(c, m2)
        return base - m3 if m3 != 0.0 else base
    eps = torch.finfo(c.dtype).eps
    x = c.to(_wide(c.dtype, c.device))
    theta = torch.atan2(_sin_theta(x, eps), x)
    value = torch.cos(m1 * theta + m2)
    switch = (math.pi - m2) / m1
    if switch < math.pi:
        value = torch.where(theta < switch, value, x - (math.pi - switch) * math.sin(switch))
    return (value - m3).to(c.dtype)


def adaface_norm_scores(
    norms: Tensor, mean: Tensor | float, std: Tensor | float, h: float, eps: float
) -> Tensor:
    r"""AdaFace's normalised feature norms ``ẑ = clip(h·(‖z‖ − μ)/(σ + ε), −1, 1)``, ``[B]``.

    ``μ, σ``: the (running) mean and standard deviation of the batch's norms; ``h`` sets how
    many standard deviations map to ±1 (``h = 0.333``: about 99 % of the rows inside).
    """
    return ((norms - mean) / (std + eps) * h).clamp(-1.0, 1.0)


def adaface_target(c: Tensor, margin: float, norm_scores: Tensor) -> Tensor:
    r"""AdaFace's target ``cos(clip(θ + g_angle, 0, π)) − g_add``, elementwise on ``[B]``.

    .. math:: g_\text{angle} = -m\,\hat z,\qquad g_\text{add} = m\,\hat z + m

    with per-row norm scores ``ẑ ∈ [−1, 1]`` (:func:`adaface_norm_scores`): a high-norm
    (high-quality) row gets an angular margin like ArcFace's, a low-norm row a negative angular
    and a larger additive one (Kim, Jain, Liu, "AdaFace: Quality Adaptive Margin for Face
    Recognition", CVPR 2022, eq. 10). ``cos(θ + g) = c·cos g − sin θ·sin g``; the clip at ``0``
    (``θ < −g``, i.e. ``c > cos g`` with ``g < 0``) gives 1, at ``π`` (``c < −cos g`` with
    ``g > 0``) gives −1 (the authors' code clips at ``[10⁻³, π − 10⁻³]`` for its ``arccos``).
    """
    eps = torch.finfo(c.dtype).eps
    wide = _wide(c.dtype, c.device)
    x = c.to(wide)
    g = -margin * norm_scores.to(wide)
    cos_g = torch.cos(g)
    value = x * cos_g - _sin_theta(x, eps) * torch.sin(g)
    value = torch.where((g < 0) & (x > cos_g), 1.0, value)
    value = torch.where((g > 0) & (x < -cos_g), -1.0, value)
    g_add = margin * norm_scores.to(wide) + margin
    return (value - g_add).to(c.dtype)
