"""``MilvusGallery``: the :class:`~marginkit.gallery.Gallery` API over Milvus (``pymilvus``).

``Gallery("faces.milvus.db", ...)`` opens a local milvus-lite file (in-process, one process at
a time); ``Gallery("milvus://host:19530/faces", ...)`` (or ``http(s)://host:port``, collection
``marginkit_gallery``) a Milvus server or cluster, shared by any number of processes. Needs
``pip install 'marginkit[milvus]'``.

Two collections: ``<name>_templates`` (``tid`` auto id, ``identity``, ``vector`` float32, inner
product on unit rows = cosine) and ``<name>_identities`` (``name``, ``seq`` = enrollment
order, ``metadata`` JSON; Milvus requires a vector field, so each row also holds a constant
2-d ``unused`` vector). The gallery's facts (format, model fingerprint, dimension, metric)
are properties of the templates collection, checked on open exactly as the SQLite gallery
checks its ``meta`` table.

Answers: ``identify`` is Milvus's grouping search (``group_by_field="identity"``, one hit
per identity: the identity's best template), ``verify`` fetches the claimed identities'
templates and takes the largest cosine here, ``classify`` votes over the ``k`` nearest
templates (a tie goes to the identity enrolled first, as in the SQLite gallery). With
``backend="exact"`` (index ``FLAT``) these equal the SQLite gallery's answers; ``"hnsw"``
(``HNSW``, M 16, efConstruction 200, ef max(64, k)) and ``"ivf"`` (``IVF_FLAT``, nlist 128,
nprobe 16) are approximate: measure their recall (docs/deploy.md). Every request reads with
``Strong`` consistency: a query sees every write acknowledged before it.

Writes and what they guarantee (tested with ``kill -9`` on milvus-lite): an enrollment is two
requests, the identity rows (upsert) and then the templates (one insert, all rows of the
enrollment together); when ``enroll`` returns, both are acknowledged by Milvus and survive
the process's death. A crash between the two requests leaves the identity listed with the
templates of its earlier acknowledged enrollments (possibly none) — never templates without
their identity. A removal deletes the templates, then the identity row. There are no
multi-request transactions, so unlike the SQLite gallery a failed enrollment is not rolled
back as a whole.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from marginkit._lazy import install_hint, require
from marginkit.gallery.core import Gallery, UnknownIdentityError
from marginkit.gallery.results import Candidate
from marginkit.gallery.store import GalleryError, check_model, require_facts

__all__ = ["FORMAT", "MILVUS_HINT", "MilvusGallery"]

FORMAT = "marginkit.gallery.milvus"
VERSION = 1
MILVUS_HINT = install_hint("milvus")
DEFAULT_COLLECTION = "marginkit_gallery"
_INDEXES = {
    "exact": ("FLAT", {}, {}),
    "hnsw": ("HNSW", {"M": 16, "efConstruction": 200}, {"ef": 64}),
    "ivf": ("IVF_FLAT", {"nlist": 128}, {"nprobe": 16}),
}
_MAX_LIMIT = 16_384  # Milvus's largest topk

# milvus-lite has no server timestamps: pymilvus's query iterator warns on every use that it
# takes the client's, which is right for a local file. Only that message is dropped.
logging.getLogger("pymilvus.client.iterator.query_iterator").addFilter(
    lambda record: "mvccTs" not in record.getMessage()
)


def _literal(text: str) -> str:
    """A Milvus string literal (JSON escaping of quotes and backslashes; names hold no control
    characters), so that no identity name can change a filter expression."""
    return json.dumps(text, ensure_ascii=False)


def _in(names: list[str]) -> str:
    return f"[{', '.join(_literal(n) for n in names)}]"


class MilvusGallery(Gallery):
    """A :class:`~marginkit.gallery.Gallery` stored and searched in Milvus (see the module
    docstring); made by ``Gallery(path_or_uri, ...)`` when the path names Milvus.

    ``backend``: ``"exact"`` (FLAT, the default), ``"hnsw"`` or ``"ivf"``; chosen when the
    collection is created (opening it with another one is an error: the index is Milvus's).
    """

    BACKENDS = ("exact", "hnsw", "ivf")

    # ------------------------------------------------------------------ opening
    def _open(
        self,
        path: Any,
        model_fingerprint: str | None,
        embedding_dim: int | None,
        timeout: float,
        dtype: str | None,
    ) -> None:
        if dtype not in (None, "float32"):
            raise ValueError(
                f"dtype {dtype!r}: a Milvus gallery stores float32 templates (float16 and int8 "
                "storage are the SQLite gallery's)"
            )
        self.dtype = "float32"
        require("pymilvus", extra="milvus", purpose="a Milvus gallery")
        from pymilvus import DataType, MilvusClient, MilvusException

        self._errors = (MilvusException,)
        text = os.fspath(path)
        self.path = text
        if text.startswith(("milvus://", "http://", "https://")):
            parts = urlsplit(text)
            scheme = "http" if parts.scheme == "milvus" else parts.scheme
            uri = f"{scheme}://{parts.hostname}:{parts.port or 19530}"
            token = f"{parts.username}:{parts.password or ''}" if parts.username else ""
            collection = parts.path.strip("/") or DEFAULT_COLLECTION
            where = f"{uri}/{collection}"
        else:
            if not os.path.isdir(os.path.dirname(os.path.abspath(text))):
                raise GalleryError(f"{text}: directory {os.path.dirname(text) or '.'} does not exist")
            require("milvus_lite", extra="milvus", purpose="a milvus-lite gallery file")
            uri, token, collection, where = text, "", DEFAULT_COLLECTION, text
        if not collection.replace("_", "").isalnum():
            raise GalleryError(
                f"{where}: a collection name holds letters, digits and '_', got {collection!r}"
            )
        self._where = where
        try:
            self._client = MilvusClient(uri=uri, token=token, timeout=timeout)
        except Exception as exc:  # pymilvus raises several kinds (connection, lock of a local file)
            raise GalleryError(
                f"{where}: cannot open the Milvus gallery ({exc}); a milvus-lite file is open in one "
                "process at a time"
            ) from None
        self._tcol, self._icol = f"{collection}_templates", f"{collection}_identities"
        try:
            facts = self._facts_or_create(DataType, model_fingerprint, embedding_dim)
        except self._errors as exc:
            raise GalleryError(f"{where}: Milvus refused the gallery ({exc})") from None
        self.model_fingerprint = facts["model_fingerprint"]
        self.embedding_dim = int(facts["dim"])
        self._count_hint = 0

    def _facts_or_create(self, data_type: Any, fingerprint: str | None, dim: int | None) -> dict[str, str]:
        c = self._client
        index_type, build, _ = _INDEXES[self.backend]
        if not c.has_collection(self._tcol):
            require_facts(self._where, fingerprint, dim)
            assert fingerprint is not None and dim is not None
            facts = {
                "format": FORMAT, "version": str(VERSION), "model_fingerprint": fingerprint,
                "dim": str(int(dim)), "metric": "cosine",
            }  # fmt: skip
            schema = c.create_schema(auto_id=True, enable_dynamic_field=False)
            schema.add_field("tid", data_type.INT64, is_primary=True)
            schema.add_field("identity", data_type.VARCHAR, max_length=1024)
            schema.add_field("vector", data_type.FLOAT_VECTOR, dim=int(dim))
            index = c.prepare_index_params()
            index.add_index(field_name="vector", index_type=index_type, metric_type="IP", params=build)
            # The identities first: a templates collection always has its identities beside it.
            ischema = c.create_schema(auto_id=False, enable_dynamic_field=False)
            ischema.add_field("name", data_type.VARCHAR, is_primary=True, max_length=1024)
            ischema.add_field("seq", data_type.INT64)
            ischema.add_field("metadata", data_type.VARCHAR, max_length=65_535)
            ischema.add_field("unused", data_type.FLOAT_VECTOR, dim=2)
            iindex = c.prepare_index_params()
            iindex.add_index(field_name="unused", index_type="FLAT", metric_type="L2")
            if not c.has_collection(self._icol):
                c.create_collection(
                    self._icol, schema=ischema, index_params=iindex, consistency_level="Strong"
                )
            c.create_collection(
                self._tcol, schema=schema, index_params=index, consistency_level="Strong",
                properties={"marginkit": json.dumps(facts)},
            )  # fmt: skip
        described = c.describe_collection(self._tcol)
        try:
            facts = json.loads(described.get("properties", {}).get("marginkit", ""))
        except ValueError:
            facts = None
        if not isinstance(facts, dict) or facts.get("format") != FORMAT:
            raise GalleryError(f"{self._where}: collection {self._tcol} is not a marginkit gallery")
        if facts.get("version") != str(VERSION):
            raise GalleryError(
                f"{self._where}: gallery format version {facts.get('version')}; "
                f"this marginkit reads {VERSION}"
            )
        check_model(self._where, facts, fingerprint, dim)
        have = c.describe_index(self._tcol, "vector").get("index_type")
        if have != index_type:
            raise GalleryError(
                f"{self._where}: this Milvus gallery is indexed with {have}; open it with "
                f"backend={next((b for b, v in _INDEXES.items() if v[0] == have), have)!r}"
            )
        c.load_collection(self._tcol)
        c.load_collection(self._icol)
        return facts

    # ------------------------------------------------------------------ helpers
    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self._client, method)(*args, **kwargs)
        except self._errors as exc:
            raise GalleryError(f"{self._where}: Milvus {method} failed ({exc})") from None

    def _count(self, collection: str, expr: str = "") -> int:
        rows = self._call("query", collection, filter=expr, output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def _rows(self, collection: str, expr: str, fields: list[str]) -> list[dict[str, Any]]:
        """Every row matching ``expr`` (an iterator: a plain query stops at Milvus's limit)."""
        rows: list[dict[str, Any]] = []
        try:
            iterator = self._client.query_iterator(
                collection, batch_size=4096, filter=expr, output_fields=fields
            )
            while batch := iterator.next():
                rows.extend(batch)
            iterator.close()
        except self._errors as exc:
            raise GalleryError(f"{self._where}: Milvus query failed ({exc})") from None
        return rows

    def _identity_rows(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        expr = "" if names is None else f"name in {_in(names)}"
        rows = self._rows(self._icol, expr, ["name", "seq", "metadata"])
        return sorted(rows, key=lambda r: (r["seq"], r["name"]))

    # ------------------------------------------------------------------ writes
    def _add(self, names: list[str], vectors: torch.Tensor, metadata: dict[str, str]) -> dict[str, int]:
        unique = list(dict.fromkeys(names))
        known = {r["name"]: r for r in self._identity_rows(unique)}
        now = time.time_ns()
        rows = [
            {
                "name": n,
                "seq": known[n]["seq"] if n in known else now + i,
                "metadata": metadata.get(n, known[n]["metadata"] if n in known else ""),
                "unused": [0.0, 0.0],
            }
            for i, n in enumerate(unique)
            if n not in known or n in metadata
        ]
        if rows:
            self._call("upsert", self._icol, rows)
        data = np.ascontiguousarray(vectors.numpy(), dtype=np.float32)
        self._call(
            "insert", self._tcol, [{"identity": n, "vector": v} for n, v in zip(names, data, strict=True)]
        )
        self._count_hint += len(names)
        total = dict.fromkeys(unique, 0)
        for row in self._rows(self._tcol, f"identity in {_in(unique)}", ["identity"]):
            total[row["identity"]] += 1
        return total

    def _remove(self, name: str) -> bool:
        if not self._identity_rows([name]):
            return False
        self._call("delete", self._tcol, filter=f"identity == {_literal(name)}")
        self._call("delete", self._icol, filter=f"name == {_literal(name)}")
        return True

    # ------------------------------------------------------------------ queries
    def _vectors_of(self, names: list[str]) -> list[tuple[str, np.ndarray]]:
        rows = self._rows(self._tcol, f"identity in {_in(names)}", ["identity", "vector"])
        return [(r["identity"], np.asarray(r["vector"], dtype=np.float32)) for r in rows]

    def _best_scores(self, emb: torch.Tensor, names: list[str]) -> torch.Tensor:
        unique = list(dict.fromkeys(names))
        known = {r["name"] for r in self._identity_rows(unique)}
        missing = next((n for n in names if n not in known), None)
        if missing is not None:
            raise UnknownIdentityError(missing)
        scores = torch.full((len(names),), -torch.inf)
        rows = self._vectors_of(unique)
        if not rows:
            return scores
        owners = np.array([n for n, _ in rows])
        vectors = torch.from_numpy(np.stack([v for _, v in rows]))
        sims = emb @ vectors.T  # [B, templates]
        for i, n in enumerate(names):
            mask = torch.from_numpy(owners == n)
            if bool(mask.any()):
                scores[i] = sims[i, mask].max()
        return scores

    def _search(self, emb: torch.Tensor, limit: int, **kwargs: Any) -> list[list[dict[str, Any]]]:
        _, _, params = _INDEXES[self.backend]
        params = {**params, **({"ef": max(params["ef"], limit)} if "ef" in params else {})}
        return self._call(
            "search", self._tcol, data=emb.numpy(), limit=limit, output_fields=["identity"],
            search_params={"metric_type": "IP", "params": params}, anns_field="vector", **kwargs,
        )  # fmt: skip

    def _top_identities(self, emb: torch.Tensor, k: int) -> list[tuple[Candidate, ...]]:
        hits = self._search(emb, min(k, _MAX_LIMIT), group_by_field="identity", group_size=1)
        return [
            tuple(Candidate(h["entity"]["identity"], float(h["distance"])) for h in probe_hits)
            for probe_hits in hits
        ]

    def _vote(self, emb: torch.Tensor) -> list[tuple[str, float]]:
        n = self._count(self._tcol)
        if n == 0:
            raise GalleryError(f"{self._where}: the gallery is empty; enroll identities first")
        k = min(self.k, n, _MAX_LIMIT)
        hits = self._search(emb, k)
        owners = sorted({h["entity"]["identity"] for probe_hits in hits for h in probe_hits})
        order = {r["name"]: r["seq"] for r in self._identity_rows(owners)}
        out = []
        for probe_hits in hits:
            votes: dict[str, int] = {}
            for h in probe_hits:
                votes[h["entity"]["identity"]] = votes.get(h["entity"]["identity"], 0) + 1
            # Most votes; a tie goes to the identity enrolled first (the SQLite gallery's rule).
            winner = min(votes, key=lambda name: (-votes[name], order.get(name, 0), name))
            out.append((winner, votes[winner] / len(probe_hits)))
        return out

    # ------------------------------------------------------------------ facts
    def __len__(self) -> int:
        with self._lock:
            return self._count(self._icol)

    def __contains__(self, identity: object) -> bool:
        if not isinstance(identity, str):
            return False
        with self._lock:
            return bool(self._identity_rows([identity]))

    @property
    def num_templates(self) -> int:
        with self._lock:
            n = self._count(self._tcol)
            self._count_hint = n
            return n

    def size_hint(self) -> int:
        return self._count_hint

    def identities(self) -> list[str]:
        with self._lock:
            return [r["name"] for r in self._identity_rows()]

    def templates(self, identity: str) -> torch.Tensor:
        with self._lock:
            if identity not in self:
                raise UnknownIdentityError(str(identity))
            rows = self._vectors_of([identity])
        return (
            torch.from_numpy(np.stack([v for _, v in rows])) if rows else torch.empty(0, self.embedding_dim)
        )

    def metadata(self, identity: str) -> dict[str, Any] | None:
        with self._lock:
            rows = self._identity_rows([identity]) if isinstance(identity, str) else []
        if not rows:
            raise UnknownIdentityError(str(identity))
        return json.loads(rows[0]["metadata"]) if rows[0]["metadata"] else None

    def integrity_check(self) -> str:
        """``"ok"`` when every template's owner is an enrolled identity (what the two-request
        writes could break); else names the orphans."""
        with self._lock:
            known = {r["name"] for r in self._identity_rows()}
            owners = {r["identity"] for r in self._rows(self._tcol, "", ["identity"])}
        orphans = sorted(owners - known)
        return "ok" if not orphans else f"templates without an identity: {orphans[:10]}"

    def close(self) -> None:
        with self._lock:
            self._client.close()

    def __repr__(self) -> str:
        return f"MilvusGallery({self._where!r}, backend={self.backend!r})"
