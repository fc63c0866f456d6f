"""/models: register versions, re-embed the stored gallery for one in the background, switch
the served version (gated on a paired verdict), roll back. Same code as `imgret models`
(:mod:`imgret.gallery.versions.lifecycle`)."""

from __future__ import annotations

import threading
from typing import Annotated, Any, Literal

import anyio.to_thread
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response, status
from pydantic import ValidationError

from imgret.gallery.search.milvus_index import vector_dropper
from imgret.gallery.versions import intake, lifecycle
from imgret.process import in_own_thread
from imgret.service.deps import ResourcesDep, require_api_key
from imgret.service.forms import form_schema, open_form
from imgret.service.limits import content_length
from imgret.service.request_rules import MODEL_VERSION_MAX, NAME_MAX, SafeText
from imgret.service.resources.bundle import Resources
from imgret.service.schemas.versions import (
    ActivateRequest,
    CalibrateRequest,
    CalibrationInfo,
    ModelInfo,
    ModelList,
    RegisterRequest,
    RegisterUpload,
    Switch,
)
from imgret.service.version_evaluation import (
    calibrate_version,
    compare_named,
    compare_open_set,
)

router = APIRouter(prefix="/models", tags=["models"])

VersionPath = Annotated[str, Path(min_length=1, max_length=MODEL_VERSION_MAX,
                                  pattern=r"^[A-Za-z0-9_.\-]+$", description="model version")]
_KEYED = {401: {"description": "missing or wrong X-API-Key"}}
_NOT_FOUND = {404: {"description": "no such model version"}}
# Multipart framing around an uploaded checkpoint (boundaries, part headers).
_FORM_OVERHEAD = 64 * 1024
# One switch at a time in this process (the database serialises processes: the switch
# transaction holds the gallery write lock).
_SWITCH = threading.Lock()


def _describe(resources: Resources, version: str) -> dict[str, Any]:
    return _with_runtime(resources, lifecycle.describe_one(
        version, session_factory=resources.sessions, data_dir=resources.settings.data_dir,
        index_sizes=resources.index_sizes()))


def _with_runtime(resources: Resources, info: dict[str, Any]) -> dict[str, Any]:
    """``info`` with how this process runs the version's network, if it has it loaded (a
    read never loads a model)."""
    embedder = resources.embedders.get(info["version"])
    return {**info, "runtime": embedder.runtime_choice.to_dict() if embedder else None}


@router.get("")
def list_models(resources: ResourcesDep) -> ModelList:
    """Every registered version with coverage, index and job state; the active one; the
    recent switches."""
    return ModelList(
        active=lifecycle.active_version(session_factory=resources.sessions),
        models=[_with_runtime(resources, info) for info in lifecycle.describe(
            session_factory=resources.sessions, data_dir=resources.settings.data_dir,
            index_sizes=resources.index_sizes())],
        history=lifecycle.history(session_factory=resources.sessions),
    )


@router.get("/{version}", responses=_NOT_FOUND)
def read_model(version: VersionPath, resources: ResourcesDep) -> ModelInfo:
    """One version: config, created, coverage, index state, job progress, active flag, last
    evaluation."""
    return ModelInfo.model_validate(_describe(resources, version))


@router.post(
    "", status_code=status.HTTP_201_CREATED, dependencies=[Depends(require_api_key)],
    openapi_extra={"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": form_schema(RegisterUpload)},
        "application/json": {"schema": {
            "type": "object", "required": ["path"], "additionalProperties": False,
            "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 4096}},
        }},
    }}},
    responses={**_KEYED, 413: {"description": "checkpoint over IMGRET_MAX_CHECKPOINT_BYTES or "
                                              "body over IMGRET_MAX_UPLOAD_BYTES"},
               415: {"description": "neither JSON nor multipart"},
               409: {"description": "the version name is registered with other weights"},
               422: {"description": "not an imgret checkpoint, a path this server may not "
                                    "read, or a version that does not match its weights"}},
)
async def register_model(request: Request, resources: ResourcesDep) -> ModelInfo:
    """Register a checkpoint: an upload (multipart ``checkpoint``) or a ``path`` (a run
    directory or its ``model.pt``; JSON or form) under ``<data_dir>/models`` or
    ``IMGRET_MODEL_ROOTS``; any other path gets one generic 422, whatever is there.

    It is read with ``torch.load(weights_only=True)`` (no code runs), rebuilt, and its version
    recomputed from the weights; its bytes are stored in the database so every process can
    load it. Registering the same weights again is harmless (same version, 201); other
    weights under a registered version name are refused (409).
    """
    settings = resources.settings
    cap = settings.max_checkpoint_bytes
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    declared = content_length(request.scope)
    if declared is not None and declared > cap + _FORM_OVERHEAD:
        # Refused before one byte of the body is read (IMGRET_MAX_UPLOAD_BYTES may be larger).
        raise HTTPException(413, f"{declared} bytes is over the checkpoint limit of {cap} "
                                 "bytes (IMGRET_MAX_CHECKPOINT_BYTES)")
    kwargs = dict(session_factory=resources.sessions, data_dir=settings.data_dir,
                  max_bytes=cap)

    def by_path(path: str) -> dict[str, Any]:
        return intake.register_path(_checked_path(path), roots=settings.model_roots,
                                    **kwargs)

    try:
        if content_type == "application/json":
            path = _json_path(await request.body())
            info = await anyio.to_thread.run_sync(by_path, path)
        elif content_type == "multipart/form-data":
            async with open_form(request, RegisterUpload, max_files=1, max_fields=4) as form:
                if form.path is not None:
                    info = await anyio.to_thread.run_sync(by_path, form.path)
                else:
                    upload = form.checkpoint
                    assert upload is not None  # the form holds exactly one of them
                    if upload.size is not None and upload.size > cap:
                        raise intake.CheckpointTooLarge(
                            f"the checkpoint is {upload.size} bytes, over "
                            f"IMGRET_MAX_CHECKPOINT_BYTES ({cap})")
                    # The upload is spooled to a temporary file; one byte over the cap is
                    # enough to refuse it, so no more than that is read into memory.
                    data = await upload.read(cap + 1)
                    info = await anyio.to_thread.run_sync(
                        lambda: intake.register_upload(data, **kwargs))
        else:
            raise HTTPException(415, 'send JSON {"path": ...} or a multipart `checkpoint` file')
    except intake.CheckpointTooLarge as exc:
        raise HTTPException(413, str(exc)) from None
    return ModelInfo.model_validate(_describe(resources, info["version"]))


def _json_path(body: bytes) -> str:
    try:
        return _checked_path(RegisterRequest.model_validate_json(body).path)
    except ValidationError as exc:
        raise HTTPException(422, f"body: {exc.errors(include_url=False)[0]['msg']}") from None


def _checked_path(path: str) -> str:
    if not path.strip() or "\x00" in path or len(path) > 4096:
        raise HTTPException(422, "path: give the run directory or model.pt of a checkpoint")
    return path


@router.delete("/{version}", status_code=status.HTTP_204_NO_CONTENT,
               dependencies=[Depends(require_api_key)],
               responses={**_KEYED, **_NOT_FOUND,
                          409: {"description": "active, the rollback target, or being "
                                               "re-embedded"}})
async def delete_model(version: VersionPath, resources: ResourcesDep) -> Response:
    """Delete a version that is neither active nor the rollback target (the version the last
    switch replaced): its checkpoint, embeddings, query embeddings, saved index and row."""
    def drop() -> None:
        with _SWITCH:  # not while this process switches
            lifecycle.delete_version(version, session_factory=resources.sessions,
                                     data_dir=resources.settings.data_dir,
                                     drop_vectors=vector_dropper(resources.settings))
        resources.forget(version)
    await anyio.to_thread.run_sync(drop)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/rollback", dependencies=[Depends(require_api_key)],
             responses={**_KEYED, 409: {"description": "no previous version, or its coverage "
                                                       "cannot be completed"}})
async def rollback(resources: ResourcesDep) -> Switch:
    """Serve the version that the active one replaced again (items added meanwhile are
    embedded for it first). A second rollback goes forward again."""
    return await anyio.to_thread.run_sync(_switch, resources, None, None, None, "rollback")


@router.post("/{version}/embed", status_code=status.HTTP_202_ACCEPTED,
             dependencies=[Depends(require_api_key)],
             responses={**_KEYED, **_NOT_FOUND,
                        409: {"description": "the version's checkpoint is not stored"}})
async def embed_model(version: VersionPath, resources: ResourcesDep) -> ModelInfo:
    """Re-embed the stored gallery and query sets for ``version`` in the background.

    Chunked, resumable (each chunk commits; a new call, or the next start of any process,
    resumes an interrupted job), throttled so searches keep their latency
    (``IMGRET_EMBED_DUTY``). Progress: ``coverage`` and ``embedding`` of ``GET
    /models/{version}``. Calling it while the job runs (in any process) changes nothing.
    """
    def start() -> dict[str, Any]:
        assert resources.jobs is not None
        resources.jobs.start(version)
        return _describe(resources, version)

    return ModelInfo.model_validate(await anyio.to_thread.run_sync(start))


@router.post(
    "/{version}/calibrate", dependencies=[Depends(require_api_key)],
    responses={**_KEYED, 404: {"description": "no such model version or query set"},
               422: {"description": "target_fpir outside (0, 1), an empty query set, one "
                                    "without non-mated queries (identities the gallery does "
                                    "not hold) or with too few for the target"}},
)
async def calibrate_model(version: VersionPath, body: CalibrateRequest,
                          resources: ResourcesDep) -> CalibrationInfo:
    """Set ``version``'s decision threshold: the open-set evaluation of the version on
    ``query_set`` (through its index, as ``/evaluate``), the lowest threshold whose FPIR
    there is at most ``target_fpir``, kept with the version (its interval, the FPIR and FNIR
    measured at it, the set's content digest, the time). ``/search``, ``/search/batch`` and
    ``/identify`` decide with it while the version serves; ``GET /models/{v}`` shows it.
    """
    result = await anyio.to_thread.run_sync(
        in_own_thread, lambda: calibrate_version(resources, version, body.query_set,
                                                 body.target_fpir,
                                                 rerank=body.rerank_option()))
    return CalibrationInfo.model_validate(result.to_dict())


@router.post(
    "/{version}/activate", dependencies=[Depends(require_api_key)],
    responses={**_KEYED, **_NOT_FOUND,
               409: {"description": "coverage incomplete, checkpoint not stored, no "
                                    "calibration for require=fnir_not_worse, or a paired "
                                    "verdict that does not satisfy `require` (the body has "
                                    "the comparison and, for FNIR, `open_set`)"}},
)
async def activate_model(
    version: VersionPath, request: Request, resources: ResourcesDep,
    require: Annotated[list[Literal["better", "not_worse", "fnir_not_worse"]] | None,
                       Query(max_length=3)] = None,
    query_set: Annotated[SafeText | None, Query(min_length=1, max_length=NAME_MAX)] = None,
) -> Switch:
    """Serve ``version``: atomically, once its index is built and its coverage complete.

    Every search response names the version that produced it, and a search never mixes a
    query embedded by one version with another's index. ``require=better|not_worse`` with
    ``query_set=NAME`` (query string or JSON body) compares the active version and this one
    on that set first (paired bootstrap) and refuses with 409 and the comparison unless the
    verdict says so. ``require=fnir_not_worse`` (repeatable beside one of them) needs this
    version's calibration and refuses unless its FNIR at the calibrated FPIR is not worse
    than the active version's on ``query_set`` (paired bootstrap, each version at its own
    threshold for that FPIR). Other processes on the database follow within the follower
    interval.
    """
    body = await request.body()
    if body.strip():
        try:
            options = ActivateRequest.model_validate_json(body)
        except ValidationError as exc:
            raise HTTPException(422, f"body: {exc.errors(include_url=False)[0]['msg']}") from None
        if (require or query_set) and (options.require or options.query_set):
            raise HTTPException(422, "give require/query_set in the query string or the body, "
                                     "not both")
        require = options.requirements() or require
        query_set = options.query_set or query_set
    if require and query_set is None:
        raise HTTPException(422, "require needs query_set (a stored query set to compare on)")
    return await anyio.to_thread.run_sync(_switch, resources, version, require, query_set,
                                          "activate")


def _switch(resources: Resources, version: str | None, require: list[str] | None,
            query_set: str | None, reason: str) -> Switch:
    with _SWITCH:
        if version is None:
            version = lifecycle.previous_version(session_factory=resources.sessions)
        result = lifecycle.activate(
            version, session_factory=resources.sessions, data_dir=resources.settings.data_dir,
            media=resources.media, embedder=resources.embedder_for(version), require=require,
            query_set=query_set,
            compare=lambda a, b, name: compare_named(resources, a, b, name),
            compare_fnir=lambda a, b, name, calibration: compare_open_set(
                resources, a, b, name, calibration),
            prepare_index=resources.searcher_for, reason=reason,
            max_pixels=resources.settings.max_image_pixels,
        )
        # This process switches now; the others follow the database within their interval.
        resources.serve(version)
        return Switch.model_validate(result.to_dict())
