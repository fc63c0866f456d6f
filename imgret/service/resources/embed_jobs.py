"""The supervisor of a collection's background re-embedding jobs in this process."""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from imgret.embedder import Embedder
from imgret.gallery.media.files import MediaBackend
from imgret.gallery.search import Searcher
from imgret.gallery.versions import reembed
from imgret.settings import Settings

logger = logging.getLogger(__name__)


class JobHost(Protocol):
    """What the jobs need of their collection's bundle
    (:class:`imgret.service.resources.bundle.Resources`)."""

    settings: Settings
    sessions: sessionmaker[Session]
    media: MediaBackend

    def search_busy(self) -> bool: ...

    def embedder_for(self, version: str) -> Embedder: ...

    def searcher_for(self, version: str) -> Searcher: ...


class EmbedJobs:
    """This process's background re-embedding threads (one per version at most).

    The state that other processes see lives in SQL
    (:func:`imgret.gallery.versions.reembed.claim_job`); a job stopped by a shutdown is left
    "running" with an old heartbeat, which any process's next start or ``POST /models/{v}/embed``
    resumes.
    """

    def __init__(self, resources: JobHost):
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
