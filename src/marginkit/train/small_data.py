"""The small-data rules of a training run, in one place (``docs/defaults.md`` says how they were chosen).

1. **Validation split.** ``val_fraction`` of each class is held out for checkpoint selection
   only when that gives at least :data:`MIN_VAL_PER_CLASS` samples per class on average.
   Below that, a validation accuracy cannot tell checkpoints apart (on 10 samples one
   mistake moves it by 10 points) and the held-out samples are worth more as training data:
   no validation split is carved, every sample trains, and the run keeps its *last*
   checkpoint (the cosine schedule has decayed to zero there). :func:`marginkit.data.load_dataset`
   applies the rule (``min_val_per_class``) and its warning says what it did.
2. **Epochs.** ``epochs: null`` (the default) means :func:`auto_epochs`: at least
   :data:`AUTO_MIN_EPOCHS` epochs and at least :data:`AUTO_MIN_SAMPLES` training samples
   seen, so that 100 images get as many optimiser steps as the budget the study tuned,
   not 10 epochs of one step each. An explicit ``epochs`` is always kept.
"""

from __future__ import annotations

import dataclasses
import math

from marginkit.train.config import TrainConfig

__all__ = ["AUTO_MIN_EPOCHS", "AUTO_MIN_SAMPLES", "MIN_VAL_PER_CLASS", "auto_epochs", "resolve_epochs"]

#: A validation split is carved only when it holds at least this many samples per class on average.
MIN_VAL_PER_CLASS = 10
#: ``epochs: null``: at least this many epochs ...
AUTO_MIN_EPOCHS = 10
#: ... and at least this many training samples seen (epochs × training-set size).
AUTO_MIN_SAMPLES = 5_000


def auto_epochs(n_train: int) -> int:
    """``max(AUTO_MIN_EPOCHS, ceil(AUTO_MIN_SAMPLES / n_train))``.

    >>> auto_epochs(100), auto_epochs(1000), auto_epochs(4000)
    (50, 10, 10)
    """
    if n_train < 1:
        raise ValueError(f"n_train must be >= 1, got {n_train}")
    return max(AUTO_MIN_EPOCHS, math.ceil(AUTO_MIN_SAMPLES / n_train))


def resolve_epochs(config: TrainConfig, n_train: int) -> TrainConfig:
    """``config`` with ``epochs`` set by :func:`auto_epochs` when it is ``None``; else ``config``."""
    if config.epochs is not None:
        return config
    return dataclasses.replace(config, epochs=auto_epochs(n_train)).validate()
