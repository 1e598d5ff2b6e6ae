"""Compact template storage: float16, and int8 with one scale per vector.

int8 (symmetric, per vector): for a template ``t``,

.. math:: s = \\max_j |t_j| / 127, \\qquad c_j = \\operatorname{round}(t_j / s) \\in [-127, 127],

so ``t ≈ s c`` with an error of at most ``s / 2`` per coordinate, and a probe's cosine with a
unit template is ``s \\langle q, c \\rangle`` — one integer matrix product and one scale per
template (the scheme of the insightface server's int8 galleries). Memory per template: ``D``
bytes plus 4 for the scale, against ``4 D`` for float32 and ``2 D`` for float16.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "dequantize", "quantize", "scores"]

DTYPES = ("float32", "float16", "int8")


def quantize(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``x`` ``[N, D]`` stored as ``dtype``: ``(codes, scales)``; ``scales`` ``[N]`` float32
    for ``int8``, else ``None``. An all-zero row gets scale 1 (its codes are 0)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    x = x.to(torch.float32)
    if dtype == "float32":
        return x.contiguous(), None
    if dtype == "float16":
        return x.to(torch.float16), None
    scale = x.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """float32 rows back from :func:`quantize`'s ``(codes, scales)``."""
    out = codes.to(torch.float32)
    return out * scales[:, None] if scales is not None else out


def scores(
    queries: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None, *, chunk: int = 65_536
) -> torch.Tensor:
    """Inner products ``[B, N]`` of float32 ``queries`` ``[B, D]`` with the stored rows, computed
    in float32 over chunks of ``chunk`` rows (so at most ``chunk × D`` floats are decoded at once)."""
    q = queries.to(torch.float32)
    out = torch.empty(q.shape[0], codes.shape[0])
    for start in range(0, codes.shape[0], chunk):
        part = slice(start, start + chunk)
        out[:, part] = q @ dequantize(codes[part], None if scales is None else scales[part]).T
    return out
