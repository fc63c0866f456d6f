"""One collection per session: the filter that keeps collections apart, in one place.

A session made by :func:`imgret.gallery.storage.db.make_sessionmaker` carries its collection's id in
``session.info``. Every ORM statement it runs (SELECT, UPDATE, DELETE, lazy loads,
``session.get``) gets ``collection_id = <that id>`` on each :class:`CollectionScoped` table
it touches (SQLAlchemy's ``with_loader_criteria``, the documented way to filter every query
of a tenant), and every scoped row it adds is stamped with it. So a store function written
for one gallery serves any collection unchanged, and one that forgets the collection still
cannot read, count or delete another's rows.

A query item belongs to its collection through its query set (it has no ``collection_id`` of
its own): every statement on ``query_items`` gets ``query_set_id IN (the collection's query
sets)``, so a job that picks query images to embed, or a count of them, sees only its own
collection's, like every other row.

What must see every collection says so: a session made with ``collection_id=None``
(backups, the media sweep), or one statement with ``.execution_options(all_collections=True)``
(is this image still used by anyone?). Core statements on a table (bulk inserts, the change
log a Searcher polls on a plain connection) are not ORM statements: they name their
collection themselves.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event, select
from sqlalchemy.orm import ORMExecuteState, Session, sessionmaker, with_loader_criteria

from imgret.gallery.storage.tables import (
    DEFAULT_COLLECTION_ID,
    CollectionScoped,
    QueryItem,
    QuerySet,
)

ALL_COLLECTIONS = "all_collections"
_INFO_KEY = "collection_id"


def session_info(collection_id: int | None) -> dict[str, Any]:
    """The ``info`` of a session scoped to ``collection_id`` (``None``: every collection)."""
    return {_INFO_KEY: collection_id}


def collection_of(session: Session) -> int:
    """The collection a session works in (``default`` for a session made without one).

    Raises:
        ValueError: the session sees every collection, so a row it adds has no owner.
    """
    collection_id = session.info.get(_INFO_KEY, DEFAULT_COLLECTION_ID)
    if collection_id is None:
        raise ValueError("a session over every collection cannot add a collection's rows")
    return int(collection_id)


def collection_of_factory(session_factory: sessionmaker[Session]) -> int:
    """The collection the sessions of ``session_factory`` work in (for Core statements on
    its engine, which name their collection themselves)."""
    collection_id = session_factory.kw.get("info", {}).get(_INFO_KEY, DEFAULT_COLLECTION_ID)
    if collection_id is None:
        raise ValueError("these sessions see every collection; name one")
    return int(collection_id)


@event.listens_for(Session, "do_orm_execute")
def _only_this_collection(state: ORMExecuteState) -> None:
    if not (state.is_select or state.is_update or state.is_delete):
        return
    if state.execution_options.get(ALL_COLLECTIONS):
        return
    collection_id = state.session.info.get(_INFO_KEY, DEFAULT_COLLECTION_ID)
    if collection_id is None:
        return
    state.statement = state.statement.options(
        with_loader_criteria(
            CollectionScoped, lambda cls: cls.collection_id == collection_id,
            include_aliases=True,
        ),
        with_loader_criteria(
            QueryItem, lambda cls: cls.query_set_id.in_(
                select(QuerySet.id).where(QuerySet.collection_id == collection_id)),
            include_aliases=True,
        ),
    )


@event.listens_for(Session, "before_flush")
def _stamp_new_rows(session: Session, _context: Any, _instances: Any) -> None:
    for row in session.new:
        if isinstance(row, CollectionScoped) and row.collection_id is None:
            row.collection_id = collection_of(session)
