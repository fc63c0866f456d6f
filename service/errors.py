"""The one place that turns imgret's domain exceptions into HTTP 4xx ``{"detail": ...}`` answers."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from imgret import errors
from index.evaluation import EvaluationError

logger = logging.getLogger(__name__)

# Most specific first: the first isinstance match wins (ImageTooLarge is an ImageDecodeError).
# A name that has no match here falls through to the ImgretError row.
_STATUS: list[tuple[type[Exception], int]] = [
    (EvaluationError, 422),
    (errors.ImageTooLarge, 413),
    (errors.ImageDecodeError, 422),
    (errors.UnknownName, 404),
    (errors.IndexStale, 503),
    (errors.DatabaseError, 503),
    (errors.GalleryError, 409),
    (errors.InvalidIndexFactory, 422),
    (errors.CheckpointError, 422),
    (errors.ImgretError, 400),
]


def status_for(exc: Exception) -> int:
    """The HTTP status of a domain exception (400 for one this table does not name)."""
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return 400


async def _imgret_error(request: Request, exc: Exception) -> JSONResponse:
    status = status_for(exc)
    # 5xx-like states (a stale index) deserve a warning; bad input is routine.
    log = logger.warning if status >= 500 else logger.info
    log("%s %s -> %d: %s", request.method, request.url.path, status, exc)
    return JSONResponse({"detail": str(exc)}, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handler for every :class:`imgret.errors.ImgretError` on ``app``."""
    app.add_exception_handler(errors.ImgretError, _imgret_error)
