"""The SQL of identities: the labels and their item counts, relabelling items (merge, move,
undo) and the audit log of those changes.

Every function takes ``session`` keyword-only and never commits: the caller frames the
transaction.

**A relabelled item gets a new id.** Gallery ids are never reused, and every index (FAISS
in each process, Milvus, saved index files, replicas) follows the gallery through two
writes alone: adds and deletes, in change-log order. A relabel is therefore written as
exactly those: the old row deleted (its personal data cleared, as any delete clears it)
and a new row with the new label, the same image bytes, camera, metadata and every model
version's vector, in one transaction. Every backend then applies it with the machinery
that already makes deletes final and adds durable, and no index can serve an item under
a label SQL no longer gives it (a label kept in a remote engine's rows, for filters, would
otherwise need its own update path, and its own way to fail). The audit entry and the
response map each old id to its new id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import delete as sa_delete
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from imgret.gallery.storage.bulk import chunks, insert_rows
from imgret.gallery.storage.change_log import _insert_changes
from imgret.gallery.storage.item_store import delete_items, lock_gallery_writes
from imgret.gallery.storage.scope import collection_of
from imgret.gallery.storage.tables import (
    CHANGE_ADD,
    Embedding,
    GalleryItem,
    LabelChange,
    QueryEmbedding,
    QueryItem,
    utcnow,
)

MERGE, MOVE, UNDO, ERASE = "merge", "move", "undo", "erase"
# What an erased label becomes in the audit log (see :func:`forget_label`).
ERASED = "(erased)"


@dataclass(frozen=True)
class Move:
    """One relabelled item: its old id and label, and its new id."""

    old_id: int
    new_id: int | None  # None: erased
    old_label: str


def label_counts(*, session: Session, offset: int = 0, limit: int = 100,
                 label: str | None = None) -> tuple[list[tuple[str, int]], int]:
    """A page of ``(label, live items)`` in label order, and how many labels there are."""
    live = GalleryItem.deleted_at.is_(None)
    query = select(GalleryItem.label, func.count()).where(live).group_by(GalleryItem.label)
    total = select(func.count(func.distinct(GalleryItem.label))).where(live)
    if label is not None:
        query, total = (query.where(GalleryItem.label == label),
                        total.where(GalleryItem.label == label))
    rows = session.execute(query.order_by(GalleryItem.label).offset(offset).limit(limit))
    return [(str(name), int(n)) for name, n in rows], int(session.scalar(total) or 0)


def live_ids_of(label: str, *, session: Session) -> list[int]:
    """The live items of ``label``, in id order."""
    return list(session.scalars(
        select(GalleryItem.id).where(GalleryItem.label == label,
                                     GalleryItem.deleted_at.is_(None))
        .order_by(GalleryItem.id)))


def live_among(item_ids: Sequence[int], *, session: Session,
               label: str | None = None) -> list[int]:
    """The ids among ``item_ids`` that are live items (with ``label``, if given), sorted."""
    found: list[int] = []
    for chunk in chunks(sorted({int(i) for i in item_ids})):
        query = select(GalleryItem.id).where(GalleryItem.id.in_(chunk),
                                             GalleryItem.deleted_at.is_(None))
        if label is not None:
            query = query.where(GalleryItem.label == label)
        found.extend(int(i) for i in session.scalars(query))
    return sorted(found)


def relabel_items(item_ids: Sequence[int], to_label: str, *,
                  session: Session) -> list[Move]:
    """Give the live items ``item_ids`` the label ``to_label``: each becomes a new item (new
    id, same image, camera, metadata and vectors) and the old one is deleted (see the module
    docstring). Items already labelled ``to_label``, unknown and deleted ids are skipped.

    Returns:
        The moves, in id order of the old items.
    """
    wanted = sorted({int(i) for i in item_ids})
    if not wanted:
        return []
    lock_gallery_writes(session=session)
    columns = (GalleryItem.id, GalleryItem.label, GalleryItem.sha256, GalleryItem.media_path,
               GalleryItem.content_type, GalleryItem.camera, GalleryItem.meta,
               GalleryItem.source, GalleryItem.created_at)
    rows = []
    for chunk in chunks(wanted):
        rows.extend(session.execute(
            select(*columns).where(GalleryItem.id.in_(chunk), GalleryItem.deleted_at.is_(None),
                                   GalleryItem.label != to_label)))
    if not rows:
        return []
    rows.sort(key=lambda row: row[0])
    collection_id = collection_of(session)
    copies = [{"sha256": sha, "media_path": path, "content_type": kind, "label": to_label,
               "camera": camera, "metadata": dict(meta or {}), "source": source,
               "created_at": created, "collection_id": collection_id}
              for _, _, sha, path, kind, camera, meta, source, created in rows]
    old = [(int(row[0]), str(row[1])) for row in rows]
    vectors: list[tuple[int, int, int, bytes]] = []
    for chunk in chunks([i for i, _ in old]):
        vectors.extend(session.execute(
            select(Embedding.item_id, Embedding.model_version_id, Embedding.dim,
                   Embedding.vector).where(Embedding.item_id.in_(chunk))))
    # Delete first: the live-hash index allows one live row per image.
    delete_items([i for i, _ in old], session=session)
    new_ids = insert_rows(session, GalleryItem.__table__, copies, return_ids=True)
    new_of = {old_id: new_id for (old_id, _), new_id in zip(old, new_ids, strict=True)}
    now = utcnow()
    if vectors:
        insert_rows(session, Embedding.__table__, [
            {"model_version_id": version, "item_id": new_of[item_id], "dim": dim,
             "vector": vector, "created_at": now}
            for item_id, version, dim, vector in vectors])
    _insert_changes(new_ids, CHANGE_ADD, session)
    return [Move(old_id, new_of[old_id], label) for old_id, label in old]


@dataclass(frozen=True)
class ErasedRows:
    """What :func:`erase_label` removed from SQL."""

    item_ids: list[int]
    item_hashes: list[str]
    vectors: int
    query_item_ids: list[int]
    query_hashes: list[str]
    query_vectors: int
    audit_entries: int


def erase_label(label: str, *, session: Session) -> ErasedRows:
    """Remove everything of ``label`` in the session's collection, in its transaction: the
    live gallery items (deleted as any delete deletes: personal data cleared, vectors gone,
    the deletes logged), the query-set items with that label and their vectors, and the
    label's name from the audit log (:func:`forget_label`). The image bytes are the
    caller's to purge once this commits (their hashes are returned).
    """
    lock_gallery_writes(session=session)
    ids = live_ids_of(label, session=session)
    hashes: set[str] = set()
    vectors = 0
    for chunk in chunks(ids):
        hashes.update(session.scalars(select(GalleryItem.sha256)
                                      .where(GalleryItem.id.in_(chunk))))
        vectors += int(session.scalar(select(func.count()).select_from(Embedding)
                                      .where(Embedding.item_id.in_(chunk))) or 0)
    delete_items(ids, session=session)
    queries = list(session.execute(
        select(QueryItem.id, QueryItem.sha256).where(QueryItem.label == label)))
    query_ids = sorted(int(i) for i, _ in queries)
    query_vectors = 0
    for chunk in chunks(query_ids):
        query_vectors += int(session.scalar(
            select(func.count()).select_from(QueryEmbedding)
            .where(QueryEmbedding.query_item_id.in_(chunk))) or 0)
        session.execute(sa_delete(QueryEmbedding)
                        .where(QueryEmbedding.query_item_id.in_(chunk)))
        session.execute(sa_delete(QueryItem).where(QueryItem.id.in_(chunk)))
    audit = forget_label(label, session=session)
    return ErasedRows(ids, sorted(hashes), vectors, query_ids,
                      sorted({str(h) for _, h in queries}), query_vectors, audit)


def record_change(action: str, *, session: Session, actor: str, moves: Sequence[Move],
                  from_label: str | None = None, to_label: str | None = None,
                  undo_of: int | None = None) -> LabelChange:
    """Append one entry to the audit log (in the caller's transaction)."""
    entry = LabelChange(action=action, from_label=from_label, to_label=to_label,
                        moves=[[m.old_id, m.new_id, m.old_label] for m in moves],
                        actor=actor[:128], undo_of=undo_of, created_at=utcnow())
    session.add(entry)
    session.flush()
    if undo_of is not None:
        session.execute(update(LabelChange).where(LabelChange.id == undo_of)
                        .values(undone_by=entry.id))
    return entry


def get_change(change_id: int, *, session: Session) -> LabelChange | None:
    """One audit entry of the session's collection (``None``: none with that id)."""
    return session.scalar(select(LabelChange).where(LabelChange.id == int(change_id)))


def list_changes(*, session: Session, offset: int = 0,
                 limit: int = 50) -> tuple[list[LabelChange], int]:
    """A page of the audit log, newest first, and its length."""
    rows = list(session.scalars(select(LabelChange).order_by(LabelChange.id.desc())
                                .offset(offset).limit(limit)))
    return rows, int(session.scalar(select(func.count()).select_from(LabelChange)) or 0)


def forget_label(label: str, *, session: Session) -> int:
    """Clear ``label`` from every audit entry (an erase: nothing of it may remain). Entries
    that name it keep their ids, action, time and actor; the label becomes :data:`ERASED`.

    Returns:
        How many entries named it.
    """
    named = 0
    for entry in session.scalars(select(LabelChange)):
        moves = [[o, n, ERASED if lab == label else lab] for o, n, lab in entry.moves or []]
        changed = (entry.from_label == label or entry.to_label == label
                   or moves != (entry.moves or []))
        if changed:
            named += 1
            entry.from_label = ERASED if entry.from_label == label else entry.from_label
            entry.to_label = ERASED if entry.to_label == label else entry.to_label
            entry.moves = moves
    session.flush()
    return named
