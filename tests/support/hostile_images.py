"""Hostile images for tests: ratio bombs, header-only bombs, EXIF that breaks Pillow."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image

# EXIF blobs found by mutating a valid one (orientation 6 + a few tags): Pillow reads them, but
# ImageOps.exif_transpose raises TypeError / struct.error when it writes the EXIF back, i.e.
# errors that are not OSError/ValueError and that a decoder catching only those lets through.
CRAFTED_EXIF = {
    "TypeError": "4578696600004d4d002a000000080003013e00020000000463616d00011200030000000100"
                 "06000087690004000000010000003200000000000190030002000000140000004400000000"
                 "323032303a30313a30312030303a30303a303000",
    "struct.error": "4578696600004d4d002a0000000800030117000200000004f9616d000112000300000001"
                    "0006000087690004000000010000003200000000000190030002000000140000004400"
                    "000000323032303a30313a30312030303a303054303000",
}


def crafted_exif_jpeg(kind: str) -> bytes:
    """A small valid JPEG whose EXIF makes Pillow raise ``kind`` (see ``CRAFTED_EXIF``)."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 12), (10, 200, 30)).save(
        buffer, "JPEG", exif=bytes.fromhex(CRAFTED_EXIF[kind])
    )
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width x height`` but holds no pixel data: decoding it fails, so
    an answer about its size proves that only the header was read."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body) & 0xFFFFFFFF
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) \
        + chunk(b"IEND", b"")


def ratio_bomb(width: int, height: int, mode: str = "RGB") -> bytes:
    """A real, fully decodable PNG of one flat colour: kilobytes that decode to megabytes."""
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, "PNG")
    return buffer.getvalue()
