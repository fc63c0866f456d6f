"""The FastAPI app factory: middleware, routers, error handlers, and the lifespan that loads
the model and the index once per process."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio.to_thread
from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles

from imgret.gallery.storage.holders import hold_for_serving
from imgret.process import frozen_long_lived, in_own_thread
from imgret.service.access import KeyRing, need
from imgret.service.auth import (
    API_KEY_HEADER,
    WriteGuardMiddleware,
    bootstrap_key,
    has_api_key,
    is_write,
    normalized_origins,
)
from imgret.service.collection_registry import CollectionRegistry
from imgret.service.errors import install_error_handlers
from imgret.service.limits import UploadLimitMiddleware
from imgret.service.resources.follower import follow_changes
from imgret.service.resources.startup import load_resources, resume_interrupted_jobs
from imgret.service.routers import (
    admin,
    collections,
    evaluate,
    gallery,
    health,
    identify,
    identities,
    keys,
    metrics,
    models,
    query_sets,
    search,
    ui,
)
from imgret.service.security_headers import SecurityHeadersMiddleware
from imgret.service.tasks import cancel_and_wait
from imgret.service.telemetry import AccessLogMiddleware, ServiceMetrics
from imgret.settings import Settings

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
COLLECTION_PREFIX = "/collections/{collection}"
# The routes every collection has (the default one's at the root).
COLLECTION_ROUTERS = (search, identify, gallery, identities, evaluate, models, query_sets)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; nothing heavy happens until the lifespan starts.

    ``uvicorn --factory imgret.service.app:create_app`` calls this with no argument, so the settings
    come from the ``IMGRET_*`` environment; tests pass their own ``Settings``.

    Args:
        settings: runtime settings (default: read from the environment).

    Returns:
        The app. Entering its lifespan (uvicorn start-up, ``with TestClient(app)``) brings the
        schema up to date, loads the model (``IMGRET_MODEL``) and loads or rebuilds the index.
    """
    settings = settings or Settings()
    service_metrics = ServiceMetrics()
    app = FastAPI(
        title="imgret",
        summary="Image retrieval: search a gallery by image, manage it, evaluate retrieval.",
        version="0.1.0",
        lifespan=_lifespan,
        generate_unique_id_function=_operation_id,
    )
    app.state.settings = settings
    app.state.metrics = service_metrics
    app.state.keyring = KeyRing(bootstrap_key(settings))
    install_error_handlers(app)
    for module in (health, search, identify, gallery, identities, evaluate, models, query_sets,
                   metrics, ui, admin, collections, keys):
        app.include_router(module.router)
    # Another collection's routes are the default one's under /collections/{collection}.
    for module in COLLECTION_ROUTERS:
        app.include_router(module.router, prefix=COLLECTION_PREFIX,
                           dependencies=[Depends(collections.collection_path)])
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    # The last one added is the outermost. The write guard runs before the upload limit, so
    # an unauthorised write is refused before one byte of its body is read; the access log
    # sees both refusals.
    app.add_middleware(UploadLimitMiddleware, max_bytes=settings.max_upload_bytes)
    app.add_middleware(WriteGuardMiddleware, settings=settings, keyring=app.state.keyring)
    app.add_middleware(AccessLogMiddleware, metrics=service_metrics)
    if settings.allowed_origins:
        # Origins allowed to write may also read the answers and send the key (preflight).
        app.add_middleware(
            CORSMiddleware, allow_origins=sorted(normalized_origins(settings.allowed_origins)),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=[API_KEY_HEADER, "Content-Type"],
        )
    # Outermost: refusals and CORS answers carry the headers too.
    app.add_middleware(SecurityHeadersMiddleware, no_policy=(
        app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url))
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    if not has_api_key(settings):
        logger.warning(
            "no IMGRET_API_KEY: %s", "writes are accepted from every client "
            "(IMGRET_ALLOW_ANONYMOUS_WRITES=true)" if settings.allow_anonymous_writes else
            "writes are accepted only from this machine by a loopback name, not proxied",
        )
    # Held while serving: maintenance that needs the servers stopped is refused meanwhile.
    serving = await anyio.to_thread.run_sync(hold_for_serving, settings.db_url)
    # Loading a model and rebuilding an index take seconds: keep the loop free meanwhile. On
    # a thread that ends with the loading: torch runs on the batcher's model thread alone
    # once serving (imgret.process.in_own_thread says why).
    try:
        resources = await anyio.to_thread.run_sync(
            in_own_thread, load_resources, settings, app.state.metrics)
    except BaseException:
        serving.release()
        raise
    app.state.resources = resources
    app.state.collections = CollectionRegistry(resources)
    await anyio.to_thread.run_sync(app.state.keyring.attach, resources.sessions)
    await resources.batcher.start()
    # A re-embedding whose process died resumes here (it is chunked; nothing is redone).
    await anyio.to_thread.run_sync(resume_interrupted_jobs, resources)
    # Other API processes on the same database add and delete items too: follow them.
    follower = asyncio.create_task(follow_changes(resources), name="follow-gallery-changes")
    # Keys revoked and collections made private by any process: refused here within the
    # follower interval.
    key_follower = asyncio.create_task(app.state.keyring.follow(settings.follow_interval_s),
                                       name="follow-api-keys")
    reaper = asyncio.create_task(app.state.collections.reap(), name="close-idle-collections")
    collections_follower = asyncio.create_task(app.state.collections.follow(),
                                               name="follow-collections")
    try:
        # Started: what exists now lives as long as the app; full collections under load
        # stopped every request for ~200 ms scanning it (imgret.process).
        with frozen_long_lived():
            yield
    finally:
        await cancel_and_wait(collections_follower)
        await cancel_and_wait(reaper)
        await app.state.collections.close_all()
        await cancel_and_wait(key_follower)
        await cancel_and_wait(follower)
        await resources.batcher.stop()
        await anyio.to_thread.run_sync(resources.close)
        serving.release()


def _operation_id(route: APIRoute) -> str:
    # Stable OpenAPI operation ids for generated clients: "<tag>-<handler name>", and
    # "collection-<tag>-<handler name>" for the routes under /collections/{collection}.
    tag = route.tags[0] if route.tags else "default"
    scope = "collection-" if route.path_format.startswith(COLLECTION_PREFIX) else ""
    return f"{scope}{tag}-{route.name}"


# Responses every operation may give besides its own (documented once, here, so that the
# schema names every status the service really returns; schemathesis checks it).
_ERROR_SCHEMA = {
    "title": "ErrorMessage",
    "type": "object",
    "required": ["detail"],
    "properties": {
        "detail": {
            "description": "what was wrong: a message, or FastAPI's list of field errors",
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}],
        }
    },
}
_WRITE_ERRORS = {
    "401": f"missing or wrong {API_KEY_HEADER} header (once keys are in use)",
    "403": "a key without the role this needs, a cross-origin browser write, or a keyless "
           "server reached from beyond this machine, by a non-loopback name or through a proxy",
}
_KEYED_ERRORS = {
    "401": f"missing or wrong {API_KEY_HEADER} header: a private collection, or a bad key",
    "403": "a key without the role this needs",
}
_BODY_ERRORS = {
    "400": "malformed body (multipart or JSON that cannot be parsed)",
    "413": "body or decoded image over the limits (IMGRET_MAX_UPLOAD_BYTES, pixel budgets)",
}
_COMMON_ERRORS = {
    "503": "the database, the index or the batch queue is unavailable or full; retry",
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the error responses the middleware and handlers add.

    Every 4xx/5xx answer is ``{"detail": ...}``: a message string from our handlers, or the
    list of field errors of FastAPI's validation, so 422 documents both shapes.
    """
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = FastAPI.openapi(app)  # FastAPI's own (cached on the app), patched in place
    schema.setdefault("components", {}).setdefault("schemas", {})["ErrorMessage"] = (
        _ERROR_SCHEMA
    )
    error_content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorMessage"}}}
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            _describe_multipart_as_sent(schema, operation)
            responses = operation.setdefault("responses", {})
            extra = dict(_COMMON_ERRORS)
            if need(method, path) is not None:
                extra.update(_KEYED_ERRORS)
            if is_write(method, path):
                extra.update(_WRITE_ERRORS)
            if path.startswith(COLLECTION_PREFIX):
                extra["404"] = "no such collection (or no such item in it)"
            if "requestBody" in operation:
                extra.update(_BODY_ERRORS)
            if "parameters" in operation or "requestBody" in operation:
                extra["422"] = "invalid parameters, fields, images or values"
            for code, description in extra.items():
                responses.setdefault(code, {"description": description})
            for code, response in responses.items():
                if code[0] in "45":
                    # Replaces FastAPI's HTTPValidationError for 422: our handlers also
                    # answer 422 with a message string.
                    response["content"] = error_content
    app.openapi_schema = schema
    return schema


def _describe_multipart_as_sent(schema: dict[str, Any], operation: dict[str, Any]) -> None:
    """Make a multipart body's schema say what a client really sends (FastAPI's says more).

    * An optional form field is *absent*, never ``null`` (a form has no null): FastAPI's
      ``anyOf: [T, {"type": "null"}]`` becomes ``T``.
    * A file is a binary part: ``format: binary`` beside FastAPI's ``contentMediaType`` (what
      OpenAPI 3.0 tools, Swagger UI's file picker and generators look for).
    * A required repeated field (``images``, ``labels``) has at least one value: an empty list
      is the same request as a missing field.
    """
    content = operation.get("requestBody", {}).get("content", {})
    body = content.get("multipart/form-data", {}).get("schema", {})
    ref = body.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        body = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    required = set(body.get("required", ()))
    for name, field in body.get("properties", {}).items():
        options = [o for o in field.get("anyOf", ()) if o.get("type") != "null"]
        if "anyOf" in field and len(options) == 1:
            del field["anyOf"]
            for key, value in options[0].items():
                field.setdefault(key, value)  # the field's own title and description stay
        for part in (field, field.get("items", {})):
            if part.get("contentMediaType") == "application/octet-stream":
                part["format"] = "binary"
        if name in required and field.get("type") == "array":
            field.setdefault("minItems", 1)
