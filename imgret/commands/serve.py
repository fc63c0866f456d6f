"""CLI commands: serve (the REST API under uvicorn) and evaluate (the same code as /evaluate)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import typer

logger = logging.getLogger(__name__)

# Everything (uvicorn's lines, the access log of service.telemetry) goes to stderr through the
# root logger, one format for all.
LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {
        "stderr": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}
    },
    "root": {"level": "INFO", "handlers": ["stderr"]},
    "loggers": {
        "uvicorn": {"level": "INFO", "handlers": [], "propagate": True},
        "uvicorn.error": {"level": "INFO", "handlers": [], "propagate": True},
    },
}


def register(app: typer.Typer, *, db_app: typer.Typer, index_app: typer.Typer) -> None:
    """Add this area's commands to the CLI."""

    @app.command("serve")
    def serve_command(
        host: str = typer.Option("127.0.0.1", help="interface to bind (0.0.0.0 for all)"),
        port: int = typer.Option(8000, min=1, max=65535),
        workers: int = typer.Option(
            1, min=1, help="API processes; each loads the model and its own index copy"
        ),
        model: Path | None = typer.Option(
            None, help="checkpoint (run dir or model.pt); default: IMGRET_MODEL"
        ),
    ) -> None:
        """Bring the schema up to date (Alembic), then serve the API with uvicorn.

        Settings come from the environment (IMGRET_DATABASE_URL, IMGRET_DATA_DIR, ...).
        """
        if model is not None:
            # Workers are separate processes that read their settings from the environment.
            os.environ["IMGRET_MODEL"] = str(model)
        serve(host=host, port=port, workers=workers)

    @app.command("evaluate")
    def evaluate_command(
        query_set: str = typer.Option(..., "--query-set", help="a set stored by `imgret ingest "
                                      "PATH --query-set NAME`"),
        k: str = typer.Option("1,5,10", "--k", help="comma-separated cut-offs"),
        exclude_same_camera: bool = typer.Option(
            False, "--exclude-same-camera", help="re-ID rule: drop same-label same-camera items"
        ),
        model_version: str | None = typer.Option(
            None, "--model-version", help="default: IMGRET_MODEL's version, else the active one"
        ),
        worst: int = typer.Option(0, "--worst", min=0, max=100, help="list the n worst queries"),
        json_out: Path | None = typer.Option(None, "--json", help="also write the report here"),
    ) -> None:
        """Evaluate a named query set through the index, exactly as POST /evaluate does."""
        try:
            ks = [int(part) for part in k.split(",") if part.strip()]
        except ValueError:
            raise typer.BadParameter(f"{k!r} is not a list of integers", param_hint="--k") from None
        report = evaluate_query_set(
            query_set, ks=ks, exclude_same_camera=exclude_same_camera,
            model_version=model_version, worst=worst,
        )
        from index.evaluation import format_report

        for line in format_report(report):
            typer.echo(line)
        for query in report.get("worst", []):
            neighbours = ", ".join(
                f"{n['label']}{'*' if n['relevant'] else ''} {n['score']:.3f}"
                for n in query["neighbours"][:5]
            )
            typer.echo(f"worst: query {query['index']} ({query['label']}): AP@R "
                       f"{query['average_precision_at_r']:.3f}; top: {neighbours}")
        if json_out is not None:
            json_out.write_text(json.dumps(report, indent=2, default=str))
            typer.echo(f"report written to {json_out}")


def serve(*, host: str = "127.0.0.1", port: int = 8000, workers: int = 1) -> None:
    """Upgrade the database schema to head, then run ``service.app:create_app`` under uvicorn.

    The schema is upgraded once here, before any worker starts, so that several workers
    never race to run the same migration. Each worker builds its app from the environment
    (``IMGRET_*``), loads the model and loads or rebuilds its index from SQL.

    Args:
        host: interface to bind.
        port: TCP port.
        workers: uvicorn worker processes.

    Raises:
        ImgretError: no model configured, an unusable checkpoint, or a non-loopback ``host``
            without ``IMGRET_API_KEY`` (and without ``IMGRET_ALLOW_ANONYMOUS_WRITES=true``).
    """
    import uvicorn

    from imgret.checkpoint import resolve_checkpoint_path
    from imgret.errors import CheckpointError
    from imgret.settings import Settings
    from index.db import upgrade_to_head
    from service.auth import check_write_exposure, normalized_origins

    settings = Settings()
    # Before anything slow: an open write API on a network interface is refused outright,
    # and a malformed IMGRET_ALLOWED_ORIGINS is named here rather than in every worker.
    check_write_exposure(settings, host)
    normalized_origins(settings.allowed_origins)
    if settings.model is None:
        raise CheckpointError(
            "no model: set IMGRET_MODEL (or pass --model) to a run directory or its model.pt"
        )
    resolve_checkpoint_path(settings.model)  # fail here, not in every worker
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.db_url)
    logger.info("schema at head on %s; serving on http://%s:%d", _safe(settings.db_url), host,
                port)
    uvicorn.run(
        "service.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        # service.telemetry writes one structured line per request instead.
        access_log=False,
        # Applied in every worker process too (they are spawned, not forked).
        log_config=LOG_CONFIG,
        # Shut down promptly even with keep-alive clients attached.
        timeout_graceful_shutdown=10,
    )


def evaluate_query_set(
    name: str, *, ks: list[int] | None = None, exclude_same_camera: bool = False,
    model_version: str | None = None, worst: int = 0,
) -> dict:
    """The report of ``imgret evaluate``: the same functions as ``POST /evaluate`` use.

    The index of the version is loaded (or rebuilt from SQL) like the service does; the model
    (``IMGRET_MODEL``) is only needed when the query set has no stored embeddings for it.
    """
    from imgret.embedder import Embedder
    from imgret.settings import Settings
    from index import evaluation
    from index.db import make_engine, make_sessionmaker
    from index.media import MediaStore
    from index.search import Searcher

    settings = Settings()
    embedder = (
        Embedder.from_checkpoint(settings.model, device=settings.device)
        if settings.model is not None else None
    )
    engine = make_engine(settings.db_url)
    try:
        sessions = make_sessionmaker(engine)
        if model_version is None and embedder is not None:
            model_version = embedder.model_version
        # None: the active version.
        searcher = Searcher.from_settings(sessions, settings, model_version)
        return evaluation.evaluate_query_set(
            searcher, name, session_factory=sessions, embedder=embedder,
            media=MediaStore.in_data_dir(settings.data_dir),
            max_pixels=settings.max_image_pixels, k=ks,
            exclude_same_camera=exclude_same_camera, worst=worst,
        ).report
    finally:
        engine.dispose()


def _safe(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
