"""/gallery: add images (searchable at once), list, read, fetch image bytes, delete."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, HTTPException, Path, Query, UploadFile, status
from fastapi.responses import FileResponse, Response

from index import store
from index.ingest import NewItem, add_items
from index.models import GalleryItem
from service.deps import ResourcesDep, SessionDep, require_api_key
from service.schemas import GalleryItemList, GalleryItemPublic, GalleryItemsCreated

router = APIRouter(prefix="/gallery", tags=["gallery"])

ItemId = Annotated[int, Path(ge=1, le=2**63 - 1, description="gallery item id")]
LABEL_MAX = 255
SOURCE_MAX = 255


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    dependencies=[Depends(require_api_key)],
    responses={401: {"description": "missing or wrong X-API-Key"},
               413: {"description": "upload or image too large"},
               422: {"description": "not an image, or fields that do not line up"}},
)
def add_gallery_items(
    resources: ResourcesDep,
    images: Annotated[list[UploadFile], File(description="image files, one per item")],
    labels: Annotated[list[str], Form(description="one label per image, in order")],
    cameras: Annotated[
        list[int] | None, Form(description="one camera id per image (re-ID data)")
    ] = None,
    metadata: Annotated[
        list[str] | None,
        Form(description="JSON objects: one per image, or one for all images"),
    ] = None,
) -> GalleryItemsCreated:
    """Add labelled images to the gallery; they are searchable when this returns.

    The rows, embeddings and change-log entries are committed in one transaction *before*
    the in-memory index changes, so an acknowledged item survives a crash (the index is
    rebuilt or replayed from SQL at start-up). Images whose bytes are already in the gallery
    are not added twice: their existing id is returned (``created`` is false for them).
    """
    n = len(images)
    _check_count("labels", labels, n)
    for position, label in enumerate(labels):
        if not label.strip() or len(label) > LABEL_MAX:
            raise HTTPException(
                422, f"labels[{position}]: a label is 1 to {LABEL_MAX} characters, not empty"
            )
    if cameras is not None:
        _check_count("cameras", cameras, n)
    metas = _parse_metadata(metadata, n)
    items = [
        NewItem(
            data=upload.file.read(),
            label=label,
            camera=cameras[i] if cameras is not None else None,
            metadata=metas[i],
            # The client's file name is kept as a note for people; it is never opened.
            source=(upload.filename or None) and upload.filename[:SOURCE_MAX],
        )
        for i, (upload, label) in enumerate(zip(images, labels, strict=True))
    ]
    with resources.sessions.begin() as session:
        added = add_items(
            items, session=session, media=resources.media, embedder=resources.embedder,
            max_pixels=resources.settings.max_image_pixels,
        )
    # Committed: now the index. A crash between the two loses nothing (SQL is the truth).
    resources.searcher.add(added.vector_ids, added.vectors, added.infos)
    resources.metrics.gallery_writes.labels("add").inc(sum(added.created))
    return GalleryItemsCreated(ids=added.ids, created=added.created)


@router.get("")
def list_gallery_items(
    session: SessionDep,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    label: Annotated[str | None, Query(max_length=LABEL_MAX)] = None,
) -> GalleryItemList:
    """A page of live gallery items in id order; ``count`` is the total matching ``label``."""
    items, count = store.list_items(session=session, offset=offset, limit=limit, label=label)
    return GalleryItemList(
        data=[_public(item) for item in items], count=count, offset=offset, limit=limit
    )


@router.get("/{item_id}", responses={404: {"description": "no such item"}})
def read_gallery_item(item_id: ItemId, session: SessionDep) -> GalleryItemPublic:
    """One gallery item."""
    return _public(_get_or_404(item_id, session))


@router.get(
    "/{item_id}/image",
    response_class=FileResponse,
    responses={200: {"content": {"image/*": {}}}, 404: {"description": "no such item"}},
)
def read_gallery_image(item_id: ItemId, session: SessionDep, resources: ResourcesDep):
    """The stored image bytes, with the content type found at upload."""
    item = _get_or_404(item_id, session)
    path = resources.media.resolve(item.media_path)  # the path is ours, from the row
    if not path.is_file():
        raise HTTPException(404, f"the image file of item {item_id} is missing from the store")
    return FileResponse(
        path,
        media_type=item.content_type,
        headers={
            # The bytes under an id never change; deletion makes the id 404 for good.
            "Cache-Control": "public, max-age=86400",
            # Never let a browser guess a type (an uploaded "image" that is really HTML).
            "X-Content-Type-Options": "nosniff",
        },
    )


@router.delete(
    "/{item_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    dependencies=[Depends(require_api_key)],
    responses={401: {"description": "missing or wrong X-API-Key"},
               404: {"description": "no such item (or already deleted)"}},
)
def delete_gallery_item(item_id: ItemId, resources: ResourcesDep) -> Response:
    """Delete an item; it never appears in results again (committed, then unindexed)."""
    with resources.sessions.begin() as session:
        deleted = store.delete_items([item_id], session=session)
    if not deleted:
        raise HTTPException(404, f"no gallery item {item_id}")
    resources.searcher.remove(deleted)
    resources.metrics.gallery_writes.labels("delete").inc(len(deleted))
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _get_or_404(item_id: int, session) -> GalleryItem:
    item = store.get_item(item_id, session=session)
    if item is None:
        raise HTTPException(404, f"no gallery item {item_id}")
    return item


def _public(item: GalleryItem) -> GalleryItemPublic:
    return GalleryItemPublic(
        id=item.id, label=item.label, camera=item.camera, metadata=item.meta or {},
        content_type=item.content_type, sha256=item.sha256, uri=image_uri(item.id),
        created_at=item.created_at,
    )


def image_uri(item_id: int) -> str:
    """Where a client fetches an item's image (relative to the API root)."""
    return f"/gallery/{item_id}/image"


def _check_count(name: str, values: list[Any], n: int) -> None:
    if len(values) != n:
        raise HTTPException(
            422, f"{len(values)} {name} for {n} images: send one {name[:-1]} per image, in order"
        )


def _parse_metadata(values: list[str] | None, n: int) -> list[dict[str, Any] | None]:
    if not values:
        return [None] * n
    if len(values) not in (1, n):
        raise HTTPException(
            422, f"{len(values)} metadata fields for {n} images: send one per image or one for all"
        )
    parsed = [parse_json_object(value, f"metadata[{i}]") for i, value in enumerate(values)]
    return parsed * n if len(parsed) == 1 else parsed


def parse_json_object(value: str, name: str) -> dict[str, Any]:
    """A form field holding a JSON object (``{"color": "red"}``); 422 otherwise."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise HTTPException(422, f"{name}: not valid JSON ({exc.msg})") from None
    if not isinstance(parsed, dict):
        raise HTTPException(422, f"{name}: expected a JSON object like {{\"key\": \"value\"}}")
    return parsed
