"""Files of a backup: copied while hashed, made durable in one call, and measured."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
from pathlib import Path

from imgret.files import fsync_dir

_CHUNK = 1 << 20


def copy_hashing(source: Path, target: Path, made: set[Path]) -> tuple[str, int]:
    """Copy a file, returning the SHA-256 and size of what was copied. Not yet durable: the
    caller calls :func:`make_durable` once for all of them. ``made``: folders known to exist
    (the media fan-out would otherwise cost a few system calls per file)."""
    if target.parent not in made:
        target.parent.mkdir(parents=True, exist_ok=True)
        made.add(target.parent)
    digest, size = hashlib.sha256(), 0
    with open(source, "rb") as reader, open(target, "wb") as writer:
        while block := reader.read(_CHUNK):
            digest.update(block)
            writer.write(block)
            size += len(block)
    return digest.hexdigest(), size


def make_durable(root: Path) -> None:
    """Flush every file and folder written under ``root`` to disk: one ``syncfs`` of its file
    system on Linux (thousands of small files: one call instead of an fsync each), else an
    fsync of each file and folder."""
    fd = os.open(root, os.O_RDONLY)
    try:
        if _syncfs(fd):
            return
    finally:
        os.close(fd)
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(root)


def _syncfs(fd: int) -> bool:
    """``syncfs(fd)``; False where the C library has none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return False
    if call(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"syncfs failed: {os.strerror(code)}")
    return True


def fsync_file(path: Path) -> None:
    """Flush one file to disk (a database file before it is renamed into place)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(root: Path) -> int:
    """The bytes of the regular files under ``root`` (0 when it does not exist)."""
    total = 0
    stack = [root]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except (FileNotFoundError, NotADirectoryError):
            continue
        with entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat(follow_symlinks=False).st_size
    return total
