"""Backup and restore while serving: one consistent snapshot of the database, the media files
it refers to, the model checkpoints and the FAISS indexes with their manifests.

Layout of a backup folder (``imgret backup DEST``, ``POST /admin/backup``)::

    backup.json          format, source (database kind, URL without password, Alembic
                         revision), what the snapshot holds, and the SHA-256 and size of every
                         other file; written last
    database.sqlite      the snapshot: an imgret database at that Alembic revision
    media/ab/cd/<sha>    every file a live gallery item or a query item of the snapshot refers to
    models/<v>/model.pt  the stored checkpoint of every model version of the snapshot
    indexes/<v>/         index.faiss + manifest.json, matching the snapshot (see below)

Decisions the architecture leaves open:

- **One portable database format.** The snapshot is always a SQLite file at the source's
  Alembic revision. From SQLite it is made with SQLite's online backup API; from PostgreSQL by
  copying every table inside one ``REPEATABLE READ READ ONLY`` transaction (one MVCC snapshot)
  into a SQLite file created by the same migrations, with the id sequences carried over
  (``sqlite_sequence``), so ids are never reused after a restore. ``pg_dump`` is not used: it
  must match the server's major version, is often absent beside the service, and its output
  restores into PostgreSQL only. With one format, a backup restores into either engine
  (SQLite -> PostgreSQL and back), and restoring brings the schema to head afterwards.
- **Media consistent with the snapshot, with a short write pause.** Deletes remove image
  bytes (``imgret.index.gc``), so a file the snapshot refers to may vanish while a backup runs. The
  backup pins files by hard-linking them into ``<data_dir>/.backup-pins/`` (same file system
  as the store; a link costs no copy and keeps the bytes alive after the store unlinks them):
  first every stored file, without any lock; then, holding the gallery write lock
  (``imgret.index.store.lock_gallery_writes``, which every writer and every media clean-up takes),
  it pins the database snapshot (opens the read transaction), lists the hashes the snapshot
  refers to, and links the few files stored since the first pass. Writers wait only for that
  (``write_pause_ms`` in the report: one query and a few links), then everything is copied
  from the pins and the pinned snapshot without any lock. Where a link is impossible (the
  store on another file system than the data dir), the file is copied under the lock instead,
  which makes the pause longer (logged). Image bytes kept in the database (the
  ``media_blobs`` table of the database media backend) are part of the snapshot itself; only
  hashes without a blob need a file.
- **Indexes match the snapshot.** Each saved index (and the active version's, saved or not)
  is copied, then opened with :meth:`imgret.index.search.Searcher.open` against the snapshot itself:
  it is kept when its manifest and checksum hold and its ids, after replaying the snapshot's
  change log, equal the snapshot's; otherwise it is rebuilt from the snapshot's embeddings
  (no re-embedding). It is then saved, so its manifest describes the snapshot exactly.
- **Nothing of deleted items.** Deletes clear the rows' personal data; the snapshot is cleaned
  again (:func:`_clear_personal_leftovers`: rows deleted by an older imgret, blobs no live row
  refers to) and vacuumed, so no free page of the copy holds an old value.
- **Bounded disk.** :func:`check_free_space` refuses a backup whose estimated size
  (:func:`estimate_backup_bytes`) plus ``IMGRET_BACKUP_FREE_MARGIN_BYTES`` is not free before
  anything is written; callers run :func:`prune_backups` after a successful backup
  (``IMGRET_BACKUP_KEEP``, ``IMGRET_BACKUP_MAX_BYTES``; never the new one, only complete
  imgret backups).
- **Nothing half-done.** A backup is written to a temporary sibling folder and renamed to
  DEST only when complete, ``backup.json`` last; a folder without ``backup.json`` is partial
  and refused. Restore verifies every checksum (and that the snapshot's media and checkpoints
  are all there) before writing anything, restores only into an empty data dir and an empty
  database, writes the database last (one transaction on PostgreSQL; a temporary file renamed
  on SQLite), then checks that each index loads against the restored database (or rebuilds
  it) and that the active model version loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, DateTime, Engine, MetaData, create_engine, inspect, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import ImgretError, IndexStale
from imgret.files import file_sha256, fsync_dir, process_exists, write_atomic
from imgret.index import store
from imgret.index.db import (
    alembic_config,
    make_engine,
    make_sessionmaker,
    safe_url,
    upgrade_to_head,
)
from imgret.index.faiss_index import DEFAULT_FACTORY
from imgret.index.manifest import MANIFEST_FILE, Manifest, index_dir
from imgret.index.media import MediaStore
from imgret.settings import Settings

logger = logging.getLogger(__name__)

FORMAT = "imgret-backup-v1"
BACKUP_FILE = "backup.json"
DATABASE_FILE = "database.sqlite"
MEDIA_DIR = "media"
MODELS_DIR = "models"
INDEXES_DIR = "indexes"
PINS_DIR = ".backup-pins"
# Where POST /admin/backup writes (a client names a backup, never a path).
ADMIN_BACKUPS_DIR = "backups"
BACKUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_COPY_PAGE = 2_000
_CHUNK = 1 << 20

Phase = Callable[[str], None]


class BackupError(ImgretError):
    """A backup that cannot be made, or a backup (or target) that restore refuses."""


class BackupExists(BackupError):
    """The backup destination exists already."""


class BackupNoSpace(BackupError):
    """The backup's file system has too little free space for the estimated backup."""


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


# =========================================================================== backup


def create_backup(settings: Settings, dest: str | Path, *, on_phase: Phase | None = None,
                  ) -> BackupReport:
    """Back up the gallery of ``settings`` into the new folder ``dest`` while it is served.

    Args:
        settings: the database (``IMGRET_DATABASE_URL``) and data dir in force.
        dest: a folder that does not exist yet (its parent is created).
        on_phase: called with ``"pinned"`` (snapshot taken, writers released),
            ``"database"``, ``"media"``, ``"models"``, ``"indexes"``, ``"done"``.

    Returns:
        What the backup holds.

    Raises:
        BackupExists: ``dest`` exists.
        BackupError: the snapshot refers to a file missing from the store, a checkpoint that
            does not hold its recorded bytes, or the database is unreachable.
    """
    start = time.perf_counter()
    phase = on_phase or (lambda _name: None)
    dest = Path(dest).expanduser().absolute()
    if dest.exists():
        raise BackupExists(f"{dest} exists already; back up into a new folder name")
    data_dir = Path(settings.data_dir).absolute()
    media = MediaStore.in_data_dir(data_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temp = dest.parent / f".{dest.name}.partial-{token}"
    pins = data_dir / PINS_DIR / token
    _remove_dead_pins(data_dir / PINS_DIR)
    upgrade_to_head(settings.db_url)  # a service does this at start; a fresh one just works
    engine = make_engine(settings.db_url)
    try:
        check_free_space(dest.parent, estimate_backup_bytes(engine, settings.db_url, data_dir),
                         margin=settings.backup_free_margin_bytes)
        temp.mkdir()
        pinned = _Pins(pins, media, data_dir)
        pinned.link_all()  # no lock: every stored file and checkpoint, as they are now
        with _pin_snapshot(engine, settings.db_url, pinned) as snap:
            # Pinned: a consistent snapshot, and every file it refers to hard-linked.
            phase("pinned")
            snap.write_sqlite(temp / DATABASE_FILE)
        _clear_personal_leftovers(temp / DATABASE_FILE)
        phase("database")
        _check_media(snap, pinned)
        files: dict[str, dict[str, Any]] = {}
        made: set[Path] = set()
        for sha in sorted(snap.media):
            rel = f"{MEDIA_DIR}/{MediaStore.relative_path(sha)}"
            digest, size = _copy_hashing(pinned.media_path(sha), temp / rel, made)
            if digest != sha:
                raise BackupError(
                    f"{media.path(sha)} does not hold the bytes of its name (corrupted on "
                    "disk); delete that gallery item (or restore it from an older backup) and "
                    "back up again"
                )
            files[rel] = {"sha256": digest, "size": size}
        phase("media")
        for version, sha in sorted(snap.checkpoints.items()):
            rel = f"{MODELS_DIR}/{version}/model.pt"
            digest, size = _copy_hashing(pinned.checkpoint_path(version), temp / rel, made)
            if digest != sha:
                raise BackupError(
                    f"{data_dir / rel} does not hold the checkpoint recorded for model version "
                    f"{version}; register that checkpoint again (imgret models register) and "
                    "back up again"
                )
            files[rel] = {"sha256": digest, "size": size}
        phase("models")
        indexes = _backup_indexes(snap, data_dir, temp, settings)
        phase("indexes")
        for path in sorted((temp / INDEXES_DIR).rglob("*")) + [temp / DATABASE_FILE]:
            if path.is_file():
                files[path.relative_to(temp).as_posix()] = {
                    "sha256": file_sha256(path), "size": path.stat().st_size}
        report = BackupReport(
            path=str(dest), database=snap.kind, alembic_revision=snap.revision,
            change_seq=snap.change_seq, gallery_items=snap.gallery_items,
            query_items=snap.query_items, media_files=len(snap.media),
            model_versions=sorted(snap.versions), active_version=snap.active,
            indexes=indexes, bytes=sum(f["size"] for f in files.values()),
            write_pause_ms=round(snap.pause_ms, 2),
            seconds=round(time.perf_counter() - start, 3),
        )
        _write_backup_json(temp, report, files, source_url=settings.db_url)
        _make_durable(temp)
        try:
            os.rename(temp, dest)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise BackupExists(
                    f"{dest} appeared while the backup ran; back up into a new folder name"
                ) from None
            raise
        fsync_dir(dest.parent)
        phase("done")
        logger.info("backup of %s (%d items, %d media files, %.1f MB) in %.1f s -> %s; writes "
                    "paused %.1f ms", safe_url(settings.db_url), report.gallery_items,
                    report.media_files, report.bytes / 1e6, report.seconds, dest,
                    report.write_pause_ms)
        return report
    finally:
        engine.dispose()
        shutil.rmtree(pins, ignore_errors=True)
        with contextlib.suppress(OSError):
            pins.parent.rmdir()  # only when no other backup is running
        shutil.rmtree(temp, ignore_errors=True)


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
    files = sum(_tree_bytes(data_dir / folder) for folder in (MEDIA_DIR, MODELS_DIR,
                                                               INDEXES_DIR))
    return 2 * db_bytes + files


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
    sizes = {path: _tree_bytes(path) for path, _ in backups}
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


def _tree_bytes(root: Path) -> int:
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


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


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


class _Pins:
    """Hard links that keep the bytes of media files and checkpoints alive during a backup."""

    def __init__(self, root: Path, media: MediaStore, data_dir: Path):
        self.root, self.media, self.data_dir = root, media, data_dir
        self.media_keys: set[str] = set()
        self.versions: set[str] = set()
        self.copied_under_lock = 0

    def media_path(self, sha: str) -> Path:
        return self.root / MEDIA_DIR / sha

    def checkpoint_path(self, version: str) -> Path:
        return self.root / MODELS_DIR / version / "model.pt"

    def link_all(self) -> None:
        (self.root / MEDIA_DIR).mkdir(parents=True, exist_ok=True)
        for sha in self.media.stored_keys():
            self.link_media(sha)
        models = self.data_dir / MODELS_DIR
        if models.is_dir():
            for path in models.glob("*/model.pt"):
                self.link_checkpoint(path.parent.name)

    def link_media(self, sha: str) -> bool:
        """Pin one stored file; False when the store no longer has it."""
        if sha not in self.media_keys and self._link(self.media.path(sha), self.media_path(sha)):
            self.media_keys.add(sha)
        return sha in self.media_keys

    def link_checkpoint(self, version: str) -> bool:
        source = self.data_dir / MODELS_DIR / version / "model.pt"
        self.checkpoint_path(version).parent.mkdir(parents=True, exist_ok=True)
        if version not in self.versions and self._link(source, self.checkpoint_path(version)):
            self.versions.add(version)
        return version in self.versions

    def _link(self, source: Path, target: Path) -> bool:
        try:
            os.link(source, target)
        except FileNotFoundError:
            return False
        except FileExistsError:
            return True
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            try:
                shutil.copyfile(source, target)  # no hard links here: a copy pins as well
            except FileNotFoundError:
                return False
            self.copied_under_lock += 1
        return True


def _check_media(snap: _Snapshot, pins: _Pins) -> None:
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


@dataclass
class _Snapshot:
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
        blobs = self.query(_BLOBS_TABLE_SQL[self.kind])[0][0]
        self.media = {r[0] for r in self.query(_referenced_files_sql(bool(blobs)))}
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
        engine = _plain_sqlite_engine(path)
        try:
            with engine.begin() as target:
                _migrate_to(target, f"sqlite:///{path}", self.revision)
                _copy_tables(self.connection, target)
                _carry_pg_sequences(self.connection, target)
        finally:
            engine.dispose()


def _clear_personal_leftovers(path: Path) -> None:
    """Leave nothing of deleted items in the snapshot file: their rows' personal fields (a row
    deleted before deletes cleared them, :func:`imgret.index.store.clear_deleted_items`), image
    bytes
    in ``media_blobs`` that no live row refers to (a delete whose purge did not run yet), and,
    by a ``VACUUM``, the free pages that a page-by-page copy of SQLite carries along."""
    engine = _plain_sqlite_engine(path)
    try:
        with engine.begin() as connection:
            store.clear_deleted_items(connection=connection)
            if connection.execute(text(_BLOBS_TABLE_SQL["sqlite"])).scalar_one():
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
_BLOBS_TABLE_SQL = {
    "sqlite": "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'media_blobs'",
    "postgresql": "SELECT to_regclass('media_blobs') IS NOT NULL",
}


def _referenced_files_sql(with_blobs: bool) -> str:
    """The hashes a live gallery item or a query item refers to whose bytes are files."""
    unless = " AND sha256 NOT IN (SELECT sha256 FROM media_blobs)" if with_blobs else ""
    return (f"SELECT sha256 FROM gallery_items WHERE deleted_at IS NULL{unless} "
            f"UNION SELECT sha256 FROM query_items WHERE 1 = 1{unless}")


@contextmanager
def _pin_snapshot(engine: Engine, url: str, pins: _Pins) -> Iterator[_Snapshot]:
    """Open a consistent read snapshot under the gallery write lock, pin the files it refers
    to (see the module docstring), release the lock, and yield the snapshot (still open)."""
    kind = engine.dialect.name
    if kind == "sqlite":
        database = make_url(url).database
        raw = sqlite3.connect(database, isolation_level=None, timeout=30,
                              check_same_thread=False)
        snap = _Snapshot(kind, url, raw)
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
        snap = _Snapshot(kind, url, connection)
        with connection.begin():
            # REPEATABLE READ takes its snapshot at the first statement (in read_facts).
            _pin_under_lock(engine, snap, pins, lambda: None)
            yield snap


def _pin_under_lock(engine: Engine, snap: _Snapshot, pins: _Pins,
                    begin: Callable[[], object]) -> None:
    with make_sessionmaker(engine)() as session:
        store.lock_gallery_writes(session=session)
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


def _plain_sqlite_engine(path: Path) -> Engine:
    """An engine on a snapshot file that leaves its journal mode alone (no WAL files)."""
    return create_engine(f"sqlite:///{path}")


def _migrate_to(connection: Connection, url: str, revision: str) -> None:
    """Create the imgret schema at ``revision`` (not head) on an empty database."""
    from alembic import command

    config = alembic_config(url)
    _check_revision_known(config, revision)
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


def _check_revision_known(config: Any, revision: str) -> None:
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        known = ScriptDirectory.from_config(config).get_revision(revision)
    except CommandError:
        known = None
    if known is None:
        raise BackupError(
            f"the backup's schema revision {revision!r} is unknown to this imgret (made by a "
            "newer version): restore it with that version or a newer one"
        )


def _copy_tables(source: Connection, target: Connection) -> dict[str, int]:
    """Copy every table (but ``alembic_version``) from ``source`` into the same, empty tables
    of ``target``, in foreign-key order, page by page; timestamps are carried in UTC.

    Returns:
        table -> rows copied.
    """
    src_meta, dst_meta = MetaData(), MetaData()
    src_meta.reflect(bind=source)
    dst_meta.reflect(bind=target)
    counts: dict[str, int] = {}
    to_sqlite = target.dialect.name == "sqlite"
    for table in dst_meta.sorted_tables:
        if table.name == "alembic_version":
            continue
        src = src_meta.tables.get(table.name)
        if src is None or set(src.columns.keys()) != set(table.columns.keys()):
            raise BackupError(
                f"table {table.name} differs between the snapshot and the schema at its "
                "revision; was the database changed by hand?"
            )
        stamps = [c.name for c in table.columns if isinstance(c.type, DateTime)]
        order = [src.columns[c.name] for c in table.primary_key.columns] or list(src.columns)
        result = source.execution_options(yield_per=_COPY_PAGE).execute(
            select(src).order_by(*order))
        total = 0
        for page in result.mappings().partitions(_COPY_PAGE):
            rows = [dict(row) for row in page]
            for row in rows:
                for name in stamps:
                    row[name] = _utc(row[name], naive=to_sqlite)
            target.execute(table.insert(), rows)
            total += len(rows)
        counts[table.name] = total
    return counts


def _utc(value: datetime | None, *, naive: bool) -> datetime | None:
    """A stored time in UTC: SQLite keeps naive UTC, PostgreSQL ``timestamptz`` aware."""
    if value is None:
        return None
    value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return value.replace(tzinfo=None) if naive else value


def _serial_columns(connection: Connection) -> list[tuple[str, str]]:
    """``(table, column)`` of every single-column integer primary key (the id sequences)."""
    inspector = inspect(connection)
    found = []
    for table in inspector.get_table_names():
        pk = inspector.get_pk_constraint(table).get("constrained_columns") or []
        if table != "alembic_version" and len(pk) == 1:
            found.append((table, pk[0]))
    return found


def _carry_pg_sequences(source: Connection, target: Connection) -> None:
    """Set the SQLite snapshot's ``sqlite_sequence`` to PostgreSQL's sequence positions: ids
    handed out (and maybe rolled back or deleted) are never handed out again after restore."""
    for table, column in _serial_columns(source):
        name = source.execute(text("SELECT pg_get_serial_sequence(:t, :c)"),
                              {"t": table, "c": column}).scalar()
        if not name:
            continue
        last, called = source.execute(text(f"SELECT last_value, is_called FROM {name}")).one()
        used = int(last) if called else int(last) - 1
        current = target.execute(text("SELECT seq FROM sqlite_sequence WHERE name = :t"),
                                 {"t": table}).scalar()
        if current is None:
            target.execute(text("INSERT INTO sqlite_sequence (name, seq) VALUES (:t, :s)"),
                           {"t": table, "s": used})
        elif used > int(current):
            target.execute(text("UPDATE sqlite_sequence SET seq = :s WHERE name = :t"),
                           {"t": table, "s": used})


def _backup_indexes(snap: _Snapshot, data_dir: Path, temp: Path, settings: Settings,
                    ) -> list[str]:
    """Copy each saved index whose version is in the snapshot (and make the active one's),
    then make each match the snapshot (load + replay, or rebuild) and save it."""
    from imgret.index.search import Searcher

    wanted = {v for v in snap.versions if (index_dir(data_dir, v) / MANIFEST_FILE).is_file()}
    if snap.active is not None:
        wanted.add(snap.active)
    if not wanted:
        return []
    engine = _plain_sqlite_engine(temp / DATABASE_FILE)
    sessions = make_sessionmaker(engine)
    done = []
    try:
        for version in sorted(wanted):
            factory = _copy_index_pair(index_dir(data_dir, version), index_dir(temp, version))
            searcher = Searcher.open(sessions, temp, factory or settings.index_factory,
                                     version, use_gpu=False, save=True)
            searcher.wait_for_rebuild()
            searcher.save()
            done.append(version)
    finally:
        engine.dispose()
    return done


def _copy_index_pair(source: Path, target: Path, attempts: int = 3) -> str | None:
    """Copy ``index.faiss`` + ``manifest.json`` as a matching pair (a save may be writing them:
    the index's checksum must be the manifest's); returns the manifest's factory, or ``None``
    when there is no usable pair (the index is then built from the snapshot)."""
    for _ in range(attempts):
        try:
            manifest = Manifest.read(source)
        except IndexStale:
            return None
        target.mkdir(parents=True, exist_ok=True)
        try:
            digest, _ = _copy_hashing(source / "index.faiss", target / "index.faiss", set())
        except FileNotFoundError:
            return None
        if digest == manifest.index_sha256:
            manifest.write(target)
            return manifest.factory
        time.sleep(0.05)  # a save was replacing the pair: read it again
    shutil.rmtree(target, ignore_errors=True)
    return None


def _copy_hashing(source: Path, target: Path, made: set[Path]) -> tuple[str, int]:
    """Copy a file, returning the SHA-256 and size of what was copied. Not yet durable: the
    caller calls :func:`_make_durable` once for all of them. ``made``: folders known to exist
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


def _files_checksum(files: dict[str, dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _write_backup_json(temp: Path, report: BackupReport, files: dict[str, dict[str, Any]], *,
                       source_url: str) -> None:
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
        "files_sha256": _files_checksum(files),
    }
    write_atomic(temp / BACKUP_FILE, json.dumps(document, indent=2, sort_keys=True).encode())


def _make_durable(root: Path) -> None:
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


def _remove_dead_pins(root: Path) -> None:
    """Remove pin folders of backups whose process died (``<pid>-<token>``)."""
    if not root.is_dir():
        return
    for folder in root.iterdir():
        pid = folder.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        if not process_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


# =========================================================================== restore


@dataclass(frozen=True)
class VerifiedBackup:
    """A backup folder whose every file was checked against ``backup.json``."""

    path: Path
    document: dict[str, Any]

    @property
    def revision(self) -> str:
        return self.document["source"]["alembic_revision"]

    @property
    def snapshot(self) -> dict[str, Any]:
        return self.document["snapshot"]

    def files(self, prefix: str) -> list[str]:
        return sorted(rel for rel in self.document["files"] if rel.startswith(prefix + "/"))


def verify_backup(src: str | Path) -> VerifiedBackup:
    """Check a backup folder without writing anything.

    Every file listed in ``backup.json`` must be there with its size and SHA-256, no other
    file may be, every media file must be named by its hash, and every image and checkpoint
    the snapshot refers to must be in the backup.

    Raises:
        BackupError: what is wrong (a partial or damaged backup), naming the file.
    """
    root = Path(src).expanduser().absolute()
    if not root.is_dir():
        raise BackupError(f"{root}: no such backup folder")
    manifest = root / BACKUP_FILE
    if not manifest.is_file():
        raise BackupError(
            f"{root} has no {BACKUP_FILE}: it is not an imgret backup, or a partial one (an "
            "interrupted backup never gets one); use a complete backup folder"
        )
    try:
        document = json.loads(manifest.read_text())
        files: dict[str, dict[str, Any]] = document["files"]
        recorded = document["files_sha256"]
        fmt = document["format"]
        revision = document["source"]["alembic_revision"]
        document["snapshot"]["model_versions"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BackupError(f"{manifest}: unreadable backup manifest ({exc}); the backup is "
                          "damaged, use another one") from None
    if fmt != FORMAT:
        raise BackupError(f"{manifest}: format {fmt!r} is not {FORMAT!r}; restore it with the "
                          "imgret version that made it")
    if _files_checksum(files) != recorded:
        raise BackupError(f"{manifest}: its file list does not match its own checksum (edited "
                          "or damaged); use another backup")
    for rel, entry in files.items():
        path = _inside(root, rel)
        if not path.is_file():
            raise BackupError(f"{path}: listed in {BACKUP_FILE} but missing (a partial or "
                              "damaged backup); use another backup")
        size = path.stat().st_size
        if size != entry["size"] or file_sha256(path) != entry["sha256"]:
            raise BackupError(f"{path}: checksum mismatch with {BACKUP_FILE} (the file was "
                              "changed or damaged); use another backup")
    extra = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.relative_to(root).as_posix() not in files
                   and p.name != BACKUP_FILE)
    if extra:
        raise BackupError(f"{root / extra[0]}: not listed in {BACKUP_FILE} ({len(extra)} such "
                          "files); a backup must hold exactly what it lists, remove them")
    if DATABASE_FILE not in files:
        raise BackupError(f"{root}: {BACKUP_FILE} lists no {DATABASE_FILE}; use another backup")
    media = {}
    for rel in (r for r in files if r.startswith(MEDIA_DIR + "/")):
        sha = files[rel]["sha256"]
        if rel != f"{MEDIA_DIR}/{MediaStore.relative_path(sha)}":
            raise BackupError(f"{root / rel}: a media file not named by its hash; the backup "
                              "is damaged, use another one")
        media[sha] = rel
    with _snapshot_reader(root / DATABASE_FILE) as db:
        rows = db.execute("SELECT version_num FROM alembic_version").fetchall()
        if not rows or rows[0][0] != revision:
            raise BackupError(f"{root / DATABASE_FILE}: not at revision {revision} as "
                              f"{BACKUP_FILE} says; use another backup")
        blobs = db.execute(_BLOBS_TABLE_SQL["sqlite"]).fetchone()[0]
        wanted = {r[0] for r in db.execute(_referenced_files_sql(bool(blobs)))}
        missing = sorted(wanted - set(media))
        if missing:
            raise BackupError(f"{root}: {len(missing)} image files the snapshot refers to are "
                              f"not in the backup (first {missing[0]}); use another backup")
        for version, sha in db.execute(
                "SELECT version, checkpoint_sha256 FROM model_versions "
                "WHERE checkpoint_sha256 IS NOT NULL"):
            entry = files.get(f"{MODELS_DIR}/{version}/model.pt")
            if entry is None or entry["sha256"] != sha:
                raise BackupError(f"{root / MODELS_DIR / version / 'model.pt'}: the checkpoint "
                                  f"of model version {version} is missing or not the one "
                                  "recorded; use another backup")
    return VerifiedBackup(root, document)


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
    _check_revision_known(alembic_config(url), backup.revision)
    phase("verified")
    # The target is empty and the database is written last, so files need no atomic rename
    # each: one flush of them all before the database commits (media/ab/cd/<sha> is the
    # media store's own layout, checked by verify_backup).
    made: set[Path] = set()
    listed = backup.document["files"]
    for rel in backup.files(MEDIA_DIR) + backup.files(MODELS_DIR) + backup.files(INDEXES_DIR):
        digest, _ = _copy_hashing(backup.path / rel, data_dir / rel, made)
        if digest != listed[rel]["sha256"]:
            raise BackupError(f"{backup.path / rel} changed while it was restored; restore "
                              "again into an empty data dir")
    _make_durable(data_dir)
    phase("files")
    _restore_database(backup.path / DATABASE_FILE, url, backup.revision)
    upgrade_to_head(url)
    phase("database")
    engine = make_engine(url)
    try:
        sessions = make_sessionmaker(engine)
        indexes = _check_indexes(backup, sessions, data_dir)
        phase("indexes")
        active = backup.snapshot.get("active_version")
        if active is not None and active in _stored_checkpoints(backup):
            from imgret.index import versions

            versions.load_embedder(active, session_factory=sessions, data_dir=data_dir,
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


def _inside(root: Path, rel: str) -> Path:
    """``root / rel`` for a relative path that stays inside ``root`` (a hostile backup.json
    cannot make restore read elsewhere)."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise BackupError(f"{root / BACKUP_FILE}: refuses the path {rel[:200]!r}; use another "
                          "backup")
    return root.joinpath(*parts)


@contextmanager
def _snapshot_reader(path: Path) -> Iterator[sqlite3.Connection]:
    """The snapshot opened read-only (a backup folder may be read-only)."""
    try:
        connection = sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True)
        connection.execute("SELECT 1 FROM alembic_version")
    except sqlite3.DatabaseError as exc:
        raise BackupError(f"{path}: not a readable imgret database ({exc}); use another "
                          "backup") from None
    try:
        yield connection
    finally:
        connection.close()


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
        with _snapshot_reader(snapshot) as source:
            copy = sqlite3.connect(temp)
            try:
                source.backup(copy)
                copy.execute("PRAGMA journal_mode=DELETE")
                copy.commit()
            finally:
                copy.close()
        _fsync_file(temp)
        os.replace(temp, target)
        fsync_dir(target.parent)
        return
    source_engine = _readonly_sqlite_engine(snapshot)
    engine = make_engine(url)
    try:
        with source_engine.connect() as source, engine.begin() as target:
            _migrate_to(target, url, revision)
            _copy_tables(source, target)
            _set_pg_sequences(source, target)
    finally:
        engine.dispose()
        source_engine.dispose()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _set_pg_sequences(source: Connection, target: Connection) -> None:
    """Move each PostgreSQL id sequence past the snapshot's (``sqlite_sequence`` and the
    largest id), so restored ids are never handed out again."""
    carried = dict(source.execute(text("SELECT name, seq FROM sqlite_sequence")).all())
    for table, column in _serial_columns(target):
        name = target.execute(text("SELECT pg_get_serial_sequence(:t, :c)"),
                              {"t": table, "c": column}).scalar()
        if not name:
            continue
        largest = target.execute(text(f'SELECT COALESCE(MAX("{column}"), 0) FROM "{table}"')
                                 ).scalar_one()
        used = max(int(largest), int(carried.get(table) or 0))
        if used > 0:
            target.execute(text("SELECT setval(:s, :v, true)"), {"s": name, "v": used})


def _stored_checkpoints(backup: VerifiedBackup) -> set[str]:
    return {rel.split("/")[1] for rel in backup.files(MODELS_DIR)}


def _check_indexes(backup: VerifiedBackup, sessions: sessionmaker[Session], data_dir: Path,
                   ) -> dict[str, str]:
    """Open each restored index against the restored database: ``loaded`` when its manifest
    matches (after replaying the change log), ``rebuilt`` from SQL otherwise."""
    from imgret.index.search import Searcher

    folders = sorted({rel.split("/")[1] for rel in backup.files(INDEXES_DIR)})
    versions = {index_dir(data_dir, v).name: v for v in backup.snapshot["model_versions"]}
    states = {}
    for folder in folders:
        version = versions.get(folder)
        if version is None:
            continue
        path = data_dir / INDEXES_DIR / folder
        try:
            before = Manifest.read(path)
        except IndexStale:
            before = None
        factory = before.factory if before is not None else DEFAULT_FACTORY
        searcher = Searcher.open(sessions, data_dir, factory, version, use_gpu=False, save=True)
        searcher.wait_for_rebuild()
        after = Manifest.read(path)
        states[version] = "loaded" if before == after else "rebuilt"
        if states[version] == "rebuilt":
            logger.warning("the restored %s index did not match the restored database: rebuilt "
                           "from SQL", version)
    return states
