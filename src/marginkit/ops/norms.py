"""Vector norms and unit vectors that neither overflow nor underflow in the squares.

``torch.linalg.vector_norm`` and ``F.normalize`` square the entries: in float32 a row of
1e30 has norm ``inf`` (its unit vector becomes 0, every cosine 0) and a row of 1e-25 norm 0.
Dividing each row by its largest magnitude first keeps the squares in ``[0, D]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from marginkit._validation import active_checks, check_flag

__all__ = ["robust_norm", "row_norms", "unit_rows"]


def _row_scale(x: Tensor) -> Tensor:
    """Largest magnitude of each row (keepdim, detached), 1 for all-zero rows."""
    top = x.detach().abs().amax(dim=-1, keepdim=True)
    return torch.where(top > 0, top, 1.0)


def robust_norm(x: Tensor) -> Tensor:
    """``‖x‖`` over the last dimension (keepdim), computed on the rows divided by their largest entry."""
    top = _row_scale(x)
    return torch.linalg.vector_norm(x / top, dim=-1, keepdim=True).mul_(top)


def row_norms(x: Tensor) -> Tensor:
    """``‖x‖`` over the last dimension (no keepdim) for a large matrix: no temporary of ``x``'s size.

    ``torch.linalg.vector_norm`` (one pass, no copy); the rows whose squares overflow (entries
    beyond about 1.8e19 in float32: norm ``inf``) are recomputed divided by their largest entry
    (:func:`robust_norm`), found with one host sync. Squares that underflow matter only for
    norms far below the ``eps`` floors of the cosine heads.
    """
    norm = torch.linalg.vector_norm(x, dim=-1)
    over = torch.isinf(norm)
    if active_checks() is not None:
        # a training step reads nothing back: rows this large mean diverged weights, reported at the
        # next read point instead of being fixed up here
        check_flag("row norms", over, lambda: _OVERFLOW)
        return norm
    if bool(over.any()):
        rows = over.nonzero(as_tuple=True)
        norm = norm.index_put(rows, robust_norm(x[rows]).squeeze(-1))
    return norm


_OVERFLOW = (
    "vectors with entries beyond the square root of the dtype's largest number (about 1.8e19 in float32) "
    "reached a cosine head: their norms overflow (the weights diverged); lower lr or set grad_clip"
)


def unit_rows(x: Tensor, eps: float = 1e-12) -> Tensor:
    """``F.normalize(x, dim=-1)`` of the rescaled rows: the same unit vectors, for any finite scale.

    The scale is detached (the unit vector does not depend on it), so the gradient is
    ``F.normalize``'s at ``x / max|x|``, divided by ``max|x|``. Rows of norm below ``eps`` (after
    rescaling: all-zero rows) stay 0.
    """
    return F.normalize(x / _row_scale(x), dim=-1, eps=eps)
