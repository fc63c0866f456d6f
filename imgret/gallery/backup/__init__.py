"""Backup and restore while serving: one consistent snapshot of the database, the media files
it refers to, the model checkpoints and the FAISS indexes with their manifests
(``imgret backup DEST``, ``POST /admin/backup``, ``imgret restore SRC``).

Layout of a backup folder::

    backup.json          format, source (database kind, URL without password, Alembic
                         revision), what the snapshot holds, and the SHA-256 and size of every
                         other file; written last
    database.sqlite      the snapshot: an imgret database at that Alembic revision
    media/ab/cd/<sha>    every file a live gallery item or a query item of the snapshot refers to
    models/<v>/model.pt  the stored checkpoint of every model version of the snapshot
    indexes/<v>/         index.faiss + manifest.json, matching the snapshot

Three steps, each a module, compose parts with one job each (the decisions are in the
docstrings of the modules that make them, and in ``docs/backup.md``):

- :mod:`imgret.gallery.backup.create`: :func:`create_backup`, into a temporary folder renamed
  when complete, ``backup.json`` last;
- :mod:`imgret.gallery.backup.verify`: :func:`verify_backup`, every checksum and reference
  checked, nothing written;
- :mod:`imgret.gallery.backup.restore`: :func:`restore_backup`, into an empty data dir and an
  empty database of either engine, the database last;
- :mod:`imgret.gallery.backup.snapshot`: the consistent database snapshot, taken under a short
  write pause with the files it refers to pinned, written as SQLite and cleaned of deleted
  items;
- :mod:`imgret.gallery.backup.pins`: hard links that keep media files and checkpoints alive
  while a backup copies them;
- :mod:`imgret.gallery.backup.tables`: the portable database copy (the schema at a revision,
  every table across engines, the id sequences), used by the snapshot and by restore;
- :mod:`imgret.gallery.backup.indexes`: each index made to match the snapshot (loaded and
  replayed, or rebuilt), and checked again after a restore;
- :mod:`imgret.gallery.backup.files`: copying while hashing, making a tree durable, the bytes
  under a folder;
- :mod:`imgret.gallery.backup.space`: the estimated size of a backup and the free-space check
  before anything is written;
- :mod:`imgret.gallery.backup.retention`: :func:`prune_backups`, the oldest complete backups
  removed after a successful one;
- :mod:`imgret.gallery.backup.layout`: the format (names in a backup folder, ``backup.json``
  and :class:`BackupReport`) and where ``POST /admin/backup`` writes
  (:func:`admin_backup_path`);
- :mod:`imgret.gallery.backup.errors`: what backup and restore refuse.
"""

from imgret.gallery.backup.create import create_backup
from imgret.gallery.backup.errors import BackupError, BackupExists, BackupNoSpace
from imgret.gallery.backup.layout import (
    ADMIN_BACKUPS_DIR,
    BACKUP_FILE,
    BACKUP_NAME,
    DATABASE_FILE,
    FORMAT,
    INDEXES_DIR,
    MEDIA_DIR,
    MODELS_DIR,
    BackupReport,
    Phase,
    admin_backup_path,
)
from imgret.gallery.backup.restore import RestoreReport, restore_backup
from imgret.gallery.backup.retention import prune_backups
from imgret.gallery.backup.space import check_free_space, estimate_backup_bytes
from imgret.gallery.backup.verify import VerifiedBackup, verify_backup

__all__ = [
    "ADMIN_BACKUPS_DIR",
    "BACKUP_FILE",
    "BACKUP_NAME",
    "DATABASE_FILE",
    "FORMAT",
    "INDEXES_DIR",
    "MEDIA_DIR",
    "MODELS_DIR",
    "BackupError",
    "BackupExists",
    "BackupNoSpace",
    "BackupReport",
    "Phase",
    "RestoreReport",
    "VerifiedBackup",
    "admin_backup_path",
    "check_free_space",
    "create_backup",
    "estimate_backup_bytes",
    "prune_backups",
    "restore_backup",
    "verify_backup",
]
