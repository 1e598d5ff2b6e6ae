"""The file format of a saved :class:`~marginkit.knn.KNNClassifier`, and its validation on load.

One ``.npz`` (no pickle) with arrays

- ``metadata`` — a JSON object: format and version, hyper-parameters, dimension, dtype,
  number of references, model fingerprint (and, for ``hnsw``, the graph's entry point; for
  ``ivf``, its cell settings: the cells themselves are trained again on load);
- ``classes`` — ``[C]`` the sorted distinct labels (int64, or unicode strings);
- ``labels`` — ``[N]`` each reference's code, its position in ``classes``;
- ``embeddings`` — ``[N, D]`` prepared references (L2-normalised for ``cosine``);
- ``hnsw_levels``, ``hnsw_offsets``, ``hnsw_neighbors`` — the HNSW graph as plain arrays
  (``hnsw`` backend only), so that it is checked here instead of deserialised by FAISS.

A file is user input: :func:`read_index` checks every member's header against the input
memory limit before reading it (:func:`marginkit._files.read_npz_arrays`), then every value
of the metadata and every array against what :meth:`KNNClassifier.fit` would have stored.
Each problem raises :class:`IndexFileError` naming the file; nothing damaged reaches FAISS
or a prediction.

Versions: 3 stores ``classes`` and codes; 1 and 2 stored the labels themselves (integer class
ids); :func:`read_index` returns every version in version 3's terms, with ``classes`` the
distinct labels (``0 .. num_classes - 1`` when those were fixed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from marginkit._files import read_npz_arrays

__all__ = ["FORMAT", "VERSION", "IndexFileError", "check_hnsw_graph", "fail", "read_index", "write_index"]

FORMAT = "marginkit.knn.KNNClassifier"
VERSION = 3  # 3: classes + codes (labels as identifiers); 2: the HNSW graph as arrays (1: a FAISS blob)
_METADATA_MAX_CHARS = 1 << 20
_GRAPH = ("hnsw_levels", "hnsw_offsets", "hnsw_neighbors")


class IndexFileError(ValueError):
    """A saved K-NN index is unreadable, damaged or inconsistent; the message names the file."""


def write_index(path: str | os.PathLike[str], meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` and the JSON ``meta`` (format and version added) to ``path``."""
    meta = {"format": FORMAT, "version": VERSION, **meta}
    with open(path, "wb") as f:
        np.savez(f, **arrays, metadata=np.array(json.dumps(meta)))


def _int(meta: dict[str, Any], key: str, low: int, high: int | None = None) -> int:
    value = meta.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"metadata {key!r} must be an integer {bound}, got {value!r}")
    return value


def _check_metadata(meta: Any, names: set[str]) -> dict[str, Any]:
    """Types and ranges of every metadata value (the classifier then checks them as on fit)."""
    if not isinstance(meta, dict):
        raise ValueError(f"metadata must be a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT or meta.get("version") not in (1, 2, VERSION):
        raise ValueError(
            f"has format {meta.get('format')!r} version {meta.get('version')!r}; "
            f"expected {FORMAT!r} version {VERSION} (or 1, 2)"
        )
    required = {
        "k", "metric", "normalization", "weights", "backend", "memory_limit_mb", "num_classes",
        "fixed_num_classes", "hnsw", "dimension", "dtype", "num_references", "model_fingerprint",
    }  # fmt: skip
    missing = sorted(required - set(meta))
    if missing:
        raise ValueError(f"metadata lacks {', '.join(map(repr, missing))}")
    n = _int(meta, "num_references", 1)
    _int(meta, "dimension", 1)
    _int(meta, "num_classes", 1)
    _int(meta, "k", 1, n)
    if meta["metric"] not in ("cosine", "l2"):
        raise ValueError(f"metadata 'metric' must be 'cosine' or 'l2', got {meta['metric']!r}")
    if meta["normalization"] != ("l2" if meta["metric"] == "cosine" else "none"):
        raise ValueError(
            f"metadata 'normalization' {meta['normalization']!r} contradicts metric {meta['metric']!r}"
        )
    if not isinstance(meta["fixed_num_classes"], bool):
        raise ValueError(
            f"metadata 'fixed_num_classes' must be true or false, got {meta['fixed_num_classes']!r}"
        )
    dtypes = ("float32", "float64") if meta["backend"] == "exact" else ("float32",)
    if meta["dtype"] not in dtypes:
        raise ValueError(f"metadata 'dtype' {meta['dtype']!r} is not stored by backend {meta['backend']!r}")
    fingerprint = meta["model_fingerprint"]
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise ValueError(f"metadata 'model_fingerprint' must be a string or null, got {fingerprint!r}")
    if not isinstance(meta["hnsw"], dict):
        raise ValueError(f"metadata 'hnsw' must be an object, got {meta['hnsw']!r}")
    for key in ("m", "ef_construction", "ef_search"):
        _int(meta["hnsw"], key, 1)
    ivf = meta.get("ivf", {})  # (files before the ivf backend have none)
    if not isinstance(ivf, dict) or set(ivf) - {"nlist", "nprobe"}:
        raise ValueError(f"metadata 'ivf' must be an object with 'nlist' and 'nprobe', got {ivf!r}")
    if ivf.get("nlist") is not None:
        _int(ivf, "nlist", 1)
    if "nprobe" in ivf:
        _int(ivf, "nprobe", 1)
    expected = {"labels", "embeddings"} | ({"classes"} if meta["version"] >= 3 else set())
    if meta["backend"] == "hnsw":
        if meta["version"] == 1:
            raise ValueError(
                "is a version-1 HNSW index, whose FAISS graph blob cannot be checked before FAISS "
                "reads it; fit the index again and save it with this version"
            )
        expected |= set(_GRAPH)
        _int(meta["hnsw"], "entry_point", 0, n - 1)
        _int(meta["hnsw"], "max_level", 0)
    if names != expected:
        missing, extra = sorted(expected - names), sorted(names - expected)
        problem = "; ".join(
            [f"lacks {', '.join(map(repr, missing))}"] * bool(missing)
            + [f"has unexpected {', '.join(map(repr, extra))}"] * bool(extra)
        )
        graph = " (the HNSW graph)" if set(missing) & set(_GRAPH) else ""
        raise ValueError(
            f"holds arrays {sorted(names)}, but a version-{meta['version']} {meta['backend']!r} index has "
            f"exactly {sorted(expected)}: {problem}{graph}"
        )
    return meta


def _check_classes(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Version 3's ``classes`` (sorted distinct labels) and codes; older versions converted to them."""
    labels, num_classes = arrays["labels"], meta["num_classes"]
    if meta["version"] < 3:  # the labels were class ids 0 .. num_classes - 1
        classes = np.arange(num_classes, dtype=np.int64) if meta["fixed_num_classes"] else np.unique(labels)
        arrays["classes"] = classes.astype(np.int64)
        arrays["labels"] = np.searchsorted(arrays["classes"], labels).astype(np.int64)
        return
    classes = arrays["classes"]
    if classes.dtype.kind not in "iU" or classes.shape != (num_classes,):
        raise ValueError(
            f"'classes' must be {num_classes} integers or strings, got {classes.dtype} {list(classes.shape)}"
        )
    if classes.dtype.kind == "i":
        arrays["classes"] = classes = classes.astype(np.int64)
    if num_classes > 1 and not bool((classes[1:] > classes[:-1]).all()):
        raise ValueError("'classes' must be sorted and distinct")
    used = np.unique(labels).size
    if not meta["fixed_num_classes"] and used != num_classes:
        raise ValueError(f"'classes' holds {num_classes} classes, but the references use {used}")


def _check_arrays(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    n, dim, num_classes = meta["num_references"], meta["dimension"], meta["num_classes"]
    labels = arrays["labels"]
    what = "" if meta["version"] < 3 else " (positions in 'classes')"
    if labels.dtype.kind not in "iu" or labels.shape != (n,):
        raise ValueError(f"'labels' must be {n} integers{what}, got {labels.dtype} {list(labels.shape)}")
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= num_classes:
        raise ValueError(f"'labels' must lie in [0, num_classes={num_classes}), got values in [{lo}, {hi}]")
    if not meta["fixed_num_classes"] and num_classes != hi + 1:
        raise ValueError(f"'num_classes' is {num_classes} but the largest label is {hi}")
    _check_classes(meta, arrays)
    x = arrays["embeddings"]
    _expect("embeddings", x, np.dtype(meta["dtype"]).type, (n, dim))
    with np.errstate(over="ignore", invalid="ignore"):
        sq = np.einsum("ij,ij->i", x, x)
    if not (np.isfinite(x).all() and np.isfinite(sq).all()):
        raise ValueError("'embeddings' hold NaN, infinite or overflowing values")
    if meta["metric"] == "cosine":
        tol = 2**13 * np.finfo(x.dtype).eps
        worst = float(np.abs(sq - 1).max())
        if worst > tol:
            raise ValueError(
                f"'embeddings' of a cosine index must be unit-norm, but |norm² - 1| reaches {worst:.3g}"
            )


def _expect(name: str, a: np.ndarray, dtype: type, shape: tuple[int, ...]) -> None:
    if a.dtype != np.dtype(dtype) or a.shape != shape:
        raise ValueError(f"{name!r} must be {np.dtype(dtype)} {list(shape)}, got {a.dtype} {list(a.shape)}")


def check_hnsw_graph(meta: dict[str, Any], arrays: dict[str, np.ndarray], cum_neighbors: np.ndarray) -> None:
    """The graph's structure, so that a search can only follow valid node ids.

    ``cum_neighbors`` is FAISS's ``cum_nneighbor_per_level`` for the index's ``M``: a node of
    level ``l`` owns ``cum_neighbors[l]`` neighbour slots.
    """
    n = meta["num_references"]
    levels, offsets, neighbors = (arrays[name] for name in _GRAPH)
    _expect("hnsw_levels", levels, np.int32, (n,))
    if not (levels.min() >= 1 and levels.max() < len(cum_neighbors)):
        raise ValueError(f"'hnsw_levels' must lie in [1, {len(cum_neighbors) - 1}]")
    _expect("hnsw_offsets", offsets, np.uint64, (n + 1,))
    slots = cum_neighbors[levels].astype(np.uint64)
    if offsets[0] != 0 or not np.array_equal(np.diff(offsets), slots):
        raise ValueError("'hnsw_offsets' do not match the nodes' levels")
    _expect("hnsw_neighbors", neighbors, np.int32, (int(offsets[-1]),))
    if neighbors.size and not (neighbors.min() >= -1 and neighbors.max() < n):
        raise ValueError(f"'hnsw_neighbors' must be node ids in [0, {n}) or -1")
    entry, max_level = meta["hnsw"]["entry_point"], meta["hnsw"]["max_level"]
    if max_level != int(levels.max()) - 1 or int(levels[entry]) - 1 != max_level:
        raise ValueError("the HNSW entry point is not a node of the top level")


def read_index(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Metadata and arrays of the index file at ``path``, validated (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such K-NN index file")
    try:
        arrays = read_npz_arrays(path)
        if "metadata" not in arrays or "labels" not in arrays:
            raise ValueError("is not a saved KNNClassifier (no metadata/labels)")
        info = arrays["metadata"]
        if info.dtype.kind != "U" or info.shape != () or info.dtype.itemsize > 4 * _METADATA_MAX_CHARS:
            raise ValueError(f"'metadata' must be one JSON string, got {info.dtype} {list(info.shape)}")
        try:
            meta = json.loads(str(arrays.pop("metadata")))
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"'metadata' is not valid JSON ({type(exc).__name__})") from None
        meta = _check_metadata(meta, set(arrays))
        _check_arrays(meta, arrays)
    except IndexFileError:
        raise
    except ValueError as exc:
        message = str(exc).removeprefix(f"{path}: ")
        raise IndexFileError(f"{path}: {message}") from exc
    return meta, arrays


def fail(path: str | os.PathLike[str], problem: str) -> IndexFileError:
    """The error for ``problem`` found in the index file at ``path``."""
    return IndexFileError(f"{Path(path)}: {problem}")
