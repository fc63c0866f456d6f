"""The background re-embedding of the stored gallery for a model version: a claimed job with
a heartbeat (:func:`claim_job`, :func:`run_embed_job`), the scan it runs
(:func:`embed_missing`), and the :class:`Throttle` that keeps it from starving searches.
The SQL is :mod:`imgret.gallery.versions.version_store`'s and :mod:`imgret.gallery.storage`'s.

- **It reads the media store**, never a source folder. It is stateless: each chunk takes the
  next live items (in id order) that lack an embedding of the version, so a crash loses at
  most one chunk and a new run resumes where the last commit left off. Items added while it
  runs have larger ids and are picked up by the same scan; an item deleted while it runs is
  skipped at the write (``store.add_embeddings`` re-checks liveness under the gallery write
  lock), so a delete never comes back. Query-set items are embedded after the gallery.
- **The job's state and heartbeat are columns of** ``model_versions``, so every process sees
  progress; a ``running`` job whose heartbeat is older than
  :data:`imgret.gallery.versions.version_store.HEARTBEAT_STALE_S` was interrupted and may be claimed
  again. The heartbeat beats from its own thread (every third of that), not per chunk: a slow chunk
  plus its throttle pause never looks dead.
- **Throttle**: the job computes at most ``duty`` of the wall time (it sleeps in between) and
  waits while the caller says searches are queued, so ``/search`` on the active version keeps
  its latency (``benchmarks/reembed_bench.py`` measures it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from imgret.embedder import Embedder
from imgret.errors import GalleryError, ImageDecodeError, ImgretError
from imgret.gallery.media.files import MediaBackend
from imgret.gallery.storage import item_store
from imgret.gallery.storage.tables import ModelVersion
from imgret.gallery.versions import version_store
from imgret.gallery.versions.version_store import STATE_DONE, STATE_FAILED
from imgret.images import DEFAULT_MAX_PIXELS, DecodeLimits, embed_encoded

logger = logging.getLogger(__name__)

EMBED_CHUNK = 64
DEFAULT_DUTY = 0.5


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
    """Mark the version's job running, unless a live job (fresh heartbeat) already runs: of
    several processes asked at once, one wins.

    Raises:
        VersionNotFound: unknown version.
    """
    with session_factory.begin() as session:
        row = version_store.get_version(version, session=session)
        return version_store.claim_job(row, session=session)


def stale_jobs(*, session_factory: sessionmaker[Session]) -> list[str]:
    """Versions whose job was running when its process died (heartbeat gone stale)."""
    with session_factory() as session:
        return [row.version for row in version_store.running_jobs(session=session)
                if version_store.is_stale(row.embed_heartbeat_at)]


@contextmanager
def _beating(version: str, session_factory: sessionmaker[Session]) -> Iterator[None]:
    """Refresh the job's heartbeat from a thread every third of the staleness limit while the
    job runs, however long one chunk or its throttle pause takes: the heartbeat says the
    process is alive, not that a chunk just ended, so a live job is never claimed by a second
    process. (A process that dies stops beating; one whose job hangs keeps its claim until it
    is restarted.)"""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(version_store.HEARTBEAT_STALE_S / 3):
            try:
                with session_factory.begin() as session:
                    version_store.beat(version, session=session)
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
    with session_factory.begin() as session:
        version_store.finish_job(version, session=session, state=state, error=error,
                                 covered_through=covered_through)


def job_error(exc: BaseException) -> str:
    """The error a failed job keeps (``GET /models/{v}`` shows it): imgret's own message for
    an error it raises on purpose (a model that cannot run, non-finite vectors), never the
    text of another exception, which may quote a stored file (ONNX Runtime's errors name the
    graph's nodes); that text goes to the log."""
    if isinstance(exc, ImgretError):
        return str(exc)[:500]
    return (f"the re-embedding stopped on an unexpected error ({type(exc).__name__}); the "
            "server log has the details")


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
        through = item_store.newest_item_id(session=session)
    try:
        with _beating(version, session_factory):
            report = embed_missing(
                version, session_factory=session_factory, media=media, embedder=embedder,
                throttle=throttle, chunk_size=chunk_size, max_pixels=max_pixels,
                progress=progress, stop=stop, heartbeat=True,
            )
    except BaseException as exc:
        _finish_job(version, session_factory, STATE_FAILED, job_error(exc))
        raise
    error = (f"{len(report.failed)} stored images could not be decoded (ids "
             f"{report.failed[:10]})" if report.failed else None)
    if stop is not None and stop.is_set():
        # Stopped by a shutdown: resumed by the next start of any process (or a request).
        with session_factory.begin() as session:
            version_store.release_job(version, session=session)
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
        heartbeat: also refresh the job's heartbeat with each chunk.
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
                row = version_store.get_version(version, session=session)
                batch = version_store.missing_items(row.id, session=session, after=after,
                                                    limit=chunk_size, queries=queries)
            if not batch:
                break
            after = batch[-1][0]
            t0 = time.perf_counter()
            ids, vectors, broken = embed_stored(batch, media, embedder, limits)
            failed.update(broken)
            with session_factory.begin() as session:
                row = version_store.get_version(version, session=session)
                if queries:
                    written = _add_query_embeddings(session, row, ids, vectors)
                    report.queries_embedded += written
                else:
                    written = len(item_store.add_embeddings(ids, vectors, session=session,
                                                            model_version=row))
                    report.gallery_embedded += written
                    report.skipped_deleted += len(ids) - written
                if heartbeat:
                    version_store.beat(version, session=session)
                cov = (version_store.coverage(row.id, session=session)
                       if progress is not None else None)
            if progress is not None and cov is not None:
                progress(cov.embedded, cov.live)
            if throttle is not None:
                throttle.pause(time.perf_counter() - t0)
    report.failed = sorted(failed)
    report.seconds = time.perf_counter() - start
    return report


def embed_stored(batch: list[tuple[int, str]], media: MediaBackend, embedder: Embedder,
                 limits: DecodeLimits) -> tuple[list[int], np.ndarray, list[int]]:
    """Vectors of stored images (``(id, media_path)`` pairs); an unreadable one is left out
    (its id in the third list)."""
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
    have = item_store.ids_with_embedding(ids, session=session, model_version_id=row.id,
                                         query_set=item_store.ANY_QUERY_SET)
    keep = [j for j, item_id in enumerate(ids) if item_id not in have]
    if keep:
        item_store.add_embeddings([ids[j] for j in keep], vectors[keep], session=session,
                                  model_version=row, query_set=item_store.ANY_QUERY_SET)
    return len(keep)
