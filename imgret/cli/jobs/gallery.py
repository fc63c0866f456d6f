"""What the gallery commands of `imgret` run, one function each: `imgret db`, `ingest`,
`index build`, `evaluate` and `media migrate` (and the demo, which calls these, not the CLI).
`imgret models ...` runs :mod:`imgret.cli.jobs.models`.

Every function takes the :class:`~imgret.settings.Settings` in force and opens the gallery database
through :func:`open_gallery`: schema brought to head, an engine, sessions, disposed at the end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import CheckpointError, DatabaseError, GalleryError
from imgret.gallery.ingest import IngestReport
from imgret.gallery.storage.db import downgrade, make_engine, make_sessionmaker, upgrade_to_head
from imgret.gallery.storage.tables import DEFAULT_COLLECTION
from imgret.gallery.tenancy import collections, keys
from imgret.settings import MEDIA_BACKENDS, Settings

if TYPE_CHECKING:  # numpy and the search package load with the command that needs them
    from imgret.gallery.evaluation.open_set import OpenSetRequest
    from imgret.gallery.media.blobs import MediaMigration
    from imgret.gallery.search.rerank import Rerank

logger = logging.getLogger(__name__)


@contextmanager
def open_gallery(settings: Settings) -> Iterator[sessionmaker[Session]]:
    """Sessions on the gallery database of ``settings``, with the schema at head, scoped to
    ``settings.collection`` (``IMGRET_COLLECTION``, the CLI's ``--collection``).

    A fresh data dir or database just works: the schema is upgraded first (a no-op at head).
    The engine is disposed when the block ends.

    Raises:
        CollectionNotFound: no collection of that name.
    """
    upgrade_to_head(settings.db_url)
    engine = make_engine(settings.db_url)
    try:
        sessions = make_sessionmaker(engine)
        if settings.collection not in (None, DEFAULT_COLLECTION):
            with sessions() as session:
                collection_id = collections.get(settings.collection, session=session).id
            sessions = make_sessionmaker(engine, collection_id)
        yield sessions
    finally:
        engine.dispose()


def upgrade(settings: Settings) -> str:
    """`imgret db upgrade`: the schema to the latest migration; returns the revision."""
    return upgrade_to_head(settings.db_url)


def downgrade_to(settings: Settings, revision: str, *, confirmed: bool) -> None:
    """`imgret db downgrade`: undo migrations down to ``revision`` (data is lost).

    Raises:
        DatabaseError: not ``confirmed``.
    """
    if not confirmed:
        raise DatabaseError("downgrading deletes gallery data; pass --yes to confirm")
    downgrade(settings.db_url, revision)


def ingest(
    settings: Settings, path: str | Path, *, model: Path | None = None,
    query_set: str | None = None, batch_size: int = 64, chunk_size: int = 256,
    workers: int | None = None, progress: bool = True, ray: str | None = None,
) -> IngestReport:
    """`imgret ingest`: embed a data set into the gallery or a named query set (idempotent).

    Args:
        settings: the settings in force (database, data dir, device, pixel limit).
        path: an ImageFolder tree, a CSV manifest or a Market-1501 folder.
        model: the checkpoint; default ``settings.model``.
        query_set: store the images in this named query set instead of the gallery.
        batch_size: images per forward pass.
        chunk_size: images per transaction.
        workers: processes decoding and, on the CPU, embedding files (with ``ray``: embed
            actors).
        progress: a tqdm bar.
        ray: ingest on Ray Data (``imgret.gallery.ingest.ray``): ``"local"`` for a local Ray
            instance, else a cluster address (``auto``, ``ray://host:10001``).

    Raises:
        CheckpointError: no model given or configured.
        GalleryError: an empty query-set name.
        RayUnavailable: ``ray`` given but Ray Data is not installed or not reachable.
    """
    from imgret.embedder import Embedder
    from imgret.gallery.ingest import ingest_source
    from imgret.gallery.media.blobs import open_media_store
    from imgret.gallery.versions import intake

    checkpoint = model or settings.model
    if checkpoint is None:
        raise CheckpointError("no model: pass --model RUN_DIR (or its model.pt) or set "
                              "IMGRET_MODEL")
    if query_set is not None and not query_set.strip():
        raise GalleryError("the query set name is empty (--query-set)")
    if ray is not None:
        from imgret.gallery.ingest.ray import import_ray

        import_ray()  # a missing extra is said before any work is done
    with open_gallery(settings) as sessions:
        # Keep the checkpoint under the data dir: any server can then load this version
        # (compare it, switch to it) without the run directory.
        intake.register_checkpoint(checkpoint, session_factory=sessions,
                                   data_dir=settings.data_dir)
        if ray is not None:
            from imgret.gallery.ingest.ray import ingest_with_ray

            return ingest_with_ray(
                path, session_factory=sessions, media=open_media_store(settings, sessions),
                database_url=settings.db_url, checkpoint=checkpoint, device=settings.device,
                runtime=settings.runtime, query_set=query_set, batch_size=batch_size,
                chunk_size=chunk_size,
                max_pixels=settings.max_image_pixels, address=None if ray == "local" else ray,
                actors=workers, progress=progress,
            )
        embedder = Embedder.from_checkpoint(checkpoint, device=settings.device,
                                            batch_size=batch_size, runtime=settings.runtime)
        return ingest_source(
            path, session_factory=sessions, media=open_media_store(settings, sessions),
            embedder=embedder, query_set=query_set, chunk_size=chunk_size,
            max_pixels=settings.max_image_pixels, workers=workers, progress=progress,
        )


@dataclass(frozen=True)
class BuildReport:
    """What `imgret index build` made."""

    factory: str
    model_version: str
    size: int
    seconds: float
    folder: Path


def build(
    settings: Settings, *, factory: str | None = None, model_version: str | None = None,
    progress: bool = True,
) -> BuildReport:
    """`imgret index build`: the FAISS index from the stored embeddings, saved with its manifest.

    Unlike a starting service, an explicit build refuses a factory the gallery is too small to
    train, instead of falling back to exact search. On the Milvus backend
    (``IMGRET_INDEX_BACKEND=milvus``) the version's Milvus collection is dropped and refilled
    from SQL instead.
    """
    from imgret.gallery.search import Searcher
    from imgret.gallery.search.build import build_from_sql

    if settings.index_backend == "milvus":
        with open_gallery(settings) as sessions:
            start = time.perf_counter()
            searcher = Searcher.open_milvus(sessions, settings, model_version, rebuild=True)
            return BuildReport(searcher.factory, searcher.model_version, searcher.size,
                               time.perf_counter() - start, settings.data_dir)
    with open_gallery(settings) as sessions:
        start = time.perf_counter()
        built = build_from_sql(sessions, factory or settings.index_factory,
                               model_version=model_version, progress=progress)
        seconds = time.perf_counter() - start
        searcher = Searcher(
            built.index, model_version=built.manifest.model_version,
            factory=built.manifest.factory, infos=built.infos,
            change_seq=built.manifest.change_seq, session_factory=sessions,
            data_dir=settings.data_dir, use_gpu=False,
        )
        searcher.refresh_from_changes()
        folder = searcher.save()
    return BuildReport(built.manifest.factory, built.manifest.model_version, searcher.size,
                       seconds, folder)


def evaluate_named(
    settings: Settings, name: str, *, ks: list[int] | None = None,
    exclude_same_camera: bool = False, model_version: str | None = None, worst: int = 0,
    rerank: Rerank | None = None, open_set: OpenSetRequest | None = None,
) -> dict:
    """`imgret evaluate`: the report of ``POST /evaluate {"query_set": name}``, same code.

    The index of the version is loaded (or rebuilt from SQL) like the service does; the model
    (``settings.model``) is needed only when the query set has no stored embeddings for it.
    With ``rerank`` the results are re-ranked as ``/search`` does, and the report is not kept
    as the version's last evaluation.
    """
    from imgret.embedder import Embedder
    from imgret.gallery.media.blobs import open_media_store
    from imgret.gallery.search import Searcher
    from imgret.gallery.versions import lifecycle

    embedder = (
        Embedder.from_checkpoint(settings.model, device=settings.device,
                                 runtime=settings.runtime)
        if settings.model is not None else None
    )
    if model_version is None and embedder is not None:
        model_version = embedder.model_version
    with open_gallery(settings) as sessions:
        searcher = Searcher.from_settings(sessions, settings, model_version)  # None: active
        # On record as the version's last evaluation (GET /models shows it), unless re-ranked.
        return lifecycle.evaluate_recorded(
            searcher, name, session_factory=sessions, embedder=embedder,
            media=open_media_store(settings, sessions),
            max_pixels=settings.max_image_pixels, k=ks,
            exclude_same_camera=exclude_same_camera, worst=worst, rerank=rerank,
            open_set=open_set,
        ).report


def migrate_media(settings: Settings, to: str, *, progress: bool = True) -> MediaMigration:
    """`imgret media migrate --to BACKEND`: move every stored image of the gallery of
    ``settings`` into the ``to`` media backend (``imgret.gallery.media.blobs.migrate_media``;
    servers stopped), the data dir and the database as configured.

    Raises:
        GalleryError: ``to`` is not a backend.
    """
    from tqdm.auto import tqdm

    from imgret.gallery.media.blobs import migrate_media as migrate
    from imgret.gallery.media.blobs import open_media_store

    if to not in MEDIA_BACKENDS:
        raise GalleryError(f"--to {to!r}: the media backends are {', '.join(MEDIA_BACKENDS)}")
    source_name = MEDIA_BACKENDS[1 - MEDIA_BACKENDS.index(to)]
    with open_gallery(settings) as sessions, tqdm(
        unit="img", desc=f"media {source_name} -> {to}", disable=not progress
    ) as bar:
        return migrate(
            source=open_media_store(settings.model_copy(update={"media_backend": source_name}),
                                    sessions),
            target=open_media_store(settings.model_copy(update={"media_backend": to}),
                                    sessions),
            session_factory=sessions, on_batch=bar.update,
        )


def _default_gallery(settings: Settings):
    """:func:`open_gallery` on ``default`` whatever ``--collection`` says: collections and
    keys belong to no collection, and are managed from there."""
    return open_gallery(settings.model_copy(update={"collection": None}))


def list_collections(settings: Settings) -> list[collections.CollectionInfo]:
    """`imgret collections list`: every collection with its size and served version."""
    with _default_gallery(settings) as sessions:
        return collections.describe(session_factory=sessions)


def create_collection(settings: Settings, name: str, *, version: str | None = None,
                      public: bool = True) -> collections.CollectionInfo:
    """`imgret collections create NAME`: the twin of ``POST /collections``."""
    with _default_gallery(settings) as sessions:
        return collections.create(name, session_factory=sessions, version=version,
                                  public=public)


def delete_collection(settings: Settings, name: str) -> int:
    """`imgret collections delete NAME`: the twin of ``DELETE /collections/{name}``; returns
    how many live items it held."""
    from imgret.gallery.media.blobs import open_media_store
    from imgret.gallery.search.milvus_index import vector_dropper

    with _default_gallery(settings) as sessions:
        return collections.delete(name, session_factory=sessions,
                                  media=open_media_store(settings, sessions),
                                  data_dir=settings.data_dir,
                                  drop_vectors=vector_dropper(settings))


def create_key(settings: Settings, name: str, *, roles: dict[str, str],
               admin: bool = False) -> tuple[keys.KeyRecord, str]:
    """`imgret keys create`: the twin of ``POST /keys``; returns the record and the key."""
    with _default_gallery(settings) as sessions:
        return keys.create(name, session_factory=sessions, roles=roles, is_admin=admin)


def list_keys(settings: Settings) -> list[keys.KeyRecord]:
    """`imgret keys list`: every key, revoked ones included (never a secret)."""
    with _default_gallery(settings) as sessions:
        return list(keys.load(session_factory=sessions).values())


def revoke_key(settings: Settings, key_id: int) -> keys.KeyRecord:
    """`imgret keys revoke ID`: the twin of ``DELETE /keys/{id}``."""
    with _default_gallery(settings) as sessions:
        return keys.revoke(key_id, session_factory=sessions)
