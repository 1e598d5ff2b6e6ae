"""What the study runs: data settings, losses, seeds, tuning budget and protocols of each mode."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FACES",
    "FACE_AUGMENT",
    "FACE_LOSSES",
    "FACE_PEERS",
    "KNN_LOSSES",
    "PEER_LOSSES",
    "PEER_TRAIN_OPTIONS",
    "SPEAKERS",
    "StudyPlan",
    "identity_rows",
    "speaker_dir",
    "speaker_rows",
    "study_plan",
]

#: Losses of the small-data and retrieval sections, in table order.
KNN_LOSSES = ("softmax", "cosface", "qmargin", "mep", "circle", "triplet", "local_triplet")
#: The peers' losses (issue [5/6]), run at their registry defaults on the target setting.
PEER_LOSSES = (
    "arcface",
    "combined_margin",
    "subcenter_arcface",
    "adaface",
    "proxy_anchor",
    "multi_similarity",
    "supcon",
    "ntxent",
    "contrastive",
    "smooth_triplet",
)
#: Training options a peer loss cannot run without (AdaFace reads the embedding norms).
PEER_TRAIN_OPTIONS: dict[str, dict[str, Any]] = {"adaface": {"normalize": False}}
#: Real faces, people never seen in training: the seeds' losses, each without and with augmentation ...
FACE_LOSSES = ("qmargin", "circle", "local_triplet", "mep")
#: ... and the field's margin and pair baselines, without augmentation.
FACE_PEERS = ("cosface", "arcface", "triplet")
#: The augmentation of the faces section's "+ augment" rows (``--augment``).
FACE_AUGMENT = "flip,crop,rotate,brightness,contrast"
#: Where the faces section reads the Yale faces (``folder:`` spec), relative to the working directory:
#: the repository's root in a checkout beside ``shared/``. The section is skipped when it is absent.
FACES = "../shared/data/yalefaces"
#: The folder (in marginkit's cache, :func:`marginkit.data.datasets.resolve_cache_dir`) where the
#: speaker section reads its synthetic speakers: what ``python benchmarks/make_espeak_speakers.py
#: --speakers 40 --utterances 12`` writes by default. The section is skipped, saying how to make
#: them, when they are absent.
SPEAKERS = "espeak_speakers"


@dataclass
class StudyPlan:
    """Every knob of one study run (saved as ``plan.json`` next to the results).

    Settings are ``(data, train_per_class or None)``; every setting runs ``seeds`` seeds
    (seed = data subset + initialisation + batch order), the same seeds for every loss, so
    comparisons are paired. ``train_options`` override the library defaults for every
    training run (the quick mode's tiny budget); the full study runs the defaults.
    """

    mode: str
    seeds: int
    tune_data: str
    tune_per_class: int
    tune_val_fraction: float
    trials: int
    startup_trials: int
    knn_settings: list[tuple[str, int | None]]
    paper_settings: list[tuple[str, int | None]]
    disjoint_settings: list[tuple[str, int | None]]
    margin_settings: list[tuple[str, int | None]]
    identity_options: dict[str, Any] = field(default_factory=dict)
    knn_losses: tuple[str, ...] = KNN_LOSSES
    tune_losses: tuple[str, ...] = KNN_LOSSES
    peer_losses: tuple[str, ...] = PEER_LOSSES
    dev_seed: int = 100
    sampler_seed: int = 0
    train_options: dict[str, Any] = field(default_factory=dict)
    margin_scale: float = 16.0
    margin_margin: float = 4.0
    margin_epochs: int = 50
    margin_lr: float = 3e-3
    e2e: dict[str, Any] = field(default_factory=dict)
    jobs: int = 2
    k: int = 5
    faces: str = FACES
    # 32 × 32: the resolution of the usual downsampled Yale set (Cai et al.); at 64 × 64 the
    # section's 102 runs alone took 73 min of the study's wall time on 2 cores.
    faces_options: dict[str, Any] = field(default_factory=lambda: {"image_size": 32, "folds": 3})
    faces_seeds: int = 3
    face_losses: tuple[str, ...] = FACE_LOSSES
    face_peers: tuple[str, ...] = FACE_PEERS
    face_augment: str = FACE_AUGMENT
    speakers: str = SPEAKERS  # a folder; relative: inside marginkit's cache
    speaker_seeds: int = 3
    # a small ECAPA-TDNN (64 channels instead of 512) that trains on 2 CPU cores in minutes
    speaker_train: dict[str, Any] = field(
        default_factory=lambda: {
            "model": "ecapa_tdnn",
            "model_options": {"channels": 64, "aggregation_channels": 192},
            "epochs": 10,
            "batch_size": 32,
        }
    )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_E2E = {
    "classes": [10_000, 100_000],
    "batch": 256,
    "input_dim": 256,
    "hidden": [512, 512],
    "dim": 128,
    "rounds": 5,
    "methods": {"CosFace": ["cosface", {}], "ArcFace": ["arcface", {}], "Q-Margin": ["qmargin", {}]},
}


_QUICK_DATA = [("digits", 10)]
#: What ``--quick`` changes in the full plan: one small setting, tiny budgets.
_QUICK: dict[str, Any] = {
    "mode": "quick",
    "seeds": 3,
    "tune_data": "digits",
    "tune_val_fraction": 0.1,
    "trials": 2,
    "startup_trials": 1,
    "knn_settings": _QUICK_DATA,
    "paper_settings": _QUICK_DATA,
    "disjoint_settings": _QUICK_DATA,
    "margin_settings": _QUICK_DATA,
    "knn_losses": ("softmax", "qmargin", "triplet", "local_triplet"),
    "tune_losses": ("softmax", "local_triplet"),
    "peer_losses": ("arcface", "adaface", "multi_similarity"),
    "identity_options": {
        "num_train_identities": 30,
        "train_samples_per_identity": 6,
        "num_val_identities": 5,
        "num_test_identities": 20,
        "test_samples_per_identity": 5,
    },
    "train_options": {"epochs": 3},
    "margin_epochs": 3,
    "e2e": {**_E2E, "classes": [1000], "rounds": 2, "batch": 32, "hidden": [64]},
    "faces_options": {"image_size": 16, "folds": 3},
    "faces_seeds": 1,
    "face_losses": ("circle",),
    "face_peers": ("cosface",),
    "speaker_seeds": 1,
    "speaker_train": {
        "model": "ecapa_tdnn",
        "model_options": {"channels": 16, "aggregation_channels": 48},
        "epochs": 1,
        "batch_size": 32,
    },
}


def study_plan(quick: bool = False, jobs: int = 2) -> StudyPlan:
    """The full study or the ``--quick`` CI smoke version (same sections, tiny budget)."""
    full = StudyPlan(
        mode="full",
        seeds=5,
        tune_data="mnist-sample",
        tune_per_class=10,
        tune_val_fraction=0.05,
        trials=6,
        startup_trials=3,
        knn_settings=[
            ("mnist-sample", 10),
            ("japanese-vowels", 10),
            ("japanese-vowels", None),
            ("digits", 10),
            ("digits", 50),
            ("digits", 100),
            ("mnist1d", 10),
            ("mnist1d", 50),
            ("mnist1d", 100),
            ("breast_cancer", 10),
            ("breast_cancer", 50),
            ("breast_cancer", 100),
        ],
        paper_settings=[("mnist-sample", 10)],
        disjoint_settings=[("japanese-vowels", None), ("digits", None), ("mnist1d", 100)],
        margin_settings=[("mnist-sample", 10)],
        identity_options={"num_test_identities": 150},  # 1,500 test samples: 1.1e6 impostor pairs
        e2e=dict(_E2E),
        jobs=jobs,
    )
    return dataclasses.replace(full, **copy.deepcopy(_QUICK)) if quick else full


def identity_rows() -> list[tuple[str, str, dict[str, Any]]]:
    """(label, loss, loss_options) of the verification section: defaults, then published settings."""
    from marginkit.study.tuning import PAPER, QMARGIN_SPEAKER

    rows = [
        (f"{name} (defaults)", loss, {})
        for name, loss in (("ArcFace", "arcface"), ("CosFace", "cosface"), ("Q-Margin", "qmargin"))
    ]
    for name, loss in (("ArcFace", "arcface"), ("CosFace", "cosface"), ("Q-Margin", "qmargin")):
        rows.append((f"{name} ({PAPER[loss][0].split(': ', 1)[1]})", loss, PAPER[loss][1]))
    rows.append((f"Q-Margin ({QMARGIN_SPEAKER[0].split(': ', 1)[1]})", "qmargin", QMARGIN_SPEAKER[1]))
    return rows


def speaker_dir(plan: StudyPlan) -> Path:
    """The speaker section's folder (``plan.speakers``; a relative one in marginkit's cache)."""
    from marginkit.data.datasets import resolve_cache_dir

    where = Path(plan.speakers).expanduser()
    return where if where.is_absolute() else resolve_cache_dir() / where


def speaker_rows() -> list[tuple[str, str, dict[str, Any]]]:
    """(label, loss, loss_options) of the speaker section: Q-Margin at the paper's speaker
    settings against the margins speaker toolkits train with (wespeaker's AAM-softmax, s = 32,
    m = 0.2, and the same for CosFace's additive margin)."""
    from marginkit.study.tuning import QMARGIN_SPEAKER

    return [
        (f"Q-Margin ({QMARGIN_SPEAKER[0].split(': ', 1)[1]})", "qmargin", dict(QMARGIN_SPEAKER[1])),
        ("ArcFace (wespeaker: s = 32, m = 0.2)", "arcface", {"scale": 32.0, "margin": 0.2}),
        ("CosFace (s = 32, m = 0.2)", "cosface", {"scale": 32.0, "margin": 0.2}),
    ]
