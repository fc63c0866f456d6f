"""The SQL of gallery items and their vectors: the write lock, inserts, deletes that clear personal
data, dedup lookups, reads and listings, and whether image bytes are still referenced.

Every function takes ``session`` keyword-only and never commits: the caller frames the
transaction."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, func, select, text, update
from sqlalchemy import delete as sa_delete
from sqlalchemy.orm import Session

from imgret.errors import GalleryError
from imgret.gallery.storage.bulk import chunks, insert_rows
from imgret.gallery.storage.change_log import _insert_changes
from imgret.gallery.storage.scope import ALL_COLLECTIONS, collection_of
from imgret.gallery.storage.tables import (
    CHANGE_ADD,
    CHANGE_DELETE,
    Collection,
    Embedding,
    GalleryItem,
    ModelVersion,
    QueryEmbedding,
    QueryItem,
    QuerySet,
    UnknownFace,
    utcnow,
)
from imgret.gallery.storage.vector_store import encode_vector

logger = logging.getLogger(__name__)


# Any constant: every writer of gallery rows takes this PostgreSQL advisory lock.
_GALLERY_WRITE_LOCK_KEY = 0x67616C6C  # "gall"


# What a deleted row keeps instead of its personal data (see delete_items). The label, the
# hash and the path are NOT NULL columns: the empty string, which no live row has (labels
# are checked non-empty, hashes and paths are always set), so it also marks a cleared row.
DELETED_LABEL = ""


_CLEARED = {"label": DELETED_LABEL, "camera": None, "meta": {}, "source": None,
            "sha256": "", "media_path": ""}




@dataclass(frozen=True)
class NewRow:
    """A gallery or query item about to be inserted (its bytes are already in the media store).

    Attributes:
        sha256: content hash (hex) of the image bytes.
        media_path: where the media store put them (relative path).
        content_type: MIME type of the bytes.
        label, camera, metadata, source: as given by the caller.
    """

    sha256: str
    media_path: str
    content_type: str
    label: str
    camera: int | None = None
    metadata: Mapping[str, Any] | None = None
    source: str | None = None


@dataclass(frozen=True)
class DeletedItem:
    """A gallery item that a delete just took out: its id and where its bytes are."""

    id: int
    sha256: str
    media_path: str


@dataclass(frozen=True)
class KnownItems:
    """The items that already hold some content hashes, and which of them already have one
    model version's vector: what ingest asks before it embeds anything.

    Attributes:
        ids: sha256 -> id of the live gallery item (or the query set's item) with those bytes.
        embedded: the ids among ``ids`` that have the model version's embedding.
    """

    ids: dict[str, int]
    embedded: set[int]

    @property
    def embedded_shas(self) -> set[str]:
        """The hashes that need no embedding: their item already has the version's vector."""
        return {sha for sha, item_id in self.ids.items() if item_id in self.embedded}


def lock_gallery_writes(*, session: Session) -> None:
    """Serialise gallery writers (and media-store changes) until this transaction ends.

    Call it first in a write transaction, before any read whose answer the write relies on
    (dedup, "is this item still live?"): the reads then see every write that committed before,
    and none can commit in between.

    - PostgreSQL: a transaction-scoped advisory lock. Change-log sequence numbers are drawn at
      INSERT time, but transactions may commit in another order; a replica reading
      ``seq > last_seen`` could then skip a late commit for good. Holding one lock from the
      first change row to the commit makes seq order equal commit order.
    - SQLite: a no-op ``UPDATE`` takes the database's write lock now (pysqlite starts the
      transaction at the first write, and a deferred transaction that read first would fail
      with "database is locked" when another writer committed meanwhile); other writers wait
      on the busy timeout, readers go on (WAL).
    """
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _GALLERY_WRITE_LOCK_KEY})
    elif dialect == "sqlite":
        session.execute(text("UPDATE model_versions SET id = id WHERE 1 = 0"))


class CollectionNotFound(GalleryError, LookupError):
    """No collection of that name (404); also a collection deleted while a write to it was
    on its way."""


def require_collection(*, session: Session) -> None:
    """Refuse a write to a collection that no longer exists.

    Call it after :func:`lock_gallery_writes`: deleting a collection takes that lock too, so
    the answer holds until this transaction ends, and a write that races a delete stops
    here, before any image byte is stored.

    Raises:
        CollectionNotFound: the session's collection was deleted.
    """
    collection_id = collection_of(session)
    if session.scalar(select(Collection.id).where(Collection.id == collection_id)) is None:
        raise CollectionNotFound("this collection was deleted")


@dataclass(frozen=True)
class _Tables:
    """Where one kind of stored image lives: its item table and its embedding table."""

    item: type
    embedding: type
    key: str  # the embedding table's column naming the item

    @property
    def embedding_item_id(self):
        return getattr(self.embedding, self.key)


_GALLERY = _Tables(GalleryItem, Embedding, "item_id")


_QUERIES = _Tables(QueryItem, QueryEmbedding, "query_item_id")


# Stands for "the query-set tables" in the calls that only pick tables by their query set
# (re-embedding the items of every query set at once, by item id).
ANY_QUERY_SET: Any = type("AnyQuerySet", (), {"id": None})()


def _tables(query_set: QuerySet | None) -> _Tables:
    return _GALLERY if query_set is None else _QUERIES


def find_items(
    sha256s: Iterable[str], *, session: Session, query_set: QuerySet | None = None
) -> dict[str, int]:
    """Map content hashes to the ids of the items that have them: live (not deleted) gallery
    items, or the items of ``query_set``."""
    tables = _tables(query_set)
    scope = (GalleryItem.deleted_at.is_(None) if query_set is None
             else QueryItem.query_set_id == query_set.id)
    found: dict[str, int] = {}
    for chunk in chunks(sorted(set(sha256s))):
        rows = session.execute(
            select(tables.item.sha256, tables.item.id).where(tables.item.sha256.in_(chunk), scope)
        )
        found.update({sha: item_id for sha, item_id in rows})
    return found


def ids_with_embedding(
    item_ids: Iterable[int], *, session: Session, model_version_id: int,
    query_set: QuerySet | None = None,
) -> set[int]:
    """The subset of ``item_ids`` (gallery items, or items of ``query_set``) that already
    have an embedding for the model version."""
    tables = _tables(query_set)
    have: set[int] = set()
    for chunk in chunks(sorted(set(item_ids))):
        have.update(
            session.scalars(
                select(tables.embedding_item_id).where(
                    tables.embedding.model_version_id == model_version_id,
                    tables.embedding_item_id.in_(chunk),
                )
            )
        )
    return have


def known_items(
    sha256s: Iterable[str], *, session: Session, model_version_id: int,
    query_set: QuerySet | None = None,
) -> KnownItems:
    """The items that have these content hashes (:func:`find_items`) and which of them have
    the model version's vector (:func:`ids_with_embedding`): one question, so the plain and
    the Ray ingest decide "already embedded" the same way."""
    ids = find_items(sha256s, session=session, query_set=query_set)
    embedded = ids_with_embedding(ids.values(), session=session, query_set=query_set,
                                  model_version_id=model_version_id)
    return KnownItems(ids=ids, embedded=embedded)


def insert_items(
    rows: Sequence[NewRow], vectors: np.ndarray, *, session: Session, model_version: ModelVersion,
    query_set: QuerySet | None = None,
) -> list[int]:
    """Insert items with their embeddings: gallery items (each with one ``add`` change row,
    under the gallery write lock) or, with ``query_set``, items of that query set (never
    searchable, so no change rows).

    Args:
        rows: the items (their bytes already stored).
        vectors: ``(len(rows), d)`` float32, unit norm, ``d == model_version.dim``.
        session: the open transaction.
        model_version: the version that produced ``vectors``.
        query_set: where the items go; ``None`` for the gallery.

    Returns:
        The new ids (FAISS ids for gallery items), in the order of ``rows``.
    """
    _check_vectors(vectors, len(rows), model_version)
    if not rows:
        return []
    tables = _tables(query_set)
    if query_set is None:
        lock_gallery_writes(session=session)
    # Query items belong to their set's collection; gallery items name theirs.
    scope = ({"collection_id": collection_of(session)} if query_set is None
             else {"query_set_id": query_set.id})
    now = utcnow()
    table = tables.item.__table__
    params = [
        {
            "sha256": r.sha256, "media_path": r.media_path, "content_type": r.content_type,
            "label": r.label, "camera": r.camera, "metadata": dict(r.metadata or {}),
            "source": r.source, "created_at": now, **scope,
        }
        for r in rows
    ]
    # One bulk statement per table (insert_rows): multi-row INSERTs spent most of their time
    # in the driver re-parsing each long statement (measured by benchmarks/ingest_bench.py).
    ids = insert_rows(session, table, params, return_ids=True)
    if len(ids) != len(rows):
        raise GalleryError(f"inserted {len(rows)} items but got {len(ids)} ids back")
    _insert_embeddings(tables, ids, vectors, session, model_version)
    if query_set is None:
        _insert_changes(ids, CHANGE_ADD, session)
    return ids


def add_embeddings(
    item_ids: Sequence[int], vectors: np.ndarray, *, session: Session,
    model_version: ModelVersion, query_set: QuerySet | None = None,
) -> list[int]:
    """Store embeddings of existing items for another model version (re-embedding).

    Gallery items: only those still live get one (an item deleted since the caller looked is
    skipped: its vector must never reach an index again), and each gets an ``add`` change row,
    so a searcher of that version picks it up. Items of ``query_set`` all get one.

    Returns:
        The ids that got an embedding, in the order given.
    """
    _check_vectors(vectors, len(item_ids), model_version)
    if not item_ids:
        return []
    if query_set is not None:
        ids = [int(i) for i in item_ids]
        _insert_embeddings(_QUERIES, ids, vectors, session, model_version)
        return ids
    lock_gallery_writes(session=session)
    live = _live_ids(item_ids, session=session)
    keep = [row for row, item_id in enumerate(item_ids) if int(item_id) in live]
    ids = [int(item_ids[row]) for row in keep]
    _insert_embeddings(_GALLERY, ids, vectors[keep], session, model_version)
    _insert_changes(ids, CHANGE_ADD, session)
    return ids


def delete_items(item_ids: Iterable[int], *, session: Session) -> list[DeletedItem]:
    """Delete gallery items: mark the rows deleted, clear their personal data, drop their
    embeddings, log the deletes, all in the caller's transaction.

    The row stays (soft delete: the change log points at it and ids are never reused), but
    nothing personal does: the label, camera, metadata and source are cleared, and so are the
    content hash and media path (anyone holding the photo could otherwise prove it was in the
    gallery); the embeddings go too (for face and person galleries a vector is personal data).
    What remains is the id, the content type and the two timestamps. The image bytes are the
    caller's to remove once this commits (:func:`unreferenced_media`); rows deleted before
    deletes cleared them are cleared by :func:`clear_deleted_items` (the start-up sweep).

    Returns:
        The items that were live and are now deleted, with their media paths (unknown or
        already deleted ids are skipped, so a repeated DELETE is harmless).
    """
    wanted = sorted({int(i) for i in item_ids})
    if not wanted:
        return []
    lock_gallery_writes(session=session)
    live: list[DeletedItem] = []
    for chunk in chunks(wanted):
        live.extend(
            DeletedItem(int(i), sha, path)
            for i, sha, path in session.execute(
                select(GalleryItem.id, GalleryItem.sha256, GalleryItem.media_path).where(
                    GalleryItem.id.in_(chunk), GalleryItem.deleted_at.is_(None)
                )
            )
        )
    if not live:
        return []
    if session.get_bind().dialect.name == "sqlite":
        # Zero the freed bytes of the rewritten pages, so the old values do not linger in
        # the file's free space (and in copies of it); PostgreSQL's VACUUM reclaims dead rows.
        session.execute(text("PRAGMA secure_delete = ON"))
    now = utcnow()
    ids = [item.id for item in live]
    for chunk in chunks(ids):
        session.execute(
            update(GalleryItem).where(GalleryItem.id.in_(chunk))
            .values(deleted_at=now, **_CLEARED)
        )
        session.execute(sa_delete(Embedding).where(Embedding.item_id.in_(chunk)))
    _insert_changes(ids, CHANGE_DELETE, session)
    return live


def clear_deleted_items(*, connection: Connection | Session) -> int:
    """Clear the personal data that deleted rows still hold (see :func:`delete_items`): rows
    deleted before deletes cleared it, and rows of an older backup restored since. A cleared
    row has an empty hash, so this finds nothing to do after the first run; it needs no lock
    (deleted rows are never written by anything else).

    Returns:
        How many rows were cleared.
    """
    result = connection.execute(
        update(GalleryItem)
        .where(GalleryItem.deleted_at.is_not(None), GalleryItem.sha256 != "")
        .values(**_CLEARED)
        .execution_options(synchronize_session=False, **{ALL_COLLECTIONS: True})
    )
    return int(result.rowcount or 0)


def unreferenced_media(sha256s: Iterable[str], *, session: Session) -> set[str]:
    """The content hashes that no live gallery item, query item or kept unknown refers to any
    more, in
    any collection (the media store is shared: the same photo in two collections is one file).

    Their files may be removed from the media store, provided the caller holds the gallery
    write lock (:func:`lock_gallery_writes`) until the files are gone: writers store media
    under that lock, so no new row can start referring to a hash meanwhile.
    """
    wanted = sorted(set(sha256s))
    used: set[str] = set()
    for chunk in chunks(wanted):
        used.update(session.scalars(
            select(GalleryItem.sha256).where(
                GalleryItem.sha256.in_(chunk), GalleryItem.deleted_at.is_(None)
            ).execution_options(**{ALL_COLLECTIONS: True})
        ))
        used.update(session.scalars(
            select(QueryItem.sha256).where(QueryItem.sha256.in_(chunk))
            .execution_options(**{ALL_COLLECTIONS: True})
        ))
        used.update(session.scalars(
            select(UnknownFace.sha256).where(UnknownFace.sha256.in_(chunk))
            .execution_options(**{ALL_COLLECTIONS: True})
        ))
    return set(wanted) - used


def referenced_media(*, session: Session) -> set[str]:
    """Every content hash a live gallery item, a query item or a kept unknown of any
    collection refers to (the media sweep)."""
    used = set(session.scalars(
        select(GalleryItem.sha256).where(GalleryItem.deleted_at.is_(None))
        .execution_options(**{ALL_COLLECTIONS: True})
    ))
    used.update(session.scalars(
        select(QueryItem.sha256).execution_options(**{ALL_COLLECTIONS: True})))
    used.update(session.scalars(
        select(UnknownFace.sha256).execution_options(**{ALL_COLLECTIONS: True})))
    return used


def _live_ids(item_ids: Iterable[int], *, session: Session) -> set[int]:
    live: set[int] = set()
    for chunk in chunks(sorted({int(i) for i in item_ids})):
        live.update(session.scalars(
            select(GalleryItem.id).where(
                GalleryItem.id.in_(chunk), GalleryItem.deleted_at.is_(None)
            )
        ))
    return live


def get_item(
    item_id: int, *, session: Session, include_deleted: bool = False
) -> GalleryItem | None:
    """One gallery item, ``None`` when absent (or deleted, unless ``include_deleted``)."""
    item = session.get(GalleryItem, item_id)
    if item is None or (item.deleted_at is not None and not include_deleted):
        return None
    return item


def get_items(item_ids: Sequence[int], *, session: Session) -> dict[int, GalleryItem]:
    """Live items by id (search results → rows); missing or deleted ids are left out."""
    found: dict[int, GalleryItem] = {}
    for chunk in chunks(sorted({int(i) for i in item_ids})):
        for item in session.scalars(
            select(GalleryItem).where(GalleryItem.id.in_(chunk), GalleryItem.deleted_at.is_(None))
        ):
            found[item.id] = item
    return found


def list_items(
    *, session: Session, offset: int = 0, limit: int = 50, label: str | None = None
) -> tuple[list[GalleryItem], int]:
    """A page of live items in id order, and the total count matching ``label``."""
    where = [GalleryItem.deleted_at.is_(None)]
    if label is not None:
        where.append(GalleryItem.label == label)
    total = session.scalar(select(func.count()).select_from(GalleryItem).where(*where)) or 0
    items = session.scalars(
        select(GalleryItem).where(*where).order_by(GalleryItem.id).offset(offset).limit(limit)
    ).all()
    return list(items), int(total)


def spread_items(n: int, *, session: Session) -> list[tuple[int, str]]:
    """Up to ``n`` live gallery items spread evenly over the id order, as ``(id,
    media_path)``: a sample of the gallery across its whole history (ingest order often
    follows classes or sources), the same on every run over the same gallery."""
    ids = session.scalars(select(GalleryItem.id).where(GalleryItem.deleted_at.is_(None))
                          .order_by(GalleryItem.id)).all()
    if not ids or n <= 0:
        return []
    picked = sorted({ids[int(i)] for i in np.linspace(0, len(ids) - 1, min(n, len(ids)))})
    rows = session.execute(select(GalleryItem.id, GalleryItem.media_path)
                           .where(GalleryItem.id.in_(picked)).order_by(GalleryItem.id))
    return [(int(i), path) for i, path in rows]


def count_live_items(*, session: Session) -> int:
    """How many gallery items are live (not deleted)."""
    return int(session.scalar(
        select(func.count()).select_from(GalleryItem).where(GalleryItem.deleted_at.is_(None))
    ) or 0)


def newest_item_id(*, session: Session) -> int | None:
    """The largest gallery item id ever handed out (deleted rows included), ``None`` if none."""
    return session.scalar(select(func.max(GalleryItem.id)))


def _check_vectors(vectors: np.ndarray, n: int, model_version: ModelVersion) -> None:
    if vectors.ndim != 2 or vectors.shape[0] != n or vectors.shape[1] != model_version.dim:
        raise GalleryError(
            f"expected ({n}, {model_version.dim}) vectors for model version "
            f"{model_version.version}, got {tuple(vectors.shape)}"
        )
    if not np.isfinite(vectors).all():
        # Ranked by nothing and served as JSON null: never stored.
        raise GalleryError(f"model version {model_version.version} produced non-finite "
                           "vectors (NaN or infinite values); they are not stored")


def _insert_embeddings(tables: _Tables, ids, vectors, session, model_version) -> None:
    if len(ids) == 0:
        return  # an empty executemany would insert one row of defaults
    vectors = np.asarray(vectors, dtype=np.float32)
    now = utcnow()
    params = [
        {
            "model_version_id": model_version.id,
            tables.key: int(item_id),
            "dim": model_version.dim,
            "vector": encode_vector(vector),
            "created_at": now,
        }
        for item_id, vector in zip(ids, vectors, strict=True)
    ]
    insert_rows(session, tables.embedding.__table__, params)


