"""``/keys``: creating, listing and revoking API keys."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
)

from imgret.gallery.tenancy.keys import KEY_NAME_PATTERN
from imgret.settings import COLLECTION_NAME_PATTERN

ROLE_NAMES = Literal["read", "write", "admin"]


class KeyCreate(BaseModel):
    """``POST /keys``: a new API key with roles per collection, or a global admin key."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=KEY_NAME_PATTERN,
                      description="who or what holds it (letters, digits, space, . _ @ -)")
    roles: dict[Annotated[str, StringConstraints(pattern=COLLECTION_NAME_PATTERN)],
                ROLE_NAMES] = Field(
        default_factory=dict, max_length=1000,
        description="collection name -> read, write or admin")
    admin: bool = Field(False, strict=True,
                        description="every role on every collection, and collections, keys "
                                    "and backups")


class KeyInfo(BaseModel):
    """A stored key (never its secret)."""

    id: int
    name: str
    admin: bool
    roles: dict[str, str]
    created_at: datetime
    revoked_at: datetime | None


class KeyCreated(KeyInfo):
    key: str = Field(description="the key: shown once, send it as the X-API-Key header")


class KeyList(BaseModel):
    keys: list[KeyInfo]
