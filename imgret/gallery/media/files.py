"""Content-addressed media store: image files named by their SHA-256, written atomically.

Layout: ``<root>/<h[0:2]>/<h[2:4]>/<h>`` (two fan-out levels keep folders small at millions
of files). Files are written with ``imgret.files.write_atomic`` (temporary name, fsync,
rename), so a reader (or a crash) never sees half a file; storing bytes that are already
there is a no-op, so duplicates are stored once. :meth:`MediaStore.put_many` does the same
for a batch (an ingest chunk) with the syncs done once per batch instead of twice per file:
every temporary file is written, all of them are made durable, renamed, and the renames made
durable, before it returns. Deleting the last row that refers to a file
removes the file (``imgret.gallery.media.gc``): a deleted face must not stay on disk. Files carry no
extension: the content type lives in the database row (``gallery_items.content_type``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from imgret.files import (
    create_temp,
    file_sha256,
    fsync_dir,
    read_file,
    remove_stale_temps,
    write_atomic,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# put_many: fewer new files than this are written one by one (write_atomic); from this many on,
# the batch's syncs are shared (measured on ext4: 2 fsyncs per file ~500 us, shared ~100 us).
BATCH_MIN = 8
# Threads issuing the fsyncs of a batch where syncfs is not used (the journal commits them
# together).
_SYNC_THREADS = 8

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


class MediaBackend(Protocol):
    """What the gallery needs from a media store, whichever holds the bytes: the files of
    :class:`MediaStore` or the database rows of ``imgret.gallery.media.blobs.DatabaseMediaStore``
    (built for the settings in force by ``imgret.gallery.media.blobs.open_media_store``).

    Writes and removals take the session of the caller's transaction, always under the gallery
    write lock: the database store writes in it (the bytes commit or roll back with the rows
    that point to them); the file store ignores it (its files are durable before the rows
    commit, and a crash's leftovers are swept at start-up).
    """

    backend: ClassVar[str]
    # Whether ingest's workers may write new bytes ahead of the write transaction
    # (:meth:`MediaStore.stage`): only files can be made durable later in one batch.
    stages_files: ClassVar[bool]

    @staticmethod
    def relative_path(sha256: str) -> str: ...

    def exists(self, sha256: str) -> bool: ...

    def put_many(self, items: Sequence[tuple[bytes, str]], *, session: Session,
                 staged: Mapping[str, str] | None = None) -> list[str]: ...

    def read(self, relative_path: str) -> bytes:
        """The bytes of a stored relative path; ``FileNotFoundError`` when they are gone."""
        ...

    def read_many(self, relative_paths: Sequence[str]) -> list[bytes | None]:
        """The bytes of several stored paths, in order; ``None`` for those that are gone
        (bulk readers: re-embedding, evaluation; the database store reads them in a few
        queries instead of one per image)."""
        ...

    def remove(self, sha256s: Iterable[str], *, session: Session) -> int: ...

    def stored_keys(self) -> Iterator[str]: ...

    def sweep_temporaries(self) -> int:
        """Remove what killed writes left behind; returns how many things went."""
        ...


class MediaStore:
    """Image bytes on disk, keyed by content hash.

    Args:
        root: the folder holding the files (``<data_dir>/media`` by default).
    """

    backend: ClassVar[str] = "files"
    stages_files: ClassVar[bool] = True

    def __init__(self, root: str | Path):
        self.root = Path(root)
        # The hot paths (put_many, stage) build plain strings: pathlib's joins, parents and
        # hashes were ~60 % of put_many's CPU time for a chunk of new files.
        self._root = os.fspath(self.root)

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
        return Path(self._file(sha256))

    def _file(self, sha256: str) -> str:
        """:meth:`path` as a string."""
        return f"{self._root}/{self.relative_path(sha256)}"

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def put(self, data: bytes, sha256: str | None = None) -> str:
        """Store ``data`` once and return its relative path.

        A file already under the key is reused only when its bytes hash to the key: a file
        truncated or corrupted on disk (a crash on a file system without data journaling, a
        stray edit) is replaced rather than trusted for its size.

        Gallery writers call this while holding the gallery write lock
        (``imgret.gallery.storage.item_store.lock_gallery_writes``), so that a concurrent delete's
        clean-up can never remove bytes a new row is about to point to.

        Args:
            data: the image file bytes.
            sha256: their hash when the caller already computed it with :func:`sha256_hex`.

        Returns:
            The path relative to ``root`` (``ab/cd/<sha256>``).
        """
        key = sha256 or sha256_hex(data)
        if not self._holds(key, len(data)):
            write_atomic(self.path(key), data)
        return self.relative_path(key)

    def put_many(
        self, items: Sequence[tuple[bytes, str]], *, session: Session | None = None,
        staged: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Store several files; every one is durable when this returns (like :meth:`put`).

        The guarantees are :meth:`put`'s, file by file: a file already under its key is kept
        only when its bytes hash to the key; a new one appears under its final name whole or
        not at all. Only the syncs are shared: all temporary files are written (in their final
        folders, named like ``write_atomic``'s, so a killed batch's leftovers are swept the
        same way), then made durable together, renamed, and the renames (and any new fan-out
        folders) made durable together. On Linux 5.8+ each "together" is one ``syncfs`` of
        the store's file system (which reports writeback errors since then); elsewhere the
        files' and folders' fsyncs run on a few threads. Fewer than ``BATCH_MIN`` new files
        (and none staged) are written one by one with ``write_atomic``.

        Call under the gallery write lock, like :meth:`put`.

        Args:
            items: ``(data, sha256)`` pairs (``sha256_hex(data)``, computed by the caller);
                a key may repeat.
            staged: sha256 -> a temporary file from :meth:`stage` holding those bytes: it is
                synced and renamed instead of writing the bytes again (or removed, when the
                store holds the key already).
            session: the caller's transaction (:class:`MediaBackend`); files do not use it.

        Returns:
            The relative paths, in the order of ``items``.
        """
        staged = staged or {}
        paths: list[str] = []
        todo: dict[str, bytes] = {}
        seen: set[str] = set()
        for data, key in items:
            paths.append(self.relative_path(key))
            if key in seen:
                continue
            seen.add(key)
            if not self._holds(key, len(data)):
                todo[key] = data
            elif key in staged:
                Path(staged[key]).unlink(missing_ok=True)
        if len(todo) < BATCH_MIN and not staged.keys() & todo.keys():
            for key, data in todo.items():
                write_atomic(self.path(key), data)
        elif todo:
            self._write_batch(todo, staged)
        return paths

    def stage(self, data: bytes, sha256: str) -> str:
        """Write bytes to a temporary file in their key's folder, for :meth:`put_many`.

        Nothing is synced and nothing is visible as media yet (the name is a temporary one:
        ``stored_keys`` skips it, ``imgret.files.remove_stale_temps`` removes it once this
        process is gone), so this may run without the gallery write lock: ingest's decode
        workers stage a chunk's new files while the chunk before it is written.

        Returns:
            The temporary file's path.
        """
        folder, _ = os.path.split(self._file(sha256))
        fd, tmp = create_temp(folder, sha256)
        try:
            _write_all(fd, data)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def _holds(self, key: str, size: int) -> bool:
        """Whether the file of ``key`` exists and holds exactly the bytes of that key."""
        target = self._file(key)
        try:
            if os.stat(target).st_size != size:
                return False
        except OSError:
            return False  # absent (the usual case), or not reachable: write it
        try:
            if file_sha256(target) == key:
                return True
        except OSError:
            pass  # unreadable: write it again
        logger.warning("media file %s does not hold its bytes; writing it again", target)
        return False

    def _write_batch(self, todo: dict[str, bytes], staged: Mapping[str, str]) -> None:
        os.makedirs(self._root, exist_ok=True)
        # Opened before anything is written here: syncfs reports the writeback errors that
        # happened on the file system since, and those no one has seen before (a staged
        # file's included).
        anchor = os.open(self._root, os.O_RDONLY)
        temps: list[tuple[str, str]] = []
        try:
            folders: set[str] = set()  # the ab/cd folders written to; any of them may be new
            for key, data in todo.items():
                target = self._file(key)
                folder, _ = os.path.split(target)
                folders.add(folder)
                tmp = staged.get(key)
                if tmp is not None and _size(tmp) == len(data):
                    temps.append((tmp, target))
                    continue
                fd, tmp = create_temp(folder, key)
                temps.append((tmp, target))
                try:
                    _write_all(fd, data)
                finally:
                    os.close(fd)
            use_syncfs = _syncfs_reports_errors()
            # 1. the bytes, before any of them gets its final name
            if use_syncfs:
                _syncfs(anchor)
            else:
                _fsync_all([tmp for tmp, _ in temps])
            for tmp, target in temps:
                os.replace(tmp, target)
            temps = []
            # 2. the names: every renamed file's folder and, as any of those may be new, the
            # folders above it (a folder that did not change syncs at little cost)
            if use_syncfs:
                _syncfs(anchor)
            else:
                parents = {os.path.dirname(folder) for folder in folders}
                _fsync_all(sorted(folders | parents | {self._root}))
        finally:
            os.close(anchor)
            for tmp, _ in temps:  # a failed batch leaves no temporary file
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def remove(self, sha256s: Iterable[str], *, session: Session | None = None) -> int:
        """Delete the files of these keys (missing ones are skipped); returns how many went.

        Call only with keys that no row refers to, under the gallery write lock
        (``imgret.gallery.storage.item_store.unreferenced_media``); ``session`` (that lock's
        transaction) is not used by files.
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

    def sweep_temporaries(self) -> int:
        """Remove the temporary files of writes that were killed (``write_atomic``, ``stage``)."""
        return remove_stale_temps(self.root)

    def read(self, relative_path: str) -> bytes:
        """The bytes at a relative path from :meth:`put` (as stored in the database)."""
        return read_file(self.resolve(relative_path))

    def read_many(self, relative_paths: Sequence[str]) -> list[bytes | None]:
        """:meth:`read` of each path, ``None`` where the file is gone."""
        out: list[bytes | None] = []
        for relative_path in relative_paths:
            try:
                out.append(self.read(relative_path))
            except FileNotFoundError:
                out.append(None)
        return out

    def resolve(self, relative_path: str) -> Path:
        """The absolute path of a stored relative path; refuses paths leaving the root."""
        path = (self.root / relative_path).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"media path {relative_path!r} is outside the store")
        return path


# --------------------------------------------------------------------------- batch syncs


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_all(paths: Sequence[str | Path]) -> None:
    """fsync files and folders, several at a time (the journal commits them together)."""
    def sync(path: str | Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=min(_SYNC_THREADS, max(1, len(paths)))) as pool:
        list(pool.map(sync, paths))  # re-raises the first OSError


_SYNCFS: list = []  # [libc.syncfs or None], resolved once


def _syncfs_reports_errors() -> bool:
    """Whether ``syncfs(2)`` is there and reports writeback errors (Linux 5.8 and later)."""
    if not _SYNCFS:
        function = None
        if sys.platform.startswith("linux") and _kernel_at_least(5, 8):
            try:
                function = ctypes.CDLL(None, use_errno=True).syncfs
                function.argtypes = [ctypes.c_int]
                function.restype = ctypes.c_int
            except (OSError, AttributeError):
                function = None
        _SYNCFS.append(function)
    return _SYNCFS[0] is not None


def _kernel_at_least(major: int, minor: int) -> bool:
    match = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return bool(match) and (int(match[1]), int(match[2])) >= (major, minor)


def _syncfs(fd: int) -> None:
    if _SYNCFS[0](fd) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"syncfs of the media store failed: {os.strerror(errno)}")
