"""Model versions in production: register a checkpoint, describe and compare versions,
switch the served one atomically (gated on a paired verdict), roll back, delete. One code
path for ``/models`` and ``imgret models``. This module sequences the steps; the SQL is
:mod:`imgret.gallery.storage.store`'s and :mod:`imgret.gallery.versions.version_store`'s, and the
background re-embedding of
the gallery for a version is :mod:`imgret.gallery.versions.reembed`.

Decisions:

- **Checkpoints live in the database** (``model_checkpoints``, beside ``media_blobs``), so
  every process on the database loads every version, a replica without any local file
  included. A checkpoint is read with ``torch.load(weights_only=True)`` and its version is
  recomputed from the weights: a file that names another version than its weights is
  refused. A version's identity is the full SHA-256 of config + weights
  (``content_digest``): the same weights again are a no-op, other weights under a
  registered name are refused with 409 and never re-bound. ``<data_dir>/models/<v>/model.pt``
  is only a local copy (the backup reads it; a start-up imports such a file into the
  database when a version's bytes are missing there, for galleries from older releases).
- **Paths from clients**: ``POST /models {"path"}`` reads only under ``<data_dir>/models``
  and ``IMGRET_MODEL_ROOTS``, after resolving symlinks and ``..``, and answers every path it
  may not or cannot read, and every file that is not a checkpoint, with one message
  (:data:`PATH_REFUSED`). Operators' paths (``IMGRET_MODEL``, the CLI) are not confined.
  Every read is capped by ``IMGRET_MAX_CHECKPOINT_BYTES``, checked with ``fstat`` first.
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
  (``imgret.gallery.evaluation.retrieval.gate``). ``require=fnir_not_worse`` (alone or beside one of
  them) needs the candidate's calibration and its FNIR, at its own threshold for the calibrated
  target FPIR, not worse than the active version's at the active version's own threshold for that
  FPIR, on the same queries (a paired bootstrap that re-derives both thresholds per resample:
  ``imgret.gallery.evaluation.open_set.fnir_gate``); a comparison that cannot be resolved refuses.
- **Rollback** activates the version that the current one replaced (the last
  ``model_activations`` row), with the same coverage rule: items added meanwhile are embedded
  for it first. A second rollback goes forward again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from imgret.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    load_checkpoint,
    resolve_checkpoint_path,
)
from imgret.embedder import Embedder
from imgret.errors import CheckpointError, GalleryError, IndexStale
from imgret.files import file_sha256, write_atomic_with
from imgret.gallery.evaluation import calibration as calibrations
from imgret.gallery.evaluation import open_set as open_set_evaluation
from imgret.gallery.evaluation.retrieval import (
    BOOTSTRAP,
    MIN_EFFECT,
    SEED,
    Evaluation,
    EvaluationError,
    compare_versions,
    evaluate_query_set,
    gate,
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

MODELS_DIR = "models"
# Temporary upload files of older releases (see sweep_incoming).
INCOMING_DIR = ".incoming"
INCOMING_STALE_S = 600.0
# Items still missing a vector that an activation embeds itself (more: 409, embed first).
STRAGGLER_LIMIT = 1000

# What ``require`` may ask: one retrieval verdict, and the open-set FNIR.
RETRIEVAL_REQUIREMENTS = ("better", "not_worse")
FNIR_NOT_WORSE = "fnir_not_worse"
REQUIREMENTS = (*RETRIEVAL_REQUIREMENTS, FNIR_NOT_WORSE)


class ActivationRefused(GalleryError):
    """A switch that the state or the verdict does not allow (409); ``details`` goes into the
    response body beside ``detail`` (the comparisons behind a refused gate)."""

    def __init__(self, message: str, comparison: dict[str, Any] | None = None,
                 open_set: dict[str, Any] | None = None):
        super().__init__(message)
        self.details = {"comparison": comparison, "open_set": open_set}


# --------------------------------------------------------------------------- checkpoints


class VersionConflict(GalleryError):
    """A version name already bound to other weights (409): a name is never re-bound."""


class VersionInUse(GalleryError):
    """A version that cannot be deleted now: active, the rollback target, or re-embedding
    (409)."""


class CheckpointTooLarge(CheckpointError):
    """A checkpoint over ``IMGRET_MAX_CHECKPOINT_BYTES`` (413), refused before it is read."""


# The one answer to a path a client may not have read: outside the roots, missing,
# unreadable, a folder without model.pt, or not a checkpoint. Saying which would tell a
# client what exists on the server (or, from a parser's message, what a file holds).
PATH_REFUSED = ("path: no imgret checkpoint this server may read there; give a run directory "
                "or model.pt under <data_dir>/models or IMGRET_MODEL_ROOTS, or upload the file")
DEFAULT_MAX_CHECKPOINT_BYTES = 256 * 1024 * 1024


def checkpoint_file(data_dir: str | Path, version: str) -> Path:
    """The local copy of a version's checkpoint under the data dir (the backup reads it; the
    database holds the bytes every process loads)."""
    return Path(data_dir) / MODELS_DIR / version / CHECKPOINT_FILE


def model_roots(data_dir: str | Path, extra: Iterable[str | Path] = ()) -> list[Path]:
    """The folders ``POST /models {"path"}`` may read: ``<data_dir>/models`` and
    ``IMGRET_MODEL_ROOTS``, resolved (symlinks followed) like the paths checked against
    them."""
    return [Path(root).resolve() for root in (Path(data_dir) / MODELS_DIR, *extra)]


def read_capped(path: Path, max_bytes: int) -> bytes:
    """A regular file's bytes, its size checked with ``fstat`` before anything is read.

    Raises:
        CheckpointTooLarge: over ``max_bytes``.
        OSError: missing, unreadable, or not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise IsADirectoryError(str(path))
        if info.st_size > max_bytes:
            raise CheckpointTooLarge(
                f"the checkpoint is {info.st_size} bytes, over IMGRET_MAX_CHECKPOINT_BYTES "
                f"({max_bytes})")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew since the fstat
        raise CheckpointTooLarge(f"the checkpoint is over IMGRET_MAX_CHECKPOINT_BYTES "
                                 f"({max_bytes})")
    return data


def read_under_roots(path: str | Path, roots: Iterable[Path], max_bytes: int) -> bytes:
    """The bytes of a client-given checkpoint path, only when it resolves (symlinks, ``..``)
    to a file under one of ``roots`` (a run directory: its model.pt, resolved again).

    Raises:
        CheckpointError: :data:`PATH_REFUSED` for every path that may not or cannot be read.
        CheckpointTooLarge: a file under the roots over ``max_bytes``.
    """
    roots = list(roots)

    def inside(target: Path) -> bool:
        return any(target.is_relative_to(root) for root in roots)

    try:
        target = Path(path).resolve(strict=True)
        if not inside(target):
            raise CheckpointError(PATH_REFUSED)
        if target.is_dir():
            target = (target / CHECKPOINT_FILE).resolve(strict=True)
            if not inside(target):
                raise CheckpointError(PATH_REFUSED)
        return read_capped(target, max_bytes)
    except CheckpointTooLarge:
        raise
    except (OSError, ValueError, RuntimeError):  # RuntimeError: a symlink loop
        raise CheckpointError(PATH_REFUSED) from None


def register_checkpoint(
    path: str | Path, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
) -> dict[str, Any]:
    """Register a checkpoint an operator names (``IMGRET_MODEL``, ``imgret models register``,
    ``imgret ingest --model``): a run directory or its ``model.pt``, anywhere, with precise
    messages. See :func:`register_bytes`."""
    source = resolve_checkpoint_path(path)
    try:
        data = read_capped(source, max_bytes)
    except OSError as exc:
        raise CheckpointError(f"{source}: cannot read the checkpoint ({exc.strerror})") from None
    return register_bytes(data, session_factory=session_factory, data_dir=data_dir,
                          name=str(source))


def register_path(
    path: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    roots: Iterable[str | Path] = (), max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
) -> dict[str, Any]:
    """Register a checkpoint by a path a client sent (``POST /models {"path"}``): read only
    under :func:`model_roots`, and any file that is not a checkpoint gets
    :data:`PATH_REFUSED` (never the parser's words, which may quote the file)."""
    data = read_under_roots(path, model_roots(data_dir, roots), max_bytes)
    try:
        loaded = _parse(data, "the checkpoint")
    except CheckpointError:
        raise CheckpointError(PATH_REFUSED) from None
    return _register_loaded(data, loaded, session_factory=session_factory, data_dir=data_dir)


def register_upload(
    data: bytes, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
) -> dict[str, Any]:
    """Register uploaded checkpoint bytes (no temporary file: they go to the database)."""
    if len(data) > max_bytes:
        raise CheckpointTooLarge(f"the checkpoint is {len(data)} bytes, over "
                                 f"IMGRET_MAX_CHECKPOINT_BYTES ({max_bytes})")
    return register_bytes(data, session_factory=session_factory, data_dir=data_dir,
                          name="the uploaded checkpoint")


def register_bytes(
    data: bytes, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    name: str = "the checkpoint",
) -> dict[str, Any]:
    """Register a checkpoint's bytes: parsed with :func:`imgret.checkpoint.load_checkpoint`,
    its version recomputed from the weights, the bytes stored in ``model_checkpoints``.

    Identity is the full content digest: the same weights again change nothing (the first
    bytes stay), other weights under a registered name are refused (409), never re-bound.
    On a database without an active version, the version becomes active (with its history
    row).

    Returns:
        The version as :func:`describe_one` shows it.

    Raises:
        CheckpointError: not an imgret checkpoint, or a version that does not match its
            weights.
        VersionConflict: the name is bound to other weights.
        GalleryError: the version is registered with another dimension.
    """
    return _register_loaded(data, _parse(data, name), session_factory=session_factory,
                            data_dir=data_dir)


def _parse(data: bytes, name: str) -> Checkpoint:
    """:func:`imgret.checkpoint.load_checkpoint` of bytes from outside; a failure it does not
    name (a bug for a file it should refuse) is still the file's fault: 422, never 500."""
    try:
        return load_checkpoint(data)
    except CheckpointError:
        raise
    except Exception:  # noqa: BLE001 - logged; the client gets no parser text
        logger.warning("%s could not be parsed", name, exc_info=True)
        raise CheckpointError(f"{name} is not an imgret checkpoint (it cannot be rebuilt "
                              "from its spec and weights)") from None


def _register_loaded(data: bytes, loaded: Checkpoint, *, session_factory: sessionmaker[Session],
                     data_dir: str | Path) -> dict[str, Any]:
    version = loaded.model_version  # load_checkpoint checked it is its weights' hash
    sha = hashlib.sha256(data).hexdigest()
    with session_factory.begin() as session:
        # Serialised with deletes and activations (they take the same lock).
        item_store.lock_gallery_writes(session=session)
        new = version_store.find_version(version, session=session) is None
        row = version_store.register_model_version(session=session, version=version,
                                           dim=loaded.spec.dim, config=loaded.spec.to_dict())
        if row.content_digest is not None and row.content_digest != loaded.digest:
            raise VersionConflict(
                f"model version {version} is registered with other weights (content digest "
                f"{row.content_digest[:16]}..., these: {loaded.digest[:16]}...); the names "
                "share 12 digits only: a registered version is never re-bound"
            )
        stored = version_store.store_checkpoint(row, session=session, digest=loaded.digest,
                                                sha256=sha, data=data)
        if new and row.is_active:
            # The first version of a fresh database: active through a recorded switch.
            version_store.record_activation(row, session=session, previous=None,
                                            reason="register")
    if stored == sha:
        _write_local_copy(data_dir, version, data)
    return describe_one(version, session_factory=session_factory, data_dir=data_dir)


def _write_local_copy(data_dir: str | Path, version: str, data: bytes) -> None:
    """Keep ``<data_dir>/models/<v>/model.pt`` equal to the stored bytes (what the backup
    copies); best effort: the database is what every process loads from."""
    dest = checkpoint_file(data_dir, version)
    try:
        if dest.is_file() and dest.stat().st_size == len(data) \
                and file_sha256(dest) == hashlib.sha256(data).hexdigest():
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_atomic_with(dest, lambda handle: handle.write(data))
    except OSError as exc:
        logger.warning("cannot keep a local copy of checkpoint %s: %s", version, exc)


def load_version_checkpoint(
    version: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
) -> Checkpoint:
    """The loaded checkpoint of a registered version, from its bytes in the database,
    checked to be the version's weights (and kept as the local copy under ``data_dir``).

    Raises:
        VersionNotFound: unknown version.
        GalleryError: its checkpoint is not stored (register it with ``POST /models``).
        CheckpointError: the stored bytes are not the version's weights.
    """
    with session_factory() as session:
        row = _get(session, version)
        digest = row.content_digest
        data = version_store.checkpoint_bytes(row.id, session=session)
    if data is None:
        raise GalleryError(
            f"model version {version} has no stored checkpoint; register it with "
            f"`imgret models register RUN_DIR` or POST /models"
        )
    loaded = load_checkpoint(data)
    if loaded.model_version != version or (digest is not None and digest != loaded.digest):
        raise CheckpointError(f"the stored checkpoint of {version} holds other weights "
                              f"({loaded.model_version})")
    _write_local_copy(data_dir, version, data)
    return loaded


def load_embedder(
    version: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    device: str = "auto", runtime: str = "torch",
) -> Embedder:
    """The Embedder of a registered version, from its checkpoint in the database, run by
    ``runtime`` (``IMGRET_RUNTIME``: torch or onnxruntime; the vectors are the same).

    Raises:
        VersionNotFound: unknown version.
        GalleryError: its checkpoint is not stored (register it with ``POST /models``).
        CheckpointError: the stored bytes are not the version's weights.
    """
    loaded = load_version_checkpoint(version, session_factory=session_factory,
                                     data_dir=data_dir)
    return Embedder.from_checkpoint(loaded, device=device, runtime=runtime)


def import_checkpoint_files(
    *, session_factory: sessionmaker[Session], data_dir: str | Path,
    max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
) -> list[str]:
    """Store ``<data_dir>/models/<v>/model.pt`` for every registered version whose bytes the
    database lacks (galleries from before checkpoints moved into the database); a file
    that is unreadable or holds other weights is left alone (logged).

    Returns:
        The versions imported.
    """
    with session_factory() as session:
        missing = version_store.versions_without_checkpoint(session=session)
    imported = []
    for version in missing:
        path = checkpoint_file(data_dir, version)
        if not path.is_file():
            continue
        try:
            data = read_capped(path, max_bytes)
            info = register_bytes(data, session_factory=session_factory, data_dir=data_dir,
                                  name=str(path))
        except (OSError, CheckpointError, GalleryError) as exc:
            logger.warning("not importing %s into the database: %s", path, exc)
            continue
        if info["version"] == version:
            imported.append(version)
            logger.info("imported the checkpoint of %s from %s into the database", version,
                        path)
    return imported


def sweep_incoming(data_dir: str | Path, older_than_s: float = INCOMING_STALE_S) -> int:
    """Remove files under ``<data_dir>/models/.incoming`` older than ``older_than_s``:
    temporary uploads of processes killed mid-upload (uploads now go to the database; a
    process of an older release may still write there, so a fresh file is left alone).

    Returns:
        How many files were removed.
    """
    folder = Path(data_dir) / MODELS_DIR / INCOMING_DIR
    if not folder.is_dir():
        return 0
    removed = 0
    cutoff = time.time() - older_than_s
    for path in folder.iterdir():
        try:
            if path.is_file() and path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    if removed:
        logger.info("removed %d stale temporary uploads from %s", removed, folder)
    return removed


# --------------------------------------------------------------------------- describing


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
    (``imgret.gallery.evaluation.retrieval.compare_versions``)."""
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


# --------------------------------------------------------------------------- switching


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
            (``imgret.gallery.evaluation.retrieval.compare_versions`` of both evaluations,
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
                   data_dir: str | Path) -> None:
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

