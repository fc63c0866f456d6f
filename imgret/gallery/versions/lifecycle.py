"""Model versions in production: describe and compare versions,
switch the served one atomically (gated on a paired verdict), roll back, delete. One code
path for ``/models`` and ``imgret models``. This module sequences the steps; the SQL is
:mod:`imgret.gallery.storage`'s and :mod:`imgret.gallery.versions.version_store`'s, and the
background re-embedding of
the gallery for a version is :mod:`imgret.gallery.versions.reembed`.

Decisions:

- **Deleting a version** (:func:`delete_version`) is allowed unless it is active, the
  rollback target or being re-embedded; it removes everything of the version (no tombstone).
- **Activation** needs a stored checkpoint and full coverage: every live item up to
  ``covered_through`` (the newest id when the version was last complete: its re-embedding
  finished, or it stopped being the active one) must have a vector. Items added after that
  (at most :data:`STRAGGLER_LIMIT`) are embedded during the activation; the last of them
  inside the transaction that holds the gallery write lock and flips ``is_active``, so no
  item committed before the switch lacks the new version's vector and no write commits after
  it with the old one (``imgret.gallery.ingest.add_items`` checks the active version under the same
  lock). More missing items than that: 409, run embed first.
- **Gate**: ``require=better`` needs the paired verdict on MAP@R to be "better" and no
  metric "worse"; ``not_worse`` needs no metric "worse"
  (``imgret.gallery.evaluation.comparison.gate``). ``require=fnir_not_worse`` (alone or beside
  one of them) needs the candidate's calibration and its FNIR, at its own threshold for the
  calibrated target FPIR, not worse than the active version's at the active version's own
  threshold for that FPIR, on the same queries (a paired bootstrap that re-derives both
  thresholds per resample: ``imgret.gallery.evaluation.open_set.fnir_gate``); a comparison
  that cannot be resolved refuses.
- **Rollback** activates the version that the current one replaced (the last
  ``model_activations`` row), with the same coverage rule: items added meanwhile are embedded
  for it first. A second rollback goes forward again.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from imgret.checkpoint import CHECKPOINT_FILE
from imgret.embedder import Embedder
from imgret.errors import GalleryError, IndexStale
from imgret.gallery.evaluation import calibration as calibrations
from imgret.gallery.evaluation import open_set as open_set_evaluation
from imgret.gallery.evaluation.comparison import (
    MIN_EFFECT,
    compare_versions,
    gate,
)
from imgret.gallery.evaluation.comparison import REQUIREMENTS as RETRIEVAL_REQUIREMENTS
from imgret.gallery.evaluation.retrieval import (
    BOOTSTRAP,
    SEED,
    Evaluation,
    EvaluationError,
    evaluate_query_set,
)
from imgret.gallery.media.files import MediaBackend
from imgret.gallery.search.manifest import Manifest, collection_root, index_dir
from imgret.gallery.storage import item_store
from imgret.gallery.storage.scope import ALL_COLLECTIONS
from imgret.gallery.storage.tables import ModelVersion, utcnow
from imgret.gallery.versions import version_store
from imgret.gallery.versions.reembed import EMBED_CHUNK, embed_missing, embed_stored
from imgret.gallery.versions.version_store import (
    VersionNotFound as VersionNotFound,  # raised here too
)
from imgret.gallery.versions.version_store import as_utc
from imgret.images import DEFAULT_MAX_PIXELS, DecodeLimits

logger = logging.getLogger(__name__)


# Items still missing a vector that an activation embeds itself (more: 409, embed first).
STRAGGLER_LIMIT = 1000


# What ``require`` may ask: one retrieval verdict (RETRIEVAL_REQUIREMENTS), and the open-set
# FNIR.
FNIR_NOT_WORSE = "fnir_not_worse"


REQUIREMENTS = (*RETRIEVAL_REQUIREMENTS, FNIR_NOT_WORSE)


MODELS_DIR = "models"


def checkpoint_file(data_dir: str | Path, version: str) -> Path:
    """The local copy of a version's checkpoint under the data dir (the backup reads it; the
    database holds the bytes every process loads)."""
    return Path(data_dir) / MODELS_DIR / version / CHECKPOINT_FILE


class ActivationRefused(GalleryError):
    """A switch that the state or the verdict does not allow (409); ``details`` goes into the
    response body beside ``detail`` (the comparisons behind a refused gate)."""

    def __init__(self, message: str, comparison: dict[str, Any] | None = None,
                 open_set: dict[str, Any] | None = None):
        super().__init__(message)
        self.details = {"comparison": comparison, "open_set": open_set}


class VersionInUse(GalleryError):
    """A version that cannot be deleted now: active, the rollback target, or re-embedding
    (409)."""


def describe(
    *, session_factory: sessionmaker[Session], data_dir: str | Path,
    index_sizes: dict[str, tuple[int, str]] | None = None,
) -> list[dict[str, Any]]:
    """Every version as ``GET /models`` shows it (see :func:`describe_one`)."""
    with session_factory() as session:
        rows = version_store.list_model_versions(session=session)
        return [_describe(session, row, data_dir, index_sizes or {}) for row in rows]


def describe_one(
    version: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    index_sizes: dict[str, tuple[int, str]] | None = None,
) -> dict[str, Any]:
    """One version: config, created, coverage, index state, job state, active flag, last
    evaluation. ``index_sizes`` (version -> (size, factory)) are the indexes this process has
    open; otherwise the saved manifest says whether an index is built.

    Raises:
        VersionNotFound: unknown version.
    """
    with session_factory() as session:
        return _describe(session, _get(session, version), data_dir, index_sizes or {})


def _describe(session: Session, row: ModelVersion, data_dir: str | Path,
              index_sizes: dict[str, tuple[int, str]]) -> dict[str, Any]:
    embedded_queries, total_queries = version_store.query_coverage(row.id, session=session)
    calibration = calibrations.current_in(session, row)
    if row.version in index_sizes:
        size, factory = index_sizes[row.version]
        index = {"state": "built", "size": size, "factory": factory}
    else:
        index = _saved_index(collection_root(data_dir, row.collection_id), row.version)
    return {
        "version": row.version,
        "dim": row.dim,
        "config": dict(row.config or {}),
        "created_at": as_utc(row.created_at),
        "active": bool(row.is_active),
        "activated_at": as_utc(row.activated_at),
        "coverage": version_store.coverage(row.id, session=session).to_dict(),
        "query_items": {"embedded": embedded_queries, "total": total_queries},
        "index": index,
        "embedding": _job_state(row),
        "checkpoint_stored": version_store.has_checkpoint(row.id, session=session),
        "last_evaluation": row.last_evaluation,
        "calibration": calibration.to_dict() if calibration is not None else None,
        "decisions": _decisions(row.version, calibration),
    }


def _decisions(version: str, calibration: calibrations.Calibration | None) -> str:
    """Whether the version serves decisions, in words."""
    if calibration is None:
        return f"none: {calibrations.no_decision_reason(version, None, None)}"
    option = calibration.search_option()
    return (f"known when the top score is >= {calibration.threshold:.6g} ({option}; target "
            f"FPIR {calibration.target_fpir:g}, measured {calibration.fpir:.4g} with FNIR "
            f"{calibration.fnir:.4g} on query set {calibration.query_set!r})")


def _saved_index(data_dir: str | Path, version: str) -> dict[str, Any]:
    try:
        manifest = Manifest.read(index_dir(data_dir, version))
    except IndexStale:  # missing or unreadable: not built (a process builds it on demand)
        return {"state": "missing", "size": None, "factory": None}
    return {"state": "built", "size": manifest.count, "factory": manifest.factory}


def _job_state(row: ModelVersion) -> dict[str, Any]:
    state = row.embed_state or "idle"
    if state == version_store.STATE_RUNNING and not version_store.job_is_live(row):
        state = "interrupted"
    return {"state": state, "error": row.embed_error,
            "updated_at": as_utc(row.embed_heartbeat_at)}


def has_checkpoint(version: str, *, session_factory: sessionmaker[Session]) -> bool:
    """Whether a registered version's checkpoint bytes are in the database (False for an
    unknown version)."""
    with session_factory() as session:
        row = version_store.find_version(version, session=session)
        return row is not None and version_store.has_checkpoint(row.id, session=session)


def _get(session: Session, version: str) -> ModelVersion:
    return version_store.get_version(version, session=session)


def record_evaluation(
    version: str, report: dict[str, Any], *, session_factory: sessionmaker[Session],
) -> None:
    """Keep a summary of a named query set's evaluation as the version's last one.

    Uploaded query sets (no name) and re-ranked evaluations (``report["rerank"]``: a search
    option, not the model) are not kept.
    """
    if not report.get("query_set") or report.get("rerank"):
        return
    summary = {
        "query_set": report["query_set"], "at": utcnow().isoformat(),
        "num_queries": report.get("num_queries"),
        **{m: report.get(m) for m in ("map_at_r", "r_precision", "precision_at_1")},
    }
    with session_factory.begin() as session:
        version_store.set_last_evaluation(version, summary, session=session)


def evaluate_recorded(searcher: Any, query_set: str, *,
                      session_factory: sessionmaker[Session], **options: Any) -> Evaluation:
    """:func:`imgret.gallery.evaluation.retrieval.evaluate_query_set` through ``searcher`` (its
    version's index),
    kept as that version's last evaluation unless re-ranked (:func:`record_evaluation`): what
    ``/evaluate``, ``imgret evaluate`` and the comparisons run. ``options`` as
    ``evaluate_query_set`` (embedder, media, k, rerank, ...)."""
    result = evaluate_query_set(searcher, query_set, session_factory=session_factory, **options)
    record_evaluation(searcher.model_version, result.report, session_factory=session_factory)
    return result


def fnir_comparison(a: Evaluation, b: Evaluation, fpir: float) -> dict[str, Any]:
    """B's FNIR against A's at each one's threshold for ``fpir``, paired over the queries of
    two open-set evaluations of one query set
    (:func:`imgret.gallery.evaluation.open_set.fnir_comparison`), with the versions and the query
    set named.

    Raises:
        EvaluationError: not the same queries, or too few non-mated ones for ``fpir``.
    """
    if a.searches is None or b.searches is None:
        raise EvaluationError("an FNIR comparison needs two evaluations with their searches")
    try:
        result = open_set_evaluation.fnir_comparison(
            a.searches, b.searches, fpir, bootstrap=BOOTSTRAP, seed=SEED, min_effect=MIN_EFFECT)
    except ValueError as exc:
        raise EvaluationError(f"FNIR comparison on {a.report.get('query_set')!r}: {exc}") \
            from None
    result["a"]["version"] = a.report["model_version"]
    result["b"]["version"] = b.report["model_version"]
    return {"query_set": a.report.get("query_set"), **result}


def comparison_report(a: Evaluation, b: Evaluation) -> dict[str, Any]:
    """Two :class:`imgret.gallery.evaluation.retrieval.Evaluation` of one query set as
    ``/evaluate`` reports a comparison:
    ``{"a", "b", "difference", "verdict", "b_better", "a_better"}``, per metric B − A
    with its paired 95% interval and verdict
    (``imgret.gallery.evaluation.comparison.compare_versions``)."""
    comparison = compare_versions(a, b)
    return {
        "a": a.report,
        "b": b.report,
        "difference": {m: v for m, v in comparison.items()
                       if isinstance(v, dict) and "ci95" in v},
        "verdict": comparison.get("verdict", {}),
        "b_better": comparison["b_better"],
        "a_better": comparison["a_better"],
    }


@dataclass(frozen=True)
class Activation:
    """A switch that happened (or, with ``changed`` false, was already in force)."""

    active: str
    previous: str | None
    comparison: dict[str, Any] | None
    changed: bool
    stragglers: int = 0
    open_set: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"active": self.active, "previous": self.previous,
                "comparison": self.comparison, "changed": self.changed,
                "stragglers_embedded": self.stragglers, "open_set": self.open_set}


Compare = Callable[[str, str, str], dict[str, Any]]


# (active, candidate, query set, the candidate's calibration) -> :func:`fnir_comparison`.
CompareFnir = Callable[[str, str, str, calibrations.Calibration], dict[str, Any]]


def requirements_of(require: str | Sequence[str] | None) -> tuple[str, ...]:
    """The gate's requirements as a tuple: at most one retrieval verdict (``better`` or
    ``not_worse``) and, or, ``fnir_not_worse``.

    Raises:
        ActivationRefused: an unknown requirement, or both retrieval verdicts.
    """
    given = (require,) if isinstance(require, str) else tuple(require or ())
    unknown = [r for r in given if r not in REQUIREMENTS]
    if unknown:
        raise ActivationRefused(f"require must be one of {', '.join(REQUIREMENTS)}, not "
                                f"{unknown[0]!r}")
    if len({r for r in given if r in RETRIEVAL_REQUIREMENTS}) > 1:
        raise ActivationRefused("require: give one of better or not_worse (better implies "
                                "not_worse)")
    return tuple(dict.fromkeys(given))


def activate(
    version: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    media: MediaBackend, embedder: Embedder, require: str | Sequence[str] | None = None,
    query_set: str | None = None, compare: Compare | None = None,
    compare_fnir: CompareFnir | None = None,
    prepare_index: Callable[[str], Any] | None = None, reason: str = "activate",
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Activation:
    """Make ``version`` the served one (see the module docstring for the rules).

    Args:
        embedder: the version's model (for the items added since its re-embedding).
        require: ``"better"`` or ``"not_worse"`` (needs ``query_set`` and ``compare``),
            ``"fnir_not_worse"`` (needs ``query_set``, ``compare_fnir`` and a calibration of
            ``version``), or a sequence of them (:func:`requirements_of`).
        compare_fnir: ``compare_fnir(active, candidate, query_set, calibration)`` ->
            :func:`fnir_comparison` at the calibration's target FPIR.
        compare: ``compare(active, candidate, query_set)`` -> the paired comparison
            (``imgret.gallery.evaluation.comparison.compare_versions`` of both evaluations,
            with verdicts).
        prepare_index: opens (loads or builds) the version's index before the switch.
        reason: ``"activate"`` or ``"rollback"`` (recorded).

    Raises:
        VersionNotFound: unknown version.
        ActivationRefused: no stored checkpoint, coverage far from complete, or the verdict
            does not satisfy ``require``.
    """
    requirements = requirements_of(require)
    with session_factory() as session:
        row = _get(session, version)
        active = version_store.active_model_version(session=session)
        active_name = active.version if active is not None else None
        if not version_store.has_checkpoint(row.id, session=session):
            raise ActivationRefused(
                f"model version {version} has no stored checkpoint, so other processes could "
                "not load it; register it first (imgret models register / POST /models)"
            )
        cov = version_store.coverage(row.id, session=session)
        old_gaps = version_store.count_missing(row.id, session=session,
                                               through=row.covered_through)
        new_gaps = cov.missing - old_gaps
    if active_name == version:
        return Activation(version, None, None, changed=False)
    if old_gaps or new_gaps > STRAGGLER_LIMIT:
        raise ActivationRefused(
            f"model version {version} covers {cov.embedded} of {cov.live} live items; "
            f"re-embed first (POST /models/{version}/embed or imgret models embed {version})"
        )
    comparison = open_set = None
    for requirement in requirements:
        if not query_set or active_name is None:
            raise ActivationRefused("require needs query_set (and an active version to beat)")
        if requirement in RETRIEVAL_REQUIREMENTS:
            if compare is None:
                raise ActivationRefused(f"require={requirement} needs a comparison")
            comparison = compare(active_name, version, query_set)
            allowed, why = gate(comparison, requirement)
        else:
            with session_factory() as session:
                calibration = calibrations.current_in(session, _get(session, version))
            if calibration is None:
                raise ActivationRefused(
                    f"require={FNIR_NOT_WORSE} compares FNIR at the candidate's calibrated "
                    f"FPIR, and {version} has no calibration: calibrate it first (POST "
                    f"/models/{version}/calibrate or imgret models calibrate {version})")
            if compare_fnir is None:
                raise ActivationRefused(f"require={FNIR_NOT_WORSE} needs an FNIR comparison")
            open_set = compare_fnir(active_name, version, query_set, calibration)
            allowed, why = open_set_evaluation.fnir_gate(open_set)
        if not allowed:
            raise ActivationRefused(f"activation refused (require={requirement}): {why}",
                                    comparison, open_set)
    # Stragglers (items added since the re-embedding), outside any lock first...
    caught_up = embed_missing(version, session_factory=session_factory, media=media,
                              embedder=embedder, max_pixels=max_pixels,
                              include_queries=False).gallery_embedded
    if prepare_index is not None:
        prepare_index(version)
    limits = DecodeLimits(image_pixels=max_pixels, request_pixels=2**62)
    with session_factory.begin() as session:
        # ... then the last ones under the gallery write lock: nothing commits in between.
        item_store.lock_gallery_writes(session=session)
        row = _get(session, version)
        while batch := version_store.missing_items(row.id, session=session, after=0,
                                                   limit=EMBED_CHUNK, queries=False):
            ids, vectors, broken = embed_stored(batch, media, embedder, limits)
            if broken:
                raise ActivationRefused(
                    f"stored images of items {broken[:10]} cannot be decoded with {version}"
                )
            caught_up += len(item_store.add_embeddings(ids, vectors, session=session,
                                                       model_version=row))
        # The previous version served until now, so every item so far has its vector too
        # (writes check it): both are covered through the newest item.
        version_store.switch_active(row, session=session, reason=reason,
                                    gate=_gate_summary(comparison, open_set, requirements,
                                                       query_set))
    logger.info("%s: %s is active (was %s; %d items embedded during the switch)", reason,
                version, active_name, caught_up)
    return Activation(version, active_name, comparison, changed=True, stragglers=caught_up,
                      open_set=open_set)


def previous_version(*, session_factory: sessionmaker[Session]) -> str:
    """The version the active one replaced (what a rollback activates).

    Raises:
        ActivationRefused: no switch on record.
    """
    with session_factory() as session:
        target = version_store.rollback_target(session=session)
        if target is None:
            raise ActivationRefused("no previous version to roll back to: the active version "
                                    "was never switched to from another one")
        return target.version


def delete_version(version: str, *, session_factory: sessionmaker[Session],
                   data_dir: str | Path,
                   drop_vectors: Callable[[int, str | None], None] | None = None) -> None:
    """Delete a version that is neither active nor the rollback target: its row, checkpoint
    bytes, gallery and query embeddings and the activations that switched to it (one
    transaction under the gallery write lock, which activations take too: a delete and an
    activation of the same version never both succeed), then its saved index and local
    checkpoint copy under this data dir. Nothing is kept: registering the same weights again
    starts it afresh.

    Raises:
        VersionNotFound: unknown version.
        VersionInUse: active, the rollback target, or being re-embedded.
    """
    with session_factory.begin() as session:
        item_store.lock_gallery_writes(session=session)
        row = _get(session, version)
        if row.is_active:
            raise VersionInUse(f"model version {version} is active; activate another version "
                               "first")
        target = version_store.rollback_target(session=session)
        if target is not None and row.id == target.id:
            raise VersionInUse(f"model version {version} is the rollback target (the version "
                               "the active one replaced); it can be deleted after the next "
                               "switch")
        if version_store.job_is_live(row):
            raise VersionInUse(f"model version {version} is being re-embedded; wait for the "
                               "job to end")
        version_store.delete_version(row, session=session)
        collection_id = row.collection_id
        # The local checkpoint copy is shared by the collections that bind these weights.
        shared = session.scalar(
            select(func.count()).select_from(ModelVersion)
            .where(ModelVersion.version == version)
            .execution_options(**{ALL_COLLECTIONS: True})
        )
    folders = [index_dir(collection_root(data_dir, collection_id), version)]
    if not shared:
        folders.append(checkpoint_file(data_dir, version).parent)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    if drop_vectors is not None:  # the version's vectors in an outside engine (Milvus)
        drop_vectors(collection_id, version)
    logger.info("deleted model version %s", version)


def served_state(*, session_factory: sessionmaker[Session]) -> tuple[str | None, int | None]:
    """``(active version, id of its newest calibration)`` (see
    :func:`imgret.gallery.versions.version_store.served_state`)."""
    with session_factory() as session:
        return version_store.served_state(session=session)


def active_version(*, session_factory: sessionmaker[Session]) -> str | None:
    """The name of the active version (``None`` on an empty database)."""
    with session_factory() as session:
        active = version_store.active_model_version(session=session)
        return active.version if active is not None else None


def history(*, session_factory: sessionmaker[Session], limit: int = 20) -> list[dict[str, Any]]:
    """The last switches, newest first."""
    with session_factory() as session:
        names = version_store.version_names(session=session)
        rows = version_store.last_activations(session=session, limit=limit)
        return [{"version": names.get(r.model_version_id),
                 "previous": names.get(r.previous_version_id), "reason": r.reason,
                 "at": as_utc(r.created_at), "gate": r.gate} for r in rows]


def _gate_summary(comparison: dict[str, Any] | None, open_set: dict[str, Any] | None,
                  requirements: tuple[str, ...], query_set: str | None) -> dict[str, Any] | None:
    if comparison is None and open_set is None:
        return None
    retrieval = [r for r in requirements if r in RETRIEVAL_REQUIREMENTS]
    summary: dict[str, Any] = {"require": retrieval[0] if retrieval else None,
                               "query_set": query_set,
                               "verdict": comparison.get("verdict") if comparison else None}
    if open_set is not None:
        summary["fnir"] = {key: open_set[key] for key in ("fpir", "difference", "ci95",
                                                          "verdict")}
    return summary
