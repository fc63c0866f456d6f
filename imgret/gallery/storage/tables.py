"""SQL schema of the gallery (the source of truth): items, embeddings, model versions,
query sets and the change log that replicas poll.

Design decisions:

- ``gallery_items.id`` is the FAISS id. Ids are never reused (SQLite ``AUTOINCREMENT``, a
  PostgreSQL sequence), because a replica that missed a delete must not confuse an old vector
  with a new item.
- Deletes are soft (``deleted_at``), so the change log keeps pointing at real rows. The
  content hash is unique among *live* items only (a partial unique index), so an image that
  was deleted can be added again as a new item.
- Embeddings are keyed by ``(model_version_id, item_id)``: the primary key doubles as the
  index that the index build streams through, in id order, for one model version.
- ``model_versions.is_active`` is true for at most one row (a partial unique index); every
  switch is recorded in ``model_activations`` (rollback walks it back).
- ``gallery_changes.seq`` increases with commit order: writers take a lock first
  (:func:`imgret.gallery.storage.item_store.lock_gallery_writes`), so a replica polling ``seq >
  last_seen`` can never skip a row that commits late.
- Query-set items carry their own embeddings per model version, so two model versions can be
  compared on one query set without the serving model being either of them.
- A version's checkpoint bytes live in ``model_checkpoints`` (one row per version, dropped
  with it), so every process on the database loads every version without a shared volume.
  ``model_versions.content_digest`` is the full SHA-256 of config + weights: the identity
  of a version (its name carries only 12 digits of it).
- A version's open-set decision threshold lives in ``model_calibrations``, one row per
  calibration (history kept): the newest row of the version is the one served with it, so
  the threshold always travels with the version it was measured on.
- Everything a gallery owns belongs to one ``collections`` row (:class:`CollectionScoped`):
  items, query sets, change-log rows, model versions and their activations. A version row is
  a checkpoint *bound to* a collection, so the same checkpoint serves several collections,
  each with its own active flag, coverage, re-embedding job, calibration and history. Rows
  are filtered to the session's collection by :mod:`imgret.gallery.storage.scope`, in one place, so
  a query that forgets the collection still cannot read another one. Collection 1 is
  ``default``: what a deployment with one gallery has always had.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import BYTEA, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# SQLite only auto-increments an ``INTEGER PRIMARY KEY``; PostgreSQL gets 64-bit ids.
IdType = BigInteger().with_variant(Integer(), "sqlite")
JsonType = JSON().with_variant(JSONB(), "postgresql")
VectorType = LargeBinary().with_variant(BYTEA(), "postgresql")

CHANGE_ADD = "add"
CHANGE_DELETE = "delete"

# Explicit constraint names: Alembic needs them to drop or alter constraints, and SQLite's
# batch mode (table copy) needs them to recreate the table faithfully.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """Timezone-aware now in UTC (the default of every timestamp column)."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    """Declarative base; ``Base.metadata`` is Alembic's target metadata."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


DEFAULT_COLLECTION_ID = 1
DEFAULT_COLLECTION = "default"


class Collection(Base):
    """A named gallery: its own items, query sets, versions, index and keys' roles.

    Ids are never reused, so files named by id (indexes) never outlive their collection into
    a new one of the same name. ``public``: reads need no key (writes always do, when keys
    are set).
    """

    __tablename__ = "collections"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    public: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Keep the images /identify calls unknown for this many days (0: not at all).
    unknowns_days: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class CollectionScoped:
    """The column of every row a collection owns (a mixin); deleting the collection deletes
    them (the database cascades)."""

    collection_id: Mapped[int] = mapped_column(
        ForeignKey("collections.id", ondelete="CASCADE"), index=True
    )


class ModelVersion(CollectionScoped, Base):
    """A checkpoint bound to a collection, with its embeddings; at most one per collection
    is active (served)."""

    __tablename__ = "model_versions"
    __table_args__ = (
        Index(
            "uq_model_versions_one_active",
            "collection_id",
            unique=True,
            sqlite_where=text("is_active"),
            postgresql_where=text("is_active"),
        ),
        Index("uq_model_versions_collection_version", "collection_id", "version", unique=True),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version: Mapped[str] = mapped_column(String(128))
    dim: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict)
    is_active: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # SHA-256 of the stored checkpoint's bytes (``model_checkpoints``); NULL: not stored (a
    # version registered from an in-memory model, or before migration 0002).
    checkpoint_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The full SHA-256 of config + weights (``imgret.checkpoint.content_digest``): a version
    # name is never bound to other weights. NULL: registered before migration 0005 (bound at
    # the first registration or start-up import of its checkpoint).
    content_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    activated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # The background re-embedding job (imgret.gallery.versions.lifecycle): its state and heartbeat,
    # shared by every process (a "running" job whose heartbeat is old was interrupted).
    embed_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    embed_heartbeat_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    embed_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Every live gallery item up to this id had a vector of this version when it was last
    # complete (a finished re-embedding, or the moment it stopped being the active one): an
    # activation embeds the items above it itself, and refuses if any below it lack one.
    covered_through: Mapped[int | None] = mapped_column(IdType, nullable=True)
    # A summary of the last evaluation of a named query set with this version.
    last_evaluation: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)


class ModelActivation(CollectionScoped, Base):
    """One switch of the served version (activate or rollback), in order: the history that
    ``POST /models/rollback`` walks back."""

    __tablename__ = "model_activations"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_version_id: Mapped[int] = mapped_column(
        ForeignKey("model_versions.id", ondelete="CASCADE")
    )
    previous_version_id: Mapped[int | None] = mapped_column(
        ForeignKey("model_versions.id", ondelete="SET NULL"), nullable=True
    )
    reason: Mapped[str] = mapped_column(String(16))
    # The paired verdict that allowed a gated switch (None: not gated).
    gate: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class StoredImage:
    """The columns every stored image has, gallery item or query-set item (a mixin)."""

    sha256: Mapped[str] = mapped_column(String(64))
    media_path: Mapped[str] = mapped_column(String(255))
    content_type: Mapped[str] = mapped_column(String(64))
    camera: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # ``metadata`` is reserved on declarative classes; the column keeps the natural name.
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JsonType, default=dict)
    source: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class GalleryItem(CollectionScoped, StoredImage, Base):
    """One searchable image: its FAISS id, content hash, stored file, label and camera."""

    __tablename__ = "gallery_items"
    __table_args__ = (
        Index(
            "uq_gallery_items_live_sha256",
            "collection_id",
            "sha256",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    label: Mapped[str] = mapped_column(String(255), index=True)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    embeddings: Mapped[list[Embedding]] = relationship(
        back_populates="item", cascade="all, delete-orphan", passive_deletes=True
    )


class StoredVector:
    """The columns every stored vector has, of a gallery item or a query item (a mixin): the
    model version that produced it (first column of the primary key), its dimension, its
    float32 bytes (unit norm) and when it was stored."""

    # sort_order keeps the pre-mixin column order (mixin columns would otherwise come last).
    model_version_id: Mapped[int] = mapped_column(
        ForeignKey("model_versions.id", ondelete="CASCADE"), primary_key=True, sort_order=-1
    )
    dim: Mapped[int] = mapped_column(Integer)
    vector: Mapped[bytes] = mapped_column(VectorType)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Embedding(StoredVector, Base):
    """The vector of one gallery item under one model version."""

    __tablename__ = "embeddings"

    item_id: Mapped[int] = mapped_column(
        IdType, ForeignKey("gallery_items.id", ondelete="CASCADE"), primary_key=True, index=True
    )

    item: Mapped[GalleryItem] = relationship(back_populates="embeddings")


class GalleryChange(CollectionScoped, Base):
    """One gallery write (an item added, or deleted), in commit order; replicas poll it."""

    __tablename__ = "gallery_changes"
    __table_args__ = (
        CheckConstraint(f"op IN ('{CHANGE_ADD}', '{CHANGE_DELETE}')", name="op"),
        {"sqlite_autoincrement": True},
    )

    seq: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    item_id: Mapped[int] = mapped_column(
        IdType, ForeignKey("gallery_items.id", ondelete="CASCADE"), index=True
    )
    op: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class LabelChange(CollectionScoped, Base):
    """One change of who the gallery's items are (the identities audit log): a merge, a move
    of items to another label, the undo of one of them, or an erase.

    ``moves``: ``[[old_id, new_id, old_label], ...]`` (a relabelled item gets a new id: see
    :func:`imgret.gallery.storage.identity_store.relabel_items`). ``actor``: which key made it
    (``key 7``, ``IMGRET_API_KEY``, ``local``). An erase clears the erased label from
    every entry (``labels_erased``), as it clears the items.
    """

    __tablename__ = "label_changes"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    action: Mapped[str] = mapped_column(String(8))
    from_label: Mapped[str | None] = mapped_column(String(255), nullable=True)
    to_label: Mapped[str | None] = mapped_column(String(255), nullable=True)
    moves: Mapped[list[Any]] = mapped_column(JsonType, default=list)
    actor: Mapped[str] = mapped_column(String(128))
    undo_of: Mapped[int | None] = mapped_column(IdType, nullable=True)
    undone_by: Mapped[int | None] = mapped_column(IdType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ServingPosition(CollectionScoped, Base):
    """How far one serving process has applied a collection's change log: each process's
    follower writes its row after every catch-up, so an erase can tell when every process
    that serves the collection has dropped the erased items (``seen_at``: its last word; a
    process that stops writing is gone)."""

    __tablename__ = "serving_positions"

    process: Mapped[str] = mapped_column(String(128), primary_key=True)
    collection_id: Mapped[int] = mapped_column(
        ForeignKey("collections.id", ondelete="CASCADE"), primary_key=True, index=True)
    change_seq: Mapped[int] = mapped_column(IdType)
    seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class UnknownCluster(CollectionScoped, Base):
    """A candidate identity among the kept unknowns: the members that joined it under one
    model version, with the sum of their vectors (its template is the sum, normalised; its
    cohesion, the members' mean cosine with that template, is ``|sum| / size``)."""

    __tablename__ = "unknown_clusters"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    model_version_id: Mapped[int] = mapped_column(
        ForeignKey("model_versions.id", ondelete="CASCADE"), index=True)
    vector_sum: Mapped[bytes] = mapped_column(VectorType)
    size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class UnknownFace(CollectionScoped, Base):
    """An image ``/identify`` called unknown, kept (the collection opted in) with its vector
    under the version that decided, and the cluster it joined."""

    __tablename__ = "unknowns"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    sha256: Mapped[str] = mapped_column(String(64))
    media_path: Mapped[str] = mapped_column(String(255))
    content_type: Mapped[str] = mapped_column(String(64))
    model_version_id: Mapped[int] = mapped_column(
        ForeignKey("model_versions.id", ondelete="CASCADE"), index=True)
    dim: Mapped[int] = mapped_column(Integer)
    vector: Mapped[bytes] = mapped_column(VectorType)
    score: Mapped[float | None] = mapped_column(Float, nullable=True)
    cluster_id: Mapped[int | None] = mapped_column(
        ForeignKey("unknown_clusters.id", ondelete="SET NULL"), nullable=True, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow,
                                                 index=True)


class QuerySet(CollectionScoped, Base):
    """A named, labelled set of query images (for ``/evaluate`` and ``imgret evaluate``);
    names are unique within a collection."""

    __tablename__ = "query_sets"
    __table_args__ = (
        Index("uq_query_sets_collection_name", "collection_id", "name", unique=True),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    items: Mapped[list[QueryItem]] = relationship(
        back_populates="query_set",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="QueryItem.id",
    )


class QueryItem(StoredImage, Base):
    """One query image of a query set; not a gallery item, never searchable."""

    __tablename__ = "query_items"
    __table_args__ = (
        Index("uq_query_items_set_sha256", "query_set_id", "sha256", unique=True),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True, autoincrement=True)
    query_set_id: Mapped[int] = mapped_column(
        ForeignKey("query_sets.id", ondelete="CASCADE"), index=True
    )
    label: Mapped[str] = mapped_column(String(255))

    query_set: Mapped[QuerySet] = relationship(back_populates="items")


class QueryEmbedding(StoredVector, Base):
    """The vector of one query item under one model version."""

    __tablename__ = "query_embeddings"

    query_item_id: Mapped[int] = mapped_column(
        IdType, ForeignKey("query_items.id", ondelete="CASCADE"), primary_key=True, index=True
    )


class MediaBlob(Base):
    """Image bytes kept in the database itself (``IMGRET_MEDIA_BACKEND=database``): every
    replica reads them without a shared volume (galleries of small images: faces, re-ID
    crops). Keyed by content hash, like the files of the default store."""

    __tablename__ = "media_blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    data: Mapped[bytes] = mapped_column(VectorType)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ModelCheckpoint(Base):
    """The checkpoint file of a model version (``model.pt`` bytes, as ``torch.save`` wrote
    them), so every process on the database can load the version it is told to serve."""

    __tablename__ = "model_checkpoints"

    model_version_id: Mapped[int] = mapped_column(
        ForeignKey("model_versions.id", ondelete="CASCADE"), primary_key=True
    )
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(VectorType)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ModelCalibration(Base):
    """One calibration of a version's decision threshold (``POST /models/{v}/calibrate``):
    the threshold that held FPIR at ``target_fpir`` on a query set, what was measured at it,
    and which query set, by content. The newest row of a version is served with it."""

    __tablename__ = "model_calibrations"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_version_id: Mapped[int] = mapped_column(
        ForeignKey("model_versions.id", ondelete="CASCADE"), index=True
    )
    query_set: Mapped[str] = mapped_column(String(255))
    # SHA-256 over the query items' (id, sha256, label), in id order: the same name with
    # other content is another calibration set.
    query_set_sha256: Mapped[str] = mapped_column(String(64))
    target_fpir: Mapped[float] = mapped_column(Float)
    # Doubles: a threshold lies one ulp above a score, and a search compares it exactly.
    threshold: Mapped[float] = mapped_column(Float)
    threshold_low: Mapped[float | None] = mapped_column(Float, nullable=True)
    threshold_high: Mapped[float | None] = mapped_column(Float, nullable=True)
    fpir: Mapped[float] = mapped_column(Float)
    fnir: Mapped[float] = mapped_column(Float)
    # The search option the scores came from (re-ranking; NULL: plain search).
    rerank: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    # The rest of the operating point: intervals, counts, rank-1 identification, depth.
    details: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


ROLES = ("read", "write", "admin")


class ApiKey(Base):
    """An API key: only a salted, memory-hard hash of its secret is kept (scrypt; the secret
    is shown once, at creation). ``is_admin``: every role on every collection, and the
    collections, keys and backups themselves. A revoked key keeps its row (the audit trail:
    who had it, until when) and is refused everywhere."""

    __tablename__ = "api_keys"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64))
    salt: Mapped[bytes] = mapped_column(VectorType)
    digest: Mapped[bytes] = mapped_column(VectorType)
    # The KDF and its parameters, so they can be raised later without locking anyone out.
    kdf: Mapped[str] = mapped_column(String(64))
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ApiKeyRole(Base):
    """One key's role on one collection (``read`` < ``write`` < ``admin``)."""

    __tablename__ = "api_key_roles"
    __table_args__ = (
        CheckConstraint("role IN ('read', 'write', 'admin')", name="role"),
    )

    key_id: Mapped[int] = mapped_column(
        ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True
    )
    collection_id: Mapped[int] = mapped_column(
        ForeignKey("collections.id", ondelete="CASCADE"), primary_key=True, index=True
    )
    role: Mapped[str] = mapped_column(String(8))
