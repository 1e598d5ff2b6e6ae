"""Index backends of :class:`~marginkit.knn.KNNClassifier`: exact torch, FAISS flat, FAISS HNSW.

Every backend stores *prepared* reference vectors (cast to the working precision and, for
``metric="cosine"``, L2-normalised), grows with :meth:`add` without rebuilding, and answers
``search(queries, k) -> (values, indices)`` with cosine similarities (descending) or
Euclidean distances (ascending), neighbours ordered by value then by reference index.

FAISS is imported lazily, inside the backends that need it; when it is missing the error
names the extra to install.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from marginkit.knn._search import exact_search, neg_sqnorms, prepare

FAISS_HINT = "pip install 'marginkit[faiss]'"


def import_faiss() -> Any:
    """Import FAISS or raise an ImportError that names the extra to install."""
    try:
        import faiss
    except ImportError as err:  # pragma: no cover - exercised with faiss hidden
        raise ImportError(
            f"the 'faiss' and 'hnsw' K-NN backends need FAISS, which is not installed: {FAISS_HINT}"
        ) from err
    return faiss


class Index(Protocol):
    """What the classifier needs from a backend."""

    metric: str
    dtype: torch.dtype

    def __len__(self) -> int: ...
    def add(self, vectors: torch.Tensor) -> None: ...
    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def vectors(self) -> torch.Tensor: ...
    def state(self) -> dict[str, np.ndarray]: ...


def order_by_value_then_index(keys: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each row by key descending, then reference index ascending (NumPy, no threads)."""
    order = np.lexsort((indices, -keys), axis=-1)
    return np.take_along_axis(keys, order, -1), np.take_along_axis(indices, order, -1)


class ExactIndex:
    """Brute force in torch on the references' device, chunked under ``memory_limit_bytes``."""

    def __init__(
        self, metric: str, dim: int, dtype: torch.dtype, device: torch.device, memory_limit_bytes: int
    ):
        self.metric, self.dtype, self.memory_limit_bytes = metric, dtype, memory_limit_bytes
        self._x = torch.empty(0, dim, dtype=dtype, device=device)
        self._neg_sqnorms = torch.empty(0, dtype=dtype, device=device)

    def __len__(self) -> int:
        return self._x.shape[0]

    def add(self, vectors: torch.Tensor) -> None:
        vectors = vectors.to(device=self._x.device, dtype=self.dtype)
        self._x = torch.cat([self._x, vectors]) if len(self) else vectors.clone()
        if self.metric == "l2":
            self._neg_sqnorms = torch.cat([self._neg_sqnorms, neg_sqnorms(vectors)])

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return exact_search(
            queries,
            self._x,
            k,
            metric=self.metric,
            memory_limit_bytes=self.memory_limit_bytes,
            ref_neg_sqnorms=self._neg_sqnorms if self.metric == "l2" else None,
        )

    def vectors(self) -> torch.Tensor:
        return self._x

    def state(self) -> dict[str, np.ndarray]:
        return {"embeddings": self._x.cpu().numpy()}


class FaissFlatIndex:
    """FAISS exact flat index (inner product on normalised rows for cosine, L2 otherwise).

    FAISS works in float32 on the CPU. It searches ``k + 1`` neighbours so that a tie at the
    k-th place is detected; those (rare) rows are answered again by the exact torch search
    over FAISS's own storage, which applies the documented tie-break.
    """

    def __init__(self, metric: str, dim: int, memory_limit_bytes: int):
        faiss = import_faiss()
        self.metric, self.dtype, self.memory_limit_bytes = metric, torch.float32, memory_limit_bytes
        self.index = faiss.IndexFlatIP(dim) if metric == "cosine" else faiss.IndexFlatL2(dim)
        self._faiss = faiss

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def add(self, vectors: torch.Tensor) -> None:
        self.index.add(np.ascontiguousarray(vectors.detach().to("cpu", torch.float32).numpy()))

    def vectors(self) -> torch.Tensor:
        """Zero-copy view of FAISS's storage: valid until the next :meth:`add`."""
        n, d = len(self), self.index.d
        flat = self._faiss.rev_swig_ptr(self.index.get_xb(), n * d)
        return torch.from_numpy(flat).view(n, d)

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = prepare(queries.detach().cpu(), self.metric, "queries", torch.float32)
        kk = min(k + 1, len(self))
        distances, indices = self.index.search(q.numpy(), kk)
        keys = distances if self.metric == "cosine" else -distances  # larger is closer
        tied = keys[:, k] == keys[:, k - 1] if kk > k else np.zeros(len(q), dtype=bool)
        keys, indices = order_by_value_then_index(keys[:, :k], indices[:, :k])
        values = torch.from_numpy(keys if self.metric == "cosine" else np.sqrt(np.maximum(-keys, 0)))
        indices = torch.from_numpy(indices)
        if tied.any():
            rows = torch.from_numpy(np.flatnonzero(tied))
            v, i = exact_search(
                q[rows], self.vectors(), k, metric=self.metric, memory_limit_bytes=self.memory_limit_bytes
            )
            values[rows], indices[rows] = v, i
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

    def __init__(
        self,
        metric: str,
        dim: int,
        m: int,
        ef_construction: int,
        ef_search: int,
        index: Any | None = None,
    ):
        faiss = import_faiss()
        self.metric, self.dtype = metric, torch.float32
        if index is None:
            index = faiss.IndexHNSWFlat(dim, m, faiss.METRIC_L2)
            index.hnsw.efConstruction = ef_construction
        self.index = index
        self.index.hnsw.efSearch = ef_search
        self._faiss = faiss

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
        keys, indices = order_by_value_then_index(-distances, labels)
        sq = np.maximum(-keys, 0)
        values = 1 - sq / 2 if self.metric == "cosine" else np.sqrt(sq)
        return torch.from_numpy(values), torch.from_numpy(indices)

    def state(self) -> dict[str, np.ndarray]:
        return {"faiss_index": self._faiss.serialize_index(self.index)}
