"""Pure tensor functions: every op is batched over leading dimensions and device-agnostic."""

from marginkit._lazy import attach

# public name -> private module defining it (imported on first use)
__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "mep": "projection",
        "margin_gap": "projection",
        "alpha_softargmax": "alpha",
        "alpha_divergence_loss": "alpha",
        "qmargin_loss": "alpha",
        "circle_loss": "circle",
        "multi_similarity_loss": "contrastive",
        "supcon_loss": "contrastive",
        "ntxent_loss": "contrastive",
        "contrastive_loss": "contrastive",
        "class_block": "classes",
        "class_cross_entropy": "softmax",
        "proxy_anchor_loss": "proxy_anchor",
        "subcenter_cosines": "subcenters",
    },
)
