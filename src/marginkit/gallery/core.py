"""``Gallery``: enrolled identities in SQLite, answered from an in-memory index kept in step.

Scores are cosines of L2-normalised embeddings. An identity holds one or more templates;
its score against a probe is the largest template cosine,

.. math:: s(q, c) = \\max_{t \\in T_c} \\langle q, t \\rangle / (\\lVert q \\rVert \\lVert t \\rVert),

and a decision accepts iff ``s > threshold`` (the rule of
:func:`marginkit.metrics.verification_metrics`, so a threshold calibrated at FAR ``f`` on
validation pairs gives FAR ``<= f`` on pairs like them).

Identification ranks identities by ``s``: the ``k`` best identities are the first ``k``
distinct owners among the ``k * T_max`` nearest templates (``T_max`` = most templates of
one identity), which is exact whenever the template search is (the ``exact`` and
``faiss`` backends of :class:`~marginkit.knn.KNNClassifier`).

Consistency across processes: before every query the gallery asks SQLite whether another
connection committed (``PRAGMA data_version``); if so it loads the identities and templates
above the last ids it has seen, or rebuilds from the file after a removal.
"""

from __future__ import annotations

import collections
import json
import math
import os
import threading
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from marginkit.gallery.quantize import check_dtype, dequantize, quantize, search, torch_dtype
from marginkit.gallery.results import Candidate, Classification, Enrollment, Identification, Verification
from marginkit.gallery.store import GalleryError, Store
from marginkit.knn._search import prepare

__all__ = ["Gallery", "UnknownIdentityError", "is_milvus"]

MAX_NAME = 256
MAX_METADATA_BYTES = 64 * 1024


class UnknownIdentityError(LookupError):
    """The identity is not enrolled in the gallery."""

    def __init__(self, identity: str) -> None:
        super().__init__(f"unknown identity {identity!r}: it is not enrolled in this gallery")
        self.identity = identity


#: The storages other than SQLite, by name: (module, class), imported when a path asks for one. The
#: subclass imports this module, so naming it here (not importing it) keeps the layers acyclic.
_STORAGES = {"milvus": ("marginkit.gallery.milvus", "MilvusGallery")}


def _storage(name: str) -> type[Gallery]:
    import importlib

    module, cls = _STORAGES[name]
    return getattr(importlib.import_module(module), cls)


def is_milvus(path: Any) -> bool:
    """Whether ``path`` names a Milvus gallery: ``milvus://host:port[/collection]``, an
    ``http(s)://`` URI of a Milvus server, or a local milvus-lite file ``*.milvus.db``."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
    return text.startswith(("milvus://", "http://", "https://")) or text.endswith(".milvus.db")


def _check_name(identity: Any, name: str = "identity") -> str:
    if not isinstance(identity, str):
        raise TypeError(f"{name} must be a str, got {type(identity).__name__}")
    if not 0 < len(identity) <= MAX_NAME:
        raise ValueError(f"{name} must have 1 to {MAX_NAME} characters, got {len(identity)}")
    if any(unicodedata.category(c)[0] == "C" for c in identity):
        raise ValueError(f"{name} must not contain control characters, got {identity!r}")
    return identity


def _metadata_json(metadata: Any) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict (JSON object) or None, got {type(metadata).__name__}")
    try:
        text = json.dumps(metadata, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be JSON-serialisable without NaN: {exc}") from None
    if len(text.encode()) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {len(text.encode())} bytes as JSON; at most {MAX_METADATA_BYTES}")
    return text


class Gallery:
    """A persistent gallery of identities for verification, open-set identification and K-NN.

    Args:
        path: the SQLite file (created when missing).
        embedder: an object that turns raw inputs into embeddings — a
            :class:`~marginkit.export.Bundle` (``embed``, ``input_shape``, ``embedding_dim``,
            ``model_fingerprint``, ``threshold(far)``); then enroll and query with raw inputs
            too. Its fingerprint and dimension are the gallery's.
        model_fingerprint: fingerprint (str or the ``nn.Module``) of the model whose
            embeddings the gallery holds; needed to create a gallery without ``embedder``.
            A gallery made with another fingerprint refuses to open (:class:`GalleryError`).
        embedding_dim: ``D``; needed to create a gallery without ``embedder``.
        far: target false-accept rate of the decisions, looked up in the embedder's
            calibration table (ignored when ``threshold`` is given).
        threshold: explicit score threshold (accept iff score > threshold).
        k: neighbours of :meth:`classify`'s vote.
        backend: the template search: ``"exact"`` (torch), ``"faiss"`` (FAISS flat, exact),
            ``"hnsw"`` (FAISS HNSW) or ``"ivf"`` (FAISS inverted lists, cells trained once
            there are 39² templates), both approximate, for millions of templates (their recall
            is measured by ``benchmarks/bench_gallery_scale.py``); the last three with
            ``marginkit[faiss]``. :meth:`verify` is always exact. A Milvus gallery takes
            ``"exact"``, ``"hnsw"`` or ``"ivf"``.
            Templates stored as float16 or int8 are searched exactly (``"exact"`` only).
        timeout: seconds a write waits for another process's transaction.
        dtype: how a new gallery stores its templates, on disk and in memory: ``"float32"``
            (``4 D`` bytes each), ``"float16"`` (``2 D``) or ``"int8"`` (``D + 4``: codes with one
            scale per template, :mod:`marginkit.gallery.quantize`); scores are then computed
            from the stored values (float16: within about 1e-3 of the float32 cosine, int8:
            within ``sqrt(D) / 254``). ``None`` (the default) keeps an existing gallery's and
            makes a new one float32; another dtype than the file's is an error. The Milvus
            storage keeps float32.

    Thread-safe: one lock serialises the calls of the threads of a process; other processes
    read concurrently (SQLite WAL) and write one at a time.

    Example:
        >>> import tempfile, torch
        >>> g = Gallery(tempfile.mktemp(suffix=".db"), model_fingerprint="demo", embedding_dim=2,
        ...             threshold=0.5)
        >>> g.enroll("alice", torch.tensor([1.0, 0.0])).templates
        1
        >>> g.verify(torch.tensor([0.9, 0.1]), "alice").match
        True
        >>> g.identify(torch.tensor([0.0, 1.0])).identity is None   # unknown
        True
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        embedder: Any = None,
        *,
        model_fingerprint: str | nn.Module | None = None,
        embedding_dim: int | None = None,
        far: float | None = 1e-3,
        threshold: float | None = None,
        k: int = 5,
        backend: str = "exact",
        timeout: float = 30.0,
        dtype: str | None = None,
    ) -> None:
        from marginkit._validation import choice, positive_int
        from marginkit.knn import model_fingerprint as fingerprint_of

        if isinstance(model_fingerprint, nn.Module):
            model_fingerprint = fingerprint_of(model_fingerprint)
        if embedder is not None:
            fp = str(embedder.model_fingerprint)
            if model_fingerprint is not None and model_fingerprint != fp:
                raise ValueError(
                    f"model_fingerprint {model_fingerprint!r} differs from the embedder's {fp!r}"
                )
            model_fingerprint, embedding_dim = fp, int(embedder.embedding_dim)
        if model_fingerprint is not None and not isinstance(model_fingerprint, str):
            raise TypeError(
                f"model_fingerprint must be a str or nn.Module, got {type(model_fingerprint).__name__}"
            )
        if embedding_dim is not None:
            embedding_dim = positive_int(embedding_dim, "embedding_dim")
        self.k = positive_int(k, "k")
        self.backend = choice(backend, "backend", self.BACKENDS)
        self.embedder = embedder
        self.threshold: float | None = None
        self._threshold_error = "no decision threshold: pass threshold=, or an embedder calibrated at far="
        if threshold is not None:
            if (
                isinstance(threshold, bool)
                or not isinstance(threshold, (int, float))
                or not math.isfinite(threshold)
            ):
                raise ValueError(f"threshold must be a finite number, got {threshold!r}")
            self.threshold = float(threshold)
        elif far is not None and embedder is not None and hasattr(embedder, "threshold"):
            try:
                self.threshold = float(embedder.threshold(far))
            except ValueError as exc:
                self._threshold_error = str(exc)
        self.far = far if threshold is None else None
        if dtype is not None:
            dtype = check_dtype(dtype)
        self._lock = threading.RLock()
        self._open(path, model_fingerprint, embedding_dim, timeout, dtype)

    def __new__(cls, path: Any = None, *args: Any, **kwargs: Any) -> Gallery:
        if cls is Gallery and is_milvus(path):
            return super().__new__(_storage("milvus"))
        return super().__new__(cls)

    #: Template searches this storage offers (``backend=``).
    BACKENDS: tuple[str, ...] = ("exact", "faiss", "hnsw", "ivf")

    def _open(
        self,
        path: Any,
        model_fingerprint: str | None,
        embedding_dim: int | None,
        timeout: float,
        dtype: str | None,
    ) -> None:
        if self.backend != "exact":  # a missing FAISS fails now, naming its extra, not at the first search
            from marginkit.knn import KNNClassifier

            KNNClassifier(k=1, backend=self.backend)
        self._store = Store(path, model_fingerprint, embedding_dim, timeout, dtype)
        self.path = self._store.path
        self.model_fingerprint: str = self._store.model_fingerprint
        self.embedding_dim: int = self._store.dim
        #: How the templates are stored (``float32``, ``float16`` or ``int8``).
        self.dtype: str = self._store.dtype
        if self.dtype != "float32" and self.backend != "exact":
            self._store.close()
            raise ValueError(
                f"backend {self.backend!r} searches float32 templates; this gallery stores them as "
                f"{self.dtype}, which is searched exactly: use backend='exact'"
            )
        self._reset()
        self._data_version = self._store.data_version()
        self._sync(force=True)

    # ------------------------------------------------------------------ in-memory state
    def _reset(self) -> None:
        self._names: list[str] = []  # dense identity index -> name
        self._db_ids = np.empty(0, dtype=np.int64)  # dense index -> database id (increasing)
        self._index_of: dict[str, int] = {}  # name -> dense index
        self._owner = torch.empty(0, dtype=torch.long)  # template -> dense identity index
        # float16 / int8 templates as stored: codes, and one scale each for int8. float32
        # templates live in the K-NN index alone (one copy in memory).
        self._codes = torch.empty(0, self._store.dim, dtype=torch_dtype(self._store.dtype))
        self._scales: torch.Tensor | None = torch.empty(0) if self._store.dtype == "int8" else None
        self._knn: Any = None  # float32 templates: the K-NN index of `backend`
        self._csr: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._last_identity = self._last_template = 0
        self._removals = -1

    def _sync(self, *, force: bool = False) -> None:
        """Bring the in-memory index in step with the database (see the module docstring)."""
        version = self._store.data_version()
        if not force and version == self._data_version:
            return
        with self._store.snapshot():
            removals = self._store.removals()
            if removals != self._removals:
                self._reset()
                self._removals = removals
            new_ids = self._store.identities_after(self._last_identity)
            tids, owners, codes, scales = self._store.templates_after(self._last_template)
        self._data_version = version
        for _, name in new_ids:
            self._index_of[name] = len(self._names)
            self._names.append(name)
        if new_ids:
            self._last_identity = new_ids[-1][0]
            self._db_ids = np.concatenate([self._db_ids, np.array([i for i, _ in new_ids], dtype=np.int64)])
        if len(tids) == 0:
            return
        # Identities arrive in id order, so the dense index of an owner is its rank among the ids.
        dense = torch.from_numpy(np.searchsorted(self._db_ids, owners))
        vec = torch.from_numpy(codes)
        self._last_template = int(tids[-1])
        self._owner = torch.cat([self._owner, dense])
        self._csr = None
        if self.dtype != "float32":
            self._codes = torch.cat([self._codes, vec])
            if self._scales is not None and scales is not None:
                self._scales = torch.cat([self._scales, torch.from_numpy(scales)])
            return
        if self._knn is None:
            from marginkit.knn import KNNClassifier

            self._knn = KNNClassifier(k=1, backend=self.backend).fit(vec, dense)
        else:
            self._knn.add(vec, dense)

    def _templates_csr(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Templates grouped by identity: ``(order, offsets, most templates of one identity)``;
        identity ``i``'s templates are ``order[offsets[i]:offsets[i + 1]]``."""
        if self._csr is None:
            order = torch.argsort(self._owner, stable=True)
            counts = torch.bincount(self._owner, minlength=len(self._names))
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
            self._csr = (order, offsets, int(counts.max()) if len(counts) else 0)
        return self._csr

    # ------------------------------------------------------------------ inputs
    def _as_embeddings(self, x: Any, kind: str, name: str) -> tuple[torch.Tensor, bool]:
        """``(unit rows [B, D] float32, single)`` from embeddings or raw inputs."""
        from marginkit._validation import choice

        kind = choice(kind, "kind", ("auto", "embeddings", "inputs"))
        if not isinstance(x, torch.Tensor):
            array = np.asarray(x)
            if array.dtype.kind not in "biuf":
                raise TypeError(f"{name} must hold numbers (a tensor or array), got dtype {array.dtype}")
            x = torch.from_numpy(np.ascontiguousarray(array))
        if x.is_complex():
            raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
        t = x
        shape = tuple(t.shape)
        d = self.embedding_dim
        as_emb = len(shape) in (1, 2) and len(shape) > 0 and shape[-1] == d
        in_shape = tuple(self.embedder.input_shape) if self.embedder is not None else None
        as_inp = in_shape is not None and (shape == in_shape or shape[1:] == in_shape)
        if kind == "auto":
            if as_emb and as_inp:
                raise ValueError(
                    f"{name} of shape {list(shape)} could be embeddings or raw inputs; "
                    "pass kind='embeddings' or kind='inputs'"
                )
            kind = "inputs" if as_inp else "embeddings"
        if kind == "inputs":
            if self.embedder is None:
                raise ValueError(f"{name}: raw inputs need a gallery opened with an embedder (a bundle)")
            if not as_inp:
                raise ValueError(
                    f"{name} must have shape [B, {', '.join(map(str, in_shape or ()))}] (raw inputs), "
                    f"got {list(shape)}"
                )
            single = shape == in_shape
            emb = self.embedder.embed(t[None] if single else t)
        else:
            if not as_emb:
                hint = f" or raw inputs [B, {', '.join(map(str, in_shape))}]" if in_shape else ""
                raise ValueError(
                    f"{name} must be embeddings [D] or [B, D] with D = {d}{hint}, got {list(shape)}"
                )
            if not torch.is_floating_point(t):
                t = t.to(torch.float32)
            single = len(shape) == 1
            emb = t.reshape(-1, d)
        emb = emb.detach().cpu()  # in its own precision: `prepare` casts (a float64 1e300 is a direction)
        if emb.shape[0] == 0:
            raise ValueError(f"{name} holds no sample")
        if not bool(torch.isfinite(emb).all()):
            raise ValueError(f"{name} contains NaN or infinite values")
        return prepare(emb, "cosine", name, torch.float32), single

    def _require_threshold(self) -> float:
        if self.threshold is None:
            raise GalleryError(self._threshold_error)
        return self.threshold

    # ------------------------------------------------------------------ writes
    def enroll(
        self,
        identity: str,
        embeddings_or_inputs: Any,
        metadata: dict[str, Any] | None = None,
        *,
        kind: str = "auto",
    ) -> Enrollment:
        """Add templates ``[T, D]`` (or ``[D]``, or raw inputs) to ``identity`` (created if new).

        One transaction: when this returns, the enrollment is on disk (WAL, ``synchronous=FULL``)
        and survives a crash. ``metadata`` (a JSON object), when given, replaces the stored one.
        ``kind``: ``"auto"`` (by shape), ``"embeddings"`` or ``"inputs"``.
        """
        name = _check_name(identity)
        meta = _metadata_json(metadata)
        emb, _ = self._as_embeddings(embeddings_or_inputs, kind, "embeddings_or_inputs")
        with self._lock:
            total = self._add([name] * emb.shape[0], emb, {} if meta is None else {name: meta})
        return Enrollment(name, int(emb.shape[0]), total[name])

    def enroll_many(
        self, identities: Sequence[str], embeddings_or_inputs: Any, *, kind: str = "auto"
    ) -> list[Enrollment]:
        """Row ``i`` becomes a template of ``identities[i]``; all rows in one transaction."""
        if isinstance(identities, str) or not isinstance(identities, Sequence):
            raise TypeError("identities must be a sequence of str, one per row")
        names = [_check_name(n, f"identities[{i}]") for i, n in enumerate(identities)]
        emb, single = self._as_embeddings(embeddings_or_inputs, kind, "embeddings_or_inputs")
        if single or emb.shape[0] != len(names):
            raise ValueError(
                f"{len(names)} identities but {1 if single else emb.shape[0]} rows; they must match"
            )
        with self._lock:
            counts = self._add(names, emb, {})
        return [Enrollment(n, a, counts[n]) for n, a in collections.Counter(names).items()]

    def _add(self, names: list[str], vectors: torch.Tensor, metadata: dict[str, str]) -> dict[str, int]:
        """Store unit rows ``vectors[i]`` as templates of ``names[i]`` in one transaction; the
        templates each of ``names`` holds afterwards."""
        codes, scales = quantize(vectors, self.dtype)
        self._store.add_templates(names, codes.numpy(), metadata, None if scales is None else scales.numpy())
        self._sync(force=True)
        counts = torch.bincount(self._owner, minlength=len(self._names)).tolist()
        return {n: counts[self._index_of[n]] for n in set(names)}

    def remove(self, identity: str) -> None:
        """Delete ``identity`` and its templates in one transaction.

        Raises:
            UnknownIdentityError: ``identity`` is not enrolled.
        """
        name = _check_name(identity)
        with self._lock:
            if not self._remove(name):
                raise UnknownIdentityError(name)

    def _remove(self, name: str) -> bool:
        if not self._store.remove(name):
            return False
        self._sync(force=True)
        return True

    # ------------------------------------------------------------------ queries
    def verify(
        self, probe: Any, identity: str | Sequence[str], *, kind: str = "auto"
    ) -> Verification | list[Verification]:
        """Score of ``probe`` against ``identity`` and the decision ``score > threshold``.

        ``probe``: one embedding ``[D]`` / input, or ``B`` of them with ``identity`` one name
        (all probes against it) or ``B`` names; a batch returns a list.
        """
        emb, single = self._as_embeddings(probe, kind, "probe")
        names = [identity] if isinstance(identity, str) else list(identity)
        names = [_check_name(n) for n in names]
        if len(names) == 1 and emb.shape[0] > 1:
            names = names * emb.shape[0]
        if len(names) != emb.shape[0]:
            raise ValueError(f"{emb.shape[0]} probes but {len(names)} identities; give one or one per probe")
        threshold = self._require_threshold()
        with self._lock:
            scores = self._best_scores(emb, names)
        out = [
            Verification(n, float(s), bool(s > threshold), threshold)
            for n, s in zip(names, scores.tolist(), strict=True)
        ]
        return out[0] if single else out

    def _best_scores(self, emb: torch.Tensor, names: list[str]) -> torch.Tensor:
        """Largest cosine between probe ``i`` and the templates of ``names[i]`` (``[B]``)."""
        self._sync()
        missing = next((n for n in names if n not in self._index_of), None)
        if missing is not None:
            raise UnknownIdentityError(missing)
        order, offsets, _ = self._templates_csr()
        # The rows of each claimed identity's templates: index arithmetic on a few integers,
        # in numpy (views of the CPU tensors), where each step costs a fraction of a torch op.
        order_np, offsets_np = order.numpy(), offsets.numpy()
        idx = np.fromiter((self._index_of[n] for n in names), dtype=np.int64, count=len(names))
        first, counts = offsets_np[idx], offsets_np[idx + 1] - offsets_np[idx]
        probe_of = np.repeat(np.arange(len(names)), counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = torch.from_numpy(order_np[np.repeat(first, counts) + within])
        probe_of_t = torch.from_numpy(probe_of)
        sims = (self._decoded(rows) * emb[probe_of_t]).sum(dim=1)
        return torch.full((len(names),), -math.inf).scatter_reduce(0, probe_of_t, sims, reduce="amax")

    def _decoded(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored templates ``rows`` as float32 ``[len(rows), D]``."""
        if self.dtype == "float32":
            if self._knn is None:
                return torch.empty(0, self.embedding_dim)
            return self._knn.reference_embeddings(copy=False)[rows]
        return dequantize(self._codes[rows], None if self._scales is None else self._scales[rows])

    def _nearest(self, emb: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``m`` nearest templates of each probe: ``(scores, template rows)`` ``[B, m]``,
        by decreasing score, ties to the earlier template."""
        if self._knn is not None:
            return self._knn.kneighbors(emb, m)
        return search(emb, self._codes, self._scales, m)

    def identify(
        self, probe: Any, k: int = 5, *, kind: str = "auto"
    ) -> Identification | list[Identification]:
        """The ``k`` best identities of ``probe`` (ranked by score), with open-set rejection.

        The best candidate is the answer if its score exceeds the threshold, else the probe is
        unknown (``identity=None``). An empty gallery answers unknown with no candidates.
        """
        from marginkit._validation import positive_int

        k = positive_int(k, "k")
        emb, single = self._as_embeddings(probe, kind, "probe")
        threshold = self._require_threshold()
        with self._lock:
            ranked = self._top_identities(emb, k)
        out = []
        for cands in ranked:
            if not cands:
                out.append(Identification(None, None, (), threshold))
                continue
            best = cands[0]
            accepted = best.score > threshold
            out.append(Identification(best.identity if accepted else None, best.score, cands, threshold))
        return out[0] if single else out

    def _top_identities(self, emb: torch.Tensor, k: int) -> list[tuple[Candidate, ...]]:
        """The ``k`` best identities of each probe, best first (none for an empty gallery)."""
        self._sync()
        if len(self._owner) == 0:
            return [() for _ in range(emb.shape[0])]
        n_templates = len(self._owner)
        k_ids = min(k, len(self._names))
        t_max = self._templates_csr()[2]
        m = min(n_templates, k_ids * t_max)
        values, indices = self._nearest(emb, m)
        owners = self._owner[indices]
        names = self._names
        # First occurrence of each owner in score order; its score is the owner's best.
        sorted_owner, perm = owners.sort(dim=1, stable=True)
        first_sorted = torch.ones_like(sorted_owner, dtype=torch.bool)
        first_sorted[:, 1:] = sorted_owner[:, 1:] != sorted_owner[:, :-1]
        first = torch.zeros_like(first_sorted).scatter_(1, perm, first_sorted)
        position = torch.where(first, torch.arange(m).expand_as(first), m)
        top = position.sort(dim=1).values[:, :k_ids]
        top_values = values.gather(1, top).tolist()
        top_owners = owners.gather(1, top).tolist()
        return [
            tuple(Candidate(names[o], float(v)) for v, o in zip(vals, owns, strict=True))
            for vals, owns in zip(top_values, top_owners, strict=True)
        ]

    def classify(self, probe: Any, *, kind: str = "auto") -> Classification | list[Classification]:
        """K-NN vote (``k`` nearest templates, uniform weights) over the enrolled identities."""
        emb, single = self._as_embeddings(probe, kind, "probe")
        with self._lock:
            votes = self._vote(emb)
        out = [Classification(name, share) for name, share in votes]
        return out[0] if single else out

    def _vote(self, emb: torch.Tensor) -> list[tuple[str, float]]:
        """The winner of each probe's vote over its ``k`` nearest templates, with its share."""
        self._sync()
        if len(self._owner) == 0:
            raise GalleryError(f"{self.path}: the gallery is empty; enroll identities first")
        k = min(self.k, len(self._owner))
        if self._knn is not None:
            # The classifier is refitted incrementally, so its k is set here, not at fit time.
            self._knn.k = k
            proba = self._knn.predict_proba(emb)
            owner_of_column = self._knn.classes_  # identities with templates, by dense index
        else:
            from marginkit.knn.classifier import vote_proba

            values, rows = self._nearest(emb, k)
            proba = vote_proba(
                values, self._owner[rows], metric="cosine", weights="uniform", num_classes=len(self._names)
            )
            owner_of_column = torch.arange(len(self._names))
        names = self._names
        # A tie goes to the first column: the earliest enrolled of the tied identities.
        share, winner = proba.max(dim=1)
        return [
            (names[int(owner_of_column[w])], float(s))
            for w, s in zip(winner.tolist(), share.tolist(), strict=True)
        ]

    # ------------------------------------------------------------------ facts
    def __len__(self) -> int:
        with self._lock:
            self._sync()
            return len(self._names)

    def __contains__(self, identity: object) -> bool:
        with self._lock:
            self._sync()
            return identity in self._index_of

    @property
    def num_templates(self) -> int:
        with self._lock:
            self._sync()
            return len(self._owner)

    def size_hint(self) -> int:
        """Templates the gallery held at its last look at the storage: cheap (no check of the
        file), and it may lag other processes' commits; for sizing work, never for answers."""
        return len(self._owner)

    def identities(self) -> list[str]:
        """Enrolled identity names, in enrollment order."""
        with self._lock:
            self._sync()
            return list(self._names)

    def templates(self, identity: str) -> torch.Tensor:
        """The stored (unit) templates ``[T, D]`` of ``identity``."""
        with self._lock:
            self._sync()
            if identity not in self._index_of:
                raise UnknownIdentityError(str(identity))
            return self._decoded((self._owner == self._index_of[identity]).nonzero().squeeze(1))

    def metadata(self, identity: str) -> dict[str, Any] | None:
        with self._lock:
            try:
                return self._store.metadata(identity)
            except KeyError:
                raise UnknownIdentityError(identity) from None

    def integrity_check(self) -> str:
        """SQLite's ``PRAGMA integrity_check`` (``"ok"`` for a sound file)."""
        with self._lock:
            return self._store.integrity_check()

    def close(self) -> None:
        with self._lock:
            self._store.close()

    def __enter__(self) -> Gallery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Gallery({str(self.path)!r}, identities={len(self._names)}, templates={len(self._owner)})"
