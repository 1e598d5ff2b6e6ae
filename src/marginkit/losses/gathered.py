"""Pair losses on the global batch: :class:`GatheredPairLoss` (defined with the distributed plumbing).

It wraps any pair loss and imports none, so it lives in :mod:`marginkit.distributed`; it is
re-exported here beside the losses it wraps.
"""

from marginkit.distributed import GatheredPairLoss

__all__ = ["GatheredPairLoss"]
