r"""Open-set 1:N identification: CMC, DIR at fixed FPIR (NIST FRVT, ISO/IEC 19795-1).

A probe is *mated* when its label has at least one gallery entry, *non-mated* otherwise. The
score of a gallery label is its best entry's score (cosine similarity, or minus the Euclidean
distance for ``metric="l2"``). A mated probe's *rank* is the number of gallery labels scoring
at least as high as its own label: ties count against the probe, so a label tied with a
wrong one is not ranked first. With ``t`` a threshold and the decision "a candidate is
returned iff its score > t",

.. math::
    \text{FPIR}(t) = \frac{\#\{\text{non-mated}: \text{top score} > t\}}{N_\text{non-mated}},\qquad
    \text{DIR}(t) = \frac{\#\{\text{mated}: \text{rank} = 1,\ \text{own score} > t\}}{N_\text{mated}},

``FNIR(t) = 1 - DIR(t)`` and ``CMC(k) = #{mated: rank <= k} / N_mated`` (no threshold). The
denominators are the mated and non-mated *counts*, never the number of probes. ``DIR`` at a
target FPIR ``f`` uses the smallest ``t`` with ``FPIR(t) <= f`` (exact order statistic of the
non-mated top scores); a target ``f < 1/N_non-mated`` cannot be resolved and gives ``None``.
(The standards write ``score >= t``; the same operating points result, at a threshold one
score higher.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from marginkit._validation import accepts_arrays, compute_dtype, positive_float, positive_int
from marginkit.knn._search import check_embeddings, check_labels, check_metric, prepare, search_keys
from marginkit.metrics._roc import Side, rates_at_targets, sort_values
from marginkit.metrics.curves import det_points

DEFAULT_RANKS = (1, 5, 10)
DEFAULT_FPIRS = (1e-1, 1e-2, 1e-3)


@dataclass(frozen=True)
class GallerySearch:
    """What an open-set search found for each probe (from :func:`search_gallery`).

    Attributes:
        mated: ``[P]`` bool, the probe's label has a gallery entry.
        rank: ``[P]`` int64, rank of the probe's own label (1 = best, ties count against);
            0 for non-mated probes.
        own_score: ``[P]`` float64, the score of the probe's own label (``-inf`` if non-mated).
        top_score: ``[P]`` float64, the best label score.
        num_labels: number of distinct gallery labels.
        metric: ``"cosine"`` (scores are cosines) or ``"l2"`` (scores are minus distances).
    """

    mated: torch.Tensor
    rank: torch.Tensor
    own_score: torch.Tensor
    top_score: torch.Tensor
    num_labels: int
    metric: str

    @property
    def num_mated(self) -> int:
        return int(self.mated.sum())

    @property
    def num_nonmated(self) -> int:
        return self.mated.numel() - self.num_mated

    def cmc_curve(self, max_rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ranks, rates)``: ``ranks = 1..max_rank`` (default: every label) and CMC at each, float64."""
        self._need_mated()
        k = self.num_labels if max_rank is None else positive_int(max_rank, "max_rank")
        k = min(k, self.num_labels)
        counts = torch.bincount(self.rank[self.mated].clamp_max(k + 1), minlength=k + 2)[1 : k + 1]
        ranks = torch.arange(1, k + 1, device=counts.device)
        return ranks, torch.cumsum(counts, 0).to(torch.float64) / self.num_mated

    def det_curve(self, num_points: int | None = 200) -> dict[str, torch.Tensor]:
        """Open-set DET points ``{"threshold", "fpir", "fnir"}`` (see :func:`marginkit.metrics.det_curve`)."""
        self._need_mated()
        if self.num_nonmated == 0:
            raise ValueError("every probe is mated: FPIR, hence the open-set DET curve, is undefined")
        if num_points is not None:
            num_points = positive_int(num_points, "num_points", minimum=2)
        d = det_points(self._hits(), Side(sort_values(self.top_score[~self.mated])), num_points)
        return {"threshold": d["threshold"], "fpir": d["p_fa"], "fnir": d["p_miss"]}

    def _hits(self) -> Side:
        # Mated probes as the "genuine" side: the own score when ranked first, else -inf (a miss
        # at every threshold), so that FNIR(t) = share of them <= t.
        s = torch.where(self.rank[self.mated] == 1, self.own_score[self.mated], -math.inf)
        return Side(sort_values(s))

    def _need_mated(self) -> None:
        if self.num_mated == 0:
            raise ValueError("no probe label occurs in gallery_labels: CMC and DIR need mated probes")

    def metrics(
        self, ranks: Sequence[int] = DEFAULT_RANKS, fpir: Sequence[float] = DEFAULT_FPIRS
    ) -> dict[str, object]:
        """The summary of :func:`identification_metrics`."""
        self._need_mated()
        ranks = tuple(positive_int(k, "ranks") for k in ranks)
        fpir = tuple(float(f) for f in fpir)
        for f in fpir:
            if not 0 < f < 1:
                raise ValueError(f"fpir must lie in (0, 1), got {f}")
        mated_rank = self.rank[self.mated]
        cmc = {k: float((mated_rank <= k).double().mean()) if k <= self.num_labels else None for k in ranks}
        nonmated = Side(sort_values(self.top_score[~self.mated]))
        thresholds, dir_at = rates_at_targets(self._hits(), nonmated, fpir)
        return {
            "cmc": cmc,
            "dir_at_fpir": dir_at,
            "thresholds": thresholds,
            "num_mated": self.num_mated,
            "num_nonmated": self.num_nonmated,
            "num_gallery_labels": self.num_labels,
            "metric": self.metric,
            "decision": "a candidate is returned iff its score > threshold",
        }


@accepts_arrays(probe_emb="float", probe_labels="int", gallery_emb="float", gallery_labels="int")
def search_gallery(
    probe_emb: torch.Tensor,
    probe_labels: torch.Tensor,
    gallery_emb: torch.Tensor,
    gallery_labels: torch.Tensor,
    *,
    metric: str = "cosine",
    memory_limit_mb: float = 256.0,
) -> GallerySearch:
    """Exact open-set search of every probe against a gallery with any number of entries per label.

    Probe rows are scored in chunks against all gallery rows (one ``[chunk, G]`` score matrix
    and one ``[chunk, labels]`` matrix of label scores under ``memory_limit_mb``, at least one
    probe row); a label's score is the maximum over its entries.

    Args:
        probe_emb: ``[P, D]``; probe_labels: ``[P]`` integer labels.
        gallery_emb: ``[G, D]``; gallery_labels: ``[G]`` integer labels, repeats allowed.
        metric: ``"cosine"`` (rows L2-normalised) or ``"l2"`` (score = minus Euclidean distance).
        memory_limit_mb: budget of the per-chunk score matrices.
    """
    check_embeddings(probe_emb, "probe_emb")
    check_labels(probe_labels, "probe_labels", probe_emb.shape[0], "probe_emb")
    check_embeddings(gallery_emb, "gallery_emb")
    check_labels(gallery_labels, "gallery_labels", gallery_emb.shape[0], "gallery_emb")
    if probe_emb.shape[1] != gallery_emb.shape[1]:
        raise ValueError(
            f"probe_emb has dimension {probe_emb.shape[1]} but gallery_emb has {gallery_emb.shape[1]}"
        )
    metric = check_metric(metric)
    budget = positive_float(memory_limit_mb, "memory_limit_mb") * 2**20
    dtype = compute_dtype(gallery_emb.dtype)
    device = gallery_emb.device
    labels, label_index = torch.unique(gallery_labels.to(device), return_inverse=True)
    order = torch.argsort(label_index, stable=True)  # one entry per label: the label scores are the scores
    g = prepare(gallery_emb.detach()[order], metric, "gallery_emb", dtype)
    label_index = label_index[order]
    bias = -torch.einsum("ij,ij->i", g, g) if metric == "l2" else None  # -|g|², summed products
    n_labels, n_gallery = labels.numel(), g.shape[0]
    one_each = n_labels == n_gallery

    probe_labels = probe_labels.to(device)
    pos = torch.searchsorted(labels, probe_labels).clamp_max(n_labels - 1)
    mated = labels[pos] == probe_labels
    n = probe_emb.shape[0]
    rank = torch.zeros(n, dtype=torch.long, device=device)
    own = torch.empty(n, dtype=torch.float64, device=device)
    top = torch.empty(n, dtype=torch.float64, device=device)
    itemsize = g.element_size()
    per_row = (n_gallery + (0 if one_each else n_labels)) * itemsize + n_labels + 4 * g.shape[1] * itemsize
    rows = max(1, int(budget // per_row))
    for s in range(0, n, rows):
        q = prepare(probe_emb.detach()[s : s + rows].to(device), metric, "probe_emb", dtype)
        keys = search_keys(q, g, bias)
        if not one_each:
            keys = torch.full((q.shape[0], n_labels), -math.inf, dtype=dtype, device=device).scatter_reduce_(
                1, label_index.expand(q.shape[0], -1), keys, "amax"
            )
        own_key = keys.gather(1, pos[s : s + rows, None])
        rank[s : s + rows] = (keys >= own_key).sum(1)
        top_key = keys.amax(1)
        if metric == "l2":  # key = |q|² - d², so d = sqrt(|q|² - key)
            sq = torch.einsum("ij,ij->i", q, q)[:, None]
            own_key = -(sq - own_key).clamp_min(0).sqrt()
            top_key = -(sq[:, 0] - top_key).clamp_min(0).sqrt()
        own[s : s + rows] = own_key[:, 0].to(torch.float64)
        top[s : s + rows] = top_key.to(torch.float64)
    rank = torch.where(mated, rank, 0)
    own = torch.where(mated, own, -math.inf)
    return GallerySearch(mated, rank, own, top, n_labels, metric)


@accepts_arrays(probe_emb="float", probe_labels="int", gallery_emb="float", gallery_labels="int")
def identification_metrics(
    probe_emb: torch.Tensor,
    probe_labels: torch.Tensor,
    gallery_emb: torch.Tensor,
    gallery_labels: torch.Tensor,
    *,
    ranks: Sequence[int] = DEFAULT_RANKS,
    fpir: Sequence[float] = DEFAULT_FPIRS,
    metric: str = "cosine",
    memory_limit_mb: float = 256.0,
) -> dict[str, object]:
    r"""Open-set identification: CMC at ``ranks`` and DIR at each target FPIR, with thresholds.

    Definitions in :mod:`marginkit.metrics.identification`: a label's score is its best
    gallery entry; rank ties count against the probe; ``CMC(k)`` and ``DIR`` are shares of
    the *mated* probes, ``FPIR`` of the *non-mated* ones; the threshold at FPIR ``f`` is the
    (m+1)-th largest non-mated top score, ``m = floor(f N_non-mated)``, and a candidate is
    returned iff its score > threshold.

    Returns:
        ``{"cmc": {k: float | None}, "dir_at_fpir": {f: float | None}, "thresholds": {f: float |
        None}, "num_mated", "num_nonmated", "num_gallery_labels": int, "metric", "decision"}``.
        ``cmc[k]`` is ``None`` for ``k`` above the number of gallery labels;
        ``dir_at_fpir[f]`` and its threshold are ``None`` when ``f < 1/num_nonmated`` (or no
        probe is non-mated): that rate is not measurable with these probes.

    Example:
        >>> import torch
        >>> gal = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
        >>> probes = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.6], [1.0, 0.05]])
        >>> m = identification_metrics(probes, torch.tensor([0, 1, 7, 8]), gal, torch.tensor([0, 1]),
        ...                            ranks=(1, 5), fpir=(0.5, 0.1))
        >>> m["cmc"], m["dir_at_fpir"], m["num_mated"], m["num_nonmated"]
        ({1: 1.0, 5: None}, {0.5: 1.0, 0.1: None}, 2, 2)
    """
    search = search_gallery(
        probe_emb, probe_labels, gallery_emb, gallery_labels, metric=metric, memory_limit_mb=memory_limit_mb
    )
    return search.metrics(ranks, fpir)
