"""Restore a verified backup into an empty data dir and an empty database, of either engine.

**Nothing half-done.** Restore verifies every checksum (and that the snapshot's media and
checkpoints are all there: :func:`imgret.gallery.backup.verify.verify_backup`) before writing
anything, restores only into an empty data dir and an empty database, writes the database last
(one transaction on PostgreSQL; a temporary file renamed on SQLite), then checks that each
index loads against the restored database (or rebuilds it) and that the active model version
loads.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Engine, create_engine, inspect, text
from sqlalchemy.engine import make_url

from imgret.files import fsync_dir
from imgret.gallery.backup.errors import BackupError
from imgret.gallery.backup.files import copy_hashing, fsync_file, make_durable
from imgret.gallery.backup.indexes import check_indexes
from imgret.gallery.backup.layout import DATABASE_FILE, INDEXES_DIR, MEDIA_DIR, MODELS_DIR, Phase
from imgret.gallery.backup.tables import (
    check_revision_known,
    copy_tables,
    migrate_to,
    set_pg_sequences,
)
from imgret.gallery.backup.verify import VerifiedBackup, snapshot_reader, verify_backup
from imgret.gallery.storage.db import (
    alembic_config,
    make_engine,
    make_sessionmaker,
    safe_url,
    upgrade_to_head,
)
from imgret.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreReport:
    """What a restore wrote, and how its indexes were checked."""

    database: str
    alembic_revision: str
    gallery_items: int
    media_files: int
    model_versions: list[str]
    active_version: str | None
    indexes: dict[str, str] = field(default_factory=dict)  # version -> "loaded" | "rebuilt"
    seconds: float = 0.0


def restore_backup(settings: Settings, src: str | Path, *, on_phase: Phase | None = None,
                   ) -> RestoreReport:
    """Restore a backup into the empty data dir and empty database of ``settings``.

    Args:
        settings: the target (``IMGRET_DATA_DIR``, ``IMGRET_DATABASE_URL``; either engine,
            whatever the backup's source was); ``IMGRET_DEVICE`` loads the active model.
        src: a backup folder.
        on_phase: called with ``"verified"``, ``"files"``, ``"database"``, ``"indexes"``,
            ``"done"``.

    Raises:
        BackupError: a partial or damaged backup (nothing written), a target that is not
            empty (nothing written), or a schema revision this imgret does not know.
    """
    start = time.perf_counter()
    phase = on_phase or (lambda _name: None)
    backup = verify_backup(src)
    data_dir = Path(settings.data_dir).expanduser().absolute()
    url = settings.db_url
    _check_empty_target(data_dir, url)
    check_revision_known(alembic_config(url), backup.revision)
    phase("verified")
    # The target is empty and the database is written last, so files need no atomic rename
    # each: one flush of them all before the database commits (media/ab/cd/<sha> is the
    # media store's own layout, checked by verify_backup).
    made: set[Path] = set()
    listed = backup.document["files"]
    for rel in backup.files(MEDIA_DIR) + backup.files(MODELS_DIR) + backup.files(INDEXES_DIR):
        digest, _ = copy_hashing(backup.path / rel, data_dir / rel, made)
        if digest != listed[rel]["sha256"]:
            raise BackupError(f"{backup.path / rel} changed while it was restored; restore "
                              "again into an empty data dir")
    make_durable(data_dir)
    phase("files")
    _restore_database(backup.path / DATABASE_FILE, url, backup.revision)
    upgrade_to_head(url)
    phase("database")
    engine = make_engine(url)
    try:
        sessions = make_sessionmaker(engine)
        indexes = check_indexes(backup, sessions, data_dir)
        phase("indexes")
        active = backup.snapshot.get("active_version")
        if active is not None and active in _stored_checkpoints(backup):
            from imgret.gallery.versions import intake

            intake.load_embedder(active, session_factory=sessions, data_dir=data_dir,
                                 device=settings.device)
        with sessions() as session:
            items = session.execute(text(
                "SELECT COUNT(*) FROM gallery_items WHERE deleted_at IS NULL")).scalar_one()
    finally:
        engine.dispose()
    report = RestoreReport(
        database=engine.dialect.name, alembic_revision=backup.revision,
        gallery_items=int(items), media_files=len(backup.files(MEDIA_DIR)),
        model_versions=list(backup.snapshot["model_versions"]), active_version=active,
        indexes=indexes, seconds=round(time.perf_counter() - start, 3),
    )
    phase("done")
    logger.info("restored %s (%d items, %d media files) into %s and %s in %.1f s", backup.path,
                report.gallery_items, report.media_files, safe_url(url), data_dir,
                report.seconds)
    return report


def _readonly_sqlite_engine(path: Path) -> Engine:
    uri = f"{path.as_uri()}?mode=ro&immutable=1"
    return create_engine("sqlite://", creator=lambda: sqlite3.connect(uri, uri=True))


def _check_empty_target(data_dir: Path, url: str) -> None:
    if data_dir.exists() and (not data_dir.is_dir() or any(data_dir.iterdir())):
        raise BackupError(
            f"{data_dir} is not empty: restore writes only into an empty data dir; set "
            "IMGRET_DATA_DIR to a new folder (or empty this one)"
        )
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = Path(parsed.database or "")
        if database.exists() and database.stat().st_size > 0:
            raise BackupError(
                f"{database} exists: restore writes only into a new database; set "
                "IMGRET_DATABASE_URL to a new file (or remove this one)"
            )
        return
    from sqlalchemy.exc import OperationalError

    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            tables = inspect(connection).get_table_names()
    except OperationalError as exc:
        first = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        raise BackupError(f"cannot use the database {safe_url(url)}: {first}; check "
                          "IMGRET_DATABASE_URL") from None
    finally:
        engine.dispose()
    if tables:
        raise BackupError(
            f"the database {safe_url(url)} has tables ({', '.join(sorted(tables)[:5])}): restore "
            "writes only into an empty database; create a new one (createdb NAME) and point "
            "IMGRET_DATABASE_URL at it"
        )


def _restore_database(snapshot: Path, url: str, revision: str) -> None:
    """Write the snapshot into the target database, all or nothing."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        target = Path(parsed.database or "").absolute()
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.with_name(f"{target.name}.restore-{os.getpid()}")
        with snapshot_reader(snapshot) as source:
            copy = sqlite3.connect(temp)
            try:
                source.backup(copy)
                copy.execute("PRAGMA journal_mode=DELETE")
                copy.commit()
            finally:
                copy.close()
        fsync_file(temp)
        os.replace(temp, target)
        fsync_dir(target.parent)
        return
    source_engine = _readonly_sqlite_engine(snapshot)
    engine = make_engine(url)
    try:
        with source_engine.connect() as source, engine.begin() as target:
            migrate_to(target, url, revision)
            copy_tables(source, target)
            set_pg_sequences(source, target)
    finally:
        engine.dispose()
        source_engine.dispose()


def _stored_checkpoints(backup: VerifiedBackup) -> set[str]:
    return {rel.split("/")[1] for rel in backup.files(MODELS_DIR)}
