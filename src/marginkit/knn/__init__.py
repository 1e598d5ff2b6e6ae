"""K-nearest-neighbour classification over learned embeddings."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "KNNClassifier": "classifier",
        "IndexFileError": "index_file",
        "model_fingerprint": "fingerprint",
    },
)
