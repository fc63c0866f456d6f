"""/search and /search/batch: query images in, ranked gallery items out (dynamically batched)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, File, Form, HTTPException, Query, Request, UploadFile

from imgret.errors import ImageDecodeError
from imgret.images import DecodeLimits, check_request_pixels
from index.search import Hit, Searcher, SearchFilter
from service.deps import ResourcesDep
from service.pipeline import ImageQuery
from service.routers.gallery import image_uri
from service.schemas import K_MAX, SearchBatchResponse, SearchHit, SearchResponse
from service.validation import LABEL_MAX, Camera, SafeText, form_fields, parse_json_object

router = APIRouter(prefix="/search", tags=["search"])

K_DEFAULT = 10
SEARCH_OPTIONS = ("k", "label", "camera", "metadata")
SEARCH_FIELDS = ("image", "images", *SEARCH_OPTIONS)

_ERRORS = {
    413: {"description": "upload, image, file count or decoded pixels over the limits"},
    422: {"description": "not an image, or invalid options"},
    503: {"description": "the search queue is full or the server is shutting down; retry "
                        "after Retry-After seconds"},
}


@dataclass(frozen=True)
class SearchOptions:
    """What every search request may say besides its images."""

    k: int
    filters: SearchFilter | None


def search_options(
    k_form: Annotated[
        int | None, Form(alias="k", ge=1, le=K_MAX, description="neighbours (default 10)")
    ] = None,
    k_query: Annotated[
        int | None, Query(alias="k", ge=1, le=K_MAX, description="same as the form field k")
    ] = None,
    label: Annotated[
        SafeText | None, Form(max_length=LABEL_MAX, description="only items with this label")
    ] = None,
    camera: Annotated[Camera | None, Form(description="only items from this camera")] = None,
    metadata: Annotated[
        str | None,
        Form(description='JSON object; only items whose metadata has these values, e.g. '
                         '{"color": "red"}'),
    ] = None,
    _fields: Annotated[None, Depends(form_fields(known=SEARCH_FIELDS, single=SEARCH_OPTIONS))]
    = None,
) -> SearchOptions:
    """``k`` from the form or the query string, and the optional filters."""
    if k_form is not None and k_query is not None and k_form != k_query:
        raise HTTPException(422, f"k is {k_form} in the form but {k_query} in the query string")
    k = k_form if k_form is not None else k_query if k_query is not None else K_DEFAULT
    meta = parse_json_object(metadata, "metadata") if metadata else None
    if label is None and camera is None and not meta:
        return SearchOptions(k, None)
    return SearchOptions(k, SearchFilter(label=label, camera=camera, metadata=meta))


SearchOptionsDep = Annotated[SearchOptions, Depends(search_options)]


@router.post("", responses=_ERRORS)
async def search_images(
    request: Request,
    resources: ResourcesDep,
    image: Annotated[UploadFile, File(description="the query image")],
    options: SearchOptionsDep,
) -> SearchResponse:
    """The ``k`` gallery items most similar to one image, best first.

    Concurrent requests are decoded and embedded together (dynamic batching), off the event
    loop. ``score`` is the cosine similarity of unit embeddings: higher is better.
    """
    start = time.perf_counter()
    form = await request.form()  # already parsed by FastAPI; this returns the same object
    if len(form.getlist("image")) != 1:
        raise HTTPException(422, "send exactly one `image` file (use /search/batch for more)")
    data = await image.read()
    hits = await resources.batcher.submit(ImageQuery(data, options.k, options.filters))
    return SearchResponse(
        results=_public_hits(resources.searcher, hits),
        took_ms=round((time.perf_counter() - start) * 1000, 3),
        model_version=resources.searcher.model_version,
    )


@router.post("/batch", responses=_ERRORS)
async def search_images_batch(
    resources: ResourcesDep,
    images: Annotated[
        list[UploadFile],
        File(description="query images (at most IMGRET_SEARCH_BATCH_MAX_FILES, default 32)"),
    ],
    options: SearchOptionsDep,
) -> SearchBatchResponse:
    """The neighbours of several images, in request order (each list best first).

    A corrupt image fails the whole request with 422, naming its position (``images[i]``).
    More files than ``IMGRET_SEARCH_BATCH_MAX_FILES``, or files whose headers together declare
    more pixels than ``IMGRET_MAX_REQUEST_PIXELS``, get 413 before any image is decoded.
    """
    start = time.perf_counter()
    settings = resources.settings
    if len(images) > settings.search_batch_max_files:
        raise HTTPException(
            413, f"{len(images)} images: send at most {settings.search_batch_max_files} per "
                 "request (IMGRET_SEARCH_BATCH_MAX_FILES)"
        )
    blobs = [await upload.read() for upload in images]
    # Headers only, off the event loop: the whole request is priced before decoding starts.
    await anyio.to_thread.run_sync(
        lambda: check_request_pixels(
            blobs, size=resources.embedder.spec.image_size,
            limits=DecodeLimits.from_settings(settings),
        )
    )
    queries = [ImageQuery(data, options.k, options.filters) for data in blobs]
    results = await resources.batcher.submit_many(queries, return_exceptions=True)
    for position, result in enumerate(results):
        if isinstance(result, ImageDecodeError):
            # Same type (same status), with the position of the bad image in the message.
            raise type(result)(f"images[{position}]: {result}") from None
        if isinstance(result, BaseException):
            raise result
    return SearchBatchResponse(
        results=[_public_hits(resources.searcher, hits) for hits in results],
        took_ms=round((time.perf_counter() - start) * 1000, 3),
        model_version=resources.searcher.model_version,
    )


def _public_hits(searcher: Searcher, hits: list[Hit]) -> list[SearchHit]:
    """Hits with their label, camera and metadata from the index's own map (no SQL)."""
    public = []
    for hit in hits:
        info = searcher.info(hit.id)
        if info is None:
            continue  # deleted while this request was in flight
        public.append(
            SearchHit(
                id=hit.id, score=hit.score, label=info.label, camera=info.camera,
                uri=image_uri(hit.id), metadata=dict(info.metadata or {}),
            )
        )
    return public
