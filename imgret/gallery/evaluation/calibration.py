"""Decision thresholds kept with their model version: calibrate one on a query set, read the
one a version serves, and turn a ranked result list into a decision with it.

A **calibration** runs the open-set evaluation of a version on a named query set
(:mod:`imgret.gallery.evaluation.open_set`, through the version's Searcher: the path ``/search``
takes) and keeps the threshold that holds FPIR at the target, with its bootstrap interval, the FPIR
and FNIR measured at it, the query set's name and content digest, the search option it was
measured with (re-ranking or plain), and the time (``model_calibrations``, history kept: the
newest row of a version is the one served).

Decisions this module makes:

- **The threshold belongs to the version.** Scores of two versions are not on one scale, so
  a threshold is only ever applied to the scores of the version it was calibrated on; the
  service carries it inside the object that holds the version's model and index.
- **A decision names the top candidate** of the ranked list the search returned (filters
  and re-ranking included): ``known`` when its score is ``>= threshold``, its label then;
  ``label`` ``None`` otherwise (and for an empty list).
- **The search option must match.** Re-ranked scores are not cosine similarities (k-reciprocal
  gives 1 - a Jaccard-blended distance, query expansion a similarity to another query), so a
  threshold calibrated on plain search decides plain searches only, and one calibrated with
  a re-ranking decides searches with that re-ranking and those parameters only; any other
  search gets no decision and the reason.
- **Filters are allowed.** A filter only removes candidates, so a non-mated search's top
  score can only go down: a filtered search alarms no more often than the calibration
  measured (for queries like the calibration set's), while its misses may change.
- **Content digest**: SHA-256 over the query items' ``[id, sha256, label]`` in id order, so
  a query set edited under the same name reads as another set.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from imgret.embedder import Embedder
from imgret.errors import GalleryError
from imgret.gallery.evaluation.retrieval import (
    BOOTSTRAP,
    SEED,
    EvaluationError,
    OpenSetRequest,
    evaluate_query_set,
)
from imgret.gallery.media.files import MediaBackend
from imgret.gallery.search.identities import BEST
from imgret.gallery.search.rerank import Rerank, rerank_options, rerank_summary
from imgret.gallery.storage import query_set_store
from imgret.gallery.storage.tables import ModelCalibration, QueryItem
from imgret.gallery.versions import version_store
from imgret.images import DEFAULT_MAX_PIXELS


class NotCalibrated(GalleryError):
    """A decision asked of a version that serves none (no calibration, or one for another
    search option): 409, with the reason."""


@dataclass(frozen=True)
class Calibration:
    """A version's decision threshold and what it was measured on.

    Attributes:
        id: the row (a newer calibration of the version has a larger one).
        version: the model version whose scores it applies to.
        query_set, query_set_sha256: the calibration set, by name and content.
        target_fpir: the FPIR the threshold was chosen to hold.
        threshold: the lowest score threshold whose FPIR on the set is ``<= target_fpir``.
        threshold_ci95: its bootstrap interval (``None``: unresolved in too many resamples).
        fpir, fnir: measured at ``threshold`` on the set.
        rerank: the re-ranking the scores came from (``None``: plain search).
        details: the rest of the operating point (intervals, counts, rank-1 identification).
        created_at: when it was measured.
    """

    id: int
    version: str
    query_set: str
    query_set_sha256: str
    target_fpir: float
    threshold: float
    threshold_ci95: list[float] | None
    fpir: float
    fnir: float
    rerank: dict[str, Any] | None
    details: dict[str, Any]
    created_at: datetime | None

    @classmethod
    def from_row(cls, row: ModelCalibration, version: str) -> Calibration:
        low, high = row.threshold_low, row.threshold_high
        return cls(
            id=row.id, version=version, query_set=row.query_set,
            query_set_sha256=row.query_set_sha256, target_fpir=row.target_fpir,
            threshold=row.threshold,
            threshold_ci95=[low, high] if low is not None and high is not None else None,
            fpir=row.fpir, fnir=row.fnir, rerank=row.rerank, details=dict(row.details or {}),
            created_at=version_store.as_utc(row.created_at),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def score(self) -> str:
        """The score the threshold applies to: ``template`` (each identity's template, the
        one decisions are made on since it was measured better) or ``best`` (the best item:
        calibrations made before, and re-ranked ones)."""
        return str(self.details.get("score", BEST))

    def rerank_option(self) -> Rerank | None:
        """The re-ranking the scores came from, as search options (``None``: plain)."""
        if self.rerank is None:
            return None
        params = {k: v for k, v in self.rerank.items() if k != "method"}
        return rerank_options(self.rerank["method"], **params)

    def search_option(self) -> str:
        """What the scores were: "plain search" or the re-ranking, in words."""
        if self.rerank is None:
            return "plain search"
        params = ", ".join(f"{k}={v}" for k, v in self.rerank.items() if k != "method")
        return f"re-ranked by {self.rerank['method']} ({params})"


@dataclass(frozen=True)
class Decision:
    """Who the query is, under a calibration: the top candidate's label when its score
    reaches the threshold (``known``), else nobody (``label`` ``None``)."""

    label: str | None
    score: float | None
    threshold: float
    known: bool

    @property
    def margin(self) -> float | None:
        """``score - threshold``: how far above (or below, negative) the threshold."""
        return None if self.score is None else self.score - self.threshold


def decide(calibration: Calibration, top: tuple[str, float] | None) -> Decision:
    """The decision on a ranked list whose best candidate is ``top`` (label, score), or on
    an empty list (``None``: nobody)."""
    if top is None:
        return Decision(None, None, calibration.threshold, False)
    label, score = top
    known = float(score) >= calibration.threshold
    return Decision(label if known else None, float(score), calibration.threshold, known)


def no_decision_reason(version: str, calibration: Calibration | None,
                       rerank: Rerank | None) -> str | None:
    """Why a search of ``version`` with ``rerank`` gets no decision (``None``: it gets one)."""
    if calibration is None:
        return (f"model version {version} has no calibration, so it serves no decisions; "
                f"calibrate it: POST /models/{version}/calibrate")
    wanted = rerank.describe() if rerank is not None else None
    if wanted != calibration.rerank:
        used = rerank_summary(rerank) if rerank is not None else "plain search"
        return (f"the threshold of {version} was calibrated on {calibration.search_option()}; "
                f"this search used {used}, whose scores are on another scale")
    return None


def query_set_digest(items: Sequence[QueryItem]) -> str:
    """SHA-256 over ``[id, sha256, label]`` of each query item, in id order."""
    digest = hashlib.sha256()
    for item in sorted(items, key=lambda i: i.id):
        digest.update(json.dumps([int(item.id), item.sha256, item.label]).encode() + b"\n")
    return digest.hexdigest()


def _digest_of(name: str, session_factory: sessionmaker[Session]) -> str:
    with session_factory() as session:
        items, _ = query_set_store.load_query_set(name, session=session)
    if not items:
        raise EvaluationError(f"query set {name!r} is empty: nothing to calibrate on")
    return query_set_digest(items)


def check_fpir(target_fpir: float) -> float:
    """The target as a float in (0, 1).

    Raises:
        EvaluationError: outside it (0 and 1 included: no threshold holds them).
    """
    value = float(target_fpir)
    if not 0.0 < value < 1.0:
        raise EvaluationError(f"target_fpir must lie in (0, 1), got {target_fpir}")
    return value


def calibrate(
    searcher: Any, query_set: str, target_fpir: float, *,
    session_factory: sessionmaker[Session], embedder: Embedder | None = None,
    media: MediaBackend | None = None, max_pixels: int = DEFAULT_MAX_PIXELS,
    rerank: Rerank | None = None, bootstrap: int = BOOTSTRAP, seed: int = SEED,
) -> Calibration:
    """Measure ``searcher``'s version on ``query_set`` and keep the threshold at
    ``target_fpir`` as the version's calibration (the one served from now on).

    Args:
        searcher: the version's index (:class:`~imgret.gallery.search.Searcher`).
        embedder, media, max_pixels: as :func:`imgret.gallery.evaluation.retrieval.load_query_batch`
            (needed only for query items without stored vectors of the version).
        rerank: calibrate re-ranked search (decides only searches with the same option).

    Raises:
        EvaluationError: a target outside (0, 1), an empty query set, one without mated or
            non-mated queries, too few non-mated queries for the target, or a set that
            changed while it was measured.
        GalleryError: no such query set or version.
    """
    target = check_fpir(target_fpir)
    before = _digest_of(query_set, session_factory)
    try:
        evaluation = evaluate_query_set(
            searcher, query_set, session_factory=session_factory, embedder=embedder,
            media=media, max_pixels=max_pixels, rerank=rerank,
            open_set=OpenSetRequest(enabled=True, fpirs=(target,)),
        )
    except EvaluationError as exc:
        raise EvaluationError(f"cannot calibrate {searcher.model_version} on {query_set!r}: "
                              f"{exc}") from None
    section = evaluation.report["open_set"]
    (point,) = section["operating_points"]
    if point["threshold"] is None:
        raise EvaluationError(f"cannot calibrate at FPIR {target:g} on {query_set!r}: "
                              f"{point['note']}")
    if _digest_of(query_set, session_factory) != before:
        raise EvaluationError(f"query set {query_set!r} changed while it was measured; "
                              "calibrate again")
    threshold_ci = point["threshold"]["ci95"] or [None, None]
    details = {
        "score": section.get("score", BEST),
        "mated": section["mated"], "non_mated": section["non_mated"],
        "depth": section["depth"], "resamples": section["resamples"],
        **{key: point[key] for key in ("fnir", "fpir_measured", "rank1_identification")},
    }
    with session_factory.begin() as session:
        row = version_store.get_version(searcher.model_version, session=session)
        saved = version_store.add_calibration(
            row, session=session, query_set=query_set, query_set_sha256=before,
            target_fpir=target, threshold=point["threshold"]["value"],
            threshold_low=threshold_ci[0], threshold_high=threshold_ci[1],
            fpir=point["fpir_measured"]["value"], fnir=point["fnir"]["value"],
            rerank=evaluation.report["rerank"], details=details,
        )
        return Calibration.from_row(saved, row.version)


def current(version: str, *, session_factory: sessionmaker[Session]) -> Calibration | None:
    """The calibration ``version`` serves (its newest), or ``None``.

    Raises:
        VersionNotFound: unknown version.
    """
    with session_factory() as session:
        return current_in(session, version_store.get_version(version, session=session))


def current_in(session: Session, row: Any) -> Calibration | None:
    """:func:`current` for a loaded ``model_versions`` row, in ``session``."""
    saved = version_store.latest_calibration(row.id, session=session)
    return Calibration.from_row(saved, row.version) if saved is not None else None
