"""/collections: create, list, describe and delete collections (named galleries).

A collection's own routes are the default collection's under ``/collections/{name}``
(``/collections/shop/search``, ``.../gallery``, ``.../evaluate``, ``.../models``,
``.../query-sets``); see :mod:`imgret.service.collection_registry`. HTTP only: the work is
:mod:`imgret.gallery.tenancy.collections`'.
"""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, Path, Request, Response, status

from imgret.gallery.search.milvus_index import vector_dropper
from imgret.gallery.storage.tables import DEFAULT_COLLECTION
from imgret.gallery.tenancy import collections
from imgret.service.access import Caller
from imgret.service.deps import require_api_key
from imgret.service.request_rules import InvalidRequest
from imgret.service.schemas.collections import (
    COLLECTION_NAME_RULE,
    CollectionCreate,
    CollectionInfo,
    CollectionList,
    CollectionUpdate,
)

router = APIRouter(prefix="/collections", tags=["collections"])

CollectionName = Annotated[str, Path(min_length=1, max_length=64,
                                     pattern=collections.NAME_PATTERN,
                                     description="collection name: " + COLLECTION_NAME_RULE)]
_NOT_FOUND = {404: {"description": "no such collection"}}


async def collection_path(collection: CollectionName) -> str:
    """Declares (and checks) the ``{collection}`` of the routes a collection shares with the
    default one."""
    return collection


def _public(info: collections.CollectionInfo, request: Request) -> CollectionInfo:
    return CollectionInfo(**info.to_dict(),
                          index=request.app.state.collections.memory(info.name))


@router.get("")
def list_collections(request: Request) -> CollectionList:
    """The collections the caller may read, oldest first, with their live item count and
    served version: every one for a global admin key, the public ones and those its roles
    name for another key, the public ones without a key."""
    default = request.app.state.resources
    caller = request.scope.get("state", {}).get("caller") or Caller()
    return CollectionList(collections=[
        _public(info, request) for info in collections.describe(session_factory=default.sessions)
        if info.public or caller.may("read", info.name)])


@router.post("", status_code=status.HTTP_201_CREATED, dependencies=[Depends(require_api_key)],
             responses={409: {"description": "the name is taken"}})
def create_collection(body: CollectionCreate, request: Request) -> CollectionInfo:
    """Create an empty collection serving a stored checkpoint (by default the one the default
    collection serves). Its routes are ``/collections/{name}/...``."""
    default = request.app.state.resources
    if body.name in collections.RESERVED_NAMES:
        raise InvalidRequest(f"name: {body.name!r} is reserved")
    try:
        created = collections.create(body.name, session_factory=default.sessions,
                                     version=body.model_version, public=body.public)
    except collections.VersionNotStored as exc:
        raise InvalidRequest(f"model_version: {exc}") from None
    request.app.state.keyring.refresh()
    return _public(created, request)


@router.get("/{collection}", responses=_NOT_FOUND)
def read_collection(collection: CollectionName, request: Request) -> CollectionInfo:
    """One collection."""
    default = request.app.state.resources
    return _public(collections.describe(session_factory=default.sessions, name=collection)[0],
                   request)


@router.patch("/{collection}", responses=_NOT_FOUND, dependencies=[Depends(require_api_key)])
def update_collection(collection: CollectionName, body: CollectionUpdate,
                      request: Request) -> CollectionInfo:
    """Make a collection's reads public or private (a key with the read role needed), and
    set how many days ``/identify``'s unknowns are kept (0: none). Every process follows
    within its follower interval."""
    default = request.app.state.resources
    info = collections.update(collection, session_factory=default.sessions,
                              public=body.public, unknowns_days=body.unknowns_days)
    request.app.state.keyring.refresh()
    return _public(info, request)


@router.delete("/{collection}", status_code=status.HTTP_204_NO_CONTENT,
               dependencies=[Depends(require_api_key)],
               responses={**_NOT_FOUND, 422: {"description": "the default collection"}})
async def delete_collection(collection: CollectionName, request: Request) -> Response:
    """Delete a collection and all it holds: items, vectors, image bytes no other collection
    uses, query sets, versions, calibrations and change log. Every process answers 404 for
    it afterwards."""
    default = request.app.state.resources
    if collection == DEFAULT_COLLECTION:
        raise InvalidRequest("the default collection cannot be deleted")
    async with request.app.state.collections.deleting(collection):
        await anyio.to_thread.run_sync(lambda: collections.delete(
            collection, session_factory=default.sessions, media=default.media,
            data_dir=default.settings.data_dir,
            drop_vectors=vector_dropper(default.settings)))
    await anyio.to_thread.run_sync(request.app.state.keyring.refresh)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
