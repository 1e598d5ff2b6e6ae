"""Small data sets on disk for the readers' tests: image folders and RecordIO files written from
the documented layout (SPEC.md §10, dmlc-core recordio.h), without mxnet."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
from PIL import Image

MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", MAGIC)


def image(size=(6, 8), mode="RGB", seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    h, w = size
    return Image.fromarray(rng.integers(0, 256, (h, w) if mode == "L" else (h, w, 3), dtype=np.uint8), mode)


def encoded(img: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt)
    return buffer.getvalue()


def make_folder(root: Path, classes=("cat", "dog", "emu"), per_class=5, size=(6, 8), mode="RGB") -> Path:
    """``root/<class>/NN.{jpg,png}``, alternating formats, each image its own seed."""
    seed = 0
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            ext = "png" if i % 2 else "jpg"
            image(size, mode, seed).save(root / c / f"{i:02d}.{ext}")
            seed += 1
    return root


def record_parts(payload: bytes) -> bytes:
    """One record as dmlc's RecordIOWriter::WriteRecord writes it: split wherever the magic sits
    at a 4-byte-aligned position (flags 1, 2, ..., 3), the last part padded to 4 bytes."""
    out = bytearray()
    start = 0
    for i in range(0, len(payload) // 4 * 4, 4):
        if payload[i : i + 4] == MAGIC_BYTES:
            out += MAGIC_BYTES + struct.pack("<I", ((1 if start == 0 else 2) << 29) | (i - start))
            out += payload[start:i]
            start = i + 4
    out += MAGIC_BYTES + struct.pack("<I", ((3 if start else 0) << 29) | (len(payload) - start))
    out += payload[start:]
    out += b"\0" * (-len(payload[start:]) % 4)
    return bytes(out)


def image_record(label, data: bytes, ids=(0, 0)) -> bytes:
    """``<IfQQ`` header (+ float32 labels when ``label`` is a vector), then the encoded image."""
    if np.ndim(label):
        labels = np.asarray(label, dtype="<f4")
        return struct.pack("<IfQQ", len(labels), 0.0, *ids) + labels.tobytes() + data
    return struct.pack("<IfQQ", 0, float(label), *ids) + data


def write_recordio(directory: Path, payloads: dict[int, bytes], name="train") -> tuple[Path, Path]:
    """``name.rec`` and ``name.idx`` holding ``payloads`` (key -> record payload) in key order."""
    directory.mkdir(parents=True, exist_ok=True)
    rec, idx = directory / f"{name}.rec", directory / f"{name}.idx"
    data, lines = bytearray(), []
    for key in sorted(payloads):
        lines.append(f"{key}\t{len(data)}")
        data += record_parts(payloads[key])
    rec.write_bytes(bytes(data))
    idx.write_text("\n".join(lines) + "\n")
    return rec, idx


def insightface_records(items: list[tuple[int, bytes]], num_classes: int) -> dict[int, bytes]:
    """insightface's layout: record 0 a header (labels [N + 1, N + 1 + C], no image), images at
    keys 1..N, then one identity-range record per class (labels [first key, end key])."""
    n = len(items)
    records = {0: image_record([n + 1, n + 1 + num_classes], b"")}
    for key, (label, data) in enumerate(items, 1):
        records[key] = image_record(label, data)
    for c in range(num_classes):
        records[n + 1 + c] = image_record([1, n + 1], b"")
    return records
