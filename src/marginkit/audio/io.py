"""Reading audio files: wav and flac through libsndfile (soundfile), one channel, at the model's rate.

* Formats: whatever libsndfile decodes (wav, flac, ogg, ...) in 16-bit, 24-bit, 32-bit integer or
  32/64-bit float PCM; samples come back as float32 in [-1, 1] (integer PCM divided by its full scale).
* Channels: one is kept, the first by default (``channel=0``; ``channel="mean"`` averages them).
* Only the frames a crop needs are read (``sf.read(start=, frames=)`` after ``sf.info``): a random
  2 s crop of a two-hour file costs the crop's memory, not the file's.
* Resampling to the model's rate by soxr (``"HQ"`` quality) when the file's rate differs, or a
  refusal naming both rates (``resample=False``).
* Bad inputs raise :class:`~marginkit.data.samples.BadSampleError` naming the file: not audio
  (libsndfile cannot open it), no samples, NaN or infinite samples, a truncated file (a WAV whose
  data chunk promises more bytes than the file holds, or a read that ends early), an unreadable
  channel, a whole-utterance read over ``max_seconds``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from marginkit.data.samples import BadSampleError

__all__ = [
    "AudioInfo",
    "audio_info",
    "decode_audio_bytes",
    "decode_audio_upload",
    "read_audio",
    "read_crop",
    "soundfile_module",
]

#: Longest utterance read whole (evaluation) unless the caller allows more: an hour at 16 kHz is 230 MB.
MAX_SECONDS = 3600.0

_TRUNCATED = re.compile(r"^data\s*:\s*(\d+)\s*\(should be (\d+)\)", re.MULTILINE)
_STREAMED_SIZES = (0, 0xFFFFFFFF, 0x7FFFFFFF)  # data sizes writers use when the length is unknown


def _optional(name: str) -> ModuleType:
    from marginkit._lazy import require

    return require(name, purpose="reading audio", extra="audio")


def soundfile_module() -> ModuleType:
    """The ``soundfile`` module, or an ImportError naming the ``audio`` extra."""
    return _optional("soundfile")


@dataclass(frozen=True)
class AudioInfo:
    """What the header of an audio file says: rate (Hz), frames (samples per channel), channels, format."""

    path: str
    sample_rate: int
    frames: int
    channels: int
    format: str
    subtype: str

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate


def audio_info(path: str | os.PathLike[str]) -> AudioInfo:
    """Read and check an audio file's header (nothing is decoded).

    Raises:
        BadSampleError: not a file libsndfile opens, 0 samples, a WAV truncated below its data chunk.
    """
    where = os.fspath(path)
    sf = soundfile_module()
    if not os.path.isfile(where):
        raise BadSampleError(where, "no such file" if not os.path.exists(where) else "not a regular file")
    try:
        info = sf.info(where)
    except (sf.SoundFileError, RuntimeError, OSError, TypeError, ValueError) as err:
        raise BadSampleError(where, f"not an audio file libsndfile can read ({_first_line(err)})") from None
    _check_header(where, info.samplerate, info.frames, info.channels, info.extra_info)
    return AudioInfo(
        where, int(info.samplerate), int(info.frames), int(info.channels), info.format, info.subtype
    )


def _check_header(where: str, rate: int, frames: int, channels: int, extra_info: str | None) -> None:
    """Refuse a header with no samples, a nonsense rate or channel count, or a WAV whose data chunk
    declares more bytes than the file holds (libsndfile then reads what is there, silently)."""
    if rate <= 0 or channels <= 0:
        raise BadSampleError(where, f"invalid header: {rate} Hz, {channels} channels")
    if frames <= 0:
        raise BadSampleError(where, "the file holds 0 samples")
    truncated = _TRUNCATED.search(extra_info or "")
    if truncated and int(truncated.group(1)) not in _STREAMED_SIZES:
        declared, present = int(truncated.group(1)), int(truncated.group(2))
        if present < declared:
            raise BadSampleError(
                where, f"truncated: its data chunk declares {declared} bytes but the file holds {present}"
            )


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _channel(data: np.ndarray, channel: int | str, info: AudioInfo) -> np.ndarray:
    if channel == "mean":
        return data.mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(data[:, channel])


def _decode(info: AudioInfo, start: int, frames: int, channel: int | str) -> np.ndarray:
    """Frames ``[start, start + frames)`` of one channel, float32; refuses short reads and NaN."""
    sf = soundfile_module()
    if channel != "mean" and (isinstance(channel, bool) or not isinstance(channel, int) or channel < 0):
        raise ValueError(f"channel must be an int >= 0 or 'mean', got {channel!r}")
    if channel != "mean" and channel >= info.channels:
        raise BadSampleError(info.path, f"has {info.channels} channel(s); channel {channel} was asked for")
    try:
        data, _ = sf.read(info.path, start=start, frames=frames, dtype="float32", always_2d=True)
    except (sf.SoundFileError, RuntimeError, OSError, ValueError) as err:
        raise BadSampleError(
            info.path,
            f"cannot decode frames {start}..{start + frames} ({_first_line(err)}); truncated or corrupt?",
        ) from None
    if data.shape[0] != frames:
        raise BadSampleError(
            info.path,
            f"truncated: the header promises {info.frames} frames but reading {frames} from frame {start} "
            f"gave {data.shape[0]}",
        )
    wave = _channel(data, channel, info)
    if not np.isfinite(wave).all():
        bad = int(np.flatnonzero(~np.isfinite(wave))[0]) + start
        raise BadSampleError(info.path, f"NaN or infinite sample at frame {bad}")
    return wave


def _resample(wave: np.ndarray, info: AudioInfo, sample_rate: int, resample: bool) -> np.ndarray:
    if info.sample_rate == sample_rate:
        return wave
    if not resample:
        raise BadSampleError(
            info.path,
            f"sampled at {info.sample_rate} Hz, the model takes {sample_rate} Hz (resampling is off)",
        )
    soxr = _optional("soxr")
    return np.asarray(soxr.resample(wave, info.sample_rate, sample_rate, quality="HQ"), dtype=np.float32)


def read_audio(
    path: str | os.PathLike[str],
    sample_rate: int,
    *,
    channel: int | str = 0,
    resample: bool = True,
    max_seconds: float = MAX_SECONDS,
    info: AudioInfo | None = None,
) -> np.ndarray:
    """The whole file as float32 ``[N]`` at ``sample_rate`` (one channel; see the module notes)."""
    info = info or audio_info(path)
    if info.seconds > max_seconds:
        raise BadSampleError(
            info.path,
            f"{info.seconds:.0f} s long, over the {max_seconds:g} s limit of a whole-utterance read",
        )
    return _resample(_decode(info, 0, info.frames, channel), info, sample_rate, resample)


def read_crop(
    path: str | os.PathLike[str],
    sample_rate: int,
    num_samples: int,
    rng: np.random.Generator,
    *,
    channel: int | str = 0,
    resample: bool = True,
    info: AudioInfo | None = None,
) -> np.ndarray:
    """A random crop of ``num_samples`` at ``sample_rate``, float32 ``[num_samples]``.

    The start is drawn from ``rng`` uniformly over the file's possible starts and only the frames
    the crop needs are decoded (in the file's rate, a few more when resampling). An utterance
    shorter than the crop is repeated end to end (as wespeaker does) before the crop is taken.
    """
    info = info or audio_info(path)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    ratio = info.sample_rate / sample_rate
    need = num_samples if ratio == 1 else math.ceil(num_samples * ratio) + 64  # soxr's edges, then cut
    if info.frames <= need:
        wave = _resample(_decode(info, 0, info.frames, channel), info, sample_rate, resample)
        if wave.size == 0:
            raise BadSampleError(
                info.path, f"{info.frames} frame(s) at {info.sample_rate} Hz: no sample at {sample_rate} Hz"
            )
        if wave.size < num_samples:
            wave = np.tile(wave, -(-num_samples // wave.size) + 1)
        start = int(rng.integers(0, wave.size - num_samples + 1))
        return wave[start : start + num_samples].copy()
    start = int(rng.integers(0, info.frames - need + 1))
    wave = _resample(_decode(info, start, need, channel), info, sample_rate, resample)
    if wave.size < num_samples:  # resampler rounding; never more than a few samples
        wave = np.pad(wave, (0, num_samples - wave.size), mode="wrap")
    return wave[:num_samples].copy()


def _refusal(name: str, problem: str, reason: str) -> BadSampleError:
    """A :class:`BadSampleError` with ``reason`` (``"too_large"``, ``"not_audio"`` or
    ``"invalid"``) for callers that answer differently, as a server does (413 / 415 / 422)."""
    err = BadSampleError(name, problem)
    err.reason = reason  # type: ignore[attr-defined]
    return err


def decode_audio_bytes(
    data: bytes,
    sample_rate: int,
    *,
    name: str = "upload",
    max_bytes: int = 50 * 2**20,
    max_seconds: float = 600.0,
    channel: int | str = 0,
    resample: bool = True,
) -> np.ndarray:
    """A wav / flac file given as bytes (an HTTP upload) as float32 ``[N]`` at ``sample_rate``.

    The checks of :func:`audio_info` and :func:`read_audio` (not audio, 0 samples, truncated, NaN,
    channel), plus ``max_bytes`` before anything is parsed and ``max_seconds`` before decoding;
    every refusal is a :class:`BadSampleError` whose ``where`` is ``name`` and whose ``reason``
    is ``"too_large"``, ``"not_audio"`` or ``"invalid"``. :func:`decode_audio_upload` also
    returns the file's header.
    """
    return decode_audio_upload(
        data, sample_rate, name=name, max_bytes=max_bytes, max_seconds=max_seconds, channel=channel,
        resample=resample,
    )[0]  # fmt: skip


def decode_audio_upload(
    data: bytes,
    sample_rate: int,
    *,
    name: str = "upload",
    max_bytes: int = 50 * 2**20,
    max_seconds: float = 600.0,
    channel: int | str = 0,
    resample: bool = True,
) -> tuple[np.ndarray, AudioInfo]:
    """:func:`decode_audio_bytes` and the file's :class:`AudioInfo` (its own rate and channels,
    before the channel was taken and the rate changed)."""
    import io

    sf = soundfile_module()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise _refusal(name, f"{len(data)} bytes, over the {max_bytes}-byte limit", "too_large")
    if len(data) == 0:
        raise _refusal(name, "empty body: no audio file", "not_audio")
    try:
        handle = sf.SoundFile(io.BytesIO(bytes(data)))
    except (sf.SoundFileError, RuntimeError, OSError, TypeError, ValueError) as err:
        raise _refusal(
            name, f"not an audio file libsndfile can read ({_first_line(err)})", "not_audio"
        ) from None
    with handle:
        info = AudioInfo(name, int(handle.samplerate), int(handle.frames), int(handle.channels),
                         handle.format, handle.subtype)  # fmt: skip
        try:
            _check_header(name, info.sample_rate, info.frames, info.channels, handle.extra_info)
        except BadSampleError as err:
            raise _refusal(name, err.problem, "invalid") from None
        if info.seconds > max_seconds:
            raise _refusal(name, f"{info.seconds:.1f} s long, over the {max_seconds:g} s limit", "too_large")
        if channel != "mean" and (isinstance(channel, bool) or not isinstance(channel, int) or channel < 0):
            raise ValueError(f"channel must be an int >= 0 or 'mean', got {channel!r}")
        if channel != "mean" and channel >= info.channels:
            problem = f"has {info.channels} channel(s); channel {channel} was asked for"
            raise _refusal(name, problem, "invalid")
        try:
            frames = handle.read(info.frames, dtype="float32", always_2d=True)
        except (sf.SoundFileError, RuntimeError, OSError, ValueError) as err:
            raise _refusal(
                name, f"cannot decode ({_first_line(err)}); truncated or corrupt?", "invalid"
            ) from None
    if frames.shape[0] != info.frames:
        raise _refusal(name, f"truncated: the header promises {info.frames} frames, the body holds "
                       f"{frames.shape[0]}", "invalid")  # fmt: skip
    wave = _channel(frames, channel, info)
    if not np.isfinite(wave).all():
        first = int(np.flatnonzero(~np.isfinite(wave))[0])
        raise _refusal(name, f"NaN or infinite sample at frame {first}", "invalid")
    try:
        return _resample(wave, info, sample_rate, resample), info
    except BadSampleError as err:
        raise _refusal(name, err.problem, "invalid") from None


def describe(info: AudioInfo) -> dict[str, Any]:
    """A JSON-able summary of a header (for reports)."""
    return {"sample_rate": info.sample_rate, "frames": info.frames, "channels": info.channels,
            "format": info.format, "subtype": info.subtype}  # fmt: skip
