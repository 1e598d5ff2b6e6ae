"""Training, evaluation and checkpoints behind the ``marginkit`` command line."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "TrainConfig": "config",
        "ConfigError": "errors",
        "apply_overrides": "config",
        "load_config": "config",
        "LOSSES": "registry",
        "build_loss": "registry",
        "train": "trainer",
        "load_run": "rundir",
        "RunResult": "trainer",
        "evaluate_run": "evaluate",
        "load_checkpoint": "rundir",
        "CheckpointError": "errors",
    },
)
