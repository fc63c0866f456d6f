"""/gallery: add images (searchable at once), list, read, fetch image bytes, delete.

HTTP only: the work is :mod:`imgret.service.gallery`'s, the form is parsed by
:mod:`imgret.service.forms`.
"""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, Path, Query, Request, status
from fastapi.responses import Response

from imgret.gallery.ingest import AddedItems, NewItem
from imgret.gallery.storage.tables import GalleryItem
from imgret.service import gallery
from imgret.service.deps import ResourcesDep, SessionDep, require_api_key
from imgret.service.forms import form_body, open_form
from imgret.service.request_rules import LABEL_MAX, SafeText
from imgret.service.schemas.gallery import (
    GalleryAddOutcome,
    GalleryItemList,
    GalleryItemPublic,
    GalleryItemsCreated,
    GalleryUpload,
)

router = APIRouter(prefix="/gallery", tags=["gallery"])

ItemId = Annotated[int, Path(ge=1, le=2**63 - 1, description="gallery item id")]
SOURCE_MAX = 255


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    dependencies=[Depends(require_api_key)],
    openapi_extra=form_body(GalleryUpload),
    responses={401: {"description": "missing or wrong X-API-Key"},
               413: {"description": "upload or image too large"},
               422: {"description": "not an image, or fields that do not line up"}},
)
async def add_gallery_items(request: Request, resources: ResourcesDep) -> GalleryItemsCreated:
    """Add labelled images to the gallery; they are searchable when this returns.

    The rows, embeddings and change-log entries are committed in one transaction *before*
    the in-memory index changes, so an acknowledged item survives a crash (the index is
    rebuilt or replayed from SQL at start-up). Images whose bytes are already a live item are
    not added twice: ``items[i]`` says ``existing`` and shows the stored label, camera and
    metadata (the values sent are not applied to it).
    """
    max_files = resources.settings.gallery_max_files
    too_many = (f"too many images: send at most {max_files} per request "
                "(IMGRET_GALLERY_MAX_FILES); bulk imports belong to `imgret ingest`")
    async with open_form(request, GalleryUpload, max_files=max_files,
                         too_many_files=too_many) as upload:
        cameras = upload.cameras or [None] * len(upload.images)
        items = [
            NewItem(
                data=await image.read(), label=label, camera=camera, metadata=metadata,
                # The client's file name is kept as a note for people; it is never opened.
                source=(image.filename or None) and image.filename[:SOURCE_MAX],
            )
            for image, label, camera, metadata in zip(
                upload.images, upload.labels, cameras, upload.metadata_per_image(),
                strict=True)
        ]
    added = await anyio.to_thread.run_sync(gallery.add, resources, items)
    return GalleryItemsCreated(ids=added.ids, created=added.created,
                               items=_outcomes(added, items))


def _outcomes(added: AddedItems, items: list[NewItem]) -> list[GalleryAddOutcome]:
    """Per upload: created (as sent), existing (as stored), or a duplicate of an earlier one."""
    outcomes: list[GalleryAddOutcome] = []
    first: dict[int, GalleryAddOutcome] = {}
    for position, item_id in enumerate(added.ids):
        if added.created[position]:
            sent = items[position]
            outcome = GalleryAddOutcome(id=item_id, status="created", label=sent.label,
                                        camera=sent.camera, metadata=dict(sent.metadata or {}))
        elif (stored := added.existing.get(position)) is not None:
            outcome = GalleryAddOutcome(id=item_id, status="existing", label=stored.label,
                                        camera=stored.camera, metadata=dict(stored.metadata))
        else:  # the same bytes earlier in this request
            outcome = first[item_id].model_copy(update={"status": "duplicate"})
        first.setdefault(item_id, outcome)
        outcomes.append(outcome)
    return outcomes


@router.get("")
def list_gallery_items(
    session: SessionDep,
    resources: ResourcesDep,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    label: Annotated[SafeText | None, Query(max_length=LABEL_MAX)] = None,
) -> GalleryItemList:
    """A page of live gallery items in id order; ``count`` is the total matching ``label``."""
    items, count = gallery.list_items(session=session, offset=offset, limit=limit, label=label)
    return GalleryItemList(
        data=[_public(item, resources.collection) for item in items], count=count,
        offset=offset, limit=limit,
    )


@router.get("/{item_id}", responses={404: {"description": "no such item"}})
def read_gallery_item(item_id: ItemId, session: SessionDep,
                      resources: ResourcesDep) -> GalleryItemPublic:
    """One gallery item."""
    return _public(gallery.get_item(item_id, session=session), resources.collection)


@router.get(
    "/{item_id}/image",
    response_class=Response,
    responses={200: {"content": {"image/*": {}}}, 404: {"description": "no such item"}},
)
def read_gallery_image(item_id: ItemId, resources: ResourcesDep) -> Response:
    """The stored image bytes, with the content type found at upload."""
    image = gallery.read_image(resources, item_id)
    return Response(image.data, media_type=image.content_type, headers=gallery.IMAGE_HEADERS)


@router.delete(
    "/{item_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    dependencies=[Depends(require_api_key)],
    responses={401: {"description": "missing or wrong X-API-Key"},
               404: {"description": "no such item (or already deleted)"}},
)
def delete_gallery_item(item_id: ItemId, resources: ResourcesDep) -> Response:
    """Delete an item: it never appears in results again, in any process, and its image
    bytes (and embeddings) are gone from this server's storage when the 204 is sent
    (:func:`imgret.service.gallery.delete` says in which order)."""
    gallery.delete(resources, item_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _public(item: GalleryItem, collection: str) -> GalleryItemPublic:
    return GalleryItemPublic(
        id=item.id, label=item.label, camera=item.camera, metadata=item.meta or {},
        content_type=item.content_type, sha256=item.sha256,
        uri=gallery.image_uri(item.id, collection),
        created_at=item.created_at,
    )
