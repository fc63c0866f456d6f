"""FastAPI dependencies: the app's resources and settings, one DB session per request, the
API-key guard.

Dependencies that only read the app's state are ``async def``: FastAPI runs a plain ``def``
dependency on a worker thread, and on the search path those hand-offs cost the event loop
more than the work itself (they delay every request of a batch).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, Security, status
from fastapi.security import APIKeyHeader
from sqlalchemy.orm import Session

from imgret.gallery.tenancy import collections
from imgret.service.auth import API_KEY_HEADER
from imgret.service.request_rules import InvalidRequest
from imgret.service.resources.bundle import Resources
from imgret.settings import Settings


async def get_resources(request: Request) -> AsyncIterator[Resources]:
    """The resources of the request's collection (model, index, sessions, batcher): the
    default one's, loaded by the lifespan, or those of ``/collections/{collection}/...``
    (:class:`imgret.service.collection_registry.CollectionRegistry`; 404 for an unknown name), held
    open until the response is sent (an idle collection is closed only when no request
    holds it)."""
    name = request.path_params.get("collection")
    if name is None:
        yield request.app.state.resources
        return
    try:
        # Dependencies run before FastAPI reports the path's own validation errors.
        collections.check_name(name)
    except ValueError as exc:
        raise InvalidRequest(f"collection: {exc}") from None
    # From here on an error may come from a delete that races this request (even while the
    # collection is being opened): the error handlers then answer 404 for the collection.
    request.state.collection = name
    registry = request.app.state.collections
    resources = await registry.resources(name)
    with registry.holding(name):
        yield resources


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
    description="an API key (`imgret keys create`, or IMGRET_API_KEY): required on writes and "
                "POST /evaluate once keys are in use, and on reads of a private collection",
)


async def require_api_key(
    request: Request, x_api_key: Annotated[str | None, Security(_API_KEY)]
) -> None:
    """Refuse with 401 a request that no key let in, once keys are in use.

    The check that counts runs earlier, in :class:`imgret.service.auth.WriteGuardMiddleware`,
    before any of the body is read (FastAPI parses a form before it solves dependencies): it
    checks the key against the role the route needs and leaves the caller in the request's
    state. This dependency documents the key in the OpenAPI schema (a security scheme) and
    refuses an anonymous caller again, so a keyed route the middleware would let through
    without a key is still guarded.
    """
    del x_api_key  # checked by the middleware (a stored key needs the KDF, off this path)
    keyring = request.app.state.keyring
    caller = request.scope.get("state", {}).get("caller")
    if keyring.in_use and (caller is None or caller.anonymous):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail=f"missing or wrong {API_KEY_HEADER} header",
            headers={"WWW-Authenticate": API_KEY_HEADER},
        )
