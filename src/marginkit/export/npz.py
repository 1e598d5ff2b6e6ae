"""``marginkit.export.read_npz``: the bounded, pickle-free ``.npz`` reader of :mod:`marginkit._npz`
(it lives in the bottom layer, so that the data readers and the K-NN index use it too)."""

from marginkit._npz import NpzError, read_npz

__all__ = ["NpzError", "read_npz"]
