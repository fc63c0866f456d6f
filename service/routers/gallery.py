"""/gallery: add images (searchable at once), list, read, fetch image bytes, delete."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, HTTPException, Path, Query, UploadFile, status
from fastapi.responses import Response

from imgret.embedder import Embedder
from imgret.images import DecodeLimits, check_request_pixels
from imgret.process import in_own_thread
from index import store
from index.gc import purge_media
from index.ingest import AddedItems, NewItem, add_items
from index.media import MediaBackend
from index.models import GalleryItem
from service.deps import ResourcesDep, SessionDep, require_api_key
from service.schemas import (
    GalleryAddOutcome,
    GalleryItemList,
    GalleryItemPublic,
    GalleryItemsCreated,
)
from service.validation import (
    LABEL_MAX,
    Camera,
    SafeText,
    check_label,
    check_text,
    form_fields,
    parse_json_object,
)

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/gallery", tags=["gallery"])

ItemId = Annotated[int, Path(ge=1, le=2**63 - 1, description="gallery item id")]
SOURCE_MAX = 255
GALLERY_FIELDS = ("images", "labels", "cameras", "metadata")


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
        list[Camera] | None, Form(description="one camera id per image (re-ID data)")
    ] = None,
    metadata: Annotated[
        list[str] | None,
        Form(description="JSON objects: one per image, or one for all images"),
    ] = None,
    _fields: Annotated[None, Depends(form_fields(known=GALLERY_FIELDS))] = None,
) -> GalleryItemsCreated:
    """Add labelled images to the gallery; they are searchable when this returns.

    The rows, embeddings and change-log entries are committed in one transaction *before*
    the in-memory index changes, so an acknowledged item survives a crash (the index is
    rebuilt or replayed from SQL at start-up). Images whose bytes are already a live item are
    not added twice: ``items[i]`` says ``existing`` and shows the stored label, camera and
    metadata (the values sent are not applied to it).
    """
    n = len(images)
    if n > resources.settings.gallery_max_files:  # before any label check or decoding
        raise HTTPException(
            413, f"{n} images: send at most {resources.settings.gallery_max_files} per request "
                 "(IMGRET_GALLERY_MAX_FILES); bulk imports belong to `imgret ingest`"
        )
    _check_count("labels", labels, n)
    for position, label in enumerate(labels):
        check_label(label, f"labels[{position}]")
    for position, upload in enumerate(images):
        if upload.filename:  # kept as a note (``source``): it must be storable text
            check_text(upload.filename, f"images[{position}] file name")
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
    # Every header is priced against the request's pixel budget before one pixel is decoded
    # (a ratio bomb costs a 413, not gigabytes); then each image is decoded under the
    # process's decode gate and shrunk towards the model's input size at once (add_items).
    limits = DecodeLimits.from_settings(resources.settings)
    serving = resources.serving  # model and index of one version, read once
    size = serving.embedder.spec.image_size
    check_request_pixels([item.data for item in items], size=size, limits=limits)

    def add(embedder: Embedder) -> AddedItems:
        # Decoded and embedded on a thread that ends with the request: an anyio worker would
        # keep the torch threads it started, and slow the model thread's passes for good.
        return in_own_thread(add_items, items, session_factory=resources.sessions,
                             media=resources.media, embedder=embedder, limits=limits,
                             require_active=True)

    try:
        added = add(serving.embedder)
    except store.ModelSwitched:
        # Another version became active while this upload was embedded (by any process): an
        # acknowledged item must have its vector, so follow the switch and embed again.
        resources.follow_active()
        serving = resources.serving
        added = add(serving.embedder)
    # Committed: now the index. An id deleted meanwhile (by any process) is not added back:
    # the Searcher remembers deletions, and every search first applies the newest ones.
    try:
        serving.searcher.add(added.vector_ids, added.vectors, added.infos)
    except Exception:  # noqa: BLE001 - the write is durable; make it searchable another way
        logger.exception("index update after a committed add failed; replaying from SQL")
        serving.searcher.refresh_from_changes()
    resources.metrics.gallery_writes.labels("add").inc(sum(added.created))
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
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    label: Annotated[SafeText | None, Query(max_length=LABEL_MAX)] = None,
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
    response_class=Response,
    responses={200: {"content": {"image/*": {}}}, 404: {"description": "no such item"}},
)
def read_gallery_image(item_id: ItemId, session: SessionDep, resources: ResourcesDep):
    """The stored image bytes, with the content type found at upload."""
    item = _get_or_404(item_id, session)
    return stored_image(resources.media, item.media_path, item.content_type,
                        missing=f"the image of gallery item {item_id}")


def stored_image(media: MediaBackend, media_path: str, content_type: str, *,
                 missing: str) -> Response:
    """The response carrying a stored image (gallery or query set), read through the media
    store of the settings in force; 404 naming ``missing`` when its bytes are not there.

    The bytes are read whole (uploads are capped by ``IMGRET_MAX_UPLOAD_BYTES``), the same way
    for files and database blobs.
    """
    try:
        data = media.read(media_path)  # the path is ours, from the row
    except (FileNotFoundError, ValueError):
        # Gone (a delete in between, files removed by hand) or never stored in this backend
        # (IMGRET_MEDIA_BACKEND switched, a replica without the shared volume).
        raise HTTPException(
            404, f"{missing} is missing from the {media.backend} media store"
        ) from None
    return Response(
        data,
        media_type=content_type,
        headers={
            # Gallery images may be faces: no shared cache keeps a copy, and none outlives a
            # delete (a browser's own cache included).
            "Cache-Control": "private, no-store",
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
    """Delete an item: it never appears in results again, in any process, and its image
    bytes (and embeddings) are gone from this server's storage when the 204 is sent.

    Order: the delete commits in SQL (the source of truth: a crash after this point still
    deletes), the local index drops the id (other processes drop it before their next search
    starts), then the image bytes (file, or database blob) are removed if no other row refers
    to them (a crash before that is finished by the start-up sweep).
    """
    with resources.sessions.begin() as session:
        deleted = store.delete_items([item_id], session=session)
    if not deleted:
        raise HTTPException(404, f"no gallery item {item_id}")
    resources.searcher.remove([item.id for item in deleted])
    purge_media([item.sha256 for item in deleted], session_factory=resources.sessions,
                media=resources.media)
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
