"""``POST /evaluate``: the requests (a stored query set, or an upload) and the reports
(closed-set metrics, open-set operating points, paired comparisons)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import UploadFile
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from imgret.gallery.evaluation.comparison import MIN_EFFECT
from imgret.gallery.evaluation.open_set import OpenSetRequest
from imgret.service.request_rules import (
    MODEL_VERSION_MAX,
    NAME_MAX,
    Camera,
    Label,
    SafeText,
)
from imgret.service.schemas.common import (
    _INTEGER,
    FPIRS_MAX,
    K_MAX,
    UNKNOWN_LABELS_MAX,
    WORST_MAX,
    RerankRequest,
    _count_problem,
)


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
    score: str = Field("best", description="what FPIR, FNIR and the thresholds are on: "
                                           "template (each identity's template score, as "
                                           "/identify decides) or best (the best item; "
                                           "re-ranked evaluations)")


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
