"""Retention: after a successful backup, the oldest complete backups in its folder are removed
(``IMGRET_BACKUP_KEEP``, ``IMGRET_BACKUP_MAX_BYTES``; never the new one, only complete imgret
backups).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

from imgret.gallery.backup.files import tree_bytes
from imgret.gallery.backup.layout import BACKUP_FILE, FORMAT

logger = logging.getLogger(__name__)


def prune_backups(folder: str | Path, *, keep: int, max_bytes: int | None,
                  protect: str | Path) -> list[Path]:
    """Remove the oldest complete backups in ``folder`` until at most ``keep`` remain and
    they take at most ``max_bytes`` (``None``: no byte limit), never ``protect`` (the backup
    just written, even when it alone is over ``max_bytes``).

    Only folders holding an imgret ``backup.json`` count and are ever removed (partial
    backups, other files and folders are left alone); age is the time their ``backup.json``
    was written.

    Returns:
        The backups removed, oldest first.
    """
    folder, protect = Path(folder).absolute(), Path(protect).absolute()
    backups = sorted(_complete_backups(folder), key=lambda b: (b[1], b[0].name))
    sizes = {path: tree_bytes(path) for path, _ in backups}
    total, count = sum(sizes.values()), len(backups)
    removed = []
    for path, _ in backups:
        if count <= keep and (max_bytes is None or total <= max_bytes):
            break
        if path == protect:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            total -= sizes[path]
            count -= 1
    if max_bytes is not None and total > max_bytes:
        logger.warning("the backups in %s take %.1f MB, over IMGRET_BACKUP_MAX_BYTES (%.1f MB), "
                       "with only the newest one left", folder, total / 1e6, max_bytes / 1e6)
    for path in removed:
        logger.info("removed the old backup %s (retention)", path)
    return removed


def _complete_backups(folder: Path) -> Iterator[tuple[Path, int]]:
    """``(folder, mtime_ns of its backup.json)`` of every complete imgret backup in ``folder``."""
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        manifest = path / BACKUP_FILE
        if path.name.startswith(".") or path.is_symlink() or not manifest.is_file():
            continue
        try:
            if json.loads(manifest.read_text()).get("format") != FORMAT:
                continue
            yield path, manifest.stat().st_mtime_ns
        except (OSError, ValueError, AttributeError):
            continue
