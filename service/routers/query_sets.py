"""/query-sets: the stored labelled query sets (for the web page's Evaluate view) and their
images (the worst queries are shown as pictures)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path
from fastapi.responses import Response
from sqlalchemy import func, select

from index.models import QueryItem, QuerySet
from service.deps import ResourcesDep, SessionDep
from service.routers.gallery import stored_image
from service.schemas import QuerySetInfo, QuerySetList
from service.validation import NAME_MAX

router = APIRouter(prefix="/query-sets", tags=["query-sets"])


@router.get("")
def list_query_sets(session: SessionDep) -> QuerySetList:
    """Every stored query set (``imgret ingest --query-set NAME``) with its size."""
    rows = session.execute(
        select(QuerySet.name, func.count(QueryItem.id))
        .outerjoin(QueryItem, QueryItem.query_set_id == QuerySet.id)
        .group_by(QuerySet.id, QuerySet.name).order_by(QuerySet.name)
    )
    return QuerySetList(query_sets=[QuerySetInfo(name=n, size=int(c)) for n, c in rows])


@router.get(
    "/{name}/items/{item_id}/image", response_class=Response,
    responses={200: {"content": {"image/*": {}}}, 404: {"description": "no such query item"}},
)
def read_query_image(
    name: Annotated[str, Path(min_length=1, max_length=NAME_MAX)],
    item_id: Annotated[int, Path(ge=1, le=2**63 - 1)],
    session: SessionDep, resources: ResourcesDep,
):
    """The stored image of one query of a set."""
    item = session.scalar(
        select(QueryItem).join(QuerySet, QuerySet.id == QueryItem.query_set_id)
        .where(QuerySet.name == name, QueryItem.id == item_id)
    )
    if item is None:
        raise HTTPException(404, f"query set {name!r} has no item {item_id}")
    return stored_image(resources.media, item.media_path, item.content_type,
                        missing=f"the image of query item {item_id}")
