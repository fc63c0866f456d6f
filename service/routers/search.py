"""/search and /search/batch: query images in, ranked gallery items out (dynamically batched)."""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import numpy as np
from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field, ValidationError
from starlette.datastructures import FormData, UploadFile

from imgret.errors import ImageDecodeError
from imgret.images import DecodeLimits, check_request_pixels
from index import store
from index.search import SearchFilter
from index.search.rerank import Rerank
from service.deps import ResourcesDep
from service.limits import check_search_budget
from service.pipeline import Answer, ImageQuery, ItemQuery, Serving
from service.resources import Resources
from service.routers.gallery import image_uri
from service.schemas import (
    K_MAX,
    RERANK_FIELDS,
    SearchBatchResponse,
    SearchHit,
    SearchRerankRequest,
    SearchResponse,
    form_field_schemas,
    parse_rerank_fields,
)
from service.validation import (
    LABEL_MAX,
    Camera,
    SafeText,
    WholeNumber,
    check_form_fields,
    parse_json_object,
    read_form,
    request_validation_error,
)

router = APIRouter(prefix="/search", tags=["search"])

K_DEFAULT = 10
ID_MAX = 2**63 - 1

_ERRORS = {
    400: {"description": "a malformed multipart body"},
    413: {"description": "upload, image, file count or decoded pixels over the limits"},
    422: {"description": "not an image, invalid options, or a request over the search "
                        "budget (results and re-ranking: see service.limits)"},
    503: {"description": "the search or re-ranking queue is full or the server is shutting "
                        "down; retry after Retry-After seconds"},
}


class SearchFields(BaseModel):
    """The option fields of ``/search`` and ``/search/batch`` besides re-ranking (which is
    :class:`~service.schemas.SearchRerankRequest`'s)."""

    k: WholeNumber | None = Field(None, ge=1, le=K_MAX, description="neighbours (default 10); may "
                                                              "also be sent as ?k=")
    label: SafeText | None = Field(None, max_length=LABEL_MAX,
                                   description="only items with this label")
    camera: Camera | None = Field(None, description="only items from this camera")
    metadata: str | None = Field(None, description='JSON object; only items whose metadata '
                                                    'has these values, e.g. {"color": "red"}')


class ItemSearchFields(SearchFields):
    """``/search``'s fields: the options and the ``id`` of a gallery item to search with."""

    id: WholeNumber | None = Field(None, ge=1, le=ID_MAX,
                           description="search with this gallery item's stored embedding "
                                       "instead of an image (the item itself is left out of "
                                       "the results)")


class _QueryK(BaseModel):
    k: WholeNumber | None = Field(None, ge=1, le=K_MAX)


@dataclass(frozen=True)
class SearchOptions:
    """What every search request may say besides its images."""

    k: int
    filters: SearchFilter | None
    rerank: Rerank | None = None


@dataclass(frozen=True)
class SearchForm:
    """A parsed search form: its files (in order), the ``id`` (``/search`` only) and the
    options."""

    files: list[UploadFile]
    item_id: int | None
    options: SearchOptions


def read_search_form(
    request: Request, form: FormData, *, files_field: str, fields: type[SearchFields]
) -> SearchForm:
    """Check and parse a search form with one model per part, on the event loop.

    The routes read the multipart body themselves instead of declaring one FastAPI parameter
    per field: FastAPI's per-field form handling and dependency solving were 54% of the
    event loop's time per ``/search`` request (cProfile under load, issue 14). The rules are
    the same as a declared form's: unknown and repeated fields are refused, blank fields
    count as not sent, and invalid values get FastAPI's own 422 (``loc`` ``body``/``query``).
    """
    single = (*fields.model_fields, *RERANK_FIELDS)
    check_form_fields(form, known=(files_field, *single), single=single)
    values: dict[str, str] = {}
    for name in fields.model_fields:
        value = form.get(name)
        if isinstance(value, UploadFile):
            raise HTTPException(422, f"{name}: send a text field, not a file")
        if value:  # blank is "not sent", as for a declared form field
            values[name] = value
    files = form.getlist(files_field)
    if any(not isinstance(file, UploadFile) for file in files):
        raise HTTPException(422, f"{files_field}: send a file, not a text field")
    try:
        parsed = fields.model_validate(values)
    except ValidationError as exc:
        raise request_validation_error(exc, "body") from None
    try:
        k_query = _QueryK.model_validate({"k": request.query_params.get("k")}).k
    except ValidationError as exc:
        raise request_validation_error(exc, "query") from None
    rerank = parse_rerank_fields(form, SearchRerankRequest)
    if parsed.k is not None and k_query is not None and parsed.k != k_query:
        raise HTTPException(422, f"k is {parsed.k} in the form but {k_query} in the query string")
    k = parsed.k if parsed.k is not None else k_query if k_query is not None else K_DEFAULT
    meta = parse_json_object(parsed.metadata, "metadata") if parsed.metadata else None
    filters = None
    if parsed.label is not None or parsed.camera is not None or meta:
        filters = SearchFilter(label=parsed.label, camera=parsed.camera, metadata=meta)
    return SearchForm(files, getattr(parsed, "id", None), SearchOptions(k, filters, rerank))


def _form_body(fields: type[SearchFields], files: dict[str, Any]) -> dict[str, Any]:
    """The documented multipart body of a search route (FastAPI cannot see the fields of a
    form the route reads itself)."""
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object",
        "properties": {**files, **form_field_schemas(fields),
                       **form_field_schemas(SearchRerankRequest)},
    }}}}}


@router.post(
    "",
    responses={**_ERRORS, 404: {"description": "no live item with that id"}},
    openapi_extra=_form_body(ItemSearchFields, {"image": {
        "type": "string", "format": "binary",
        "description": "the query image (or send `id` instead)"}}),
)
async def search_images(request: Request, resources: ResourcesDep) -> SearchResponse:
    """The ``k`` gallery items most similar to one image, best first.

    Send an ``image`` file, or the ``id`` of a gallery item: its stored embedding for the
    served version is the query (no upload, no decoding; the web page uses it when a
    neighbour is clicked). Both kinds wait in the same queue and are batched together
    (dynamic batching), off the event loop; re-ranking is finished on its own bounded pool.
    A request over the search budget (``service.limits``: ``k``, re-ranking candidates) gets
    422 before it is queued. ``score`` is the cosine similarity of unit embeddings: higher is
    better. ``model_version`` names the version whose model embedded the query and whose
    index ranked it (always the same one).
    """
    start = time.perf_counter()
    async with read_form(request) as form:
        search = read_search_form(request, form, files_field="image", fields=ItemSearchFields)
        if (search.item_id is None) == (len(search.files) == 0):
            raise HTTPException(
                422, "send exactly one of `image` (a file) or `id` (a gallery item)")
        check_search_budget(search.options.k, [search.options.rerank])
        if search.item_id is not None:
            # Queued and batched like an image: the same queue, its limit and its 503s.
            answer = await resources.batcher.submit(
                _item_query(resources, search.item_id, search.options))
        else:
            if len(search.files) != 1:
                raise HTTPException(
                    422, "send exactly one `image` file (use /search/batch for more)")
            data = await search.files[0].read()
            answer = await resources.batcher.submit(_image_query(data, search.options))
    return SearchResponse(
        results=_public_hits(answer),
        took_ms=round((time.perf_counter() - start) * 1000, 3),
        model_version=answer.serving.version,
    )


def _item_query(resources: Resources, item_id: int, options: SearchOptions) -> ItemQuery:
    """The pipeline's query for a stored item: its vector, the item itself left out."""
    base = options.filters or SearchFilter()
    flt = dataclasses.replace(base, exclude_ids=frozenset({*base.exclude_ids, item_id}))
    return ItemQuery(item_id, functools.partial(_stored_vector, resources, item_id),
                     options.k, flt, rerank=options.rerank)


def _stored_vector(resources: Resources, item_id: int, serving: Serving) -> np.ndarray:
    """The item's stored ``(d,)`` vector for ``serving``'s version (the batch's: the vector
    and the index of one version); 404 / 409 when there is none."""
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
    return page.vectors[0]


def _image_query(data: bytes, options: SearchOptions) -> ImageQuery:
    """The pipeline's query for an uploaded image."""
    return ImageQuery(data, options.k, options.filters, rerank=options.rerank)


@router.post(
    "/batch",
    responses=_ERRORS,
    openapi_extra=_form_body(SearchFields, {"images": {
        "type": "array", "items": {"type": "string", "format": "binary"},
        "description": "query images (at most IMGRET_SEARCH_BATCH_MAX_FILES, default 32)"}}),
)
async def search_images_batch(request: Request, resources: ResourcesDep) -> SearchBatchResponse:
    """The neighbours of several images, in request order (each list best first).

    A corrupt image fails the whole request with 422, naming its position (``images[i]``).
    More files than ``IMGRET_SEARCH_BATCH_MAX_FILES``, or files whose headers together declare
    more pixels than ``IMGRET_MAX_REQUEST_PIXELS``, get 413 before any image is decoded; a
    request over the search budget (queries x ``k`` results, queries x re-ranking cost:
    ``service.limits``) gets 422.
    """
    start = time.perf_counter()
    settings = resources.settings
    async with read_form(request) as form:
        search = read_search_form(request, form, files_field="images", fields=SearchFields)
        images, options = search.files, search.options
        if not images:
            raise HTTPException(422, "send at least one `images` file")
        if len(images) > settings.search_batch_max_files:
            raise HTTPException(
                413, f"{len(images)} images: send at most {settings.search_batch_max_files} "
                     "per request (IMGRET_SEARCH_BATCH_MAX_FILES)"
            )
        check_search_budget(options.k, [options.rerank] * len(images))
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
