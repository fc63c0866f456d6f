"""``POST /search``, ``/search/batch`` and ``/identify``: the forms and the answers."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import UploadFile
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from imgret.gallery.search import SearchFilter
from imgret.gallery.search.identities import (
    DEFAULT_AGGREGATION,
    IdentityGroup,
    check_aggregation,
)
from imgret.service.limits import SEARCH_CANDIDATES_MAX
from imgret.service.request_rules import (
    LABEL_MAX,
    Camera,
    JsonObject,
    SafeText,
    WholeNumber,
)
from imgret.service.schemas.common import ID_MAX, K_MAX, RerankRequest


class SearchHit(BaseModel):
    """One neighbour: a gallery item and its similarity to the query (higher is better)."""

    id: int
    score: float = Field(description="inner product of unit vectors (cosine similarity)")
    label: str
    camera: int | None = None
    uri: str = Field(description="where to fetch the stored image", examples=["/gallery/7/image"])
    metadata: dict[str, Any] = Field(default_factory=dict)


class IdentityOut(BaseModel):
    """One identity of a grouped search (``group_by=label``): a label, its score under the
    search's aggregation, and its best items, best first."""

    label: str
    score: float = Field(description="the identity's score (aggregation: see "
                                     "docs/identities.md); higher is better")
    items: list[SearchHit] = Field(description="its best items among those searched, best "
                                               "first (at most per_identity)")


class DecisionOut(BaseModel):
    """Who the query is under the answering version's calibration: the top result's label
    when its score reaches the threshold (``known``), else nobody (``label`` null)."""

    label: str | None = Field(description="the top result's label when known, else null")
    score: float | None = Field(description="the top result's score (null: no result)")
    threshold: float = Field(description="the calibrated threshold of the version that "
                                         "produced the scores")
    known: bool


_DECISION_NOTE = Field(None, description="why there is no decision (the version has no "
                                         "calibration, or this search's re-ranking is not "
                                         "the one it was calibrated with)")


class SearchResponse(BaseModel):
    """The neighbours of one query, best first, and the decision on the top one."""

    results: list[SearchHit] = Field(description="the items, best first; with group_by: the "
                                                 "identities' items, in identity order")
    identities: list[IdentityOut] | None = Field(
        None, description="group_by=label only: the top k identities, best first")
    took_ms: float
    model_version: str
    decision: DecisionOut | None = Field(None, description="null: see decision_note")
    decision_note: str | None = _DECISION_NOTE


class SearchBatchResponse(BaseModel):
    """The neighbours of each query, in request order, each list best first, and a decision
    per query."""

    results: list[list[SearchHit]]
    identities: list[list[IdentityOut]] | None = Field(
        None, description="group_by=label only: per query, its top k identities")
    took_ms: float
    model_version: str
    decisions: list[DecisionOut] | None = Field(
        None, description="one per query, in order; null: see decision_note")
    decision_note: str | None = _DECISION_NOTE


class IdentifyResponse(BaseModel):
    """Who is in the image, or nobody: the top gallery match when its score reaches the
    served version's calibrated threshold."""

    label: str = Field(description="the identity, or \"unknown\" (see known)")
    known: bool = Field(description="false: nobody the gallery holds (label is \"unknown\")")
    score: float | None = Field(description="the best match's score (null: empty gallery)")
    threshold: float
    margin: float | None = Field(description="score - threshold: how far above (or, "
                                             "negative, below) the threshold")
    model_version: str
    unknown_id: int | None = Field(None, description="unknown and the collection keeps "
                                                     "unknowns: the kept image's id")
    cluster_id: int | None = Field(None, description="the unknowns cluster it joined")


PER_IDENTITY_MAX = 20


class SearchRerankRequest(RerankRequest):
    """``/search``'s and ``/search/batch``'s re-ranking: :class:`RerankRequest` within the
    search budget (at most ``SEARCH_CANDIDATES_MAX`` candidates: see ``imgret.service.limits`` for
    the measurement). An evaluation is a job of its own and keeps the wider bounds."""

    rerank_candidates: WholeNumber | None = Field(
        None, ge=1, le=SEARCH_CANDIDATES_MAX,
        description="k_reciprocal: N, candidates re-ranked per query (default 100); items "
                    "below rank N keep their order")


class SearchForm(SearchRerankRequest):
    """The options of ``/search`` and ``/search/batch`` (multipart): how many neighbours,
    filters on them, and re-ranking (:class:`SearchRerankRequest`)."""

    k: WholeNumber | None = Field(None, ge=1, le=K_MAX, description="neighbours (default 10); "
                                                              "may also be sent as ?k=")
    label: SafeText | None = Field(None, max_length=LABEL_MAX,
                                   description="only items with this label")
    camera: Camera | None = Field(None, description="only items from this camera")
    metadata: JsonObject | None = Field(None, description='JSON object; only items whose '
                                                          'metadata has these values, e.g. '
                                                          '{"color": "red"}')

    group_by: Literal["label"] | None = Field(
        None, description="label: answer with the top k identities (labels) instead of k "
                          "items, each with its score and best items")
    per_identity: WholeNumber | None = Field(
        None, ge=1, le=PER_IDENTITY_MAX,
        description="group_by only: items listed per identity (default 3)")
    aggregation: str | None = Field(
        None, max_length=16,
        description="group_by only: how an identity's score is made from its items: "
                    f"template, best or mean_top<n> (default {DEFAULT_AGGREGATION})")

    @model_validator(mode="after")
    def _grouping(self) -> SearchForm:
        if self.group_by is None:
            given = [name for name in ("per_identity", "aggregation")
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} needs group_by=label")
            return self
        if self.aggregation is not None:
            check_aggregation(self.aggregation)
        if self.rerank is not None:
            raise ValueError("group_by cannot be combined with rerank")
        return self

    def group(self, k: int) -> IdentityGroup | None:
        """The grouping these fields ask for, for ``k`` identities (``None``: items)."""
        if self.group_by is None:
            return None
        return IdentityGroup(k, self.per_identity or 3,
                             self.aggregation or DEFAULT_AGGREGATION)

    def filters(self) -> SearchFilter | None:
        """The filter these fields name (``None``: every item)."""
        if self.label is None and self.camera is None and not self.metadata:
            return None
        return SearchFilter(label=self.label, camera=self.camera, metadata=self.metadata)


class ImageSearchForm(SearchForm):
    """``POST /search``'s form: one query image, or the ``id`` of a gallery item."""

    image: UploadFile | None = Field(None, description="the query image (or send `id` instead)")
    id: WholeNumber | None = Field(None, ge=1, le=ID_MAX,
                                   description="search with this gallery item's stored "
                                               "embedding instead of an image (the item "
                                               "itself is left out of the results)")

    @model_validator(mode="after")
    def _image_or_id(self) -> ImageSearchForm:
        if (self.image is None) == (self.id is None):
            raise ValueError("send exactly one of `image` (a file) or `id` (a gallery item)")
        return self


class IdentifyForm(BaseModel):
    """``POST /identify``'s form: one query image."""

    model_config = ConfigDict(extra="forbid")

    image: UploadFile = Field(description="the query image")


class BatchSearchForm(SearchForm):
    """``POST /search/batch``'s form: several query images."""

    images: list[UploadFile] = Field(description="query images (at most "
                                                 "IMGRET_SEARCH_BATCH_MAX_FILES, default 32)")
