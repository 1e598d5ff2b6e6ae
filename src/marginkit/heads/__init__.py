"""Classifier heads: modules that own the class centres, separate from any loss."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "CosineHead": "cosine",
        "NormedCosines": "cosine",
        "ShardedCosineHead": "sharded",
        "ShardedCosines": "sharded",
    },
)
