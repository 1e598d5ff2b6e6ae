"""Fingerprint of the embedding model that produced a K-NN index."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

_DOMAIN = b"marginkit.model_fingerprint.v1\0"


def model_fingerprint(module: nn.Module) -> str:
    """A SHA-256 over a module's architecture and every tensor of its ``state_dict``.

    Hashes, in ``state_dict`` order: the module's ``repr`` (its architecture and
    hyper-parameters), then for each entry its name, dtype, shape and raw bytes (parameters
    *and* buffers, e.g. batch-norm running statistics). Two models agree iff they would
    compute the same embeddings up to code changes outside the module. Any retraining step,
    dtype cast or architecture change gives a different fingerprint.

    Args:
        module: the embedding model.

    Returns:
        ``"sha256:<64 hex digits>"``.

    Example:
        >>> import torch
        >>> fp = model_fingerprint(torch.nn.Linear(4, 2))
        >>> fp.startswith("sha256:") and len(fp) == 71
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    h = hashlib.sha256(_DOMAIN)
    h.update(repr(module).encode())
    for name, value in module.state_dict().items():
        h.update(b"\0" + name.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"{t.dtype}{tuple(value.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        else:  # extra state returned by get_extra_state()
            h.update(repr(value).encode())
    return "sha256:" + h.hexdigest()
