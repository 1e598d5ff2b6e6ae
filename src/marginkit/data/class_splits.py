"""Which classes train, validate and test: the class-disjoint (open-set) splits of any data set.

Open-set evaluation — faces, speakers or products never seen in training — needs splits whose
*classes* are disjoint, not only their samples (Musgrave, Belongie & Lim, "A Metric Learning
Reality Check", ECCV 2020: CUB-200, Cars-196 and SOP train on the first half of the classes in
sorted order and test on the second half). :func:`choose_classes` decides the classes of each
split from the data set's class list; :func:`class_split_note` says what it did. The samples
follow their class (:func:`marginkit.data.load_dataset` moves them).

Modes (the ``split`` data option):

- ``source`` — the source's own train / test split, as given;
- ``samples`` — all samples pooled and re-split per class (stratified, ``test_fraction``):
  closed-set, every class in training and test;
- ``classes`` — ``test_classes`` (a fraction, a count or a list of names / ids) drawn at random
  (``split_seed``), or ``folds`` / ``fold``: the classes shuffled and cut into ``folds`` groups,
  group ``fold`` tests (leave-classes-out cross-validation);
- ``halves`` — the retrieval benchmarks' convention: the first ``C // 2`` classes in the data
  set's class order train, the rest test.

``val_classes`` (any mode) moves whole classes from the training side to validation, drawn at
random (``split_seed``) from the classes that neither test nor were named elsewhere; model
selection then happens on classes never trained on, as the test does.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SPLIT_MODES", "ClassSplit", "choose_classes", "class_split_note", "resolve_class_list"]

SPLIT_MODES = ("source", "samples", "classes", "halves")

#: Fewest classes a side of a class-disjoint split may have: training needs two classes to tell
#: apart, verification needs impostor pairs.
MIN_CLASSES = 2


@dataclass(frozen=True)
class ClassSplit:
    """Class indices (into the data set's class list, ascending) of each split."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


def _as_list(value: Any) -> list[Any] | None:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def resolve_class_list(value: Sequence[Any], names: Sequence[str], option: str) -> np.ndarray:
    """Class indices of an explicit list: each entry is a class name, or an integer id (the
    class named ``str(id)`` if there is one, else the id-th class)."""
    index = {name: i for i, name in enumerate(names)}
    out: list[int] = []
    for entry in value:
        if isinstance(entry, bool) or not isinstance(entry, (str, numbers.Integral)):
            raise ValueError(f"{option}: entries must be class names or integer ids, got {entry!r}")
        key = str(entry)
        if key in index:
            out.append(index[key])
        elif isinstance(entry, numbers.Integral) and 0 <= int(entry) < len(names):
            out.append(int(entry))
        else:
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"{option}: no class {entry!r}; the classes are {shown}")
    if len(set(out)) != len(out):
        raise ValueError(f"{option} names a class twice: {list(value)!r}")
    return np.asarray(sorted(out), dtype=np.int64)


def _count(value: Any, available: int, option: str) -> int:
    """How many of ``available`` classes a fraction in (0, 1) or a count >= 1 asks for."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{option} must be a fraction in (0, 1), a count >= 1 or a list of class names / ids, "
            f"got {value!r}"
        )
    if isinstance(value, numbers.Integral):
        count = int(value)
        if count < 1:
            raise ValueError(f"{option} must be a count >= 1 (or a fraction in (0, 1)), got {count}")
        return count
    frac = float(value)
    if not 0 < frac < 1:
        raise ValueError(f"{option} must be a fraction in (0, 1) (or a count >= 1), got {frac}")
    return max(1, int(np.floor(frac * available + 0.5)))


def _pick(
    value: Any,
    candidates: np.ndarray,
    names: Sequence[str],
    option: str,
    rng: np.random.Generator,
    needed_left: int,
) -> np.ndarray:
    """Classes of ``candidates`` chosen by ``value`` (list, count or fraction), leaving at least
    ``needed_left`` of them unchosen."""
    listed = _as_list(value)
    if listed is not None:
        chosen = resolve_class_list(listed, names, option)
        outside = np.setdiff1d(chosen, candidates)
        if outside.size:
            raise ValueError(
                f"{option}: {', '.join(names[c] for c in outside[:5])} cannot be chosen here (no samples, "
                "or already taken by another split)"
            )
    else:
        count = _count(value, len(candidates), option)
        if count > len(candidates):
            raise ValueError(
                f"{option}={value!r} asks for {count} classes, but only {len(candidates)} are left"
            )
        chosen = np.sort(rng.permutation(candidates)[:count])
    if len(candidates) - len(chosen) < needed_left:
        raise ValueError(
            f"{option}={value!r} takes {len(chosen)} of {len(candidates)} classes and leaves "
            f"{len(candidates) - len(chosen)}; at least {needed_left} must remain for training"
        )
    return chosen.astype(np.int64)


def choose_classes(
    present: np.ndarray,
    names: Sequence[str],
    *,
    mode: str,
    test_classes: Any = None,
    val_classes: Any = None,
    folds: int | None = None,
    fold: int | None = None,
    seed: int = 0,
    source_test: np.ndarray | None = None,
) -> ClassSplit:
    """The classes of each split.

    Args:
        present: class indices that have samples (only these are split); for ``"source"``,
            the classes of the source's training side.
        names: every class's name (``names[i]`` for class ``i``).
        mode: ``"classes"`` or ``"halves"`` choose the test classes; ``"source"`` keeps
            ``source_test`` (the source's test classes) and ``"samples"`` every class, and
            both only carve ``val_classes``.
        test_classes, folds, fold: ``mode="classes"`` only (see the module doc).
        val_classes: fraction / count / list of validation classes, or ``None``.
        seed: ``split_seed``: draws the test (``classes``) and validation classes.
        source_test: for ``source`` / ``samples``: classes the test side holds.

    Returns:
        :class:`ClassSplit` (``val`` empty when ``val_classes`` is ``None``). For ``source`` /
        ``samples``, ``train`` is every present class that is not validation (and ``test``
        may share classes with it: a closed set).
    """
    present = np.unique(np.asarray(present, dtype=np.int64))
    rng = np.random.default_rng([int(seed), 0x636C73])  # "cls": independent of the sample splits' streams
    if mode in ("source", "samples"):
        if test_classes is not None or folds is not None or fold is not None:
            raise ValueError(
                f"test_classes, folds and fold choose the test classes of split='classes'; split={mode!r} "
                "keeps the test split's classes"
            )
        test = present if mode == "samples" else np.unique(np.asarray(source_test, dtype=np.int64))
        val = (
            _pick(
                val_classes,
                np.setdiff1d(present, test) if mode == "source" else present,
                names,
                "val_classes",
                rng,
                0 if mode == "source" else MIN_CLASSES,
            )
            if val_classes is not None
            else np.empty(0, dtype=np.int64)
        )
        train = np.setdiff1d(present, val)
        if len(train) < 1:
            raise ValueError(f"val_classes={val_classes!r} leaves no training class")
        return ClassSplit(train, val, np.setdiff1d(test, val))
    if mode == "halves":
        if test_classes is not None or folds is not None or fold is not None:
            raise ValueError(
                "split='halves' fixes the test classes (the second half); drop test_classes/folds/fold"
            )
        ordered = np.sort(present)
        half = len(ordered) // 2
        train_side, test = ordered[:half], ordered[half:]
    elif mode == "classes":
        if folds is not None or fold is not None:
            if test_classes is not None:
                raise ValueError("give either test_classes or folds/fold, not both")
            if folds is None or fold is None:
                raise ValueError("folds and fold go together: folds=K (>= 2) and fold=i (0..K-1)")
            if isinstance(folds, bool) or not isinstance(folds, numbers.Integral) or folds < 2:
                raise ValueError(f"folds must be an integer >= 2, got {folds!r}")
            if isinstance(fold, bool) or not isinstance(fold, numbers.Integral) or not 0 <= fold < folds:
                raise ValueError(f"fold must be an integer in 0..{folds - 1} (folds={folds}), got {fold!r}")
            if folds > len(present):
                raise ValueError(f"folds={folds} exceeds the {len(present)} classes")
            groups = np.array_split(rng.permutation(present), int(folds))
            test = np.sort(groups[int(fold)])
        else:
            test = _pick(
                0.5 if test_classes is None else test_classes,
                present,
                names,
                "test_classes",
                rng,
                MIN_CLASSES,
            )
        train_side = np.setdiff1d(present, test)
    else:
        raise ValueError(f"split must be one of {', '.join(SPLIT_MODES)}, got {mode!r}")
    if len(test) < MIN_CLASSES:
        raise ValueError(
            f"split={mode!r} leaves {len(test)} test class(es); verification and retrieval on unseen classes "
            f"need at least {MIN_CLASSES}"
        )
    val = (
        _pick(val_classes, train_side, names, "val_classes", rng, MIN_CLASSES)
        if val_classes is not None
        else np.empty(0, dtype=np.int64)
    )
    train = np.setdiff1d(train_side, val)
    if len(train) < MIN_CLASSES:
        raise ValueError(
            f"split={mode!r} leaves {len(train)} training class(es); at least {MIN_CLASSES} are needed"
        )
    return ClassSplit(train, val, test)


def class_split_note(split: ClassSplit, names: Sequence[str], *, limit: int = 8) -> dict[str, str]:
    """One line per side: how many classes and which (the first ``limit`` names)."""

    def shown(classes: np.ndarray) -> str:
        first = ", ".join(names[c] for c in classes[:limit])
        return f"{len(classes)} ({first}{', ...' if len(classes) > limit else ''})" if len(classes) else "0"

    return {side: shown(getattr(split, side)) for side in ("train", "val", "test")}
