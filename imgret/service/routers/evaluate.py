"""POST /evaluate: retrieval metrics of a labelled query set, ranked through the serving index.

HTTP only: the body is a JSON :class:`~imgret.service.schemas.evaluation.EvaluateRequest` or
a multipart :class:`~imgret.service.schemas.evaluation.EvaluateUpload`
(:mod:`imgret.service.forms`); the work is :mod:`imgret.service.version_evaluation`'.
"""

from __future__ import annotations

import functools
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import ValidationError

from imgret.process import in_own_thread
from imgret.service import version_evaluation
from imgret.service.deps import ResourcesDep, require_api_key
from imgret.service.forms import form_schema, open_form
from imgret.service.request_rules import request_validation_error
from imgret.service.resources.bundle import Resources
from imgret.service.schemas.evaluation import (
    EvaluateRequest,
    EvaluateUpload,
    EvaluationReport,
    ModelComparison,
)

router = APIRouter(prefix="/evaluate", tags=["evaluate"], dependencies=[Depends(require_api_key)])


@router.post(
    "",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                # Inlined: no route declares EvaluateRequest as a parameter, so FastAPI would
                # not put it under components/schemas for a $ref to find.
                "application/json": {"schema": EvaluateRequest.model_json_schema()},
                "multipart/form-data": {"schema": form_schema(EvaluateUpload)},
            },
        }
    },
    responses={
        401: {"description": "missing or wrong X-API-Key"},
        404: {"description": "unknown query set or model version"},
        413: {"description": "more files than IMGRET_EVALUATE_MAX_FILES, or more decoded "
                            "pixels than IMGRET_MAX_REQUEST_PIXELS"},
        415: {"description": "neither JSON nor multipart"},
        422: {"description": "invalid options, images or labels"},
    },
)
async def evaluate_query_set(
    request: Request, resources: ResourcesDep
) -> EvaluationReport | ModelComparison:
    """Evaluate retrieval on a labelled query set, through the same index as ``/search``.

    Two ways to send the queries:

    * **JSON** ``{"query_set": NAME, ...}``: a set stored by ``imgret ingest --query-set``.
      ``model_version`` evaluates another stored version (its embeddings must exist);
      ``compare_to`` evaluates a second one on the same queries and reports the paired
      bootstrap difference of the two.
    * **multipart**: ``images`` + ``labels`` (+ ``cameras``), embedded with the served model.

    Options: ``k`` (cut-offs, default 1,5,10), ``exclude_same_camera`` (re-ID rule),
    ``worst`` (the n worst queries with their top neighbours), ``rerank`` (+ its
    ``rerank_*`` parameters: rank with k-reciprocal re-ranking or query expansion, as
    ``/search`` does; ``rerank_compare`` with JSON: plain (A) against re-ranked (B), paired),
    ``open_set`` / ``fpirs`` / ``unknown_labels`` (open-set decisions: queries whose label
    the gallery does not hold are non-mated; the ``open_set`` section gives FNIR and the
    threshold at each target FPIR, rank-1 identification, the DET curve and TAR@FAR, each
    with a 95% interval; added by default when the queries are both mated and non-mated).
    A re-ranked evaluation is not kept as the version's last evaluation. The work runs on a
    thread of its own, which ends with it (its torch threads with it: imgret.process); the
    report says which protocol, re-ranking and model version produced it.
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/json":
        options = _parse_json(await request.body())
        return await anyio.to_thread.run_sync(in_own_thread, _evaluate_named, resources,
                                              options)
    if content_type == "multipart/form-data":
        max_files = resources.settings.evaluate_max_files
        # An uploaded query set is embedded in one request: a named set has no such limit.
        too_many = (f"too many images: send at most {max_files} per request "
                    "(IMGRET_EVALUATE_MAX_FILES), or store a larger query set with "
                    "`imgret ingest --query-set NAME` and evaluate it by name")
        async with open_form(request, EvaluateUpload, max_files=max_files,
                             max_fields=4 * max_files, too_many_files=too_many) as upload:
            images = [await image.read() for image in upload.images]
        evaluate = functools.partial(
            version_evaluation.evaluate_uploaded, resources, images, upload.labels,
            cameras=upload.cameras, model_versions=upload.version_names(), k=upload.k,
            exclude_same_camera=upload.exclude_same_camera, worst=upload.worst,
            rerank=upload.rerank_option(), open_set=upload.open_set_request(),
        )
        return await anyio.to_thread.run_sync(in_own_thread, evaluate)
    raise HTTPException(
        415, "send JSON {\"query_set\": NAME, ...} or multipart images + labels"
    )


def _parse_json(body: bytes) -> EvaluateRequest:
    try:
        return EvaluateRequest.model_validate_json(body)
    except ValidationError as exc:
        raise request_validation_error(exc, "body") from None


def _evaluate_named(resources: Resources, options: EvaluateRequest) -> dict[str, Any]:
    a, b = options.versions(resources.serving.version)
    return version_evaluation.evaluate_named(
        resources, options.query_set, a, b, k=options.k,
        exclude_same_camera=options.exclude_same_camera, worst=options.worst,
        rerank=options.rerank_option(), rerank_compare=options.rerank_compare,
        open_set=options.open_set_request(),
    )
