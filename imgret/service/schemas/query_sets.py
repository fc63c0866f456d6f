"""``/query-sets``."""

from __future__ import annotations

from pydantic import (
    BaseModel,
)


class QuerySetInfo(BaseModel):
    name: str
    size: int


class QuerySetList(BaseModel):
    query_sets: list[QuerySetInfo]
