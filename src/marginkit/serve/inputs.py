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

Bundles of speaker models (``input.kind == "audio"``) also take one wav / flac file, as the
form's file or as the whole body (``audio/wav``, ``audio/flac``; the other fields in the query
string): decoded by libsndfile (:func:`marginkit.audio.io.decode_audio_upload`), the first
channel kept, other rates resampled by soxr to the model's, the duration bounded from the header
before decoding. What was done to the file is said in the ``X-Marginkit-Input`` response header.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

__all__ = [
    "AUDIO_TYPES",
    "BadInput",
    "Limits",
    "Payload",
    "decode_audio",
    "decode_image",
    "parse_audio",
    "parse_form",
    "parse_json",
    "parse_npy",
]

#: Content types of a body that is one audio file (speaker bundles).
AUDIO_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/flac", "audio/x-flac")
_AUDIO_STATUS = {"too_large": 413, "not_audio": 415, "invalid": 422}

MAX_DEPTH = 6


class BadInput(ValueError):
    """A request the server refuses: ``status`` (4xx) and a message for the client."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """Bounds on one request: body bytes, samples per batch, pixels per image, seconds per audio file."""

    max_body_bytes: int = 16 * 2**20
    max_batch: int = 1024
    max_image_pixels: int = 2**24
    max_audio_seconds: float = 300.0


@dataclass
class Payload:
    """The request's fields and, when it carries samples, ``array`` with its ``kind``."""

    fields: dict[str, Any]
    array: np.ndarray | None = None
    kind: str | None = None  # "inputs" or "embeddings"
    notes: list[str] | None = None  # what was done to an uploaded file (audio: channel, rate)


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


def parse_form(
    form: Any, input_shape: tuple[int, ...], limits: Limits, sample_rate: int | None = None
) -> Payload:
    """A parsed multipart form (Starlette ``FormData``) -> :class:`Payload`; ``sample_rate``: the
    model's, when it takes waveforms (then the file, unless an ``.npz``, is decoded as audio)."""
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
    if len(data) > limits.max_body_bytes:
        raise BadInput(f"{where}: over the {limits.max_body_bytes}-byte limit", 413)
    if sample_rate is not None:
        wave, notes = decode_audio(data, sample_rate, limits, where)
        return Payload(fields, wave, "inputs", notes)
    return Payload(fields, decode_image(data, input_shape, limits.max_image_pixels), "inputs")


def decode_audio(data: bytes, sample_rate: int, limits: Limits, where: str) -> tuple[np.ndarray, list[str]]:
    """One wav / flac file -> a batch of one waveform ``float32 [1, N]`` at ``sample_rate`` and
    notes on what was done (channel kept, rate changed). Refusals: 413 over the size or duration
    limit, 415 not audio, 422 no samples / NaN / truncated."""
    try:
        from marginkit.audio.io import decode_audio_upload
    except ImportError:  # pragma: no cover - soundfile is in the audio extra
        raise BadInput(
            "audio uploads need soundfile on the server (pip install 'marginkit[audio]')", 415
        ) from None
    from marginkit.data.samples import BadSampleError

    try:
        wave, info = decode_audio_upload(
            data, sample_rate, name=where, max_bytes=limits.max_body_bytes,
            max_seconds=limits.max_audio_seconds, channel=0,
        )  # fmt: skip
    except BadSampleError as exc:
        raise BadInput(str(exc), _AUDIO_STATUS.get(getattr(exc, "reason", ""), 422)) from None
    except ImportError as exc:  # soxr, needed only to resample
        raise BadInput(
            f"{where}: sampled at another rate and the server cannot resample ({exc})", 422
        ) from None
    notes = []
    if info.channels > 1:
        notes.append(f"{info.channels} channels: channel 0 kept")
    if info.sample_rate != sample_rate:
        notes.append(f"resampled from {info.sample_rate} Hz to {sample_rate} Hz (soxr HQ)")
    return wave[None], notes


def parse_audio(body: bytes, query: Any, limits: Limits, sample_rate: int | None) -> Payload:
    """A body that is one wav / flac file (``audio/wav``, ``audio/flac``) -> :class:`Payload`; the
    endpoint's fields come from the query string ``query``, objects and lists as JSON text."""
    if sample_rate is None:
        raise BadInput("this model does not take audio; send JSON, a form upload or a .npy body", 415)
    fields: dict[str, Any] = {}
    for key, value in query.multi_items():
        if key in fields:
            raise BadInput(f"query parameter {key!r} given twice")
        if key in ("inputs", "embeddings", "kind"):
            raise BadInput(f"with an audio body the samples are the body; {key!r} cannot be a parameter")
        fields[key] = _form_value(key, value)
    wave, notes = decode_audio(body, sample_rate, limits, "request body")
    return Payload(fields, wave, "inputs", notes)
