"""Take a backup while serving: snapshot, pinned files, checkpoints and indexes copied into a
new folder, ``backup.json`` last.

**Nothing half-done.** A backup is written to a temporary sibling folder, made durable, and
renamed to DEST only when complete, ``backup.json`` last; a folder without ``backup.json`` is
partial and refused by :func:`imgret.gallery.backup.verify.verify_backup`. Before anything is
written, :func:`imgret.gallery.backup.space.check_free_space` refuses a backup the volume cannot
hold; callers run :func:`imgret.gallery.backup.retention.prune_backups` after a successful one.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from imgret.files import file_sha256, fsync_dir
from imgret.gallery.backup.errors import BackupError, BackupExists
from imgret.gallery.backup.files import copy_hashing, make_durable
from imgret.gallery.backup.indexes import backup_indexes
from imgret.gallery.backup.layout import (
    DATABASE_FILE,
    INDEXES_DIR,
    MEDIA_DIR,
    MODELS_DIR,
    BackupReport,
    Phase,
    write_backup_json,
)
from imgret.gallery.backup.pins import PINS_DIR, Pins, remove_dead_pins
from imgret.gallery.backup.snapshot import check_media, clear_personal_leftovers, pin_snapshot
from imgret.gallery.backup.space import check_free_space, estimate_backup_bytes
from imgret.gallery.media.files import MediaStore
from imgret.gallery.storage.db import make_engine, make_sessionmaker, safe_url, upgrade_to_head
from imgret.gallery.tenancy import collections
from imgret.settings import Settings

logger = logging.getLogger(__name__)


def create_backup(settings: Settings, dest: str | Path, *, on_phase: Phase | None = None,
                  ) -> BackupReport:
    """Back up the gallery of ``settings`` into the new folder ``dest`` while it is served.

    Every collection, or only ``settings.collection`` when it is set (``imgret backup DEST
    --collection NAME``): the snapshot is then pruned to that collection (and an empty
    ``default``, see :meth:`Snapshot.keep_only`), holds only its images, and no index files
    (another collection's would ride along; a restored one rebuilds them from SQL).

    Args:
        settings: the database (``IMGRET_DATABASE_URL``), the data dir and the collection in
            force.
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
    remove_dead_pins(data_dir / PINS_DIR)
    upgrade_to_head(settings.db_url)  # a service does this at start; a fresh one just works
    engine = make_engine(settings.db_url)
    try:
        if settings.collection is not None:
            with make_sessionmaker(engine)() as session:
                collections.get(settings.collection, session=session)  # 404 before any work
        check_free_space(dest.parent, estimate_backup_bytes(engine, settings.db_url, data_dir),
                         margin=settings.backup_free_margin_bytes)
        temp.mkdir()
        pinned = Pins(pins, media, data_dir)
        pinned.link_all()  # no lock: every stored file and checkpoint, as they are now
        with pin_snapshot(engine, settings.db_url, pinned) as snap:
            # Pinned: a consistent snapshot, and every file it refers to hard-linked.
            phase("pinned")
            snap.write_sqlite(temp / DATABASE_FILE)
        if settings.collection is not None:
            snap.keep_only(temp / DATABASE_FILE, settings.collection)
        clear_personal_leftovers(temp / DATABASE_FILE)
        phase("database")
        check_media(snap, pinned)
        files: dict[str, dict[str, Any]] = {}
        made: set[Path] = set()
        for sha in sorted(snap.media):
            rel = f"{MEDIA_DIR}/{MediaStore.relative_path(sha)}"
            digest, size = copy_hashing(pinned.media_path(sha), temp / rel, made)
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
            digest, size = copy_hashing(pinned.checkpoint_path(version), temp / rel, made)
            if digest != sha:
                raise BackupError(
                    f"{data_dir / rel} does not hold the checkpoint recorded for model version "
                    f"{version}; register that checkpoint again (imgret models register) and "
                    "back up again"
                )
            files[rel] = {"sha256": digest, "size": size}
        phase("models")
        indexes = ([] if settings.collection is not None
                   else backup_indexes(snap, data_dir, temp, settings))
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
        write_backup_json(temp, report, files, source_url=settings.db_url)
        make_durable(temp)
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
