"""``csv:FILE`` — a manifest of image files in open-metric-learning's (OML) convention, read lazily.

The CSV has a header row and the columns (others are ignored, see below):

- ``path``: the image file, relative to the CSV's folder (or absolute);
- ``label``: the class. Labels that are all non-negative integers are used as numbers (the
  class names are their sorted distinct values, as text); otherwise every label is a class name
  (the classes are the sorted distinct names);
- ``split``: ``train``, ``validation`` (``val``) or ``test`` (any case). OML's data frames have
  ``train`` and ``validation`` only, their ``validation`` rows being what metrics are computed
  on: such a manifest's ``validation`` rows are this reader's *test* split (a validation split is
  then carved from training, as for any source without one). A manifest with ``test`` rows keeps
  its ``validation`` rows as the validation split. Without any ``validation`` / ``test`` row, a
  stratified ``test_fraction`` of each class (seeded by ``split_seed``) is held out.
- ``is_query``, ``is_gallery`` (optional): booleans (``true``/``false``, ``1``/``0``, ``yes``/``no``)
  on the rows of the evaluation split; returned in ``info["is_query"]`` / ``info["is_gallery"]``
  (one boolean array per split, aligned with that split's rows as read).

OML's optional ``category`` column is ignored; its bounding-box columns ``x_1, x_2, y_1, y_2``
are *not applied* (images are used whole), and a warning says so when they hold values.

The same manifest with audio paths (``.wav`` / ``.flac``) is ``audio:FILE.csv``
(:func:`marginkit.audio.sources.read_audio_manifest`, speakers as labels); ``csv:`` refuses it
and names that spec. Both read the rows with :func:`read_manifest_rows`.

Every bad row is a :class:`ValueError` naming the file and the row's line number: a missing or
empty ``path``, a file that does not exist, an empty or non-integer label among integer labels,
an unknown ``split``, a boolean that is not one. Images are decoded on
:meth:`~marginkit.data.samples.LazySamples.read` by :class:`~marginkit.data.folder.ImageFiles`
(their layout from a sample of headers, as ``folder:``).
"""

from __future__ import annotations

import csv
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from marginkit.data.folder import ImageFiles
from marginkit.data.loaders import RawSplits, _seeded_split, split_note

__all__ = [
    "AUDIO_SUFFIXES",
    "SPLIT_NAMES",
    "ManifestRows",
    "manifest_flags",
    "manifest_split_rows",
    "read_manifest",
    "read_manifest_rows",
]

#: The ``split`` values a manifest may use, and the split each one is read as.
SPLIT_NAMES = {"train": "train", "validation": "val", "val": "val", "test": "test"}
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_INT = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_BBOX = ("x_1", "x_2", "y_1", "y_2")
#: Suffixes of audio files: a manifest listing them is ``audio:FILE.csv``'s, not ``csv:``'s.
AUDIO_SUFFIXES = (".wav", ".flac")


def _labels(raw: list[str], lines: list[int], where: str) -> tuple[np.ndarray, list[str]]:
    """Class indices and names from the label column (see the module doc)."""
    is_int = np.fromiter((_INT.fullmatch(v) is not None for v in raw), dtype=bool, count=len(raw))
    if is_int.any():
        for value, line in zip(raw, lines, strict=True):
            if _INT.fullmatch(value) is None and _NUMBER.fullmatch(value) is not None:
                raise ValueError(
                    f"{where}, line {line}: bad label {value!r}: the other labels are non-negative integers"
                )
    if is_int.all():
        values = np.array([int(v) for v in raw], dtype=np.int64)
        present, labels = np.unique(values, return_inverse=True)
        return labels.astype(np.int64), [str(v) for v in present.tolist()]
    names, labels = np.unique(np.array(raw, dtype=object), return_inverse=True)
    return labels.astype(np.int64), [str(n) for n in names.tolist()]


def _boolean(value: str, column: str, where: str, line: int) -> bool:
    flag = _BOOLEANS.get(value.strip().lower())
    if flag is None:
        raise ValueError(
            f"{where}, line {line}: {column} must be a boolean (true/false, 1/0, yes/no), got {value!r}"
        )
    return flag


@dataclass(frozen=True)
class ManifestRows:
    """A manifest's rows as listed, checked (:func:`read_manifest_rows`), before any file is read.

    ``paths`` as written (relative to ``root`` or absolute); ``labels`` class indices into
    ``class_names``; ``side`` each row's split (``train`` / ``val`` / ``test``, as written);
    ``flags`` the ``is_query`` / ``is_gallery`` values (``None`` where empty); ``boxes`` the
    number of rows giving a bounding box; ``lines`` each row's line number in the file.
    """

    where: str
    root: Path
    paths: list[str]
    labels: np.ndarray
    class_names: list[str]
    side: np.ndarray
    flags: dict[str, list[bool | None]]
    boxes: int
    lines: list[int]


def read_manifest_rows(path: str | os.PathLike[str], *, check_files: bool = True) -> ManifestRows:
    """Parse and check ``csv:FILE``'s rows (module doc); ``check_files``: one ``stat`` a row, so a
    missing file is named with its line before anything is read."""
    where = str(path)
    csv_path = Path(path)
    if not csv_path.is_file():
        raise FileNotFoundError(f"{where}: no such file (expected a CSV manifest with path, label, split)")
    root = csv_path.parent
    paths: list[str] = []
    raw_labels: list[str] = []
    splits: list[str] = []
    lines: list[int] = []
    flags: dict[str, list[bool | None]] = {"is_query": [], "is_gallery": []}
    boxes = 0
    try:
        with csv_path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            columns = [c.strip() for c in reader.fieldnames or []]
            reader.fieldnames = columns
            missing = [c for c in ("path", "label", "split") if c not in columns]
            if missing:
                raise ValueError(
                    f"{where}: missing column(s) {', '.join(missing)}; a manifest needs a header row with "
                    f"path, label and split (found {', '.join(columns) or 'no header'})"
                )
            has = {c: c in columns for c in (*flags, *_BBOX)}
            for row in reader:
                line = reader.line_num
                if None in row:
                    raise ValueError(f"{where}, line {line}: more fields than the header's {len(columns)}")
                file = (row["path"] or "").strip()
                if not file:
                    raise ValueError(f"{where}, line {line}: missing path")
                label = (row["label"] or "").strip()
                if not label:
                    raise ValueError(f"{where}, line {line}: bad label: empty")
                split = SPLIT_NAMES.get((row["split"] or "").strip().lower())
                if split is None:
                    raise ValueError(
                        f"{where}, line {line}: unknown split {row['split']!r}; expected one of "
                        f"{', '.join(SPLIT_NAMES)}"
                    )
                for column, values in flags.items():
                    text = (row.get(column) or "").strip() if has[column] else ""
                    values.append(_boolean(text, column, where, line) if text else None)
                boxes += any(has[c] and (row.get(c) or "").strip() for c in _BBOX)
                full = os.path.join(root, file)
                if check_files and not os.path.isfile(full):
                    raise ValueError(f"{where}, line {line}: {full}: no such file")
                paths.append(file)
                raw_labels.append(label)
                splits.append(split)
                lines.append(line)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not a UTF-8 text file ({exc.reason})") from exc
    except csv.Error as exc:
        raise ValueError(f"{where}: malformed CSV ({exc})") from exc
    if not paths:
        raise ValueError(f"{where}: the manifest lists no rows")
    labels, class_names = _labels(raw_labels, lines, where)
    side = np.array(splits)
    if not (side == "train").any():
        raise ValueError(f"{where}: no row has split 'train'")
    return ManifestRows(where, root, paths, labels, class_names, side, flags, boxes, lines)


def manifest_split_rows(rows: ManifestRows, info: dict[str, Any]) -> dict[str, np.ndarray]:
    """Row indices of ``train`` / ``val`` / ``test`` by the manifest's ``split`` column (OML's
    convention: ``validation`` rows are the test split when there is no ``test`` row); the note
    goes to ``info["split"]``. ``test`` is empty when the manifest has train rows only."""
    side = rows.side.copy()
    if not (side == "test").any() and (side == "val").any():
        side[side == "val"] = "test"
        info["split"] = "the manifest's train rows; its validation rows are the test split (OML's convention)"
    elif (side == "test").any():
        info["split"] = "the manifest's train / validation / test rows as given"
    return {s: np.flatnonzero(side == s) for s in ("train", "val", "test")}


def manifest_flags(rows: ManifestRows, parts: dict[str, np.ndarray], info: dict[str, Any]) -> None:
    """``info["is_query"]`` / ``info["is_gallery"]``: one boolean array per split, where given."""
    for column, values in rows.flags.items():
        if any(v is not None for v in values):
            array = np.array([bool(v) for v in values])
            info[column] = {s: array[r] for s, r in parts.items() if r.size}


def read_manifest(
    path: str | os.PathLike[str],
    *,
    image_size: int | tuple[int, int] | None = None,
    color: str = "auto",
    test_fraction: float = 0.2,
    split_seed: int = 0,
    check_files: bool = True,
) -> RawSplits:
    """``csv:FILE`` as :class:`~marginkit.data.loaders.RawSplits` of lazy image rows (module doc).

    ``image_size`` / ``color``: as ``folder:``; ``test_fraction`` / ``split_seed``: the held-out
    test split of a manifest with only ``train`` rows; ``check_files``: check that every listed
    file exists while reading the manifest (one ``stat`` a row), so a missing file is named with
    its line before training starts.
    """
    rows = read_manifest_rows(path, check_files=check_files)
    where = rows.where
    audio = [p for p in rows.paths if p.lower().endswith(AUDIO_SUFFIXES)]
    if audio:
        raise ValueError(
            f"{where}: lists audio files ({audio[0]!r}, {len(audio)} of {len(rows.paths)} rows); a manifest "
            f"of utterances is read by the audio source: --data audio:{where}"
        )
    if rows.boxes:
        warnings.warn(
            f"{where}: {rows.boxes} row(s) give a bounding box (x_1, x_2, y_1, y_2); it is not applied, the "
            "whole image is used",
            UserWarning,
            stacklevel=2,
        )
    labels = rows.labels
    files = ImageFiles.from_paths(rows.root, rows.paths, image_size=image_size, color=color, source=where)
    info: dict[str, Any] = {
        "source": where,
        "color": files.layout.mode,
        "image_size": tuple(files.sample_shape[1:]),
        "layout": files.layout.note,
        "files": len(rows.paths),
        "lazy": True,
    }
    parts = manifest_split_rows(rows, info)
    if not parts["test"].size:
        train_pos, test_pos = _seeded_split(labels[parts["train"]], test_fraction, split_seed)
        parts["test"], parts["train"] = parts["train"][test_pos], parts["train"][train_pos]
        info["split"] = split_note(test_fraction, split_seed) + " (the manifest has only train rows)"
    manifest_flags(rows, parts, info)
    val = parts["val"] if parts["val"].size else None
    return RawSplits(
        files[parts["train"]], labels[parts["train"]], files[parts["test"]], labels[parts["test"]],
        x_val=files[val] if val is not None else None, y_val=labels[val] if val is not None else None,
        kind="image", class_names=rows.class_names, info=info,
    )  # fmt: skip
