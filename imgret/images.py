"""Safe image decoding: the only place that opens user bytes.

Two ways in:

* :func:`decode_image` gives the full-size RGB image (the CLI, tests, anything that needs every
  pixel).
* :func:`decode_for_embedding` / :func:`embed_encoded` are what the service uses on uploads.
  A few kilobytes of PNG can declare 40 million pixels, so what costs memory is not the upload
  but the decoded image. These functions read the header first and charge a
  :class:`PixelBudget` (per request, per batch) before any pixel is decoded, take a slot of the
  process-wide :class:`DecodeGate` (in bytes, from :func:`decode_cost`) while a full-size
  image exists, and shrink every image to a few times the model's input side as soon as it is
  decoded (JPEG: already while decoding, with ``Image.draft``; the shrinking converts and
  reduces a strip at a time, so it adds no full-size copy). So the memory that decoding holds
  in the whole process is bounded by the gate, not by the number of files or of concurrent
  requests.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import io
import logging
import math
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from imgret.errors import ImageDecodeError, ImageTooLarge, ImgretError
from imgret.files import read_file

if TYPE_CHECKING:
    import torch

    from imgret.embedder import Embedder
    from imgret.settings import Settings

logger = logging.getLogger(__name__)

DEFAULT_MAX_PIXELS = 40_000_000
# See imgret.settings.Settings (max_request_pixels, batch_max_pixels, decode_memory_mb) for
# why these values.
DEFAULT_REQUEST_PIXELS = 256_000_000
DEFAULT_BATCH_PIXELS = 80_000_000
DEFAULT_DECODE_MEMORY = 640 * 1024 * 1024

# Images are shrunk to no less than REDUCING_GAP x the model's input side before the model's
# own resize (imgret.transforms.eval_transform) does the last step. This is Pillow's
# ``reducing_gap`` idea: a box reduction down to 3x the target followed by the antialiased
# resize is indistinguishable from the antialiased resize alone, and images smaller than 6x
# the input side are not touched at all (so their model input is bit-for-bit unchanged).
REDUCING_GAP = 3

# The formats decoded, by Pillow's names: the six the message lists, and nothing else. Pillow
# opens dozens more (XBM, PPM, ICO, PSD, ...), each a parser more for hostile bytes to reach
# and a file the media store would keep and serve; none is a photo format clients send.
DECODED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_UNSUPPORTED = "not a recognised image format (expected JPEG, PNG, WebP, GIF, BMP or TIFF)"


def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode bytes into an RGB image with EXIF orientation applied.

    The header is read first and the pixel count checked against ``max_pixels`` before any
    pixel data is decoded, so a decompression bomb costs nothing.

    Args:
        data: the raw file bytes: JPEG, PNG, WebP, GIF, BMP or TIFF (:data:`DECODED_FORMATS`;
            any other format is refused like non-image data).
        max_pixels: the largest width × height accepted.

    Returns:
        A fully loaded ``PIL.Image`` in mode ``RGB``.

    Raises:
        ImageTooLarge: more pixels than ``max_pixels``.
        ImageDecodeError: empty, truncated, corrupt or non-image data, and any other failure
            while decoding (crafted EXIF that breaks Pillow, no memory left, ...): a hostile
            file must be a 4xx for its sender, never an error of the server.
    """
    with _decoding(max_pixels):
        image = _open(data, max_pixels)
        image.load()
        image = ImageOps.exif_transpose(image)
        return _to_rgb(image)


def load_image_file(path: str | Path, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Read a file and decode it with :func:`decode_image`; errors name the file."""
    path = Path(path)
    try:
        data = read_file(path)
    except OSError as exc:
        raise ImageDecodeError(f"{path}: cannot read file ({exc.strerror})") from None
    try:
        return decode_image(data, max_pixels=max_pixels)
    except ImageTooLarge as exc:
        raise ImageTooLarge(f"{path}: {exc}") from None
    except ImageDecodeError as exc:
        raise ImageDecodeError(f"{path}: {exc}") from None


# --------------------------------------------------------------------------- budgets


class PixelBudget:
    """An allowance of decoded pixels for one request or one batch.

    Charged with what decoding *will* produce, read from the header, before anything is
    decoded: a request whose files together would decode too much is refused at no cost. Not
    thread-safe: one request or one batch uses it from one thread.

    Args:
        max_pixels: the allowance.
        setting: the environment variable that sets it, named in the error so an operator
            knows what to raise.
        scope: ``"request"`` or ``"batch"``, for the message.
    """

    def __init__(self, max_pixels: int, *, setting: str, scope: str = "request"):
        if max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, not {max_pixels}")
        self.max_pixels = max_pixels
        self.setting = setting
        self.scope = scope
        self.used = 0

    @property
    def remaining(self) -> int:
        return max(0, self.max_pixels - self.used)

    def fits(self, pixels: int) -> bool:
        """Whether ``pixels`` more are within the allowance."""
        return self.used + pixels <= self.max_pixels

    def charge(self, pixels: int) -> None:
        """Take ``pixels`` from the allowance.

        Raises:
            ImageTooLarge: the allowance would be exceeded (nothing is taken then).
        """
        if not self.fits(pixels):
            raise ImageTooLarge(
                f"this {self.scope} would decode {self.used + pixels:,} pixels, over its budget "
                f"of {self.max_pixels:,} ({self.setting}); send fewer or smaller images"
            )
        self.used += pixels

    def force(self, pixels: int) -> None:
        """Take ``pixels`` even past the allowance (a batch always takes its first item)."""
        self.used += pixels


class DecodeGate:
    """Bounds the memory that full-size decoding holds at the same time, in one process.

    Every decode of an upload holds its :func:`decode_cost` (bytes) of the gate from just
    before its pixels are decoded until the full-size image is shrunk and freed. A decode
    waits while the others in flight would take the total over ``capacity_bytes``; one image
    alone always passes (its size is already bounded by ``IMGRET_MAX_IMAGE_PIXELS``), so
    nothing waits forever. Search batches, gallery uploads and evaluation uploads run in
    different threads; this is what bounds their sum, whatever the number of concurrent
    requests: at most ``max(capacity_bytes, the costliest single image)``.
    """

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, not {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._in_flight = 0
        self._condition = threading.Condition()

    @property
    def in_flight(self) -> int:
        """Bytes held now."""
        return self._in_flight

    @contextlib.contextmanager
    def hold(self, cost: int) -> Iterator[None]:
        """Hold ``cost`` bytes of the gate for the ``with`` block (waits for room first)."""
        with self._condition:
            self._condition.wait_for(
                lambda: self._in_flight == 0 or self._in_flight + cost <= self.capacity_bytes
            )
            self._in_flight += cost
        try:
            yield
        finally:
            with self._condition:
                self._in_flight -= cost
                self._condition.notify_all()


@cache
def decode_gate(capacity_bytes: int) -> DecodeGate:
    """The process's gate of this capacity (``IMGRET_DECODE_MEMORY_MB``).

    One gate per value: a process serves one settings object, so every path that decodes
    uploads (search, gallery, evaluate) shares the same gate, which is what makes the bound
    hold for the process (like ``get_settings``, read once).
    """
    return DecodeGate(capacity_bytes)


# Bytes Pillow holds per decoded pixel, by mode (measured with Pillow 12: the image itself;
# the decoders' own buffers are a few rows). RGB is stored as 32-bit pixels.
_MODE_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2}
# Formats whose decoder holds more: Pillow decodes WebP through libwebp's animation decoder,
# which keeps its own RGBA canvases besides the image (16.2 bytes per pixel measured).
_FORMAT_BYTES = {"WEBP": 16}
# What shrinking adds on top, whatever the image: one strip converted and reduced at a time
# (at most ~13 bytes per strip pixel: a 16-bit strip as float64 + its crop + 8-bit result).
_STRIP_PIXELS = 1 << 20
_STRIP_BYTES = 24 * _STRIP_PIXELS


class _Trimmer:
    """Calls ``malloc_trim(0)`` once every ``every`` bytes of decoding, process-wide.

    glibc gives each thread its own malloc arena and keeps what a thread freed for that
    thread's later use. Decodes run on many threads (the batcher's, the thread pool's), so
    without this each thread that once decoded a large image keeps that memory resident, and
    the RSS grows to threads x largest image whatever the gate allows. Measured with 12 threads
    decoding 40 M-pixel bombs under a 640 MiB gate: 2,085 MiB peak without trimming, 668 MiB
    trimming after every decode (10 % more time). Counting bytes keeps that bound without
    paying a trim (a walk of every arena) for each small image. A no-op without glibc.
    """

    def __init__(self, every: int):
        self.every = every
        self._pending = 0
        self._lock = threading.Lock()
        try:
            self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc (musl, macOS)
            self._trim = None

    def freed(self, nbytes: int) -> None:
        """Note ``nbytes`` of decoding done; trim when enough has piled up."""
        if self._trim is None:
            return
        with self._lock:
            self._pending += nbytes
            if self._pending < self.every:
                return
            self._pending = 0
        self._trim(0)


_TRIMMER = _Trimmer(every=64 * 1024 * 1024)


def decode_cost(image: Image.Image) -> int:
    """The peak bytes :func:`decode_for_embedding` holds for ``image`` (opened, not loaded).

    The full-size image at its mode's size per pixel (or the format decoder's, when larger),
    plus one strip of the shrinking. Conservative: measured peaks are within 5 % of the
    per-pixel part.
    """
    pixels = image.size[0] * image.size[1]
    per_pixel = max(_MODE_BYTES.get(image.mode, 4), _FORMAT_BYTES.get(image.format or "", 0))
    return pixels * per_pixel + _STRIP_BYTES


@dataclass(frozen=True)
class DecodeLimits:
    """The decoding limits of the service, from the settings.

    Attributes:
        image_pixels: the most pixels one image may declare (``IMGRET_MAX_IMAGE_PIXELS``).
        request_pixels: the most pixels one request may decode (``IMGRET_MAX_REQUEST_PIXELS``).
        decode_memory: the capacity in bytes of the process's :class:`DecodeGate`
            (``IMGRET_DECODE_MEMORY_MB``).
    """

    image_pixels: int = DEFAULT_MAX_PIXELS
    request_pixels: int = DEFAULT_REQUEST_PIXELS
    decode_memory: int = DEFAULT_DECODE_MEMORY

    @classmethod
    def from_settings(cls, settings: Settings) -> DecodeLimits:
        return cls(
            image_pixels=settings.max_image_pixels,
            request_pixels=settings.max_request_pixels,
            decode_memory=settings.decode_memory_mb * 1024 * 1024,
        )

    def request_budget(self) -> PixelBudget:
        """A fresh allowance for one request."""
        return PixelBudget(self.request_pixels, setting="IMGRET_MAX_REQUEST_PIXELS")

    @property
    def gate(self) -> DecodeGate:
        return decode_gate(self.decode_memory)


# --------------------------------------------------------------------------- for the model


@dataclass(frozen=True)
class ImageProbe:
    """What an image's header says, before any pixel is decoded.

    Attributes:
        width, height: the declared size.
        decode_width, decode_height: the size decoding will produce (smaller for a large JPEG,
            which is decoded at 1/2, 1/4 or 1/8 scale when that still leaves enough pixels).
    """

    width: int
    height: int
    decode_width: int
    decode_height: int

    @property
    def decode_pixels(self) -> int:
        return self.decode_width * self.decode_height


def probe_image(
    data: bytes, *, size: int, max_pixels: int = DEFAULT_MAX_PIXELS
) -> ImageProbe:
    """Read the header only and say what :func:`decode_for_embedding` would decode.

    Args:
        data: the encoded bytes.
        size: the model's input side (``embedder.spec.image_size``).
        max_pixels: the per-image limit.

    Raises:
        ImageTooLarge: the header declares more than ``max_pixels``.
        ImageDecodeError: not an image, or a header Pillow cannot read.
    """
    with _decoding(max_pixels):
        image = _open(data, max_pixels)
        width, height = image.size
        _draft(image, size)
        return ImageProbe(width, height, *image.size)


def decode_for_embedding(
    data: bytes, *, size: int, max_pixels: int = DEFAULT_MAX_PIXELS,
    budget: PixelBudget | None = None, gate: DecodeGate | None = None,
) -> Image.Image:
    """Decode an upload for the model, holding as little memory as the model allows.

    Like :func:`decode_image`, but: a JPEG is decoded at reduced scale (``Image.draft``); the
    pixels to decode are charged to ``budget`` before decoding; decoding holds ``gate``; and
    the decoded image is box-reduced to no less than ``REDUCING_GAP x size`` per side before
    EXIF orientation and colour conversion, which then work on the small image. The model's
    own resize (``Embedder.preprocess``) does the rest, so this is one embedding path: an
    image under ``2 x REDUCING_GAP x size`` per side comes out exactly as from
    :func:`decode_image`.

    Args:
        data: the encoded bytes.
        size: the model's input side (``embedder.spec.image_size``).
        max_pixels: the per-image limit on the declared size (``IMGRET_MAX_IMAGE_PIXELS``).
        budget: the request's or batch's allowance, charged here; ``None``: not charged (the
            caller charged it from :func:`probe_image` already).
        gate: the process's decode gate (``DecodeLimits.gate``); ``None``: not gated.

    Returns:
        An RGB image with each side at most about ``2 x REDUCING_GAP x size`` (or its original
        size when smaller).

    Raises:
        ImageTooLarge: over ``max_pixels`` or over the budget.
        ImageDecodeError: anything else that goes wrong with these bytes.
    """
    target = REDUCING_GAP * max(1, size)
    with _decoding(max_pixels):
        image = _open(data, max_pixels)
        _draft(image, size)
        if budget is not None:
            budget.charge(image.size[0] * image.size[1])
        cost = decode_cost(image)
        with gate.hold(cost) if gate is not None else contextlib.nullcontext():
            image.load()
            loaded = image
            image = _reduce(image, target)
            # Before the gate lets the next one in. The trimmer counts what was allocated:
            # the strips only when shrinking (the gate's cost is an upper bound; counted
            # whole, every small query added 24 MiB and ran a trim every third decode, ~50 us
            # per image on average, a quarter of decoding a 28 px PNG).
            _TRIMMER.freed(cost if image is not loaded else cost - _STRIP_BYTES)
        image = ImageOps.exif_transpose(image)
        return _to_rgb(image)


def check_request_pixels(
    blobs: Sequence[bytes], *, size: int, limits: DecodeLimits,
    budget: PixelBudget | None = None, names: Sequence[str] | None = None,
) -> PixelBudget:
    """Read every header of one request and charge what decoding them all would cost.

    Run this before decoding any of them: a request over its budget, or with one file that is
    not an image, is refused without decoding a pixel.

    Args:
        blobs: the request's files, in order.
        size: the model's input side.
        limits: the service's limits.
        budget: the allowance to charge (default: a fresh one from ``limits``).
        names: how to name each file in errors (default ``images[i]``).

    Returns:
        The charged budget.

    Raises:
        ImageTooLarge, ImageDecodeError: the message starts with the file's name.
    """
    budget = budget if budget is not None else limits.request_budget()
    for name, data in zip(_names(blobs, names), blobs, strict=True):
        try:
            budget.charge(probe_image(data, size=size, max_pixels=limits.image_pixels)
                          .decode_pixels)
        except ImgretError as exc:
            raise type(exc)(f"{name}: {exc}") from None
    return budget


def preprocess_encoded(
    data: bytes, *, embedder: Embedder, max_pixels: int, gate: DecodeGate | None = None,
) -> torch.Tensor:
    """Decode one upload and turn it into the model's input right away.

    Returns:
        ``(1, 3, S, S)`` float32: ``embedder.preprocess`` of :func:`decode_for_embedding`.
        The decoded image is dropped before this returns, so a caller that keeps only these
        tensors holds ``3 x S x S x 4`` bytes per image.

    Raises:
        ImageDecodeError: any failure, including an unexpected one in preprocessing (logged
            with its traceback).
    """
    image = decode_for_embedding(
        data, size=embedder.spec.image_size, max_pixels=max_pixels, gate=gate
    )
    try:
        return embedder.preprocess([image])
    except Exception as exc:  # noqa: BLE001 - an odd image must fail alone, as a 4xx
        logger.exception("preprocessing a decoded %dx%d %s image failed", *image.size,
                         image.mode)
        raise ImageDecodeError(f"cannot prepare the image for the model ({exc})") from None


def embed_encoded(
    blobs: Sequence[bytes], *, embedder: Embedder, limits: DecodeLimits,
    budget: PixelBudget | None = None, names: Sequence[str] | None = None,
) -> np.ndarray:
    """Embed one request's uploads, decoding one image at a time.

    First every header is charged to the request's budget (:func:`check_request_pixels`),
    then each image is decoded, shrunk and preprocessed, and every ``embedder.batch_size``
    inputs go through the model. Peak memory: one full-size image (under the gate) plus one
    batch of model inputs, however many files the request has.

    Args:
        blobs: the encoded images, in order.
        embedder: the one embedding path.
        limits: the service's limits (``DecodeLimits.from_settings``).
        budget: the request's allowance (default: a fresh one from ``limits``).
        names: how to name each file in errors (default ``images[i]``).

    Returns:
        ``(len(blobs), dim)`` float32, unit rows, in input order.

    Raises:
        ImageTooLarge: a file or the request over its limit; nothing was decoded.
        ImageDecodeError: a bad file; the message starts with its name.
    """
    names = _names(blobs, names)
    check_request_pixels(blobs, size=embedder.spec.image_size, limits=limits, budget=budget,
                         names=names)
    vectors: list[np.ndarray] = []
    chunk: list[torch.Tensor] = []
    for position, (name, data) in enumerate(zip(names, blobs, strict=True)):
        try:
            chunk.append(preprocess_encoded(data, embedder=embedder,
                                            max_pixels=limits.image_pixels, gate=limits.gate))
        except ImgretError as exc:
            raise type(exc)(f"{name}: {exc}") from None
        if len(chunk) == embedder.batch_size or position == len(blobs) - 1:
            vectors.append(embedder.embed_tensors(_cat(chunk)))
            chunk = []
    if not vectors:
        return np.zeros((0, embedder.dim), dtype=np.float32)
    return np.concatenate(vectors)


# --------------------------------------------------------------------------- internals


@contextlib.contextmanager
def _decoding(max_pixels: int) -> Iterator[None]:
    """Map every failure of Pillow on these bytes to a domain error (-> 4xx)."""
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns at its global limit; ours is per call.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    except ImgretError:
        raise
    except UnidentifiedImageError:
        raise ImageDecodeError(_UNSUPPORTED) from None
    except Image.DecompressionBombError as exc:
        # Pillow's own, larger global limit fired while reading the header.
        raise ImageTooLarge(
            f"image is over the limit of {max_pixels} pixels (IMGRET_MAX_IMAGE_PIXELS): {exc}"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageDecodeError(f"corrupt or truncated image: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - e.g. TypeError/struct.error from crafted EXIF
        # Pillow is not hardened against every crafted file, and MemoryError lands here too.
        # The sender gets a 4xx; the traceback goes to the log, since it may be a Pillow bug.
        logger.warning("unexpected %s while decoding an upload", type(exc).__name__,
                       exc_info=True)
        raise ImageDecodeError(
            f"cannot decode the image ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """Parse the header; refuse empty data and more than ``max_pixels`` declared pixels."""
    if not data:
        raise ImageDecodeError("empty file: expected image bytes (JPEG, PNG, WebP, ...)")
    image = Image.open(io.BytesIO(data), formats=DECODED_FORMATS)
    width, height = image.size
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"image is {width}x{height} = {width * height} pixels, "
            f"over the limit of {max_pixels} (IMGRET_MAX_IMAGE_PIXELS)"
        )
    return image


def _draft(image: Image.Image, size: int) -> None:
    """Let a JPEG decode at 1/2, 1/4 or 1/8 scale, keeping each side >= the reduce target.

    A no-op for every other format (``Image.draft`` does nothing there).
    """
    target = REDUCING_GAP * max(1, size)
    image.draft(None, (target, target))


# Modes Image.reduce handles; strips of the others are converted first.
_REDUCIBLE = frozenset({"L", "LA", "RGB", "RGBA"})


def _reduce(image: Image.Image, target: int) -> Image.Image:
    """Box-reduce by whole factors so that each side stays >= ``target``; frees the original.

    The two axes are reduced independently: the model's resize is to a square, not
    aspect-preserving, so each axis only needs enough samples of its own. The work goes a
    strip of whole reduction blocks at a time (``_STRIP_PIXELS``): a palette image is never
    converted to RGBA at full size, nor an RGBA one premultiplied at full size, and the result
    is the same as reducing the whole image at once.
    """
    width, height = image.size
    factors = (max(1, width // target), max(1, height // target))
    if factors == (1, 1):
        return image
    top = _integer_top(image)  # 16/32-bit greyscale: one scale for the whole image
    rows = max(1, _STRIP_PIXELS // (width * factors[1])) * factors[1]
    reduced: Image.Image | None = None
    for y in range(0, height, rows):
        strip = image.crop((0, y, width, min(height, y + rows)))
        if strip.mode not in _REDUCIBLE:
            strip = _reducible(strip, top)
        small = strip.reduce(factors)
        if reduced is None:
            reduced = Image.new(small.mode, (math.ceil(width / factors[0]),
                                             math.ceil(height / factors[1])))
        reduced.paste(small, (0, y // factors[1]))
    assert reduced is not None
    reduced.info = dict(image.info)  # EXIF orientation, transparency, ...
    image.close()
    return reduced


def _reducible(image: Image.Image, top: float | None) -> Image.Image:
    """A mode :meth:`Image.reduce` accepts, keeping transparency for :func:`_to_rgb`."""
    if image.mode == "P":
        return image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode == "PA":
        return image.convert("RGBA")
    if image.mode == "1":
        return image.convert("L")
    if top is not None:
        return _scale_to_l(image, top)
    return _to_rgb(image)


def _integer_top(image: Image.Image) -> float | None:
    """The value that maps to white for 16/32-bit greyscale (``None`` for other modes)."""
    if image.mode.startswith("I;16"):
        return 65535.0
    if image.mode == "I":
        return 65535.0 if image.getextrema()[1] > 255 else 255.0
    return None


def _scale_to_l(image: Image.Image, top: float) -> Image.Image:
    """16/32-bit greyscale to 8-bit: scale to 0..255 instead of clipping."""
    arr = np.asarray(image, dtype=np.float64)
    arr /= top  # in place: one float64 copy, not four (same values as arr / top * 255)
    arr *= 255.0
    np.clip(arr, 0, 255, out=arr)
    return Image.fromarray(arr.astype("uint8"), mode="L")


def _names(blobs: Sequence[bytes], names: Sequence[str] | None) -> Sequence[str]:
    if names is None:
        return [f"images[{i}]" for i in range(len(blobs))]
    if len(names) != len(blobs):
        raise ValueError(f"{len(names)} names for {len(blobs)} images")
    return names


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.cat(tensors)


def _to_rgb(image: Image.Image) -> Image.Image:
    """Any mode to RGB; transparency is composited on white, 16-bit is scaled to 8-bit."""
    if image.mode == "RGB":
        return image
    top = _integer_top(image)
    if top is not None:
        return _scale_to_l(image, top).convert("RGB")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")
