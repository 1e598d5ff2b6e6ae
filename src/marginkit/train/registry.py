"""Loss registry: command-line name → loss factory, kind (class-level or pair) and defaults.

Class-level losses (``kind == "class"``) are trained with a :class:`marginkit.heads.CosineHead`
and receive the head's cosines ``c = cos(e, w_j)`` of shape ``[B, C]``. Pair losses
(``kind == "pair"``) receive the batch embeddings and are fed by a
:class:`marginkit.data.PKSampler` (P classes × K samples per batch).

The margin-enforcing projection loss works on *scores*; here the scores are the scaled
cosines ``x = s · c`` (``scale`` option, default 16), so its ``margin`` is in units of
``s · cosine``: with ``s = 16`` and ``margin = 4`` the projection asks the true class's
cosine to beat every other class by 0.25.

    >>> from marginkit.train.registry import LOSSES, build_loss
    >>> LOSSES["cosface"].kind, LOSSES["triplet"].kind
    ('class', 'pair')
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from marginkit.train.errors import ConfigError, suggest

__all__ = [
    "LOSSES",
    "LossSpec",
    "ScaledScoresLoss",
    "build_loss",
    "check_loss_options",
    "class_defaults",
    "format_options",
    "loss_names",
]


@dataclass(frozen=True)
class LossSpec:
    """One registered loss.

    ``target`` is ``"module:Class"``; ``defaults`` are this library's training defaults
    (overridable with ``loss_options``): what ``marginkit train``, ``compare`` and ``demo`` and
    :func:`build_loss` use. They differ from the class's own constructor defaults
    (:func:`class_defaults`, its papers' settings for face recognition at 10⁴–10⁶ identities)
    where the command line's small data sets, with few classes, call for other values
    (``docs/defaults.md``); ``marginkit losses`` prints both. ``alpha`` marks the alpha-divergence family
    (sparse posteriors: the report shows their support sizes); ``scores`` marks losses that
    take scaled scores rather than cosines (wrapped in :class:`ScaledScoresLoss`); ``norms``
    marks losses that read the embedding norms (the head's ``with_norms=True`` output; the
    model must not normalise its embeddings).
    """

    name: str
    kind: Literal["class", "pair"]
    target: str
    description: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    alpha: bool = False
    scores: bool = False
    norms: bool = False

    def loss_class(self) -> type[nn.Module]:
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls)


_L = "marginkit.losses"
LOSSES: dict[str, LossSpec] = {
    s.name: s
    for s in (
        LossSpec("softmax", "class", f"{_L}:NormSoftmaxLoss", "NormFace: cross-entropy on s·cos",
                 {"scale": 16.0}),
        LossSpec("cosface", "class", f"{_L}:CosFaceLoss", "CosFace: additive cosine margin",
                 {"scale": 16.0, "margin": 0.2}),
        LossSpec("arcface", "class", f"{_L}:ArcFaceLoss", "ArcFace: additive angular margin",
                 {"scale": 16.0, "margin": 0.2}),
        LossSpec("combined_margin", "class", f"{_L}:CombinedMarginLoss",
                 "InsightFace's combined margin cos(m1·θ + m2) − m3",
                 {"m1": 1.0, "m2": 0.3, "m3": 0.2, "scale": 16.0}),
        LossSpec("subcenter_arcface", "class", f"{_L}:SubCenterArcFaceLoss",
                 "ArcFace on K sub-centres per class (max over sub-centres)",
                 {"scale": 16.0, "margin": 0.2, "sub_centers": 3}),
        LossSpec("adaface", "class", f"{_L}:AdaFaceLoss",
                 "AdaFace: margin adapted to the embedding norm (needs normalize: false)",
                 {"scale": 16.0, "margin": 0.4}, norms=True),
        LossSpec("proxy_anchor", "class", f"{_L}:ProxyAnchorLoss",
                 "Proxy-Anchor: class centres as anchors over the batch", {"alpha": 32.0, "margin": 0.1}),
        LossSpec("qmargin", "class", f"{_L}:QMarginLoss",
                 "Q-Margin: alpha-divergence Fenchel–Young loss, margin in the reference measure",
                 {"alpha": 1.25, "scale": 16.0, "margin": 0.2}, alpha=True),
        LossSpec("entmax", "class", f"{_L}:EntmaxLoss", "1.25-entmax Fenchel–Young loss on s·cos",
                 {"alpha": 1.25, "scale": 16.0}, alpha=True),
        LossSpec("sparsemax", "class", f"{_L}:SparsemaxLoss", "sparsemax loss on s·cos",
                 {"scale": 16.0}, alpha=True),
        LossSpec("mep", "class", f"{_L}:MEPLoss",
                 "margin-enforcing projection target on s·cos (squared L2 distance to the margin set)",
                 {"scale": 16.0, "margin": 4.0}, scores=True),
        LossSpec("class_circle", "class", f"{_L}:ClassCircleLoss", "Circle loss against class centres",
                 {"margin": 0.25, "gamma": 64.0}),
        LossSpec("circle", "pair", f"{_L}:CircleLoss", "Circle loss on in-batch pairs",
                 {"margin": 0.25, "gamma": 64.0}),
        LossSpec("triplet", "pair", f"{_L}:TripletMarginLoss",
                 "triplet margin loss, batch-all mining (mean over non-zero triplets)",
                 {"margin": 0.2, "mining": "batch_all"}),
        LossSpec("local_triplet", "pair", f"{_L}:LocalMarginTripletLoss",
                 "local-margin triplet loss (K-NN aware; k defaults to the run's K)", {"margin": 0.2}),
        LossSpec("multi_similarity", "pair", f"{_L}:MultiSimilarityLoss",
                 "multi-similarity loss on its mined pairs (Wang et al. 2019)",
                 {"alpha": 2.0, "beta": 50.0, "base": 0.5, "epsilon": 0.1}),
        LossSpec("supcon", "pair", f"{_L}:SupConLoss", "supervised contrastive loss (Khosla et al. 2020)",
                 {"temperature": 0.1}),
        LossSpec("ntxent", "pair", f"{_L}:NTXentLoss", "NT-Xent / InfoNCE over the in-batch positive pairs",
                 {"temperature": 0.07}),
        LossSpec("contrastive", "pair", f"{_L}:ContrastiveLoss",
                 "contrastive loss on normalised L2 distances (Hadsell et al. 2006)",
                 {"pos_margin": 0.0, "neg_margin": 1.0}),
        LossSpec("smooth_triplet", "pair", f"{_L}:TripletMarginLoss",
                 "triplet loss with log(1 + e^t) for the hinge, batch-all",
                 {"margin": 0.2, "mining": "batch_all", "smooth_loss": True}),
    )
}  # fmt: skip


def loss_names() -> list[str]:
    """Registered loss names in registry order."""
    return list(LOSSES)


def class_defaults(name: str) -> dict[str, Any]:
    """The loss class's own defaults for the options the registry sets: what ``Class()`` uses in
    Python where ``marginkit train --loss NAME`` uses ``LOSSES[NAME].defaults``.

    Read from a default-constructed instance, so a ``None`` default appears as the value the class
    resolves it to (``NormSoftmaxLoss()``'s scale, 30). An option the class does not take is left
    out (MEP's ``scale``: the command line multiplies the cosines by it, :class:`ScaledScoresLoss`).

        >>> class_defaults("cosface"), dict(LOSSES["cosface"].defaults)
        ({'scale': 64.0, 'margin': 0.4}, {'scale': 16.0, 'margin': 0.2})
    """
    loss = LOSSES[name].loss_class()()
    return {key: getattr(loss, key) for key in LOSSES[name].defaults if hasattr(loss, key)}


def format_options(options: Mapping[str, Any]) -> str:
    """``key=value, ...`` as ``marginkit losses`` prints options (``(none)`` for none)."""
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "(none)"


class ScaledScoresLoss(nn.Module):
    """Adapter: ``loss(scale · cosines, labels)`` for losses defined on scores (MEP).

    Args:
        loss: a module taking ``(scores [B, C], labels [B])``.
        scale: ``s > 0`` multiplying the cosines.
    """

    def __init__(self, loss: nn.Module, scale: float) -> None:
        super().__init__()
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.loss = loss
        self.scale = float(scale)

    def forward(self, cosines: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.scale * cosines, labels)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


def _accepted(spec: LossSpec) -> tuple[set[str], bool]:
    """Keyword names the loss accepts, and whether it takes ``**kwargs``."""
    params = inspect.signature(spec.loss_class().__init__).parameters
    names = {p for p in params if p != "self"}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names -= {n for n, p in params.items() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    names.discard("reduction")  # training needs the mean over the batch
    if spec.scores:
        names.add("scale")
    return names, var_kw


def check_loss_options(name: str, options: Mapping[str, Any]) -> None:
    """Raise :class:`~marginkit.train.errors.ConfigError` for an option the loss does not take."""
    spec = LOSSES[name]
    try:
        names, var_kw = _accepted(spec)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"loss {name!r} is not available in this installation: {exc}") from None
    if var_kw:
        return
    for key in options:
        if key not in names:
            raise ConfigError(
                f"loss {name!r} has no option {key!r}{suggest(key, sorted(names))}; "
                f"its options: {', '.join(sorted(names)) or '(none)'}"
            )


def resolved_options(name: str, options: Mapping[str, Any] | None = None, *, k: int | None = None) -> dict:
    """Registry defaults updated with ``options``; ``local_triplet`` gets ``k`` from the run."""
    spec = LOSSES[name]
    out = dict(spec.defaults)
    if name == "local_triplet" and k is not None:
        out["k"] = k
    out.update(dict(options or {}))
    return out


def build_loss(name: str, options: Mapping[str, Any] | None = None, *, k: int | None = None) -> nn.Module:
    """Instantiate loss ``name`` with the registry defaults overridden by ``options``.

    Class-level losses map ``(cosines [B, C], labels [B])`` to a scalar; pair losses map
    ``(embeddings [B, D], labels [B])`` to a scalar. ``k`` (the run's K-NN K) is the default
    neighbourhood of ``local_triplet``.
    """
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}{suggest(name, LOSSES)}; valid: {', '.join(LOSSES)}")
    check_loss_options(name, options or {})
    spec = LOSSES[name]
    kwargs = resolved_options(name, options, k=k)
    if spec.scores:
        scale = kwargs.pop("scale", 1.0)
        return ScaledScoresLoss(spec.loss_class()(**kwargs), scale)
    return spec.loss_class()(**kwargs)
