"""The one place that turns exceptions into HTTP ``{"detail": ...}`` answers.

* imgret's domain exceptions (:mod:`imgret.errors`) -> their 4xx (or 503) by the table below;
* the service's refusals (:mod:`imgret.service.unavailable`: queue full, pool full, shutting down)
  -> 503 with ``Retry-After``, by the same table;
* database errors (SQLAlchemy's wrappers of the driver's) -> 422 / 409 / 503, with a message
  that says what to do and never a line of SQL or a parameter value (those go to the log);
* request validation errors -> FastAPI's 422 shape, with each echoed input cut short (a
  client that sends a 10 MB label does not get it back).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc

from imgret import errors
from imgret.gallery.evaluation.retrieval import EvaluationError
from imgret.gallery.tenancy.collections import CollectionNotFound
from imgret.gallery.tenancy.keys import KeyNotFound
from imgret.gallery.versions.lifecycle import VersionNotFound
from imgret.service import request_rules
from imgret.service.unavailable import RETRY_AFTER_S, ServiceUnavailable

logger = logging.getLogger(__name__)

# Most specific first: the first isinstance match wins (ImageTooLarge is an ImageDecodeError).
# A name that has no match here falls through to the ImgretError row.
_STATUS: list[tuple[type[Exception], int]] = [
    (ServiceUnavailable, 503),
    (EvaluationError, 422),
    (VersionNotFound, 404),
    (CollectionNotFound, 404),
    (KeyNotFound, 404),
    (request_rules.InvalidRequest, 422),
    (request_rules.PayloadTooLarge, 413),
    (request_rules.MalformedBody, 400),
    (request_rules.NotFound, 404),
    (errors.ImageTooLarge, 413),
    (errors.ImageDecodeError, 422),
    (errors.UnknownName, 404),
    (errors.IndexStale, 503),
    (errors.IndexUnavailable, 503),
    (errors.DatabaseError, 503),
    (errors.GalleryError, 409),
    (errors.ModelRunError, 409),
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


async def _collection_gone(request: Request) -> JSONResponse | None:
    """404 for a request whose collection was deleted while it ran (by any process), ``None``
    when its collection is still there (or it names none).

    A request to a named collection looks it up first, but a delete can commit between that
    and the request's own reads and writes, which then fail on what the delete took with it
    (its versions, its rows). The client should hear what happened to the collection, not
    about a version or a conflict it never caused.
    """
    name = getattr(request.state, "collection", None)  # set once the collection was found
    registry = getattr(request.app.state, "collections", None)
    if name is None or registry is None:
        return None
    try:
        gone = await anyio.to_thread.run_sync(registry.is_gone, name)
    except sa_exc.SQLAlchemyError:
        return None  # the database is the problem: the first error says so
    if not gone:
        return None
    logger.info("%s %s -> 404: the collection was deleted meanwhile", request.method,
                request.url.path)
    return JSONResponse({"detail": f"no collection named {name!r}"}, status_code=404)


async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    gone = await _collection_gone(request)
    if gone is not None:
        return gone
    status = status_for(exc)
    # 5xx-like states (a stale index) deserve a warning; bad input is routine, and so is a
    # busy server telling its clients to come back.
    overloaded = isinstance(exc, ServiceUnavailable)
    log = logger.warning if status >= 500 and not overloaded else logger.info
    log("%s %s -> %d: %s", request.method, request.url.path, status, exc)
    # Some refusals carry what they were decided on (a refused activation: the comparison).
    extra = getattr(exc, "details", None) or {}
    headers = {"Retry-After": str(exc.retry_after_s)} if overloaded else None
    if isinstance(exc, errors.IndexUnavailable):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(jsonable_encoder({"detail": str(exc), **extra}), status_code=status,
                        headers=headers)


# Database errors, most specific first. The driver's exception (psycopg, sqlite3) is wrapped by
# SQLAlchemy in the class that names its SQLSTATE class: 22xxx -> DataError (value too long,
# numeric out of range, NUL in text or jsonb, bad escape), 23xxx -> IntegrityError (unique or
# foreign-key violations), 08xxx / 57Pxx / 40xxx / "database is locked" -> OperationalError.
_DB_STATUS: list[tuple[type[Exception], int, str]] = [
    (sa_exc.DataError, 422,
     "a value was refused by the database: too long, out of range, or holding a character "
     "it cannot store (such as NUL); check the fields sent"),
    (sa_exc.IntegrityError, 409,
     "the write conflicts with the stored gallery (a concurrent write of the same item, or "
     "an item deleted meanwhile); retry the request"),
    (sa_exc.OperationalError, 503,
     "the database is unavailable or busy; retry shortly"),
    (sa_exc.InterfaceError, 503,
     "the connection to the database was lost; retry shortly"),
]
INPUT_ECHO_MAX = 100


def database_status(exc: Exception) -> tuple[int, str] | None:
    """``(status, message)`` for a database error this module maps, else ``None`` (a bug)."""
    for kind, status, message in _DB_STATUS:
        if isinstance(exc, kind):
            return status, message
    return None


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    gone = await _collection_gone(request)
    if gone is not None:
        return gone
    mapped = database_status(exc)
    assert mapped is not None  # registered for the classes of _DB_STATUS only
    status, message = mapped
    # The driver's message names the column or the constraint: good for the log, not the client.
    orig = getattr(exc, "orig", None)
    cause = str(orig if orig is not None else exc).splitlines()[0][:300]
    log = logger.warning if status >= 500 else logger.info
    log("%s %s -> %d: %s: %s", request.method, request.url.path, status,
        type(orig or exc).__name__, cause)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (409, 503) else None
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(
        {"detail": jsonable_encoder([_short(error) for error in exc.errors()])}, status_code=422
    )


def _short(error: dict[str, Any]) -> dict[str, Any]:
    """A validation error with its echoed ``input`` cut to a few characters."""
    error = {key: value for key, value in error.items() if key != "url"}
    if "input" in error:
        value = error["input"]
        if isinstance(value, bytes | bytearray):
            value = f"<{len(value)} bytes>"
        elif isinstance(value, float) and not math.isfinite(value):
            value = repr(value)  # JSON has no inf or nan: the answer itself would fail
        elif not isinstance(value, str | int | float | bool | type(None)):
            value = repr(value)
        if isinstance(value, str) and len(value) > INPUT_ECHO_MAX:
            value = value[:INPUT_ECHO_MAX] + f"... ({len(value)} characters)"
        error["input"] = value
    if "ctx" in error:
        error["ctx"] = {key: str(value)[:INPUT_ECHO_MAX] for key, value in error["ctx"].items()}
    return error


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers of this module on ``app``."""
    app.add_exception_handler(errors.ImgretError, _domain_error)
    app.add_exception_handler(ServiceUnavailable, _domain_error)
    # ProgrammingError & co are not mapped: they are bugs of ours, left to the server's 500.
    for kind, _, _ in _DB_STATUS:
        app.add_exception_handler(kind, _database_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
