"""The FastAPI app factory: middleware, routers, error handlers, and the lifespan that loads
the model and the index once per process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio.to_thread
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles

from imgret.settings import Settings
from service.errors import install_error_handlers
from service.limits import UploadLimitMiddleware
from service.resources import follow_changes, load_resources
from service.routers import evaluate, gallery, health, metrics, search, ui
from service.telemetry import AccessLogMiddleware, ServiceMetrics

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; nothing heavy happens until the lifespan starts.

    ``uvicorn --factory service.app:create_app`` calls this with no argument, so the settings
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
    install_error_handlers(app)
    for module in (health, search, gallery, evaluate, metrics, ui):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    # The last one added is the outermost: the access log also sees the limit's 413s.
    app.add_middleware(UploadLimitMiddleware, max_bytes=settings.max_upload_bytes)
    app.add_middleware(AccessLogMiddleware, metrics=service_metrics)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    # Loading a model and rebuilding an index take seconds: keep the loop free meanwhile.
    resources = await anyio.to_thread.run_sync(load_resources, settings, app.state.metrics)
    app.state.resources = resources
    await resources.batcher.start()
    # Other API processes on the same database add and delete items too: follow them.
    follower = asyncio.create_task(follow_changes(resources), name="follow-gallery-changes")
    try:
        yield
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await resources.batcher.stop()
        resources.close()


def _operation_id(route: APIRoute) -> str:
    # Stable OpenAPI operation ids for generated clients: "<tag>-<handler name>".
    tag = route.tags[0] if route.tags else "default"
    return f"{tag}-{route.name}"
