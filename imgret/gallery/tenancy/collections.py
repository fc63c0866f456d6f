"""Collections: named galleries in one database, each with its own items, query sets, model
versions (bound checkpoints), index files and change-log rows.

Everything a collection owns carries its id
(:class:`imgret.gallery.storage.tables.CollectionScoped`) and is read through sessions scoped to it
(:mod:`imgret.gallery.storage.scope`). This module creates, lists and deletes the collections
themselves.

Decisions:

- **Names** are what URLs and the CLI use: 1-64 characters, lower-case letters, digits, ``-``
  and ``_``, starting with a letter or digit (no case or Unicode look-alikes, nothing a URL
  must escape). ``default`` is the gallery a single-gallery deployment always had: it cannot
  be created or deleted. ``all`` means every collection on the command line and is reserved.
- **A new collection binds a checkpoint** already stored in the database (by version name,
  by default the one ``default`` serves): its row and bytes are copied into the collection,
  which then serves it. The same weights in two collections are two version rows: each has
  its own active flag, coverage, re-embedding job, calibration and history.
- **Deleting is final**: one transaction under the gallery write lock deletes the collection
  row and the database cascades to its items, vectors, query sets, versions, calibrations and
  change-log rows (SQLite zeroes the freed pages); then the image bytes no other collection
  refers to are removed (crash-safely: the start-up sweep removes what a crash left), and
  its index files. Every process answers 404 for it from then on: requests look the name up
  in SQL first.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import GalleryError
from imgret.gallery.media.files import MediaBackend
from imgret.gallery.media.gc import purge_media
from imgret.gallery.search.manifest import collection_root
from imgret.gallery.storage import item_store
from imgret.gallery.storage.item_store import CollectionNotFound
from imgret.gallery.storage.scope import ALL_COLLECTIONS
from imgret.gallery.storage.tables import (
    DEFAULT_COLLECTION,
    Collection,
    GalleryItem,
    ModelCheckpoint,
    ModelVersion,
    QueryItem,
    QuerySet,
    UnknownFace,
    utcnow,
)
from imgret.gallery.versions import version_store

__all__ = ["CollectionNotFound"]  # defined beside the writes that check it; named here too
from imgret.settings import COLLECTION_NAME_PATTERN

logger = logging.getLogger(__name__)

NAME_PATTERN = COLLECTION_NAME_PATTERN
RESERVED_NAMES = frozenset({DEFAULT_COLLECTION, "all"})
_NAME = re.compile(NAME_PATTERN)
_EVERY = {ALL_COLLECTIONS: True}


class CollectionExists(GalleryError):
    """A collection of that name exists already (409)."""


class VersionNotStored(GalleryError):
    """The version a new collection should serve is not stored in the database (422)."""


@dataclass(frozen=True)
class CollectionInfo:
    """A collection as ``GET /collections`` shows it."""

    id: int
    name: str
    public: bool
    created_at: datetime
    items: int
    active_version: str | None
    unknowns_days: int = 0

    def to_dict(self) -> dict:
        return {"name": self.name, "public": self.public, "created_at": self.created_at,
                "items": self.items, "active_version": self.active_version,
                "unknowns_days": self.unknowns_days}


def check_name(name: str) -> str:
    """``name`` if it can name a collection.

    Raises:
        ValueError: with the rule it breaks (a 422 in the service).
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError("a collection name is 1-64 characters: lower-case letters, digits, "
                         "'-' and '_', starting with a letter or digit")
    return name


def find(name: str, *, session: Session) -> Collection | None:
    """The collection called ``name``, ``None`` if there is none (or the name is invalid)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return None
    return session.scalar(select(Collection).where(Collection.name == name))


def get(name: str, *, session: Session) -> Collection:
    """The collection called ``name``.

    Raises:
        CollectionNotFound: there is none.
    """
    row = find(name, session=session)
    if row is None:
        raise CollectionNotFound(f"no collection named {name!r}")
    return row


def describe(*, session_factory: sessionmaker[Session],
             name: str | None = None) -> list[CollectionInfo]:
    """Every collection (or the one called ``name``), oldest first, with its live item count
    and active version.

    Raises:
        CollectionNotFound: ``name`` names none.
    """
    with session_factory() as session:
        where = [] if name is None else [Collection.name == name]
        rows = session.scalars(select(Collection).where(*where).order_by(Collection.id)).all()
        if name is not None and not rows:
            raise CollectionNotFound(f"no collection named {name!r}")
        counts = dict(session.execute(
            select(GalleryItem.collection_id, func.count())
            .where(GalleryItem.deleted_at.is_(None))
            .group_by(GalleryItem.collection_id).execution_options(**_EVERY)
        ).all())
        active = dict(session.execute(
            select(ModelVersion.collection_id, ModelVersion.version)
            .where(ModelVersion.is_active).execution_options(**_EVERY)
        ).all())
        return [CollectionInfo(r.id, r.name, bool(r.public), r.created_at,
                               int(counts.get(r.id, 0)), active.get(r.id),
                               int(r.unknowns_days or 0)) for r in rows]


def create(name: str, *, session_factory: sessionmaker[Session], version: str | None = None,
           public: bool = True) -> CollectionInfo:
    """Create an empty collection serving ``version`` (a version name stored in any
    collection; by default the one ``default`` serves).

    Raises:
        ValueError: an invalid or reserved name.
        CollectionExists: the name is taken.
        VersionNotStored: ``version`` is not stored in the database.
    """
    check_name(name)
    if name in RESERVED_NAMES:
        raise ValueError(f"{name!r} is reserved")
    with session_factory.begin() as session:
        source = _source_version(session, version)
        try:
            with session.begin_nested():
                row = Collection(name=name, public=public)
                session.add(row)
                session.flush()
        except IntegrityError:
            raise CollectionExists(f"a collection named {name!r} exists already") from None
        _bind_version(session, source, row.id)
        collection_id = row.id
    logger.info("created collection %s (id %d) serving %s", name, collection_id,
                source.version)
    return describe(session_factory=session_factory, name=name)[0]


def update(name: str, *, session_factory: sessionmaker[Session], public: bool | None = None,
           unknowns_days: int | None = None) -> CollectionInfo:
    """Change what is given: whether reads are public (no key) or private (a key with
    ``read``), and how many days ``/identify``'s unknowns are kept (0: none; lowering it
    expires the older ones at the next unknown kept).

    Raises:
        CollectionNotFound: no such collection.
    """
    with session_factory.begin() as session:
        row = get(name, session=session)
        if public is not None:
            row.public = public
        if unknowns_days is not None:
            row.unknowns_days = int(unknowns_days)
    return describe(session_factory=session_factory, name=name)[0]


def _source_version(session: Session, version: str | None) -> ModelVersion:
    where = ([ModelVersion.version == version] if version is not None
             else [ModelVersion.is_active, ModelVersion.collection_id == 1])
    row = session.scalars(
        select(ModelVersion).where(*where).order_by(ModelVersion.id).limit(1)
        .execution_options(**_EVERY)
    ).first()
    if row is None or session.get(ModelCheckpoint, row.id) is None:
        what = f"model version {version!r}" if version else "the default collection's version"
        raise VersionNotStored(f"{what} is not stored in the database; register it first")
    return row


def _bind_version(session: Session, source: ModelVersion, collection_id: int) -> None:
    """Copy a version row (identity and config, none of its state) and its checkpoint bytes
    into a collection, as its active version. The bytes are copied by the database
    (INSERT ... SELECT): they never pass through this process."""
    bound = ModelVersion(collection_id=collection_id, version=source.version, dim=source.dim,
                         config=dict(source.config or {}), is_active=True,
                         checkpoint_sha256=source.checkpoint_sha256,
                         content_digest=source.content_digest, activated_at=utcnow())
    session.add(bound)
    session.flush()
    session.execute(
        text("INSERT INTO model_checkpoints (model_version_id, sha256, size, data, created_at) "
             "SELECT :new, sha256, size, data, created_at FROM model_checkpoints "
             "WHERE model_version_id = :old"),
        {"new": bound.id, "old": source.id},
    )
    version_store.record_activation(bound, session=session, previous=None, reason="register")


def delete(name: str, *, session_factory: sessionmaker[Session], media: MediaBackend,
           data_dir: str | Path,
           drop_vectors: Callable[[int, str | None], None] | None = None) -> int:
    """Delete a collection and everything it owns (see the module's decisions).

    ``drop_vectors(collection_id, None)`` is called after the commit when the vectors also
    live in an engine outside SQL (the Milvus backend: its collections are dropped).

    Returns:
        How many live items it had.

    Raises:
        ValueError: ``default``.
        CollectionNotFound: no such collection.
    """
    if name == DEFAULT_COLLECTION:
        raise ValueError("the default collection cannot be deleted")
    with session_factory.begin() as session:
        item_store.lock_gallery_writes(session=session)
        row = get(name, session=session)
        collection_id = row.id
        items = session.execute(
            select(GalleryItem.sha256, GalleryItem.deleted_at)
            .where(GalleryItem.collection_id == collection_id).execution_options(**_EVERY)
        ).all()
        shas = {sha for sha, _ in items if sha}
        shas.update(session.scalars(
            select(QueryItem.sha256).join(QuerySet, QuerySet.id == QueryItem.query_set_id)
            .where(QuerySet.collection_id == collection_id).execution_options(**_EVERY)
        ))
        shas.update(session.scalars(  # the kept unknowns' images go with it too
            select(UnknownFace.sha256).where(UnknownFace.collection_id == collection_id)
            .execution_options(**_EVERY)))
        if session.get_bind().dialect.name == "sqlite":
            session.execute(text("PRAGMA secure_delete = ON"))
        session.delete(row)
    live = sum(1 for _, deleted_at in items if deleted_at is None)
    removed = purge_media(shas, session_factory=session_factory, media=media)
    shutil.rmtree(collection_root(data_dir, collection_id), ignore_errors=True)
    if drop_vectors is not None:
        drop_vectors(collection_id, None)
    logger.info("deleted collection %s: %d items, %d stored images", name, live, removed)
    return live
