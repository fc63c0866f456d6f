"""Repository functions over the gallery tables: items, embeddings, the change log, query
sets, and the model versions they are embedded with (which one is active:
:func:`active_model_version`). With :mod:`imgret.index.version_store` (a version's checkpoint,
activations and re-embedding job), the only modules that query or write the gallery's
tables (a backup copies them whole: :mod:`imgret.index.backup`).

Every function takes ``session`` keyword-only and never commits: the caller frames the
transaction (``with sessionmaker.begin() as session:``), so a request or an ingest chunk is
all-or-nothing. Vectors cross this boundary as NumPy arrays: ``(n, d) float32`` rows and
``(n,) int64`` ids.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import JSON, Connection, bindparam, func, select, text, update
from sqlalchemy import delete as sa_delete
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from imgret.errors import GalleryError
from imgret.index.models import (
    CHANGE_ADD,
    CHANGE_DELETE,
    DEFAULT_COLLECTION_ID,
    Collection,
    Embedding,
    GalleryChange,
    GalleryItem,
    ModelVersion,
    QueryEmbedding,
    QueryItem,
    QuerySet,
    utcnow,
)
from imgret.index.scope import ALL_COLLECTIONS, collection_of

logger = logging.getLogger(__name__)

# Any constant: every writer of gallery rows takes this PostgreSQL advisory lock.
_GALLERY_WRITE_LOCK_KEY = 0x67616C6C  # "gall"
# Bind-parameter lists are chunked: SQLite allows 32,766 variables per statement.
_IN_CHUNK = 2_000
# What a deleted row keeps instead of its personal data (see delete_items). The label, the
# hash and the path are NOT NULL columns: the empty string, which no live row has (labels
# are checked non-empty, hashes and paths are always set), so it also marks a cleared row.
DELETED_LABEL = ""
_CLEARED = {"label": DELETED_LABEL, "camera": None, "meta": {}, "source": None,
            "sha256": "", "media_path": ""}


@dataclass(frozen=True, slots=True)
class ItemInfo:
    """What search filters look at: an item's label, camera and metadata."""

    label: str
    camera: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


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
class VectorPage:
    """A page of embeddings: ``ids (n,) int64`` ascending, ``vectors (n, d) float32``."""

    ids: np.ndarray
    vectors: np.ndarray
    infos: list[ItemInfo]


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


@dataclass(frozen=True)
class ChangeRow:
    """One entry of the gallery change log."""

    seq: int
    item_id: int
    op: str


# --------------------------------------------------------------------------- encoding


def encode_vector(vector: np.ndarray) -> bytes:
    """One ``(d,)`` vector as little-endian float32 bytes (the ``embeddings.vector`` format)."""
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()


def decode_vectors(blobs: Sequence[bytes], dim: int) -> np.ndarray:
    """Stored vector bytes back to a ``(n, dim)`` float32 array (one copy)."""
    if not blobs:
        return np.zeros((0, dim), dtype=np.float32)
    flat = np.frombuffer(b"".join(blobs), dtype="<f4")
    if flat.size != len(blobs) * dim:
        raise GalleryError(f"stored vectors are not all {dim}-dimensional")
    if not np.isfinite(flat).all():
        # Written before non-finite vectors were refused (_check_vectors): nothing can rank
        # them, so every reader (an index, an evaluation, a search by id) refuses them too.
        raise GalleryError(
            "stored vectors hold NaN or infinite values (written by an older release from a "
            "model that produced them); delete that model version and register one whose "
            "vectors are finite")
    return flat.reshape(len(blobs), dim).astype(np.float32, copy=False)


# --------------------------------------------------------------------------- model versions


def register_model_version(
    *, session: Session, version: str, dim: int, config: Mapping[str, Any] | None = None
) -> ModelVersion:
    """Get or create a model version; the first one registered becomes the active one.

    Safe against concurrent registration (several API processes starting together): the
    insert runs in a savepoint and a unique-key conflict reads the winner's row instead.
    """
    row = session.scalar(select(ModelVersion).where(ModelVersion.version == version))
    if row is None:
        has_active = active_model_version(session=session) is not None
        # Try as the active version if there is none yet, else (or on a lost race) inactive.
        for is_active in (True, False) if not has_active else (False,):
            try:
                with session.begin_nested():
                    row = ModelVersion(
                        version=version, dim=dim, config=dict(config or {}), is_active=is_active
                    )
                    session.add(row)
                    session.flush()
                logger.info("registered model version %s (dim %d, active: %s)", version, dim,
                            is_active)
                break
            except IntegrityError:
                # Another process registered this version, or another one as active.
                row = session.scalar(select(ModelVersion).where(ModelVersion.version == version))
                if row is not None:
                    break
    if row is None:
        raise GalleryError(f"could not register model version {version}")
    if row.dim != dim:
        raise GalleryError(f"model version {version} is registered with dim {row.dim}, not {dim}")
    return row


def get_model_version(*, session: Session, version: str | None = None) -> ModelVersion:
    """A model version by name, or the active one when ``version`` is ``None``.

    Raises:
        GalleryError: no such version, or no active version (nothing ingested yet).
    """
    if version is None:
        row = active_model_version(session=session)
        if row is None:
            raise GalleryError(
                "no active model version: the gallery is empty; run "
                "`imgret ingest PATH --model CKPT` first"
            )
        return row
    row = session.scalar(select(ModelVersion).where(ModelVersion.version == version))
    if row is None:
        known = session.scalars(select(ModelVersion.version)).all()
        raise GalleryError(
            f"unknown model version {version!r}; known: {', '.join(known) or 'none'}"
        )
    return row


def active_model_version(*, session: Session) -> ModelVersion | None:
    """The active model version (the one searches and writes use), ``None`` before any."""
    return session.scalar(select(ModelVersion).where(ModelVersion.is_active))


def activate_model_version(*, session: Session, version: str) -> ModelVersion:
    """Make ``version`` the active one (blue/green switch): one UPDATE pair, one transaction."""
    row = get_model_version(session=session, version=version)
    session.execute(update(ModelVersion).where(ModelVersion.is_active).values(is_active=False))
    session.flush()
    row.is_active = True
    session.flush()
    return row


class ModelSwitched(GalleryError):
    """The served model version changed while a write was being embedded (retry with the
    new one). Attributes: ``active``: the version now active."""

    def __init__(self, written: str, active: str | None):
        self.active = active
        super().__init__(f"the served model version changed from {written} to {active} while "
                         "this upload was embedded; send it again")


def check_active(*, session: Session, version: ModelVersion) -> None:
    """Refuse a gallery write embedded with a version that is no longer the active one.

    Call it under :func:`lock_gallery_writes`: an activation flips the flag under the same
    lock, so a write that passes this check commits before the switch (and the switch embeds
    it for the new version) or not at all.

    Raises:
        ModelSwitched: another version is active.
    """
    active = active_model_version(session=session)
    if active is not None and active.id != version.id:
        raise ModelSwitched(version.version, active.version)


def list_model_versions(*, session: Session) -> list[ModelVersion]:
    return list(session.scalars(select(ModelVersion).order_by(ModelVersion.id)))


# --------------------------------------------------------------------------- gallery writes


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
    for chunk in _chunks(sorted(set(sha256s))):
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
    for chunk in _chunks(sorted(set(item_ids))):
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
    for chunk in _chunks(wanted):
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
    for chunk in _chunks(ids):
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
    """The content hashes that no live gallery item and no query item refers to any more, in
    any collection (the media store is shared: the same photo in two collections is one file).

    Their files may be removed from the media store, provided the caller holds the gallery
    write lock (:func:`lock_gallery_writes`) until the files are gone: writers store media
    under that lock, so no new row can start referring to a hash meanwhile.
    """
    wanted = sorted(set(sha256s))
    used: set[str] = set()
    for chunk in _chunks(wanted):
        used.update(session.scalars(
            select(GalleryItem.sha256).where(
                GalleryItem.sha256.in_(chunk), GalleryItem.deleted_at.is_(None)
            ).execution_options(**{ALL_COLLECTIONS: True})
        ))
        used.update(session.scalars(
            select(QueryItem.sha256).where(QueryItem.sha256.in_(chunk))
            .execution_options(**{ALL_COLLECTIONS: True})
        ))
    return set(wanted) - used


def referenced_media(*, session: Session) -> set[str]:
    """Every content hash a live gallery item or a query item of any collection refers to
    (the media sweep)."""
    used = set(session.scalars(
        select(GalleryItem.sha256).where(GalleryItem.deleted_at.is_(None))
        .execution_options(**{ALL_COLLECTIONS: True})
    ))
    used.update(session.scalars(
        select(QueryItem.sha256).execution_options(**{ALL_COLLECTIONS: True})))
    return used


def _live_ids(item_ids: Iterable[int], *, session: Session) -> set[int]:
    live: set[int] = set()
    for chunk in _chunks(sorted({int(i) for i in item_ids})):
        live.update(session.scalars(
            select(GalleryItem.id).where(
                GalleryItem.id.in_(chunk), GalleryItem.deleted_at.is_(None)
            )
        ))
    return live


# --------------------------------------------------------------------------- gallery reads


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
    for chunk in _chunks(sorted({int(i) for i in item_ids})):
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


def max_change_seq(*, session: Session) -> int:
    """The newest change-log sequence number (0 for an empty log)."""
    return int(session.scalar(select(func.max(GalleryChange.seq))) or 0)


def changes_after(seq: int, *, session: Session, limit: int = 10_000) -> list[ChangeRow]:
    """Change-log rows with ``seq > seq``, oldest first (at most ``limit``)."""
    rows = session.execute(
        select(GalleryChange.seq, GalleryChange.item_id, GalleryChange.op)
        .where(GalleryChange.seq > seq)
        .order_by(GalleryChange.seq)
        .limit(limit)
    )
    return [ChangeRow(int(s), int(i), o) for s, i, o in rows]


# Built once: the statement runs before every search batch, so its compiled form is cached.
_DELETES_AFTER = (
    select(GalleryChange.seq, GalleryChange.item_id, GalleryChange.op,
           GalleryChange.collection_id)
    .where(GalleryChange.seq > bindparam("after"))
    .where(
        ((GalleryChange.op == CHANGE_DELETE)
         & (GalleryChange.collection_id == bindparam("collection_id")))
        | (GalleryChange.seq == select(func.max(GalleryChange.seq)).scalar_subquery())
    )
    .order_by(GalleryChange.seq)
)


def deletes_after(
    seq: int, *, connection: Connection | Session, collection_id: int = DEFAULT_COLLECTION_ID
) -> tuple[list[int], int]:
    """The ids deleted in a collection after change ``seq``, and the newest change sequence
    number (of any collection: sequence numbers are shared).

    One statement, so both answers come from one snapshot: nothing committed between them
    can be skipped. Cheap enough to run before every search batch (an index range scan over
    the few changes since the last call); the Searcher runs it on a plain Core connection,
    which skips an ORM session's overhead.

    Returns:
        ``(deleted_ids, last_seq)``; ``last_seq`` is ``seq`` when nothing changed.
    """
    rows = connection.execute(
        _DELETES_AFTER, {"after": int(seq), "collection_id": int(collection_id)}
    ).all()
    if not rows:
        return [], seq
    # The newest row may be another collection's: it only carries the position.
    deleted = [int(i) for _, i, op, owner in rows
               if op == CHANGE_DELETE and owner == collection_id]
    return deleted, int(rows[-1][0])


def count_vectors(*, session: Session, model_version_id: int) -> int:
    """How many live items have an embedding for the model version."""
    return int(
        session.scalar(
            select(func.count())
            .select_from(Embedding)
            .join(GalleryItem, GalleryItem.id == Embedding.item_id)
            .where(Embedding.model_version_id == model_version_id, GalleryItem.deleted_at.is_(None))
        )
        or 0
    )


def iter_vector_pages(
    *, session: Session, model_version: ModelVersion, page_size: int = 10_000,
    with_vectors: bool = True,
) -> Iterator[VectorPage]:
    """Stream the live embeddings of a model version in ascending id pages.

    Keyset pagination (``item_id > last``) on the primary key: every page is one indexed
    range scan, and at most one page is in memory, whatever the gallery size.

    Args:
        session: a session (read-only use).
        model_version: whose embeddings.
        page_size: rows per page.
        with_vectors: ``False`` streams ids and infos only (``vectors`` is then ``(n, 0)``).
    """
    last = -1
    columns = [Embedding.item_id, GalleryItem.label, GalleryItem.camera, GalleryItem.meta]
    if with_vectors:
        columns.append(Embedding.vector)
    while True:
        rows = session.execute(
            select(*columns)
            .join(GalleryItem, GalleryItem.id == Embedding.item_id)
            .where(
                Embedding.model_version_id == model_version.id,
                Embedding.item_id > last,
                GalleryItem.deleted_at.is_(None),
            )
            .order_by(Embedding.item_id)
            .limit(page_size)
        ).all()
        if not rows:
            return
        yield _page(rows, model_version.dim, with_vectors)
        last = int(rows[-1][0])


def fetch_vectors(
    item_ids: Iterable[int], *, session: Session, model_version: ModelVersion
) -> VectorPage:
    """Embeddings of specific live items for a model version (ids without one are left out)."""
    rows: list = []
    for chunk in _chunks(sorted({int(i) for i in item_ids})):
        rows.extend(
            session.execute(
                select(
                    Embedding.item_id, GalleryItem.label, GalleryItem.camera, GalleryItem.meta,
                    Embedding.vector,
                )
                .join(GalleryItem, GalleryItem.id == Embedding.item_id)
                .where(
                    Embedding.model_version_id == model_version.id,
                    Embedding.item_id.in_(chunk),
                    GalleryItem.deleted_at.is_(None),
                )
                .order_by(Embedding.item_id)
            ).all()
        )
    return _page(rows, model_version.dim, True)


# --------------------------------------------------------------------------- query sets


def get_or_create_query_set(name: str, *, session: Session) -> QuerySet:
    """The query set called ``name``, created empty if needed."""
    row = session.scalar(select(QuerySet).where(QuerySet.name == name))
    if row is None:
        row = QuerySet(name=name)
        session.add(row)
        session.flush()
    return row


def load_query_set(
    name: str, *, session: Session, model_version: ModelVersion | None = None
) -> tuple[list[QueryItem], np.ndarray | None]:
    """The items of a query set in id order, and their vectors for ``model_version``.

    Returns:
        ``(items, vectors)`` where ``vectors`` is ``(len(items), d)`` float32, or ``None``
        when ``model_version`` is ``None``.

    Raises:
        GalleryError: no such query set, or some items lack an embedding for the version
            (re-run ``imgret ingest PATH --query-set NAME --model CKPT`` with that model).
    """
    query_set = session.scalar(select(QuerySet).where(QuerySet.name == name))
    if query_set is None:
        known = session.scalars(select(QuerySet.name).order_by(QuerySet.name)).all()
        raise GalleryError(f"unknown query set {name!r}; known: {', '.join(known) or 'none'}")
    items = list(query_set.items)
    if model_version is None:
        return items, None
    blobs = dict(
        session.execute(
            select(QueryEmbedding.query_item_id, QueryEmbedding.vector)
            .join(QueryItem, QueryItem.id == QueryEmbedding.query_item_id)
            .where(
                QueryEmbedding.model_version_id == model_version.id,
                QueryItem.query_set_id == query_set.id,
            )
        ).all()
    )
    missing = [i.id for i in items if i.id not in blobs]
    if missing:
        raise GalleryError(
            f"query set {name!r}: {len(missing)} of {len(items)} items have no embedding for "
            f"model version {model_version.version}; ingest it again with that model"
        )
    return items, decode_vectors([blobs[i.id] for i in items], model_version.dim)


# --------------------------------------------------------------------------- helpers


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


def _insert_changes(item_ids: Sequence[int], op: str, session: Session) -> None:
    """One change-log row per id, in this order (one Core executemany)."""
    if not item_ids:
        return
    now = utcnow()
    collection_id = collection_of(session)
    insert_rows(session, GalleryChange.__table__,
                [{"item_id": int(i), "op": op, "created_at": now,
                  "collection_id": collection_id} for i in item_ids])


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


def insert_rows(session: Session, table, params: Sequence[Mapping[str, Any]], *,
                return_ids: bool = False) -> list[int]:
    """Insert rows into ``table`` in the session's transaction with one bulk statement.

    PostgreSQL: one ``COPY ... FROM STDIN`` (statement-level triggers fire as for an INSERT).
    SQLite: one DBAPI ``executemany`` of a plain ``INSERT``, each value converted by its
    column type's bind processor, so rows are stored exactly as SQLAlchemy stores them (a
    timestamp shared by every row is converted once). Both skip SQLAlchemy's per-row
    parameter handling, the larger part of an ingest chunk's insert cost.

    Every row has the same keys; JSON columns are given as dicts.

    Args:
        return_ids: also return the new rows' primary keys, in the order of ``params``.
            PostgreSQL draws them from the column's sequence first. SQLite reads them back:
            with ``AUTOINCREMENT`` every new id is larger than any the table ever had, and
            the transaction holds the database's write lock from its first write, so the
            rows just inserted are the table's ``len(params)`` largest ids.

    Returns:
        The new ids with ``return_ids``, else an empty list.
    """
    if return_ids and not table.kwargs.get("sqlite_autoincrement"):
        raise ValueError(f"{table.name}: new ids come back only from a table whose ids are "
                         "never reused (sqlite_autoincrement)")
    if not params:
        return []
    if session.get_bind().dialect.name == "postgresql":
        return _copy_rows(session, table, params, return_ids)
    _executemany_rows(session, table, params)
    if not return_ids:
        return []
    key = next(iter(table.primary_key.columns))
    newest = session.scalars(select(key).order_by(key.desc()).limit(len(params)))
    return [int(i) for i in reversed(newest.all())]


def _copy_rows(session: Session, table, params: Sequence[Mapping[str, Any]],
               return_ids: bool) -> list[int]:
    """:func:`insert_rows` on PostgreSQL: the ids from the sequence, then one ``COPY``."""
    from psycopg.types.json import Jsonb

    columns = list(params[0])
    ids: list[int] = []
    if return_ids:
        key = next(iter(table.primary_key.columns)).name
        ids = sorted(int(i) for i in session.scalars(
            text("SELECT nextval(pg_get_serial_sequence(:t, :c)) FROM generate_series(1, :n)"),
            {"t": table.name, "c": key, "n": len(params)}))
        params = [{**row, key: i} for row, i in zip(params, ids, strict=True)]
        columns.append(key)
    json_columns = {c for c in columns if isinstance(table.c[c].type, JSON)}
    names = ", ".join(f'"{c}"' for c in columns)
    raw = session.connection().connection.driver_connection
    with raw.cursor() as cursor, cursor.copy(
        f'COPY "{table.name}" ({names}) FROM STDIN'
    ) as copy:
        for row in params:
            copy.write_row([Jsonb(row[c]) if c in json_columns else row[c] for c in columns])
    return ids


def _executemany_rows(session: Session, table, params: Sequence[Mapping[str, Any]]) -> None:
    """:func:`insert_rows` on SQLite: one DBAPI ``executemany`` of the converted values."""
    connection = session.connection()
    columns = list(params[0])
    values = [_bound(table.c[c].type, connection.dialect, [row[c] for row in params])
              for c in columns]
    names = ", ".join(f'"{c}"' for c in columns)
    cursor = connection.connection.driver_connection.cursor()
    try:
        cursor.executemany(
            f'INSERT INTO "{table.name}" ({names}) VALUES ({", ".join("?" * len(columns))})',
            zip(*values, strict=True))
    finally:
        cursor.close()


def _bound(column_type, dialect, values: list) -> list:
    """A column's values as SQLAlchemy hands them to the driver (its type's bind processor);
    a value repeated in a row (the rows' shared timestamp) is converted once."""
    process = column_type.dialect_impl(dialect).bind_processor(dialect)
    if process is None:
        return values
    out, last, converted = [], object(), None
    for value in values:
        if value is not last:
            last, converted = value, (None if value is None else process(value))
        out.append(converted)
    return out


def _page(rows: Sequence, dim: int, with_vectors: bool) -> VectorPage:
    ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    infos = [ItemInfo(r[1], r[2], r[3] or {}) for r in rows]
    if with_vectors:
        vectors = decode_vectors([r[4] for r in rows], dim)
    else:
        vectors = np.zeros((len(rows), 0), dtype=np.float32)
    return VectorPage(ids, vectors, infos)


def chunks(values: Sequence) -> Iterator[Sequence]:
    """Slices of ``values`` short enough for one ``IN (...)`` list on every database."""
    for start in range(0, len(values), _IN_CHUNK):
        yield values[start : start + _IN_CHUNK]


_chunks = chunks  # this module's own call sites


def query_set_sizes(*, session: Session) -> list[tuple[str, int]]:
    """Every stored query set's name and number of items, by name."""
    rows = session.execute(
        select(QuerySet.name, func.count(QueryItem.id))
        .outerjoin(QueryItem, QueryItem.query_set_id == QuerySet.id)
        .group_by(QuerySet.id, QuerySet.name).order_by(QuerySet.name)
    )
    return [(name, int(count)) for name, count in rows]


def get_query_item(query_set: str, item_id: int, *, session: Session) -> QueryItem | None:
    """Item ``item_id`` of the query set named ``query_set``, or ``None``."""
    return session.scalar(
        select(QueryItem).join(QuerySet, QuerySet.id == QueryItem.query_set_id)
        .where(QuerySet.name == query_set, QueryItem.id == item_id)
    )
