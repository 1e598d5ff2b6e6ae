"""The checkpoint names, importable from here as before; they live in :mod:`marginkit.train.rundir`
(the one module for run-directory and checkpoint I/O) and :mod:`marginkit.train.runtime` (RNG states)."""

from marginkit.train.errors import CheckpointError
from marginkit.train.rundir import FORMAT, VERSION, atomic_save, atomic_write_text, load_checkpoint
from marginkit.train.runtime import capture_rng, restore_rng

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "atomic_save",
    "atomic_write_text",
    "capture_rng",
    "load_checkpoint",
    "restore_rng",
]
