"""Repository functions over model versions, the one home of their SQL: the version rows (register,
look up, list, activate, which one is active, :func:`check_active` for writers), checkpoint bytes
(``model_checkpoints``), decision thresholds (``model_calibrations``), the activation history
(``model_activations``), the re-embedding job's claim and heartbeat (columns of
``model_versions``), and which items still lack the version's vector.

The gallery's own rows are :mod:`imgret.gallery.storage`'s. As there, every function takes
``session`` keyword-only and never commits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, exists, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from imgret.errors import GalleryError
from imgret.gallery.storage import item_store, vector_store
from imgret.gallery.storage.item_store import logger
from imgret.gallery.storage.scope import ALL_COLLECTIONS
from imgret.gallery.storage.tables import (
    Embedding,
    GalleryChange,
    GalleryItem,
    ModelActivation,
    ModelCalibration,
    ModelCheckpoint,
    ModelVersion,
    QueryEmbedding,
    QueryItem,
    utcnow,
)
from imgret.gallery.versions import version_store

# A running job whose heartbeat is older than this was interrupted (crash, kill).
HEARTBEAT_STALE_S = 30.0

STATE_RUNNING, STATE_DONE, STATE_FAILED = "running", "done", "failed"


class VersionNotFound(GalleryError, LookupError):
    """No model version by that name (404)."""


# --------------------------------------------------------------------------- versions


def find_version(version: str, *, session: Session) -> ModelVersion | None:
    """The version called ``version``, or ``None``."""
    return session.scalar(select(ModelVersion).where(ModelVersion.version == version))


def get_version(version: str, *, session: Session) -> ModelVersion:
    """The version called ``version``.

    Raises:
        VersionNotFound: no such version (the message lists the registered ones).
    """
    row = find_version(version, session=session)
    if row is None:
        known = [r.version for r in version_store.list_model_versions(session=session)]
        raise VersionNotFound(
            f"unknown model version {version!r}; registered: {', '.join(known) or 'none'}"
        )
    return row


def version_names(*, session: Session) -> dict[int, str]:
    """Every version's id -> name."""
    return dict(session.execute(select(ModelVersion.id, ModelVersion.version)).all())


def set_last_evaluation(version: str, summary: Mapping[str, Any], *, session: Session) -> None:
    """Keep ``summary`` as the version's last evaluation."""
    session.execute(update(ModelVersion).where(ModelVersion.version == version)
                    .values(last_evaluation=dict(summary)))


def delete_version(row: ModelVersion, *, session: Session) -> None:
    """Remove a version and everything of it: its gallery and query embeddings, checkpoint
    bytes and the activations that switched to it (those that switched away from it forget
    it). The caller holds the gallery write lock and has checked that it may go."""
    for table, key in ((Embedding, Embedding.model_version_id),
                       (QueryEmbedding, QueryEmbedding.model_version_id),
                       (ModelCheckpoint, ModelCheckpoint.model_version_id),
                       (ModelCalibration, ModelCalibration.model_version_id),
                       (ModelActivation, ModelActivation.model_version_id)):
        session.execute(delete(table).where(key == row.id))
    session.execute(update(ModelActivation).where(ModelActivation.previous_version_id == row.id)
                    .values(previous_version_id=None))
    session.delete(row)


# --------------------------------------------------------------------------- checkpoints


def store_checkpoint(row: ModelVersion, *, session: Session, digest: str, sha256: str,
                     data: bytes) -> str:
    """Bind the version to its weights' ``digest`` and keep ``data`` as its checkpoint unless
    bytes are stored already (the first ones stay).

    Returns:
        The SHA-256 of the stored bytes (``sha256`` when these were stored).
    """
    row.content_digest = digest
    stored = session.scalar(select(ModelCheckpoint.sha256)
                            .where(ModelCheckpoint.model_version_id == row.id))
    if stored is None:
        session.add(ModelCheckpoint(model_version_id=row.id, sha256=sha256, size=len(data),
                                    data=data))
        stored = sha256
    row.checkpoint_sha256 = stored
    return stored


def checkpoint_bytes(version_id: int, *, session: Session) -> bytes | None:
    """The stored checkpoint of a version, ``None`` when it has none."""
    data = session.scalar(select(ModelCheckpoint.data)
                          .where(ModelCheckpoint.model_version_id == version_id))
    return bytes(data) if data is not None else None


def has_checkpoint(version_id: int, *, session: Session) -> bool:
    """Whether the version's checkpoint bytes are stored."""
    return session.scalar(select(ModelCheckpoint.model_version_id)
                          .where(ModelCheckpoint.model_version_id == version_id)) is not None


def versions_without_checkpoint(*, session: Session) -> list[str]:
    """The registered versions whose checkpoint bytes are not stored."""
    has = exists().where(ModelCheckpoint.model_version_id == ModelVersion.id)
    return list(session.scalars(select(ModelVersion.version).where(~has)))


# --------------------------------------------------------------------------- calibrations


def add_calibration(row: ModelVersion, *, session: Session,
                    **values: Any) -> ModelCalibration:
    """Keep a new calibration of the version (the newest is the one served)."""
    calibration = ModelCalibration(model_version_id=row.id, **values)
    session.add(calibration)
    session.flush()
    return calibration


def latest_calibration(version_id: int, *, session: Session) -> ModelCalibration | None:
    """The version's newest calibration, or ``None``."""
    return session.scalar(select(ModelCalibration)
                          .where(ModelCalibration.model_version_id == version_id)
                          .order_by(ModelCalibration.id.desc()).limit(1))


def served_state(*, session: Session) -> tuple[str | None, int | None]:
    """``(active version, id of its newest calibration)``: what a process serves, read in
    one transaction (a follower compares both with what it holds)."""
    active = version_store.active_model_version(session=session)
    if active is None:
        return None, None
    newest = session.scalar(select(func.max(ModelCalibration.id))
                            .where(ModelCalibration.model_version_id == active.id))
    return active.version, newest


def served_states(*, session: Session) -> dict[int, tuple[str, int | None]]:
    """:func:`served_state` of every collection at once: collection id -> (active version,
    id of its newest calibration); one statement (the shared follower asks every interval)."""
    newest = (select(func.max(ModelCalibration.id))
              .where(ModelCalibration.model_version_id == ModelVersion.id)
              .scalar_subquery())
    rows = session.execute(
        select(ModelVersion.collection_id, ModelVersion.version, newest)
        .where(ModelVersion.is_active).execution_options(**{ALL_COLLECTIONS: True}))
    return {int(c): (v, n) for c, v, n in rows}


def newest_change_seq(*, session: Session) -> int:
    """The newest change-log sequence number of any collection (0 for an empty log)."""
    return int(session.scalar(select(func.max(GalleryChange.seq))
                              .execution_options(**{ALL_COLLECTIONS: True})) or 0)


def collections_changed_after(seq: int, *, session: Session) -> tuple[dict[int, int], int]:
    """The collections with change-log rows after ``seq`` (id -> their newest seq), and the
    newest seq of all (``seq`` when none)."""
    rows = session.execute(
        select(GalleryChange.collection_id, func.max(GalleryChange.seq))
        .where(GalleryChange.seq > seq).group_by(GalleryChange.collection_id)
        .execution_options(**{ALL_COLLECTIONS: True})).all()
    changed = {int(c): int(s) for c, s in rows}
    return changed, max(changed.values(), default=seq)


# --------------------------------------------------------------------------- activations


def record_activation(row: ModelVersion, *, session: Session, previous: ModelVersion | None,
                      reason: str, gate: Mapping[str, Any] | None = None) -> None:
    """Note that ``row`` became the active version (replacing ``previous``), and why."""
    row.activated_at = utcnow()
    session.add(ModelActivation(
        collection_id=row.collection_id, model_version_id=row.id,
        previous_version_id=previous.id if previous else None,
        reason=reason, gate=dict(gate) if gate is not None else None,
    ))


def switch_active(row: ModelVersion, *, session: Session, reason: str,
                  gate: Mapping[str, Any] | None = None) -> ModelVersion | None:
    """Make ``row`` the active version and record the switch. Every live item so far has
    both versions' vectors (the caller made sure, under the gallery write lock), so both
    are marked covered through the newest item id.

    Returns:
        The version that was active before.
    """
    previous = version_store.active_model_version(session=session)
    newest = item_store.newest_item_id(session=session)
    if previous is not None:
        previous.covered_through = newest
    version_store.activate_model_version(session=session, version=row.version)
    row.covered_through = newest
    record_activation(row, session=session, previous=previous, reason=reason, gate=gate)
    return previous


def rollback_target(*, session: Session) -> ModelVersion | None:
    """The version the active one replaced (the last switch to it), if any."""
    active = version_store.active_model_version(session=session)
    if active is None:
        return None
    target = session.scalar(
        select(ModelActivation.previous_version_id)
        .where(ModelActivation.model_version_id == active.id)
        .order_by(ModelActivation.id.desc()).limit(1)
    )
    return session.get(ModelVersion, target) if target is not None else None


def last_activations(*, session: Session, limit: int) -> list[ModelActivation]:
    """The last ``limit`` switches, newest first."""
    return list(session.scalars(
        select(ModelActivation).order_by(ModelActivation.id.desc()).limit(limit)))


# --------------------------------------------------------------------------- coverage


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


def coverage(version_id: int, *, session: Session) -> Coverage:
    """How much of the live gallery has a vector of the version (two counts)."""
    return Coverage(vector_store.count_vectors(session=session, model_version_id=version_id),
                    item_store.count_live_items(session=session))


def count_missing(version_id: int, *, session: Session, through: int | None) -> int:
    """Live gallery items up to id ``through`` (all, for ``None``) without a vector of the
    version."""
    has = exists().where(and_(Embedding.item_id == GalleryItem.id,
                              Embedding.model_version_id == version_id))
    query = select(func.count()).select_from(GalleryItem).where(
        GalleryItem.deleted_at.is_(None), ~has)
    if through is not None:
        query = query.where(GalleryItem.id <= through)
    return int(session.scalar(query) or 0)


def missing_items(version_id: int, *, session: Session, after: int, limit: int,
                  queries: bool) -> list[tuple[int, str]]:
    """The next ``limit`` items (id > ``after``, id order) with no vector of the version, as
    ``(id, media_path)``: live gallery items, or query items."""
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


def query_coverage(version_id: int, *, session: Session) -> tuple[int, int]:
    """``(embedded, total)``: query items with a vector of the version, and all of them."""
    total = session.scalar(select(func.count()).select_from(QueryItem)) or 0
    # Joined to the (scoped) query items: a vector counts only for this collection's items.
    embedded = session.scalar(
        select(func.count()).select_from(QueryEmbedding)
        .join(QueryItem, QueryItem.id == QueryEmbedding.query_item_id)
        .where(QueryEmbedding.model_version_id == version_id)
    ) or 0
    return int(embedded), int(total)


# --------------------------------------------------------------------------- job claims


def as_utc(moment: datetime | None) -> datetime | None:
    """Timezone-aware (SQLite gives stored UTC times back without their zone)."""
    return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None else moment


def is_stale(heartbeat: datetime | None) -> bool:
    """Whether a job with this heartbeat is no longer alive (never beat, or too long ago)."""
    if heartbeat is None:
        return True
    return utcnow() - as_utc(heartbeat) > timedelta(seconds=HEARTBEAT_STALE_S)


def job_is_live(row: ModelVersion) -> bool:
    """Whether the version's re-embedding job runs now (running, with a fresh heartbeat)."""
    return row.embed_state == STATE_RUNNING and not is_stale(row.embed_heartbeat_at)


def claim_job(row: ModelVersion, *, session: Session) -> bool:
    """Mark the version's job running, unless a live job (fresh heartbeat) already runs.

    One conditional UPDATE: of several processes asked at once, one wins.
    """
    stale_before = utcnow() - timedelta(seconds=HEARTBEAT_STALE_S)
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


def beat(version: str, *, session: Session) -> None:
    """Refresh the heartbeat of the version's job, if it is running."""
    session.execute(
        update(ModelVersion)
        .where(ModelVersion.version == version, ModelVersion.embed_state == STATE_RUNNING)
        .values(embed_heartbeat_at=utcnow()))


def finish_job(version: str, *, session: Session, state: str, error: str | None,
               covered_through: int | None = None) -> None:
    """End the version's job in ``state`` (``done`` or ``failed``) with ``error``; a finished
    scan also records the newest item id it covered."""
    values: dict[str, Any] = dict(embed_state=state, embed_heartbeat_at=utcnow(),
                                  embed_error=error)
    if covered_through is not None:
        values["covered_through"] = covered_through
    session.execute(update(ModelVersion).where(ModelVersion.version == version)
                    .values(**values))


def release_job(version: str, *, session: Session) -> None:
    """Leave the job ``running`` without a heartbeat: it reads as interrupted, and the next
    start of any process (or a request) resumes it at once."""
    session.execute(update(ModelVersion).where(ModelVersion.version == version)
                    .values(embed_heartbeat_at=None))


def running_jobs(*, session: Session) -> list[ModelVersion]:
    """The versions whose job is marked running (live or interrupted)."""
    return list(session.scalars(select(ModelVersion)
                                .where(ModelVersion.embed_state == STATE_RUNNING)))


def register_model_version(
    *, session: Session, version: str, dim: int, config: Mapping[str, Any] | None = None
) -> ModelVersion:
    """Get or create a model version; the first one registered becomes the active one.

    Safe against concurrent registration (several API processes starting together): the
    insert runs in a savepoint and a unique-key conflict reads the winner's row instead.
    """
    row = session.scalar(select(ModelVersion).where(ModelVersion.version == version))
    if row is None:
        has_active = active_model_version(session=session) is not None
        # Try as the active version if there is none yet, else (or on a lost race) inactive.
        for is_active in (True, False) if not has_active else (False,):
            try:
                with session.begin_nested():
                    row = ModelVersion(
                        version=version, dim=dim, config=dict(config or {}), is_active=is_active
                    )
                    session.add(row)
                    session.flush()
                logger.info("registered model version %s (dim %d, active: %s)", version, dim,
                            is_active)
                break
            except IntegrityError:
                # Another process registered this version, or another one as active.
                row = session.scalar(select(ModelVersion).where(ModelVersion.version == version))
                if row is not None:
                    break
    if row is None:
        raise GalleryError(f"could not register model version {version}")
    if row.dim != dim:
        raise GalleryError(f"model version {version} is registered with dim {row.dim}, not {dim}")
    return row


def get_model_version(*, session: Session, version: str | None = None) -> ModelVersion:
    """A model version by name, or the active one when ``version`` is ``None``.

    Raises:
        GalleryError: no such version, or no active version (nothing ingested yet).
    """
    if version is None:
        row = active_model_version(session=session)
        if row is None:
            raise GalleryError(
                "no active model version: the gallery is empty; run "
                "`imgret ingest PATH --model CKPT` first"
            )
        return row
    row = session.scalar(select(ModelVersion).where(ModelVersion.version == version))
    if row is None:
        known = session.scalars(select(ModelVersion.version)).all()
        raise GalleryError(
            f"unknown model version {version!r}; known: {', '.join(known) or 'none'}"
        )
    return row


def active_model_version(*, session: Session) -> ModelVersion | None:
    """The active model version (the one searches and writes use), ``None`` before any."""
    return session.scalar(select(ModelVersion).where(ModelVersion.is_active))


def activate_model_version(*, session: Session, version: str) -> ModelVersion:
    """Make ``version`` the active one (blue/green switch): one UPDATE pair, one transaction."""
    row = get_model_version(session=session, version=version)
    session.execute(update(ModelVersion).where(ModelVersion.is_active).values(is_active=False))
    session.flush()
    row.is_active = True
    session.flush()
    return row


class ModelSwitched(GalleryError):
    """The served model version changed while a write was being embedded (retry with the
    new one). Attributes: ``active``: the version now active."""

    def __init__(self, written: str, active: str | None):
        self.active = active
        super().__init__(f"the served model version changed from {written} to {active} while "
                         "this upload was embedded; send it again")


def check_active(*, session: Session, version: ModelVersion) -> None:
    """Refuse a gallery write embedded with a version that is no longer the active one.

    Call it under :func:`lock_gallery_writes`: an activation flips the flag under the same
    lock, so a write that passes this check commits before the switch (and the switch embeds
    it for the new version) or not at all.

    Raises:
        ModelSwitched: another version is active.
    """
    active = active_model_version(session=session)
    if active is not None and active.id != version.id:
        raise ModelSwitched(version.version, active.version)


def list_model_versions(*, session: Session) -> list[ModelVersion]:
    return list(session.scalars(select(ModelVersion).order_by(ModelVersion.id)))
