"""A persistent gallery of enrolled identities (SQLite) for verification at a target FAR,
open-set identification and K-NN classification. See docs/deploy.md."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "Gallery": "core",
        "UnknownIdentityError": "core",
        "GalleryError": "store",
        "Enrollment": "results",
        "Verification": "results",
        "Identification": "results",
        "Candidate": "results",
        "Classification": "results",
    },
)
