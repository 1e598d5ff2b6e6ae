"""Audio data sources: ``audio:DIR`` (one sub-folder per speaker) and ``audio:wav.scp`` (Kaldi lists).

Both give :class:`AudioFiles`, a :class:`~marginkit.data.samples.LazySamples` of ``kind="audio"``
whose rows stay in their files: :meth:`AudioFiles.read` decodes one utterance in the calling
process (a DataLoader worker) — a seeded random crop of ``crop_seconds`` (2 s) in training
(``rng`` given), the whole utterance at evaluation (``rng=None``) — as float32 in [-1, 1] at
``sample_rate``, one channel (the first; ``channel``), resampled by soxr where the file's rate
differs (:mod:`marginkit.audio.io`). Nothing is decoded while listing.

Layouts:

* ``DIR/<speaker>/**/<utterance>.wav|.flac`` — VoxCeleb's ``<speaker>/<session>/<nnnnn>.wav`` or any
  nesting; the speaker is the first folder level. ``DIR/train/<speaker>/…`` and
  ``DIR/test/<speaker>/…`` (and ``DIR/val/…``) are used as given. A row's
  :meth:`~AudioFiles.relative_path` is its path relative to ``DIR`` (the split folder included),
  the name a trial list uses.
* ``wav.scp`` (``<utterance-id> <path>`` per line) with ``utt2spk`` (``<utterance-id> <speaker>``)
  beside it. Relative paths are taken relative to the folder holding ``wav.scp``. A row's
  relative path is its utterance id (VoxCeleb recipes use ``id10001/1zcIwhmdeo4/00001.wav``).
  Kaldi also allows ``<command> |`` (a pipe whose output is the audio) and ``file.ark:offset``
  entries: both are refused — no command named in a data file is ever run.

* ``FILE.csv`` — the manifest of ``csv:`` (open-metric-learning's convention: ``path``, ``label``,
  ``split``; ``is_query`` / ``is_gallery`` optional) listing audio files, ``label`` the speaker.
  Paths are relative to the CSV's folder (or absolute); a row's relative path is its ``path``
  as written. ``split`` as for ``csv:``; a manifest of ``train`` rows only is split by speaker.

Without a ``train`` / ``test`` layout the speakers are split, not the utterances: a seeded
``test_fraction`` of the speakers (20 %) is held out, the field's convention (test speakers
are unseen in training); ``split`` options of :func:`marginkit.data.load_dataset` re-split.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from marginkit.audio.io import MAX_SECONDS, audio_info, read_audio, read_crop
from marginkit.data.loaders import RawSplits
from marginkit.data.manifest import (
    AUDIO_SUFFIXES,
    manifest_flags,
    manifest_split_rows,
    read_manifest_rows,
)
from marginkit.data.samples import LazySamples

__all__ = [
    "AUDIO_EXTENSIONS",
    "AudioFiles",
    "read_audio_files",
    "read_audio_folder",
    "read_audio_manifest",
    "read_audio_source",
    "read_wav_scp",
]

#: File suffixes ``audio:DIR`` lists (case-insensitive).
AUDIO_EXTENSIONS = AUDIO_SUFFIXES
_MAX_LIST_BYTES = 2**30  # a wav.scp / utt2spk over 1 GiB is refused before reading


def _encode(strings: Sequence[str]) -> np.ndarray:
    """Paths as a compact UTF-8 byte array (a million paths ~ 40 MB, pickled to each worker)."""
    return np.array([s.encode("utf-8", "surrogateescape") for s in strings], dtype=np.bytes_)


class AudioFiles(LazySamples):
    """Utterances in files: row ``i`` is ``paths[i]``; see the module doc.

    Args:
        paths: each utterance's file (absolute, or relative to ``root``).
        names: each row's name relative to the data root (what trial lists name).
        sample_rate: the rate rows are returned at (the model's; 16000).
        crop_seconds: training crops (2.0); ``None``: whole utterances in training too.
        channel: the channel kept (0, the first) or ``"mean"`` (their average).
        resample: resample other rates with soxr (True) or refuse them.
        max_seconds: the longest utterance read whole (evaluation); longer ones are a
            :class:`~marginkit.data.samples.BadSampleError`.
        root: the folder relative ``paths`` start from.
    """

    kind = "audio"
    sample_shape: tuple[int, ...] = ()
    dtype = np.dtype(np.float32)

    def __init__(
        self,
        paths: Sequence[str],
        names: Sequence[str],
        *,
        sample_rate: int = 16000,
        crop_seconds: float | None = 2.0,
        channel: int | str = 0,
        resample: bool = True,
        max_seconds: float = MAX_SECONDS,
        root: str | os.PathLike[str] = ".",
    ) -> None:
        super().__init__()
        if len(paths) != len(names):
            raise ValueError(
                f"paths ({len(paths)}) and names ({len(names)}) must have one entry per utterance"
            )
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 1:
            raise ValueError(f"sample_rate must be an int >= 1 (Hz), got {sample_rate!r}")
        if crop_seconds is not None and not (float(crop_seconds) > 0 and np.isfinite(float(crop_seconds))):
            raise ValueError(f"crop_seconds must be a number > 0 or None, got {crop_seconds!r}")
        if channel != "mean" and (isinstance(channel, bool) or not isinstance(channel, int) or channel < 0):
            raise ValueError(f"channel must be an int >= 0 or 'mean', got {channel!r}")
        self.root = os.fspath(root)
        self._paths = _encode(paths)
        self._names = _encode(names)
        self.sample_rate = sample_rate
        self.crop_seconds = None if crop_seconds is None else float(crop_seconds)
        self.channel = channel
        self.resample = bool(resample)
        self.max_seconds = float(max_seconds)
        #: training-crop augmentation (:class:`marginkit.audio.augment.AudioAugment`), or None
        self.augment: Any = None

    @property
    def crop_samples(self) -> int | None:
        """Samples of a training crop (``crop_seconds * sample_rate``), or None."""
        return None if self.crop_seconds is None else round(self.crop_seconds * self.sample_rate)

    def _num_keys(self) -> int:
        return len(self._paths)

    def _file(self, key: int) -> str:
        return os.path.join(self.root, self._paths[key].decode("utf-8", "surrogateescape"))

    def _read_key(self, key: int, rng: np.random.Generator | None) -> np.ndarray:
        path = self._file(key)
        info = audio_info(path)
        crop = self.crop_samples
        if rng is None or crop is None:
            return read_audio(
                path, self.sample_rate, channel=self.channel, resample=self.resample,
                max_seconds=self.max_seconds, info=info,
            )  # fmt: skip
        if self.augment:
            return self.augment.read(
                path, self.sample_rate, crop, rng, channel=self.channel, resample=self.resample
            )
        return read_crop(
            path, self.sample_rate, crop, rng, channel=self.channel, resample=self.resample, info=info
        )

    def _where_key(self, key: int) -> str:
        return self._file(key)

    def _relative_key(self, key: int) -> str:
        return self._names[key].decode("utf-8", "surrogateescape")

    def _row_nbytes(self) -> int:
        """A training crop's bytes (whole utterances' lengths are unknown until their headers are read)."""
        return 4 * (self.crop_samples or 0)

    def relative_paths(self) -> np.ndarray:
        """Every row's name relative to the data root (a str array), e.g. for ``<split>_paths``."""
        rows = self.keys
        return np.array([self._relative_key(int(k)) for k in rows], dtype=str)

    def __repr__(self) -> str:
        crop = f"{self.crop_seconds:g} s crops" if self.crop_seconds else "whole utterances"
        return f"AudioFiles({len(self)} utterances at {self.sample_rate} Hz, {crop}, root={self.root!r})"


# -------------------------------------------------------------------------------------------- listing


def _speaker_files(speaker_dir: Path) -> list[Path]:
    """Audio files under a speaker's folder, any depth, sorted (hidden entries, symlinked folders skipped)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(speaker_dir, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found.extend(
            Path(dirpath, f)
            for f in filenames
            if not f.startswith(".") and f.lower().endswith(AUDIO_EXTENSIONS)
        )
    return sorted(found)


def _list_speakers(root: Path) -> dict[str, list[Path]]:
    speakers = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not speakers:
        raise ValueError(
            f"{root}: no speaker sub-folders (expected {root}/<speaker>/[<session>/]<utterance>.wav or .flac)"
        )
    listing = {}
    for d in speakers:
        files = _speaker_files(d)
        if not files:
            raise ValueError(
                f"{d}: speaker folder holds no audio files ({', '.join(AUDIO_EXTENSIONS)}, any depth)"
            )
        listing[d.name] = files
    return listing


def _speaker_split(
    labels: np.ndarray, num_speakers: int, test_fraction: float, split_seed: int
) -> np.ndarray:
    """Boolean test mask: a seeded ``test_fraction`` of the speakers (at least 2 on each side);
    ``0``: none held out (a class-disjoint ``split`` pools the source and chooses the test
    speakers itself)."""
    if not 0 <= test_fraction < 1:
        raise ValueError(
            f"test_fraction must lie in [0, 1) (a fraction of the speakers), got {test_fraction!r}"
        )
    if test_fraction == 0:
        return np.zeros(len(labels), dtype=bool)
    count = round(test_fraction * num_speakers)
    if num_speakers < 4 or not 2 <= count <= num_speakers - 2:
        raise ValueError(
            f"test_fraction={test_fraction} of {num_speakers} speakers leaves {count} test speakers; "
            "a speaker-disjoint split needs >= 2 speakers on each side"
        )
    chosen = np.random.default_rng(split_seed).permutation(num_speakers)[:count]
    return np.isin(labels, chosen)


def _speaker_split_note(test_fraction: float, split_seed: int) -> str:
    """How :func:`_speaker_split` split the speakers, for ``info["split"]``."""
    if test_fraction:
        held = f"test_fraction={test_fraction} of the speakers held out"
        return f"speaker-disjoint: {held}, split_seed={split_seed}"
    return "every speaker in one pool (split by class: data_options.split / test_classes)"


def _info(source: str, files: AudioFiles, split: str, num_speakers: int) -> dict[str, Any]:
    return {
        "source": source, "kind": "audio", "sample_rate": files.sample_rate,
        "crop_seconds": files.crop_seconds, "channel": files.channel,
        "resample": "soxr HQ" if files.resample else "off", "split": split,
        "num_speakers": num_speakers, "evaluation": "whole utterances",
    }  # fmt: skip


def _splits(
    source: str, files: AudioFiles, labels: np.ndarray, speakers: list[str],
    parts: dict[str, np.ndarray] | None, test_fraction: float, split_seed: int,
) -> RawSplits:  # fmt: skip
    if parts is not None:  # train/ and test/ (and val/) as given
        val = parts.get("val")
        return RawSplits(
            files[parts["train"]], labels[parts["train"]], files[parts["test"]], labels[parts["test"]],
            x_val=None if val is None else files[val], y_val=None if val is None else labels[val],
            kind="audio", class_names=speakers,
            info=_info(source, files, "train/ and test/ sub-folders as given", len(speakers)),
        )  # fmt: skip
    test = _speaker_split(labels, len(speakers), test_fraction, split_seed)
    note = _speaker_split_note(test_fraction, split_seed)
    return RawSplits(
        files[~test], labels[~test], files[test], labels[test], kind="audio", class_names=speakers,
        info=_info(source, files, note, len(speakers)),
    )  # fmt: skip


def read_audio_folder(
    directory: str | os.PathLike[str],
    *,
    sample_rate: int = 16000,
    crop_seconds: float | None = 2.0,
    channel: int | str = 0,
    resample: bool = True,
    test_fraction: float = 0.2,
    split_seed: int = 0,
) -> RawSplits:
    """``audio:DIR``: one sub-folder per speaker (nested sessions allowed), or ``train/`` and ``test/``.

    Labels are the indices of the sorted speaker names (their union over split folders). See the
    module doc for the split and what a row reads.
    """
    files, y, speakers, parts = _folder_files(
        directory, sample_rate=sample_rate, crop_seconds=crop_seconds, channel=channel, resample=resample
    )
    return _splits(str(Path(directory)), files, y, speakers, parts, test_fraction, split_seed)


def _folder_files(
    directory: str | os.PathLike[str], **options: Any
) -> tuple[AudioFiles, np.ndarray, list[str], dict[str, np.ndarray] | None]:
    """Every utterance of ``audio:DIR``, its speaker label, the speakers and the split folders' rows."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory (expected one sub-folder of audio per speaker)")
    split_layout = (root / "train").is_dir() and (root / "test").is_dir()
    groups = [s for s in ("train", "val", "test") if (root / s).is_dir()] if split_layout else [""]
    listings = {g: _list_speakers(root / g if g else root) for g in groups}
    speakers = sorted({name for listing in listings.values() for name in listing})
    index = {name: i for i, name in enumerate(speakers)}
    names: list[str] = []
    labels: list[int] = []
    group_of: list[str] = []
    for g, listing in listings.items():
        for name, files in listing.items():
            names.extend(f.relative_to(root).as_posix() for f in files)
            labels.extend([index[name]] * len(files))
            group_of.extend([g] * len(files))
    files = AudioFiles(names, names, root=root, **options)
    y = np.asarray(labels, dtype=np.int64)
    groups_array = np.asarray(group_of)
    parts = {g: np.flatnonzero(groups_array == g) for g in groups} if split_layout else None
    return files, y, speakers, parts


def _read_table(path: Path, what: str) -> list[tuple[int, str, str]]:
    """``(line number, first field, rest of the line)`` of a Kaldi table (blank lines skipped)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file ({what})")
    size = path.stat().st_size
    if size > _MAX_LIST_BYTES:
        raise ValueError(f"{path}: {size} bytes, over the {_MAX_LIST_BYTES}-byte limit of a {what}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        key, _, rest = stripped.partition(" ")
        if "\t" in key:
            key, _, more = key.partition("\t")
            rest = (more + " " + rest).strip()
        rest = rest.strip()
        if not rest:
            raise ValueError(
                f"{path}, line {number}: expected '<utterance-id> <{what} value>', got {stripped[:200]!r}"
            )
        rows.append((number, key, rest))
    if not rows:
        raise ValueError(f"{path}: holds no entries ({what})")
    return rows


def _checked_location(scp: Path, number: int, utt: str, location: str) -> str:
    if location.endswith("|"):
        raise ValueError(
            f"{scp}, line {number}: utterance {utt!r} is a command pipe ({location[:120]!r}); marginkit "
            "never runs commands named in a data file: convert the audio to wav/flac files and list "
            "their paths"
        )
    if location == "-" or location.startswith("-|") or location.startswith("|"):
        raise ValueError(
            f"{scp}, line {number}: utterance {utt!r} reads standard input or a pipe ({location!r})"
        )
    head, sep, offset = location.rpartition(":")
    if sep and offset.isdigit() and head.lower().endswith(".ark"):
        raise ValueError(
            f"{scp}, line {number}: utterance {utt!r} is a Kaldi archive entry ({location!r}); "
            "list wav/flac files"
        )
    return location


def read_wav_scp(
    path: str | os.PathLike[str],
    *,
    sample_rate: int = 16000,
    crop_seconds: float | None = 2.0,
    channel: int | str = 0,
    resample: bool = True,
    test_fraction: float = 0.2,
    split_seed: int = 0,
) -> RawSplits:
    """``audio:wav.scp``: Kaldi's ``wav.scp`` and the ``utt2spk`` beside it (see the module doc)."""
    files, y, speakers = _scp_files(
        path, sample_rate=sample_rate, crop_seconds=crop_seconds, channel=channel, resample=resample
    )
    return _splits(str(Path(path)), files, y, speakers, None, test_fraction, split_seed)


def _scp_files(path: str | os.PathLike[str], **options: Any) -> tuple[AudioFiles, np.ndarray, list[str]]:
    """Every utterance of ``audio:wav.scp``, its speaker label and the speakers."""
    scp = Path(path)
    table = _read_table(scp, "wav.scp")
    utt2spk_path = scp.with_name("utt2spk")
    speaker_of: dict[str, str] = {}
    for number, utt, spk in _read_table(utt2spk_path, "utt2spk"):
        if " " in spk:
            raise ValueError(
                f"{utt2spk_path}, line {number}: expected '<utterance-id> <speaker>', got extra fields"
            )
        if utt in speaker_of:
            raise ValueError(f"{utt2spk_path}, line {number}: utterance {utt!r} is listed twice")
        speaker_of[utt] = spk
    names: list[str] = []
    locations: list[str] = []
    seen: set[str] = set()
    for number, utt, location in table:
        if utt in seen:
            raise ValueError(f"{scp}, line {number}: utterance {utt!r} is listed twice")
        seen.add(utt)
        if utt not in speaker_of:
            raise ValueError(f"{scp}, line {number}: utterance {utt!r} has no speaker in {utt2spk_path}")
        names.append(utt)
        locations.append(_checked_location(scp, number, utt, location))
    speakers = sorted({speaker_of[u] for u in names})
    index = {name: i for i, name in enumerate(speakers)}
    y = np.asarray([index[speaker_of[u]] for u in names], dtype=np.int64)
    return AudioFiles(locations, names, root=scp.parent, **options), y, speakers


def _is_manifest(path: Path) -> bool:
    return path.suffix.lower() == ".csv" and not path.is_dir()


def _manifest_files(
    path: str | os.PathLike[str], **options: Any
) -> tuple[AudioFiles, np.ndarray, list[str], Any]:
    """Every utterance of ``audio:FILE.csv``, its speaker label, the speakers and the parsed rows."""
    rows = read_manifest_rows(path)
    others = [p for p in rows.paths if not p.lower().endswith(AUDIO_EXTENSIONS)]
    if others:
        line = rows.lines[rows.paths.index(others[0])]
        raise ValueError(
            f"{rows.where}, line {line}: {others[0]!r} is not a {' or '.join(AUDIO_EXTENSIONS)} file; an "
            "audio manifest lists audio files only"
        )
    if rows.boxes:
        raise ValueError(
            f"{rows.where}: bounding-box columns (x_1, x_2, y_1, y_2) hold values; audio has none"
        )
    files = AudioFiles(rows.paths, rows.paths, root=rows.root, **options)
    return files, rows.labels, rows.class_names, rows


def read_audio_manifest(
    path: str | os.PathLike[str],
    *,
    sample_rate: int = 16000,
    crop_seconds: float | None = 2.0,
    channel: int | str = 0,
    resample: bool = True,
    test_fraction: float = 0.2,
    split_seed: int = 0,
) -> RawSplits:
    """``audio:FILE.csv``: a manifest in ``csv:``'s convention listing utterances (module doc).

    The manifest's ``split`` column is used as given (``validation`` rows are the test split when
    no row is ``test``, as for ``csv:``); with ``train`` rows only, a seeded ``test_fraction`` of
    the *speakers* is held out, as for ``audio:DIR``.
    """
    files, y, speakers, rows = _manifest_files(
        path, sample_rate=sample_rate, crop_seconds=crop_seconds, channel=channel, resample=resample
    )
    info = _info(rows.where, files, "", len(speakers))
    parts = manifest_split_rows(rows, info)
    if not parts["test"].size:
        train = parts["train"]
        test = _speaker_split(y[train], len(speakers), test_fraction, split_seed)
        parts["train"], parts["test"] = train[~test], train[test]
        info["split"] = _speaker_split_note(test_fraction, split_seed) + (
            " (the manifest has only train rows)" if test_fraction else ""
        )
    manifest_flags(rows, parts, info)
    val = parts["val"] if parts["val"].size else None
    return RawSplits(
        files[parts["train"]], y[parts["train"]], files[parts["test"]], y[parts["test"]],
        x_val=None if val is None else files[val], y_val=None if val is None else y[val],
        kind="audio", class_names=speakers, info=info,
    )  # fmt: skip


def read_audio_files(
    location: str, *, sample_rate: int = 16000, channel: int | str = 0, resample: bool = True
) -> tuple[AudioFiles, np.ndarray, list[str]]:
    """Every utterance of ``audio:LOCATION``, unsplit and read whole (a trial list's data):
    ``(files, speaker label of each row, speaker names)``."""
    path = Path(location)
    options: dict[str, Any] = {
        "sample_rate": sample_rate, "crop_seconds": None, "channel": channel, "resample": resample,
    }  # fmt: skip
    if path.is_dir():
        return _folder_files(path, **options)[:3]
    if _is_manifest(path):
        files, y, speakers, _ = _manifest_files(path, **options)
        return files, y, speakers
    if path.is_file():
        return _scp_files(path, **options)
    raise FileNotFoundError(f"audio:{location}: no such folder, wav.scp or CSV manifest")


def read_audio_source(location: str, **options: Any) -> RawSplits:
    """``audio:LOCATION``: a folder (:func:`read_audio_folder`), a CSV manifest
    (:func:`read_audio_manifest`, a ``.csv`` file) or a ``wav.scp`` (:func:`read_wav_scp`)."""
    path = Path(location)
    if path.is_dir():
        return read_audio_folder(path, **options)
    if _is_manifest(path):
        return read_audio_manifest(path, **options)
    if path.is_file():
        return read_wav_scp(path, **options)
    raise FileNotFoundError(f"audio:{location}: no such folder, wav.scp or CSV manifest")
