"""Shared skeleton of the losses on a ``[B, R]`` pair matrix (not re-exported).

Multi-similarity, SupCon, NT-Xent and contrastive losses all build one matrix between the
batch and its references (the batch itself, or a memory bank via ``ref_embeddings``) and
two masks — positives and negatives — from the labels or from mined ``indices``. This base
does the checks, the masks and the forward's single host synchronisation; the subclasses
only apply their op from :mod:`marginkit.ops.contrastive` and reduce.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from marginkit._validation import REDUCTIONS, choice
from marginkit.losses.pair_loss import PairLoss
from marginkit.losses.triplet import _sq_dist
from marginkit.ops.norms import unit_rows
from marginkit.ops.pairs import (
    COLLAPSE_TOL,
    PairBatch,
    check_pair_indices,
    cosine_similarity_matrix,
    distance_matrix,
    empty_reference_loss,
    label_masks,
    max_sq_norm,
    nonfinite_flag,
    pair_masks_from_indices,
    read_flags,
    report_checks,
    too_small_error,
    underflow_flag,
)


class PairMatrix(NamedTuple):
    batch: PairBatch
    matrix: torch.Tensor  # [B, R] cosine similarities or distances
    pos: torch.Tensor  # [B, R] bool, or int64 multiplicities of mined pairs
    neg: torch.Tensor


class PairMatrixLoss(PairLoss):
    """Base of the pair-matrix losses: masks, checks (one host sync), statistics.

    A subclass sets :attr:`distance` / :attr:`normalize` (cosine similarities by default) and
    implements :meth:`_loss` on the :class:`PairMatrix`; ``forward`` is
    :class:`~marginkit.losses.pair_loss.PairLoss`'s (mined ``indices``: a pair listed twice
    counts twice where the class has :attr:`multiplicities`, else once).
    """

    #: whether mined pairs listed twice count twice (pair-based losses) or once (set-based)
    multiplicities: bool = False
    #: ``None``: cosine similarities; else a distance of ``marginkit.ops.pairs.DISTANCES``
    distance: str | None = None
    normalize: bool = True

    def __init__(self, reduction: str, validate: bool) -> None:
        super().__init__()
        self.reduction = choice(reduction, "reduction", REDUCTIONS)
        self.validate = bool(validate)
        self.last_active_fraction = None

    def _loss(self, pm: PairMatrix) -> torch.Tensor:
        raise NotImplementedError

    def _pair_loss(self, batch: PairBatch, indices: Any) -> torch.Tensor:
        pm = self._pair_matrix(batch, indices)
        if not isinstance(pm, PairMatrix):
            return empty_reference_loss(self, pm, self.reduction)
        return self._loss(pm)

    def _pair_matrix(self, batch: PairBatch, indices: Any) -> PairMatrix | PairBatch:
        """The matrix and masks, or the bare batch when the reference set is empty.

        :attr:`distance` ``None`` gives cosine similarities; otherwise a distance of
        :data:`marginkit.ops.pairs.DISTANCES` on (optionally, :attr:`normalize`) L2-normalised
        embeddings.
        """
        distance, normalize = self.distance, self.normalize
        flags: list[torch.Tensor] = []
        if indices is not None:
            idx, out_of_range = check_pair_indices(
                indices, batch.x.shape[0], batch.y.shape[0], batch.x.device
            )
            flags.append(out_of_range)
        if batch.y.shape[0] == 0:
            return batch
        x, y = batch.x, batch.y
        if distance is None:
            matrix = cosine_similarity_matrix(x, y)
            scale: torch.Tensor | float = 1.0
        else:
            if normalize:  # (unit_rows: F.normalize overflows at 1e20 in float32, and its eps
                # leaves rows of norm below 1e-12 unnormalised)
                x = unit_rows(x)
                y = x if batch.self_ref else unit_rows(y)
            matrix = distance_matrix(x, y, distance)
            scale = 1.0 if (normalize or distance == "cosine") else max_sq_norm(x, y)
        if indices is None:
            pos, neg = label_masks(batch.labels, batch.ref_labels, batch.self_ref)
        else:
            shape = (matrix.shape[0], matrix.shape[1])
            pos, neg = pair_masks_from_indices(idx, shape, counts=self.multiplicities, clamp=self.validate)
        if self.validate:
            # One reduction of the matrix gives the widest pair (the "collapsed" check) and, as
            # NaN/inf propagate through amin/amax, whether any embedding is non-finite.
            m = matrix.detach()
            extreme = m.amin() if distance is None else m.amax()
            widest = 2.0 - 2.0 * extreme if distance is None else _sq_dist(extreme, distance)
            raw = distance is not None and distance != "cosine" and not normalize
            checks = [
                ~torch.isfinite(extreme),
                (widest <= COLLAPSE_TOL**2 * scale) & (m.numel() > 1 or not batch.self_ref),
                underflow_flag(x, y) if raw else torch.zeros((), dtype=torch.bool, device=m.device),
            ]
            if indices is None:
                checks.append(pos.count_nonzero() == 0)
            else:
                checks += [*flags, ((pos != 0) & (neg != 0)).any()]
            nonfinite, collapsed, small, *rest = torch.stack(checks).tolist()
            if small and not nonfinite:
                assert distance is not None
                raise too_small_error(x, y, distance)
            if nonfinite:  # the error path may synchronise again, to say which
                if read_flags(nonfinite_flag(batch.x, batch.y))[0]:
                    raise ValueError("embeddings (or ref_embeddings) contain NaN or infinite values")
                raise ValueError(
                    f"the pairwise {'similarities' if distance is None else 'distances'} overflow to "
                    f"infinity in {matrix.dtype}: the embeddings are too large (use normalize=True)"
                )
            if indices is not None:
                if rest[0]:
                    raise ValueError(
                        f"indices out of range: anchors must lie in [0, {x.shape[0]}) and "
                        f"positives/negatives in [0, {y.shape[0]})"
                    )
                if rest[1]:
                    raise ValueError("indices list a pair both as a positive and as a negative pair")
            report_checks(self, type(self).__name__, False, rest[0] if indices is None else None, collapsed)
        return PairMatrix(batch, matrix, pos, neg)
