"""CLI commands: the gallery database (`db upgrade`), `ingest`, and `index build`.

Settings (``IMGRET_DATABASE_URL``, ``IMGRET_DATA_DIR``, ``IMGRET_MODEL``, ``IMGRET_DEVICE``,
``IMGRET_INDEX_FACTORY``, ``IMGRET_MAX_IMAGE_PIXELS``) come from the environment; options
override them. Heavy modules are imported inside each command.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer, *, db_app: typer.Typer, index_app: typer.Typer) -> None:
    """Add this area's commands to the CLI."""

    @db_app.command("upgrade")
    def db_upgrade() -> None:
        """Bring the database schema to the latest migration (Alembic `upgrade head`)."""
        from imgret.settings import get_settings
        from index.db import upgrade_to_head

        settings = get_settings()
        revision = upgrade_to_head(settings.db_url)
        typer.echo(f"database schema at revision {revision} ({_safe(settings.db_url)})")

    @db_app.command("downgrade")
    def db_downgrade(
        revision: str = typer.Argument("base", help="target revision; base drops every table"),
        yes: bool = typer.Option(False, "--yes", help="confirm: this deletes data"),
    ) -> None:
        """Undo migrations down to REVISION (data in dropped tables is lost)."""
        from imgret.errors import DatabaseError
        from imgret.settings import get_settings
        from index.db import downgrade

        if not yes:
            raise DatabaseError("downgrading deletes gallery data; pass --yes to confirm")
        settings = get_settings()
        downgrade(settings.db_url, revision)
        typer.echo(f"database schema downgraded to {revision} ({_safe(settings.db_url)})")

    @app.command("ingest")
    def ingest_command(
        path: Path = typer.Argument(
            ..., help="ImageFolder tree, CSV manifest (path,label[,camera]) or Market-1501 folder"
        ),
        model: Path | None = typer.Option(
            None, "--model", help="checkpoint (run dir or model.pt); default: IMGRET_MODEL"
        ),
        query_set: str | None = typer.Option(
            None, "--query-set", help="store the images in this named query set, not the gallery"
        ),
        batch_size: int = typer.Option(64, "--batch-size", min=1, help="images per forward pass"),
        chunk_size: int = typer.Option(
            256, "--chunk-size", min=1, help="images per transaction (lost if interrupted)"
        ),
        workers: int | None = typer.Option(
            None, "--workers", min=1, help="threads reading and decoding files"
        ),
        progress: bool = typer.Option(True, "--progress/--no-progress"),
    ) -> None:
        """Embed a data set into the gallery (or a query set); running it again adds nothing."""
        from imgret.embedder import Embedder
        from imgret.errors import CheckpointError
        from imgret.settings import get_settings
        from index.db import make_engine, make_sessionmaker, upgrade_to_head
        from index.ingest import ingest_source
        from index.media import MediaStore

        settings = get_settings()
        checkpoint = model or settings.model
        if checkpoint is None:
            raise CheckpointError(
                "no model: pass --model RUN_DIR (or its model.pt) or set IMGRET_MODEL"
            )
        if query_set is not None and not query_set.strip():
            raise typer.BadParameter("the query set name is empty", param_hint="--query-set")
        upgrade_to_head(settings.db_url)  # a fresh data dir or database just works
        embedder = Embedder.from_checkpoint(
            checkpoint, device=settings.device, batch_size=batch_size
        )
        engine = make_engine(settings.db_url)
        try:
            report = ingest_source(
                path, session_factory=make_sessionmaker(engine),
                media=MediaStore.in_data_dir(settings.data_dir), embedder=embedder,
                query_set=query_set, chunk_size=chunk_size,
                max_pixels=settings.max_image_pixels, workers=workers, progress=progress,
            )
        finally:
            engine.dispose()
        for line in report.summary():
            typer.echo(line)
        if not query_set and report.added + report.embedded:
            typer.echo("next: `imgret index build` (or start `imgret serve`, which builds it)")

    @index_app.command("build")
    def index_build(
        factory: str | None = typer.Option(
            None, "--factory",
            help="FAISS index factory string (Flat = exact; IVF1024,Flat; HNSW32; "
            "IVF1024,PQ32 ...); default: IMGRET_INDEX_FACTORY",
        ),
        model_version: str | None = typer.Option(
            None, "--model-version", help="default: the active model version"
        ),
        progress: bool = typer.Option(True, "--progress/--no-progress"),
    ) -> None:
        """Build the FAISS index from the stored embeddings (no re-embedding) and save it."""
        import time

        from imgret.settings import get_settings
        from index.db import make_engine, make_sessionmaker, upgrade_to_head
        from index.faiss_index import build_from_sql
        from index.search import Searcher

        settings = get_settings()
        factory = factory or settings.index_factory
        upgrade_to_head(settings.db_url)
        engine = make_engine(settings.db_url)
        try:
            sessions = make_sessionmaker(engine)
            start = time.perf_counter()
            # Unlike a starting service, an explicit build refuses a factory the gallery is
            # too small to train, instead of falling back to exact search.
            built = build_from_sql(sessions, factory, model_version=model_version,
                                   progress=progress)
            seconds = time.perf_counter() - start
            searcher = Searcher(
                built.index, model_version=built.manifest.model_version,
                factory=built.manifest.factory, infos=built.infos,
                change_seq=built.manifest.change_seq, session_factory=sessions,
                data_dir=settings.data_dir, use_gpu=False,
            )
            searcher.refresh_from_changes()
            folder = searcher.save()
        finally:
            engine.dispose()
        typer.echo(
            f"built {built.manifest.factory} index of model version "
            f"{built.manifest.model_version}: {searcher.size} vectors in {seconds:.1f}s "
            f"-> {folder}"
        )


def _safe(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
