"""FastAPI dependencies: the app's resources, one DB session per request, the API-key guard."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request, status
from sqlalchemy.orm import Session, sessionmaker

from imgret.embedder import Embedder
from imgret.settings import Settings
from index.search import Searcher
from service.resources import Resources


def get_resources(request: Request) -> Resources:
    """The resources the lifespan loaded (model, index, sessions, batcher)."""
    return request.app.state.resources


ResourcesDep = Annotated[Resources, Depends(get_resources)]


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session_factory(resources: ResourcesDep) -> sessionmaker[Session]:
    return resources.sessions


def get_session(resources: ResourcesDep) -> Iterator[Session]:
    """One session per request; writes frame their own transaction (``session.begin()``)."""
    with resources.sessions() as session:
        yield session


def get_embedder(resources: ResourcesDep) -> Embedder:
    return resources.embedder


def get_searcher(resources: ResourcesDep) -> Searcher:
    return resources.searcher


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
SessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_session_factory)]
EmbedderDep = Annotated[Embedder, Depends(get_embedder)]
SearcherDep = Annotated[Searcher, Depends(get_searcher)]


def require_api_key(
    settings: SettingsDep,
    x_api_key: Annotated[str | None, Header(description="required when IMGRET_API_KEY is set")]
    = None,
) -> None:
    """Refuse with 401 unless ``X-API-Key`` equals ``IMGRET_API_KEY`` (when one is set).

    The comparison takes the same time wherever the strings differ (no timing oracle).
    """
    expected = settings.api_key
    if expected is None or not expected.get_secret_value():
        return  # no key configured: the service is open (a local or private deployment)
    given = (x_api_key or "").encode()
    if not secrets.compare_digest(given, expected.get_secret_value().encode()):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing or wrong X-API-Key header",
            headers={"WWW-Authenticate": "X-API-Key"},
        )
