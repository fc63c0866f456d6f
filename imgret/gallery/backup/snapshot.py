"""The database snapshot of a backup: consistent, taken under a short write pause with the
files it refers to pinned, written as one SQLite file and cleaned of deleted items.

**Media consistent with the snapshot, with a short write pause.** First every stored file is
pinned (:mod:`imgret.gallery.backup.pins`) without any lock; then, holding the gallery write
lock (``imgret.gallery.storage.item_store.lock_gallery_writes``, which every writer and every media
clean-up takes), the snapshot is pinned (its read transaction opened), the hashes it refers to
listed, and the few files stored since the first pass linked. Writers wait only for that
(``write_pause_ms`` in the report: one query and a few links), then everything is copied from
the pins and the pinned snapshot without any lock. Where a link is impossible the file is
copied under the lock instead, which makes the pause longer (logged). Image bytes kept in the
database (the ``media_blobs`` table of the database media backend) are part of the snapshot
itself; only hashes without a blob need a file.

From SQLite the snapshot file is made with SQLite's online backup API; from PostgreSQL by the
table copy of :mod:`imgret.gallery.backup.tables`.

**Nothing of deleted items.** Deletes clear the rows' personal data; the snapshot is cleaned
again (:func:`clear_personal_leftovers`: rows deleted by an older imgret, blobs no live row
refers to) and vacuumed, so no free page of the copy holds an old value.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from imgret.gallery.backup.errors import BackupError
from imgret.gallery.backup.layout import MODELS_DIR
from imgret.gallery.backup.pins import Pins
from imgret.gallery.backup.tables import carry_pg_sequences, copy_tables, migrate_to
from imgret.gallery.storage import item_store
from imgret.gallery.storage.db import make_sessionmaker
from imgret.gallery.tenancy.collections import CollectionNotFound

logger = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """A pinned, consistent view of the database, and what it refers to."""

    kind: str
    url: str
    connection: Any  # sqlite3.Connection (SQLite) or a SQLAlchemy Connection (PostgreSQL)
    revision: str = ""
    change_seq: int = 0
    gallery_items: int = 0
    query_items: int = 0
    media: set[str] = field(default_factory=set)
    checkpoints: dict[str, str] = field(default_factory=dict)  # version -> sha256
    versions: dict[str, int] = field(default_factory=dict)  # version -> dim
    active: str | None = None
    pause_ms: float = 0.0

    def query(self, sql: str) -> list[tuple]:
        if self.kind == "sqlite":
            return list(self.connection.execute(sql).fetchall())
        return [tuple(row) for row in self.connection.execute(text(sql))]

    def read_facts(self) -> None:
        """Everything the backup needs to know, read inside the pinned transaction."""
        rows = self.query("SELECT version_num FROM alembic_version")
        self.revision = rows[0][0] if rows else ""
        self.change_seq = int(self.query("SELECT COALESCE(MAX(seq), 0) FROM gallery_changes")[0][0])
        blobs = self.query(BLOBS_TABLE_SQL[self.kind])[0][0]
        self.media = {r[0] for r in self.query(referenced_files_sql(bool(blobs)))}
        self.gallery_items = int(self.query(
            "SELECT COUNT(*) FROM gallery_items WHERE deleted_at IS NULL")[0][0])
        self.query_items = int(self.query("SELECT COUNT(*) FROM query_items")[0][0])
        for version, dim, sha, active in self.query(
                "SELECT version, dim, checkpoint_sha256, is_active FROM model_versions"):
            self.versions[version] = int(dim)
            if sha:
                self.checkpoints[version] = sha
            if active:
                self.active = version

    def keep_only(self, path: Path, collection: str) -> None:
        """Prune the snapshot file at ``path`` to one collection, and read its facts again
        from it: the other collections go with everything they own (the database cascades),
        ``default`` stays as an empty shell when it is not the one kept (a restored database
        needs it), keys keep only if they hold a role on the kept collection, image blobs
        only if a kept row refers to them. SQLite's secure delete and a VACUUM leave no trace
        of what was pruned in the file.

        Raises:
            CollectionNotFound: no collection of that name in the snapshot.
        """
        connection = sqlite3.connect(path)
        try:
            found = connection.execute("SELECT id FROM collections WHERE name = ?",
                                       (collection,)).fetchone()
            if found is None:
                raise CollectionNotFound(f"no collection named {collection!r} to back up")
            kept = int(found[0])
            connection.execute("PRAGMA foreign_keys = ON")
            connection.execute("PRAGMA secure_delete = ON")
            with connection:
                connection.execute("DELETE FROM collections WHERE id NOT IN (1, ?)", (kept,))
                if kept != 1:
                    for table in ("gallery_items", "query_sets"):
                        connection.execute(f"DELETE FROM {table} WHERE collection_id = 1")
                connection.execute("DELETE FROM api_keys WHERE id NOT IN (SELECT key_id FROM "
                                   "api_key_roles WHERE collection_id = ?)", (kept,))
                if connection.execute(BLOBS_TABLE_SQL["sqlite"]).fetchone()[0]:
                    connection.execute(
                        "DELETE FROM media_blobs WHERE sha256 NOT IN (SELECT sha256 FROM "
                        "gallery_items UNION SELECT sha256 FROM query_items)")
            connection.execute("VACUUM")
            pruned = Snapshot("sqlite", self.url, connection)
            pruned.read_facts()
            active = connection.execute(
                "SELECT version FROM model_versions WHERE is_active AND collection_id = ?",
                (kept,)).fetchone()
        finally:
            connection.close()
        for name in ("change_seq", "gallery_items", "query_items", "media", "checkpoints",
                     "versions"):
            setattr(self, name, getattr(pruned, name))
        self.active = active[0] if active else None

    def write_sqlite(self, path: Path) -> None:
        """The snapshot as an imgret SQLite database at :attr:`revision`."""
        if self.kind == "sqlite":
            target = sqlite3.connect(path)
            try:
                self.connection.backup(target)  # the pinned read transaction's pages
                target.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
            finally:
                target.close()
            return
        engine = plain_sqlite_engine(path)
        try:
            with engine.begin() as target:
                migrate_to(target, f"sqlite:///{path}", self.revision)
                copy_tables(self.connection, target)
                carry_pg_sequences(self.connection, target)
        finally:
            engine.dispose()


def check_media(snap: Snapshot, pins: Pins) -> None:
    """Refuse a backup whose snapshot refers to a media file or checkpoint that is not pinned.

    Raises:
        BackupError: the store lost a file outside imgret, or a checkpoint is not stored.
    """
    missing = sorted(snap.media - pins.media_keys)
    if missing:
        raise BackupError(
            f"the database refers to {len(missing)} image files missing from the media store "
            f"(first: {pins.media.path(missing[0])}); the store was damaged outside imgret: "
            "delete those gallery items, or restore an older backup"
        )
    lost = sorted(set(snap.checkpoints) - pins.versions)
    if lost:
        raise BackupError(
            f"model version {lost[0]} has no stored checkpoint "
            f"({pins.data_dir / MODELS_DIR / lost[0] / 'model.pt'}); register it again with "
            "`imgret models register RUN_DIR` and back up again"
        )


def clear_personal_leftovers(path: Path) -> None:
    """Leave nothing of deleted items in the snapshot file: their rows' personal fields (a row
    deleted before deletes cleared them,
    :func:`imgret.gallery.storage.item_store.clear_deleted_items`), image bytes in ``media_blobs``
    that no live row refers to (a delete whose purge did not run yet),
    and, by a ``VACUUM``, the free pages that a page-by-page copy of SQLite carries along."""
    engine = plain_sqlite_engine(path)
    try:
        with engine.begin() as connection:
            item_store.clear_deleted_items(connection=connection)
            if connection.execute(text(BLOBS_TABLE_SQL["sqlite"])).scalar_one():
                connection.execute(text(
                    "DELETE FROM media_blobs WHERE sha256 NOT IN (SELECT sha256 FROM "
                    "gallery_items WHERE deleted_at IS NULL UNION SELECT sha256 FROM "
                    "query_items)"))
    finally:
        engine.dispose()
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.execute("VACUUM")
    finally:
        connection.close()


# Image bytes kept in the database (``media_blobs``, the database media backend) travel with
# the snapshot; only the hashes without a blob need a file.
BLOBS_TABLE_SQL = {
    "sqlite": "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'media_blobs'",
    "postgresql": "SELECT to_regclass('media_blobs') IS NOT NULL",
}


def referenced_files_sql(with_blobs: bool) -> str:
    """The hashes a live gallery item or a query item refers to whose bytes are files."""
    unless = " AND sha256 NOT IN (SELECT sha256 FROM media_blobs)" if with_blobs else ""
    return (f"SELECT sha256 FROM gallery_items WHERE deleted_at IS NULL{unless} "
            f"UNION SELECT sha256 FROM query_items WHERE 1 = 1{unless}")


@contextmanager
def pin_snapshot(engine: Engine, url: str, pins: Pins) -> Iterator[Snapshot]:
    """Open a consistent read snapshot under the gallery write lock, pin the files it refers
    to (see the module docstring), release the lock, and yield the snapshot (still open)."""
    kind = engine.dialect.name
    if kind == "sqlite":
        database = make_url(url).database
        raw = sqlite3.connect(database, isolation_level=None, timeout=30,
                              check_same_thread=False)
        snap = Snapshot(kind, url, raw)
        try:
            _pin_under_lock(engine, snap, pins, lambda: raw.execute("BEGIN"))
            yield snap
        finally:
            if raw.in_transaction:
                raw.execute("ROLLBACK")
            raw.close()
        return
    with engine.connect() as connection:
        connection = connection.execution_options(
            isolation_level="REPEATABLE READ", postgresql_readonly=True)
        snap = Snapshot(kind, url, connection)
        with connection.begin():
            # REPEATABLE READ takes its snapshot at the first statement (in read_facts).
            _pin_under_lock(engine, snap, pins, lambda: None)
            yield snap


def _pin_under_lock(engine: Engine, snap: Snapshot, pins: Pins,
                    begin: Callable[[], object]) -> None:
    with make_sessionmaker(engine)() as session:
        item_store.lock_gallery_writes(session=session)
        started = time.perf_counter()
        begin()
        snap.read_facts()  # the first read fixes the snapshot: no writer can commit now
        before = pins.copied_under_lock
        for sha in snap.media - pins.media_keys:
            pins.link_media(sha)
        for version in set(snap.checkpoints) - pins.versions:
            pins.link_checkpoint(version)
        snap.pause_ms = (time.perf_counter() - started) * 1000
        session.rollback()  # nothing was written: release the lock
    if pins.copied_under_lock > before:
        logger.warning("copied %d files while holding the write lock: hard links are "
                       "impossible between the media store and %s",
                       pins.copied_under_lock - before, pins.root)


def plain_sqlite_engine(path: Path) -> Engine:
    """An engine on a snapshot file that leaves its journal mode alone (no WAL files)."""
    return create_engine(f"sqlite:///{path}")
