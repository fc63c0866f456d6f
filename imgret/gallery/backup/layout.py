"""The backup format: the names in a backup folder, ``backup.json`` (its ``snapshot`` part is
:class:`BackupReport`) with the checksum of its file list, and where ``POST /admin/backup``
writes (a client names a backup, never a path).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from imgret.files import write_atomic
from imgret.gallery.backup.errors import BackupError
from imgret.gallery.storage.db import safe_url
from imgret.settings import Settings

FORMAT = "imgret-backup-v1"
BACKUP_FILE = "backup.json"
DATABASE_FILE = "database.sqlite"
MEDIA_DIR = "media"
MODELS_DIR = "models"
INDEXES_DIR = "indexes"
# Where POST /admin/backup writes (a client names a backup, never a path).
ADMIN_BACKUPS_DIR = "backups"
BACKUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

# Told the name of each step as a backup or a restore passes it (progress for the CLI).
Phase = Callable[[str], None]


@dataclass(frozen=True)
class BackupReport:
    """What a backup holds (also the ``snapshot`` part of ``backup.json``)."""

    path: str
    database: str
    alembic_revision: str
    change_seq: int
    gallery_items: int
    query_items: int
    media_files: int
    model_versions: list[str]
    active_version: str | None
    indexes: list[str]
    bytes: int
    write_pause_ms: float
    seconds: float


def files_checksum(files: dict[str, dict[str, Any]]) -> str:
    """The SHA-256 of a backup's file list (``backup.json``'s ``files``): an edited or
    damaged list no longer matches the one recorded beside it."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_backup_json(temp: Path, report: BackupReport, files: dict[str, dict[str, Any]], *,
                      source_url: str) -> None:
    """Write ``backup.json`` into the backup folder ``temp``: the format, the source (database
    kind, URL without password, Alembic revision), ``report`` as the snapshot, and every
    other file's SHA-256 and size with the checksum of that list."""
    snapshot = asdict(report)
    for key in ("path", "database", "alembic_revision", "seconds"):
        snapshot.pop(key)
    document = {
        "format": FORMAT,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": {"database": report.database, "url": safe_url(source_url),
                   "alembic_revision": report.alembic_revision},
        "snapshot": snapshot,
        "files": files,
        "files_sha256": files_checksum(files),
    }
    write_atomic(temp / BACKUP_FILE, json.dumps(document, indent=2, sort_keys=True).encode())


def admin_backup_path(settings: Settings, name: str | None) -> Path:
    """Where ``POST /admin/backup`` writes backup ``name``: ``<data_dir>/backups/<name>``.

    A client chooses a name, never a path, so it cannot make the server write elsewhere.

    Raises:
        BackupError: a name that is not 1-100 letters, digits, ``.``, ``_`` or ``-`` (not
            starting with a dot or dash).
    """
    if name is None:
        name = "imgret-" + datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    if not BACKUP_NAME.match(name):
        raise BackupError(
            f"backup name {name[:120]!r} refused: use 1-100 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return Path(settings.data_dir).absolute() / ADMIN_BACKUPS_DIR / name
