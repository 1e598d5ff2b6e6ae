"""Retrieval, verification, identification and calibration metrics, and the field's protocols."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "retrieval_metrics": "retrieval",
        "verification_metrics": "verification",
        "pair_scores": "verification",
        "eer": "verification",
        "min_dcf": "verification",
        "knn_accuracy": "classification",
        "per_class_recall": "classification",
    },
)
