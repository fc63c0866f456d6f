"""Image bytes kept in the gallery database (``IMGRET_MEDIA_BACKEND=database``).

The default store (:class:`imgret.gallery.media.files.MediaStore`) is a folder: replicas on several
machines must share it as a volume. This one keeps the bytes in ``media_blobs`` (``bytea`` on
PostgreSQL, a BLOB on SQLite), so every process that reaches the database can serve every
image: meant for galleries of small images (faces, re-ID crops, thumbnails), not for
terabytes of photos.

Same keys and the same guarantees as the files, with the database's transactions instead of
fsync and rename: the bytes are written *in the caller's transaction* (the one that writes
the rows pointing to them, under the gallery write lock), so a row never commits without its
bytes and a rolled-back upload leaves nothing behind; a hard delete removes the blob in the
transaction that finds it unreferenced, so once the delete's 204 is sent no process can read
the bytes through the database. (PostgreSQL reclaims the dead tuple's disk space at the next
VACUUM, SQLite reuses its pages: as with a deleted file, the bytes are gone from every reader,
not scrubbed from the disk.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import ImgretError
from imgret.gallery.media.files import MediaBackend, MediaStore
from imgret.gallery.storage import bulk, item_store
from imgret.gallery.storage.tables import MediaBlob, utcnow
from imgret.settings import Settings


class DatabaseMediaStore:
    """Image bytes in ``media_blobs``, keyed by content hash (a :class:`MediaBackend`).

    Args:
        session_factory: sessions on the gallery database, for reads (writes and removals
            use the caller's session).
    """

    backend: ClassVar[str] = "database"
    stages_files: ClassVar[bool] = False

    def __init__(self, session_factory: sessionmaker[Session]):
        self.session_factory = session_factory

    relative_path = staticmethod(MediaStore.relative_path)  # the same keys as the files

    def put_many(self, items: Sequence[tuple[bytes, str]], *, session: Session,
                 staged: Mapping[str, str] | None = None) -> list[str]:
        """Store images in ``session``'s transaction; returns their relative paths in the
        order of ``items``.

        Bytes already stored under a key are kept: the key is their hash, and the database
        checks what it stores, unlike a file system after a crash. Call under the gallery
        write lock, like the files. ``staged`` is never set for this store
        (``stages_files`` is false).
        """
        paths = [self.relative_path(sha) for _, sha in items]  # refuses a malformed key
        rows = {sha: data for data, sha in items}
        if not rows:
            return paths
        # The keys already stored are read first, then the others go in with one bulk insert
        # (store.insert_rows, as the gallery rows do): an executemany of INSERT ... ON CONFLICT
        # pays one round of statement handling per row. Safe under the gallery write lock, which
        # every writer of media_blobs holds: no key can appear between the read and the insert
        # (a writer without it would make the insert fail on the key, not store twice).
        for chunk in bulk.chunks(sorted(rows)):
            for sha in session.scalars(select(MediaBlob.sha256)
                                       .where(MediaBlob.sha256.in_(chunk))):
                del rows[sha]
        now = utcnow()
        bulk.insert_rows(session, MediaBlob.__table__,
                          [{"sha256": sha, "data": data, "created_at": now}
                           for sha, data in rows.items()])
        return paths

    def exists(self, sha256: str) -> bool:
        with self.session_factory() as session:
            return session.scalar(
                select(MediaBlob.sha256).where(MediaBlob.sha256 == sha256)
            ) is not None

    def read(self, relative_path: str) -> bytes:
        """The bytes at a relative path from :meth:`put_many` (as stored in the gallery rows).

        Raises:
            FileNotFoundError: no blob under that key (deleted, or never stored here: a
                gallery written with the files backend), as a missing file would.
            ValueError: not a path this store makes (as the files refuse a path outside).
        """
        data = self.read_many([relative_path])[0]
        if data is None:
            raise FileNotFoundError(f"no stored image under {relative_path!r}")
        return data

    def read_many(self, relative_paths: Sequence[str]) -> list[bytes | None]:
        """The bytes of several stored paths in one session and a query per
        ``store.chunks`` of keys; ``None`` where there is no blob.

        Raises:
            ValueError: a path this store does not make (as :meth:`read`).
        """
        keys = []
        for relative_path in relative_paths:
            key = relative_path.rsplit("/", 1)[-1]
            if self.relative_path(key) != relative_path:
                raise ValueError(f"media path {relative_path!r} is not a stored image's")
            keys.append(key)
        found: dict[str, bytes] = {}
        with self.session_factory() as session:
            for chunk in bulk.chunks(sorted(set(keys))):
                found.update(
                    (sha, bytes(data)) for sha, data in session.execute(
                        select(MediaBlob.sha256, MediaBlob.data)
                        .where(MediaBlob.sha256.in_(chunk))
                    )
                )
        return [found.get(key) for key in keys]

    def remove(self, sha256s: Iterable[str], *, session: Session) -> int:
        """Delete these keys' blobs in ``session``'s transaction; returns how many went.

        Call only with keys no row refers to, under the gallery write lock (as the files):
        once that transaction commits, no process reads the bytes any more.
        """
        removed = 0
        for chunk in bulk.chunks(sorted(set(sha256s))):
            result = session.execute(delete(MediaBlob).where(MediaBlob.sha256.in_(chunk)))
            removed += int(result.rowcount or 0)
        return removed

    def stored_keys(self) -> Iterator[str]:
        with self.session_factory() as session:
            yield from session.scalars(select(MediaBlob.sha256)).all()

    def sweep_temporaries(self) -> int:
        """Nothing to sweep: a killed write rolls back with its transaction."""
        return 0


def open_media_store(settings: Settings, session_factory: sessionmaker[Session]) -> MediaBackend:
    """The media store of the settings in force (``IMGRET_MEDIA_BACKEND``): the one place that
    chooses it, for the service, the CLI jobs and the demo.

    Args:
        settings: ``media_backend`` and ``data_dir``.
        session_factory: sessions on the gallery database (the database store reads with
            them).
    """
    if settings.media_backend == "database":
        return DatabaseMediaStore(session_factory)
    return MediaStore.in_data_dir(settings.data_dir)


@dataclass
class MediaMigration:
    """What :func:`migrate_media` did.

    Attributes:
        source, target: the backends' names.
        moved: images copied to the target and then removed from the source.
        missing: images rows refer to that the source did not hold (nothing to move).
        leftovers: bytes no row refers to (any more), removed from the source.
        seconds: wall time.
    """

    source: str
    target: str
    moved: int = 0
    missing: int = 0
    leftovers: int = 0
    seconds: float = 0.0


def migrate_media(
    *, source: MediaBackend, target: MediaBackend, session_factory: sessionmaker[Session],
    batch_size: int = 256, on_batch: Callable[[int], None] | None = None,
) -> MediaMigration:
    """Move every image the gallery and the query sets refer to from one media backend to the
    other, and leave none in the source (``imgret media migrate``).

    Meant to run with the servers stopped, between the last process of the old setting and
    the first of the new one. Per batch, under the gallery write lock: the batch's images
    that rows still refer to are read from the source and made durable in the target (files
    synced, blobs committed), the ones deleted since the listing are removed from the source
    (not copied: nothing would remove them from the target), then the copied ones are removed
    from the source in a second transaction. A crash between the two leaves a batch in both
    stores, which a re-run moves again (writing a key the target holds is a no-op), so the
    command can always be run again until it says nothing is left. Bytes no row refers to
    are removed from the source at the end: after a migration the old store holds nothing,
    so no deleted image survives there.

    Processes already on the new backend may write meanwhile (tested beside one adding and
    deleting items): when this returns, the target holds the bytes of every item committed
    before, neither store holds the bytes of an item whose delete was acknowledged, and the
    source holds nothing (bytes of an image deleted before the listing and uploaded again
    during the run move in a final pass over what the source still holds). Processes still
    on the old backend are not covered, nor tested: images they add after the listing stay in the
    source only (run this again once they are stopped), and moved images they delete keep
    their bytes in the target until its start-up sweep.

    Args:
        source, target: the two stores (``open_media_store`` of each setting).
        session_factory: sessions on the gallery database.
        batch_size: images per transaction.
        on_batch: called with the number of images of each batch done (progress).
    """
    if source.backend == target.backend:
        raise ImgretError(f"the media are in the {source.backend} backend already")
    started = time.perf_counter()
    report = MediaMigration(source.backend, target.backend)
    with session_factory() as session:
        keys = sorted(item_store.referenced_media(session=session))
    _move_batches(keys, source=source, target=target, session_factory=session_factory,
                  batch_size=batch_size, on_batch=on_batch, report=report, count_missing=True)
    # What the source still holds: bytes no row referred to at the listing, some of which a
    # live writer may have uploaded again since (referenced now, yet never listed). The same
    # batches move the referenced ones and remove the rest, each asked under the lock; not the
    # start-up sweep, which would drop re-uploaded bytes the target lacks.
    _move_batches(sorted(source.stored_keys()), source=source, target=target,
                  session_factory=session_factory, batch_size=batch_size, on_batch=None,
                  report=report, count_missing=False)
    source.sweep_temporaries()
    report.seconds = time.perf_counter() - started
    return report


def _move_batches(
    keys: list[str], *, source: MediaBackend, target: MediaBackend,
    session_factory: sessionmaker[Session], batch_size: int,
    on_batch: Callable[[int], None] | None, report: MediaMigration, count_missing: bool,
) -> None:
    """One pass of :func:`migrate_media` over ``keys``, ``batch_size`` at a time."""
    for start in range(0, len(keys), batch_size):
        batch = keys[start : start + batch_size]
        with session_factory.begin() as session:
            item_store.lock_gallery_writes(session=session)
            # Asked again under the lock: a live writer may have deleted some since the listing.
            gone = item_store.unreferenced_media(batch, session=session)
            live = [key for key in batch if key not in gone]
            found = source.read_many([MediaStore.relative_path(key) for key in live])
            present = [(data, key) for data, key in zip(found, live, strict=True)
                       if data is not None]
            if count_missing:
                report.missing += len(live) - len(present)
            target.put_many(present, session=session)
            report.leftovers += source.remove(gone, session=session)
        with session_factory.begin() as session:
            item_store.lock_gallery_writes(session=session)
            report.moved += source.remove([key for _, key in present], session=session)
        if on_batch is not None:
            on_batch(len(batch))
