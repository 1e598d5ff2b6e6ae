r"""The evaluation protocols of ``marginkit eval --protocol`` (and ``compare --protocol``).

Each protocol is computed on a run's *test* split, from the functions of
:mod:`marginkit.metrics`; nothing is fitted or chosen on the test trials:

- ``verification`` — every genuine and up to ``max_impostors`` impostor test pairs
  (:func:`~marginkit.metrics.pair_scores`, seeded by the run's seed), then
  :func:`~marginkit.metrics.verification_metrics` (EER, TAR@FAR, AUC, minDCF);
- ``identification`` — :func:`~marginkit.metrics.open_set_split` of the test identities
  (half of them enrolled with one gallery sample each, their other samples mated probes, every
  sample of the rest a non-mated probe; seeded by the run's seed), then
  :func:`~marginkit.metrics.identification_metrics` (CMC at ranks 1, 5, 10; DIR at FPIR 1e-1,
  1e-2, 1e-3), the CMC curve and the open-set DET curve (FNIR against FPIR);
- ``templates`` — the test samples of each identity grouped at random into templates of
  ``template_size`` samples (:func:`~marginkit.metrics.random_templates`), pooled with
  :func:`~marginkit.metrics.template_features` (the IJB pooling), then verification of
  template pairs as above.

Score normalisation (``norm``, pair-score protocols only): the cohort is ``cohort`` embeddings
of the *training* split drawn at random (seeded by the run's seed) — identities disjoint from
the test's, so the data must be open-set; each trial side's cohort statistics come from
:func:`~marginkit.metrics.cohort_stats` (the ``top_k`` largest scores for AS-norm) and the
trial scores from :func:`~marginkit.metrics.normalize_scores`.

Calibration: logistic regression (:func:`~marginkit.metrics.calibrate`) fitted on the same
protocol's trials of the *validation* split (normalised alike), applied to the test scores:
``cllr`` and ``actual_dcf`` (at the minDCF's ``p_target``) of the calibrated test llrs;
``min_cllr`` needs no fit. Without validation trials to fit on (no validation split, one
identity, or validation scores separated perfectly) ``cllr`` and ``actual_dcf`` are ``None``
and ``calibration.skipped`` says why.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line reads PROTOCOLS and NORMS without importing torch
    import numpy as np
    import torch

PROTOCOLS = ("verification", "identification", "templates")
NORMS = ("s-norm", "as-norm", "z-norm", "t-norm")
RANKS = (1, 5, 10)
FPIRS = (1e-1, 1e-2, 1e-3)
ENROLLED_FRACTION = 0.5
GALLERY_PER_SUBJECT = 1
MAX_CMC_RANK = 50  # the report's CMC curve

__all__ = ["NORMS", "PROTOCOLS", "ProtocolOptions", "check_protocol_data", "evaluate_protocol"]


@dataclasses.dataclass(frozen=True)
class ProtocolOptions:
    """What ``--protocol`` evaluates; built and checked by :meth:`from_flags`."""

    protocol: str = "verification"
    cohort: int | None = None
    norm: str | None = None
    top_k: int | None = None
    template_size: int = 4

    @classmethod
    def from_flags(
        cls,
        protocol: str | None,
        *,
        cohort: int | None = None,
        norm: str | None = None,
        top_k: int | None = None,
        template_size: int | None = None,
    ) -> ProtocolOptions | None:
        """The options of the command-line flags (``None``: no protocol); ``ValueError`` naming the flag."""
        if protocol is None:
            given = [f for f, v in (("--cohort", cohort), ("--norm", norm), ("--top-k", top_k),
                                    ("--template-size", template_size)) if v is not None]  # fmt: skip
            if given:
                raise ValueError(f"{given[0]} needs --protocol ({' | '.join(PROTOCOLS)})")
            return None
        if protocol not in PROTOCOLS:
            raise ValueError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if norm is not None and norm not in NORMS:
            raise ValueError(f"--norm must be one of {', '.join(NORMS)}, got {norm!r}")
        if cohort is not None and cohort < 2:
            raise ValueError(f"--cohort must be >= 2 (training embeddings in the cohort), got {cohort}")
        if norm is not None and cohort is None:
            raise ValueError(f"--norm {norm} needs --cohort N (cohort embeddings from the training split)")
        if cohort is not None and norm is None:
            raise ValueError(f"--cohort {cohort} needs --norm ({' | '.join(NORMS)})")
        if norm is not None and protocol == "identification":
            raise ValueError(
                "--norm normalises pair scores: use it with --protocol verification or templates, "
                "not identification"
            )
        if top_k is not None:
            if norm is None:
                raise ValueError("--top-k needs --norm as-norm (or z-norm / t-norm) and --cohort N")
            if norm == "s-norm":
                raise ValueError("--top-k with S-norm is adaptive S-norm: use --norm as-norm")
            if top_k < 2:
                raise ValueError(f"--top-k must be >= 2 (one cohort score has no spread), got {top_k}")
            if cohort is not None and top_k > cohort:
                raise ValueError(f"--top-k {top_k} exceeds --cohort {cohort}")
        if norm == "as-norm" and top_k is None:
            assert cohort is not None
            top_k = max(2, cohort // 10)
        if template_size is not None:
            if protocol != "templates":
                raise ValueError("--template-size applies to --protocol templates only")
            if template_size < 1:
                raise ValueError(f"--template-size must be >= 1, got {template_size}")
        return cls(protocol, cohort, norm, top_k, 4 if template_size is None else template_size)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.protocol}
        if self.protocol == "templates":
            out["template_size"] = self.template_size
        if self.norm is not None:
            out.update(norm=self.norm, cohort=self.cohort, top_k=self.top_k)
        return out


def _counts(labels: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.unique(labels, return_counts=True)[1]


def check_protocol_data(options: ProtocolOptions, splits: Any) -> None:
    """Refuse a protocol the data cannot support, before any work (``ValueError`` naming the flag)."""
    name = getattr(splits, "name", "the data")
    counts = _counts(splits.test.y)
    if options.norm is not None:
        if not splits.open_set:
            raise ValueError(
                f"--norm needs open-set data (training identities disjoint from the test's): in {name}, "
                "the test classes are training classes, so a training cohort holds the test identities"
            )
        assert options.cohort is not None
        if options.cohort > len(splits.train):
            raise ValueError(
                f"--cohort {options.cohort} exceeds the {len(splits.train)} training samples of {name} "
                "(the cohort is drawn from the training split)"
            )
    if counts.numel() < 2:
        raise ValueError(f"--protocol {options.protocol} needs at least 2 test identities; {name} has 1")
    if options.protocol == "verification" and int(counts.max()) < 2:
        raise ValueError(
            f"--protocol verification needs an identity with 2 test samples (a genuine pair); {name} has "
            "one sample per test identity"
        )
    if options.protocol == "identification" and int(counts.max()) <= GALLERY_PER_SUBJECT:
        raise ValueError(
            f"--protocol identification needs identities with more than {GALLERY_PER_SUBJECT} test "
            f"sample (one in the gallery, the others probes); {name} has one per identity"
        )
    if options.protocol == "templates" and int(counts.max()) < 2 * options.template_size:
        raise ValueError(
            f"--protocol templates with --template-size {options.template_size} needs an identity with "
            f"{2 * options.template_size} test samples (two templates); {name} has at most "
            f"{int(counts.max())}"
        )


# ---------------------------------------------------------------------- pair-score protocols
def _cohort(train_emb: torch.Tensor, options: ProtocolOptions, seed: int) -> torch.Tensor:
    import torch

    assert options.cohort is not None
    gen = torch.Generator().manual_seed(seed)
    return train_emb[torch.randperm(train_emb.shape[0], generator=gen)[: options.cohort]]


def _trials(emb: torch.Tensor, labels: torch.Tensor, options: ProtocolOptions, seed: int, cap: int | None):
    """``(side embeddings, side labels, scores, genuine, pairs)`` of the protocol's trials."""
    from marginkit.metrics import pair_scores, random_templates, template_features

    if options.protocol == "templates":
        template_ids, labels = random_templates(labels, size=options.template_size, seed=seed)
        emb = template_features(emb, template_ids)[1]
    scores, genuine, pairs = pair_scores(emb, labels, max_impostors=cap, seed=seed, return_pairs=True)
    return emb, labels, scores, genuine, pairs


def _normalized(scores, emb, pairs, cohort: torch.Tensor, options: ProtocolOptions) -> torch.Tensor:
    from marginkit.metrics import cohort_stats, normalize_scores

    stats = cohort_stats(emb, cohort, top_k=options.top_k)
    return normalize_scores(scores, stats, stats, method=options.norm, trials=pairs)


def _calibration(val, test_scores, test_genuine, p_target: float) -> dict[str, Any]:
    """``cllr``, ``min_cllr``, ``actual_dcf`` of the test scores calibrated on validation trials."""
    from marginkit.metrics import actual_dcf, calibrate, cllr, min_cllr

    out: dict[str, Any] = {"min_cllr": min_cllr(test_scores, test_genuine), "cllr": None, "actual_dcf": None}
    if isinstance(val, str):
        out["calibration"] = {"skipped": val}
        return out
    scores, genuine = val
    try:
        cal = calibrate(scores, genuine)
    except ValueError as exc:  # perfectly separated validation scores: no finite fit
        out["calibration"] = {"skipped": str(exc).split(":")[0]}
        return out
    llr = cal.llr(test_scores)
    out["cllr"] = cllr(llr, test_genuine)
    out["actual_dcf"] = actual_dcf(llr, test_genuine, p_target=p_target)
    out["calibration"] = {
        "fitted_on": "validation split",
        "slope": cal.slope,
        "offset": cal.offset,
        "num_genuine": cal.num_genuine,
        "num_impostor": cal.num_impostor,
    }
    return out


def _val_scores(val_emb, y_val, options, seed, cap, cohort) -> tuple[torch.Tensor, torch.Tensor] | str:
    """The validation trials' scores (normalised like the test's), or why there are none."""
    if y_val.numel() < 2:
        return "no validation split"
    counts = _counts(y_val)
    need = 2 * options.template_size if options.protocol == "templates" else 2
    if counts.numel() < 2 or int(counts.max()) < need:
        return "the validation split has no genuine and impostor trials of this protocol"
    emb, _, scores, genuine, pairs = _trials(val_emb, y_val, options, seed, cap)
    if cohort is not None:
        scores = _normalized(scores, emb, pairs, cohort, options)
    return scores, genuine


def _pair_protocol(
    options: ProtocolOptions, embs: dict[str, torch.Tensor], labels: dict[str, torch.Tensor], *,
    seed: int, cap: int | None, fars: tuple[float, ...],
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:  # fmt: skip
    from marginkit.metrics import det_curve, verification_metrics

    key = "templates" if options.protocol == "templates" else "verification"
    emb, side_labels, scores, genuine, pairs = _trials(embs["test"], labels["test"], options, seed, cap)
    cohort = _cohort(embs["train"], options, seed) if options.norm else None
    variants = {key: (scores, None)}
    if cohort is not None:
        variants[f"{key}_normalized"] = (_normalized(scores, emb, pairs, cohort, options), cohort)
    metrics: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for name, (s, with_cohort) in variants.items():
        m = verification_metrics(s, genuine, fars=fars)
        val = _val_scores(embs["val"], labels["val"], options, seed, cap, with_cohort)
        m.update(_calibration(val, s, genuine, m["dcf_params"]["p_target"]))
        if options.protocol == "templates":
            m["num_templates"] = int(side_labels.numel())
            m["template_size"] = options.template_size
        if name.endswith("_normalized"):
            m["normalization"] = {"method": options.norm, "cohort": options.cohort, "top_k": options.top_k,
                                  "cohort_from": "training split", "seed": seed}  # fmt: skip
        metrics[name] = m
        det = det_curve(s, genuine)
        arrays[f"det_{name}_p_fa"], arrays[f"det_{name}_p_miss"] = det["p_fa"].numpy(), det["p_miss"].numpy()
    return metrics, arrays


# ---------------------------------------------------------------------- identification
def _identification(
    test_emb: torch.Tensor, y_test: torch.Tensor, *, seed: int, metric: str
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from marginkit.metrics import open_set_split, search_gallery

    gallery, probes = open_set_split(
        y_test, enrolled_fraction=ENROLLED_FRACTION, gallery_per_subject=GALLERY_PER_SUBJECT, seed=seed
    )
    search = search_gallery(
        test_emb[probes], y_test[probes], test_emb[gallery], y_test[gallery], metric=metric
    )
    m = search.metrics(RANKS, FPIRS)
    m["split"] = {"enrolled_fraction": ENROLLED_FRACTION, "gallery_per_subject": GALLERY_PER_SUBJECT,
                  "gallery_size": int(gallery.numel()), "seed": seed}  # fmt: skip
    ranks, rates = search.cmc_curve(MAX_CMC_RANK)
    arrays = {"cmc_rank": ranks.numpy(), "cmc_rate": rates.numpy()}
    if search.num_nonmated:
        det = search.det_curve()
        arrays["det_identification_p_fa"] = det["fpir"].numpy()
        arrays["det_identification_p_miss"] = det["fnir"].numpy()
    return {"identification": m}, arrays


def evaluate_protocol(
    options: ProtocolOptions,
    embeddings: dict[str, torch.Tensor],
    labels: dict[str, torch.Tensor],
    *,
    seed: int,
    metric: str = "cosine",
    max_impostors: int | None = None,
    fars: tuple[float, ...] = (1e-1, 1e-2, 1e-3, 1e-4),
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The protocol's metrics (keyed ``verification``, ``verification_normalized``,
    ``identification``, ``templates``, ``templates_normalized``, plus ``protocol``) and the
    report's curves (``det_<key>_p_fa`` / ``det_<key>_p_miss``, ``cmc_rank`` / ``cmc_rate``).

    ``embeddings`` / ``labels``: ``train``, ``val`` and ``test`` of the run (``val`` may be empty).
    """
    if options.protocol == "identification":
        metrics, arrays = _identification(embeddings["test"], labels["test"], seed=seed, metric=metric)
    else:
        metrics, arrays = _pair_protocol(options, embeddings, labels, seed=seed, cap=max_impostors, fars=fars)
    metrics["protocol"] = options.as_dict()
    return metrics, arrays
