"""What the study runs: data settings, losses, seeds and the training budget of each mode."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["KNN_LOSSES", "StudyPlan", "study_plan"]

#: Losses of section 1 (small-data K-NN), in table order.
KNN_LOSSES = ("softmax", "cosface", "qmargin", "mep", "circle", "triplet", "local_triplet")
#: Losses of section 6 (transfer to unseen classes).
TRANSFER_LOSSES = ("softmax", "cosface", "circle", "triplet", "local_triplet")


@dataclass
class StudyPlan:
    """Every knob of one study run (saved as ``plan.json`` next to the results).

    ``steps`` is the optimiser-step budget of one training run: a run's epochs are
    ``ceil(steps / steps_per_epoch)``, so tiny training sets are not under-trained.
    ``knn_settings`` are ``(data, train_per_class or None, seeds)``.
    """

    mode: str
    steps: int
    knn_settings: list[tuple[str, int | None, int]]
    knn_losses: tuple[str, ...] = KNN_LOSSES
    identity_seeds: int = 3
    identity_options: dict[str, Any] = field(default_factory=dict)
    qmargin_alphas: tuple[float, ...] = (1.25, 1.5)
    qmargin_scales: tuple[float, ...] = (8.0, 16.0, 32.0)
    identity_steps: int = 300
    mep_settings: list[tuple[str, int | None, int]] = field(default_factory=list)
    mep_margin: float = 4.0
    mep_scale: float = 16.0
    transfer_data: tuple[str, ...] = ("digits", "mnist1d")
    transfer_losses: tuple[str, ...] = TRANSFER_LOSSES
    transfer_seeds: int = 3
    transfer_refs: tuple[int, ...] = (1, 5)
    transfer_draws: int = 5
    bench_args: list[str] = field(default_factory=list)
    jobs: int = 2
    k: int = 5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def study_plan(quick: bool = False, jobs: int = 2) -> StudyPlan:
    """The full study (budgeted for ~60 min on 2 cores) or the ``--quick`` CI smoke version."""
    if quick:
        return StudyPlan(
            mode="quick",
            steps=8,
            knn_settings=[("mnist1d", 50, 1), ("digits", 10, 1), ("breast_cancer", None, 1)],
            identity_seeds=1,
            identity_options={
                "num_train_identities": 40,
                "train_samples_per_identity": 10,
                "num_val_identities": 10,
                "num_test_identities": 30,
                "test_samples_per_identity": 6,
            },
            qmargin_scales=(8.0, 16.0),
            identity_steps=8,
            mep_settings=[("digits", 10, 1)],
            transfer_data=("digits",),
            transfer_seeds=1,
            transfer_draws=2,
            bench_args=["--quick", "--threads", "1", "--entmax-max-classes", "0"],
            jobs=jobs,
        )
    return StudyPlan(
        mode="full",
        steps=300,
        knn_settings=[
            ("mnist1d", 50, 3),
            ("mnist1d", 100, 3),
            ("mnist1d", None, 3),
            ("digits", 10, 5),
            ("digits", 30, 5),
            ("breast_cancer", None, 5),
        ],
        identity_seeds=5,
        identity_steps=300,
        mep_settings=[("mnist1d", 100, 3), ("digits", 30, 5)],
        bench_args=[
            "--classes",
            "10000",
            "100000",
            "1000000",
            "--repeats",
            "3",
            "--threads",
            "1",
            "--entmax-max-classes",
            "0",
        ],
        jobs=jobs,
    )
