"""A source's splits as labelled arrays: its label space, and the ``split`` data option applied.

:func:`labelled_splits` is step 2 of :func:`marginkit.data.load_dataset`: it maps the source's
labels onto class indices with names, decides whether the test classes are the training
classes (closed set) or disjoint from them (open set), refuses a partial overlap, and applies
the ``split`` modes of :mod:`marginkit.data.class_splits` (pooling the source's samples when
they re-split it).

Label layout. A closed-set source keeps its classes ``0..C-1`` as they are. Whenever a split
has classes that training lacks (an open-set test split, validation classes), the classes are
renumbered: the training classes first (``0..T-1``: the head's classes), then the validation
classes, then the test classes; :attr:`LabelledSplits.class_names` lists them in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from marginkit.data.class_splits import SPLIT_MODES, ClassSplit, choose_classes, class_split_note
from marginkit.data.loaders import RawSplits
from marginkit.data.splits import _seed, _split_indices

__all__ = ["LabelledSplits", "labelled_splits"]

SIDES = ("train", "val", "test")


@dataclass
class LabelledSplits:
    """Arrays per split (``val`` absent when the source has none and none was carved here)."""

    x: dict[str, np.ndarray]
    y: dict[str, np.ndarray]
    num_classes: int
    class_names: list[str] | None
    open_set: bool
    info: dict[str, Any] = field(default_factory=dict)


def _label_space(raw: RawSplits, name: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """Labels as indices into class names: the source's names if it has them, else ``0..C-1``
    kept as they are, else the sorted distinct values (named by their value)."""
    labels = {"train": raw.y_train, "test": raw.y_test}
    if raw.y_val is not None:
        labels["val"] = raw.y_val
    present = np.unique(np.concatenate(list(labels.values())))
    names = raw.class_names
    if names is not None:  # labels index the source's class names: keep them as they are
        if present.size and present[-1] >= len(names):
            raise ValueError(f"{name}: label {int(present[-1])} has no entry in its {len(names)} class names")
        return labels, list(names)
    if np.array_equal(present, np.arange(present.size)):
        return labels, [str(v) for v in present.tolist()]
    remapped = {split: np.searchsorted(present, y).astype(np.int64) for split, y in labels.items()}
    return remapped, [str(v) for v in present.tolist()]


def _layout(split: ClassSplit, names: list[str]) -> tuple[np.ndarray, list[str]]:
    """Old class index -> new (training classes first, then validation, then test-only; -1 for
    classes in no split) and the names in the new order."""
    order = np.concatenate([split.train, split.val, np.setdiff1d(split.test, split.train)])
    new = np.full(len(names), -1, dtype=np.int64)
    new[order] = np.arange(len(order))
    return new, [names[c] for c in order.tolist()]


def _classes_of(y: np.ndarray) -> np.ndarray:
    return np.unique(y)


def _overlap_error(
    name: str, what: str, unseen: np.ndarray, seen: np.ndarray, names: list[str]
) -> ValueError:
    def shown(c: np.ndarray) -> str:
        return ", ".join(names[i] for i in c[:8]) + (", ..." if len(c) > 8 else "")

    return ValueError(
        f"{name}: the {what} split's classes overlap the training classes only in part: "
        f"{len(unseen)} have no training samples ({shown(unseen)}) while {len(seen)} do "
        f"({shown(seen)}); a split is either closed-set (every class trained) or open-set (no class "
        "trained). Re-split the data: split=classes (class-disjoint, open-set: verification and "
        "retrieval on unseen classes) or split=samples (every class in training and test, closed-set)"
    )


def labelled_splits(
    raw: RawSplits,
    name: str,
    *,
    split: str | None = None,
    split_seed: int = 0,
    test_fraction: float = 0.2,
    **classes: Any,
) -> LabelledSplits:
    """The source's splits with class labels (see the module doc). ``classes``: the class
    options of :func:`~marginkit.data.class_splits.choose_classes` (``test_classes``,
    ``val_classes``, ``folds``, ``fold``); ``split`` ``None`` means ``"classes"`` when
    ``test_classes`` or ``folds`` is given, else ``"source"``."""
    if raw.open_set:  # a source that is class-disjoint by construction (identities): as it is
        x = {"train": raw.x_train, "test": raw.x_test}
        y = {"train": raw.y_train, "test": raw.y_test}
        if raw.x_val is not None:
            x["val"], y["val"] = raw.x_val, raw.y_val
        return LabelledSplits(x, y, int(np.unique(raw.y_train).size), None, True, dict(raw.info))
    chooses = classes.get("test_classes") is not None or classes.get("folds") is not None
    mode = split if split is not None else ("classes" if chooses else "source")
    if mode not in SPLIT_MODES:
        raise ValueError(f"split must be one of {', '.join(SPLIT_MODES)}, got {mode!r}")
    seed = _seed(split_seed, "split_seed")
    labels, names = _label_space(raw, name)
    empty = [side for side in SIDES if side in labels and not labels[side].size]
    if len(empty) == len(labels):
        raise ValueError(f"{name}: holds no samples (every split is empty)")
    for side in ("train", "test"):  # the pooled modes re-split the other splits' samples
        if mode == "source" and side in empty:
            raise ValueError(f"{name}: the {'training' if side == 'train' else side} split holds no samples")
    info = dict(raw.info)
    xs = {"train": raw.x_train, "test": raw.x_test}
    if raw.x_val is not None:
        xs["val"] = raw.x_val
    if mode == "source":
        return _source(xs, labels, names, name, info, seed, classes)
    pool_x = _concatenate([xs[s] for s in SIDES if s in xs])
    pool_y = np.concatenate([labels[s] for s in SIDES if s in labels])
    info["split"] = f"split={mode!r}, split_seed={seed}: the source's {len(pool_y)} samples pooled"
    if classes.get("val_classes") is not None:
        info["val_split"] = f"val_classes={classes['val_classes']!r}, split_seed={seed}: {_WHOLE}"
    chosen = choose_classes(_classes_of(pool_y), names, mode=mode, seed=seed, **classes)
    side = np.full(len(pool_y), "train", dtype=object)
    side[np.isin(pool_y, chosen.val)] = "val"
    if mode == "samples":  # the rest re-split per class: every class trains and tests
        rest = np.flatnonzero(side == "train")
        _, held = _split_indices(pool_y[rest], test_fraction, np.random.default_rng(seed))
        if not held.size:
            raise ValueError(
                f"{name}: split='samples' with test_fraction={test_fraction} leaves no test samples"
            )
        side[rest[held]] = "test"
        info["split"] += f", then stratified test_fraction={test_fraction} per class"
    else:
        side[np.isin(pool_y, chosen.test)] = "test"
        if mode == "halves":
            how = "the first half of the classes in their order train, the second half tests"
        elif classes.get("folds") is not None:
            how = f"folds={classes['folds']}, fold={classes.get('fold')}"
        else:
            how = f"test_classes={classes.get('test_classes') or 0.5!r}"
        info["split"] += f", split by class ({how})"
    x = {s: pool_x[side == s] for s in SIDES if s != "val" or chosen.val.size}
    y = {s: pool_y[side == s] for s in SIDES if s != "val" or chosen.val.size}
    return _finish(x, y, chosen, names, info, relabel=mode != "samples" or bool(chosen.val.size))


_WHOLE = "whole classes, none trained on"


def _concatenate(parts: list[Any]) -> Any:
    """``np.concatenate`` of arrays, :func:`~marginkit.data.samples.concat_samples` of lazy rows."""
    from marginkit.data.samples import concat_samples, is_lazy

    return concat_samples(parts) if any(is_lazy(p) for p in parts) else np.concatenate(parts)


def _source(
    xs: dict[str, np.ndarray],
    labels: dict[str, np.ndarray],
    names: list[str],
    name: str,
    info: dict[str, Any],
    seed: int,
    classes: dict[str, Any],
) -> LabelledSplits:
    """``split='source'``: the splits as given, their class overlap decided (closed, open or an
    error); ``val_classes`` moves whole training classes to validation."""
    train = _classes_of(labels["train"])
    sides = {}
    for side in ("test", "val"):
        if side not in labels:
            continue
        found = _classes_of(labels[side])
        seen = np.intersect1d(found, train)
        if seen.size and seen.size < found.size:
            raise _overlap_error(name, side, np.setdiff1d(found, train), seen, names)
        sides[side] = "closed" if seen.size else "open"
    val_classes = classes.get("val_classes")
    if val_classes is not None and "val" in labels:
        raise ValueError(
            f"{name}: the source has its own validation split; val_classes would replace it "
            "(drop val_classes)"
        )
    test = _classes_of(labels["test"])
    chosen = choose_classes(train, names, mode="source", source_test=test, seed=seed, **classes)
    x, y = dict(xs), dict(labels)
    if chosen.val.size:  # whole training classes move to validation
        moved = np.isin(labels["train"], chosen.val)
        x["val"], y["val"] = xs["train"][moved], labels["train"][moved]
        x["train"], y["train"] = xs["train"][~moved], labels["train"][~moved]
        info["val_split"] = f"val_classes={val_classes!r}, split_seed={seed}: {_WHOLE}"
    elif sides.get("val") == "open":
        chosen = ClassSplit(chosen.train, _classes_of(labels["val"]), chosen.test)
    relabel = sides["test"] == "open" or chosen.val.size > 0
    return _finish(x, y, chosen, names, info, relabel=relabel)


def _finish(
    x: dict[str, np.ndarray],
    y: dict[str, np.ndarray],
    chosen: ClassSplit,
    names: list[str],
    info: dict[str, Any],
    *,
    relabel: bool,
) -> LabelledSplits:
    open_set = not np.isin(chosen.test, chosen.train).any()
    if not relabel:
        return LabelledSplits(x, y, len(names), names, False, info)
    new, ordered = _layout(chosen, names)
    y = {s: new[v] for s, v in y.items()}
    info["classes"] = class_split_note(chosen, names)
    info["class_split"] = {s: [names[c] for c in getattr(chosen, s).tolist()] for s in SIDES}
    return LabelledSplits(x, y, len(chosen.train), ordered, bool(open_set), info)
