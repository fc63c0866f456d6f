"""What the app loads once per process (model, index, database, batcher), as one typed bundle."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import anyio.to_thread
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from imgret.embedder import Embedder
from imgret.errors import CheckpointError
from imgret.files import remove_stale_temps
from imgret.settings import Settings
from index import store
from index.db import make_engine, make_sessionmaker, upgrade_to_head
from index.gc import sweep_media
from index.media import MediaStore
from index.search import Hit, Searcher
from service.batching import DynamicBatcher
from service.pipeline import ImageQuery, build_search_batcher
from service.telemetry import ServiceMetrics

logger = logging.getLogger(__name__)

# How often a process looks for gallery writes made by other processes on the same database.
CHANGE_POLL_INTERVAL_S = 1.0
# /health says "degraded" when the follower has not caught up for this long (other
# processes' adds are then not searchable here; deletes still are honoured: every search
# reads them first).
FOLLOWER_STALE_AFTER_S = 10.0


@dataclass
class FollowerState:
    """How far this process's index follows the gallery change log (for /health, /metrics).

    Attributes:
        last_ok_at: ``time.time()`` of the last successful catch-up.
        failures: consecutive failed polls.
        last_error: the last failure, as a short message.
    """

    last_ok_at: float = field(default_factory=time.time)
    failures: int = 0
    last_error: str | None = None

    def lag_seconds(self, now: float | None = None) -> float:
        """Seconds since the index last caught up with the database."""
        return max(0.0, (now or time.time()) - self.last_ok_at)

    def stale(self, now: float | None = None) -> bool:
        return self.lag_seconds(now) > FOLLOWER_STALE_AFTER_S


@dataclass
class Resources:
    """The loaded resources of one app (clip-retrieval's ``ClipResource`` idea).

    Attributes:
        settings: the settings the app was built with.
        engine, sessions: the database (one session per request, from ``sessions``).
        media: the image store under the data dir.
        embedder: the one embedding path (``IMGRET_MODEL``).
        searcher: the index of the embedder's model version.
        batcher: the dynamic batcher in front of :class:`SearchPipeline`.
        metrics: the app's Prometheus metrics.
        extra_searchers: indexes of other model versions opened by ``/evaluate``.
    """

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    media: MediaStore
    embedder: Embedder
    searcher: Searcher
    batcher: DynamicBatcher[ImageQuery, list[Hit]]
    metrics: ServiceMetrics
    extra_searchers: dict[str, Searcher] = field(default_factory=dict)
    follower: FollowerState = field(default_factory=FollowerState)

    def close(self) -> None:
        """Release the database connections (the index lives in memory only)."""
        self.engine.dispose()


def load_resources(settings: Settings, metrics: ServiceMetrics) -> Resources:
    """Upgrade the schema, load the model, open the database and load or rebuild the index.

    Runs in a worker thread during the lifespan start-up.

    Raises:
        CheckpointError: no ``IMGRET_MODEL`` or an unusable checkpoint.
        DatabaseError: the database is unreachable or cannot be migrated.
    """
    if settings.model is None:
        raise CheckpointError(
            "no model: set IMGRET_MODEL to a run directory from `imgret train` or its model.pt"
        )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    # `imgret serve` already did this before starting workers; here it makes a bare
    # `uvicorn --factory` (or a test) work on a fresh database too. It is a no-op at head and
    # serialised by an advisory lock on PostgreSQL.
    upgrade_to_head(settings.db_url)
    embedder = Embedder.from_checkpoint(settings.model, device=settings.device)
    logger.info("model %s loaded on %s", embedder.model_version, embedder.device)
    engine = make_engine(settings.db_url)
    sessions = make_sessionmaker(engine)
    with sessions.begin() as session:
        # A fresh database starts with an empty gallery served by this model: register it
        # (the first version registered becomes the active one).
        store.register_model_version(
            session=session, version=embedder.model_version, dim=embedder.dim,
            config=embedder.spec.to_dict(),
        )
    media = MediaStore.in_data_dir(settings.data_dir)
    # Finish what a crash interrupted: bytes of deleted items, files of uploads that never
    # committed, temporary files.
    sweep_media(session_factory=sessions, media=media)
    remove_stale_temps(settings.data_dir / "indexes")
    searcher = Searcher.from_settings(sessions, settings, embedder.model_version)
    logger.info("index of %s ready: %d vectors", searcher.model_version, searcher.size)
    metrics.track_index_size(lambda: searcher.size)
    batcher = build_search_batcher(settings, embedder=embedder, searcher=searcher,
                                   metrics=metrics)
    return Resources(
        settings=settings,
        engine=engine,
        sessions=sessions,
        media=media,
        embedder=embedder,
        searcher=searcher,
        batcher=batcher,
        metrics=metrics,
    )


async def follow_changes(
    resources: Resources, interval_s: float = CHANGE_POLL_INTERVAL_S
) -> None:
    """Apply other processes' gallery writes to this process's index, every ``interval_s``.

    API replicas share the database, the source of truth; each keeps its own in-memory
    index and replays the gallery change log. Errors are logged and retried at the next
    tick (a database restart must not stop the follower for good); ``resources.follower``
    keeps the lag, which /health and /metrics report.
    """
    state = resources.follower
    resources.metrics.track_follower(
        lambda: state.lag_seconds(), lambda: resources.searcher.change_seq
    )
    while True:
        await asyncio.sleep(interval_s)
        try:
            applied = await anyio.to_thread.run_sync(resources.searcher.refresh_from_changes)
        except Exception as exc:  # noqa: BLE001 - keep following; the next tick retries
            state.failures += 1
            state.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
            resources.metrics.follower_failures.inc()
            log = logger.exception if state.failures in (1, 10) else logger.debug
            log("could not apply gallery changes (%d in a row); retrying", state.failures)
            continue
        state.last_ok_at, state.failures, state.last_error = time.time(), 0, None
        if applied:
            # Includes this process's own writes, which are already in the index (no-ops).
            logger.debug("replayed %d gallery change-log rows", applied)
