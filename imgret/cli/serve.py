"""CLI command `imgret serve`: the API under uvicorn (``imgret.service.run.serve``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import typer

logger = logging.getLogger(__name__)


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
        from imgret.service.run import serve
        from imgret.settings import Settings

        if model is not None:
            # Workers are separate processes that read their settings from the environment.
            os.environ["IMGRET_MODEL"] = str(model)
        serve(Settings(), host=host, port=port, workers=workers)
