"""Index backends of :class:`~marginkit.knn.KNNClassifier`: exact torch, FAISS flat, FAISS HNSW,
FAISS IVF.

Every backend stores *prepared* reference vectors (cast to the working precision and, for
``metric="cosine"``, L2-normalised), grows with :meth:`add` without rebuilding, and answers
``search(queries, k) -> (values, indices)`` with cosine similarities (descending) or
Euclidean distances (ascending), neighbours ordered by value then by reference index.

FAISS is imported lazily, inside the backends that need it; when it is missing the error
names the extra to install.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import torch

from marginkit._lazy import require
from marginkit.knn._search import candidate_margin, exact_search, neg_sqnorms, prepare, rerank, sqnorms

_RERANK_BYTES = 64 * 2**20  # temporaries of HNSW's distance recomputation


def import_faiss() -> Any:
    """Import FAISS or raise :class:`~marginkit._lazy.MissingExtraError` naming the extra to install."""
    return require("faiss", extra="faiss", purpose="the 'faiss', 'hnsw' and 'ivf' K-NN backends")


class Index(Protocol):
    """What the classifier needs from a backend."""

    metric: str
    dtype: torch.dtype

    def __len__(self) -> int: ...
    def add(self, vectors: torch.Tensor) -> None: ...
    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def vectors(self) -> torch.Tensor: ...
    def state(self) -> dict[str, np.ndarray]: ...


_GROWTH = 1.25  # capacity factor of the reference buffers: amortised appends, at most 25 % slack


class _Rows:
    """Rows appended in amortised constant time per row: a buffer whose capacity grows by
    ``_GROWTH`` when full. :attr:`view` is its first ``n`` rows (no copy), valid until the
    next :meth:`append` (a growth moves the rows). One ``torch.cat`` per append instead copied
    every stored row for each enrollment of a growing gallery."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
        self._buf = torch.empty((0, *shape), dtype=dtype, device=device)
        self.n = 0

    @property
    def view(self) -> torch.Tensor:
        return self._buf[: self.n]

    def append(self, rows: torch.Tensor) -> None:
        need = self.n + rows.shape[0]
        if need > self._buf.shape[0]:
            # The first batch (a fit) gets exactly its size; later ones grow geometrically.
            capacity = need if self.n == 0 else max(need, int(self._buf.shape[0] * _GROWTH) + 1)
            grown = self._buf.new_empty((capacity, *self._buf.shape[1:]))
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : need] = rows
        self.n = need


class ExactIndex:
    """Brute force in torch on the references' device, chunked under ``memory_limit_bytes``."""

    def __init__(
        self, metric: str, dim: int, dtype: torch.dtype, device: torch.device, memory_limit_bytes: int
    ):
        self.metric, self.dtype, self.memory_limit_bytes = metric, dtype, memory_limit_bytes
        self.device = torch.device(device)
        self._x = _Rows((dim,), dtype, device)
        self._neg_sqnorms = _Rows((), dtype, device)

    def __len__(self) -> int:
        return self._x.n

    def add(self, vectors: torch.Tensor) -> None:
        vectors = vectors.to(device=self.device, dtype=self.dtype)
        self._x.append(vectors)
        if self.metric == "l2":
            self._neg_sqnorms.append(neg_sqnorms(vectors))

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return exact_search(
            queries,
            self._x.view,
            k,
            metric=self.metric,
            memory_limit_bytes=self.memory_limit_bytes,
            ref_neg_sqnorms=self._neg_sqnorms.view if self.metric == "l2" else None,
        )

    def vectors(self) -> torch.Tensor:
        return self._x.view

    def state(self) -> dict[str, np.ndarray]:
        return {"embeddings": self._x.view.cpu().numpy()}


class FaissFlatIndex:
    """FAISS exact flat index (inner product on normalised rows for cosine, L2 otherwise).

    FAISS works in float32 on the CPU. It returns ``k`` plus a margin of candidates, which are
    re-ranked by recomputed distances and certified exactly as by the ``exact`` backend
    (:func:`~marginkit.knn._search.rerank`); the (rare) rows it cannot certify — near-ties at
    the k-th place — are answered by the exact torch search over FAISS's own storage.
    """

    def __init__(self, metric: str, dim: int, memory_limit_bytes: int):
        faiss = import_faiss()
        self.metric, self.dtype, self.memory_limit_bytes = metric, torch.float32, memory_limit_bytes
        self.index = faiss.IndexFlatIP(dim) if metric == "cosine" else faiss.IndexFlatL2(dim)
        self._faiss = faiss
        self._max_sqnorm = 0.0

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def add(self, vectors: torch.Tensor) -> None:
        vectors = vectors.detach().to("cpu", torch.float32).contiguous()
        if self.metric == "l2" and len(vectors):
            self._max_sqnorm = max(self._max_sqnorm, float(sqnorms(vectors).max()))
        self.index.add(vectors.numpy())

    def vectors(self) -> torch.Tensor:
        """Zero-copy view of FAISS's storage: valid until the next :meth:`add`."""
        n, d = len(self), self.index.d
        flat = self._faiss.rev_swig_ptr(self.index.get_xb(), n * d)
        return torch.from_numpy(flat).view(n, d)

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        raw = queries.detach().cpu()
        q = prepare(raw, self.metric, "queries", torch.float32)
        n = len(self)
        width = min(n, k + candidate_margin(k))
        distances, candidates = self.index.search(q.numpy(), width)
        approx_sq = 2 - 2 * distances if self.metric == "cosine" else distances  # FAISS L2 is squared
        refs = self.vectors()
        values, indices, certified = rerank(
            raw, refs, torch.from_numpy(candidates), torch.from_numpy(approx_sq), k, metric=self.metric,
            memory_limit_bytes=self.memory_limit_bytes, exhaustive=width >= n,
            q_sqnorms=sqnorms(q, "queries") if self.metric == "l2" else None, max_ref_sqnorm=self._max_sqnorm,
        )  # fmt: skip
        if not bool(certified.all()):
            rows = (~certified).nonzero().squeeze(1)
            values[rows], indices[rows] = exact_search(
                raw[rows], refs, k, metric=self.metric, memory_limit_bytes=self.memory_limit_bytes
            )
        return values, indices

    def state(self) -> dict[str, np.ndarray]:
        return {"embeddings": self.vectors().numpy().copy()}


class HNSWIndex:
    """FAISS ``IndexHNSWFlat`` (approximate), parameters ``M``, ``efConstruction``, ``efSearch``.

    Cosine search runs as L2 search on normalised rows (``||a - b||² = 2 - 2 cos``), the
    metric HNSW is built for; similarities are recovered as ``1 - d²/2``. Returned neighbours
    are ordered by value then index, but *which* neighbours come back is approximate: there is
    no tie-break guarantee at the k-th place. Graph construction with several OpenMP threads
    is not bit-for-bit reproducible; save the index to keep a graph.
    """

    def __init__(self, metric: str, dim: int, m: int, ef_construction: int, ef_search: int):
        faiss = import_faiss()
        self.metric, self.dtype = metric, torch.float32
        self.index = faiss.IndexHNSWFlat(dim, m, faiss.METRIC_L2)
        self.index.hnsw.efConstruction = ef_construction
        self.index.hnsw.efSearch = ef_search
        self._faiss = faiss

    def level_sizes(self) -> np.ndarray:
        """Neighbour slots of a node per level (FAISS's ``cum_nneighbor_per_level`` for ``M``)."""
        return self._faiss.vector_to_array(self.index.hnsw.cum_nneighbor_per_level)

    def graph(self) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """The graph as arrays (levels, offsets, neighbours) and its entry point and top level."""
        h, to_array = self.index.hnsw, self._faiss.vector_to_array
        arrays = {
            "hnsw_levels": to_array(h.levels),
            "hnsw_offsets": to_array(h.offsets),
            "hnsw_neighbors": to_array(h.neighbors),
        }
        return arrays, {"entry_point": int(h.entry_point), "max_level": int(h.max_level)}

    def set_graph(
        self, vectors: np.ndarray, arrays: dict[str, np.ndarray], entry_point: int, max_level: int
    ) -> None:
        """Install a saved graph over ``vectors`` (checked by ``index_file.check_hnsw_graph``)."""
        h = self.index.hnsw
        for name in ("levels", "offsets", "neighbors"):
            target = getattr(h, name)
            target.resize(0)
            self._faiss.copy_array_to_vector(np.ascontiguousarray(arrays[f"hnsw_{name}"]), target)
        h.entry_point, h.max_level = entry_point, max_level
        self.index.storage.add(np.ascontiguousarray(vectors, dtype=np.float32))
        self.index.ntotal = len(vectors)

    def __len__(self) -> int:
        return int(self.index.ntotal)

    @property
    def ef_search(self) -> int:
        return int(self.index.hnsw.efSearch)

    @ef_search.setter
    def ef_search(self, value: int) -> None:
        self.index.hnsw.efSearch = value

    def add(self, vectors: torch.Tensor) -> None:
        self.index.add(np.ascontiguousarray(vectors.detach().to("cpu", torch.float32).numpy()))

    def vectors(self) -> torch.Tensor:
        storage = self._faiss.downcast_index(self.index.storage)
        n, d = len(self), self.index.d
        return torch.from_numpy(self._faiss.rev_swig_ptr(storage.get_xb(), n * d)).view(n, d)

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = prepare(queries.detach().cpu(), self.metric, "queries", torch.float32)
        ef = self.ef_search
        # efSearch below k cannot return k neighbours; raise it for this call only. (Not via
        # SearchParametersHNSW: faiss.contrib.torch_utils, which pytorch-metric-learning
        # imports, replaces Index.search with a version that drops `params`.)
        self.ef_search = max(ef, k)
        try:
            distances, labels = self.index.search(q.numpy(), k)
        finally:
            self.ef_search = ef
        if (labels < 0).any():
            raise RuntimeError(
                f"HNSW returned fewer than k={k} neighbours for some queries; raise hnsw_ef_search "
                f"(now {self.ef_search}) or use the 'faiss' or 'exact' backend"
            )
        # Approximate neighbours, exact distances: recomputed and ordered by value then index.
        values, indices, _ = rerank(
            queries.detach().cpu(), self.vectors(), torch.from_numpy(labels), torch.from_numpy(distances),
            k, metric=self.metric, memory_limit_bytes=_RERANK_BYTES, exhaustive=True,
        )  # fmt: skip
        return values, indices

    def state(self) -> dict[str, np.ndarray]:
        return {"embeddings": self.vectors().numpy().copy(), **self.graph()[0]}


IVF_MIN_POINTS_PER_LIST = 39  # FAISS's k-means warns below 39 training points per centroid
IVF_REGROW = 4  # an automatic ``nlist`` is chosen again when the index has grown this many times
IVF_TRAIN_POINTS_PER_LIST = 64  # k-means sample per cell (FAISS's default, 256, quadruples training)


class IVFIndex:
    """FAISS inverted lists (approximate) over an exact float32 store of the references.

    The references live in one ``[N, D]`` tensor (what :meth:`vectors` returns and what the
    answers are scored from); FAISS holds an ``IndexIVFScalarQuantizer`` (8-bit per dimension,
    ``D`` bytes a reference) over them that proposes candidates: the ``nprobe`` nearest of
    ``nlist`` k-means cells are scanned (Jégou et al., "Product quantization for nearest
    neighbor search", TPAMI 2011, §IV-A), and the ``k`` best are re-scored exactly and ordered
    by value then index, as :class:`HNSWIndex` does. *Which* neighbours come back is
    approximate; measure it with ``recall_at_k``.

    Cells are k-means centroids of the references themselves (FAISS's seeded k-means on a sample
    of 64 references a cell), so they are trained only once there are ``39 × nlist``
    references; until then search is exact.
    ``nlist=None`` chooses ``⌊√N⌋`` cells when trained and trains again, over all references,
    each time the index has grown ``IVF_REGROW`` times: cells fit the data they split however
    the index grows (one re-training per factor of growth, so the total cost stays linear in
    ``N`` up to a logarithm). A row whose probed cells hold fewer than ``k`` references is
    answered by exact search.
    """

    def __init__(self, metric: str, dim: int, nlist: int | None, nprobe: int, memory_limit_bytes: int):
        self._faiss = import_faiss()
        self.metric, self.dtype, self.memory_limit_bytes = metric, torch.float32, memory_limit_bytes
        self.nlist_setting, self.nprobe = nlist, nprobe
        self._x = _Rows((dim,), torch.float32, "cpu")
        self.index: Any = None  # the trained FAISS IVF index
        self._trained_at = 0  # references when the cells were last trained

    def __len__(self) -> int:
        return self._x.n

    @property
    def nlist(self) -> int | None:
        """Cells of the trained index (``None`` while search is exact)."""
        return None if self.index is None else int(self.index.nlist)

    def _wanted_nlist(self, n: int) -> int:
        return self.nlist_setting if self.nlist_setting is not None else max(1, math.isqrt(n))

    def add(self, vectors: torch.Tensor) -> None:
        vectors = vectors.detach().to("cpu", torch.float32).contiguous()
        self._x.append(vectors)
        n = len(self)
        nlist = self._wanted_nlist(n)
        due = self.index is None or (self.nlist_setting is None and n >= IVF_REGROW * self._trained_at)
        if due and n >= IVF_MIN_POINTS_PER_LIST * nlist:
            self._train(nlist)
        elif self.index is not None:
            self.index.add(vectors.numpy())

    def _train(self, nlist: int) -> None:
        faiss, data = self._faiss, self._x.view.numpy()
        dim = data.shape[1]
        metric = faiss.METRIC_INNER_PRODUCT if self.metric == "cosine" else faiss.METRIC_L2
        quantizer = faiss.IndexFlatIP(dim) if self.metric == "cosine" else faiss.IndexFlatL2(dim)
        index = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_8bit, metric)
        index.cp.max_points_per_centroid = IVF_TRAIN_POINTS_PER_LIST
        index.train(data)
        index.add(data)
        self.index, self._trained_at = index, len(self)

    def vectors(self) -> torch.Tensor:
        return self._x.view

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        refs, limit = self._x.view, self.memory_limit_bytes
        if self.index is None:
            return exact_search(queries, refs, k, metric=self.metric, memory_limit_bytes=limit)
        q = prepare(queries.detach().cpu(), self.metric, "queries", torch.float32)
        self.index.nprobe = min(self.nprobe, self.index.nlist)
        approx, labels = self.index.search(q.numpy(), k)
        labels = torch.from_numpy(labels)
        short = (labels < 0).any(dim=1)  # the probed cells held fewer than k references
        labels[short] = torch.arange(k)  # placeholders: these rows are answered exactly below
        values, indices, _ = rerank(
            queries.detach().cpu(), refs, labels, torch.from_numpy(approx), k, metric=self.metric,
            memory_limit_bytes=_RERANK_BYTES, exhaustive=True,
        )  # fmt: skip
        if bool(short.any()):
            rows = short.nonzero().squeeze(1)
            values[rows], indices[rows] = exact_search(
                queries.detach().cpu()[rows], refs, k, metric=self.metric, memory_limit_bytes=limit,
            )  # fmt: skip
        return values, indices

    def state(self) -> dict[str, np.ndarray]:
        return {"embeddings": self._x.view.numpy().copy()}
