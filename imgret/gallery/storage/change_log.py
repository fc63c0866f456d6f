"""The change log: one row per gallery write (an add or a delete) in commit order, which replicas
and Searchers poll to catch up."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, bindparam, func, select
from sqlalchemy.orm import Session

from imgret.gallery.storage.bulk import insert_rows
from imgret.gallery.storage.scope import collection_of
from imgret.gallery.storage.tables import (
    CHANGE_DELETE,
    DEFAULT_COLLECTION_ID,
    GalleryChange,
    utcnow,
)


@dataclass(frozen=True)
class ChangeRow:
    """One entry of the gallery change log."""

    seq: int
    item_id: int
    op: str


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


def _insert_changes(item_ids: Sequence[int], op: str, session: Session) -> None:
    """One change-log row per id, in this order (one Core executemany)."""
    if not item_ids:
        return
    now = utcnow()
    collection_id = collection_of(session)
    insert_rows(session, GalleryChange.__table__,
                [{"item_id": int(i), "op": op, "created_at": now,
                  "collection_id": collection_id} for i in item_ids])
