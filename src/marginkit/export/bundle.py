"""A deployment bundle: a directory of plain files that serves an embedding model.

Layout (every name is fixed by the manifest; see docs/deploy.md)::

    manifest.json        format tag and version, input and output facts, file names + SHA-256
    model.onnx | .ts     the embedding model, batch axis dynamic (ONNX or TorchScript)
    knn_index.npz        K-NN index over the training embeddings (KNNClassifier.save)
    preprocessing.npz    standardisation mean / std (only when the inputs were standardised)
    examples.npz         a few raw inputs `x` with their PyTorch embeddings (self-check, demo)

The manifest carries the class names, the input preprocessing, the calibration table
(score threshold at FAR 1e-2, 1e-3, 1e-4 from validation pairs) and the model fingerprint
(:func:`marginkit.knn.model_fingerprint` of the PyTorch module the files were made from).

Loading treats every file as hostile: the manifest is size-limited JSON checked key by key,
file names must be plain names inside the bundle (no paths, no symbolic links), each file's
SHA-256 must match, ``.npz`` files are read with bounded memory and no pickle, and the
model is run once on the examples before the bundle is handed out. A TorchScript model is
code that PyTorch executes when it is loaded: such bundles load only with
``trust_torchscript=True``; prefer ONNX for a server.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from marginkit._npz import NpzError, read_npz
from marginkit.export.model_file import FORMATS, INPUT_NAME, OUTPUT_NAME, Embedder, load_model_file

__all__ = ["BUNDLE_FORMAT", "BUNDLE_VERSION", "MANIFEST", "Bundle", "BundleError", "load_bundle"]

BUNDLE_FORMAT = "marginkit.bundle"
BUNDLE_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 4 * 2**20
MAX_NPZ_BYTES = 2 * 2**30
EXAMPLE_ATOL = 1e-4  # the runtimes' rounding differs from eager PyTorch's, far below this
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class BundleError(ValueError):
    """A bundle is missing, malformed, tampered with or does not match its manifest."""


@dataclass(frozen=True)
class _Field:
    path: Path

    def fail(self, key: str, expected: str, value: Any) -> BundleError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return BundleError(f"{self.path}: {key} must be {expected}, got {shown}")

    def get(
        self, obj: dict[str, Any], key: str, types: type | tuple[type, ...], expected: str, where: str = ""
    ) -> Any:
        name = f"{where}.{key}" if where else key
        if key not in obj:
            raise BundleError(f"{self.path}: missing key {name!r}")
        value = obj[key]
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise self.fail(name, expected, value)
        if not isinstance(value, types):
            raise self.fail(name, expected, value)
        return value


def _file_name(check: _Field, value: Any, key: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise check.fail(key, "a plain file name inside the bundle (letters, digits, '._-')", value)
    return value


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _bundle_file(root: Path, name: str, what: str, sha256: str | None = None) -> Path:
    path = root / name
    if path.is_symlink() or not path.is_file():
        raise BundleError(f"{path}: the bundle's {what} is missing (or not a regular file)")
    if sha256 is not None and _sha256(path) != sha256:
        raise BundleError(f"{path}: SHA-256 differs from the manifest's; the file was changed or corrupted")
    return path


def _input_space(input_shape: tuple[int, ...], kind: str, mean: Any, std: Any) -> Any:
    """A ``DatasetSplits`` with no samples: its ``preprocess`` is the run's input pipeline."""
    from marginkit.data.datasets import DatasetSplits, Split

    empty = Split(torch.empty(0), torch.empty(0, dtype=torch.long))
    return DatasetSplits(
        train=empty, val=empty, test=empty, num_classes=1, input_shape=input_shape, name="bundle",
        kind=kind, mean=mean, std=std,
    )  # fmt: skip


class Bundle:
    """A loaded, checked bundle (use :func:`load_bundle`).

    Attributes:
        path: the bundle directory.
        manifest: the parsed ``manifest.json``.
        format: ``"onnx"`` or ``"torchscript"``.
        input_shape: per-sample model input shape; ``input_kind``: ``"image"``, ``"vector"`` or
            ``"audio"`` (waveforms of any length >= ``min_samples`` at ``sample_rate`` Hz; the
            shape is then the training crop's; both are None for other kinds).
        embedding_dim: ``D``; ``model_fingerprint``: the PyTorch model's fingerprint.
        class_names: one name per training class; ``calibration``: the threshold table.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], embedder: Embedder, space: Any) -> None:
        self.path = path
        self.manifest = manifest
        self.format: str = manifest["model"]["format"]
        self.input_shape: tuple[int, ...] = tuple(manifest["input"]["shape"])
        self.input_kind: str = manifest["input"]["kind"]
        audio = self.input_kind == "audio"
        self.sample_rate: int | None = manifest["input"]["sample_rate"] if audio else None
        self.min_samples: int | None = manifest["input"]["min_samples"] if audio else None
        self.embedding_dim: int = manifest["embedding"]["dim"]
        self.model_fingerprint: str = manifest["model_fingerprint"]
        self.class_names: list[str] = list(manifest["classes"]["names"])
        self.calibration: dict[str, Any] = manifest["calibration"]
        self._embedder = embedder
        self._space = space
        self._knn: Any = None

    def __repr__(self) -> str:
        return (
            f"Bundle({str(self.path)!r}, format={self.format!r}, input_shape={self.input_shape}, "
            f"embedding_dim={self.embedding_dim})"
        )

    def preprocess(self, x: Any) -> torch.Tensor:
        """Raw inputs ``[B, ...]`` -> model inputs ``[B, *input_shape]`` (float32), as in training.

        Images: ``uint8`` (divided by 255) or floats in [0, 1], ``[B, H, W]``, ``[B, H, W, C]``
        or ``[B, C, H, W]``; vectors: floats, standardised with the training statistics when
        the run's data were; audio: float waveforms ``[B, samples]`` at :attr:`sample_rate`, of
        any length >= :attr:`min_samples`. Raises ``ValueError`` naming what is wrong (shape, NaN,
        range).
        """
        if self.input_kind == "audio":
            return self._waveforms(x)
        return self._space.preprocess(x)

    def _waveforms(self, x: Any) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x), dtype=torch.float32)
        if t.dim() != 2:
            raise ValueError(
                f"x must be waveforms [B, samples] at {self.sample_rate} Hz, got shape {list(t.shape)}"
            )
        if t.shape[0] and t.shape[1] < (self.min_samples or 1):
            raise ValueError(
                f"x holds {t.shape[1]} samples per waveform; the model needs >= {self.min_samples} "
                f"({(self.min_samples or 1) / (self.sample_rate or 1):.3f} s at {self.sample_rate} Hz)"
            )
        if not bool(torch.isfinite(t).all()):
            raise ValueError("x contains NaN or infinite values")
        return t

    def embed(self, x: Any, *, preprocessed: bool = False, batch_size: int = 256) -> torch.Tensor:
        """Embeddings ``[B, D]`` (float32) of raw inputs ``x`` (or model inputs, ``preprocessed=True``)."""
        if preprocessed and self.input_kind == "audio":
            t = self._waveforms(x)
        elif preprocessed:
            t = torch.as_tensor(x, dtype=torch.float32)
            if t.dim() != len(self.input_shape) + 1 or tuple(t.shape[1:]) != self.input_shape:
                raise ValueError(
                    f"x must have shape [B, {', '.join(map(str, self.input_shape))}], got {list(t.shape)}"
                )
            if not bool(torch.isfinite(t).all()):
                raise ValueError("x contains NaN or infinite values")
        else:
            t = self.preprocess(x)
        if t.shape[0] == 0:
            return torch.empty(0, self.embedding_dim)
        arr = t.numpy()
        chunks = [self._embedder(arr[i : i + batch_size]) for i in range(0, arr.shape[0], batch_size)]
        out = torch.from_numpy(np.concatenate(chunks)).float()
        if out.shape != (arr.shape[0], self.embedding_dim) or not bool(torch.isfinite(out).all()):
            raise BundleError(
                f"{self.path}: the model returned shape {list(out.shape)} or non-finite values; "
                f"expected [{arr.shape[0]}, {self.embedding_dim}] finite embeddings"
            )
        return out

    def threshold(self, far: float) -> float:
        """The calibrated score threshold at target FAR ``far`` (accept iff score > threshold)."""
        from marginkit.export.calibration import threshold_at

        return threshold_at(self.calibration, far)

    def knn(self) -> Any:
        """The bundle's :class:`~marginkit.knn.KNNClassifier` (training embeddings, class ids)."""
        if self._knn is None:
            from marginkit.knn import KNNClassifier

            spec = self.manifest["knn_index"]
            path = _bundle_file(self.path, spec["file"], "K-NN index", spec["sha256"])
            try:
                read_npz(path, where=str(path), max_bytes=MAX_NPZ_BYTES, required=("metadata", "labels"))
                knn = KNNClassifier.load(path, expected_fingerprint=self.model_fingerprint)
            except (NpzError, ValueError, KeyError, TypeError) as exc:
                raise BundleError(f"{path}: not a valid K-NN index for this bundle ({exc})") from None
            if knn.dimension != self.embedding_dim:
                raise BundleError(
                    f"{path}: index dimension {knn.dimension} differs from the model's {self.embedding_dim}"
                )
            self._knn = knn
        return self._knn


def _check_manifest(path: Path, raw: bytes) -> dict[str, Any]:
    check = _Field(path)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{path}: must hold a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{path}: not a marginkit bundle manifest (format {manifest.get('format')!r})")
    version = check.get(manifest, "version", int, "an integer")
    if version != BUNDLE_VERSION:
        raise BundleError(
            f"{path}: bundle format version {version}; this marginkit reads version {BUNDLE_VERSION}"
        )
    model = check.get(manifest, "model", dict, "an object")
    fmt = check.get(model, "format", str, "a string", "model")
    if fmt not in FORMATS:
        raise check.fail("model.format", f"one of {', '.join(FORMATS)}", fmt)
    _file_name(check, check.get(model, "file", str, "a string", "model"), "model.file")
    if not re.fullmatch(r"[0-9a-f]{64}", check.get(model, "sha256", str, "a string", "model")):
        raise check.fail("model.sha256", "64 hex digits", model["sha256"])
    if (
        model.get("input_name", INPUT_NAME) != INPUT_NAME
        or model.get("output_name", OUTPUT_NAME) != OUTPUT_NAME
    ):
        raise check.fail("model.input_name/output_name", f"{INPUT_NAME!r}/{OUTPUT_NAME!r}", model)
    inp = check.get(manifest, "input", dict, "an object")
    shape = check.get(inp, "shape", list, "a list of positive integers", "input")
    if not 1 <= len(shape) <= 4 or not all(
        isinstance(s, int) and not isinstance(s, bool) and 0 < s <= 2**20 for s in shape
    ):
        raise check.fail("input.shape", "1 to 4 positive integers", shape)
    if math.prod(shape) > 2**26:
        raise check.fail("input.shape", "at most 2**26 values per sample", shape)
    if check.get(inp, "kind", str, "a string", "input") not in ("image", "vector", "audio"):
        raise check.fail("input.kind", "'image', 'vector' or 'audio'", inp["kind"])
    if inp["kind"] == "audio":
        rate = check.get(inp, "sample_rate", int, "an integer (Hz)", "input")
        if isinstance(rate, bool) or not 1000 <= rate <= 384000 or len(shape) != 1:
            raise check.fail("input.sample_rate", "an integer in [1000, 384000] with a 1-D shape", rate)
        least = check.get(inp, "min_samples", int, "a positive integer", "input")
        if isinstance(least, bool) or not 1 <= least <= shape[0]:
            raise check.fail("input.min_samples", f"an integer in [1, {shape[0]}]", least)
    if check.get(inp, "dtype", str, "a string", "input") != "float32":
        raise check.fail("input.dtype", "'float32'", inp["dtype"])
    standardized = check.get(inp, "standardized", bool, "true or false", "input")
    if standardized:
        _file_name(
            check, check.get(inp, "preprocessing_file", str, "a string", "input"), "input.preprocessing_file"
        )
        if not re.fullmatch(
            r"[0-9a-f]{64}", check.get(inp, "preprocessing_sha256", str, "a string", "input")
        ):
            raise check.fail("input.preprocessing_sha256", "64 hex digits", inp["preprocessing_sha256"])
    emb = check.get(manifest, "embedding", dict, "an object")
    dim = check.get(emb, "dim", int, "a positive integer", "embedding")
    if not 0 < dim <= 65536:
        raise check.fail("embedding.dim", "an integer in [1, 65536]", dim)
    if check.get(emb, "metric", str, "a string", "embedding") != "cosine":
        raise check.fail("embedding.metric", "'cosine'", emb["metric"])
    check.get(emb, "normalized", bool, "true or false", "embedding")
    fp = check.get(manifest, "model_fingerprint", str, "a string")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", fp):
        raise check.fail("model_fingerprint", "'sha256:' and 64 hex digits", fp)
    classes = check.get(manifest, "classes", dict, "an object")
    names = check.get(classes, "names", list, "a list of strings", "classes")
    if not all(isinstance(n, str) and len(n) <= 1024 for n in names):
        raise check.fail("classes.names", "a list of strings", names)
    index = check.get(manifest, "knn_index", dict, "an object")
    _file_name(check, check.get(index, "file", str, "a string", "knn_index"), "knn_index.file")
    check.get(index, "sha256", str, "a string", "knn_index")
    cal = check.get(manifest, "calibration", dict, "an object")
    rows = check.get(cal, "rows", list, "a list", "calibration")
    for i, row in enumerate(rows):
        where = f"calibration.rows[{i}]"
        if not isinstance(row, dict):
            raise check.fail(where, "an object", row)
        far = check.get(row, "far", float, "a number in (0, 1)", where)
        if not 0 < far < 1:
            raise check.fail(f"{where}.far", "a number in (0, 1)", far)
        t = row.get("threshold")
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t)):
            raise check.fail(f"{where}.threshold", "a finite number or null", t)
    examples = manifest.get("examples")
    if examples is not None:
        if not isinstance(examples, dict):
            raise check.fail("examples", "an object or null", examples)
        _file_name(check, check.get(examples, "file", str, "a string", "examples"), "examples.file")
        check.get(examples, "sha256", str, "a string", "examples")
    return manifest


def load_bundle(
    path: str | os.PathLike[str], *, trust_torchscript: bool = False, threads: int = 0, check: bool = True
) -> Bundle:
    """Load and validate the bundle directory ``path`` (written by :func:`~marginkit.export.export_model`).

    Args:
        path: the bundle directory.
        trust_torchscript: allow a TorchScript model (loading it executes code from the file).
        threads: intra-op threads of the model runtime (0: the runtime's default).
        check: run the model on the bundle's examples and compare with the stored embeddings.

    Raises:
        BundleError: naming the file and what is wrong.
    """
    root = Path(path)
    if not root.is_dir():
        raise BundleError(f"{root}: no bundle directory there (make one with `marginkit export`)")
    mpath = root / MANIFEST
    if mpath.is_symlink() or not mpath.is_file():
        raise BundleError(f"{mpath}: missing; {root} is not a marginkit bundle")
    if mpath.stat().st_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{mpath}: larger than {MAX_MANIFEST_BYTES} bytes; not a bundle manifest")
    manifest = _check_manifest(mpath, mpath.read_bytes())
    model = manifest["model"]
    if model["format"] == "torchscript" and not trust_torchscript:
        raise BundleError(
            f"{root / model['file']}: a TorchScript model executes code when loaded; load it only from a "
            "trusted source with trust_torchscript=True (--trust-torchscript), or export with --format onnx"
        )
    model_path = _bundle_file(root, model["file"], "model file", model["sha256"])
    inp = manifest["input"]
    shape = tuple(inp["shape"])
    mean = std = None
    if inp["standardized"]:
        ppath = _bundle_file(
            root, inp["preprocessing_file"], "preprocessing file", inp["preprocessing_sha256"]
        )
        try:
            arrays = read_npz(
                ppath,
                where=str(ppath),
                max_bytes=16 * math.prod(shape) + 1024,
                names=("mean", "std"),
                required=("mean", "std"),
            )
        except NpzError as exc:
            raise BundleError(str(exc)) from None
        for key in ("mean", "std"):
            a = arrays[key]
            if a.dtype != np.float32 or a.shape != shape or not np.isfinite(a).all():
                raise BundleError(
                    f"{ppath}: {key} must be finite float32 of shape {list(shape)}, "
                    f"got {a.dtype} {list(a.shape)}"
                )
        if (arrays["std"] <= 0).any():
            raise BundleError(f"{ppath}: std must be positive")
        mean, std = torch.from_numpy(arrays["mean"]), torch.from_numpy(arrays["std"])
    try:
        embedder = load_model_file(model_path, model["format"], threads=threads)
    except ImportError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise BundleError(f"{model_path}: cannot load the {model['format']} model ({first})") from None
    bundle = Bundle(root, manifest, embedder, _input_space(shape, inp["kind"], mean, std))
    try:
        bundle.embed(np.zeros((1, *shape), dtype=np.float32), preprocessed=True)
    except BundleError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise BundleError(
            f"{model_path}: the model does not run on input [1, {', '.join(map(str, shape))}] ({first})"
        ) from None
    if check and manifest.get("examples"):
        _check_examples(bundle, manifest["examples"])
    return bundle


def _check_examples(bundle: Bundle, spec: dict[str, Any]) -> None:
    epath = _bundle_file(bundle.path, spec["file"], "examples file", spec["sha256"])
    try:
        arrays = read_npz(
            epath,
            where=str(epath),
            max_bytes=256 * 2**20,
            names=("x", "embeddings"),
            required=("x", "embeddings"),
        )
        got = bundle.embed(arrays["x"])
    except (NpzError, ValueError) as exc:
        raise BundleError(f"{epath}: unusable examples ({exc})") from None
    want = arrays["embeddings"]
    if want.shape != tuple(got.shape) or not np.isfinite(want).all():
        raise BundleError(f"{epath}: embeddings of shape {list(want.shape)}, expected {list(got.shape)}")
    err = float(np.abs(got.numpy() - want).max()) if want.size else 0.0
    if err > EXAMPLE_ATOL:
        raise BundleError(
            f"{epath}: the {bundle.format} model's embeddings differ from PyTorch's by {err:.2e} "
            f"(more than {EXAMPLE_ATOL:g}); the model file does not compute what was exported"
        )
