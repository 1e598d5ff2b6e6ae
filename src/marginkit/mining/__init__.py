"""Pair and triplet mining (under ``no_grad``, returning index tensors) and memory banks."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "local_triplets": "triplets",
        "batch_hard_triplets": "triplets",
        "multi_similarity_pairs": "multi_similarity",
        "MemoryBank": "memory_bank",
    },
)
