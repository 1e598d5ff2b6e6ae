"""Request bodies of the server, decoded as hostile input with bounded memory.

A body is JSON (``application/json``: arrays as nested lists, ``NaN``/``Infinity`` refused;
an array of integers only stays integer, which the app reads as 8-bit pixels), a form upload
(``multipart/form-data``: one file — an ``.npz`` archive with an array ``x`` of raw inputs
or ``embeddings``, or one image — plus the other fields as form fields, JSON-encoded where
they are objects or lists), or one binary ``.npy`` array (``application/x-npy``) with the
other fields in the query string. The body's size is bounded before any of
this runs (:class:`~marginkit.serve.limits.BodyLimit`); ``.npz`` members by their header
and ``.npy`` bodies by their header
before decoding (:mod:`marginkit._npz`); images by their pixel count from the
header, before Pillow decodes them (decompression bombs).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

__all__ = ["BadInput", "Limits", "Payload", "decode_image", "parse_form", "parse_json", "parse_npy"]

MAX_DEPTH = 6


class BadInput(ValueError):
    """A request the server refuses: ``status`` (4xx) and a message for the client."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """Bounds on one request: body bytes, samples per batch, pixels per image."""

    max_body_bytes: int = 16 * 2**20
    max_batch: int = 1024
    max_image_pixels: int = 2**24


@dataclass
class Payload:
    """The request's fields and, when it carries samples, ``array`` with its ``kind``."""

    fields: dict[str, Any]
    array: np.ndarray | None = None
    kind: str | None = None  # "inputs" or "embeddings"


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows; send finite numbers")


def _array(value: Any, key: str) -> np.ndarray:
    """Nested lists of JSON numbers -> a rectangular array: int64 when every number is an
    integer (so that pixels stay 8-bit levels), else float64."""
    depth, v = 0, value
    while isinstance(v, list) and v:
        depth, v = depth + 1, v[0]
        if depth > MAX_DEPTH:
            raise BadInput(f"{key} is nested deeper than {MAX_DEPTH} levels")
    if not isinstance(value, list):
        raise BadInput(f"{key} must be an array (nested lists of numbers), got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        raise BadInput(f"{key} must be a rectangular array of numbers (equal-length rows)") from None
    if array.dtype.kind == "u":  # integers above 2**63 - 1
        array = array.astype(np.float64)
    if array.dtype.kind not in "if":
        what = "equal-length rows" if array.dtype.kind == "O" else f"got {array.dtype.name} values"
        raise BadInput(f"{key} must be a rectangular array of numbers ({what})")
    return _checked_array(array, key)


def _take_samples(fields: dict[str, Any]) -> Payload:
    present = [k for k in ("inputs", "embeddings") if fields.get(k) is not None]
    if len(present) > 1:
        raise BadInput("give either 'inputs' (raw samples) or 'embeddings', not both")
    if not present:
        return Payload(fields)
    key = present[0]
    return Payload(fields, _array(fields.pop(key), key), key)


def parse_json(body: bytes) -> Payload:
    """A JSON object body -> :class:`Payload` (``inputs`` / ``embeddings`` become the array).

    Parsed by orjson; a body it refuses is parsed again by the standard library only to name
    the fault (e.g. ``NaN``, which JSON does not allow).
    """
    if not body:
        raise BadInput("empty request body; send a JSON object")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        try:
            json.loads(body, parse_constant=_refuse_constant)
        except RecursionError:
            raise BadInput("JSON nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as std:
            raise BadInput(f"body is not valid JSON: {std}") from None
        raise BadInput(f"body is not valid JSON: {exc}") from None  # e.g. nesting or integer range
    if not isinstance(obj, dict):
        raise BadInput(f"body must be a JSON object, got {type(obj).__name__}")
    return _take_samples(obj)


def parse_npy(body: bytes, query: Any, limits: Limits) -> Payload:
    """An ``application/x-npy`` body (one ``numpy.save`` array) -> :class:`Payload`; the other
    fields come from the query string ``query`` (Starlette ``QueryParams``): ``kind``
    (``inputs`` or ``embeddings``, required) and the endpoint's fields, objects and lists as
    JSON text, as in a form."""
    from marginkit._npz import NpzError, read_npy

    fields: dict[str, Any] = {}
    for key, value in query.multi_items():
        if key in fields:
            raise BadInput(f"query parameter {key!r} given twice")
        if key in ("inputs", "embeddings"):
            raise BadInput(f"with a binary body the samples are the body; {key!r} cannot be a parameter")
        fields[key] = value if key == "kind" else _form_value(key, value)
    kind = fields.pop("kind", None)
    if kind not in ("inputs", "embeddings"):
        raise BadInput(
            "a binary (application/x-npy) body needs the query parameter kind=inputs (raw samples) "
            f"or kind=embeddings, got {kind!r}"
        )
    if not body:
        raise BadInput("empty request body; send one .npy array")
    try:
        array = read_npy(body, where="request body", max_bytes=4 * limits.max_body_bytes)
    except NpzError as exc:
        raise BadInput(str(exc)) from None
    return Payload(fields, _checked_array(array, "request body"), kind)


def _checked_array(array: np.ndarray, where: str) -> np.ndarray:
    if array.dtype.kind not in "biuf":
        raise BadInput(f"{where}: the array must hold numbers, got dtype {array.dtype}")
    if array.size == 0:
        raise BadInput(f"{where}: the array holds no number")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise BadInput(f"{where}: the array contains NaN or infinite values")
    return array


def decode_image(data: bytes, input_shape: tuple[int, ...], max_pixels: int) -> np.ndarray:
    """One image file -> ``uint8 [1, H, W]`` (grey) or ``[1, H, W, 3]`` for the model's ``(C, H, W)``.

    The pixel count is read from the header and checked before decoding. Images are not
    resized: their size must be the model's.
    """
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is in the serve extra
        raise BadInput(
            "image uploads need Pillow on the server (pip install 'marginkit[serve]')", 415
        ) from None
    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        raise BadInput(
            f"this model takes inputs of shape {list(input_shape)}, not images; send an .npz or JSON"
        )
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > max_pixels:
                raise BadInput(f"image of {w}x{h} pixels exceeds the limit of {max_pixels} pixels", 413)
            if (h, w) != tuple(input_shape[1:]):
                raise BadInput(
                    f"image is {w}x{h} pixels (width x height); "
                    f"the model expects {input_shape[2]}x{input_shape[1]}"
                )
            pixels = np.asarray(img.convert("L" if input_shape[0] == 1 else "RGB"), dtype=np.uint8)
    except BadInput:
        raise
    except Image.DecompressionBombError as exc:
        raise BadInput(f"image refused: {exc}", 413) from None
    except Exception as exc:  # Pillow raises many kinds (UnidentifiedImageError, OSError, ...)
        raise BadInput(
            f"the file is neither an .npz archive nor a readable image ({type(exc).__name__})", 415
        ) from None
    return pixels[None]


def _form_value(key: str, value: str) -> Any:
    if key in ("metadata", "identities", "inputs", "embeddings"):
        try:
            return json.loads(value, parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            raise BadInput(f"form field {key!r} must be JSON") from None
    if key == "k":
        try:
            return int(value)
        except ValueError:
            raise BadInput(f"form field 'k' must be an integer, got {value!r}") from None
    return value


def parse_form(form: Any, input_shape: tuple[int, ...], limits: Limits) -> Payload:
    """A parsed multipart form (Starlette ``FormData``) -> :class:`Payload`."""
    from marginkit._npz import NpzError, read_npz

    fields: dict[str, Any] = {}
    files = []
    for key, value in form.multi_items():
        if isinstance(value, str):
            if key in fields:
                raise BadInput(f"form field {key!r} given twice")
            fields[key] = _form_value(key, value)
        else:
            files.append((key, value))
    if len(files) > 1:
        raise BadInput(f"one file per request, got {len(files)}")
    if not files:
        return _take_samples(fields)
    if fields.get("inputs") is not None or fields.get("embeddings") is not None:
        raise BadInput("give samples either as a file or as a form field, not both")
    name, upload = files[0]
    upload.file.seek(0)
    data = upload.file.read(limits.max_body_bytes + 1)
    where = f"uploaded file {upload.filename or name!r}"
    if data[:4] == b"PK\x03\x04":
        try:
            arrays = read_npz(data, where=where, max_bytes=4 * limits.max_body_bytes)
        except NpzError as exc:
            raise BadInput(str(exc)) from None
        for key in ("x", "embeddings"):
            if key in arrays:
                array = _checked_array(arrays[key], f"{where}: array {key!r}")
                return Payload(fields, array, "inputs" if key == "x" else "embeddings")
        found = ", ".join(arrays) or "none"
        raise BadInput(f"{where}: expected an array 'x' (raw inputs) or 'embeddings', found {found}")
    return Payload(fields, decode_image(data, input_shape, limits.max_image_pixels), "inputs")
