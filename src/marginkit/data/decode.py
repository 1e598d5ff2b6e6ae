"""Image decoding for training data: the one place that hands a sample's bytes to Pillow.

:func:`decode_image` turns an encoded image (a path or the bytes of a ``.rec`` record or a shard
member) into ``uint8`` ``[C, H, W]`` pixels: ``mode`` ``"L"`` (C = 1) or ``"RGB"`` (C = 3), and
an optional bilinear resize to ``(H, W)`` — the same Pillow calls as the eager ``folder:`` reader
(``convert(mode)`` then ``resize((W, H), BILINEAR)`` when the size differs), so both paths give
identical pixels. Files are hostile, so before any pixel is decoded:

- the file is at most the input memory limit (:func:`marginkit._files.input_limit_bytes`);
- the header's ``width x height`` is at most :func:`max_image_pixels` — Pillow's own
  ``Image.MAX_IMAGE_PIXELS`` (about 89.5 M pixels, where it starts warning of a decompression
  bomb) and no more than a quarter of the input limit in pixels (Pillow decodes every mode
  used here to at most 4 bytes a pixel). A header that declares 30,000 x 30,000 pixels costs
  the header's bytes, never 3.6 GB;
- only the formats of :data:`~marginkit.data.loaders.IMAGE_EXTENSIONS` are tried.

A truncated or corrupt file, an empty file or one that is not an image raises
:class:`~marginkit.data.samples.BadSampleError` naming the file. Formats other than JPEG are
``verify()``-ed first (PNG chunk checksums and its end marker: a truncated PNG can otherwise
decode); Pillow's JPEG ``verify`` checks nothing, and a truncated JPEG fails to decode.

JPEGs, where ``simplejpeg`` is installed (the ``cli`` extra), are decoded by it instead of
Pillow when the result is the same: a YCbCr or grayscale JPEG read as ``"RGB"``, or a grayscale
one read as ``"L"``, at its own size. simplejpeg calls libjpeg-turbo's decoder with the settings
Pillow uses (the accurate integer IDCT, smooth chroma upsampling), so the pixels are Pillow's
(tests/test_data_folder.py compares them over subsamplings, qualities, progressive and grayscale
files), and skips Pillow's header parsing in Python — about half the time per small image.
Everything else (CMYK / YCCK / Adobe-RGB JPEGs, a resize, a colour image read as ``"L"``, which
Pillow converts with its own weights, and any file simplejpeg's strict decoder refuses) takes the
Pillow path, so the errors and pixels of those files are Pillow's as before.
"""

from __future__ import annotations

import functools
import io
import os
import warnings
from types import ModuleType
from typing import NamedTuple

import numpy as np

from marginkit.data.samples import BadSampleError

__all__ = [
    "GRAY_MODES",
    "HEADER_SAMPLE",
    "ImageHeader",
    "ImageLayout",
    "choose_layout",
    "decode_image",
    "image_header",
    "image_size_option",
    "max_image_pixels",
    "sample_positions",
]

#: Pillow modes that hold one channel (``color="auto"`` keeps a source of only these grayscale).
GRAY_MODES = ("1", "L", "LA", "I", "I;16", "F")
_BYTES_PER_PIXEL = 4
# Pillow's format names for IMAGE_EXTENSIONS (.pgm / .ppm are "PPM", .tif / .tiff "TIFF").
_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "TIFF", "WEBP", "PPM")

ImageHeader = tuple[str, tuple[int, int]]  # (Pillow mode, (width, height))


#: Decode JPEGs with simplejpeg where it gives Pillow's pixels (tests switch it off to compare).
FAST_JPEG = True


@functools.cache
def _fast_jpeg() -> ModuleType | None:
    """The ``simplejpeg`` module, or ``None`` where it is not installed (imported once)."""
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def _too_many_pixels(where: str, width: int, height: int, max_pixels: int) -> BadSampleError:
    return BadSampleError(
        where,
        f"its header declares {width} x {height} pixels, more than the {max_pixels:,} an image may have "
        "(refused as a decompression bomb before decoding)",
    )


def _decode_jpeg(
    data: bytes, mode: str, size: tuple[int, int] | None, where: str, max_pixels: int, gray_only: bool
) -> np.ndarray | None:
    """``[H, W, C]`` pixels of a JPEG by simplejpeg, or ``None`` where Pillow decodes it (module doc)."""
    sj = _fast_jpeg() if FAST_JPEG and data[:2] == b"\xff\xd8" else None
    if sj is None:
        return None
    try:
        height, width, colorspace, _ = sj.decode_jpeg_header(data)  # type: ignore[attr-defined]
    except ValueError:
        return None  # Pillow names what is wrong with it
    if width * height > max_pixels:
        raise _too_many_pixels(where, width, height, max_pixels)
    if colorspace == "YCbCr":
        if gray_only:
            return None  # Pillow's path refuses it by name
        if mode == "L":
            return None  # Pillow's own grey weights
    elif colorspace != "Gray":
        return None
    if size is not None and (height, width) != tuple(size):
        return None
    try:
        pixels = sj.decode_jpeg(  # type: ignore[attr-defined]
            data, colorspace="GRAY" if mode == "L" else "RGB", fastdct=False, fastupsample=False, strict=True
        )
    except ValueError:
        return None  # a truncated or corrupt file: Pillow decodes it or names the cause, as before
    return pixels


def max_image_pixels() -> int:
    """The most pixels one image may declare (see the module doc)."""
    from PIL import Image

    from marginkit._files import input_limit_bytes

    pil = Image.MAX_IMAGE_PIXELS or 2**62
    return int(min(pil, input_limit_bytes() // _BYTES_PER_PIXEL))


def _bytes_of(source: bytes | bytearray | memoryview | str | os.PathLike[str], where: str) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    from marginkit._files import input_limit_bytes

    try:
        with open(source, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            limit = input_limit_bytes()
            if size > limit:
                raise BadSampleError(where, f"{size:,} bytes, above the input memory limit ({limit:,} bytes)")
            return handle.read()
    except FileNotFoundError as exc:
        raise BadSampleError(where, "no such file") from exc
    except OSError as exc:
        raise BadSampleError(where, f"cannot read the file ({exc.strerror or exc})") from exc


def _open(data: bytes, where: str, max_pixels: int) -> object:
    """Pillow's image over ``data``, its header checked (nothing decoded yet)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise BadSampleError(where, "empty file (0 bytes), not an image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below, by size
            image = Image.open(io.BytesIO(data), formats=_FORMATS)
    except Image.DecompressionBombError as exc:
        raise BadSampleError(where, f"refused as a decompression bomb before decoding ({exc})") from exc
    except UnidentifiedImageError as exc:
        raise BadSampleError(
            where, f"not an image in a format read here ({', '.join(_FORMATS)}), or a corrupt header"
        ) from exc
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise BadSampleError(where, f"truncated or corrupt image header ({exc})") from exc
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise _too_many_pixels(where, width, height, max_pixels)
    if width < 1 or height < 1:
        image.close()
        raise BadSampleError(where, f"its header declares {width} x {height} pixels")
    return image


def image_header(
    source: bytes | str | os.PathLike[str], *, where: str | None = None, max_pixels: int | None = None
) -> ImageHeader:
    """``(mode, (width, height))`` from an image's header, without decoding its pixels.

    For a path only the first bytes Pillow needs are read.
    """
    where = where or str(source if not isinstance(source, bytes) else "<bytes>")
    limit = max_pixels if max_pixels is not None else max_image_pixels()
    if isinstance(source, bytes):
        image = _open(source, where, limit)
    else:
        # the header sits at the start of every format read here; 64 KiB covers EXIF-heavy JPEGs
        try:
            with open(source, "rb") as handle:
                head = handle.read(1 << 16)
                if len(head) == 1 << 16:  # a longer header: read the whole file (bounded)
                    head += handle.read()
        except OSError as exc:
            raise BadSampleError(where, f"cannot read the file ({exc.strerror or exc})") from exc
        image = _open(head, where, limit)
    with image:  # type: ignore[attr-defined]
        return image.mode, image.size  # type: ignore[attr-defined]


def decode_image(
    source: bytes | bytearray | memoryview | str | os.PathLike[str],
    mode: str,
    size: tuple[int, int] | None = None,
    *,
    where: str | None = None,
    max_pixels: int | None = None,
    expected: tuple[int, ...] | None = None,
    gray_only: bool = False,
) -> np.ndarray:
    """Decode an encoded image to ``uint8`` ``[C, H, W]`` (see the module doc).

    Args:
        source: a path, or the encoded bytes.
        mode: ``"L"`` (one channel) or ``"RGB"``.
        size: ``(H, W)`` to resize to (bilinear), or ``None`` to keep the image's size.
        where: names the sample in errors (default: the path).
        max_pixels: the most pixels the header may declare (default :func:`max_image_pixels`).
        expected: the ``[C, H, W]`` the caller's source promised; a different result is a
            :class:`BadSampleError` (an image of another size in a source without ``image_size``).
        gray_only: refuse an image whose own mode has colour (a source that chose ``"L"`` from
            a sample of its files must not turn a colour image grey silently).

    Raises:
        BadSampleError: empty, truncated or corrupt file, not an image, too many pixels, or not
            what ``expected`` / ``gray_only`` ask for.
    """
    from PIL import Image

    if mode not in ("L", "RGB"):
        raise ValueError(f"mode must be 'L' or 'RGB', got {mode!r}")
    if where is None:
        where = "<bytes>" if isinstance(source, (bytes, bytearray, memoryview)) else os.fspath(source)
    data = _bytes_of(source, where)
    limit = max_pixels if max_pixels is not None else max_image_pixels()
    array = _decode_jpeg(data, mode, size, where, limit, gray_only)
    if array is not None:
        return _checked(array, where, expected)
    image = _open(data, where, limit)
    try:
        own_mode = image.mode  # type: ignore[attr-defined]
        if gray_only and own_mode not in GRAY_MODES:
            raise BadSampleError(
                where,
                f"a colour image (mode {own_mode}) in a source read as grayscale (color='auto' chose "
                "grayscale from a sample of its images); pass color=rgb",
            )
        if image.format != "JPEG":  # type: ignore[attr-defined]
            image.verify()  # type: ignore[attr-defined]
            image = Image.open(io.BytesIO(data), formats=_FORMATS)
        image.load()  # type: ignore[attr-defined]  # decodes (a truncated file fails here)
        # convert() to the image's own mode is a copy of the same pixels: skipped
        converted = image if own_mode == mode else image.convert(mode)  # type: ignore[attr-defined]
        if size is not None and converted.size != (size[1], size[0]):
            converted = converted.resize((size[1], size[0]), Image.Resampling.BILINEAR)
        array = np.asarray(converted, dtype=np.uint8)
    except BadSampleError:
        raise
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise BadSampleError(where, f"truncated or corrupt image ({exc})") from exc
    finally:
        image.close()  # type: ignore[attr-defined]
    return _checked(array, where, expected)


def _checked(array: np.ndarray, where: str, expected: tuple[int, ...] | None) -> np.ndarray:
    """``[C, H, W]``: a view of the decoder's ``[H, W, C]`` (or ``[H, W]``) pixels, of the expected shape."""
    # the batch keeps the [H, W, C] layout (data.loading): a plain copy per row
    array = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
    if expected is not None and array.shape != tuple(expected):
        raise BadSampleError(
            where,
            f"decoded to {list(array.shape)} but the source's samples are {list(expected)}; "
            "pass image_size to resize every image to one size",
        )
    return array


# --------------------------------------------------------------------------------------------
# the per-sample shape of a source, known before decoding it

#: How many images' headers decide a lazy source's mode and size (all of them when it has fewer).
HEADER_SAMPLE = 256


def image_size_option(image_size: object) -> tuple[int, int] | None:
    """The ``image_size`` option (``S`` or ``(H, W)``) as ``(H, W)``, or ``None``."""
    if image_size is None:
        return None
    if isinstance(image_size, int) and not isinstance(image_size, bool):
        size = (image_size, image_size)
    elif (
        isinstance(image_size, (tuple, list))
        and len(image_size) == 2
        and all(isinstance(s, int) and not isinstance(s, bool) for s in image_size)
    ):
        size = (int(image_size[0]), int(image_size[1]))
    else:
        raise ValueError(f"image_size must be an int or a pair (H, W) of ints, got {image_size!r}")
    if min(size) < 1:
        raise ValueError(f"image_size must be positive, got {image_size!r}")
    return size


def sample_positions(n: int, k: int | None = None) -> np.ndarray:
    """``min(n, k)`` positions spread evenly over ``0..n-1`` (every one when ``n <= k``), always
    including the first and the last: the rows whose headers decide a source's layout
    (``k``: :data:`HEADER_SAMPLE` by default)."""
    k = HEADER_SAMPLE if k is None else k
    if n <= k:
        return np.arange(n, dtype=np.int64)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


class ImageLayout(NamedTuple):
    """What :func:`choose_layout` decides for a source."""

    mode: str  # "L" or "RGB"
    shape: tuple[int, int, int]  # decoded [C, H, W]
    gray_only: bool  # refuse colour images on read (color="auto" chose grayscale)
    note: str  # how it was decided, for the log


def choose_layout(
    headers: list[tuple[str, ImageHeader]], total: int, *, image_size: object, color: str, source: str
) -> ImageLayout:
    """The mode and ``[C, H, W]`` of a source's decoded samples from some of its headers.

    ``headers``: ``(where, (mode, (width, height)))`` of the rows :func:`sample_positions` picks
    out of ``total``. The rule (the eager ``folder:`` reader's, over the sample):

    - ``color``: ``"rgb"`` or ``"grayscale"`` as asked; ``"auto"`` is grayscale when every sampled
      image is, else RGB. An ``"auto"`` grayscale choice (made from a sample, the files may change) is
      checked on every read: a colour image then is a :class:`BadSampleError` (``gray_only``),
      never turned grey silently.
    - size: ``image_size`` when given (every image resized to it); else the one size every sampled
      header declares (different sizes: a :class:`ValueError` asking for ``image_size``), and
      each decoded image is checked against it.
    """
    from marginkit._validation import choice

    color = choice(color, "color", ("auto", "grayscale", "rgb"))
    size = image_size_option(image_size)
    if not headers:
        raise ValueError(f"{source}: no images to read")
    if color == "grayscale":
        mode = "L"
    elif color == "rgb" or any(m not in GRAY_MODES for _, (m, _) in headers):
        mode = "RGB"
    else:
        mode = "L"
    if size is None:
        sizes: dict[tuple[int, int], str] = {}
        for where, (_, (w, h)) in headers:
            sizes.setdefault((h, w), where)
            if len(sizes) > 1:
                (a, pa), (b, pb) = list(sizes.items())[:2]
                raise ValueError(
                    f"{source}: images differ in size ({pa}: {a[0]}x{a[1]}, {pb}: {b[0]}x{b[1]}); "
                    "pass the option image_size=S (or (H, W)) to resize them to a common size"
                )
        size = next(iter(sizes))
    sampled = len(headers) < total
    note = (
        f"mode {mode} (color={color}), size {size[0]}x{size[1]} "
        f"({'image_size' if image_size is not None else 'as the headers declare'}); headers read: "
        + (f"{len(headers)} of the {total} images, spread evenly" if sampled else f"all {total} images")
    )
    shape = (1 if mode == "L" else 3, size[0], size[1])
    return ImageLayout(mode, shape, color == "auto" and mode == "L", note)
