"""What the app loads once per process (model, index, database, batcher), as one typed bundle."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import anyio.to_thread
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from imgret.embedder import Embedder
from imgret.errors import CheckpointError
from imgret.settings import Settings
from index import store
from index.db import make_engine, make_sessionmaker, upgrade_to_head
from index.media import MediaStore
from index.search import Hit, Searcher
from service.batching import DynamicBatcher
from service.pipeline import ImageQuery, SearchPipeline
from service.telemetry import ServiceMetrics

logger = logging.getLogger(__name__)

# How often a process looks for gallery writes made by other processes on the same database.
CHANGE_POLL_INTERVAL_S = 1.0


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
    searcher = Searcher.from_settings(sessions, settings, embedder.model_version)
    logger.info("index of %s ready: %d vectors", searcher.model_version, searcher.size)
    metrics.track_index_size(lambda: searcher.size)
    pipeline = SearchPipeline(
        embedder, searcher, max_pixels=settings.max_image_pixels, metrics=metrics
    )
    batcher: DynamicBatcher[ImageQuery, list[Hit]] = DynamicBatcher(
        pipeline,
        max_size=settings.batch_max_size,
        max_wait_s=settings.batch_max_wait_ms / 1000.0,
        on_batch=metrics.batch_size.observe,
    )
    return Resources(
        settings=settings,
        engine=engine,
        sessions=sessions,
        media=MediaStore.in_data_dir(settings.data_dir),
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
    tick (a database restart must not stop the follower for good).
    """
    while True:
        await asyncio.sleep(interval_s)
        try:
            applied = await anyio.to_thread.run_sync(resources.searcher.refresh_from_changes)
        except Exception:  # noqa: BLE001 - keep following; the next tick retries
            logger.exception("could not apply gallery changes; retrying")
            continue
        if applied:
            # Includes this process's own writes, which are already in the index (no-ops).
            logger.debug("replayed %d gallery change-log rows", applied)
