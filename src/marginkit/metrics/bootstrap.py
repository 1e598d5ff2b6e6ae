r"""Percentile bootstrap over subjects for TAR@FAR and EER.

Pairs sharing a subject are dependent, so resampling pairs understates the uncertainty; the
unit of resampling is the subject (Bolle, Ratha, Pankanti, "Error analysis of pattern
recognition systems: the subsets bootstrap", CVIU 2004). One replicate draws the ``G``
subjects ``G`` times with replacement; subject ``s`` drawn ``m_s`` times enters ``m_s`` times.
The replicate's pairs are the original pairs rebuilt on the drawn subjects, each copy a
distinct subject:

- a pair within one subject ``a`` (every genuine pair) enters once per copy: weight ``m_a``;
- a pair of two subjects ``a != b`` enters once per pair of copies: weight ``m_a m_b``;
- pairs between two copies of the same subject are *not* created (they would be images of
  one person labelled as different people).

So a pair is kept iff both its subjects are drawn, with that multiplicity. TAR@FAR and EER are
computed on the weighted pairs exactly as on unweighted ones (a pair of weight ``w`` counts as
``w`` pairs), and the interval is the ``(1 - level)/2`` and ``(1 + level)/2`` percentiles
(linear interpolation) of the replicates' values. The scores are sorted once; each replicate
costs one pass over the pairs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from marginkit.metrics import _roc


def check_groups(groups: object, num_pairs: int) -> torch.Tensor:
    """``groups`` as a ``[P, 2]`` int64 tensor: the subjects of each pair's two sides (``[P]``: one each)."""
    if not isinstance(groups, torch.Tensor):
        raise TypeError(f"groups must be a torch.Tensor of subject ids, got {type(groups).__name__}")
    if groups.dtype == torch.bool or torch.is_floating_point(groups) or torch.is_complex(groups):
        raise TypeError(f"groups must be an integer tensor of subject ids, got dtype {groups.dtype}")
    if groups.dim() == 1:
        groups = groups[:, None].expand(-1, 2)
    if groups.dim() != 2 or groups.shape != (num_pairs, 2):
        raise ValueError(
            f"groups must have shape ({num_pairs}, 2) (the two subjects of each pair) or ({num_pairs},); "
            f"got {tuple(groups.shape)}"
        )
    return groups.long()


def subject_multiplicities(num_subjects: int, replicates: int, seed: int) -> Iterator[torch.Tensor]:
    """Per replicate, how often each of ``num_subjects`` subjects is drawn (``[G]`` int64, sum ``G``).

    Drawn with a CPU ``torch.Generator`` seeded by ``seed``: ``randint(0, G, (G,))`` per replicate.
    """
    gen = torch.Generator().manual_seed(seed)
    for _ in range(replicates):
        draw = torch.randint(0, num_subjects, (num_subjects,), generator=gen)
        yield torch.bincount(draw, minlength=num_subjects)


class _WeightedSide:
    """One class of pairs sorted by score; a replicate weighs pair ``(a, b)`` by ``m_a m_b``, or ``m_a``
    when ``a == b`` (``second`` then points at an extra multiplicity of 1: two gathers, one product).
    """

    def __init__(self, scores: torch.Tensor, codes: torch.Tensor, num_subjects: int) -> None:
        self.values, order = torch.sort(scores.detach().to(torch.float64))
        codes = codes[order]
        self.first = codes[:, 0].contiguous()
        self.second = torch.where(codes[:, 0] == codes[:, 1], num_subjects, codes[:, 1])

    def side(self, multiplicity: torch.Tensor) -> _roc.Side:
        m = torch.cat([multiplicity, multiplicity.new_ones(1)])
        w = m.index_select(0, self.first) * m.index_select(0, self.second)
        return _roc.Side(self.values, torch.cat([w.new_zeros(1), torch.cumsum(w, 0)]))


def _interval(values: list[float], level: float) -> tuple[float, float]:
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(torch.tensor(values, dtype=torch.float64), q).tolist()
    return lo, hi


def subject_bootstrap(
    scores: torch.Tensor,
    is_genuine: torch.Tensor,
    groups: torch.Tensor,
    fars: Sequence[float],
    replicates: int,
    *,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, object]:
    """Percentile intervals of TAR@FAR and EER over ``replicates`` subject-bootstrap replicates.

    ``scores``/``is_genuine`` are validated pairs, ``groups`` their ``[P, 2]`` subjects. A
    replicate without a genuine or without an impostor pair (possible with few subjects) is
    left out and not counted in ``valid_replicates``. A FAR that some valid replicate cannot
    resolve (below one pair of its impostor weight) gets ``None`` instead of an interval.
    """
    subjects, codes = torch.unique(groups, return_inverse=True)
    device = scores.device
    g = subjects.numel()
    gen_pairs = _WeightedSide(scores[is_genuine], codes[is_genuine], g)
    imp_pairs = _WeightedSide(scores[~is_genuine], codes[~is_genuine], g)
    tars: dict[float, list[float] | None] = {far: [] for far in fars}
    eers: list[float] = []
    for m in subject_multiplicities(g, replicates, seed):
        m = m.to(device)
        genuine, impostor = gen_pairs.side(m), imp_pairs.side(m)
        if genuine.total == 0 or impostor.total == 0:
            continue
        eers.append(_roc.eer(genuine, impostor))
        for far, tar in _roc.rates_at_targets(genuine, impostor, tuple(tars))[1].items():
            column = tars[far]
            if column is not None and tar is None:
                tars[far] = None  # some replicate cannot resolve this FAR
            elif column is not None:
                column.append(tar)
    intervals: dict[float, tuple[float, float] | None] = {
        far: _interval(column, level) if column else None for far, column in tars.items()
    }
    return {
        "level": level,
        "method": "percentile bootstrap over subjects (a pair kept iff both subjects drawn)",
        "replicates": replicates,
        "valid_replicates": len(eers),
        "num_subjects": subjects.numel(),
        "seed": seed,
        "tar_at_far": intervals,
        "eer": _interval(eers, level) if eers else None,
    }
