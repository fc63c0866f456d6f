"""Multipart forms: the one parser of every route that takes uploads (``POST /gallery``,
``/search``, ``/search/batch``, ``/evaluate``, ``/models``).

A form is described by a pydantic model of :mod:`imgret.service.schemas`. A field typed
``UploadFile`` (or a list of them) takes file parts, a list field takes repeated text parts
in the order sent, any other field one text part. The parser keeps the rules of a form that
FastAPI parses for declared parameters, and adds three:

* a field the model does not name is refused (a typo such as ``camera`` for ``cameras`` would
  otherwise be dropped in silence), and so is a second value of a field that takes one
  (``k``, ``label``, ...: which one should win?);
* a file sent as a text field, or text sent as a file, is refused;
* a blank single field counts as not sent (as in a declared form); blank entries of a list
  are kept, since their position means something (``labels[1]``).

Every refusal is one 422 message, ``field: reason; ...`` with list positions as
``labels[1]`` (:class:`imgret.service.request_rules.InvalidRequest`). JSON bodies and query
parameters keep FastAPI's list of field errors.

Why the routes read their bodies themselves instead of declaring one FastAPI parameter per
field: FastAPI's per-field form handling and dependency solving cost the event loop more
per ``/search`` request than the rest of its handling (cProfile under load); and
``/evaluate`` and ``/models`` take JSON or a form on one path, which declared parameters
cannot express. FastAPI then cannot see the fields, so :func:`form_body` (or
:func:`form_schema`, beside a JSON body) documents the multipart body in the OpenAPI schema
from the same model (``imgret.service.app`` adjusts every multipart body to what a client
really sends).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData, UploadFile

from imgret.service.request_rules import InvalidRequest, read_form, validation_message

FormModel = TypeVar("FormModel", bound=BaseModel)


@dataclass(frozen=True)
class _Part:
    """How a model field is sent: once or repeated, as text or as a file."""

    repeated: bool
    file: bool


def _unwrap(annotation: Any) -> Any:
    """``T`` from ``Annotated[T, ...]`` and ``T | None``."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            options = [arg for arg in get_args(annotation) if arg is not type(None)]
            if len(options) != 1:
                raise TypeError(f"a form field is one type or a list of one, not {annotation}")
            annotation = options[0]
        else:
            return annotation


def _part(annotation: Any) -> _Part:
    annotation = _unwrap(annotation)
    repeated = get_origin(annotation) is list
    if repeated:
        annotation = _unwrap(get_args(annotation)[0])
    return _Part(repeated, isinstance(annotation, type) and issubclass(annotation, UploadFile))


@functools.cache
def _parts(model: type[BaseModel]) -> dict[str, _Part]:
    return {name: _part(field.annotation) for name, field in model.model_fields.items()}


def parse_form(form: FormData, model: type[FormModel]) -> FormModel:
    """The ``model`` that ``form`` holds, by the rules above.

    Raises:
        InvalidRequest: an unknown, repeated or misplaced field, or values the model refuses.
    """
    parts = _parts(model)
    unknown = sorted(set(form.keys()) - parts.keys())
    if unknown:
        shown = [name[:40] for name in unknown[:5]]
        raise InvalidRequest(f"unknown form fields {shown}; this endpoint reads "
                             f"{sorted(parts)} (unknown fields are refused, not ignored)")
    values: dict[str, Any] = {}
    for name, part in parts.items():
        sent = form.getlist(name)
        if not sent:
            continue
        if not part.repeated and len(sent) > 1:
            raise InvalidRequest(f"{name} was sent more than once: send exactly one")
        for value in sent:
            if part.file and not isinstance(value, UploadFile):
                raise InvalidRequest(f"{name}: send a file, not a text field")
            if not part.file and isinstance(value, UploadFile):
                raise InvalidRequest(f"{name}: send a text field, not a file")
        if part.repeated:
            values[name] = sent
        elif part.file or sent[0]:  # blank is "not sent", as for a declared form field
            values[name] = sent[0]
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise InvalidRequest(validation_message(exc)) from None


@contextlib.asynccontextmanager
async def open_form(
    request: Request, model: type[FormModel], *, max_files: int = 1000,
    max_fields: int = 1000, too_many_files: str | None = None,
) -> AsyncIterator[FormModel]:
    """The request's form parsed into ``model``; its files are readable until exit, when
    they are closed and their spooled copies removed.

    Args:
        max_files, max_fields: what the body may hold; more files than ``max_files`` is a
            413 saying ``too_many_files`` when given, more fields a 400
            (:func:`imgret.service.request_rules.read_form`).
    """
    async with read_form(request, max_files=max_files, max_fields=max_fields,
                         too_many_files=too_many_files) as form:
        yield parse_form(form, model)


def form_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema of ``model`` as a multipart body: its fields (type, range,
    description; no default, since a form has none to show), the required ones, and no
    others."""
    schema = model.model_json_schema()
    if "$defs" in schema:  # an inline schema: a nested model would need components
        raise TypeError(f"{model.__name__}: a form model holds no nested models")
    body: dict[str, Any] = {"type": "object", "properties": {
        name: {key: value for key, value in field.items() if key != "default"}
        for name, field in schema["properties"].items()
    }, "additionalProperties": False}  # unknown fields are refused
    if schema.get("required"):
        body["required"] = schema["required"]
    return body


def form_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra`` documenting its multipart body as ``model``."""
    return {"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": form_schema(model)},
    }}}
