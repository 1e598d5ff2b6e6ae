"""Embedding backbones: ``mlp``, ``cnn1d``, ``cnn2d``, ``resnet``, ``timm:NAME``, ``torchvision:NAME``,
``onnx:FILE``."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "build_model": "backbones",
        "model_options": "backbones",
        "EmbeddingModel": "backbones",
        "MODELS": "backbones",
        "register_model": "backbones",
        "ExternalBackbone": "external",
        "frozen_modules": "base",
        "is_frozen": "base",
    },
)
