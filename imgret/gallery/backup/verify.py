"""Verify a backup folder without writing anything: its manifest, every file's size and
SHA-256, nothing unlisted, and every image and checkpoint its snapshot refers to present.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgret.files import file_sha256
from imgret.gallery.backup.errors import BackupError
from imgret.gallery.backup.layout import (
    BACKUP_FILE,
    DATABASE_FILE,
    FORMAT,
    MEDIA_DIR,
    MODELS_DIR,
    files_checksum,
)
from imgret.gallery.backup.snapshot import BLOBS_TABLE_SQL, referenced_files_sql
from imgret.gallery.media.files import MediaStore


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
    if files_checksum(files) != recorded:
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
    with snapshot_reader(root / DATABASE_FILE) as db:
        rows = db.execute("SELECT version_num FROM alembic_version").fetchall()
        if not rows or rows[0][0] != revision:
            raise BackupError(f"{root / DATABASE_FILE}: not at revision {revision} as "
                              f"{BACKUP_FILE} says; use another backup")
        blobs = db.execute(BLOBS_TABLE_SQL["sqlite"]).fetchone()[0]
        wanted = {r[0] for r in db.execute(referenced_files_sql(bool(blobs)))}
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


def _inside(root: Path, rel: str) -> Path:
    """``root / rel`` for a relative path that stays inside ``root`` (a hostile backup.json
    cannot make restore read elsewhere)."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise BackupError(f"{root / BACKUP_FILE}: refuses the path {rel[:200]!r}; use another "
                          "backup")
    return root.joinpath(*parts)


@contextmanager
def snapshot_reader(path: Path) -> Iterator[sqlite3.Connection]:
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
