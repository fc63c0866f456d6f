"""decode_image: every odd and bad input we can make."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from imgret.errors import ImageDecodeError, ImageTooLarge
from imgret.images import decode_image, load_image_file
from tests.support.hostile_images import png_header_only
from tests.support.images import class_image, image_bytes


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF"])
def test_common_formats_decode_to_rgb(fmt: str) -> None:
    image = decode_image(image_bytes(class_image(1, 0), fmt))
    assert image.mode == "RGB"
    assert image.size == (32, 32)


@pytest.mark.parametrize(
    "mode", ["L", "LA", "P", "RGBA", "CMYK", "I;16", "I", "1", "YCbCr"]
)
def test_any_mode_becomes_rgb(mode: str) -> None:
    source = class_image(2, 0).convert(mode if mode not in ("I;16", "I") else "L")
    if mode in ("I;16", "I"):
        source = Image.fromarray(np.full((32, 32), 40000, dtype=np.uint16)) if mode == "I;16" \
            else source.convert("I")
    fmt = "TIFF" if mode in ("CMYK", "I;16", "I", "YCbCr") else "PNG"
    image = decode_image(_encode(source, fmt))
    assert image.mode == "RGB"
    assert image.size == (32, 32)


def test_sixteen_bit_is_scaled_not_clipped() -> None:
    source = Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16))
    pixel = decode_image(_encode(source, "PNG")).getpixel((0, 0))
    assert 120 <= pixel[0] <= 135  # half of 65535 maps to about half of 255


def test_transparency_is_composited_on_white() -> None:
    source = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    assert decode_image(_encode(source, "PNG")).getpixel((0, 0)) == (255, 255, 255)


def test_exif_orientation_is_applied() -> None:
    source = Image.new("RGB", (40, 20), (200, 10, 10))
    exif = source.getexif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    image = decode_image(_encode(source, "JPEG", exif=exif.tobytes()))
    assert image.size == (20, 40)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"hello, I am text, not a picture\n" * 10, "not a recognised image"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "corrupt|not a recognised"),
    ],
)
def test_bad_bytes_raise_one_typed_error(data: bytes, message: str) -> None:
    with pytest.raises(ImageDecodeError, match=message):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file_is_refused(fmt: str) -> None:
    data = image_bytes(class_image(3, 0, size=64), fmt)
    with pytest.raises(ImageDecodeError):
        decode_image(data[: len(data) // 2])


def test_decompression_bomb_refused_before_decoding() -> None:
    with pytest.raises(ImageTooLarge, match="over the limit"):
        decode_image(png_header_only(100_000, 100_000), max_pixels=10_000_000)


def test_pixel_limit_is_per_call() -> None:
    data = image_bytes(class_image(0, 0, size=64))
    assert decode_image(data, max_pixels=64 * 64).size == (64, 64)
    with pytest.raises(ImageTooLarge):
        decode_image(data, max_pixels=64 * 64 - 1)


def test_load_image_file_names_the_file(tmp_path) -> None:
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"nope")
    with pytest.raises(ImageDecodeError, match="broken.jpg"):
        load_image_file(bad)
    with pytest.raises(ImageDecodeError, match="missing.jpg"):
        load_image_file(tmp_path / "missing.jpg")
