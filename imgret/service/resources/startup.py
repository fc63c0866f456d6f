"""Assembling the bundle: at start-up for the default collection, on a collection's first
request for the others; refusing, with a message, a version that cannot serve."""

from __future__ import annotations

import logging
from collections.abc import Callable

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
from imgret.gallery.storage.tables import DEFAULT_COLLECTION, DEFAULT_COLLECTION_ID
from imgret.gallery.versions import intake, lifecycle, reembed
from imgret.service.pipeline import Serving, build_search_batcher
from imgret.service.resources.bundle import Resources
from imgret.service.resources.embed_jobs import EmbedJobs
from imgret.service.telemetry import ServiceMetrics
from imgret.settings import Settings

logger = logging.getLogger(__name__)


def _register_configured(settings: Settings, sessions: sessionmaker[Session]) -> str:
    """Start-up work on the model versions; returns the version of ``IMGRET_MODEL``.

    Checkpoint files of older releases go into the database (for every version lacking its
    bytes there), temporary uploads of killed processes are removed, and ``IMGRET_MODEL`` is
    registered: on a fresh database the first version registered becomes the active one,
    with its history row. Nothing here changes an active version.
    """
    assert settings.model is not None
    intake.import_checkpoint_files(session_factory=sessions, data_dir=settings.data_dir,
                                   max_bytes=settings.max_checkpoint_bytes)
    intake.sweep_incoming(settings.data_dir)
    return intake.register_checkpoint(
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
        active = lifecycle.active_version(session_factory=sessions) or configured
        if not lifecycle.has_checkpoint(active, session_factory=sessions):
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
    active = lifecycle.active_version(session_factory=sessions) or configured
    try:
        embedder = intake.load_embedder(active, session_factory=sessions,
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
    choice = embedder.runtime_choice
    checked = (f"; ONNX Runtime within {choice.max_abs_diff:.1e} of torch on its sample"
               if choice.max_abs_diff is not None else "")
    logger.info("model %s loaded on %s, run by %s (IMGRET_RUNTIME=%s: %s%s)",
                embedder.model_version, embedder.device, choice.runtime, choice.asked,
                choice.reason, checked)
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
    active = lifecycle.active_version(session_factory=sessions)
    if active is None:
        raise CheckpointError(f"collection {name} has no active model version")
    embedder = shared(active)
    if embedder is None:
        embedder = intake.load_embedder(
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
