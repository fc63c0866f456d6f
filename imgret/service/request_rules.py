"""What a request may hold, checked at the edge: the rules of a text, a number or a JSON form
field, the errors that refuse a request, and reading a form body within its limits
(:func:`read_form`; the fields are parsed by :mod:`imgret.service.forms`).

Everything here runs before a value reaches the database, so that hostile-but-ordinary input
gets a 422 with a message instead of a driver error (PostgreSQL refuses NUL in ``text`` and
``jsonb``, ``Infinity`` in ``jsonb``, integers beyond a column's range; Python's ``json``
recurses once per nesting level and refuses integers of more than 4300 digits with a
``ValueError``). Database errors that still happen are mapped in one place,
:mod:`imgret.service.errors`.

Rules (the service's decisions):

* **Text** (labels, file names, query-set names, model versions, filter values): no control
  characters (U+0000..U+001F, U+007F) and no lone surrogates (a client can produce them
  through ``\\ud800`` JSON escapes or a multipart ``charset=utf-7``).
* **Cameras** fit the 32-bit ``camera`` column and are not negative: 0..2**31-1.
* **Form fields**: see :mod:`imgret.service.forms` (unknown and repeated fields are refused).
* **JSON objects in form fields** (``metadata``): at most :data:`JSON_MAX_CHARS` characters
  and :data:`JSON_MAX_DEPTH` levels of nesting; numbers are finite (no ``NaN``,
  ``Infinity``, ``1e400``) and integers fit in 64 bits; keys are 1..255 characters without
  control characters; string values may hold tabs and newlines but no other control
  character.

A refusal is an :class:`InvalidRequest` (422), :class:`PayloadTooLarge` (413),
:class:`MalformedBody` (400) or :class:`NotFound` (404): domain errors that
:mod:`imgret.service.errors` answers, so the code that refuses needs no HTTP.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BeforeValidator, Field, PlainValidator, ValidationError
from starlette.datastructures import FormData

from imgret.errors import ImgretError

LABEL_MAX = 255
NAME_MAX = 255
MODEL_VERSION_MAX = 128  # model_versions.version is VARCHAR(128)
CAMERA_MAX = 2**31 - 1  # gallery_items.camera is a 32-bit INTEGER
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
JSON_MAX_CHARS = 16_384
JSON_MAX_DEPTH = 8
JSON_KEY_MAX = 255

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_BUT_WHITESPACE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# For the OpenAPI schema: the same rule as text_problem, as a JSON-schema pattern.
SAFE_TEXT_PATTERN = r"^[^\x00-\x1F\x7F]*$"


class InvalidRequest(ImgretError, ValueError):
    """A field, a form or a value the service refuses (422); the message names the field."""


class PayloadTooLarge(ImgretError, ValueError):
    """More files, fields or bytes than the limits allow (413); the message names the setting."""


class MalformedBody(ImgretError, ValueError):
    """A body that cannot be parsed as the form it claims to be (400)."""


class NotFound(ImgretError, LookupError):
    """Something the request names (an item, a query set, a stored image) is not there (404)."""


def text_problem(value: str, *, allow_whitespace_controls: bool = False) -> str | None:
    """Why ``value`` may not be stored as text, or ``None`` when it may."""
    control = _CONTROL_BUT_WHITESPACE if allow_whitespace_controls else _CONTROL
    found = control.search(value)
    if found:
        return (f"contains the control character U+{ord(found.group()):04X} at position "
                f"{found.start()} (NUL and other control characters are not allowed)")
    found = _SURROGATE.search(value)
    if found:
        return f"contains a lone surrogate U+{ord(found.group()):04X} (not valid Unicode)"
    return None


def label_problem(value: str) -> str | None:
    """Why ``value`` is not a class or identity label (1 to ``LABEL_MAX`` characters of
    storable text), or ``None`` when it is one."""
    if not value.strip() or len(value) > LABEL_MAX:
        return f"a label is 1 to {LABEL_MAX} characters, not empty"
    return text_problem(value)


def _safe_text(value: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _label(value: str) -> str:
    problem = label_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


_WHOLE = re.compile(r"\s*[+-]?[0-9]+\s*")


def _whole_number(value: Any) -> Any:
    # pydantic's lax mode reads "2.0" and 2.0 as the integer 2: a count (k, candidates, ...)
    # sent as a float is a client's mistake worth a 422, as "2.5" already is.
    if isinstance(value, float) or (isinstance(value, str) and not _WHOLE.fullmatch(value)):
        raise ValueError(f"must be a whole number written with digits only, got {value!r:.40}")
    return value


def _json_object_text(value: Any) -> dict[str, Any]:
    if not isinstance(value, str):
        raise ValueError("expected a JSON object as text")
    return load_json_object(value)


# Parameter and schema types (FastAPI and pydantic report their failures as 422).
SafeText = Annotated[str, AfterValidator(_safe_text)]
Label = Annotated[str, AfterValidator(_label)]
# An integer given as an integer or as decimal digits; not "2.0", "1e3", "0x10" or "1_000".
WholeNumber = Annotated[int, BeforeValidator(_whole_number)]
Camera = Annotated[
    int, Field(ge=0, le=CAMERA_MAX, description="camera id (0..2**31-1, re-ID data)")
]
# A form field holding a JSON object, within the rules above; parsed to a dict.
JsonObject = Annotated[dict[str, Any], PlainValidator(_json_object_text,
                                                      json_schema_input_type=str)]


def load_json_object(value: str) -> dict[str, Any]:
    """The JSON object that ``value`` holds (``{"color": "red"}``), within the rules above.

    Raises:
        ValueError: the rule broken (the caller names the field).
    """
    if len(value) > JSON_MAX_CHARS:
        raise ValueError(f"{len(value)} characters of JSON; at most {JSON_MAX_CHARS} are allowed")
    depth = _max_depth(value)
    if depth > JSON_MAX_DEPTH:
        raise ValueError(f"JSON nested {depth} levels deep; at most {JSON_MAX_DEPTH} are allowed")
    try:
        parsed = json.loads(value, parse_constant=_refuse_constant, parse_int=_bounded_int,
                            parse_float=_finite_float)
    except _JsonRule as exc:
        raise ValueError(str(exc)) from None
    except (json.JSONDecodeError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "too deeply nested"
        raise ValueError(f"not valid JSON ({reason})") from None
    if not isinstance(parsed, dict):
        raise ValueError("expected a JSON object like {\"key\": \"value\"}")
    problem = _json_problem(parsed, "")
    if problem is not None:
        raise ValueError(problem)
    return parsed


def parse_json_object(value: str, name: str) -> dict[str, Any]:
    """:func:`load_json_object` for the field ``name``.

    Raises:
        InvalidRequest: naming the field and the rule broken.
    """
    try:
        return load_json_object(value)
    except ValueError as exc:
        raise InvalidRequest(f"{name}: {exc}") from None


class _JsonRule(ValueError):
    """A JSON value outside the rules (raised from the json module's hooks)."""


def _refuse_constant(token: str) -> Any:
    raise _JsonRule(f"{token} is not allowed (numbers must be finite)")


def _bounded_int(token: str) -> int:
    # Refuse before int() runs: a 100,000-digit integer costs time and raises ValueError.
    if len(token.lstrip("-")) > 19 or not INT64_MIN <= int(token) <= INT64_MAX:
        raise _JsonRule(f"the integer {token[:30]}{'...' if len(token) > 30 else ''} does not "
                        "fit in 64 bits")
    return int(token)


def _finite_float(token: str) -> float:
    number = float(token)
    if not math.isfinite(number):
        raise _JsonRule(f"the number {token[:30]} overflows a 64-bit float")
    return number


def _max_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` outside strings (before parsing anything)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _json_problem(value: Any, path: str) -> str | None:
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key[:40]}" if path else key[:40]
            if not key or len(key) > JSON_KEY_MAX:
                return f"key {where!r}: a key is 1 to {JSON_KEY_MAX} characters"
            problem = text_problem(key)
            if problem is not None:
                return f"key {key[:40]!r} {problem}"
            problem = _json_problem(item, where)
            if problem is not None:
                return problem
    elif isinstance(value, list):
        for index, item in enumerate(value):
            problem = _json_problem(item, f"{path}[{index}]")
            if problem is not None:
                return problem
    elif isinstance(value, str):
        problem = text_problem(value, allow_whitespace_controls=True)
        if problem is not None:
            return f"value at {path or 'top level'!r} {problem}"
    return None


@contextlib.asynccontextmanager
async def read_form(
    request: Request, *, max_files: int = 1000, max_fields: int = 1000,
    too_many_files: str | None = None,
) -> AsyncIterator[FormData]:
    """The multipart (or urlencoded) form of a route that reads its body itself, closed (its
    spooled files removed) on exit.

    Parsing failures are the client's: a malformed body is a :class:`MalformedBody` (400)
    naming the problem, and more than ``max_files`` files a :class:`PayloadTooLarge` (413)
    saying ``too_many_files`` when given (a 400 otherwise, as FastAPI answers for declared
    forms; the defaults are Starlette's and FastAPI's).
    """
    try:
        form = await request.form(max_files=max_files, max_fields=max_fields)
    except Exception as exc:  # starlette's MultiPartException (as a 400) and parser errors
        message = str(getattr(exc, "detail", exc))
        if too_many_files is not None and "Too many files" in message:
            raise PayloadTooLarge(too_many_files) from None
        raise MalformedBody(f"malformed multipart body: {message}") from None
    try:
        yield form
    finally:
        await form.close()


def validation_message(exc: ValidationError) -> str:
    """A pydantic ``ValidationError`` as one line: ``field: message; ...`` (list positions as
    ``labels[1]``). No value sent is echoed: a value too long is described by its length."""
    parts = []
    for error in exc.errors(include_url=False):
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                        for part in error["loc"]).lstrip(".")
        message = str(error["msg"]).removeprefix("Value error, ")
        sent = error.get("input")
        if error["type"] in ("string_too_long", "too_long") and isinstance(sent, str | list):
            message += f" ({len(sent)} {'characters' if isinstance(sent, str) else 'values'} sent)"
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def request_validation_error(exc: ValidationError, where: str) -> RequestValidationError:
    """A pydantic error of a model a route validates itself, in FastAPI's own 422 shape (as
    if the fields had been declared as parameters): ``loc`` starts with ``where`` (``body``,
    ``query``)."""
    return RequestValidationError(
        [{**error, "loc": (where, *error["loc"])} for error in exc.errors(include_url=False)]
    )
