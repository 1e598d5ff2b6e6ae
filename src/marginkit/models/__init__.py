"""Embedding backbones (``mlp``, ``cnn1d``, ``cnn2d``, ``resnet``)."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "build_model": "backbones",
        "model_options": "backbones",
        "EmbeddingModel": "backbones",
        "MODELS": "backbones",
    },
)
