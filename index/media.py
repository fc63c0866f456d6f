"""Content-addressed media store: image files named by their SHA-256, written atomically.

Layout: ``<root>/<h[0:2]>/<h[2:4]>/<h>`` (two fan-out levels keep folders small at millions
of files). Files are written with ``imgret.files.write_atomic`` (temporary name, fsync,
rename), so a reader (or a crash) never sees half a file; storing bytes that are already
there is a no-op, so duplicates are stored once. :meth:`MediaStore.put_many` stores a batch
the same way, durable when it returns, with the file creations and fsyncs spread over a few
threads and each changed folder fsync'd once. :class:`MediaPrefetcher` stores files ahead of
the transaction that will point to them, in a child process (bulk ingest). Deleting the last
row that refers to a file removes the file (``index.gc``): a deleted face must not stay on
disk. Files carry no extension: the content type lives in the database row
(``gallery_items.content_type``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from imgret.files import TEMP_PREFIX, file_sha256, fsync_dir, remove_stale_temps, write_atomic

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Threads writing one batch (put_many). Creating a file and fsyncing it are system calls that
# release the GIL; concurrent fsyncs share the file system's journal commits, so a batch
# costs a few commits rather than one or two per file.
_WRITE_THREADS = 8
# Batches this large are made durable with syncfs (two journal commits) where it is reliable.
_SYNCFS_MIN_FILES = 8

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


@functools.cache
def _syncfs() -> Callable[[int], None] | None:
    """``syncfs(fd)`` raising ``OSError`` on failure, on Linux 5.8+ (before 5.8 it did not
    report write-back errors, so a failed write could pass for a durable one); else ``None``.
    """
    if sys.platform != "linux":
        return None
    try:
        version = tuple(int(part) for part in
                        re.match(r"(\d+)\.(\d+)", platform.release()).groups())
        call = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError, TypeError, ValueError):
        return None
    if version < (5, 8):
        return None
    call.argtypes = [ctypes.c_int]

    def syncfs(fd: int) -> None:
        if call(fd) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"syncfs: {os.strerror(errno)}")

    return syncfs


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
        if not self._holds(target, key, len(data)):
            write_atomic(target, data)
        return self.relative_path(key)

    def put_many(self, items: Sequence[tuple[bytes, str]], *,
                 staging: Path | None = None) -> list[str]:
        """Store several files, like :meth:`put` for each; all are durable when this returns.

        Every new file is written to a temporary name, made durable, then renamed into place
        (a reader or a crash sees all of a file or none of it), as :meth:`put` does, and the
        renames are made durable before this returns: a caller that commits rows pointing to
        these files afterwards never commits a row whose file a power cut could lose. What
        differs is the number of journal commits (each fsync of a new file or folder forces
        one, and waits for it):

        - Linux 5.8+ (``syncfs`` reports write-back errors): write every temporary file, one
          ``syncfs`` (their data), the renames, one ``syncfs`` (the renames and the new
          folders): two commits per batch. ``syncfs`` also flushes other writers' dirty data
          on that file system, so it is used for batches of ``_SYNCFS_MIN_FILES`` or more.
        - elsewhere: each file is written and fsync'd on one of ``_WRITE_THREADS`` threads
          (concurrent fsyncs share commits), then every folder whose entries changed is
          fsync'd once, after the last rename.

        Args:
            items: ``(data, sha256)`` pairs (``sha256`` from :func:`sha256_hex`); a key given
                twice is written once.
            staging: where the temporary files go (a folder on the same file system, outside
                ``root``: :class:`MediaPrefetcher`'s, so that no temporary file ever shows
                in the store); default: the file's own folder, as :meth:`put` does.

        Returns:
            The relative paths, in the order of ``items``.
        """
        todo: dict[str, bytes] = {}
        for data, key in items:
            if key not in todo and not self._holds(self.path(key), key, len(data)):
                todo[key] = data
        if len(todo) == 1 and staging is None:
            [(key, data)] = todo.items()
            write_atomic(self.path(key), data)
        elif todo:
            created_root = not self.root.is_dir()
            self.root.mkdir(parents=True, exist_ok=True)
            if len(todo) >= _SYNCFS_MIN_FILES and (syncfs := _syncfs()) is not None:
                self._put_syncfs(todo, staging, syncfs)
            else:
                self._put_fsync(todo, staging, {self.root.parent} if created_root else set())
        return [self.relative_path(key) for _, key in items]

    def _put_syncfs(self, todo: dict[str, bytes], staging: Path | None,
                    syncfs: Callable[[int], None]) -> None:
        # Opened first: syncfs reports the write-back errors seen since this open.
        root_fd = os.open(self.root, os.O_RDONLY)
        temps: list[tuple[str, Path]] = []

        def write(part: list[tuple[str, bytes]]) -> None:
            for key, data in part:
                target = self.path(key)
                self._make_folders(target)
                fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-{key}.",
                                           dir=staging or target.parent)
                temps.append((tmp, target))
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)

        try:
            # One thread: creating files in parallel did not go faster on the VM measured
            # (the kernel work serialises) and burned twice the CPU.
            write(list(todo.items()))
            syncfs(root_fd)  # every temporary file's data, before any rename
            while temps:
                tmp, target = temps[-1]
                os.replace(tmp, target)
                temps.pop()
            syncfs(root_fd)  # the renames and the new folders
        finally:
            os.close(root_fd)
            for tmp, _ in temps:
                Path(tmp).unlink(missing_ok=True)

    def _put_fsync(self, todo: dict[str, bytes], staging: Path | None,
                   changed: set[Path]) -> None:
        def write(item: tuple[str, bytes]) -> list[Path]:
            key, data = item
            target = self.path(key)
            folders = [target.parent, *self._make_folders(target)]
            fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-{key}.",
                                       dir=staging or target.parent)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            return folders

        with ThreadPoolExecutor(min(_WRITE_THREADS, len(todo)),
                                thread_name_prefix="media-write") as pool:
            for folders in pool.map(write, todo.items()):
                changed.update(folders)
            # Only now: every rename is done, so one fsync per folder covers them all.
            list(pool.map(fsync_dir, changed))

    @staticmethod
    def _make_folders(target: Path) -> list[Path]:
        """Create the two fan-out folders of ``target`` where missing; returns the folders
        that gained an entry (the parents of those created)."""
        changed = []
        for folder in (target.parent.parent, target.parent):
            try:
                folder.mkdir()
            except FileExistsError:
                continue
            changed.append(folder.parent)
        return changed

    def _holds(self, target: Path, key: str, size: int) -> bool:
        """Whether ``target`` exists with bytes that hash to ``key`` (then it is reused)."""
        try:
            info = target.stat()
        except OSError:
            return False
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return False
        try:
            if file_sha256(target) == key:
                return True
        except OSError:
            pass  # unreadable: write it again
        logger.warning("media file %s does not hold its bytes; writing it again", target)
        return False

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


class MediaPrefetcher:
    """Stores batches of files in a child process, ahead of the transaction that needs them.

    Bulk ingest (``index.ingest.ingest_source``) hands it the new files of one chunk and goes
    on computing the next chunk while the child writes them (:meth:`MediaStore.put_many`,
    durable when the child answers). The chunk's transaction then calls ``put_many`` itself,
    under the gallery write lock as always: it finds the files, checks that they hash to
    their keys, and writes whatever is missing (a file a concurrent clean-up removed
    meanwhile, a batch the child failed on). Correctness never rests on this class: it only
    moves the file writes off the thread that decodes and embeds. A prefetched file that no
    row ever points to (an interrupted ingest) is an orphan like any other, removed by
    ``index.gc.sweep_media``.

    The child's temporary files live in a staging folder beside the store
    (``.<root name>-staging``, when it is on the same file system), so none ever shows inside
    the store, even while the child finishes a batch after its parent was killed.

    Why a process and not a thread: every system call releases the GIL, so a writer thread
    has to win it back after each one while the embedding thread holds it (measured on the
    2-core development VM: a file creation took 0.7-0.9 ms alone and 6 ms beside a busy
    Python thread; a writer thread made the whole ingest slower than no overlap at all). A
    child has its own GIL; the parent makes two system calls per batch.

    The child starts with the first batch. One batch is in flight at a time: :meth:`submit`
    waits for the previous one first.

    Args:
        store: the store to write into (the child opens its own on the same root).
    """

    def __init__(self, store: MediaStore):
        self.store = store
        self._in_flight = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._failed = False

    def __enter__(self) -> MediaPrefetcher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def submit(self, items: Sequence[tuple[bytes, str]]) -> None:
        """Hand ``(data, sha256)`` pairs to the child (after the previous batch is done)."""
        self.wait()
        if not items or self._failed:
            return
        frames = [f"{len(items)}\n".encode()]
        for data, key in items:
            self.store.relative_path(key)  # a bad key fails here, not in the child
            frames += [f"{key} {len(data)}\n".encode(), data]
        try:
            process = self._process or self._start()
            process.stdin.write(b"".join(frames))
            process.stdin.flush()
        except OSError as exc:
            self._give_up(f"cannot reach it ({exc})")
            return
        self._in_flight += 1

    def wait(self) -> None:
        """Wait until the child has stored (or failed to store) the batch in flight."""
        while self._in_flight and self._process is not None:
            line = self._process.stdout.readline()
            self._in_flight -= 1
            if not line:
                self._give_up("it exited")
            elif line != b"ok\n":
                logger.warning("the media prefetch process failed on a batch (%s); the "
                               "transaction writes those files itself",
                               line.decode(errors="replace").strip())

    def close(self) -> None:
        """Stop the child (it finishes the batch in flight first)."""
        process, self._process = self._process, None
        self._in_flight = 0
        if process is None:
            return
        with contextlib.suppress(OSError):
            process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()

    def _start(self) -> subprocess.Popen[bytes]:
        staging = self.store.root.parent / f".{self.store.root.name}-staging"
        self.store.root.mkdir(parents=True, exist_ok=True)
        staging.mkdir(exist_ok=True)
        remove_stale_temps(staging)  # left by a child killed mid-batch
        if os.stat(staging).st_dev != os.stat(self.store.root).st_dev:
            staging = None  # renames must not cross file systems: temporaries in place
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH"))
                                            if p)
        self._process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from index.media import _serve_prefetch; "
             "_serve_prefetch(*sys.argv[1:])", str(self.store.root),
             *([str(staging)] if staging else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        return self._process

    def _give_up(self, why: str) -> None:
        logger.warning("the media prefetch process stopped (%s); the transactions write the "
                       "files from now on", why)
        self._failed = True
        self._in_flight = 0
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait()


def _serve_prefetch(root: str, staging: str | None = None) -> None:
    """The child of :class:`MediaPrefetcher`: batches in on stdin, one line out per batch."""
    store = MediaStore(root)
    folder = Path(staging) if staging else None
    source, reply = sys.stdin.buffer, sys.stdout.buffer
    while header := source.readline():
        items = []
        for _ in range(int(header)):
            key, size = source.readline().split()
            data = source.read(int(size))
            if len(data) != int(size):
                return  # the parent died mid-batch: write nothing of it
            items.append((data, key.decode()))
        try:
            store.put_many(items, staging=folder)
            reply.write(b"ok\n")
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which writes them
            reply.write(f"{type(exc).__name__}: {exc}".replace("\n", " ").encode() + b"\n")
        reply.flush()
