"""Content-addressed media store: image files named by their SHA-256, written atomically.

Layout: ``<root>/<h[0:2]>/<h[2:4]>/<h>`` (two fan-out levels keep folders small at millions
of files). Files are written with ``imgret.files.write_atomic`` (temporary name, fsync,
rename), so a reader (or a crash) never sees half a file; storing bytes that are already
there is a no-op, so duplicates are stored once. Deleting the last row that refers to a file
removes the file (``index.gc``): a deleted face must not stay on disk. Files carry no
extension: the content type lives in the database row (``gallery_items.content_type``).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from imgret.files import file_sha256, fsync_dir, write_atomic

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

        A file already under the key is reused only when its bytes hash to the key: a file
        truncated or corrupted on disk (a crash on a file system without data journaling, a
        stray edit) is replaced rather than trusted for its size.

        Gallery writers call this while holding the gallery write lock
        (``index.store.lock_gallery_writes``), so that a concurrent delete's clean-up can
        never remove bytes a new row is about to point to.

        Args:
            data: the image file bytes.
            sha256: their hash when the caller already computed it with :func:`sha256_hex`.

        Returns:
            The path relative to ``root`` (``ab/cd/<sha256>``).
        """
        key = sha256 or sha256_hex(data)
        target = self.path(key)
        if target.is_file() and target.stat().st_size == len(data):
            try:
                if file_sha256(target) == key:
                    return self.relative_path(key)
            except OSError:
                pass  # unreadable: write it again
            logger.warning("media file %s does not hold its bytes; writing it again", target)
        write_atomic(target, data)
        return self.relative_path(key)

    def remove(self, sha256s: Iterable[str]) -> int:
        """Delete the files of these keys (missing ones are skipped); returns how many went.

        Call only with keys that no row refers to, under the gallery write lock
        (``index.store.unreferenced_media``).
        """
        removed, folders = 0, set()
        for key in sha256s:
            target = self.path(key)
            try:
                target.unlink()
            except FileNotFoundError:
                continue
            removed += 1
            folders.add(target.parent)
        for folder in folders:
            fsync_dir(folder)  # the unlink itself must survive a power cut
        return removed

    def stored_keys(self) -> Iterator[str]:
        """The content hashes of every file in the store (temporary files excluded)."""
        if not self.root.is_dir():
            return
        for path in self.root.glob("??/??/*"):
            if _SHA256.match(path.name) and path.is_file():
                yield path.name

    def read(self, relative_path: str) -> bytes:
        """The bytes at a relative path from :meth:`put` (as stored in the database)."""
        return self.resolve(relative_path).read_bytes()

    def resolve(self, relative_path: str) -> Path:
        """The absolute path of a stored relative path; refuses paths leaving the root."""
        path = (self.root / relative_path).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"media path {relative_path!r} is outside the store")
        return path
