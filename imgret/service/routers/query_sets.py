"""/query-sets: the stored labelled query sets (for the web page's Evaluate view) and their
images (the worst queries are shown as pictures). HTTP only: the look-ups are
:mod:`imgret.service.gallery`'s."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import Response

from imgret.service import gallery
from imgret.service.deps import ResourcesDep, SessionDep
from imgret.service.request_rules import NAME_MAX
from imgret.service.schemas.query_sets import QuerySetInfo, QuerySetList

router = APIRouter(prefix="/query-sets", tags=["query-sets"])


@router.get("")
def list_query_sets(session: SessionDep) -> QuerySetList:
    """Every stored query set (``imgret ingest --query-set NAME``) with its size."""
    return QuerySetList(query_sets=[QuerySetInfo(name=name, size=size)
                                    for name, size in gallery.query_sets(session=session)])


@router.get(
    "/{name}/items/{item_id}/image", response_class=Response,
    responses={200: {"content": {"image/*": {}}}, 404: {"description": "no such query item"}},
)
def read_query_image(
    name: Annotated[str, Path(min_length=1, max_length=NAME_MAX)],
    item_id: Annotated[int, Path(ge=1, le=2**63 - 1)],
    resources: ResourcesDep,
) -> Response:
    """The stored image of one query of a set."""
    image = gallery.read_query_image(resources, name, item_id)
    return Response(image.data, media_type=image.content_type, headers=gallery.IMAGE_HEADERS)
