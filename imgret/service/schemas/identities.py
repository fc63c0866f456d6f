"""``/identities``: the labels, merging and moving items between them, the audit log, undo
and erase."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from imgret.service.request_rules import LABEL_MAX, Label, WholeNumber

MOVE_IDS_MAX = 10_000


class IdentityInfo(BaseModel):
    """One label and how many live items it has."""

    label: str
    items: int


class IdentityList(BaseModel):
    data: list[IdentityInfo]
    count: int = Field(description="labels in all (matching the filter)")
    offset: int
    limit: int


class MergeRequest(BaseModel):
    """``POST /identities/merge``: every live item of ``source`` goes to ``target``."""

    model_config = ConfigDict(extra="forbid")

    source: Label = Field(max_length=LABEL_MAX, description="the label that disappears")
    target: Label = Field(max_length=LABEL_MAX,
                          description="the label that keeps them all (new or existing)")


class MoveRequest(BaseModel):
    """``POST /identities/move``: these items go to ``label`` (a split when it is new)."""

    model_config = ConfigDict(extra="forbid")

    ids: list[WholeNumber] = Field(min_length=1, max_length=MOVE_IDS_MAX,
                                   description="live gallery item ids")
    label: Label = Field(max_length=LABEL_MAX, description="their new label")

    def item_ids(self) -> list[int]:
        return [int(i) for i in self.ids]


class EraseRequest(BaseModel):
    """``POST /identities/erase``: remove everything of ``label``."""

    model_config = ConfigDict(extra="forbid")

    label: Label = Field(max_length=LABEL_MAX)


class MoveOut(BaseModel):
    old_id: int
    new_id: int | None = Field(description="the item's id from now on (a relabelled item "
                                           "gets a new id; docs/identities.md says why); "
                                           "null: erased")
    old_label: str


class LabelChangeOut(BaseModel):
    """One entry of the audit log."""

    id: int
    action: str = Field(description="merge, move, undo or erase")
    from_label: str | None
    to_label: str | None
    moves: list[MoveOut]
    actor: str = Field(description="the key that made it: \"key <id>\", "
                                   "\"IMGRET_API_KEY\", or \"local\" (no keys in use)")
    undo_of: int | None = Field(description="the entry this one undid")
    undone_by: int | None = Field(description="the entry that undid this one")
    created_at: datetime


class LabelChangeList(BaseModel):
    data: list[LabelChangeOut]
    count: int
    offset: int
    limit: int


class ProcessConfirmation(BaseModel):
    """A serving process (host:pid:random) and when it had applied the erase."""

    process: str
    confirmed_at: datetime


class ErasedCounts(BaseModel):
    """What one kind of row an erase removed: how many, and their images' SHA-256."""

    count: int
    sha256: list[str] = Field(description="content hashes of the removed images (distinct, "
                                          "sorted): a receipt the caller can check against "
                                          "its own copies")


class EraseReceipt(BaseModel):
    """What ``POST /identities/erase`` removed, and since when no search returns it."""

    label: str
    change_id: int = Field(description="the audit entry (it names the label as (erased))")
    gallery_items: ErasedCounts
    gallery_item_ids: list[int]
    vectors: int = Field(description="gallery vectors removed, over every model version")
    query_items: ErasedCounts = Field(description="query-set items with the label")
    query_vectors: int
    media_removed: int = Field(description="stored images removed (an image another "
                                           "collection or label still uses stays)")
    audit_entries_cleared: int = Field(description="audit entries that named the label")
    committed_at: datetime = Field(description="when SQL removed it: every search that "
                                               "starts after this, in any process, leaves "
                                               "the items out")
    confirmed: list[ProcessConfirmation] = Field(
        description="each serving process of this collection that confirmed it no longer "
                    "holds the items, with when")
    unconfirmed: list[str] = Field(description="serving processes that had not confirmed "
                                               "when the wait ran out")


class UnknownOut(BaseModel):
    id: int
    uri: str = Field(description="where to fetch its image")


class ClusterOut(BaseModel):
    """A candidate identity among the kept unknowns."""

    id: int
    model_version: str = Field(description="the version whose vectors and threshold it was "
                                           "clustered under")
    size: int
    cohesion: float = Field(description="the members' mean cosine with the cluster's "
                                        "template (1: all alike)")
    members: list[UnknownOut] = Field(description="its newest members (at most 12)")
    created_at: datetime
    updated_at: datetime


class ClusterList(BaseModel):
    data: list[ClusterOut]
    count: int
    offset: int
    limit: int


class EnrollRequest(BaseModel):
    """``POST /identities/unknowns/clusters/{id}/enroll``."""

    model_config = ConfigDict(extra="forbid")

    label: Label = Field(max_length=LABEL_MAX, description="the name they are enrolled under")


class Enrolled(BaseModel):
    change: LabelChangeOut
    item_ids: list[int] = Field(description="the new gallery items")


class Dismissed(BaseModel):
    removed: int = Field(description="unknowns removed with their images")

