"""The indexes of a backup, made to match its database snapshot, and checked again after a
restore.

**Indexes match the snapshot.** Each saved index (and the active version's, saved or not) is
copied as a matching pair (the index's checksum must be its manifest's), then opened with
:meth:`imgret.gallery.search.Searcher.open` against the snapshot itself: it is kept when its
manifest and checksum hold and its ids, after replaying the snapshot's change log, equal the
snapshot's; otherwise it is rebuilt from the snapshot's embeddings (no re-embedding). It is
then saved, so its manifest describes the snapshot exactly. Restore opens each index against
the restored database the same way and reports ``loaded`` or ``rebuilt``.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import IndexStale
from imgret.gallery.backup.files import copy_hashing
from imgret.gallery.backup.layout import DATABASE_FILE, INDEXES_DIR
from imgret.gallery.backup.snapshot import Snapshot, plain_sqlite_engine
from imgret.gallery.backup.verify import VerifiedBackup
from imgret.gallery.search.faiss_index import DEFAULT_FACTORY
from imgret.gallery.search.manifest import MANIFEST_FILE, Manifest, index_dir
from imgret.gallery.storage.db import make_sessionmaker
from imgret.settings import Settings

logger = logging.getLogger(__name__)


def backup_indexes(snap: Snapshot, data_dir: Path, temp: Path, settings: Settings,
                   ) -> list[str]:
    """Copy each saved index whose version is in the snapshot (and make the active one's),
    then make each match the snapshot (load + replay, or rebuild) and save it."""
    from imgret.gallery.search import Searcher

    wanted = {v for v in snap.versions if (index_dir(data_dir, v) / MANIFEST_FILE).is_file()}
    if snap.active is not None:
        wanted.add(snap.active)
    if not wanted:
        return []
    engine = plain_sqlite_engine(temp / DATABASE_FILE)
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
            digest, _ = copy_hashing(source / "index.faiss", target / "index.faiss", set())
        except FileNotFoundError:
            return None
        if digest == manifest.index_sha256:
            manifest.write(target)
            return manifest.factory
        time.sleep(0.05)  # a save was replacing the pair: read it again
    shutil.rmtree(target, ignore_errors=True)
    return None


def check_indexes(backup: VerifiedBackup, sessions: sessionmaker[Session], data_dir: Path,
                  ) -> dict[str, str]:
    """Open each restored index against the restored database: ``loaded`` when its manifest
    matches (after replaying the change log), ``rebuilt`` from SQL otherwise."""
    from imgret.gallery.search import Searcher

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
