"""POST /evaluate: retrieval metrics of a labelled query set, ranked through the serving index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile

from imgret.errors import GalleryError
from imgret.process import in_own_thread
from index import store, versions
from index.search.rerank import Rerank
from service import evaluations
from service.deps import ResourcesDep, require_api_key
from service.resources import Resources
from service.schemas import (
    RERANK_FIELDS,
    WORST_MAX,
    EvaluateRequest,
    EvaluationReport,
    ModelComparison,
    RerankRequest,
    check_ks,
    form_field_schemas,
    parse_rerank_fields,
)
from service.validation import (
    CAMERA_MAX,
    MODEL_VERSION_MAX,
    check_label,
    read_form,
    request_validation_error,
)

router = APIRouter(prefix="/evaluate", tags=["evaluate"], dependencies=[Depends(require_api_key)])

_MULTIPART_SCHEMA = {
    "type": "object",
    "required": ["images", "labels"],
    "properties": {
        "images": {"type": "array", "items": {"type": "string", "format": "binary"}},
        "labels": {"type": "array", "items": {"type": "string"}},
        "cameras": {"type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": CAMERA_MAX}},
        "k": {"type": "array", "items": {"type": "integer"},
              "description": "repeated, or one comma-separated value; default 1,5,10"},
        "exclude_same_camera": {"type": "boolean"},
        "worst": {"type": "integer", "minimum": 0, "maximum": WORST_MAX},
        "model_version": {"type": "string", "maxLength": MODEL_VERSION_MAX,
                          "description": "embed and rank with this registered version"},
        "compare": {"type": "array", "minItems": 2, "maxItems": 2,
                    "items": {"type": "string", "maxLength": MODEL_VERSION_MAX},
                    "description": "two versions: both reports and the paired difference"},
        **form_field_schemas(RerankRequest),
    },
}


@router.post(
    "",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                # Inlined: no route declares EvaluateRequest as a parameter, so FastAPI would
                # not put it under components/schemas for a $ref to find.
                "application/json": {"schema": EvaluateRequest.model_json_schema()},
                "multipart/form-data": {"schema": _MULTIPART_SCHEMA},
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
    ``/search`` does; ``rerank_compare`` with JSON: plain (A) against re-ranked (B), paired).
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
        async with read_form(request, max_files=max_files, max_fields=4 * max_files,
                             too_many_files=too_many) as form:
            upload = await _parse_upload(form)
        return await anyio.to_thread.run_sync(in_own_thread, _evaluate_upload, resources,
                                          upload)
    raise HTTPException(
        415, "send JSON {\"query_set\": NAME, ...} or multipart images + labels"
    )


def _parse_json(body: bytes) -> EvaluateRequest:
    try:
        return EvaluateRequest.model_validate_json(body)
    except ValidationError as exc:
        raise request_validation_error(exc, "body") from None


@dataclass(frozen=True)
class _Upload:
    """A parsed multipart evaluation request."""

    images: list[bytes]
    labels: list[str]
    cameras: list[int] | None
    ks: list[int] | None
    exclude_same_camera: bool
    worst: int
    versions: list[str]
    rerank: Rerank | None


async def _parse_upload(form: FormData) -> _Upload:
    unknown = set(form.keys()) - {"images", "labels", "cameras", "k", "exclude_same_camera",
                                  "worst", "model_version", "compare", *RERANK_FIELDS}
    if unknown:
        raise HTTPException(422, f"unknown fields {sorted(unknown)}")
    rerank = parse_rerank_fields(form)
    names = [str(v) for v in form.getlist("compare")]
    single = [str(v) for v in form.getlist("model_version")]
    if names and single:
        raise HTTPException(422, "send model_version or compare, not both")
    if names and (len(names) != 2 or names[0] == names[1]):
        raise HTTPException(422, "compare: send two different model versions")
    if len(single) > 1:
        raise HTTPException(422, "model_version: send one")
    names = names or single
    if any(not v or len(v) > MODEL_VERSION_MAX or not v.isprintable() for v in names):
        raise HTTPException(422, "model_version: a registered version name")
    files = form.getlist("images")
    if not files:
        raise HTTPException(422, "no `images`: send the query images as repeated fields")
    if any(not isinstance(f, UploadFile) for f in files):
        raise HTTPException(422, "`images` must be files, not text fields")
    labels = [str(v) for v in form.getlist("labels")]
    if len(labels) != len(files):
        raise HTTPException(
            422, f"{len(labels)} labels for {len(files)} images: send one label per image"
        )
    for position, label in enumerate(labels):
        check_label(label, f"labels[{position}]")
    cameras = None
    raw_cameras = form.getlist("cameras")
    if raw_cameras:
        if len(raw_cameras) != len(files):
            raise HTTPException(
                422, f"{len(raw_cameras)} cameras for {len(files)} images: one per image"
            )
        cameras = [_int(v, "cameras") for v in raw_cameras]
        if any(not 0 <= camera <= CAMERA_MAX for camera in cameras):
            raise HTTPException(422, f"cameras: a camera id is 0 to {CAMERA_MAX}")
    ks_raw = [part for value in form.getlist("k") for part in str(value).split(",") if part.strip()]
    try:
        ks = check_ks([_int(v, "k") for v in ks_raw]) if ks_raw else None
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    exclude = _bool(form.get("exclude_same_camera", "false"))
    worst = _int(form.get("worst", "0"), "worst")
    if not 0 <= worst <= WORST_MAX:
        raise HTTPException(422, f"worst must be between 0 and {WORST_MAX}")
    images = [await f.read() for f in files]
    return _Upload(images, labels, cameras, ks, exclude, worst, names, rerank)


def _evaluate_upload(resources: Resources, upload: _Upload) -> dict[str, Any]:
    """One version (the served one by default), or two compared on the same uploads (each
    version embeds them with its own model)."""
    _require_known(resources, None, list(upload.versions))
    results = [
        evaluations.evaluate_upload(
            resources, upload.images, upload.labels, cameras=upload.cameras,
            version=version, k=upload.ks, exclude_same_camera=upload.exclude_same_camera,
            worst=upload.worst, rerank=upload.rerank,
        )
        for version in (upload.versions or [None])
    ]
    if len(results) == 1:
        return results[0].report
    return versions.comparison_report(*results)


def _evaluate_named(resources: Resources, options: EvaluateRequest) -> dict[str, Any]:
    pair = _pair(resources, options)
    _require_known(resources, options.query_set, list(pair or [options.model_version]))
    common = dict(k=options.k, exclude_same_camera=options.exclude_same_camera,
                  worst=options.worst)
    rerank = options.rerank_option()
    if pair is None:
        version = options.model_version or resources.serving.version
        if options.rerank_compare:
            return evaluations.compare_rerank(resources, version, options.query_set, rerank,
                                              **common)
        return evaluations.evaluate_version(resources, options.query_set, version,
                                            rerank=rerank, **common).report
    return evaluations.compare_named(resources, *pair, options.query_set, rerank=rerank,
                                     **common)


def _pair(resources: Resources, options: EvaluateRequest) -> tuple[str, str] | None:
    """The two versions to compare: ``compare: [a, b]``, or ``compare_to`` (b) against
    ``model_version`` (default the served one); ``None``: evaluate one version."""
    if options.compare:
        return options.compare[0], options.compare[1]
    if options.compare_to is not None:
        return options.model_version or resources.serving.version, options.compare_to
    return None


def _require_known(resources: Resources, query_set: str | None,
                   names: list[str | None]) -> None:
    """404 for a query set or model version that was never stored (before any work)."""
    with resources.sessions() as session:
        known = {row.version for row in store.list_model_versions(session=session)}
        for version in names:
            if version is not None and version not in known:
                raise HTTPException(
                    404, f"unknown model version {version!r}; stored: {', '.join(sorted(known))}"
                )
        if query_set is None:
            return
        try:
            store.load_query_set(query_set, session=session)
        except GalleryError as exc:
            raise HTTPException(404, str(exc)) from None


def _int(value: Any, name: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise HTTPException(422, f"{name}: {str(value)[:40]!r} is not an integer") from None


def _bool(value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise HTTPException(422, f"exclude_same_camera: {text[:20]!r} is not a boolean")
