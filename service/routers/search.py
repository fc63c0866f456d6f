"""/search and /search/batch: query images in, ranked gallery items out (dynamically batched)."""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Depends, File, Form, HTTPException, Query, Request, UploadFile

from imgret.errors import ImageDecodeError
from imgret.images import DecodeLimits, check_request_pixels
from index import store
from index.search import SearchFilter
from index.search.rerank import Rerank
from service.deps import ResourcesDep
from service.pipeline import Answer, ImageQuery
from service.resources import Resources
from service.routers.gallery import image_uri
from service.schemas import (
    K_MAX,
    RERANK_FIELDS,
    RerankRequest,
    SearchBatchResponse,
    SearchHit,
    SearchResponse,
)
from service.validation import LABEL_MAX, Camera, SafeText, form_fields, parse_json_object

router = APIRouter(prefix="/search", tags=["search"])

K_DEFAULT = 10
SEARCH_OPTIONS = ("k", "label", "camera", "metadata", *RERANK_FIELDS)
SEARCH_FIELDS = ("image", "images", "id", *SEARCH_OPTIONS)

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
    rerank: Rerank | None = None


@dataclass(frozen=True)
class RerankForm:
    """The checked re-ranking fields of a search form."""

    option: Rerank | None


async def rerank_form(**values: str | None) -> RerankForm:
    """The re-ranking fields, checked by :meth:`~service.schemas.RerankRequest.parse` (422)."""
    try:
        return RerankForm(RerankRequest.parse(values))
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None


# FastAPI reads the form fields from the signature: one per RerankRequest field, taken as text
# (the model parses it, as for /evaluate's form) and documented with the field's own schema.
rerank_form.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                      annotation=Annotated[str | None, Form(json_schema_extra=schema)])
    for name, schema in RerankRequest.field_schemas().items()
])


async def search_options(
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
    rerank: Annotated[RerankForm | None, Depends(rerank_form)] = None,
    _fields: Annotated[None, Depends(form_fields(known=SEARCH_FIELDS, single=SEARCH_OPTIONS))]
    = None,
) -> SearchOptions:
    """``k`` from the form or the query string, the optional filters and re-ranking (on the
    event loop: it only checks values, see ``service.deps``)."""
    if k_form is not None and k_query is not None and k_form != k_query:
        raise HTTPException(422, f"k is {k_form} in the form but {k_query} in the query string")
    k = k_form if k_form is not None else k_query if k_query is not None else K_DEFAULT
    meta = parse_json_object(metadata, "metadata") if metadata else None
    option = rerank.option if rerank is not None else None
    if label is None and camera is None and not meta:
        return SearchOptions(k, None, option)
    return SearchOptions(k, SearchFilter(label=label, camera=camera, metadata=meta), option)


SearchOptionsDep = Annotated[SearchOptions, Depends(search_options)]


@router.post("", responses={**_ERRORS, 404: {"description": "no live item with that id"}})
async def search_images(
    request: Request,
    resources: ResourcesDep,
    options: SearchOptionsDep,
    image: Annotated[
        UploadFile | None, File(description="the query image (or send `id` instead)")
    ] = None,
    item_id: Annotated[
        int | None,
        Form(alias="id", ge=1, le=2**63 - 1,
             description="search with this gallery item's stored embedding instead of an "
                         "image (the item itself is left out of the results)"),
    ] = None,
) -> SearchResponse:
    """The ``k`` gallery items most similar to one image, best first.

    Send an ``image`` file, or the ``id`` of a gallery item: its stored embedding for the
    served version is the query (no upload, no decoding; the web page uses it when a
    neighbour is clicked). Concurrent image requests are decoded and embedded together
    (dynamic batching), off the event loop. ``score`` is the cosine similarity of unit
    embeddings: higher is better. ``model_version`` names the version whose model embedded
    the query and whose index ranked it (always the same one).
    """
    start = time.perf_counter()
    form = await request.form()  # already parsed by FastAPI; this returns the same object
    images = form.getlist("image")
    if (item_id is None) == (len(images) == 0):
        raise HTTPException(422, "send exactly one of `image` (a file) or `id` (a gallery item)")
    if item_id is not None:
        answer = await anyio.to_thread.run_sync(_search_by_item, resources, item_id, options)
    else:
        if len(images) != 1 or image is None:
            raise HTTPException(422, "send exactly one `image` file (use /search/batch for more)")
        data = await image.read()
        answer = await resources.batcher.submit(_image_query(data, options))
    return SearchResponse(
        results=_public_hits(answer),
        took_ms=round((time.perf_counter() - start) * 1000, 3),
        model_version=answer.serving.version,
    )


def _search_by_item(resources: Resources, item_id: int, options: SearchOptions) -> Answer:
    """Search with a stored item's vector of the served version, leaving the item out."""
    serving = resources.serving  # read once: the vector and the index of one version
    with resources.sessions() as session:
        version = store.get_model_version(session=session, version=serving.version)
        if store.get_item(item_id, session=session) is None:
            raise HTTPException(404, f"gallery item {item_id} does not exist or was deleted")
        page = store.fetch_vectors([item_id], session=session, model_version=version)
    if len(page.ids) == 0:
        raise HTTPException(
            409, f"gallery item {item_id} has no embedding for model version {serving.version} "
                 "yet; retry shortly"
        )
    base = options.filters or SearchFilter()
    flt = dataclasses.replace(base, exclude_ids=frozenset({*base.exclude_ids, item_id}))
    hits = serving.searcher.search(page.vectors[:1], options.k, flt, rerank=options.rerank)[0]
    return Answer(hits, serving)


def _image_query(data: bytes, options: SearchOptions) -> ImageQuery:
    """The pipeline's query for an uploaded image."""
    return ImageQuery(data, options.k, options.filters, rerank=options.rerank)


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
    queries = [_image_query(data, options) for data in blobs]
    results = await resources.batcher.submit_many(queries, return_exceptions=True)
    answers: list[Answer] = []
    for position, result in enumerate(results):
        if isinstance(result, ImageDecodeError):
            # Same type (same status), with the position of the bad image in the message.
            raise type(result)(f"images[{position}]: {result}") from None
        if isinstance(result, BaseException):
            raise result
        answers.append(result)
    versions = {answer.serving.version for answer in answers}
    if len(versions) > 1:
        # The request's images were split over batches and a switch came in between: one
        # response names one version, so the request is answered by none.
        raise HTTPException(
            503, "the served model version changed during this request; send it again",
            headers={"Retry-After": "1"},
        )
    return SearchBatchResponse(
        results=[_public_hits(answer) for answer in answers],
        took_ms=round((time.perf_counter() - start) * 1000, 3),
        model_version=versions.pop() if versions else resources.serving.version,
    )


def _public_hits(answer: Answer) -> list[SearchHit]:
    """Hits with their label, camera and metadata from the answering index's own map (no
    SQL)."""
    public = []
    for hit in answer.hits:
        info = answer.serving.searcher.info(hit.id)
        if info is None:
            continue  # deleted while this request was in flight
        public.append(
            SearchHit(
                id=hit.id, score=hit.score, label=info.label, camera=info.camera,
                uri=image_uri(hit.id), metadata=dict(info.metadata or {}),
            )
        )
    return public
