"""``/collections``: creating, describing, listing and changing collections."""

from __future__ import annotations

from datetime import datetime

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from imgret.settings import COLLECTION_NAME_PATTERN

COLLECTION_NAME_RULE = ("1-64 characters: lower-case letters, digits, '-' and '_', starting "
                        "with a letter or digit")


class CollectionCreate(BaseModel):
    """``POST /collections``: a new, empty collection serving a stored checkpoint."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=COLLECTION_NAME_PATTERN,
                      description=COLLECTION_NAME_RULE + "; not 'default' or 'all'")
    model_version: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$",
        description="a version stored in any collection (default: the one the default "
                    "collection serves)")
    public: bool = Field(True, strict=True, description="reads need no key")


class CollectionMemory(BaseModel):
    """What an open collection holds in the answering process."""

    vectors: int = Field(description="vectors in its index")
    bytes: int = Field(description="estimated index memory: vectors x dim x 4")
    idle_s: float | None = Field(description="seconds since its last request (null: default, "
                                             "never closed)")


class CollectionInfo(BaseModel):
    """A collection: its name, whether reads are public, size and served version."""

    name: str
    public: bool
    created_at: datetime
    items: int = Field(description="live gallery items")
    active_version: str | None = Field(description="the model version it serves")
    index: CollectionMemory | None = Field(
        None, description="its index in the answering process; null: not open there (the next "
                          "request opens it)")


class CollectionList(BaseModel):
    collections: list[CollectionInfo]


class CollectionUpdate(BaseModel):
    """``PATCH /collections/{name}``: what may change about a collection."""

    model_config = ConfigDict(extra="forbid")

    public: bool = Field(strict=True,
                         description="reads need no key (true) or a key with the read role")
