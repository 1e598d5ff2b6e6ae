"""Retrieval, verification and K-NN classification metrics."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "retrieval_metrics": "retrieval",
        "clustering_metrics": "clustering",
        "verification_metrics": "verification",
        "pair_scores": "verification",
        "knn_accuracy": "classification",
        "per_class_recall": "classification",
    },
)
