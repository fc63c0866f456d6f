"""Safe image decoding: the only place that opens user bytes."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from imgret.errors import ImageDecodeError, ImageTooLarge

DEFAULT_MAX_PIXELS = 40_000_000


def decode_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode bytes into an RGB image with EXIF orientation applied.

    The header is read first and the pixel count checked against ``max_pixels`` before any
    pixel data is decoded, so a decompression bomb costs nothing.

    Args:
        data: the raw file bytes (JPEG, PNG, WebP, GIF, BMP, TIFF, ...).
        max_pixels: the largest width × height accepted.

    Returns:
        A fully loaded ``PIL.Image`` in mode ``RGB``.

    Raises:
        ImageTooLarge: more pixels than ``max_pixels``.
        ImageDecodeError: empty, truncated, corrupt or non-image data.
    """
    if not data:
        raise ImageDecodeError("empty file: expected image bytes (JPEG, PNG, WebP, ...)")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns at its global limit; ours is per call.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ImageTooLarge(
                    f"image is {width}x{height} = {width * height} pixels, "
                    f"over the limit of {max_pixels} (IMGRET_MAX_IMAGE_PIXELS)"
                )
            image.load()
            image = ImageOps.exif_transpose(image)
            return _to_rgb(image)
    except ImageDecodeError:
        raise
    except UnidentifiedImageError:
        raise ImageDecodeError(
            "not a recognised image format (expected JPEG, PNG, WebP, GIF, BMP or TIFF)"
        ) from None
    except Image.DecompressionBombError as exc:
        # Pillow's own, larger global limit fired while reading the header.
        raise ImageTooLarge(
            f"image is over the limit of {max_pixels} pixels (IMGRET_MAX_IMAGE_PIXELS): {exc}"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageDecodeError(f"corrupt or truncated image: {exc}") from None


def load_image_file(path: str | Path, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Read a file and decode it with :func:`decode_image`; errors name the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ImageDecodeError(f"{path}: cannot read file ({exc.strerror})") from None
    try:
        return decode_image(data, max_pixels=max_pixels)
    except ImageTooLarge as exc:
        raise ImageTooLarge(f"{path}: {exc}") from None
    except ImageDecodeError as exc:
        raise ImageDecodeError(f"{path}: {exc}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """Any mode to RGB; transparency is composited on white, 16-bit is scaled to 8-bit."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit greyscale: scale to 0..255 instead of clipping.
        import numpy as np

        arr = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or arr.max() > 255 else 255.0
        arr = np.clip(arr / top * 255.0, 0, 255).astype("uint8")
        return Image.fromarray(arr, mode="L").convert("RGB")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")
