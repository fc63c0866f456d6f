"""FastAPI dependencies: the app's resources and settings, one DB session per request, the
API-key guard.

Dependencies that only read the app's state are ``async def``: FastAPI runs a plain ``def``
dependency on a worker thread, and on the search path those hand-offs cost the event loop
more than the work itself (they delay every request of a batch).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, Security, status
from fastapi.security import APIKeyHeader
from sqlalchemy.orm import Session

from imgret.index import collections
from imgret.service.auth import API_KEY_HEADER, has_api_key
from imgret.service.request_rules import InvalidRequest
from imgret.service.resources import Resources
from imgret.settings import Settings


async def get_resources(request: Request) -> Resources:
    """The resources of the request's collection (model, index, sessions, batcher): the
    default one's, loaded by the lifespan, or those of ``/collections/{collection}/...``
    (:class:`imgret.service.collections.CollectionRegistry`; 404 for an unknown name)."""
    name = request.path_params.get("collection")
    if name is None:
        return request.app.state.resources
    try:
        # Dependencies run before FastAPI reports the path's own validation errors.
        collections.check_name(name)
    except ValueError as exc:
        raise InvalidRequest(f"collection: {exc}") from None
    return await request.app.state.collections.resources(name)


ResourcesDep = Annotated[Resources, Depends(get_resources)]


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(resources: ResourcesDep) -> Iterator[Session]:
    """One session per request; writes frame their own transaction (``session.begin()``)."""
    with resources.sessions() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]


_API_KEY = APIKeyHeader(
    name=API_KEY_HEADER, auto_error=False,
    description="required on writes (POST/DELETE /gallery, POST /evaluate) when IMGRET_API_KEY "
                "is set",
)


async def require_api_key(
    settings: SettingsDep, x_api_key: Annotated[str | None, Security(_API_KEY)]
) -> None:
    """Refuse with 401 unless ``X-API-Key`` equals ``IMGRET_API_KEY`` (when one is set).

    The check that counts runs earlier, in :class:`imgret.service.auth.WriteGuardMiddleware`, before
    any of the body is read (FastAPI parses a form before it solves dependencies). This
    dependency documents the key in the OpenAPI schema (a security scheme) and repeats the
    check, so a write route the middleware would not classify as a write is still guarded.
    The comparison takes the same time wherever the strings differ (no timing oracle).
    """
    if not has_api_key(settings):
        return  # no key configured: the write guard decides (loopback or explicit opt-in)
    expected = settings.api_key.get_secret_value().encode()
    # Starlette decodes headers as latin-1: this gives back the bytes the client sent.
    if not secrets.compare_digest((x_api_key or "").encode("latin-1"), expected):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail=f"missing or wrong {API_KEY_HEADER} header",
            headers={"WWW-Authenticate": API_KEY_HEADER},
        )
