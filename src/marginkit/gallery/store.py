"""SQLite persistence of a gallery: identities, their embedding templates, and the facts they need.

One database file (standard-library ``sqlite3``) in WAL mode with ``synchronous=FULL``: a
transaction that committed survives a crash of the process (``kill -9``) and of the
machine; readers in other processes never block the one writer and see a consistent
snapshot. Every enrollment or removal is one ``BEGIN IMMEDIATE ... COMMIT`` transaction, so
it is applied whole or not at all; concurrent writers in other processes wait their turn
(up to ``timeout`` seconds).

Tables::

    meta(key, value)                   format, version, model_fingerprint, dim, dtype, metric,
                                       removals (bumped by every removal)
    identities(id, name UNIQUE, metadata JSON, created)
    templates(id, identity -> identities.id ON DELETE CASCADE, dim, dtype, vector BLOB)

``id`` columns are ``AUTOINCREMENT``: since writers are serialised, ids grow in commit order,
which is what lets a reader catch up by loading the rows above the last id it has seen.
Templates are stored in the gallery's ``dtype``, fixed when the file is created: little-endian
float32 (``4 D`` bytes) or float16 (``2 D``) BLOBs, or int8 (``4 + D`` bytes: the float32
scale, then the codes; :mod:`marginkit.gallery.quantize`). Each row's ``dim``, ``dtype`` and
byte length are checked against ``meta`` on every read, and the decoded values for finiteness.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from marginkit.gallery.quantize import DTYPES

__all__ = ["FORMAT", "VERSION", "GalleryError", "Store", "check_model", "require_facts"]

FORMAT = "marginkit.gallery"
VERSION = 1
_NP = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "int8": np.dtype("i1")}
_SCALE = np.dtype("<f4")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS identities (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    metadata TEXT,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS templates (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    identity INTEGER NOT NULL REFERENCES identities(id) ON DELETE CASCADE,
    dim INTEGER NOT NULL,
    dtype TEXT NOT NULL,
    vector BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS templates_by_identity ON templates(identity);
"""


class GalleryError(ValueError):
    """The gallery file is unusable: not a gallery, corrupted, or made by another model."""


def require_facts(where: object, fingerprint: str | None, dim: int | None) -> None:
    """A new gallery needs both the model fingerprint and the dimension."""
    if fingerprint is None or dim is None:
        raise GalleryError(
            f"{where}: a new gallery needs the model fingerprint and the embedding "
            "dimension (pass a bundle, or model_fingerprint= and embedding_dim=)"
        )


def check_model(where: object, stored: dict[str, str], fingerprint: str | None, dim: int | None) -> None:
    """Refuse a gallery made by another model (fingerprint) or for another dimension."""
    if fingerprint is not None and stored.get("model_fingerprint") != fingerprint:
        raise GalleryError(
            f"{where}: this gallery holds embeddings of model {stored.get('model_fingerprint')}, not of "
            f"{fingerprint}; embeddings of another model live in another space: enroll the identities "
            "again into a new gallery"
        )
    if dim is not None and stored.get("dim") != str(int(dim)):
        raise GalleryError(
            f"{where}: gallery embeddings have dimension {stored.get('dim')}, the model's {dim}"
        )


class Store:
    """The SQLite side of a :class:`~marginkit.gallery.Gallery` (one connection).

    Args:
        path: the database file (created when missing).
        model_fingerprint: the embedding model's fingerprint; ``None`` adopts the stored one
            (an existing gallery only).
        dim: the embedding dimension; ``None`` adopts the stored one.
        timeout: seconds a writer waits for another process's transaction.
        dtype: the template storage of a new gallery (``float32``, ``float16``, ``int8``);
            ``None`` adopts the stored one (``float32`` for a new file). An existing gallery
            keeps its own: another ``dtype`` is an error.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        model_fingerprint: str | None,
        dim: int | None,
        timeout: float,
        dtype: str | None = None,
    ) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise GalleryError(f"{self.path}: is a directory; a gallery is one SQLite file")
        if not self.path.parent.is_dir():
            raise GalleryError(f"{self.path}: directory {self.path.parent} does not exist")
        try:
            self.conn = sqlite3.connect(
                self.path, timeout=timeout, isolation_level=None, check_same_thread=False
            )
            self._configure()
            self.meta = self._init_meta(model_fingerprint, dim, dtype)
        except sqlite3.DatabaseError as exc:
            with contextlib.suppress(Exception):
                self.conn.close()
            raise GalleryError(f"{self.path}: not a usable gallery database ({exc})") from None
        self.dim = int(self.meta["dim"])
        self.model_fingerprint = self.meta["model_fingerprint"]
        self.dtype = self.meta["dtype"]
        self.row_bytes = self.dim * _NP[self.dtype].itemsize + (
            _SCALE.itemsize if self.dtype == "int8" else 0
        )

    # ------------------------------------------------------------------ setup
    def _configure(self) -> None:
        # Pages of 32 KiB hold 15 float32 templates of D = 512 (4 KiB pages hold one: half the
        # file would be slack). SQLite applies it to a new file only.
        self.conn.execute("PRAGMA page_size=32768")
        mode = self.conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise GalleryError(f"{self.path}: SQLite refused WAL mode (journal_mode={mode})")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("PRAGMA foreign_keys=ON")

    def _init_meta(self, fingerprint: str | None, dim: int | None, dtype: str | None) -> dict[str, str]:
        with self.write():
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self.conn.execute(statement)
            meta = dict(self.conn.execute("SELECT key, value FROM meta").fetchall())
            if not meta:
                require_facts(self.path, fingerprint, dim)
                assert fingerprint is not None and dim is not None
                meta = {
                    "format": FORMAT, "version": str(VERSION), "model_fingerprint": fingerprint,
                    "dim": str(int(dim)), "dtype": dtype or "float32", "metric": "cosine", "removals": "0",
                }  # fmt: skip
                self.conn.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", meta.items())
        if meta.get("format") != FORMAT:
            raise GalleryError(f"{self.path}: not a marginkit gallery (format {meta.get('format')!r})")
        if meta.get("version") != str(VERSION):
            raise GalleryError(
                f"{self.path}: gallery format version {meta.get('version')}; this marginkit reads {VERSION}"
            )
        for key in ("model_fingerprint", "dim", "dtype", "metric", "removals"):
            if key not in meta:
                raise GalleryError(f"{self.path}: meta table lacks {key!r}")
        if meta["dtype"] not in DTYPES or meta["metric"] != "cosine" or not meta["dim"].isdigit():
            raise GalleryError(
                f"{self.path}: unsupported gallery (dtype {meta['dtype']!r}, metric {meta['metric']!r}, "
                f"dim {meta['dim']!r}); expected cosine embeddings stored as {', '.join(DTYPES)}"
            )
        check_model(self.path, meta, fingerprint, dim)
        if dtype is not None and dtype != meta["dtype"]:
            raise GalleryError(
                f"{self.path}: this gallery stores its templates as {meta['dtype']}, not {dtype}; open it "
                f"with dtype={meta['dtype']!r} (or None), or enroll into a new file to change the storage"
            )
        return meta

    def close(self) -> None:
        self.conn.close()

    # ------------------------------------------------------------------ transactions
    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        """Every statement of a write goes through here (tests inject faults at each one)."""
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        return self.conn.executemany(sql, rows)

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """One write transaction: committed on success, rolled back on any exception."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """A read transaction: every SELECT inside sees the same committed state."""
        self.conn.execute("BEGIN")
        try:
            yield
        finally:
            self.conn.execute("COMMIT")

    def data_version(self) -> int:
        """Changes when another connection commits (SQLite's ``PRAGMA data_version``)."""
        return int(self.conn.execute("PRAGMA data_version").fetchone()[0])

    # ------------------------------------------------------------------ writes
    def encode(self, codes: np.ndarray, scales: np.ndarray | None) -> list[bytes]:
        """One BLOB per row of ``codes`` (the gallery's dtype) and, for int8, ``scales``."""
        rows = np.ascontiguousarray(codes, dtype=_NP[self.dtype])
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"codes must have shape [n, {self.dim}], got {list(rows.shape)}")
        if self.dtype != "int8":
            return [r.tobytes() for r in rows]
        if scales is None or np.shape(scales) != (len(rows),):
            raise ValueError("int8 codes need one scale per row")
        scale = np.ascontiguousarray(scales, dtype=_SCALE)
        return [s.tobytes() + r.tobytes() for s, r in zip(scale, rows, strict=True)]

    def add_templates(
        self,
        names: Sequence[str],
        codes: np.ndarray,
        metadata: dict[str, str],
        scales: np.ndarray | None = None,
    ) -> None:
        """Rows ``codes[i]`` (with ``scales[i]`` for int8) as templates of identity ``names[i]``
        (created if new), one transaction.

        ``metadata`` maps names to JSON texts that replace the stored metadata.
        """
        blobs = self.encode(codes, scales)
        unique = list(dict.fromkeys(names))
        now = time.time()
        with self.write():
            self.executemany(
                "INSERT INTO identities(name, metadata, created) VALUES (?, ?, ?) ON CONFLICT(name) "
                "DO UPDATE SET metadata = COALESCE(excluded.metadata, identities.metadata)",
                ((n, metadata.get(n), now) for n in unique),
            )
            ids: dict[str, int] = {}
            for s in range(0, len(unique), 500):
                chunk = unique[s : s + 500]
                marks = ",".join("?" * len(chunk))
                rows = self.execute(f"SELECT name, id FROM identities WHERE name IN ({marks})", chunk)
                ids.update(rows.fetchall())
            self.executemany(
                "INSERT INTO templates(identity, dim, dtype, vector) VALUES (?, ?, ?, ?)",
                ((ids[n], self.dim, self.dtype, blobs[i]) for i, n in enumerate(names)),
            )

    def remove(self, name: str) -> bool:
        """Delete an identity and its templates; False when there is no such identity."""
        with self.write():
            cur = self.execute("DELETE FROM identities WHERE name = ?", (name,))
            if cur.rowcount == 0:
                return False
            self.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'removals'")
        return True

    # ------------------------------------------------------------------ reads
    def removals(self) -> int:
        return int(self.conn.execute("SELECT value FROM meta WHERE key = 'removals'").fetchone()[0])

    def identities_after(self, last_id: int) -> list[tuple[int, str]]:
        return self.conn.execute(
            "SELECT id, name FROM identities WHERE id > ? ORDER BY id", (last_id,)
        ).fetchall()

    def templates_after(self, last_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """``(template ids, identity ids, codes [n, dim], scales [n] or None)`` of the templates
        above ``last_id``: codes in the gallery's dtype (native byte order), scales for int8."""
        rows = self.conn.execute(
            "SELECT id, identity, dim, dtype, vector FROM templates WHERE id > ? ORDER BY id", (last_id,)
        ).fetchall()
        nbytes, dtype = self.row_bytes, self.dtype
        bad = next(
            (
                r
                for r in rows
                if r[2] != self.dim or r[3] != dtype or not isinstance(r[4], bytes) or len(r[4]) != nbytes
            ),
            None,
        )
        if bad is not None:
            size = len(bad[4]) if isinstance(bad[4], (bytes, str)) else 0
            raise GalleryError(
                f"{self.path}: template {bad[0]} holds {size} bytes of dim {bad[2]} {bad[3]}; "
                f"the gallery stores dim {self.dim} {dtype} ({nbytes} bytes): the file is corrupted"
            )
        tids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        owners = np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows))
        raw = np.frombuffer(b"".join(r[4] for r in rows), dtype=np.uint8).reshape(len(rows), nbytes)
        scales = None
        if dtype == "int8":
            scales = raw[:, : _SCALE.itemsize].copy().view(_SCALE).reshape(len(rows)).astype(np.float32)
            raw = raw[:, _SCALE.itemsize :]
            if not (np.isfinite(scales).all() and (scales > 0).all()):
                raise GalleryError(
                    f"{self.path}: some stored int8 templates have a scale that is not a positive "
                    "finite number: the file is corrupted"
                )
        codes = raw.copy().view(_NP[dtype]).reshape(len(rows), self.dim)
        if dtype != "int8" and not np.isfinite(codes).all():
            raise GalleryError(
                f"{self.path}: some stored templates hold NaN or infinite values: the file is corrupted"
            )
        return tids, owners, codes.astype(codes.dtype.newbyteorder("="), copy=False), scales

    def metadata(self, name: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT metadata FROM identities WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise KeyError(name)
        return None if row[0] is None else json.loads(row[0])

    def integrity_check(self) -> str:
        return str(self.conn.execute("PRAGMA integrity_check").fetchone()[0])
