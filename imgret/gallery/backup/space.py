"""Free space before a backup: its estimated size, and the refusal of a backup that would
leave less than ``IMGRET_BACKUP_FREE_MARGIN_BYTES`` free on its volume (nothing is written).
Removing old backups afterwards: :mod:`imgret.gallery.backup.retention`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from imgret.gallery.backup.errors import BackupNoSpace
from imgret.gallery.backup.files import tree_bytes
from imgret.gallery.backup.layout import INDEXES_DIR, MEDIA_DIR, MODELS_DIR


def estimate_backup_bytes(engine: Engine, url: str, data_dir: Path) -> int:
    """What a backup of this gallery will take, from what it copies: the database (counted
    twice: the snapshot, and the copy its ``VACUUM`` writes), the media files, checkpoints
    and indexes under the data dir. An upper bound for media (files no row refers to are
    counted too), a close one for the rest."""
    if engine.dialect.name == "sqlite":
        database = Path(make_url(url).database or "")
        db_bytes = sum(_size_or_zero(Path(f"{database}{suffix}")) for suffix in ("", "-wal"))
    else:
        with engine.connect() as connection:
            db_bytes = int(connection.execute(
                text("SELECT pg_database_size(current_database())")).scalar_one())
    files = sum(tree_bytes(data_dir / folder) for folder in (MEDIA_DIR, MODELS_DIR, INDEXES_DIR))
    return 2 * db_bytes + files


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def check_free_space(folder: Path, needed: int, *, margin: int) -> None:
    """Refuse a backup that would leave less than ``margin`` bytes free where it is written.

    Raises:
        BackupNoSpace: ``needed + margin`` bytes are not free; the message gives the sizes
            (never a path: an API client reads it).
    """
    free = shutil.disk_usage(folder).free
    if needed + margin > free:
        raise BackupNoSpace(
            f"not enough free space for a backup: it needs about {needed / 1e6:.1f} MB and "
            f"{margin / 1e6:.1f} MB must stay free (IMGRET_BACKUP_FREE_MARGIN_BYTES), but "
            f"{free / 1e6:.1f} MB are free; remove old backups (IMGRET_BACKUP_KEEP, "
            "IMGRET_BACKUP_MAX_BYTES) or free space on the volume"
        )
