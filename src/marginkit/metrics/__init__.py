"""Retrieval, verification, identification and calibration metrics, and the field's protocols."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "retrieval_metrics": "retrieval",
        "clustering_metrics": "clustering",
        "verification_metrics": "verification",
        "pair_scores": "verification",
        "eer": "verification",
        "min_dcf": "verification",
        "tar_at_far": "verification",
        "det_curve": "curves",
        "normal_deviate": "curves",
        "identification_metrics": "identification",
        "search_gallery": "identification",
        "GallerySearch": "identification",
        "template_features": "templates",
        "open_set_split": "protocols",
        "random_templates": "protocols",
        "normalize_scores": "normalization",
        "cohort_stats": "normalization",
        "CohortStats": "normalization",
        "calibrate": "calibration",
        "Calibration": "calibration",
        "cllr": "calibration",
        "min_cllr": "calibration",
        "actual_dcf": "calibration",
        "bayes_threshold": "calibration",
        "knn_accuracy": "classification",
        "per_class_recall": "classification",
    },
)
