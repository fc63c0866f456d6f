"""Crash-safe files: the one atomic writer (checkpoints, training records, index, manifest,
media) and its clean-up.

A file is written to a uniquely named temporary file in its final folder
(:func:`create_temp`: two threads or processes never share one), flushed and fsync'd, renamed
over the target, and the folder is fsync'd so that the rename itself survives a power cut. A
reader, or a crash, sees the old file or the new one, never half of one. A SIGKILL between
creating the temporary file and the rename leaves it behind, named after the writer's process
id: :func:`remove_stale_temps` deletes those whose process is gone (or that are old) at
start-up.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"
# A temporary file older than this belongs to a writer that died (writes take milliseconds).
STALE_TEMP_AGE_S = 600.0


def write_atomic(path: str | Path, data: bytes | Iterable[bytes]) -> None:
    """Write ``data`` (bytes, or chunks of bytes) to ``path`` atomically and durably."""
    chunks = [data] if isinstance(data, bytes | bytearray | memoryview) else data

    def write(handle: BinaryIO) -> None:
        for chunk in chunks:
            handle.write(chunk)

    write_atomic_with(path, write)


def write_atomic_with(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Like :func:`write_atomic`, for a writer that wants a file (``torch.save(obj, f)``)."""
    path = Path(path)
    fd, tmp = create_temp(os.fspath(path.parent), path.name)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


_TEMP_NUMBERS = itertools.count()


def create_temp(folder: str, name: str) -> tuple[int, str]:
    """Create a new temporary file ``<folder>/.tmp-<pid>-<name>.<n>``, open for writing with
    mode 0600 (as ``mkstemp`` makes them), and return its descriptor and path. The folder and
    its parents are made when missing.

    ``n`` counts per process (a name already taken, by a process of an earlier boot with the
    same pid, is skipped), so no two threads or processes ever get the same file, and the pid
    lets :func:`remove_stale_temps` tell a dead writer's file. ``mkstemp`` drew eight random
    letters in Python for every name, and the callers ran an ``mkdir`` per file to be sure
    of the folder; here the folder is made only when the ``open`` says it is missing.
    """
    prefix = os.path.join(folder, f"{TEMP_PREFIX}{os.getpid()}-{name}.")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    made = False
    for _ in range(10_000):  # mkstemp's TMP_MAX
        path = f"{prefix}{next(_TEMP_NUMBERS)}"
        try:
            return os.open(path, flags, 0o600), path
        except FileExistsError:
            continue
        except FileNotFoundError:
            if made:
                raise
            os.makedirs(folder, exist_ok=True)
            made = True
    raise FileExistsError(errno.EEXIST, f"no free temporary file name in {folder}")


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or unlink in ``folder`` durable (a no-op where directories can't sync)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_file(path: str | os.PathLike[str]) -> bytes:
    """A file's bytes, like ``Path.read_bytes`` at less than half its cost.

    One ``open``, ``fstat`` and two ``read`` system calls, without ``io``'s buffered file
    object, a cost a bulk ingest pays twice per image (hashed by the ingest, read again by the
    worker that decodes it). Reads until end of file, so a file that grew since ``fstat`` is
    read whole. Raises ``OSError`` as ``open`` would (missing, a directory, no permission).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        want = os.fstat(fd).st_size + 1  # +1: the short read that says end of file
        parts = []
        while part := os.read(fd, want):
            parts.append(part)
            want = 1 << 20
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """The hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def remove_stale_temps(root: str | Path, *, older_than_s: float = STALE_TEMP_AGE_S) -> int:
    """Delete temporary files that writers killed mid-write left under ``root``.

    A temporary file goes when the process named in it no longer runs on this machine, or
    when it is older than ``older_than_s`` (a data dir shared by several machines).

    Returns:
        How many were removed.
    """
    root = Path(root)
    if not root.is_dir():
        return 0
    cutoff = time.time() - older_than_s
    removed = 0
    for path in root.rglob(f"{TEMP_PREFIX}*"):
        try:
            if path.is_file() and (not _writer_alive(path.name)
                                   or path.stat().st_mtime < cutoff):
                path.unlink()
                removed += 1
        except OSError as exc:  # another process removed it first, or no permission
            logger.debug("could not remove %s: %s", path, exc)
    if removed:
        logger.info("removed %d temporary files left by interrupted writes under %s", removed,
                    root)
    return removed


def _writer_alive(name: str) -> bool:
    """Whether the process that named this temporary file still runs (``.tmp-<pid>-...``)."""
    pid_text = name[len(TEMP_PREFIX):].split("-", 1)[0]
    if not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return True  # ours: a write of this process is in flight
    return process_exists(pid)


def process_exists(pid: int) -> bool:
    """Whether a process with this pid runs (a pid reused since counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True
