"""Seeded synthetic trial scores for the metric tests: genuine ~ N(shift, 1), impostor ~ N(0, 1)."""

import torch


def trial_scores(
    seed: int, n_gen: int, n_imp: int, round_to: float | None = None, shift: float = 1.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, is_genuine)`` in float64, shuffled; ``round_to`` rounds to ``1/round_to`` (ties,
    also across the two classes)."""
    g = torch.Generator().manual_seed(seed)
    genuine = shift + torch.randn(n_gen, generator=g, dtype=torch.float64)
    s = torch.cat([genuine, torch.randn(n_imp, generator=g, dtype=torch.float64)])
    if round_to:
        s = torch.round(s * round_to) / round_to
    y = torch.arange(n_gen + n_imp) < n_gen
    perm = torch.randperm(n_gen + n_imp, generator=g)
    return s[perm], y[perm]
