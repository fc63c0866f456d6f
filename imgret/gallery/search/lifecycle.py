"""A Searcher's index from start to finish: open it (load the saved index and check it
against SQL, or rebuild it from SQL), write it to disk, and rebuild it in the background.

A saved index is trusted only when its manifest names the model version, factory and
dimension wanted, its file checksum holds, and, after replaying the change log from the
manifest's position, its ids equal the database's. Anything else is a rebuild from the
stored embeddings, with the reason logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import faiss
import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import GalleryError, IndexStale
from imgret.gallery.search.build import BuiltIndex, build_from_sql
from imgret.gallery.search.faiss_index import (
    DEFAULT_FACTORY,
    TooFewVectors,
    check_factory,
    read_index,
    set_search_defaults,
    stored_ids,
    write_index_bytes,
)
from imgret.gallery.search.live import Snapshot
from imgret.gallery.search.manifest import Manifest, ids_checksum, index_dir, now_iso
from imgret.gallery.storage import change_log, vector_store
from imgret.gallery.storage.tables import ModelVersion
from imgret.gallery.storage.vector_store import ItemInfo
from imgret.gallery.versions import version_store

logger = logging.getLogger(__name__)


class Opened(Protocol):
    """What opening needs of the Searcher it makes."""

    @property
    def size(self) -> int: ...

    def ids(self) -> np.ndarray: ...

    def refresh_from_changes(self) -> int: ...

    def save(self) -> Path: ...


S = TypeVar("S", bound=Opened)


def open_searcher(
    make: Callable[..., S], session_factory: sessionmaker[Session], data_dir: str | Path,
    factory: str, model_version: str | None, *, progress: bool, save: bool,
    dim: int | None, config: Mapping[str, Any] | None, **options: Any,
) -> S:
    """The body of :meth:`Searcher.open <imgret.gallery.search.Searcher.open>`.

    Args:
        make: the Searcher class.
        options: the Searcher's keyword arguments (``use_gpu``, ``rebuild_threshold``,
            ``nprobe``, ``ef_search``).
    """
    version = version_to_open(session_factory, model_version, dim, config)
    check_factory(factory, version.dim)  # refuse a bad string before any work
    folder = index_dir(data_dir, version.version)
    common = dict(session_factory=session_factory, data_dir=data_dir,
                  requested_factory=factory, **options)
    try:
        searcher = _load(make, folder, version, factory, common)
    except IndexStale as exc:
        logger.warning("rebuilding the %s index from SQL: %s", version.version, exc)
        built = build_or_fallback(session_factory, factory, version.version, progress)
        searcher = make(
            built.index, model_version=version.version, factory=built.manifest.factory,
            infos=built.infos, change_seq=built.manifest.change_seq, **common,
        )
        searcher.refresh_from_changes()
        if save:
            searcher.save()
    return searcher


def version_to_open(session_factory: sessionmaker[Session], model_version: str | None,
                    dim: int | None, config: Mapping[str, Any] | None) -> ModelVersion:
    """The version an index opens for: ``model_version`` (default the active one), registered
    first when it is unknown and ``dim`` is given (a service starting on an empty database).

    Raises:
        GalleryError: no such (or no active) version, and no ``dim``.
    """
    with session_factory.begin() as session:
        try:
            return version_store.get_model_version(session=session, version=model_version)
        except GalleryError:
            if model_version is None or dim is None:
                raise
            return version_store.register_model_version(
                session=session, version=model_version, dim=dim, config=config
            )


def _load(make: Callable[..., S], folder: Path, version: ModelVersion, factory: str,
          common: dict[str, Any]) -> S:
    """The saved index, caught up with the change log and checked against SQL.

    Raises:
        IndexStale: why it cannot be trusted.
    """
    session_factory = common["session_factory"]
    manifest = Manifest.read(folder)
    reasons = manifest.mismatches(model_version=version.version, factory=factory,
                                  dim=version.dim)
    if reasons:
        raise IndexStale("manifest differs: " + "; ".join(reasons))
    with session_factory() as session:
        db_seq = change_log.max_change_seq(session=session)
    if manifest.change_seq > db_seq:
        raise IndexStale(
            f"the manifest is at change {manifest.change_seq} but the database only at "
            f"{db_seq} (a different or restored database)"
        )
    index = read_index(folder, manifest.index_sha256)
    tombstones = set(manifest.tombstones)
    live = np.setdiff1d(stored_ids(index), np.fromiter(tombstones, np.int64))
    if len(live) != manifest.count or ids_checksum(live) != manifest.ids_sha256:
        raise IndexStale("the index file's ids differ from its manifest")
    db_infos = _load_infos(session_factory, version)
    infos = {int(i): db_infos.get(int(i), ItemInfo("")) for i in live}
    set_search_defaults(index)
    searcher = make(index, model_version=version.version, factory=manifest.factory,
                    infos=infos, change_seq=manifest.change_seq,
                    tombstones=sorted(tombstones), **common)
    replayed = searcher.refresh_from_changes()
    mine, theirs = searcher.ids(), np.fromiter(db_infos, np.int64, len(db_infos))
    if ids_checksum(mine) != ids_checksum(theirs):
        missing = len(np.setdiff1d(theirs, mine))
        extra = len(np.setdiff1d(mine, theirs))
        raise IndexStale(
            f"after replaying {replayed} changes the index holds {len(mine)} ids and the "
            f"database {len(theirs)} ({missing} missing, {extra} extra)"
        )
    logger.info(
        "loaded the %s index (%s, %d vectors, %d changes replayed)",
        version.version, manifest.factory, searcher.size, replayed,
    )
    return searcher


def _load_infos(session_factory: sessionmaker[Session],
                version: ModelVersion) -> dict[int, ItemInfo]:
    """id -> filter info of every live item with an embedding of ``version``."""
    infos: dict[int, ItemInfo] = {}
    with session_factory() as session:
        for page in vector_store.iter_vector_pages(session=session, model_version=version,
                                                   page_size=50_000, with_vectors=False):
            infos.update(zip(page.ids.tolist(), page.infos, strict=True))
    return infos


def build_or_fallback(session_factory: sessionmaker[Session], factory: str, version: str,
                      progress: bool) -> BuiltIndex:
    """:func:`build_from_sql`, falling back to exact ``Flat`` while the gallery is too small
    to train ``factory`` (logged; the next open or rebuild tries again)."""
    try:
        return build_from_sql(session_factory, factory, model_version=version,
                              progress=progress)
    except TooFewVectors as exc:
        logger.warning("%s; serving exact search (Flat) until the gallery is large enough",
                       exc)
        return build_from_sql(session_factory, DEFAULT_FACTORY, model_version=version,
                              progress=progress)


def write_snapshot(snapshot: Snapshot, folder: Path, *, model_version: str, dim: int) -> None:
    """Write a snapshot's index file, then its manifest (each atomically and durably)."""
    _, digest = write_index_bytes(snapshot.data, folder)
    Manifest(
        model_version=model_version, factory=snapshot.factory, dim=dim,
        count=len(snapshot.live_ids), change_seq=snapshot.change_seq,
        ids_sha256=ids_checksum(snapshot.live_ids), index_sha256=digest,
        tombstones=snapshot.tombstones, faiss_version=faiss.__version__, created_at=now_iso(),
    ).write(folder)


class BackgroundRebuild:
    """Runs a rebuild on a daemon thread, one at a time.

    Args:
        rebuild: the rebuild (``Searcher.rebuild``).
        model_version: for the log.
    """

    def __init__(self, rebuild: Callable[[], None], model_version: str):
        self._rebuild = rebuild
        self._model_version = model_version
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, reason: str) -> None:
        """Start a rebuild unless one is running."""
        with self._lock:  # two removes at once must not start two rebuilds
            if self._thread is not None and self._thread.is_alive():
                return
            logger.info("%s: rebuilding the %s index in the background", reason,
                        self._model_version)
            self._thread = threading.Thread(
                target=self._run, name="imgret-index-rebuild", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        try:
            self._rebuild()
        except Exception:  # a background thread has nobody to raise to
            logger.exception("background rebuild of the %s index failed", self._model_version)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the running rebuild (if any) has finished."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
