"""Content-addressed media store: image files named by their SHA-256, written atomically.

Layout: ``<root>/<h[0:2]>/<h[2:4]>/<h>`` (two fan-out levels keep folders small at millions
of files). A file is written to a temporary name in its final folder, flushed to disk and
renamed, so a reader (or a crash) never sees half a file; storing bytes that are already
there is a no-op, so duplicates are stored once. Files carry no extension: the content type
lives in the database row (``gallery_items.content_type``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# Magic numbers of the formats Pillow decodes for us; used only to label the stored file.
_SIGNATURES: tuple[tuple[bytes, int, str], ...] = (
    (b"\xff\xd8\xff", 0, "image/jpeg"),
    (b"\x89PNG\r\n\x1a\n", 0, "image/png"),
    (b"GIF87a", 0, "image/gif"),
    (b"GIF89a", 0, "image/gif"),
    (b"BM", 0, "image/bmp"),
    (b"II*\x00", 0, "image/tiff"),
    (b"MM\x00*", 0, "image/tiff"),
)


def sha256_hex(data: bytes) -> str:
    """The lower-case hex SHA-256 of ``data`` (the media key)."""
    return hashlib.sha256(data).hexdigest()


def sniff_content_type(data: bytes) -> str:
    """The MIME type of image bytes from their magic number (no decoding).

    Returns ``application/octet-stream`` for anything unrecognised; callers decode with
    ``imgret.images.decode_image`` first, so that only happens for rare formats.
    """
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for magic, offset, mime in _SIGNATURES:
        if data[offset : offset + len(magic)] == magic:
            return mime
    return "application/octet-stream"


class MediaStore:
    """Image bytes on disk, keyed by content hash.

    Args:
        root: the folder holding the files (``<data_dir>/media`` by default).
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @classmethod
    def in_data_dir(cls, data_dir: str | Path) -> MediaStore:
        """The store of a data directory: ``<data_dir>/media``."""
        return cls(Path(data_dir) / "media")

    @staticmethod
    def relative_path(sha256: str) -> str:
        """``ab/cd/abcd...``: the path of a key relative to the root (stored in SQL)."""
        if not _SHA256.match(sha256):
            raise ValueError(f"not a SHA-256 hex digest: {sha256!r}")
        return f"{sha256[:2]}/{sha256[2:4]}/{sha256}"

    def path(self, sha256: str) -> Path:
        """The absolute file path of a key (whether or not it exists)."""
        return self.root / self.relative_path(sha256)

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def put(self, data: bytes, sha256: str | None = None) -> str:
        """Store ``data`` once and return its relative path.

        Args:
            data: the image file bytes.
            sha256: their hash when the caller already computed it (checked cheaply by
                length only; a wrong value would mis-file the bytes, so pass it only from
                :func:`sha256_hex`).

        Returns:
            The path relative to ``root`` (``ab/cd/<sha256>``).
        """
        key = sha256 or sha256_hex(data)
        target = self.path(key)
        if target.is_file() and target.stat().st_size == len(data):
            return self.relative_path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)  # atomic on POSIX: readers see the old or the new file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.relative_path(key)

    def read(self, relative_path: str) -> bytes:
        """The bytes at a relative path from :meth:`put` (as stored in the database)."""
        return self.resolve(relative_path).read_bytes()

    def resolve(self, relative_path: str) -> Path:
        """The absolute path of a stored relative path; refuses paths leaving the root."""
        path = (self.root / relative_path).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"media path {relative_path!r} is outside the store")
        return path
