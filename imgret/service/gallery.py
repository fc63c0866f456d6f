"""The gallery as the service changes and reads it: add and delete items, look up items and
stored images (gallery and query sets), and search with a stored item.

The routers (:mod:`imgret.service.routers.gallery`, ``search``, ``query_sets``) turn HTTP into these
calls and their results back into HTTP; SQL stays in :mod:`imgret.gallery.storage`. Refusals
are domain errors (:class:`~imgret.service.request_rules.NotFound`, :class:`NoEmbedding`) that
:mod:`imgret.service.errors` answers.

Writes commit in SQL before the in-memory index changes (the database is the source of truth:
an index is rebuilt or replayed from it at start-up), so an acknowledged add survives a crash
and a delete that committed stays deleted.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import numpy as np
from sqlalchemy.orm import Session

from imgret.embedder import Embedder
from imgret.errors import GalleryError
from imgret.gallery.ingest import AddedItems, NewItem, add_items
from imgret.gallery.media.files import MediaBackend
from imgret.gallery.media.gc import purge_media
from imgret.gallery.search import SearchFilter
from imgret.gallery.search.identities import IdentityGroup
from imgret.gallery.search.rerank import Rerank
from imgret.gallery.storage import item_store, query_set_store, vector_store
from imgret.gallery.storage.tables import DEFAULT_COLLECTION, GalleryItem
from imgret.gallery.versions import version_store
from imgret.images import DecodeLimits, check_request_pixels
from imgret.process import in_own_thread
from imgret.service.pipeline import Answer, ItemQuery, Serving
from imgret.service.request_rules import NotFound
from imgret.service.resources.bundle import Resources

logger = logging.getLogger(__name__)

# Sent with every stored image. Gallery images may be faces: no shared cache keeps a copy,
# and none outlives a delete (a browser's own cache included). And a browser never guesses a
# type (an uploaded "image" that is really HTML).
IMAGE_HEADERS = {"Cache-Control": "private, no-store", "X-Content-Type-Options": "nosniff"}


class NoEmbedding(GalleryError):
    """A live item without a vector of the served version yet (409: retry shortly)."""


@dataclass(frozen=True)
class StoredImage:
    """An image's bytes and the content type found at upload."""

    data: bytes
    content_type: str


def image_uri(item_id: int, collection: str = DEFAULT_COLLECTION) -> str:
    """Where a client fetches an item's image (relative to the API root): under the routes of
    the item's collection."""
    if collection == DEFAULT_COLLECTION:
        return f"/gallery/{item_id}/image"
    return f"/collections/{collection}/gallery/{item_id}/image"


def add(resources: Resources, items: list[NewItem]) -> AddedItems:
    """Add ``items``; they are searchable in this process when this returns.

    Every header is priced against the request's pixel budget before one pixel is decoded (a
    ratio bomb costs a 413, not gigabytes); then each image is decoded under the process's
    decode gate and shrunk towards the model's input size at once (:func:`add_items`). Rows,
    embeddings and change-log entries commit in one transaction, then the index changes.
    """
    limits = DecodeLimits.from_settings(resources.settings)
    serving = resources.serving  # model and index of one version, read once
    check_request_pixels([item.data for item in items],
                         size=serving.embedder.spec.image_size, limits=limits)

    def embed_and_write(embedder: Embedder) -> AddedItems:
        # Decoded and embedded on a thread that ends with the request: an anyio worker would
        # keep the torch threads it started, and slow the model thread's passes for good.
        return in_own_thread(add_items, items, session_factory=resources.sessions,
                             media=resources.media, embedder=embedder, limits=limits,
                             require_active=True)

    try:
        added = embed_and_write(serving.embedder)
    except version_store.ModelSwitched:
        # Another version became active while this upload was embedded (by any process): an
        # acknowledged item must have its vector, so follow the switch and embed again.
        resources.follow_active()
        serving = resources.serving
        added = embed_and_write(serving.embedder)
    # Committed: now the index. An id deleted meanwhile (by any process) is not added back:
    # the Searcher remembers deletions, and every search first applies the newest ones.
    try:
        serving.searcher.add(added.vector_ids, added.vectors, added.infos)
    except Exception:  # noqa: BLE001 - the write is durable; make it searchable another way
        logger.exception("index update after a committed add failed; replaying from SQL")
        try:
            serving.searcher.refresh_from_changes()
        except Exception:  # noqa: BLE001 - e.g. the vector engine is down
            # Acknowledged all the same: SQL holds it, and the change-log follower makes it
            # searchable once the index answers (GET /health shows the lag meanwhile).
            logger.exception("replaying from SQL failed too; the follower retries")
    resources.metrics.gallery_writes.labels("add").inc(sum(added.created))
    return added


def delete(resources: Resources, item_id: int) -> None:
    """Delete an item: it never appears in results again, in any process, and its image bytes
    (and embeddings) are gone from this server's storage when this returns.

    Order: the delete commits in SQL (a crash after this point still deletes), the local
    index drops the id (other processes drop it before their next search starts), then the
    image bytes (file, or database blob) are removed if no other row refers to them (a crash
    before that is finished by the start-up sweep).

    Raises:
        NotFound: no live item ``item_id``.
    """
    with resources.sessions.begin() as session:
        deleted = item_store.delete_items([item_id], session=session)
    if not deleted:
        raise NotFound(f"no gallery item {item_id}")
    resources.searcher.remove([item.id for item in deleted])
    purge_media([item.sha256 for item in deleted], session_factory=resources.sessions,
                media=resources.media)
    resources.metrics.gallery_writes.labels("delete").inc(len(deleted))


def get_item(item_id: int, *, session: Session) -> GalleryItem:
    """The live item ``item_id``.

    Raises:
        NotFound: none (never added, or deleted).
    """
    item = item_store.get_item(item_id, session=session)
    if item is None:
        raise NotFound(f"no gallery item {item_id}")
    return item


def list_items(*, session: Session, offset: int, limit: int,
               label: str | None) -> tuple[list[GalleryItem], int]:
    """A page of live items in id order, and the number of items matching ``label``."""
    return item_store.list_items(session=session, offset=offset, limit=limit, label=label)


def read_image(resources: Resources, item_id: int) -> StoredImage:
    """The stored image of gallery item ``item_id``.

    Raises:
        NotFound: no such item, or its bytes are missing.
    """
    with resources.sessions() as session:
        item = get_item(item_id, session=session)
    return _read(resources.media, item.media_path, item.content_type,
                 missing=f"the image of gallery item {item_id}")


def query_sets(*, session: Session) -> list[tuple[str, int]]:
    """Every stored query set (``imgret ingest --query-set NAME``) and its size, by name."""
    return query_set_store.query_set_sizes(session=session)


def read_query_image(resources: Resources, query_set: str, item_id: int) -> StoredImage:
    """The stored image of query ``item_id`` of ``query_set``.

    Raises:
        NotFound: no such query, or its bytes are missing.
    """
    with resources.sessions() as session:
        item = query_set_store.get_query_item(query_set, item_id, session=session)
    if item is None:
        raise NotFound(f"query set {query_set!r} has no item {item_id}")
    return _read(resources.media, item.media_path, item.content_type,
                 missing=f"the image of query item {item_id}")


def _read(media: MediaBackend, media_path: str, content_type: str, *,
          missing: str) -> StoredImage:
    """Bytes read whole through the media store of the settings in force (uploads are capped
    by ``IMGRET_MAX_UPLOAD_BYTES``), the same way for files and database blobs."""
    try:
        data = media.read(media_path)  # the path is ours, from the row
    except (FileNotFoundError, ValueError):
        # Gone (a delete in between, files removed by hand) or never stored in this backend
        # (IMGRET_MEDIA_BACKEND switched, a replica without the shared volume).
        raise NotFound(f"{missing} is missing from the {media.backend} media store") from None
    return StoredImage(data, content_type)


async def search_by_id(resources: Resources, item_id: int, k: int,
                       filters: SearchFilter | None, rerank: Rerank | None,
                       group: IdentityGroup | None = None) -> Answer:
    """The ``k`` neighbours of a stored item, the item itself left out.

    Queued and batched like an uploaded image (the same queue, its limit and its 503s); the
    vector is read for the version of the batch that answers, so the vector and the index are
    of one version.

    Raises:
        NotFound: no live item ``item_id`` (when its batch runs).
        NoEmbedding: the item has no vector of that version yet.
    """
    base = filters or SearchFilter()
    flt = dataclasses.replace(base, exclude_ids=frozenset({*base.exclude_ids, item_id}))
    query = ItemQuery(item_id, functools.partial(_stored_vector, resources, item_id), k, flt,
                      rerank=rerank, group=group)
    return await resources.batcher.submit(query)


def _stored_vector(resources: Resources, item_id: int, serving: Serving) -> np.ndarray:
    """The item's stored ``(d,)`` vector for ``serving``'s version."""
    with resources.sessions() as session:
        version = version_store.get_model_version(session=session, version=serving.version)
        if item_store.get_item(item_id, session=session) is None:
            raise NotFound(f"gallery item {item_id} does not exist or was deleted")
        page = vector_store.fetch_vectors([item_id], session=session, model_version=version)
    if len(page.ids) == 0:
        raise NoEmbedding(
            f"gallery item {item_id} has no embedding for model version {serving.version} "
            "yet; retry shortly"
        )
    return page.vectors[0]
