"""Running the service: what `imgret serve` (and the demo) call.

``serve`` checks what must be refused before anything slow (an open write API on a network
interface, a missing model), brings the schema to head once (before any worker starts, so
workers never race to migrate), then runs ``imgret.service.app:create_app`` under uvicorn.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

from imgret.errors import CheckpointError, ImgretError
from imgret.service.auth import check_write_exposure, normalized_origins
from imgret.service.telemetry import MULTIPROC_DIR_ENV
from imgret.settings import Settings

logger = logging.getLogger(__name__)

# Everything (uvicorn's lines, the access log of imgret.service.telemetry) goes to stderr through
# the
# root logger, one format for all.
LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {
        "stderr": {"class": "logging.StreamHandler", "formatter": "plain",
                   "stream": "ext://sys.stderr"}
    },
    "root": {"level": "INFO", "handlers": ["stderr"]},
    "loggers": {
        "uvicorn": {"level": "INFO", "handlers": [], "propagate": True},
        "uvicorn.error": {"level": "INFO", "handlers": [], "propagate": True},
    },
}


def serve(settings: Settings, *, host: str = "127.0.0.1", port: int = 8000,
          workers: int = 1) -> None:
    """Upgrade the schema to head, then serve the API with uvicorn until stopped.

    One worker serves an app built from ``settings``. Several workers are separate processes
    that uvicorn starts from an import string: each builds its app from the ``IMGRET_*``
    environment, so ``settings`` must be the environment's own then (as `imgret serve` does).

    Raises:
        ImgretError: no model configured, an unusable checkpoint, several workers on a
            milvus-lite file, or a non-loopback ``host``
            without ``IMGRET_API_KEY`` (and without ``IMGRET_ALLOW_ANONYMOUS_WRITES=true``).
    """
    # Before anything slow (importing torch and the app takes seconds): an open write API on
    # a network interface is refused outright, and a malformed IMGRET_ALLOWED_ORIGINS is
    # named here rather than in every worker.
    check_write_exposure(settings, host)
    normalized_origins(settings.allowed_origins)
    check_milvus_workers(settings, workers)
    if settings.model is None:
        raise CheckpointError(
            "no model: set IMGRET_MODEL (or pass --model) to a run directory or its model.pt"
        )

    import uvicorn

    from imgret.checkpoint import resolve_checkpoint_path
    from imgret.gallery.storage.db import safe_url, upgrade_to_head
    from imgret.service.app import create_app
    from imgret.service.resources.startup import check_active_servable

    resolve_checkpoint_path(settings.model)  # fail here, not in every worker
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.db_url)
    check_active_servable(settings)  # one line and no server, rather than a failed start-up
    logger.info("schema at head on %s; serving on http://%s:%d", safe_url(settings.db_url),
                host, port)
    app = create_app(settings) if workers == 1 else "imgret.service.app:create_app"
    with shared_metrics_dir() if workers > 1 else contextlib.nullcontext():
        uvicorn.run(
            app,
            factory=workers > 1,
            host=host,
            port=port,
            workers=workers,
            # imgret.service.telemetry writes one structured line per request instead.
            access_log=False,
            # Applied in every worker process too (they are spawned, not forked).
            log_config=LOG_CONFIG,
            # Shut down promptly even with keep-alive clients attached.
            timeout_graceful_shutdown=10,
        )


def check_milvus_workers(settings: Settings, workers: int) -> None:
    """Several workers cannot share a milvus-lite file (one process opens it): refused in one
    line before any worker starts, rather than every worker but one failing its start-up."""
    from imgret.gallery.search.milvus_index import is_lite_file, milvus_uri

    if workers > 1 and settings.index_backend == "milvus" and is_lite_file(milvus_uri(settings)):
        raise ImgretError(
            f"IMGRET_MILVUS_URI is a milvus-lite file, which one process opens, and --workers "
            f"is {workers}: run a Milvus server (`python -m milvus_lite server --data-dir DIR` "
            f"or Milvus itself) and set IMGRET_MILVUS_URI to its http://host:port")


@contextlib.contextmanager
def shared_metrics_dir() -> Iterator[str]:
    """A new empty folder for the workers' metric files, in ``PROMETHEUS_MULTIPROC_DIR``.

    Set here, in the parent, before uvicorn spawns the workers: each inherits it and imports
    prometheus_client with it set, which switches the library to multiprocess mode there
    (see ``ServiceMetrics``). The folder must start empty (files left by an earlier run
    would be merged into this one's counts), so it is a new one every time, in the system's
    temporary directory rather than the data dir: replicas sharing a data dir must not
    share (or clean up) each other's files. Removed when the server stops; a parent killed
    with SIGKILL leaves it to the system's temporary-file clean-up (a few KiB). Whatever
    ``PROMETHEUS_MULTIPROC_DIR`` said before is replaced, then restored.
    """
    previous = os.environ.get(MULTIPROC_DIR_ENV)
    path = tempfile.mkdtemp(prefix="imgret-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(MULTIPROC_DIR_ENV, None)
        else:
            os.environ[MULTIPROC_DIR_ENV] = previous
        shutil.rmtree(path, ignore_errors=True)
