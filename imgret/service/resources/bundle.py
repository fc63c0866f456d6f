"""What the app loads once per process and collection (model, index, database, batcher), as one
typed bundle, and the follower's state that ``/health`` reports."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from imgret.embedder import Embedder
from imgret.gallery.evaluation import calibration as calibrations
from imgret.gallery.media.files import MediaBackend
from imgret.gallery.search import Searcher
from imgret.gallery.storage.tables import DEFAULT_COLLECTION, DEFAULT_COLLECTION_ID
from imgret.gallery.versions import intake, lifecycle
from imgret.process import in_own_thread
from imgret.service.batching import DynamicBatcher
from imgret.service.pipeline import Answer, ImageQuery, Serving
from imgret.service.resources.embed_jobs import EmbedJobs
from imgret.service.telemetry import ServiceMetrics
from imgret.service.version_cache import VersionCache
from imgret.settings import Settings

logger = logging.getLogger(__name__)


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
        position: the change-log position last written to ``serving_positions``, and when
            (``time.monotonic()``), or ``None``.
    """

    last_ok_at: float = field(default_factory=time.time)
    failures: int = 0
    last_error: str | None = None
    position: tuple[int, float] | None = None

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
        media: the image store of ``IMGRET_MEDIA_BACKEND`` (files under the data dir, or
            the database).
        serving: the served version (model + index, swapped together by :meth:`serve`).
        batcher: the dynamic batcher in front of :class:`SearchPipeline`.
        metrics: the app's Prometheus metrics.
        embedders, searchers: the versions' models and indexes this process has open (the
            served one included), for ``/evaluate``, comparisons and switches; given as
            dicts, kept as views of :attr:`loaded`.
        loaded: the open models and indexes: the served version's always, the others' in
            an LRU bounded by ``IMGRET_MAX_LOADED_VERSIONS`` and ``IMGRET_MAX_LOADED_BYTES``
            (:mod:`imgret.service.version_cache`).
    """

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    media: MediaBackend
    serving: Serving
    batcher: DynamicBatcher[ImageQuery, Answer]
    metrics: ServiceMetrics
    embedders: MutableMapping[str, Embedder] = field(default_factory=dict)
    searchers: MutableMapping[str, Searcher] = field(default_factory=dict)
    follower: FollowerState = field(default_factory=FollowerState)
    jobs: EmbedJobs | None = None
    # The collection these are of (:mod:`imgret.service.collection_registry` keeps the others').
    collection_id: int = DEFAULT_COLLECTION_ID
    collection: str = DEFAULT_COLLECTION
    loaded: VersionCache = field(init=False)
    _open_lock: threading.RLock = field(default_factory=threading.RLock)
    _switch_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.loaded = VersionCache(
            served=lambda: self.serving.version,
            max_versions=self.settings.max_loaded_versions,
            max_bytes=self.settings.max_loaded_bytes,
            # The gauges describe the default collection's versions (one set per process).
            registry=(self.metrics.registry if self.collection_id == DEFAULT_COLLECTION_ID
                      else None),
        )
        given = (self.embedders, self.searchers)
        self.embedders = self.loaded.view("embedder")
        self.searchers = self.loaded.view("searcher")
        self.embedders.update(given[0])
        self.searchers.update(given[1])
        self.embedders[self.serving.version] = self.serving.embedder
        self.searchers[self.serving.version] = self.serving.searcher

    @property
    def embedder(self) -> Embedder:
        """The served model (read :attr:`serving` once where the index is needed too)."""
        return self.serving.embedder

    @property
    def searcher(self) -> Searcher:
        """The served index (read :attr:`serving` once where the model is needed too)."""
        return self.serving.searcher

    def search_busy(self) -> bool:
        """Searches are queued or being processed (a background job yields to them)."""
        pipeline = self.batcher.process
        return self.batcher.waiting > 0 or getattr(pipeline, "running", 0) > 0

    def embedder_for(self, version: str) -> Embedder:
        """A version's model: loaded from its stored checkpoint when not open (another
        version's may be dropped meanwhile, see :attr:`loaded`)."""
        with self._open_lock:
            embedder = self.embedders.get(version)
            if embedder is None:
                # Loaded on a thread that ends with it (imgret.process.in_own_thread).
                embedder = in_own_thread(
                    intake.load_embedder, version, session_factory=self.sessions,
                    data_dir=self.settings.data_dir, device=self.settings.device,
                    runtime=self.settings.runtime,
                )
                self.embedders[version] = embedder
            return embedder

    def searcher_for(self, version: str) -> Searcher:
        """A version's index, opened when not open (loaded or rebuilt from SQL), then caught
        up with the change log on every call (only the served one is followed continuously).

        Raises:
            GalleryError: a version that was never registered.
        """
        with self._open_lock:
            searcher = self.searchers.get(version)
            if searcher is None:
                searcher = Searcher.from_settings(self.sessions, self.settings, version)
                self.searchers[version] = searcher
        if searcher is not self.serving.searcher:
            searcher.refresh_from_changes()
        return searcher

    def serve(self, version: str) -> Serving:
        """Switch this process to ``version``: load its model, index and calibration first,
        then replace :attr:`serving` in one assignment (a batch in flight finishes with the
        old ones). The version served before becomes one of the bounded others in
        :attr:`loaded`. Serving the same version again takes up its newest calibration."""
        with self._switch_lock:
            calibration = calibrations.current(version, session_factory=self.sessions)
            if self.serving.version == version:
                if _calibration_id(self.serving.calibration) != _calibration_id(calibration):
                    self.serving = dataclasses.replace(self.serving, calibration=calibration)
                    logger.info("model version %s now decides at threshold %s", version,
                                calibration.threshold if calibration else None)
            else:
                embedder = self.embedder_for(version)
                searcher = self.searcher_for(version)
                self.serving = Serving(version, embedder, searcher, calibration)
                # Kept (again, should the bounds have dropped them while loading) as the
                # served pair; the old one may be dropped now.
                self.embedders[version] = embedder
                self.searchers[version] = searcher
                logger.info("now serving model version %s (%d vectors)", version,
                            searcher.size)
            return self.serving

    def follow_active(self) -> bool:
        """Serve the database's active version if another process switched it, and its
        newest calibration if one was made since.

        Returns:
            Whether this process switched (version or threshold).
        """
        active, calibration_id = lifecycle.served_state(session_factory=self.sessions)
        serving = self.serving
        if active is None or (active == serving.version
                              and calibration_id == _calibration_id(serving.calibration)):
            return False
        self.serve(active)
        return True

    def forget(self, version: str) -> None:
        """Drop this process's model and index of a deleted version: the same weights
        registered again start with no vectors and must not be answered from the old index."""
        with self._open_lock:
            self.loaded.discard("embedder", version)
            self.loaded.discard("searcher", version)

    def index_sizes(self) -> dict[str, tuple[int, str]]:
        """Size and factory of every index this process has open (for ``GET /models``)."""
        return {v: (s.size, s.factory)
                for v, s in self.loaded.loaded("searcher").items()}  # type: ignore[union-attr]

    def close(self) -> None:
        """Stop background jobs and release the database (the indexes live in memory)."""
        if self.jobs is not None:
            self.jobs.stop()
        self.engine.dispose()


def _calibration_id(calibration: calibrations.Calibration | None) -> int | None:
    return calibration.id if calibration is not None else None
