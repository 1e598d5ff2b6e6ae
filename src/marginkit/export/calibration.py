"""Score thresholds for a target false-accept rate, from held-out validation pairs.

Every unordered pair of validation samples is genuine (same label) or impostor
(:func:`marginkit.metrics.pair_scores`, cosine scores); the threshold at FAR ``f`` is the one
of :func:`marginkit.metrics.verification_metrics`: with ``n`` impostor pairs and
``m = floor(f n)`` false accepts allowed, ``t`` is the ``(m+1)``-th largest impostor score
and a pair is *accepted iff score > t*. A FAR below ``1/n`` cannot be measured with ``n``
impostor pairs: its threshold is ``None``.

The thresholds come from the validation split only — never from test data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CALIBRATION_FARS", "calibration_table", "threshold_at"]

CALIBRATION_FARS = (1e-2, 1e-3, 1e-4)
DECISION = "accept iff score > threshold"


def calibration_table(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    fars: Sequence[float] = CALIBRATION_FARS,
    *,
    max_impostors: int | None = None,
    seed: int = 0,
    source: str = "validation pairs",
) -> dict[str, Any]:
    """Thresholds at ``fars`` from the pairs of ``embeddings`` ``[N, D]`` with ``labels`` ``[N]``.

    Returns a JSON-ready dict: ``source``, ``decision``, ``num_genuine``, ``num_impostor``,
    ``eer``, and ``rows`` — one ``{"far", "threshold", "tar"}`` per target FAR, ``threshold``
    and ``tar`` ``None`` where not measurable. With fewer than two samples, or no genuine
    or no impostor pair, every row is ``None`` and ``unavailable`` says why.
    """
    from marginkit.metrics import pair_scores, verification_metrics

    fars = [float(f) for f in fars]
    table: dict[str, Any] = {"source": source, "decision": DECISION}
    labels = labels.reshape(-1)
    counts = torch.unique(labels, return_counts=True)[1] if labels.numel() else torch.zeros(0)
    reason = None
    if labels.numel() < 2:
        reason = f"{labels.numel()} {source.split()[0]} sample(s): no pair to score"
    elif counts.numel() < 2:
        reason = f"all {source} share one label: no impostor pair"
    elif int(counts.max()) < 2:
        reason = f"every label occurs once in the {source}: no genuine pair"
    if reason is not None:
        table.update(num_genuine=0, num_impostor=0, eer=None, unavailable=reason)
        table["rows"] = [{"far": f, "threshold": None, "tar": None} for f in fars]
        return table
    scores, genuine = pair_scores(embeddings, labels, max_impostors=max_impostors, seed=seed)
    ver = verification_metrics(scores, genuine, fars=fars)
    table.update(num_genuine=int(ver["num_genuine"]), num_impostor=int(ver["num_impostor"]))
    table["eer"] = float(ver["eer"])  # type: ignore[arg-type]
    thresholds, tars = ver["thresholds"], ver["tar_at_far"]
    table["rows"] = [
        {"far": f, "threshold": thresholds[f], "tar": tars[f]}  # type: ignore[index]
        for f in fars
    ]
    return table


def threshold_at(table: dict[str, Any], far: float) -> float:
    """The threshold of ``table`` (from :func:`calibration_table`) at target FAR ``far``.

    Raises:
        ValueError: ``far`` is not a row of the table, or was not measurable.
    """
    far = float(far)
    for row in table.get("rows", []):
        if math.isclose(row["far"], far, rel_tol=1e-9):
            if row["threshold"] is None:
                why = table.get("unavailable") or (
                    f"{table.get('num_impostor', 0)} impostor pairs measure FARs down to "
                    f"{1 / max(1, table.get('num_impostor', 0)):.1e} only"
                )
                raise ValueError(f"no threshold at FAR {far:g}: {why}; choose another FAR or a threshold")
            return float(row["threshold"])
    have = ", ".join(f"{row['far']:g}" for row in table.get("rows", [])) or "none"
    raise ValueError(f"no calibrated threshold at FAR {far:g}; the table has FARs {have}")
