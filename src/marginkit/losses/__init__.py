"""Loss modules: thin ``nn.Module`` wrappers over :mod:`marginkit.ops` with a ``reduction``."""

from marginkit._lazy import attach

# public name -> private module defining it (imported on first use)
__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "MEPLoss": "mep",
        "QMarginLoss": "alpha",
        "EntmaxLoss": "alpha",
        "SparsemaxLoss": "alpha",
        "NormSoftmaxLoss": "margin_softmax",
        "CosFaceLoss": "margin_softmax",
        "ArcFaceLoss": "margin_softmax",
        "CombinedMarginLoss": "margin_softmax",
        "SubCenterArcFaceLoss": "margin_softmax",
        "AdaFaceLoss": "adaface",
        "ProxyAnchorLoss": "proxy_anchor",
        "CircleLoss": "circle",
        "ClassCircleLoss": "circle",
        "TripletMarginLoss": "triplet",
        "LocalMarginTripletLoss": "triplet",
        "GatheredPairLoss": "gathered",
        "MultiSimilarityLoss": "multi_similarity",
        "SupConLoss": "supcon",
        "NTXentLoss": "supcon",
        "ContrastiveLoss": "contrastive",
    },
)
