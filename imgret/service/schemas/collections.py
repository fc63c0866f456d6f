"""``/collections``: creating, describing, listing and changing collections."""

from __future__ import annotations

from datetime import datetime

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from imgret.settings import COLLECTION_NAME_PATTERN

UNKNOWNS_DAYS_MAX = 3650
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
    unknowns_days: int = Field(0, description="days /identify's unknowns are kept (0: none)")
    active_version: str | None = Field(description="the model version it serves")
    index: CollectionMemory | None = Field(
        None, description="its index in the answering process; null: not open there (the next "
                          "request opens it)")


class CollectionList(BaseModel):
    collections: list[CollectionInfo]


class CollectionUpdate(BaseModel):
    """``PATCH /collections/{name}``: what may change about a collection."""

    model_config = ConfigDict(extra="forbid")

    public: bool | None = Field(
        None, strict=True, description="reads need no key (true) or a key with the read role")
    unknowns_days: int | None = Field(
        None, strict=True, ge=0, le=UNKNOWNS_DAYS_MAX,
        description="keep the images /identify calls unknown for this many days, clustered "
                    "into candidate identities (0: keep none, the default)")

    @model_validator(mode="after")
    def _something(self) -> CollectionUpdate:
        if self.public is None and self.unknowns_days is None:
            raise ValueError("send public, unknowns_days or both")
        return self
