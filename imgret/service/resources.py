"""What the app loads once per process (model, index, database, batcher), as one typed bundle."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field

import anyio.to_thread
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from imgret.embedder import Embedder
from imgret.errors import CheckpointError, GalleryError
from imgret.files import remove_stale_temps
from imgret.gallery.evaluation import calibration as calibrations
from imgret.gallery.media.blobs import open_media_store
from imgret.gallery.media.files import MediaBackend
from imgret.gallery.media.gc import sweep_media
from imgret.gallery.search import Searcher
from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head
from imgret.gallery.storage.notify import listen_for_changes
from imgret.gallery.storage.tables import DEFAULT_COLLECTION, DEFAULT_COLLECTION_ID
from imgret.gallery.versions import lifecycle as versions
from imgret.gallery.versions import reembed
from imgret.process import in_own_thread
from imgret.service.batching import DynamicBatcher
from imgret.service.pipeline import Answer, ImageQuery, Serving, build_search_batcher
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
                    versions.load_embedder, version, session_factory=self.sessions,
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
        active, calibration_id = versions.served_state(session_factory=self.sessions)
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


class EmbedJobs:
    """This process's background re-embedding threads (one per version at most).

    The state that other processes see lives in SQL
    (:func:`imgret.gallery.versions.reembed.claim_job`); a job stopped by a shutdown is left
    "running" with an old heartbeat, which any process's next start or ``POST /models/{v}/embed``
    resumes.
    """

    def __init__(self, resources: Resources):
        self.resources = resources
        self._threads: dict[str, threading.Thread] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def start(self, version: str) -> bool:
        """Start re-embedding ``version`` here unless it runs (here or elsewhere).

        Returns:
            Whether this call started it.

        Raises:
            VersionNotFound, GalleryError: unknown version, or no stored checkpoint.
        """
        resources = self.resources
        resources.embedder_for(version)  # refuse a version that cannot be loaded, now
        with self._lock:
            running = self._threads.get(version)
            if running is not None and running.is_alive():
                return False
            if not reembed.claim_job(version, session_factory=resources.sessions):
                return False
            thread = threading.Thread(target=self._run, args=(version,), daemon=True,
                                      name=f"embed-{version}")
            self._threads[version] = thread
            thread.start()
            return True

    def _run(self, version: str) -> None:
        resources = self.resources
        throttle = reembed.Throttle(duty=resources.settings.embed_duty,
                                    busy=resources.search_busy)
        try:
            report = reembed.run_embed_job(
                version, session_factory=resources.sessions, media=resources.media,
                embedder=resources.embedder_for(version), throttle=throttle,
                max_pixels=resources.settings.max_image_pixels, stop=self._stop, claimed=True,
            )
            if self._stop.is_set():
                return
            # Build (or catch up) and save the version's index, so activation is quick and
            # GET /models shows it built.
            resources.searcher_for(version).save()
            logger.info("re-embedded %d gallery and %d query items for %s in %.1f s "
                        "(%.1f/s)", report.gallery_embedded, report.queries_embedded, version,
                        report.seconds, report.rate)
        except Exception:  # noqa: BLE001 - recorded as "failed" in SQL by run_embed_job
            logger.exception("re-embedding %s failed", version)

    def running(self, version: str) -> bool:
        thread = self._threads.get(version)
        return thread is not None and thread.is_alive()

    def wait(self, version: str, timeout: float | None = None) -> None:
        thread = self._threads.get(version)
        if thread is not None:
            thread.join(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        for thread in list(self._threads.values()):
            thread.join(timeout)


def _register_configured(settings: Settings, sessions: sessionmaker[Session]) -> str:
    """Start-up work on the model versions; returns the version of ``IMGRET_MODEL``.

    Checkpoint files of older releases go into the database (for every version lacking its
    bytes there), temporary uploads of killed processes are removed, and ``IMGRET_MODEL`` is
    registered: on a fresh database the first version registered becomes the active one,
    with its history row. Nothing here changes an active version.
    """
    assert settings.model is not None
    versions.import_checkpoint_files(session_factory=sessions, data_dir=settings.data_dir,
                                     max_bytes=settings.max_checkpoint_bytes)
    versions.sweep_incoming(settings.data_dir)
    return versions.register_checkpoint(
        settings.model, session_factory=sessions, data_dir=settings.data_dir,
        max_bytes=settings.max_checkpoint_bytes)["version"]


def _cannot_serve(active: str, why: Exception | str) -> str:
    return (f"cannot serve the active model version {active}: {why}; no process changes the "
            "active version at start-up (activate one with `imgret models activate`)")


def check_active_servable(settings: Settings) -> None:
    """What ``imgret serve`` checks before starting uvicorn: after the start-up work of
    :func:`load_resources`, the active version's checkpoint is in the database. A refusal
    is then one line from the CLI rather than a failed start-up in every worker.

    Raises:
        CheckpointError: the active version cannot be loaded (or ``IMGRET_MODEL`` is
            unusable).
    """
    engine = make_engine(settings.db_url)
    try:
        sessions = make_sessionmaker(engine)
        configured = _register_configured(settings, sessions)
        active = versions.active_version(session_factory=sessions) or configured
        if not versions.has_checkpoint(active, session_factory=sessions):
            raise CheckpointError(_cannot_serve(active, "its checkpoint is not stored in the "
                                                        "database; register it again"))
    finally:
        engine.dispose()


def load_resources(settings: Settings, metrics: ServiceMetrics) -> Resources:
    """Upgrade the schema, register the model, open the database and load or rebuild the
    index of the active version.

    Runs in a worker thread during the lifespan start-up. ``IMGRET_MODEL`` is registered (its
    checkpoint stored in the database); on a fresh database it becomes the active version.
    The version served is the database's active one, loaded from the database, so a switch
    made through ``/models`` survives restarts and every process agrees. A start-up never
    changes the active version: a process that cannot load it refuses to start, with one
    line saying why (see the README's "Model versions").

    Raises:
        CheckpointError: no ``IMGRET_MODEL``, an unusable checkpoint, or an active version
            this process cannot load.
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
    engine = make_engine(settings.db_url)
    sessions = make_sessionmaker(engine)
    # Checkpoint files of older releases: into the database, for every version lacking its
    # bytes there; temporary uploads of killed processes: removed.
    configured = _register_configured(settings, sessions)
    active = versions.active_version(session_factory=sessions) or configured
    try:
        embedder = versions.load_embedder(active, session_factory=sessions,
                                          data_dir=settings.data_dir, device=settings.device,
                                          runtime=settings.runtime)
    except (GalleryError, CheckpointError) as exc:
        message = _cannot_serve(active, exc)
        logger.error("%s", message)
        engine.dispose()
        raise CheckpointError(message) from None
    if active != configured:
        logger.info("IMGRET_MODEL %s is registered; serving the active version %s",
                    configured, active)
    logger.info("model %s loaded on %s (%s)", embedder.model_version, embedder.device,
                embedder.runtime)
    media = open_media_store(settings, sessions)
    # Finish what a crash interrupted: bytes of deleted items, files of uploads that never
    # committed, temporary files.
    sweep_media(session_factory=sessions, media=media)
    remove_stale_temps(settings.data_dir / "indexes")
    resources = _assemble(settings, engine, sessions, media, metrics, active, embedder)
    metrics.track_index_size(lambda: resources.searcher.size)
    return resources


def _assemble(settings: Settings, engine: Engine, sessions: sessionmaker[Session],
              media: MediaBackend, metrics: ServiceMetrics, active: str, embedder: Embedder,
              collection_id: int = DEFAULT_COLLECTION_ID,
              collection: str = DEFAULT_COLLECTION) -> Resources:
    """A collection's resources around its served model: its index (loaded or rebuilt),
    batcher and re-embedding jobs."""
    searcher = Searcher.from_settings(sessions, settings, active)
    logger.info("index of %s in collection %s ready: %d vectors", active, collection,
                searcher.size)
    holder: list[Resources] = []
    batcher = build_search_batcher(settings, serving=lambda: holder[0].serving,
                                   metrics=metrics)
    resources = Resources(
        settings=settings,
        engine=engine,
        sessions=sessions,
        media=media,
        serving=Serving(active, embedder, searcher,
                        calibrations.current(active, session_factory=sessions)),
        batcher=batcher,
        metrics=metrics,
        embedders={active: embedder},
        searchers={active: searcher},
        collection_id=collection_id,
        collection=collection,
    )
    holder.append(resources)
    resources.jobs = EmbedJobs(resources)
    return resources


def load_collection(base: Resources, collection_id: int, name: str,
                    shared: Callable[[str], Embedder | None]) -> Resources:
    """Open another collection beside the default one: the same engine, media store and
    metrics, sessions scoped to it, its own served version, index, batcher and jobs.

    Args:
        base: the default collection's resources (loaded at start-up).
        collection_id, name: the collection.
        shared: an already-open model of a version name, or ``None`` (the same checkpoint
            bound to several collections is one model in memory).

    Raises:
        CheckpointError: the collection's active version cannot be loaded.
    """
    sessions = make_sessionmaker(base.engine, collection_id)
    active = versions.active_version(session_factory=sessions)
    if active is None:
        raise CheckpointError(f"collection {name} has no active model version")
    embedder = shared(active)
    if embedder is None:
        embedder = versions.load_embedder(
            active, session_factory=sessions, data_dir=base.settings.data_dir,
            device=base.settings.device, runtime=base.settings.runtime)
    return _assemble(base.settings, base.engine, sessions, base.media, base.metrics, active,
                     embedder, collection_id, name)


def resume_interrupted_jobs(resources: Resources) -> list[str]:
    """Start the re-embedding jobs whose process died (stale heartbeat) again, here."""
    started = []
    for version in reembed.stale_jobs(session_factory=resources.sessions):
        try:
            if resources.jobs is not None and resources.jobs.start(version):
                started.append(version)
                logger.info("resuming the interrupted re-embedding of %s", version)
        except Exception:  # noqa: BLE001 - a version that cannot be loaded stays interrupted
            logger.exception("cannot resume the re-embedding of %s", version)
    return started


async def follow_changes(resources: Resources, interval_s: float | None = None) -> None:
    """Apply other processes' gallery writes to this process's index as they commit.

    API replicas share the database, the source of truth; each keeps its own in-memory
    index and replays the gallery change log, and serves the version the database says is
    active (a switch made by another process is followed the same way). On PostgreSQL a
    LISTEN (:mod:`imgret.gallery.storage.notify`, ``IMGRET_CHANGE_NOTIFY``) wakes this loop as
    soon as any process commits a write or a switch; every ``interval_s``
    (``IMGRET_FOLLOW_INTERVAL_S``) it looks anyway, the fallback for SQLite and for a listening
    connection that dropped.
    Errors are logged and retried at the next wake-up (a database restart must not stop the
    follower for good); ``resources.follower`` keeps the lag, which /health and /metrics
    report.
    """
    interval_s = resources.settings.follow_interval_s if interval_s is None else interval_s
    state = resources.follower
    default = resources.collection_id == DEFAULT_COLLECTION_ID
    if default:
        resources.metrics.track_follower(
            lambda: state.lag_seconds(), lambda: resources.searcher.change_seq
        )
        resources.metrics.publish_gauges()

    catch_up = catch_up_with(resources)
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()

    def notified(_table: str) -> None:  # on the listener's thread
        loop.call_soon_threadsafe(wake.set)

    # One listening connection per process: the other collections' followers poll (a
    # hundred open collections must not hold a hundred connections).
    listener = (
        listen_for_changes(resources.engine, notified)
        if resources.settings.change_notify and default else None
    )
    try:
        while True:
            await sleep_until_woken(wake, interval_s)
            # Cleared before catching up: a write committed during the catch-up wakes the
            # next round instead of being lost.
            wake.clear()
            await _catch_up_once(resources, catch_up)
            # With several workers, what the other workers' scrapes report of this one.
            resources.metrics.publish_gauges()
    finally:
        if listener is not None:
            await anyio.to_thread.run_sync(listener.stop)


def catch_up_with(resources: Resources) -> Callable[[], int]:
    """One catch-up of ``resources`` with the database (run on a worker thread): a switch
    made by another process first (loads that version's model and index), then the served
    index's changes, even when the switch failed (a missing checkpoint): the failure is
    reported, and /health turns degraded if it lasts. Returns the change rows applied."""

    def catch_up() -> int:
        try:
            resources.follow_active()
        except Exception:
            resources.searcher.refresh_from_changes()
            raise
        return resources.searcher.refresh_from_changes()

    return catch_up


async def catch_up_once(resources: Resources) -> None:
    """:func:`catch_up_with` once, on a worker thread; a failure is counted and logged."""
    await _catch_up_once(resources, catch_up_with(resources))


async def sleep_until_woken(wake: asyncio.Event, timeout_s: float) -> None:
    """Return when ``wake`` is set or after ``timeout_s``, whichever comes first.

    A cancellation always propagates. ``asyncio.wait_for`` does not guarantee that on Python
    3.11: a cancellation that arrives in the same loop pass as the wake-up is swallowed, so
    the follower's loop never ended and the app's shutdown waited on it forever (a change
    notification at shutdown; seen as a hung test in CI).
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await wake.wait()


async def _catch_up_once(resources: Resources, catch_up: Callable[[], int]) -> None:
    state = resources.follower
    try:
        applied = await anyio.to_thread.run_sync(catch_up)
    except Exception as exc:  # noqa: BLE001 - keep following; the next wake-up retries
        state.failures += 1
        state.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        resources.metrics.follower_failures.inc()
        log = logger.exception if state.failures in (1, 10) else logger.debug
        log("could not apply gallery changes (%d in a row); retrying", state.failures)
        return
    state.last_ok_at, state.failures, state.last_error = time.time(), 0, None
    if applied:
        # Includes this process's own writes, which are already in the index (no-ops).
        logger.debug("replayed %d gallery change-log rows", applied)
