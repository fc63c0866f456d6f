"""The SQL of query sets: named, labelled sets of query images (never searchable)."""

from __future__ import annotations

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from imgret.errors import GalleryError
from imgret.gallery.storage.tables import (
    ModelVersion,
    QueryEmbedding,
    QueryItem,
    QuerySet,
)
from imgret.gallery.storage.vector_store import decode_vectors


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
