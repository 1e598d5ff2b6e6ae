"""K-nearest-neighbour classifier over learned embeddings, with pluggable index backends."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

from marginkit._validation import choice, compute_dtype, data_tensor, positive_float, positive_int, to_caller
from marginkit.knn._backends import ExactIndex, FaissFlatIndex, HNSWIndex, Index, IVFIndex, import_faiss
from marginkit.knn._search import check_embeddings, check_metric, exact_search, prepare
from marginkit.knn.fingerprint import model_fingerprint as fingerprint_of
from marginkit.knn.index_file import IndexFileError, check_hnsw_graph, fail, read_index, write_index
from marginkit.knn.labels import Classes, Labels, check_label_values

__all__ = ["BACKENDS", "WEIGHTS", "IndexFileError", "KNNClassifier", "vote_proba", "vote_winners"]

BACKENDS = ("exact", "faiss", "hnsw", "ivf")
WEIGHTS = ("uniform", "distance")


def vote_proba(
    values: torch.Tensor, neighbour_labels: torch.Tensor, *, metric: str, weights: str, num_classes: int
) -> torch.Tensor:
    r"""Class votes of the ``k`` neighbours, normalised per row (``[N, k] -> [N, C]``).

    ``neighbour_labels`` are codes ``0 .. num_classes - 1`` (a classifier's positions in its
    ``classes_``, see :mod:`marginkit.knn.labels`).

    .. math::
        p_c(x) = \frac{\sum_{j \le k} w_j\,[y_j = c]}{\sum_{j \le k} w_j},\qquad
        w_j = 1 \text{ (uniform)} \quad\text{or}\quad w_j = 1/d_j \text{ (distance)},

    with ``d`` the Euclidean distance (``l2``) or the cosine distance ``1 - cos`` clipped at 0
    (``cosine``), as scikit-learn's ``KNeighborsClassifier``. A row with a neighbour at
    distance exactly 0 gives weight 1 to its zero-distance neighbours and 0 to the others.
    """
    dtype = compute_dtype(values.dtype)
    values = values.to(dtype)
    if weights == "uniform":
        w = torch.ones_like(values)
    else:
        dist = (1 - values).clamp_min(0) if metric == "cosine" else values
        zero = dist == 0
        w = torch.where(zero.any(dim=1, keepdim=True), zero.to(dtype), 1 / dist)
    votes = torch.zeros(values.shape[0], num_classes, dtype=dtype, device=values.device)
    votes.scatter_add_(1, neighbour_labels, w)
    return votes / votes.sum(dim=1, keepdim=True)


def vote_winners(
    values: torch.Tensor,
    neighbour_labels: torch.Tensor,
    *,
    metric: str,
    weights: str,
    num_classes: int,
    memory_limit_bytes: int,
) -> torch.Tensor:
    """The winning code of each row, ``argmax`` of :func:`vote_proba` (ties to the smallest
    code), without its ``[N, C]`` matrix: the votes are made for as many rows at a time as
    ``memory_limit_bytes`` holds (a few ``[rows, C]`` temporaries), so that many classes times
    many queries stay under the budget. Returns int64 ``[N]``."""
    itemsize = torch.finfo(compute_dtype(values.dtype)).bits // 8
    # three [rows, C] arrays live at once (votes, shares, argmax's scratch), in half the budget
    rows = max(1, int(memory_limit_bytes) // (6 * itemsize * max(1, num_classes)))
    out = torch.empty(values.shape[0], dtype=torch.long, device=values.device)
    for start in range(0, values.shape[0], rows):
        part = slice(start, start + rows)
        proba = vote_proba(
            values[part], neighbour_labels[part], metric=metric, weights=weights, num_classes=num_classes
        )
        out[part] = proba.argmax(dim=1)
    return out


class KNNClassifier:
    r"""K-NN classification by majority or distance-weighted vote over stored embeddings.

    Non-parametric: new classes and examples arrive with :meth:`add`, without retraining or
    rebuilding the index. SPEC §6 ("K-NN classification").

    Args:
        k: number of neighbours that vote.
        metric: ``"cosine"`` (rows L2-normalised; neighbours by decreasing cosine
            similarity) or ``"l2"`` (by increasing Euclidean distance).
        weights: ``"uniform"`` (majority vote) or ``"distance"`` (weights ``1/d``, see
            :func:`vote_proba`).
        backend: ``"exact"`` (pure torch, any device, chunked under ``memory_limit_mb``; the
            default, no extra dependency), ``"faiss"`` (FAISS exact flat index, CPU, float32),
            ``"hnsw"`` (FAISS HNSW graph, approximate; measure it with :meth:`recall_at_k`) or
            ``"ivf"`` (FAISS inverted lists over k-means cells, approximate, over an exact
            float32 store that scores the answers). The FAISS backends need
            ``pip install 'marginkit[faiss]'``.
        memory_limit_mb: bound on the temporary memory of one exact search (the score matrix
            is computed in chunks under it) and of :meth:`predict`'s and :meth:`score`'s votes
            (:func:`vote_winners`). The FAISS backends use FAISS's own blocking.
        num_classes: declare the classes up front as ``0 .. num_classes - 1`` (columns of
            :meth:`predict_proba` even for classes without a reference; other labels are an
            error). Default ``None``: the classes are the distinct labels of the references,
            growing with :meth:`add`.
        hnsw_m, hnsw_ef_construction, hnsw_ef_search: HNSW's ``M`` (graph degree),
            ``efConstruction`` (build beam) and ``efSearch`` (query beam, raised to ``k``
            when smaller); ``hnsw_ef_search`` can be changed after fitting.
        ivf_nlist, ivf_nprobe: IVF's cells (``None``: ``⌊√N⌋``, chosen again as the index
            grows; cells are trained once there are ``39 × nlist`` references, exact search
            until then) and cells scanned per query (can be changed after fitting).

    Labels are identifiers, with scikit-learn's conventions (``KNeighborsClassifier``): any
    integers (an id of 10**12 costs nothing) or strings; ``classes_`` holds the distinct labels
    in sorted order, :meth:`predict_proba` has one column per entry of ``classes_`` in that
    order, and :meth:`predict` returns the labels themselves. Integer labels come back as an
    int64 tensor on the queries' device, string labels as a numpy ``str`` array (torch has no
    strings).

    Tie-breaking (deterministic): neighbours are ordered by similarity (distance), and among
    equal computed values by increasing reference index, so of several tied candidates for
    the k-th place the lowest index wins (``exact`` and ``faiss``; ``hnsw`` is approximate and
    only orders what it returns). A vote tie goes to the smallest label (the first column
    of ``classes_``, as scikit-learn's ``mode``/``weighted_mode``).

    Precision: the ``exact`` backend works in float32 (float64 when fitted on float64
    embeddings); float16/bfloat16 inputs are upcast. FAISS works in float32.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> ref, lab = torch.randn(100, 8, generator=g), torch.arange(100) % 4
        >>> clf = KNNClassifier(k=3).fit(ref, lab)
        >>> clf.predict(ref[:5]).shape, clf.predict_proba(ref[:5]).shape
        (torch.Size([5]), torch.Size([5, 4]))
        >>> ids = KNNClassifier(k=1).fit(ref, lab * 10**12 + 7)  # identity ids
        >>> ids.classes_.tolist(), ids.predict(ref[:2]).tolist()
        ([7, 1000000000007, 2000000000007, 3000000000007], [7, 1000000000007])
    """

    def __init__(
        self,
        k: int = 5,
        metric: str = "cosine",
        weights: str = "uniform",
        backend: str = "exact",
        *,
        memory_limit_mb: float = 512.0,
        num_classes: int | None = None,
        hnsw_m: int = 32,
        hnsw_ef_construction: int = 200,
        hnsw_ef_search: int = 128,
        ivf_nlist: int | None = None,
        ivf_nprobe: int = 32,
    ) -> None:
        self.k = positive_int(k, "k")
        self.metric = check_metric(metric)
        self.weights = choice(weights, "weights", WEIGHTS)
        self.backend = choice(backend, "backend", BACKENDS)
        self.memory_limit_mb = positive_float(memory_limit_mb, "memory_limit_mb")
        self._classes: Classes | None = (
            None if num_classes is None else Classes.fixed_range(positive_int(num_classes, "num_classes"))
        )
        self.hnsw_m = positive_int(hnsw_m, "hnsw_m", minimum=2)
        self.hnsw_ef_construction = positive_int(hnsw_ef_construction, "hnsw_ef_construction")
        self._hnsw_ef_search = positive_int(hnsw_ef_search, "hnsw_ef_search")
        self.ivf_nlist = None if ivf_nlist is None else positive_int(ivf_nlist, "ivf_nlist")
        self._ivf_nprobe = positive_int(ivf_nprobe, "ivf_nprobe")
        self.model_fingerprint: str | None = None
        self._index: Index | None = None
        self._codes: torch.Tensor | None = None  # per reference, its position in classes_
        self._dim: int | None = None
        if self.backend != "exact":
            import_faiss()  # fail at construction, naming the extra

    # ------------------------------------------------------------------ state
    @property
    def memory_limit_bytes(self) -> int:
        return int(self.memory_limit_mb * 2**20)

    @property
    def is_fitted(self) -> bool:
        return self._index is not None

    @property
    def num_references(self) -> int:
        return 0 if self._index is None else len(self._index)

    @property
    def dimension(self) -> int | None:
        return self._dim

    @property
    def larger_is_closer(self) -> bool:
        """True for ``cosine`` (values are similarities), False for ``l2`` (distances)."""
        return self.metric == "cosine"

    @property
    def hnsw_ef_search(self) -> int:
        return self._hnsw_ef_search

    @hnsw_ef_search.setter
    def hnsw_ef_search(self, value: int) -> None:
        self._hnsw_ef_search = positive_int(value, "hnsw_ef_search")
        if isinstance(self._index, HNSWIndex):
            self._index.ef_search = self._hnsw_ef_search

    @property
    def ivf_nprobe(self) -> int:
        return self._ivf_nprobe

    @ivf_nprobe.setter
    def ivf_nprobe(self, value: int) -> None:
        self._ivf_nprobe = positive_int(value, "ivf_nprobe")
        if isinstance(self._index, IVFIndex):
            self._index.nprobe = self._ivf_nprobe

    @property
    def num_classes(self) -> int | None:
        """Number of classes (columns of :meth:`predict_proba`); ``None`` before :meth:`fit`."""
        return None if self._classes is None else len(self._classes)

    @property
    def classes_(self) -> np.ndarray:
        """The classes in sorted order (int64 or ``str``), as scikit-learn's ``classes_``."""
        if self._classes is None:
            raise RuntimeError("this KNNClassifier is not fitted yet: call fit(embeddings, labels) first")
        return self._classes.values.copy()

    @property
    def reference_labels(self) -> Labels:
        """The references' labels (an int64 tensor, or a numpy ``str`` array)."""
        _, codes = self._require_fitted()
        assert self._classes is not None
        return self._classes.decode(codes, as_numpy=False)

    def reference_embeddings(self, *, copy: bool = True) -> torch.Tensor:
        """The stored (prepared: working precision, normalised for cosine) references ``[N, D]``.

        ``copy=False`` returns the index's own storage without copying (a gallery of millions
        of templates reads rows from it): read it only, and only until the next :meth:`add`.
        """
        vectors = self._require_fitted()[0].vectors()
        return vectors.clone() if copy else vectors

    def _require_fitted(self) -> tuple[Index, torch.Tensor]:
        if self._index is None or self._codes is None:
            raise RuntimeError("this KNNClassifier is not fitted yet: call fit(embeddings, labels) first")
        return self._index, self._codes

    def _new_index(self, dim: int, dtype: torch.dtype, device: torch.device) -> Index:
        if self.backend == "exact":
            return ExactIndex(self.metric, dim, dtype, device, self.memory_limit_bytes)
        if self.backend == "faiss":
            return FaissFlatIndex(self.metric, dim, self.memory_limit_bytes)
        if self.backend == "ivf":
            return IVFIndex(self.metric, dim, self.ivf_nlist, self._ivf_nprobe, self.memory_limit_bytes)
        return HNSWIndex(self.metric, dim, self.hnsw_m, self.hnsw_ef_construction, self._hnsw_ef_search)

    def _check_new(
        self, embeddings: Any, labels: Any, dim: int | None, classes: Classes
    ) -> tuple[torch.Tensor, torch.Tensor, Classes, torch.Tensor | None]:
        """Checked embeddings, the labels' codes in the classes ``classes`` grows to, and the
        map of the old codes to the new ones (``None``: unchanged)."""
        embeddings = check_embeddings(data_tensor(embeddings, "embeddings"), "embeddings")
        values = check_label_values(labels, "labels", embeddings.shape[0], "embeddings")
        if dim is not None and embeddings.shape[1] != dim:
            raise ValueError(
                f"embeddings have dimension {embeddings.shape[1]}, but the index holds "
                f"{dim}-dimensional embeddings"
            )
        grown, remap = classes.merged(values, "labels")
        codes, _ = grown.encode(values, "labels")
        return embeddings, codes, grown, remap

    def _prepare_refs(self, embeddings: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(embeddings.dtype) if self.backend == "exact" else torch.float32
        return prepare(embeddings.detach(), self.metric, "embeddings", dtype)

    # ------------------------------------------------------------------ fitting
    def fit(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        *,
        model_fingerprint: str | nn.Module | None = None,
    ) -> KNNClassifier:
        """Store the reference set ``embeddings`` ``[N, D]`` with class ids ``labels`` ``[N]``.

        ``model_fingerprint`` (a string from :func:`~marginkit.knn.model_fingerprint`, or the
        embedding ``nn.Module`` itself) is recorded and saved with the index so that
        :meth:`load` can refuse an index built by another model. Refitting replaces
        everything.
        """
        if isinstance(model_fingerprint, nn.Module):
            model_fingerprint = fingerprint_of(model_fingerprint)
        if model_fingerprint is not None and not isinstance(model_fingerprint, str):
            raise TypeError(
                f"model_fingerprint must be a str or an nn.Module, got {type(model_fingerprint).__name__}"
            )
        start = self._classes if self._classes is not None and self._classes.fixed else Classes(np.zeros(0))
        embeddings, codes, classes, _ = self._check_new(embeddings, labels, None, start)
        if self.k > embeddings.shape[0]:
            raise ValueError(
                f"k={self.k} exceeds the number of references ({embeddings.shape[0]}): lower k or fit on "
                "more references"
            )
        prepared = self._prepare_refs(embeddings)
        index = self._new_index(prepared.shape[1], prepared.dtype, prepared.device)
        index.add(prepared)
        self._index, self._dim = index, prepared.shape[1]
        self._codes = codes.to(prepared.device if self.backend == "exact" else "cpu")
        self._classes = classes
        self.model_fingerprint = model_fingerprint
        return self

    def add(self, embeddings: torch.Tensor, labels: Any) -> KNNClassifier:
        """Append references (and possibly new classes) without rebuilding the index.

        New classes take their place in the sorted ``classes_`` (the columns of
        :meth:`predict_proba` follow).
        """
        index, old = self._require_fitted()
        assert self._classes is not None
        embeddings, codes, classes, remap = self._check_new(embeddings, labels, self._dim, self._classes)
        index.add(self._prepare_refs(embeddings))
        if remap is not None:
            old = remap.to(old.device)[old]
        self._codes = torch.cat([old, codes.to(old.device)])
        self._classes = classes
        return self

    # ------------------------------------------------------------------ queries
    def _check_queries(self, x: Any, k: int | None) -> tuple[torch.Tensor, int]:
        index, _ = self._require_fitted()
        x = check_embeddings(data_tensor(x, "x"), "x")
        if x.shape[1] != self._dim:
            raise ValueError(
                f"x has dimension {x.shape[1]}, but the index holds {self._dim}-dimensional embeddings"
            )
        k = self.k if k is None else positive_int(k, "k")
        if k > len(index):
            raise ValueError(f"k={k} exceeds the number of references ({len(index)}): lower k, or add some")
        return x, k

    def kneighbors(self, x: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` nearest references of each row of ``x`` ``[Q, D]``.

        Returns ``(values, indices)``, both ``[Q, k]`` on ``x``'s device (numpy arrays for a
        numpy ``x``): cosine similarities in decreasing order (``metric="cosine"``) or Euclidean
        distances in increasing order (``"l2"``), and reference indices; equal values are
        ordered by increasing index.
        """
        as_numpy = not isinstance(x, torch.Tensor)
        x, k = self._check_queries(x, k)
        values, indices = self._require_fitted()[0].search(x.detach(), k)
        return to_caller((values.to(x.device), indices.to(x.device)), as_numpy)

    def predict_proba(self, x: torch.Tensor) -> torch.Tensor:
        """Vote shares ``[Q, C]`` (rows sum to 1), a column per entry of ``classes_`` (:func:`vote_proba`).

        A numpy array for a numpy ``x``.
        """
        as_numpy = not isinstance(x, torch.Tensor)
        x, k = self._check_queries(x, None)
        index, codes = self._require_fitted()
        values, indices = index.search(x.detach(), k)
        proba = vote_proba(
            values,
            codes[indices.to(codes.device)].to(values.device),
            metric=self.metric,
            weights=self.weights,
            num_classes=int(self.num_classes),  # type: ignore[arg-type]
        )
        return to_caller(proba.to(x.device), as_numpy)

    def predict(self, x: torch.Tensor) -> Labels:
        """Predicted labels ``[Q]``: the largest vote, ties to the smallest label.

        An int64 tensor on ``x``'s device for integer labels, a numpy ``str`` array for strings;
        a numpy array whenever ``x`` is one (scikit-learn's convention).
        """
        as_numpy = not isinstance(x, torch.Tensor)
        x = data_tensor(x, "x")
        winners = self._winners(x)
        assert self._classes is not None
        return self._classes.decode(winners.to(x.device), as_numpy=as_numpy)

    def score(self, x: torch.Tensor, y: Any) -> float:
        """Accuracy of :meth:`predict` on ``(x, y)`` (a label outside ``classes_`` counts as an error)."""
        x = check_embeddings(data_tensor(x, "x"), "x")
        values = check_label_values(y, "y", x.shape[0], "x")
        winners = self._winners(x)
        assert self._classes is not None
        codes, known = self._classes.encode(values, "y")
        hits = known.to(winners.device) & (winners == codes.to(winners.device))
        return float(hits.to(torch.float64).mean())

    def _winners(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`predict`'s codes (on the index's device), voted under the memory limit."""
        x, k = self._check_queries(x, None)
        index, codes = self._require_fitted()
        values, indices = index.search(x.detach(), k)
        return vote_winners(
            values,
            codes[indices.to(codes.device)].to(values.device),
            metric=self.metric,
            weights=self.weights,
            num_classes=int(self.num_classes),  # type: ignore[arg-type]
            memory_limit_bytes=self.memory_limit_bytes,
        )

    def recall_at_k(self, x: torch.Tensor, k: int | None = None) -> float:
        r"""Recall@k of this backend's neighbours against exact search (for ``hnsw``).

        .. math:: \text{recall@}k = \frac{1}{Q} \sum_q \frac{|A_k(q) \cap E_k(q)|}{k},

        ``A_k`` the backend's neighbour indices, ``E_k`` the exact ones (torch search over the
        same stored vectors, ties to the lower index). 1.0 for ``exact`` and, up to ties,
        ``faiss``; index-set recall counts a swapped tie as a miss.
        """
        x, k = self._check_queries(x, k)
        index, _ = self._require_fitted()
        _, approx = index.search(x.detach(), k)
        refs = index.vectors()
        _, exact = exact_search(
            x.detach().to(refs.device),
            refs,
            k,
            metric=self.metric,
            memory_limit_bytes=self.memory_limit_bytes,
        )
        approx = approx.to(exact.device)
        hits = 0
        rows = max(1, (1 << 24) // (k * k))  # bound the [rows, k, k] comparison
        for s in range(0, approx.shape[0], rows):
            a, e = approx[s : s + rows], exact[s : s + rows]
            hits += int((a[:, :, None] == e[:, None, :]).any(dim=2).sum())
        return hits / (approx.shape[0] * k)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the index to ``path`` as one ``.npz`` file, no pickle (:mod:`~marginkit.knn.index_file`).

        Arrays: ``classes`` (sorted int64 or unicode labels), ``labels`` (each reference's code,
        its position in ``classes``), ``embeddings`` (the prepared references), for ``hnsw`` the
        graph as plain arrays, and ``metadata``, a JSON string: format version,
        hyper-parameters, dimension, metric, normalisation, number of references and the model
        fingerprint.
        """
        index, codes = self._require_fitted()
        assert self._classes is not None
        hnsw: dict[str, Any] = {
            "m": self.hnsw_m,
            "ef_construction": self.hnsw_ef_construction,
            "ef_search": self._hnsw_ef_search,
        }
        arrays = {"labels": codes.cpu().numpy(), "classes": self._classes.values, **index.state()}
        if isinstance(index, HNSWIndex):
            hnsw.update(index.graph()[1])
        meta = {
            "k": self.k,
            "metric": self.metric,
            "normalization": "l2" if self.metric == "cosine" else "none",
            "weights": self.weights,
            "backend": self.backend,
            "memory_limit_mb": self.memory_limit_mb,
            "num_classes": self.num_classes,
            "fixed_num_classes": self._classes.fixed,
            "hnsw": hnsw,
            "ivf": {"nlist": self.ivf_nlist, "nprobe": self._ivf_nprobe},
            "dimension": self._dim,
            "dtype": str(index.dtype).removeprefix("torch."),
            "num_references": len(index),
            "model_fingerprint": self.model_fingerprint,
        }
        write_index(path, meta, arrays)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        expected_fingerprint: str | nn.Module | None = None,
        device: str | torch.device | None = None,
    ) -> KNNClassifier:
        """Read an index written by :meth:`save`, validating it as :meth:`fit` validates its input.

        Every array header is checked against the file before anything is read (bounded by
        ``$MARGINKIT_MAX_INPUT_MB``), then every metadata value and array (dtypes, shapes,
        finite and — for ``cosine`` — unit-norm references, labels within ``num_classes``,
        the HNSW graph's node ids; an index saved before labels were identifiers has
        ``classes_`` = its distinct labels, or ``0 .. num_classes - 1`` when those were fixed):
        any problem raises :class:`IndexFileError` naming the
        file. With ``expected_fingerprint`` (a string or the embedding model itself) loading
        fails unless the index was saved with the same model fingerprint: embeddings from
        another model version live in another space, and mixing them silently degrades
        accuracy. ``device`` places an ``exact`` index (default CPU).
        """
        meta, arrays = read_index(path)
        hnsw = meta["hnsw"]
        try:
            clf = cls(
                **{name: meta[name] for name in ("k", "metric", "weights", "backend", "memory_limit_mb")},
                num_classes=meta["num_classes"] if meta["fixed_num_classes"] else None,
                **{f"hnsw_{name}": hnsw[name] for name in ("m", "ef_construction", "ef_search")},
                **{f"ivf_{name}": value for name, value in meta.get("ivf", {}).items()},
            )
        except (TypeError, ValueError) as exc:
            raise fail(path, f"metadata holds an invalid setting: {exc}") from exc
        if isinstance(expected_fingerprint, nn.Module):
            expected_fingerprint = fingerprint_of(expected_fingerprint)
        stored = meta["model_fingerprint"]
        if expected_fingerprint is not None and stored != expected_fingerprint:
            raise ValueError(
                "model fingerprint mismatch: the index was built from embeddings of model "
                f"{stored!r}, but expected_fingerprint is {expected_fingerprint!r}; re-embed the "
                "references with the current model and fit a new index"
            )
        dim, vectors = int(meta["dimension"]), arrays["embeddings"]
        index = clf._new_index(dim, getattr(torch, meta["dtype"]), torch.device(device or "cpu"))
        if isinstance(index, HNSWIndex):
            try:
                check_hnsw_graph(meta, arrays, index.level_sizes())
            except ValueError as exc:
                raise fail(path, str(exc)) from exc
            index.set_graph(vectors, arrays, hnsw["entry_point"], hnsw["max_level"])
        else:
            index.add(torch.from_numpy(vectors))
        classes = arrays["classes"]
        codes = torch.from_numpy(arrays["labels"].astype(np.int64))  # (read_index: codes in every version)
        clf._index, clf._dim = index, dim
        clf._classes = Classes(classes, fixed=meta["fixed_num_classes"])
        clf._codes = codes.to(device or "cpu") if clf.backend == "exact" else codes
        clf.model_fingerprint = stored
        return clf
