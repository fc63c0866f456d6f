"""Pydantic models of the HTTP API: what the routers accept (JSON bodies, and multipart forms
read by :mod:`imgret.service.forms`) and what they return.

Models raise ``ValueError`` from their validators, as pydantic expects; the routes and
:mod:`imgret.service.forms` turn the resulting ``ValidationError`` into a 422.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import UploadFile
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from imgret.gallery.evaluation.open_set import OpenSetRequest
from imgret.gallery.evaluation.retrieval import MIN_EFFECT
from imgret.gallery.search import SearchFilter
from imgret.gallery.search.rerank import (
    ALPHA_MAX,
    CANDIDATES_MAX,
    K1_MAX,
    TOP_M_MAX,
    Rerank,
    rerank_options,
)
from imgret.gallery.tenancy.keys import KEY_NAME_PATTERN
from imgret.service.limits import SEARCH_CANDIDATES_MAX
from imgret.service.request_rules import (
    LABEL_MAX,
    MODEL_VERSION_MAX,
    NAME_MAX,
    Camera,
    JsonObject,
    Label,
    SafeText,
    WholeNumber,
    text_problem,
    validation_message,
)
from imgret.settings import COLLECTION_NAME_PATTERN

K_MAX = 1000
WORST_MAX = 100
FPIRS_MAX = 10
UNKNOWN_LABELS_MAX = 1000
ID_MAX = 2**63 - 1
_INTEGER = re.compile(r"[+-]?[0-9]+")


class HealthStatus(BaseModel):
    """Liveness and what is being served."""

    status: Literal["ok", "degraded"] = Field(
        description="degraded: the index has not caught up with the database for a while"
    )
    model_version: str
    index_size: int = Field(description="vectors in the served index")
    device: str = Field(examples=["cpu", "cuda"])
    change_seq: int = Field(description="the last gallery change applied to this index")
    follower_lag_s: float = Field(description="seconds since the index last caught up")
    follower_error: str | None = Field(
        None, description="why the last catch-up failed: the database's message with the "
                          "right X-API-Key (or, without a key, from this machine), else a "
                          "generic one",
    )


class SearchHit(BaseModel):
    """One neighbour: a gallery item and its similarity to the query (higher is better)."""

    id: int
    score: float = Field(description="inner product of unit vectors (cosine similarity)")
    label: str
    camera: int | None = None
    uri: str = Field(description="where to fetch the stored image", examples=["/gallery/7/image"])
    metadata: dict[str, Any] = Field(default_factory=dict)


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

    results: list[SearchHit]
    took_ms: float
    model_version: str
    decision: DecisionOut | None = Field(None, description="null: see decision_note")
    decision_note: str | None = _DECISION_NOTE


class SearchBatchResponse(BaseModel):
    """The neighbours of each query, in request order, each list best first, and a decision
    per query."""

    results: list[list[SearchHit]]
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


class GalleryItemPublic(BaseModel):
    """A gallery item as the API shows it."""

    id: int
    label: str
    camera: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    content_type: str
    sha256: str
    uri: str = Field(description="where to fetch the stored image")
    created_at: datetime


class GalleryItemList(BaseModel):
    """One page of gallery items and the number of items matching the filter."""

    data: list[GalleryItemPublic]
    count: int = Field(description="items matching the filter, over all pages")
    offset: int
    limit: int


class GalleryAddOutcome(BaseModel):
    """What happened to one uploaded image.

    ``created``: a new item with the label, camera and metadata sent. ``existing``: the same
    bytes were already a live item; nothing was changed, and ``label``/``camera``/``metadata``
    are what is stored (the values sent were not applied). ``duplicate``: the same bytes
    appeared earlier in this request; ``id`` is that image's item.
    """

    id: int
    status: Literal["created", "existing", "duplicate"]
    label: str
    camera: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class GalleryItemsCreated(BaseModel):
    """The ids of the uploaded items, in upload order, and what happened to each.

    An image whose bytes were already in the gallery is not stored twice: its existing id
    is returned, its ``created`` entry is false and ``items[i].status`` says why.
    """

    ids: list[int]
    created: list[bool]
    items: list[GalleryAddOutcome]


RERANK_FIELDS = ("rerank", "rerank_k1", "rerank_k2", "rerank_lambda", "rerank_candidates",
                 "rerank_top_m", "rerank_alpha")


_RERANK_PARAMS = {
    None: (),
    "k_reciprocal": ("rerank_k1", "rerank_k2", "rerank_lambda", "rerank_candidates"),
    "query_expansion": ("rerank_top_m", "rerank_alpha"),
}


class RerankRequest(BaseModel):
    """Re-ranking of the results (``imgret.gallery.search.rerank``): the same fields in
    ``/search``'s form, ``/evaluate``'s JSON and form, and ``imgret evaluate``'s options. Parameters
    left out take the method's defaults; a parameter of the other method, or one without
    ``rerank``, is refused (422)."""

    model_config = ConfigDict(extra="forbid")

    rerank: Literal["k_reciprocal", "query_expansion"] | None = Field(
        None, description="k_reciprocal: Zhong et al. 2017 over the top rerank_candidates; "
                          "query_expansion: search again with the query averaged with its "
                          "top rerank_top_m. Default: no re-ranking")
    rerank_k1: WholeNumber | None = Field(None, ge=1, le=K1_MAX,
                                  description="k_reciprocal: k1 (default 20)")
    rerank_k2: WholeNumber | None = Field(None, ge=1, le=K1_MAX + 1,
                                  description="k_reciprocal: k2, 1 = no local expansion "
                                              "(default 6)")
    rerank_lambda: float | None = Field(None, ge=0.0, le=1.0,
                                        description="k_reciprocal: weight of the original "
                                                    "distance (default 0.3)")
    rerank_candidates: WholeNumber | None = Field(
        None, ge=1, le=CANDIDATES_MAX,
        description="k_reciprocal: N, candidates re-ranked per query (default 100); items "
                    "below rank N keep their order")
    rerank_top_m: WholeNumber | None = Field(None, ge=1, le=TOP_M_MAX,
                                     description="query_expansion: neighbours averaged "
                                                 "(default 5)")
    rerank_alpha: float | None = Field(None, ge=0.0, le=ALPHA_MAX,
                                       description="query_expansion: weight exponent, 0 = "
                                                   "plain average (default 0)")

    @model_validator(mode="after")
    def _check_rerank(self) -> RerankRequest:
        given = [name for name in RERANK_FIELDS[1:] if getattr(self, name) is not None]
        if self.rerank is None and given:
            raise ValueError(f"{', '.join(given)}: re-ranking parameters need rerank="
                             "k_reciprocal or rerank=query_expansion")
        wrong = [name for name in given if name not in _RERANK_PARAMS[self.rerank]]
        if wrong:
            other = next(m for m in _RERANK_PARAMS if m not in (None, self.rerank))
            raise ValueError(f"{', '.join(wrong)}: a parameter of rerank={other}, not of "
                             f"rerank={self.rerank}")
        self.rerank_option()
        return self

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> Rerank | None:
        """The re-ranking that ``rerank`` / ``rerank_*`` values name, checked by this model:
        the one parser of ``/search``'s form, ``/evaluate``'s form and ``imgret evaluate``'s
        options (``/evaluate``'s JSON validates the model itself).

        Args:
            values: field name -> value as sent (text or typed); ``None`` or blank text is
                "not sent".

        Raises:
            ValueError: one line, ``field: reason; ...`` (the routers answer it with 422).
        """
        sent = {name: value.strip() if isinstance(value, str) else value
                for name, value in values.items()}
        try:
            request = cls.model_validate(
                {name: value for name, value in sent.items() if value not in (None, "")}
            )
        except ValidationError as exc:
            raise ValueError(validation_message(exc)) from None
        return request.rerank_option()

    def rerank_option(self) -> Rerank | None:
        """The ``imgret.gallery.search.rerank`` options these fields name (``None``: plain search).

        Raises:
            ValueError: a parameter of the other method, or one without ``rerank``.
        """
        return rerank_options(
            self.rerank, k1=self.rerank_k1, k2=self.rerank_k2,
            lambda_value=self.rerank_lambda, candidates=self.rerank_candidates,
            top_m=self.rerank_top_m, alpha=self.rerank_alpha,
        )


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


def _storable_file_name(upload: UploadFile) -> UploadFile:
    # The client's file name is kept as a note (``source``): it must be storable text.
    problem = text_problem(upload.filename) if upload.filename else None
    if problem is not None:
        raise ValueError(f"file name {problem}")
    return upload


def _count_problem(name: str, values: list[Any] | None, n: int) -> str | None:
    if values is None or len(values) == n:
        return None
    return f"{len(values)} {name} for {n} images: send one {name[:-1]} per image, in order"


class GalleryUpload(BaseModel):
    """``POST /gallery``'s form: images, each with its label (and camera, metadata)."""

    images: list[Annotated[UploadFile, AfterValidator(_storable_file_name)]] = Field(
        description="image files, one per item")
    labels: list[Label] = Field(description="one label per image, in order")
    cameras: list[Camera] | None = Field(None, description="one camera id per image (re-ID "
                                                           "data)")
    metadata: list[JsonObject] | None = Field(
        None, description="JSON objects: one per image, or one for all images")

    @model_validator(mode="after")
    def _one_per_image(self) -> GalleryUpload:
        n = len(self.images)
        problem = _count_problem("labels", self.labels, n) or _count_problem(
            "cameras", self.cameras, n)
        if problem is None and self.metadata and len(self.metadata) not in (1, n):
            problem = (f"{len(self.metadata)} metadata fields for {n} images: send one per "
                       "image or one for all")
        if problem is not None:
            raise ValueError(problem)
        return self

    def metadata_per_image(self) -> list[dict[str, Any] | None]:
        """One metadata object (or ``None``) per image, in order."""
        if not self.metadata:
            return [None] * len(self.images)
        return self.metadata * len(self.images) if len(self.metadata) == 1 else self.metadata


class EvaluateOptions(RerankRequest):
    """The options of ``POST /evaluate``, the same in its JSON body (:class:`EvaluateRequest`)
    and in its multipart form (:class:`EvaluateUpload`)."""

    model_config = ConfigDict(extra="forbid")

    k: list[int] | None = Field(
        default=None, min_length=1, max_length=20,
        description="cut-offs; default 1, 5, 10 (those not over the gallery size)",
    )
    exclude_same_camera: bool = Field(
        False, description="re-ID protocol: drop same-label same-camera gallery items"
    )
    model_version: SafeText | None = Field(
        None, max_length=MODEL_VERSION_MAX,
        description="a stored model version (default: the served one)",
    )
    compare: list[Annotated[SafeText, Field(min_length=1, max_length=MODEL_VERSION_MAX)]] | None = (
        Field(
            None, min_length=2, max_length=2,
            description="[A, B]: two different stored versions; report both, B − A with "
                        "paired 95% intervals and a verdict per metric (not with "
                        "model_version or compare_to)",
        )
    )
    worst: int = Field(0, ge=0, le=WORST_MAX, description="list the n worst queries")
    open_set: bool | None = Field(
        None, description="the open_set section (FPIR/FNIR at thresholds, TAR@FAR): true "
                          "requires it (422 unless the queries are both mated and "
                          "non-mated), false leaves it out; default: added when they are both")
    fpirs: list[float] | None = Field(
        None, min_length=1, max_length=FPIRS_MAX,
        description="target FPIRs of the open-set operating points (and FARs of TAR@FAR), "
                    "each in (0, 1); default 0.1, 0.01, 0.001")
    unknown_labels: list[Label] | None = Field(
        None, min_length=1, max_length=UNKNOWN_LABELS_MAX,
        description="query labels declared unknown: each must be a label of the query set "
                    "with no gallery item (422 otherwise); implies open_set")

    @field_validator("k")
    @classmethod
    def _check_k(cls, value: list[int] | None) -> list[int] | None:
        return None if value is None else check_ks(value)

    @field_validator("fpirs")
    @classmethod
    def _check_fpirs(cls, value: list[float] | None) -> list[float] | None:
        return None if value is None else check_fpirs(value)

    @model_validator(mode="after")
    def _check_open_set(self) -> EvaluateOptions:
        if self.open_set is False and (self.unknown_labels or self.fpirs):
            raise ValueError("open_set is false: send it without "
                             f"{'unknown_labels' if self.unknown_labels else 'fpirs'}")
        return self

    def open_set_request(self) -> OpenSetRequest:
        """The open-set options these fields name."""
        return OpenSetRequest(
            enabled=self.open_set,
            **({"fpirs": tuple(self.fpirs)} if self.fpirs else {}),
            unknown_labels=tuple(self.unknown_labels or ()),
        )

    @model_validator(mode="after")
    def _check_compare(self) -> EvaluateOptions:
        if self.compare is not None:
            # The fields of this model that name a version besides ``compare``.
            others = [name for name in ("model_version", "compare_to")
                      if name in type(self).model_fields]
            if any(getattr(self, name) is not None for name in others):
                raise ValueError("compare names both versions: send it without "
                                 f"{' and '.join(others)}")
            if self.compare[0] == self.compare[1]:
                raise ValueError(f"compare needs two different versions, got "
                                 f"{self.compare[0]!r} twice")
        return self


class EvaluateRequest(EvaluateOptions):
    """``POST /evaluate`` as JSON: evaluate a named query set stored by ``imgret ingest``."""

    query_set: SafeText = Field(min_length=1, max_length=NAME_MAX)
    compare_to: SafeText | None = Field(
        None, max_length=MODEL_VERSION_MAX,
        description="a second model version B: compare [model_version or the served one, B]",
    )
    rerank_compare: bool = Field(
        False, description="with rerank: evaluate plain (A) and re-ranked (B) search on the "
                           "same queries; both reports, B − A with paired 95% intervals "
                           "(not with compare or compare_to)")

    @model_validator(mode="after")
    def _check_rerank_compare(self) -> EvaluateRequest:
        if self.rerank_compare:
            if self.rerank is None:
                raise ValueError("rerank_compare needs rerank (the re-ranking to compare "
                                 "with the plain search)")
            if self.compare is not None or self.compare_to is not None:
                raise ValueError("rerank_compare compares one version's plain and re-ranked "
                                 "search: send it without compare and compare_to")
        return self

    def versions(self, served: str) -> tuple[str, str | None]:
        """``(A, B)``: the version to evaluate and the one to compare it with (``None``: no
        comparison). ``compare: [A, B]``, or ``compare_to: B`` against ``model_version`` (by
        default ``served``)."""
        if self.compare is not None:
            return self.compare[0], self.compare[1]
        return self.model_version or served, self.compare_to


class EvaluateUpload(EvaluateOptions):
    """``POST /evaluate`` as a multipart form: query images with their labels (and cameras),
    embedded by the model of each version evaluated; the options and their checks are
    :class:`EvaluateOptions`'."""

    images: list[UploadFile] = Field(description="the query images, one file per query")
    labels: list[Label] = Field(description="one label per image, in order")
    cameras: list[Camera] | None = Field(None, description="one camera id per image")
    k: list[int] | None = Field(
        default=None, min_length=1, max_length=20,
        description="cut-offs, repeated or as one comma-separated value; default 1, 5, 10",
    )

    @field_validator("k", mode="before")
    @classmethod
    def _split_k(cls, value: Any) -> Any:
        """``k=1,5`` and ``k=1&k=5`` alike; blank parts are not cut-offs."""
        if not isinstance(value, list):
            return value
        parts = [part.strip() for v in value for part in str(v).split(",") if part.strip()]
        for part in parts:
            if not _INTEGER.fullmatch(part):
                raise ValueError(f"{part[:40]!r} is not an integer")
            if len(part) > 9:  # before int(): a 5000-digit "integer" is refused by int()
                raise ValueError(f"k must be between 1 and {K_MAX}, got {part[:20]}...")
        return [int(part) for part in parts] or None

    fpirs: list[float] | None = Field(
        None, min_length=1, max_length=FPIRS_MAX,
        description="target FPIRs, repeated or as one comma-separated value, each in (0, 1); "
                    "default 0.1, 0.01, 0.001")

    @field_validator("fpirs", mode="before")
    @classmethod
    def _split_fpirs(cls, value: Any) -> Any:
        """``fpirs=0.1,0.01`` and ``fpirs=0.1&fpirs=0.01`` alike."""
        if not isinstance(value, list):
            return value
        parts = [part.strip() for v in value for part in str(v).split(",") if part.strip()]
        return parts or None

    @field_validator("compare", mode="before")
    @classmethod
    def _two_versions(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) != 2:
            raise ValueError("send two different model versions")
        return value

    @model_validator(mode="after")
    def _one_per_image(self) -> EvaluateUpload:
        n = len(self.images)
        problem = _count_problem("labels", self.labels, n) or _count_problem(
            "cameras", self.cameras, n)
        if problem is not None:
            raise ValueError(problem)
        return self

    def version_names(self) -> list[str]:
        """The versions to evaluate: the two of ``compare``, ``model_version``, or none (the
        served one)."""
        if self.compare is not None:
            return list(self.compare)
        return [self.model_version] if self.model_version is not None else []


def check_fpirs(values: list[float]) -> list[float]:
    """Sorted unique target rates, each in the open interval (0, 1).

    Raises:
        ValueError: a value out of range (0 and 1 included: no threshold holds them).
    """
    bad = [v for v in values if not 0.0 < v < 1.0]
    if bad:
        raise ValueError(f"fpirs must each lie in (0, 1), got {bad[:5]}")
    return sorted(set(values), reverse=True)


def check_ks(values: list[int]) -> list[int]:
    """Sorted unique cut-offs, each in 1..1000.

    Raises:
        ValueError: a value out of range.
    """
    bad = [v for v in values if not 1 <= v <= K_MAX]
    if bad:
        raise ValueError(f"k must be between 1 and {K_MAX}, got {bad}")
    return sorted(set(values))


class Neighbour(BaseModel):
    """A neighbour of a query in an evaluation report."""

    id: int
    label: str
    score: float
    relevant: bool


class WorstQuery(BaseModel):
    """A query that did badly, with its top neighbours (to see what the model confuses)."""

    index: int = Field(description="position of the query in the query set")
    label: str
    camera: int | None = None
    query_id: int | None = Field(None, description="query item id (named query sets)")
    average_precision_at_r: float
    first_relevant_rank: int | None = Field(description="1-based; null when none was ranked")
    neighbours: list[Neighbour]


class Confusion(BaseModel):
    """A wrong label retrieved in the top R of a label's queries."""

    label: str
    count: int = Field(description="hits with this label in the top R of the label's queries")


class LabelMetrics(BaseModel):
    """The queries of one label (R = 0 ones skipped) and what they retrieve instead."""

    label: str
    count: int = Field(description="evaluated queries with this label")
    map_at_r: float = Field(description="mean AP@R of those queries")
    precision_at_1: float = Field(description="fraction whose first hit has the label")
    confusions: list[Confusion] = Field(
        description="wrong-label hits in their top R (R = num_relevant, capped at the depth) "
                    "by hit label, most frequent first, at most 5"
    )


class Estimate(BaseModel):
    """A figure and its bootstrap 95% interval (resampling identities)."""

    value: float
    ci95: list[float] | None = Field(
        description="[low, high]; null when too many resamples cannot resolve the rate")


class OperatingPoint(BaseModel):
    """The open-set figures at the threshold that holds FPIR at a target."""

    fpir: float = Field(description="the target FPIR")
    threshold: Estimate | None = Field(description="the lowest score threshold whose FPIR "
                                                   "is <= the target; null: too few "
                                                   "non-mated queries (see note)")
    fnir: Estimate | None = Field(description="mated queries whose identity is not returned "
                                              "at or above the threshold")
    rank1_identification: Estimate | None = Field(
        description="mated queries whose top candidate is a mate at or above the threshold")
    fpir_measured: Estimate | None = Field(description="non-mated queries with any candidate "
                                                       "at or above the threshold")
    note: str | None = None


class DetCurve(BaseModel):
    """FNIR against FPIR over thresholds (null: above every score)."""

    threshold: list[float | None]
    fpir: list[float]
    fnir: list[float]


class TarPoint(BaseModel):
    far: float
    tar: Estimate | None
    note: str | None = None


class Verification(BaseModel):
    """TAR@FAR from the scores of query-candidate pairs (same label: genuine)."""

    genuine_pairs: int
    impostor_pairs: int
    points: list[TarPoint]


class HardQuery(BaseModel):
    """A query near the threshold's edge: the decision at ``T`` names ``top_label`` when
    ``top_score >= T``, else nobody; a mated query is a miss when ``mate_score < T``."""

    index: int = Field(description="position in the query set")
    query_id: int | None = Field(description="stored query item id (null: an upload)")
    label: str
    top_label: str | None = Field(description="label of the best candidate returned")
    top_score: float | None = Field(description="best candidate's score (null: none)")
    mate_score: float | None = Field(description="best score of a candidate with the "
                                                 "query's label (null: none returned)")


class HardestQueries(BaseModel):
    """At most 20 of each kind: the non-mated queries with the highest top scores (the
    first false alarms as the threshold falls) and the mated ones with the lowest mate
    scores (the first misses as it rises)."""

    non_mated: list[HardQuery]
    mated: list[HardQuery]


class OpenSetReport(BaseModel):
    """Open-set decisions on the query set: mated queries (label in the gallery) and
    non-mated ones (identities the gallery does not hold), NIST FRVT 1:N's FPIR / FNIR and
    IJB-C's TAR@FAR (docs/evaluation.md)."""

    mated: int
    non_mated: int
    resamples: int
    operating_points: list[OperatingPoint]
    det: DetCurve
    depth: int = Field(description="candidates per query (a mate below it is a miss)")
    pairs: str = Field(description="which query-candidate pairs TAR@FAR scores: all, or "
                                   "top-K (pairs beyond them are not scored)")
    unknown_labels: list[str]
    verification: Verification | None
    hardest: HardestQueries | None = Field(
        None, description="the queries a threshold decides first (docs/evaluation.md)")
    note: str


class EvaluationReport(BaseModel):
    """Retrieval metrics of a labelled query set, ranked through the serving index.

    Metric definitions are ``imgret.metrics.ranking_metrics``'s; ``ci95`` holds each metric's
    seeded bootstrap interval over queries (``[low, high]``, per k for the ``*_at_k`` ones).
    """

    protocol: str = Field(description="how relevance and rankings were defined")
    model_version: str
    index_factory: str
    query_set: str | None = Field(description="the named query set; null for an upload")
    gallery_size: int
    depth: int = Field(description="ranking depth: max(max R, max k), at most the gallery")
    rerank: dict[str, Any] | None = Field(
        None, description="the re-ranking of the rankings (method and parameters); null: "
                          "plain search")
    num_queries: int
    num_skipped: int = Field(description="queries with no relevant gallery item (R = 0)")
    num_truncated: int = Field(
        description="queries with relevant items below the depth (their mAP is a lower bound)"
    )
    k: list[int]
    map_at_r: float
    r_precision: float
    precision_at_1: float
    mean_average_precision: float
    mrr: float
    recall_at_k: dict[int, float]
    map_at_k: dict[int, float]
    ndcg_at_k: dict[int, float]
    recall_fraction_at_k: dict[int, float]
    ci95: dict[str, Any] | None
    per_label: list[LabelMetrics] = Field(
        default_factory=list, description="one entry per query label, lowest map_at_r first"
    )
    worst: list[WorstQuery] | None = None
    open_set: OpenSetReport | None = Field(
        None, description="open-set decisions; present when the queries are both mated and "
                          "non-mated, or when asked for")


Verdict = Literal["better", "worse", "no detectable difference"]


class PairedDifference(BaseModel):
    """One metric of two model versions on the same queries."""

    a: float
    b: float
    difference: float = Field(description="b - a")
    ci95: list[float] = Field(description="paired bootstrap 95% interval of the difference")
    num_paired: int
    min_effect: float = Field(MIN_EFFECT, description="the smallest |b - a| that a verdict "
                                                      "calls better or worse")
    verdict: Verdict = Field(description="B relative to A: better (interval above 0 and "
                                         "b - a >= min_effect), worse (interval below 0 and "
                                         "a - b >= min_effect), or no detectable difference")


class ModelComparison(BaseModel):
    """Two model versions on the same queries, and B − A with paired bootstrap intervals.

    "B is better" is claimed for a metric only when its whole interval lies above zero and
    the difference is at least its ``min_effect`` (verdict "better"); "worse" when the
    interval lies below zero and A leads by at least that.
    """

    a: EvaluationReport
    b: EvaluationReport
    difference: dict[str, PairedDifference]
    verdict: dict[str, Verdict] = Field(description="per metric, B relative to A")
    b_better: list[str]
    a_better: list[str]

    @model_validator(mode="before")
    @classmethod
    def _verdict_beside_difference(cls, data: Any) -> Any:
        """Accept ``compare_versions``'s flat metric table as ``difference`` (its top-level
        ``verdict`` entry is not a metric) and derive ``verdict`` when not given."""
        if not isinstance(data, dict) or not isinstance(data.get("difference"), dict):
            return data
        data = dict(data)
        difference = {m: v for m, v in data["difference"].items()
                      if not (isinstance(v, dict) and "ci95" not in v)}
        data["difference"] = difference
        if "verdict" not in data:
            data["verdict"] = {m: v["verdict"] for m, v in difference.items()
                               if isinstance(v, dict) and "verdict" in v}
        return data


# --------------------------------------------------------------------------- model versions


class Coverage(BaseModel):
    embedded: int = Field(description="live gallery items with a vector of this version")
    live: int = Field(description="live gallery items")
    fraction: float
    complete: bool


class IndexState(BaseModel):
    state: Literal["built", "missing"]
    size: int | None = None
    factory: str | None = None


class EmbeddingJob(BaseModel):
    state: Literal["idle", "running", "done", "failed", "interrupted"]
    error: str | None = None
    updated_at: datetime | None = None


class QueryCoverage(BaseModel):
    embedded: int
    total: int


class CalibrationInfo(BaseModel):
    """A version's decision threshold and what it was measured on."""

    id: int
    version: str
    query_set: str
    query_set_sha256: str = Field(description="SHA-256 over the query items' [id, sha256, "
                                              "label], in id order")
    target_fpir: float
    threshold: float
    threshold_ci95: list[float] | None
    fpir: float = Field(description="FPIR measured at the threshold on the query set")
    fnir: float = Field(description="FNIR measured at the threshold on the query set")
    rerank: dict[str, Any] | None = Field(description="the re-ranking it was calibrated with "
                                                      "(null: plain search)")
    details: dict[str, Any]
    created_at: datetime | None


class CalibrateRequest(RerankRequest):
    """``POST /models/{v}/calibrate``: the query set (with identities the gallery does not
    hold) and the FPIR the threshold must hold; re-ranking fields calibrate re-ranked
    search."""

    query_set: SafeText = Field(min_length=1, max_length=NAME_MAX)
    target_fpir: float = Field(gt=0.0, lt=1.0, description="in (0, 1), e.g. 0.01")


class ModelInfo(BaseModel):
    """One model version: what it is, how much of the gallery it covers, whether it serves."""

    version: str
    dim: int
    config: dict[str, Any]
    created_at: datetime
    active: bool
    activated_at: datetime | None = None
    coverage: Coverage
    query_items: QueryCoverage
    index: IndexState
    embedding: EmbeddingJob
    checkpoint_stored: bool
    last_evaluation: dict[str, Any] | None = None
    calibration: CalibrationInfo | None = None
    decisions: str = Field("", description="the decisions it serves, or none and why")


class ModelList(BaseModel):
    active: str | None
    models: list[ModelInfo]
    history: list[dict[str, Any]] = Field(description="the last switches, newest first")


class RegisterRequest(BaseModel):
    """``POST /models`` as JSON: a checkpoint the server can read."""

    model_config = ConfigDict(extra="forbid")

    path: SafeText = Field(min_length=1, max_length=4096,
                           description="a run directory from `imgret train`, or its model.pt")


class RegisterUpload(BaseModel):
    """``POST /models`` as a multipart form: an uploaded checkpoint, or the path of one.

    ``path`` is any text here: the route checks it as it checks the JSON ``path``, and a
    path outside the model roots gets the one message every refused path gets.
    """

    checkpoint: UploadFile | None = Field(
        None, description="a checkpoint file (`model.pt` of `imgret train`), at most "
                          "IMGRET_MAX_CHECKPOINT_BYTES; or send `path`")
    path: str | None = Field(
        None, description="a run directory from `imgret train`, or its model.pt, under "
                          "<data_dir>/models or IMGRET_MODEL_ROOTS; or send `checkpoint`")

    @model_validator(mode="after")
    def _checkpoint_or_path(self) -> RegisterUpload:
        if (self.checkpoint is None) == (self.path is None):
            raise ValueError("send one of `checkpoint` (a file) or `path`")
        return self


class ActivateRequest(BaseModel):
    """Optional gate of a switch."""

    model_config = ConfigDict(extra="forbid")

    require: (Literal["better", "not_worse", "fnir_not_worse"]
              | list[Literal["better", "not_worse", "fnir_not_worse"]] | None) = Field(
        None, description="refuse (409) unless the paired verdict against the active version "
                          "on query_set says so; fnir_not_worse (alone, or in a list beside "
                          "better or not_worse): unless this version's FNIR at its "
                          "calibrated FPIR is not worse")
    query_set: SafeText | None = Field(None, min_length=1, max_length=NAME_MAX)

    def requirements(self) -> list[str] | None:
        """``require`` as a list (``None``: not given)."""
        if self.require is None:
            return None
        return [self.require] if isinstance(self.require, str) else list(self.require)


class Switch(BaseModel):
    """The served version after a switch."""

    active: str
    previous: str | None
    changed: bool = Field(description="false: the version was already active")
    stragglers_embedded: int = Field(
        0, description="items added since the re-embedding, embedded during the switch")
    comparison: dict[str, Any] | None = None
    open_set: dict[str, Any] | None = Field(
        None, description="require=fnir_not_worse: both versions' FNIR at the calibrated "
                          "FPIR, B - A with its paired 95% interval and the verdict")


class QuerySetInfo(BaseModel):
    name: str
    size: int


class QuerySetList(BaseModel):
    query_sets: list[QuerySetInfo]


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
