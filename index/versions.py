"""Model versions in production: register a checkpoint, re-embed the stored gallery in the
background, compare two versions, switch the served one atomically (gated on a paired
verdict), roll back. One code path for ``/models`` and ``imgret models``.

Decisions (the contract is silent on these):

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
- **Re-embedding reads the media store**, never a source folder. It is stateless: each chunk
  takes the next live items (in id order) that lack an embedding of the version, so a crash
  loses at most one chunk and a new run resumes where the last commit left off. Items added
  while it runs have larger ids and are picked up by the same scan; an item deleted while it
  runs is skipped at the write (``store.add_embeddings`` re-checks liveness under the gallery
  write lock), so a delete never comes back. Query-set items are embedded after the gallery.
  The job's state and heartbeat are columns of ``model_versions``, so every process sees
  progress; a ``running`` job whose heartbeat is older than :data:`HEARTBEAT_STALE_S` was
  interrupted and may be claimed again. The heartbeat beats from its own thread (every
  third of that), not per chunk: a slow chunk plus its throttle pause never looks dead.
- **Throttle**: the job computes at most ``duty`` of the wall time (it sleeps in between) and
  waits while the caller says searches are queued, so ``/search`` on the active version keeps
  its latency (measured in ``benchmarks/reembed_bench.py``).
- **Activation** needs a stored checkpoint and full coverage: every live item up to
  ``covered_through`` (the newest id when the version was last complete: its re-embedding
  finished, or it stopped being the active one) must have a vector. Items added after that
  (at most :data:`STRAGGLER_LIMIT`) are embedded during the activation; the last of them
  inside the transaction that holds the gallery write lock and flips ``is_active``, so no
  item committed before the switch lacks the new version's vector and no write commits after
  it with the old one (``index.ingest.add_items`` checks the active version under the same
  lock). More missing items than that: 409, run embed first.
- **Gate**: ``require=better`` needs the paired verdict on MAP@R to be "better" and no
  metric "worse"; ``not_worse`` needs no metric "worse" (``index.evaluation.gate``).
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
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import and_, delete, exists, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from imgret.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    load_checkpoint,
    resolve_checkpoint_path,
    version_name,
)
from imgret.embedder import Embedder
from imgret.errors import CheckpointError, GalleryError, ImageDecodeError, IndexStale
from imgret.files import file_sha256, write_atomic_with
from imgret.images import DEFAULT_MAX_PIXELS, DecodeLimits, embed_encoded
from index import store
from index.evaluation import Evaluation, compare_versions, evaluate_query_set, gate
from index.manifest import Manifest, index_dir
from index.media import MediaBackend
from index.models import (
    Embedding,
    GalleryItem,
    ModelActivation,
    ModelCheckpoint,
    ModelVersion,
    QueryEmbedding,
    QueryItem,
    utcnow,
)

logger = logging.getLogger(__name__)

MODELS_DIR = "models"
# Temporary upload files of older releases (see sweep_incoming).
INCOMING_DIR = ".incoming"
INCOMING_STALE_S = 600.0
# Items still missing a vector that an activation embeds itself (more: 409, embed first).
STRAGGLER_LIMIT = 1000
# A running job whose heartbeat is older than this was interrupted (crash, kill).
HEARTBEAT_STALE_S = 30.0
EMBED_CHUNK = 64
DEFAULT_DUTY = 0.5

STATE_RUNNING, STATE_DONE, STATE_FAILED = "running", "done", "failed"


class VersionNotFound(GalleryError, LookupError):
    """No model version by that name (404)."""


class ActivationRefused(GalleryError):
    """A switch that the state or the verdict does not allow (409); ``details`` goes into the
    response body beside ``detail`` (the comparison behind a refused gate)."""

    def __init__(self, message: str, comparison: dict[str, Any] | None = None):
        super().__init__(message)
        self.details = {"comparison": comparison}


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
    return _register_loaded(data, loaded, session_factory=session_factory, data_dir=data_dir,
                            name="the checkpoint")


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
                            data_dir=data_dir, name=name)


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
                     data_dir: str | Path, name: str) -> dict[str, Any]:
    version = version_name(loaded.spec, loaded.digest)
    if version != loaded.model_version:
        raise CheckpointError(
            f"{name} says version {loaded.model_version} but its weights hash to {version}; "
            "save it again with imgret.checkpoint.save_checkpoint"
        )
    sha = hashlib.sha256(data).hexdigest()
    with session_factory.begin() as session:
        # Serialised with deletes and activations (they take the same lock).
        store.lock_gallery_writes(session=session)
        new = session.scalar(select(ModelVersion.id).where(ModelVersion.version == version)) is None
        row = store.register_model_version(session=session, version=version,
                                           dim=loaded.spec.dim, config=loaded.spec.to_dict())
        if row.content_digest is not None and row.content_digest != loaded.digest:
            raise VersionConflict(
                f"model version {version} is registered with other weights (content digest "
                f"{row.content_digest[:16]}..., these: {loaded.digest[:16]}...); the names "
                "share 12 digits only: a registered version is never re-bound"
            )
        row.content_digest = loaded.digest
        stored = session.scalar(select(ModelCheckpoint.sha256)
                                .where(ModelCheckpoint.model_version_id == row.id))
        if stored is None:
            session.add(ModelCheckpoint(model_version_id=row.id, sha256=sha, size=len(data),
                                        data=data))
            stored = sha
        row.checkpoint_sha256 = stored
        if new and row.is_active:
            # The first version of a fresh database: active through a recorded switch.
            row.activated_at = utcnow()
            session.add(ModelActivation(model_version_id=row.id, previous_version_id=None,
                                        reason="register"))
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


def _stored_bytes(session: Session, row: ModelVersion) -> bytes | None:
    data = session.scalar(select(ModelCheckpoint.data)
                          .where(ModelCheckpoint.model_version_id == row.id))
    return bytes(data) if data is not None else None


def load_embedder(
    version: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    device: str = "auto",
) -> Embedder:
    """The Embedder of a registered version, from its checkpoint in the database.

    Raises:
        VersionNotFound: unknown version.
        GalleryError: its checkpoint is not stored (register it with ``POST /models``).
        CheckpointError: the stored bytes are not the version's weights.
    """
    with session_factory() as session:
        row = _get(session, version)
        digest = row.content_digest
        data = _stored_bytes(session, row)
    if data is None:
        raise GalleryError(
            f"model version {version} has no stored checkpoint; register it with "
            f"`imgret models register RUN_DIR` or POST /models"
        )
    loaded = load_checkpoint(data)
    if version_name(loaded.spec, loaded.digest) != version or (
            digest is not None and digest != loaded.digest):
        raise CheckpointError(f"the stored checkpoint of {version} holds other weights "
                              f"({version_name(loaded.spec, loaded.digest)})")
    _write_local_copy(data_dir, version, data)
    return Embedder(loaded.model, loaded.spec, device=device, model_version=version)


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
        has = exists().where(ModelCheckpoint.model_version_id == ModelVersion.id)
        missing = session.scalars(select(ModelVersion.version).where(~has)).all()
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


@dataclass(frozen=True)
class Coverage:
    """Live gallery items with a vector of the version, and all live items."""

    embedded: int
    live: int

    @property
    def missing(self) -> int:
        return self.live - self.embedded

    def to_dict(self) -> dict[str, Any]:
        return {"embedded": self.embedded, "live": self.live,
                "fraction": self.embedded / self.live if self.live else 1.0,
                "complete": self.embedded >= self.live}


def coverage(session: Session, model_version_id: int) -> Coverage:
    """How much of the live gallery has a vector of the version (two counts)."""
    live = session.scalar(
        select(func.count()).select_from(GalleryItem).where(GalleryItem.deleted_at.is_(None))
    ) or 0
    embedded = session.scalar(
        select(func.count()).select_from(Embedding)
        .join(GalleryItem, GalleryItem.id == Embedding.item_id)
        .where(Embedding.model_version_id == model_version_id, GalleryItem.deleted_at.is_(None))
    ) or 0
    return Coverage(int(embedded), int(live))


def describe(
    *, session_factory: sessionmaker[Session], data_dir: str | Path,
    index_sizes: dict[str, tuple[int, str]] | None = None,
) -> list[dict[str, Any]]:
    """Every version as ``GET /models`` shows it (see :func:`describe_one`)."""
    with session_factory() as session:
        rows = store.list_model_versions(session=session)
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
    total_queries = session.scalar(select(func.count()).select_from(QueryItem)) or 0
    embedded_queries = session.scalar(
        select(func.count()).select_from(QueryEmbedding)
        .where(QueryEmbedding.model_version_id == row.id)
    ) or 0
    if row.version in index_sizes:
        size, factory = index_sizes[row.version]
        index = {"state": "built", "size": size, "factory": factory}
    else:
        index = _saved_index(data_dir, row.version)
    return {
        "version": row.version,
        "dim": row.dim,
        "config": dict(row.config or {}),
        "created_at": _utc(row.created_at),
        "active": bool(row.is_active),
        "activated_at": _utc(row.activated_at),
        "coverage": coverage(session, row.id).to_dict(),
        "query_items": {"embedded": int(embedded_queries), "total": int(total_queries)},
        "index": index,
        "embedding": _job_state(row),
        "checkpoint_stored": _has_checkpoint(session, row.id),
        "last_evaluation": row.last_evaluation,
    }


def _saved_index(data_dir: str | Path, version: str) -> dict[str, Any]:
    try:
        manifest = Manifest.read(index_dir(data_dir, version))
    except IndexStale:  # missing or unreadable: not built (a process builds it on demand)
        return {"state": "missing", "size": None, "factory": None}
    return {"state": "built", "size": manifest.count, "factory": manifest.factory}


def _job_state(row: ModelVersion) -> dict[str, Any]:
    state = row.embed_state or "idle"
    if state == STATE_RUNNING and _stale(row.embed_heartbeat_at):
        state = "interrupted"
    return {"state": state, "error": row.embed_error, "updated_at": _utc(row.embed_heartbeat_at)}


def _utc(moment: datetime | None) -> datetime | None:
    """Timezone-aware (SQLite gives stored UTC times back without their zone)."""
    return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None else moment


def _stale(heartbeat: datetime | None) -> bool:
    if heartbeat is None:
        return True
    return utcnow() - _utc(heartbeat) > timedelta(seconds=HEARTBEAT_STALE_S)


def has_checkpoint(version: str, *, session_factory: sessionmaker[Session]) -> bool:
    """Whether a registered version's checkpoint bytes are in the database (False for an
    unknown version)."""
    with session_factory() as session:
        return session.scalar(
            select(ModelCheckpoint.model_version_id)
            .join(ModelVersion, ModelVersion.id == ModelCheckpoint.model_version_id)
            .where(ModelVersion.version == version)) is not None


def _has_checkpoint(session: Session, version_id: int) -> bool:
    return session.scalar(select(ModelCheckpoint.model_version_id)
                          .where(ModelCheckpoint.model_version_id == version_id)) is not None


def _get(session: Session, version: str) -> ModelVersion:
    row = session.scalar(select(ModelVersion).where(ModelVersion.version == version))
    if row is None:
        known = session.scalars(select(ModelVersion.version).order_by(ModelVersion.id)).all()
        raise VersionNotFound(
            f"unknown model version {version!r}; registered: {', '.join(known) or 'none'}"
        )
    return row


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
        session.execute(update(ModelVersion).where(ModelVersion.version == version)
                        .values(last_evaluation=summary))


def evaluate_recorded(searcher: Any, query_set: str, *,
                      session_factory: sessionmaker[Session], **options: Any) -> Evaluation:
    """:func:`index.evaluation.evaluate_query_set` through ``searcher`` (its version's index),
    kept as that version's last evaluation unless re-ranked (:func:`record_evaluation`): what
    ``/evaluate``, ``imgret evaluate`` and the comparisons run. ``options`` as
    ``evaluate_query_set`` (embedder, media, k, rerank, ...)."""
    result = evaluate_query_set(searcher, query_set, session_factory=session_factory, **options)
    record_evaluation(searcher.model_version, result.report, session_factory=session_factory)
    return result


def comparison_report(a: Evaluation, b: Evaluation) -> dict[str, Any]:
    """Two :class:`index.evaluation.Evaluation` of one query set as ``/evaluate`` reports a
    comparison: ``{"a", "b", "difference", "verdict", "b_better", "a_better"}``, per metric
    B − A with its paired 95% interval and verdict (``index.evaluation.compare_versions``)."""
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


# --------------------------------------------------------------------------- re-embedding


@dataclass
class Throttle:
    """Keeps a background job from starving searches.

    Attributes:
        duty: the largest fraction of wall time the job computes (it sleeps the rest).
        busy: says whether searches are waiting; the job waits (up to ``max_wait_s`` per
            chunk) while it does.
    """

    duty: float = DEFAULT_DUTY
    busy: Callable[[], bool] | None = None
    max_wait_s: float = 2.0

    def pause(self, worked_s: float) -> None:
        if 0 < self.duty < 1:
            time.sleep(worked_s * (1 - self.duty) / self.duty)
        if self.busy is not None:
            deadline = time.monotonic() + self.max_wait_s
            while self.busy() and time.monotonic() < deadline:
                time.sleep(0.005)


@dataclass
class EmbedReport:
    """What a re-embedding run did."""

    version: str
    gallery_embedded: int = 0
    queries_embedded: int = 0
    skipped_deleted: int = 0
    failed: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return (self.gallery_embedded + self.queries_embedded) / max(self.seconds, 1e-9)


def claim_job(version: str, *, session_factory: sessionmaker[Session]) -> bool:
    """Mark the version's job running, unless a live job (fresh heartbeat) already runs.

    One conditional UPDATE: of several processes asked at once, one wins.
    """
    stale_before = utcnow() - timedelta(seconds=HEARTBEAT_STALE_S)
    with session_factory.begin() as session:
        row = _get(session, version)
        result = session.execute(
            update(ModelVersion)
            .where(ModelVersion.id == row.id)
            .where(
                (ModelVersion.embed_state.is_(None))
                | (ModelVersion.embed_state != STATE_RUNNING)
                | (ModelVersion.embed_heartbeat_at.is_(None))
                | (ModelVersion.embed_heartbeat_at < stale_before)
            )
            .values(embed_state=STATE_RUNNING, embed_heartbeat_at=utcnow(), embed_error=None)
            # Not evaluated in Python against the loaded row: SQLite gives its heartbeat back
            # without a zone, and comparing it with an aware time raised TypeError.
            .execution_options(synchronize_session=False)
        )
        return result.rowcount == 1


@contextmanager
def _beating(version: str, session_factory: sessionmaker[Session]) -> Iterator[None]:
    """Refresh the job's heartbeat from a thread every third of :data:`HEARTBEAT_STALE_S`
    while the job runs, however long one chunk or its throttle pause takes: the heartbeat
    says the process is alive, not that a chunk just ended, so a live job is never claimed
    by a second process. (A process that dies stops beating; one whose job hangs keeps its
    claim until it is restarted.)"""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_STALE_S / 3):
            try:
                with session_factory.begin() as session:
                    session.execute(
                        update(ModelVersion)
                        .where(ModelVersion.version == version,
                               ModelVersion.embed_state == STATE_RUNNING)
                        .values(embed_heartbeat_at=utcnow()))
            except Exception:  # noqa: BLE001 - a lost connection: the next beat retries
                logger.warning("heartbeat of the re-embedding of %s failed", version,
                               exc_info=True)

    thread = threading.Thread(target=beat, daemon=True, name=f"heartbeat-{version}")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _finish_job(version: str, session_factory: sessionmaker[Session], state: str,
                error: str | None, covered_through: int | None = None) -> None:
    values: dict[str, Any] = dict(embed_state=state, embed_heartbeat_at=utcnow(),
                                  embed_error=error)
    if covered_through is not None:
        values["covered_through"] = covered_through
    with session_factory.begin() as session:
        session.execute(update(ModelVersion).where(ModelVersion.version == version)
                        .values(**values))


def run_embed_job(
    version: str, *, session_factory: sessionmaker[Session], media: MediaBackend,
    embedder: Embedder, throttle: Throttle | None = None, chunk_size: int = EMBED_CHUNK,
    max_pixels: int = DEFAULT_MAX_PIXELS, progress: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None, claimed: bool = False,
) -> EmbedReport:
    """Claimed job around :func:`embed_missing`: state ``done`` or ``failed`` at the end.

    Args:
        claimed: the caller already won :func:`claim_job`.

    Raises:
        GalleryError: a live job of this version runs elsewhere.
    """
    if not claimed and not claim_job(version, session_factory=session_factory):
        raise GalleryError(f"the re-embedding of {version} is already running")
    with session_factory() as session:
        # Every item up to here is covered once the scan ends (items added later may be too,
        # but an activation checks those itself).
        through = session.scalar(select(func.max(GalleryItem.id)))
    try:
        with _beating(version, session_factory):
            report = embed_missing(
                version, session_factory=session_factory, media=media, embedder=embedder,
                throttle=throttle, chunk_size=chunk_size, max_pixels=max_pixels,
                progress=progress, stop=stop, heartbeat=True,
            )
    except BaseException as exc:
        _finish_job(version, session_factory, STATE_FAILED, f"{type(exc).__name__}: {exc}"[:500])
        raise
    error = (f"{len(report.failed)} stored images could not be decoded (ids "
             f"{report.failed[:10]})" if report.failed else None)
    if stop is not None and stop.is_set():
        # Stopped by a shutdown: "running" without a heartbeat reads as interrupted, and the
        # next start of any process (or a POST) resumes it at once.
        with session_factory.begin() as session:
            session.execute(update(ModelVersion).where(ModelVersion.version == version)
                            .values(embed_heartbeat_at=None))
    else:
        _finish_job(version, session_factory, STATE_DONE, error, covered_through=through)
    return report


def embed_missing(
    version: str, *, session_factory: sessionmaker[Session], media: MediaBackend,
    embedder: Embedder, throttle: Throttle | None = None, chunk_size: int = EMBED_CHUNK,
    max_pixels: int = DEFAULT_MAX_PIXELS, progress: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None, heartbeat: bool = False,
    include_queries: bool = True,
) -> EmbedReport:
    """Embed every live gallery item (then every query item) that lacks a vector of
    ``version``, from the stored images, one committed chunk at a time (see the module
    docstring for why this covers concurrent adds and deletes).

    Args:
        progress: called with (embedded so far, live items) after each chunk.
        stop: set it to stop after the current chunk.
        heartbeat: update the job's heartbeat with each chunk.
    """
    if embedder.model_version != version:
        raise GalleryError(f"the embedder is {embedder.model_version}, not {version}")
    report = EmbedReport(version)
    start = time.perf_counter()
    limits = DecodeLimits(image_pixels=max_pixels, request_pixels=2**62)
    failed: set[int] = set()
    for queries in ((False, True) if include_queries else (False,)):
        after = 0
        while stop is None or not stop.is_set():
            with session_factory() as session:
                row = _get(session, version)
                batch = _missing(session, row.id, after, chunk_size, queries=queries)
            if not batch:
                break
            after = batch[-1][0]
            t0 = time.perf_counter()
            ids, vectors, broken = _embed_stored(batch, media, embedder, limits)
            failed.update(broken)
            with session_factory.begin() as session:
                row = _get(session, version)
                if queries:
                    written = _add_query_embeddings(session, row, ids, vectors)
                    report.queries_embedded += written
                else:
                    written = len(store.add_embeddings(ids, vectors, session=session,
                                                       model_version=row))
                    report.gallery_embedded += written
                    report.skipped_deleted += len(ids) - written
                if heartbeat:
                    row.embed_heartbeat_at = utcnow()
                cov = coverage(session, row.id) if progress is not None else None
            if progress is not None and cov is not None:
                progress(cov.embedded, cov.live)
            if throttle is not None:
                throttle.pause(time.perf_counter() - t0)
    report.failed = sorted(failed)
    report.seconds = time.perf_counter() - start
    return report


def _count_missing(session: Session, version_id: int, *, through: int | None) -> int:
    """Live gallery items up to id ``through`` (all, for ``None``) without a vector of the
    version."""
    has = exists().where(and_(Embedding.item_id == GalleryItem.id,
                              Embedding.model_version_id == version_id))
    query = select(func.count()).select_from(GalleryItem).where(
        GalleryItem.deleted_at.is_(None), ~has)
    if through is not None:
        query = query.where(GalleryItem.id <= through)
    return int(session.scalar(query) or 0)


def _missing(session: Session, version_id: int, after: int, limit: int, *,
             queries: bool) -> list[tuple[int, str]]:
    """The next ``limit`` items (id > ``after``, id order) with no vector of the version:
    live gallery items, or query items."""
    if queries:
        item, vec, key, scope = QueryItem, QueryEmbedding, QueryEmbedding.query_item_id, True
    else:
        item, vec, key = GalleryItem, Embedding, Embedding.item_id
        scope = GalleryItem.deleted_at.is_(None)
    has = exists().where(and_(key == item.id, vec.model_version_id == version_id))
    rows = session.execute(
        select(item.id, item.media_path).where(item.id > after, scope, ~has)
        .order_by(item.id).limit(limit)
    )
    return [(int(i), path) for i, path in rows]


def _embed_stored(batch: list[tuple[int, str]], media: MediaBackend, embedder: Embedder,
                  limits: DecodeLimits) -> tuple[list[int], np.ndarray, list[int]]:
    """Vectors of stored images; an unreadable one is left out (its id in the third list)."""
    ids, blobs, broken = [], [], []
    for (item_id, _), data in zip(batch, media.read_many([path for _, path in batch]),
                                  strict=True):
        if data is None:
            # Bytes gone: the item was deleted (its media purged) after the scan read it.
            broken.append(item_id)
        else:
            blobs.append(data)
            ids.append(item_id)
    if not blobs:
        return [], np.zeros((0, embedder.dim), np.float32), broken
    try:
        vectors = embed_encoded(blobs, embedder=embedder, limits=limits,
                                names=[f"item {i}" for i in ids])
        return ids, vectors, broken
    except ImageDecodeError:
        pass
    # One bad image: embed one at a time so the others still get their vectors.
    good, vectors = [], []
    for item_id, data in zip(ids, blobs, strict=True):
        try:
            vectors.append(embed_encoded([data], embedder=embedder, limits=limits,
                                         names=[f"item {item_id}"])[0])
            good.append(item_id)
        except ImageDecodeError as exc:
            logger.warning("cannot re-embed %s", exc)
            broken.append(item_id)
    stacked = np.stack(vectors) if vectors else np.zeros((0, embedder.dim), np.float32)
    return good, stacked, broken


def _add_query_embeddings(session: Session, row: ModelVersion, ids: list[int],
                          vectors: np.ndarray) -> int:
    if not ids:
        return 0
    # An ingest of the same query set may have stored some meanwhile: skip those.
    have = store.ids_with_embedding(ids, session=session, model_version_id=row.id,
                                    query_set=store.ANY_QUERY_SET)
    keep = [j for j, item_id in enumerate(ids) if item_id not in have]
    if keep:
        store.add_embeddings([ids[j] for j in keep], vectors[keep], session=session,
                             model_version=row, query_set=store.ANY_QUERY_SET)
    return len(keep)


# --------------------------------------------------------------------------- switching


@dataclass(frozen=True)
class Activation:
    """A switch that happened (or, with ``changed`` false, was already in force)."""

    active: str
    previous: str | None
    comparison: dict[str, Any] | None
    changed: bool
    stragglers: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"active": self.active, "previous": self.previous,
                "comparison": self.comparison, "changed": self.changed,
                "stragglers_embedded": self.stragglers}


Compare = Callable[[str, str, str], dict[str, Any]]


def activate(
    version: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    media: MediaBackend, embedder: Embedder, require: str | None = None,
    query_set: str | None = None, compare: Compare | None = None,
    prepare_index: Callable[[str], Any] | None = None, reason: str = "activate",
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Activation:
    """Make ``version`` the served one (see the module docstring for the rules).

    Args:
        embedder: the version's model (for the items added since its re-embedding).
        require: ``"better"`` or ``"not_worse"`` (needs ``query_set`` and ``compare``).
        compare: ``compare(active, candidate, query_set)`` -> the paired comparison
            (``index.evaluation.compare_versions`` of both evaluations, with verdicts).
        prepare_index: opens (loads or builds) the version's index before the switch.
        reason: ``"activate"`` or ``"rollback"`` (recorded).

    Raises:
        VersionNotFound: unknown version.
        ActivationRefused: no stored checkpoint, coverage far from complete, or the verdict
            does not satisfy ``require``.
    """
    if require not in (None, "better", "not_worse"):
        raise ActivationRefused(f"require must be better or not_worse, not {require!r}")
    with session_factory() as session:
        row = _get(session, version)
        active = session.scalar(select(ModelVersion).where(ModelVersion.is_active))
        active_name = active.version if active is not None else None
        if not _has_checkpoint(session, row.id):
            raise ActivationRefused(
                f"model version {version} has no stored checkpoint, so other processes could "
                "not load it; register it first (imgret models register / POST /models)"
            )
        cov = coverage(session, row.id)
        old_gaps = _count_missing(session, row.id, through=row.covered_through)
        new_gaps = cov.missing - old_gaps
    if active_name == version:
        return Activation(version, None, None, changed=False)
    if old_gaps or new_gaps > STRAGGLER_LIMIT:
        raise ActivationRefused(
            f"model version {version} covers {cov.embedded} of {cov.live} live items; "
            f"re-embed first (POST /models/{version}/embed or imgret models embed {version})"
        )
    comparison = None
    if require is not None:
        if not query_set or compare is None or active_name is None:
            raise ActivationRefused("require needs query_set (and an active version to beat)")
        comparison = compare(active_name, version, query_set)
        allowed, why = gate(comparison, require)
        if not allowed:
            raise ActivationRefused(f"activation refused (require={require}): {why}",
                                    comparison)
    # Stragglers (items added since the re-embedding), outside any lock first...
    caught_up = embed_missing(version, session_factory=session_factory, media=media,
                              embedder=embedder, max_pixels=max_pixels,
                              include_queries=False).gallery_embedded
    if prepare_index is not None:
        prepare_index(version)
    limits = DecodeLimits(image_pixels=max_pixels, request_pixels=2**62)
    with session_factory.begin() as session:
        # ... then the last ones under the gallery write lock: nothing commits in between.
        store.lock_gallery_writes(session=session)
        row = _get(session, version)
        while batch := _missing(session, row.id, 0, EMBED_CHUNK, queries=False):
            ids, vectors, broken = _embed_stored(batch, media, embedder, limits)
            if broken:
                raise ActivationRefused(
                    f"stored images of items {broken[:10]} cannot be decoded with {version}"
                )
            caught_up += len(store.add_embeddings(ids, vectors, session=session,
                                                  model_version=row))
        previous = session.scalar(select(ModelVersion).where(ModelVersion.is_active))
        newest = session.scalar(select(func.max(GalleryItem.id)))
        if previous is not None:
            # It served until now, so every item so far has its vector (writes check it).
            previous.covered_through = newest
        store.activate_model_version(session=session, version=version)
        row.activated_at = utcnow()
        row.covered_through = newest
        session.add(ModelActivation(
            model_version_id=row.id, previous_version_id=previous.id if previous else None,
            reason=reason, gate=_gate_summary(comparison, require, query_set),
        ))
    logger.info("%s: %s is active (was %s; %d items embedded during the switch)", reason,
                version, active_name, caught_up)
    return Activation(version, active_name, comparison, changed=True, stragglers=caught_up)


def _rollback_target(session: Session) -> int | None:
    """The id of the version the active one replaced (the last switch to it), if any."""
    active = session.scalar(select(ModelVersion.id).where(ModelVersion.is_active))
    if active is None:
        return None
    return session.scalar(
        select(ModelActivation.previous_version_id)
        .where(ModelActivation.model_version_id == active)
        .order_by(ModelActivation.id.desc()).limit(1)
    )


def previous_version(*, session_factory: sessionmaker[Session]) -> str:
    """The version the active one replaced (what a rollback activates).

    Raises:
        ActivationRefused: no switch on record.
    """
    with session_factory() as session:
        target = _rollback_target(session)
        if target is None:
            raise ActivationRefused("no previous version to roll back to: the active version "
                                    "was never switched to from another one")
        return session.get(ModelVersion, target).version


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
        store.lock_gallery_writes(session=session)
        row = _get(session, version)
        if row.is_active:
            raise VersionInUse(f"model version {version} is active; activate another version "
                               "first")
        if row.id == _rollback_target(session):
            raise VersionInUse(f"model version {version} is the rollback target (the version "
                               "the active one replaced); it can be deleted after the next "
                               "switch")
        if row.embed_state == STATE_RUNNING and not _stale(row.embed_heartbeat_at):
            raise VersionInUse(f"model version {version} is being re-embedded; wait for the "
                               "job to end")
        for table, key in ((Embedding, Embedding.model_version_id),
                           (QueryEmbedding, QueryEmbedding.model_version_id),
                           (ModelCheckpoint, ModelCheckpoint.model_version_id),
                           (ModelActivation, ModelActivation.model_version_id)):
            session.execute(delete(table).where(key == row.id))
        session.execute(update(ModelActivation).where(ModelActivation.previous_version_id
                                                      == row.id)
                        .values(previous_version_id=None))
        session.delete(row)
    for folder in (index_dir(data_dir, version), checkpoint_file(data_dir, version).parent):
        shutil.rmtree(folder, ignore_errors=True)
    logger.info("deleted model version %s", version)


def active_version(*, session_factory: sessionmaker[Session]) -> str | None:
    """The name of the active version (``None`` on an empty database)."""
    with session_factory() as session:
        return session.scalar(select(ModelVersion.version).where(ModelVersion.is_active))


def history(*, session_factory: sessionmaker[Session], limit: int = 20) -> list[dict[str, Any]]:
    """The last switches, newest first."""
    with session_factory() as session:
        names = dict(session.execute(select(ModelVersion.id, ModelVersion.version)).all())
        rows = session.scalars(
            select(ModelActivation).order_by(ModelActivation.id.desc()).limit(limit)
        )
        return [{"version": names.get(r.model_version_id),
                 "previous": names.get(r.previous_version_id), "reason": r.reason,
                 "at": _utc(r.created_at), "gate": r.gate} for r in rows]


def _gate_summary(comparison: dict[str, Any] | None, require: str | None,
                  query_set: str | None) -> dict[str, Any] | None:
    if comparison is None:
        return None
    return {"require": require, "query_set": query_set, "verdict": comparison.get("verdict")}


def stale_jobs(*, session_factory: sessionmaker[Session]) -> list[str]:
    """Versions whose job was running when its process died (heartbeat gone stale)."""
    with session_factory() as session:
        rows = session.scalars(select(ModelVersion).where(ModelVersion.embed_state
                                                          == STATE_RUNNING))
        return [row.version for row in rows if _stale(row.embed_heartbeat_at)]

