"""Compact template storage: float16, and int8 with one scale per vector.

int8 (symmetric, per vector): for a template ``t``,

.. math:: s = \\max_j |t_j| / 127, \\qquad c_j = \\operatorname{round}(t_j / s) \\in [-127, 127],

so ``t ≈ s c`` with an error of at most ``s / 2`` per coordinate, and a probe's cosine with a
unit template is ``s \\langle q, c \\rangle`` — one product with the codes and one scale per
template (the scheme of the insightface server's int8 galleries). Memory per template: ``D``
bytes plus 4 for the scale, against ``4 D`` for float32 and ``2 D`` for float16.

:func:`search` is the exact search of stored codes: scores ``s_i <q, c_i>`` (float16 codes:
``<q, t_i>``) computed in float32, decoded a block of rows at a time into one reused buffer.
"""

from __future__ import annotations

import torch

from marginkit.knn._search import _keep_best, _ordered_topk

__all__ = ["DTYPES", "dequantize", "quantize", "scores", "search"]

DTYPES = ("float32", "float16", "int8")
_TORCH = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}
_CHUNK = 4096  # rows decoded at once: a float32 block of D = 512 is 8 MiB, reused


def check_dtype(dtype: object, name: str = "dtype") -> str:
    if dtype not in DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
    return str(dtype)


def quantize(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``x`` ``[N, D]`` stored as ``dtype``: ``(codes, scales)``; ``scales`` ``[N]`` float32
    for ``int8``, else ``None``. An all-zero row gets scale 1 (its codes are 0)."""
    check_dtype(dtype)
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


def _blocks(queries: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None, chunk: int):
    """``(start, scores [B, rows])`` of the stored rows, one block at a time."""
    q = queries.to(torch.float32)
    if codes.dtype == torch.float32:
        for start in range(0, codes.shape[0], chunk):
            yield start, q @ codes[start : start + chunk].T
        return
    buf = torch.empty(min(chunk, codes.shape[0]), codes.shape[1])
    for start in range(0, codes.shape[0], chunk):
        part = codes[start : start + chunk]
        decoded = buf[: part.shape[0]]
        decoded.copy_(part)  # cast into the reused buffer: no allocation per block
        s = q @ decoded.T
        if scales is not None:
            s *= scales[start : start + chunk]
        yield start, s


def scores(
    queries: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None, *, chunk: int = _CHUNK
) -> torch.Tensor:
    """Inner products ``[B, N]`` of float32 ``queries`` ``[B, D]`` with the stored rows."""
    out = torch.empty(queries.shape[0], codes.shape[0])
    for start, s in _blocks(queries, codes, scales, chunk):
        out[:, start : start + s.shape[1]] = s
    return out


def search(
    queries: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None, k: int, *, chunk: int = _CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` stored rows of each query by inner product: ``(values, indices)``
    ``[B, k]``, by decreasing value and, among equal values, increasing row index.

    Each block's top ``k`` (the K-NN search's exact tie-ordered top-k) is merged with the
    running top ``k`` by a stable sort (the running rows have lower indices), so memory stays
    ``O(B (k + block))``.
    """
    n = codes.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n} (the stored rows), got {k}")
    best: tuple[torch.Tensor, torch.Tensor] | None = None
    for start, s in _blocks(queries, codes, scales, chunk):
        v, i = _ordered_topk(s, min(k, s.shape[1]), s.shape[0])
        best = _keep_best(best, v, i + start, k, descending=True, ordered=True)
    assert best is not None
    return best


def torch_dtype(dtype: str) -> torch.dtype:
    return _TORCH[check_dtype(dtype)]
