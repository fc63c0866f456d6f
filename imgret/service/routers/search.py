"""/search and /search/batch: query images in, ranked gallery items out (dynamically batched).

The path of a search, from this router to FAISS:

1. the form (:mod:`imgret.service.forms`, :class:`~imgret.service.schemas.search.ImageSearchForm`)
   and the request's budget (:mod:`imgret.service.limits`) are checked on the event loop;
2. the query (:class:`~imgret.service.pipeline.ImageQuery`, or an
   :class:`~imgret.service.pipeline.ItemQuery` built by
   :func:`imgret.service.gallery.search_by_id`) waits
   in the batcher's queue (:mod:`imgret.service.batching`), which runs whole batches off the loop;
3. each batch goes through the :class:`~imgret.service.pipeline.SearchPipeline`: decode, embed with
   the served model, rank in that version's :class:`~imgret.gallery.search.Searcher` (FAISS and the
   filters); a re-ranked query is finished on the batcher's re-ranking pool
   (:mod:`imgret.gallery.search.rerank`);
4. the hits come back here with their labels from the answering index's own map.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field, ValidationError

from imgret.errors import ImageDecodeError
from imgret.gallery.search import Hit, SearchFilter
from imgret.gallery.search.rerank import Rerank
from imgret.images import DecodeLimits, check_request_pixels
from imgret.service import gallery
from imgret.service.deps import ResourcesDep
from imgret.service.forms import form_body, open_form
from imgret.service.limits import check_search_budget
from imgret.service.pipeline import Answer, ImageQuery, decision, decision_top
from imgret.service.request_rules import InvalidRequest, WholeNumber, request_validation_error
from imgret.service.schemas.common import K_MAX
from imgret.service.schemas.search import (
    BatchSearchForm,
    DecisionOut,
    IdentityOut,
    ImageSearchForm,
    SearchBatchResponse,
    SearchForm,
    SearchHit,
    SearchResponse,
)

router = APIRouter(prefix="/search", tags=["search"])

K_DEFAULT = 10

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "a malformed multipart body"},
    413: {"description": "upload, image, file count or decoded pixels over the limits"},
    422: {"description": "not an image, invalid options, or a request over the search "
                        "budget (results and re-ranking: see imgret.service.limits)"},
    503: {"description": "the search or re-ranking queue is full or the server is shutting "
                        "down; retry after Retry-After seconds"},
}


class _QueryK(BaseModel):
    k: WholeNumber | None = Field(None, ge=1, le=K_MAX)


def _k(request: Request, form: SearchForm) -> int:
    """``k`` from the form or the query string (``?k=``; both: they must agree)."""
    try:
        k_query = _QueryK.model_validate({"k": request.query_params.get("k")}).k
    except ValidationError as exc:
        raise request_validation_error(exc, "query") from None
    if form.k is not None and k_query is not None and form.k != k_query:
        raise InvalidRequest(f"k is {form.k} in the form but {k_query} in the query string")
    return form.k if form.k is not None else k_query if k_query is not None else K_DEFAULT


@router.post(
    "",
    responses={**_ERRORS, 404: {"description": "no live item with that id"}},
    openapi_extra=form_body(ImageSearchForm),
)
async def search_images(request: Request, resources: ResourcesDep) -> SearchResponse:
    """The ``k`` gallery items most similar to one image, best first.

    Send an ``image`` file, or the ``id`` of a gallery item: its stored embedding for the
    served version is the query (no upload, no decoding; the web page uses it when a
    neighbour is clicked). Both kinds wait in the same queue and are batched together
    (dynamic batching), off the event loop; re-ranking is finished on its own bounded pool.
    A request over the search budget (``imgret.service.limits``: ``k``, re-ranking candidates) gets
    422 before it is queued. ``score`` is the cosine similarity of unit embeddings: higher is
    better. ``model_version`` names the version whose model embedded the query and whose
    index ranked it (always the same one). ``decision`` says who the query is under that
    version's calibrated threshold: the top identity's label when its score (the identity's
    template score over the best 100 items' labels, or the best item's for a version
    calibrated before identity scores) reaches it (``known``), else nobody; null with
    ``decision_note`` when the version has no calibration or was calibrated for another
    re-ranking.
    \f
    The path (not in the API description; the module docstring has each step): the form
    (:mod:`imgret.service.forms`) -> an :class:`~imgret.service.pipeline.ImageQuery` (or, by ``id``,
    :func:`imgret.service.gallery.search_by_id`'s ``ItemQuery``) in the batcher's queue
    (``resources.batcher``, :mod:`imgret.service.batching`) -> its batch through
    :class:`~imgret.service.pipeline.SearchPipeline` (decode, embed with the served model) -> that
    version's :class:`~imgret.gallery.search.Searcher` (FAISS, filters) -> a re-ranked query
    finished on the re-ranking pool (:mod:`imgret.service.followups`,
    :mod:`imgret.gallery.search.rerank`).
    """
    start = time.perf_counter()
    async with open_form(request, ImageSearchForm) as form:
        k, filters, rerank = _k(request, form), form.filters(), form.rerank_option()
        group = form.group(k)
        fetch = k if group is None else group.fetch_size(K_MAX)
        check_search_budget(fetch, [rerank])
        if form.id is not None:
            answer = await gallery.search_by_id(resources, form.id, fetch, filters, rerank,
                                                group)
        else:
            assert form.image is not None  # the form holds exactly one of them
            query = ImageQuery(await form.image.read(), fetch, filters, rerank=rerank,
                               group=group)
            answer = await resources.batcher.submit(query)
    identities = _public_identities(answer, resources.collection)
    hits = (_public_hits(answer, resources.collection) if identities is None
            else [hit for identity in identities for hit in identity.items])
    own = None if form.id is None else frozenset({form.id})
    decided, note = await _decision(answer, rerank, _without(filters, own))
    return SearchResponse(
        results=hits, identities=identities,
        took_ms=round((time.perf_counter() - start) * 1000, 3),
        model_version=answer.serving.version,
        decision=decided, decision_note=note,
    )


@router.post("/batch", responses=_ERRORS, openapi_extra=form_body(BatchSearchForm))
async def search_images_batch(request: Request, resources: ResourcesDep) -> SearchBatchResponse:
    """The neighbours of several images, in request order (each list best first).

    A corrupt image fails the whole request with 422, naming its position (``images[i]``).
    More files than ``IMGRET_SEARCH_BATCH_MAX_FILES``, or files whose headers together declare
    more pixels than ``IMGRET_MAX_REQUEST_PIXELS``, get 413 before any image is decoded; a
    request over the search budget (queries x ``k`` results, queries x re-ranking cost:
    ``imgret.service.limits``) gets 422. ``decisions``: one per image, as ``/search``'s
    ``decision`` (each with the threshold of the version that answered it).
    \f
    The path: as :func:`search_images`'s, each image one query in the same queue.
    """
    start = time.perf_counter()
    settings = resources.settings
    max_files = settings.search_batch_max_files
    too_many = (f"too many images: send at most {max_files} per request "
                "(IMGRET_SEARCH_BATCH_MAX_FILES)")
    async with open_form(request, BatchSearchForm, max_files=max_files,
                         too_many_files=too_many) as form:
        k, filters, rerank = _k(request, form), form.filters(), form.rerank_option()
        group = form.group(k)
        fetch = k if group is None else group.fetch_size(K_MAX)
        check_search_budget(fetch, [rerank] * len(form.images))
        blobs = [await upload.read() for upload in form.images]
    # Headers only, off the event loop: the whole request is priced before decoding starts.
    await anyio.to_thread.run_sync(
        lambda: check_request_pixels(
            blobs, size=resources.embedder.spec.image_size,
            limits=DecodeLimits.from_settings(settings),
        )
    )
    queries = [ImageQuery(data, fetch, filters, rerank=rerank, group=group) for data in blobs]
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
    grouped = [_public_identities(answer, resources.collection) for answer in answers]
    results = [_public_hits(answer, resources.collection) if identities is None
               else [hit for identity in identities for hit in identity.items]
               for answer, identities in zip(answers, grouped, strict=True)]
    decided = [await _decision(answer, rerank, filters) for answer in answers]
    notes = {note for _, note in decided if note is not None}
    return SearchBatchResponse(
        results=results,
        identities=None if group is None else [identities or [] for identities in grouped],
        took_ms=round((time.perf_counter() - start) * 1000, 3),
        model_version=versions.pop() if versions else resources.serving.version,
        # One version answered every query (checked above): all have a decision, or none.
        decisions=None if notes or not answers else [d for d, _ in decided if d is not None],
        decision_note=notes.pop() if notes else None,
    )


async def _decision(answer: Answer, rerank: Rerank | None,
                    flt: SearchFilter | None) -> tuple[DecisionOut | None, str | None]:
    """The decision on the answer, under the calibration of the version that produced it
    (:func:`imgret.service.pipeline.decision`), on the score that calibration measured: the
    top identity's template score over the answer's items, or its best item's
    (:func:`imgret.service.pipeline.decision_top`; read off the event loop)."""
    top = await anyio.to_thread.run_sync(decision_top, answer, flt)
    made, note = decision(answer, top, rerank)
    if made is None:
        return None, note
    return DecisionOut(label=made.label, score=made.score, threshold=made.threshold,
                       known=made.known), None


def _without(flt: SearchFilter | None, ids: frozenset[int] | None) -> SearchFilter | None:
    """``flt`` that also leaves ``ids`` out (a search by id leaves the item itself out)."""
    if not ids:
        return flt
    base = flt or SearchFilter()
    return dataclasses.replace(base, exclude_ids=frozenset({*base.exclude_ids, *ids}))


def _public_identities(answer: Answer, collection: str) -> list[IdentityOut] | None:
    """A grouped answer's identities, each with its public items (``None``: not grouped)."""
    if answer.identities is None:
        return None
    out = []
    for identity in answer.identities:
        items = _public_hits(answer, collection, identity.hits)
        if items:  # every item deleted while the request was in flight: nobody to show
            out.append(IdentityOut(label=identity.label, score=identity.score, items=items))
    return out


def _public_hits(answer: Answer, collection: str,
                 hits: Sequence[Hit] | None = None) -> list[SearchHit]:
    """Hits (default: the answer's) with their label, camera and metadata from the answering
    index's own map (no SQL)."""
    public = []
    for hit in answer.hits if hits is None else hits:
        info = answer.serving.searcher.info(hit.id)
        if info is None:
            continue  # deleted while this request was in flight
        public.append(
            SearchHit(
                id=hit.id, score=hit.score, label=info.label, camera=info.camera,
                uri=gallery.image_uri(hit.id, collection), metadata=dict(info.metadata or {}),
            )
        )
    return public
