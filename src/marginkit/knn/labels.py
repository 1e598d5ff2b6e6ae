"""Class labels as identifiers, with scikit-learn's estimator conventions.

A classifier's labels are any integers (an identity id of 10**12 included, negative ones too) or
strings. They are encoded once into *codes* ``0 .. C-1``, the positions of the labels in
``classes_``, the sorted distinct labels (``numpy.unique``), as scikit-learn's
``KNeighborsClassifier`` stores ``classes_`` and ``_y``: votes, ``predict_proba`` columns and
ties (to the smallest code, i.e. the smallest label) work on codes, and :meth:`Classes.decode`
turns codes back into the caller's labels. Nothing is ever sized by the largest label.

Integer labels stay torch tensors (on their device); string labels are numpy ``str`` arrays
(torch has no strings). ``classes_`` is a numpy array in both cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from marginkit._validation import label_tensor

__all__ = ["Classes", "check_label_values"]

Labels = torch.Tensor | np.ndarray  # int64 tensor, or a numpy str array


def check_label_values(labels: Any, name: str, num_rows: int, rows_name: str) -> Labels:
    """Labels of ``num_rows`` rows as an int64 tensor (integers) or a numpy ``str`` array (strings).

    Accepts a torch integer tensor, or anything ``numpy.asarray`` takes holding integers or
    strings (a list of names, a numpy array). Booleans, floats, bytes and mixed types are refused
    by name: labels are identifiers, not numbers to round.
    """
    if isinstance(labels, torch.Tensor):
        label_tensor(labels, name)
        values: Labels = labels
    else:
        values = _numpy_labels(labels, name)
    if values.ndim != 1 or values.shape[0] != num_rows:
        raise ValueError(
            f"{name} must have shape ({num_rows},), one label per row of {rows_name}; "
            f"got shape {tuple(values.shape)}"
        )
    return values.to(torch.long) if isinstance(values, torch.Tensor) else values


def _numpy_labels(labels: Any, name: str) -> Labels:
    try:  # a list keeps its Python types (np.asarray would turn ["a", 1] into strings)
        array = labels if isinstance(labels, np.ndarray) else np.asarray(labels, dtype=object)
    except (ValueError, TypeError, OverflowError) as exc:
        kind = type(labels).__name__
        raise TypeError(f"{name} must be integers or strings (one per row), got {kind}") from exc
    if array.dtype == object:
        items = array.reshape(-1).tolist()
        if all(isinstance(v, str) for v in items):
            array = array.astype(str)
        elif all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in items):
            if items and not -(2**63) <= min(items) <= max(items) < 2**63:
                top = max(map(abs, items))
                raise ValueError(f"{name} must fit in 64-bit integers, got values up to {top}")
            array = array.astype(np.int64)
        elif any(isinstance(v, str) for v in items):
            kinds = sorted({type(v).__name__ for v in items})
            raise TypeError(f"{name} must be all integers or all strings, got a mix of {', '.join(kinds)}")
        else:  # floats, booleans, ...: refused below by their dtype
            array = np.asarray(items).reshape(array.shape)
    kind = array.dtype.kind
    if kind == "U":
        return array
    if kind == "u" and array.size and int(array.max()) >= 2**63:
        raise ValueError(f"{name} must fit in 64-bit integers, got values up to {int(array.max())}")
    if kind in "iu":
        return torch.from_numpy(array.astype(np.int64))
    raise TypeError(
        f"{name} must be integers or strings (identifiers), got dtype {array.dtype}"
        + ("; cast whole-number floats to int first" if kind == "f" else "")
    )


@dataclass
class Classes:
    """The sorted distinct labels of a classifier (``values``, scikit-learn's ``classes_``).

    ``fixed``: the classes were declared up front (``num_classes``): labels outside them are an
    error instead of new classes.
    """

    values: np.ndarray
    fixed: bool = False

    @property
    def is_str(self) -> bool:
        return self.values.dtype.kind == "U"

    def __len__(self) -> int:
        return len(self.values)

    @classmethod
    def fixed_range(cls, num_classes: int) -> Classes:
        """The classes ``0 .. num_classes - 1`` declared up front."""
        return cls(np.arange(num_classes, dtype=np.int64), fixed=True)

    def _check_kind(self, labels: Labels, name: str) -> None:
        if len(self) and isinstance(labels, np.ndarray) != self.is_str:
            have = "strings" if self.is_str else "integers"
            got = "strings" if isinstance(labels, np.ndarray) else "integers"
            raise TypeError(f"{name} are {got}, but this classifier's classes are {have}")

    def merged(self, labels: Labels, name: str) -> tuple[Classes, torch.Tensor | None]:
        """The classes with those of ``labels`` added, and the map old code -> new code (``None``: same)."""
        self._check_kind(labels, name)
        new = torch.unique(labels).cpu().numpy() if isinstance(labels, torch.Tensor) else np.unique(labels)
        if self.fixed:
            outside = new[~np.isin(new, self.values)]
            if outside.size:
                lo, hi = self.values[0], self.values[-1]
                raise ValueError(
                    f"{name} must lie in [0, num_classes={len(self)}), got values in "
                    f"[{min(outside.min(), lo)}, {max(outside.max(), hi)}]"
                )
            return self, None
        values = np.union1d(self.values, new) if len(self) else new
        if len(values) == len(self):
            return self, None
        remap = torch.from_numpy(np.searchsorted(values, self.values).astype(np.int64))
        return Classes(values, self.fixed), remap

    def encode(self, labels: Labels, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, known)``: each label's position in the classes (0 if unknown), and whether it is one."""
        self._check_kind(labels, name)
        if isinstance(labels, torch.Tensor):
            values = torch.from_numpy(self.values).to(labels.device)
            pos = torch.searchsorted(values, labels).clamp_(max=max(len(self) - 1, 0))
            known = values[pos] == labels if len(self) else torch.zeros_like(labels, dtype=torch.bool)
            return torch.where(known, pos, 0), known
        pos = np.minimum(np.searchsorted(self.values, labels), max(len(self) - 1, 0))
        known = self.values[pos] == labels if len(self) else np.zeros(len(labels), dtype=bool)
        return torch.from_numpy(np.where(known, pos, 0).astype(np.int64)), torch.from_numpy(known)

    def decode(self, codes: torch.Tensor, *, as_numpy: bool) -> Labels:
        """The labels of ``codes``: a tensor on their device (integer classes, ``as_numpy`` false),
        else a numpy array (int64 or ``str``)."""
        if self.is_str or as_numpy:
            return self.values[codes.cpu().numpy()]
        return torch.from_numpy(self.values).to(codes.device)[codes]
