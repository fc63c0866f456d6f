"""CLI commands: the gallery database (`db upgrade|downgrade`), `ingest`, `index build` and
`media migrate`: each calls one function of ``imgret.cli.jobs.gallery``.

Settings (``IMGRET_DATABASE_URL``, ``IMGRET_DATA_DIR``, ``IMGRET_MODEL``, ``IMGRET_DEVICE``,
``IMGRET_INDEX_FACTORY``, ``IMGRET_MAX_IMAGE_PIXELS``) come from the environment; options
override them. Heavy modules are imported inside each command.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer, *, db_app: typer.Typer, index_app: typer.Typer) -> None:
    """Add this area's commands to the CLI."""
    media_app = typer.Typer(help="The stored images (IMGRET_MEDIA_BACKEND).",
                            no_args_is_help=True)
    app.add_typer(media_app, name="media")

    @media_app.command("migrate")
    def media_migrate(
        to: str = typer.Option(..., "--to", help="the backend to move the images into: "
                               "files (<data dir>/media) or database (media_blobs)"),
        progress: bool = typer.Option(True, "--progress/--no-progress"),
    ) -> None:
        """Move every stored image into the other media backend, leaving none behind; run it
        with the servers stopped, then start them with IMGRET_MEDIA_BACKEND set to the new
        backend. Safe to run again after an interruption.

        Refused, changing nothing, while any server holds the gallery's database (each holds
        a lock on it while it serves: imgret.gallery.storage.holders); servers do not start
        while it runs."""
        from imgret.cli.jobs import gallery as commands
        from imgret.gallery.storage.holders import hold_for_maintenance
        from imgret.settings import get_settings

        settings = get_settings()
        with hold_for_maintenance(settings.db_url, "imgret media migrate"):
            report = commands.migrate_media(settings, to, progress=progress)
        typer.echo(
            f"moved {report.moved} images from the {report.source} backend to the "
            f"{report.target} backend in {report.seconds:.1f}s ({report.missing} referenced "
            f"images were not in the {report.source} store; {report.leftovers} unreferenced "
            f"ones removed from it); now set IMGRET_MEDIA_BACKEND={report.target} on every "
            "process"
        )

    @db_app.command("upgrade")
    def db_upgrade() -> None:
        """Bring the database schema to the latest migration (Alembic `upgrade head`)."""
        from imgret.cli.jobs import gallery as commands
        from imgret.gallery.storage.db import safe_url
        from imgret.settings import get_settings

        settings = get_settings()
        revision = commands.upgrade(settings)
        typer.echo(f"database schema at revision {revision} ({safe_url(settings.db_url)})")

    @db_app.command("downgrade")
    def db_downgrade(
        revision: str = typer.Argument("base", help="target revision; base drops every table"),
        yes: bool = typer.Option(False, "--yes", help="confirm: this deletes data"),
    ) -> None:
        """Undo migrations down to REVISION (data in dropped tables is lost)."""
        from imgret.cli.jobs import gallery as commands
        from imgret.gallery.storage.db import safe_url
        from imgret.settings import get_settings

        settings = get_settings()
        commands.downgrade_to(settings, revision, confirmed=yes)
        typer.echo(f"database schema downgraded to {revision} "
                   f"({safe_url(settings.db_url)})")

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
            None, "--workers", min=1,
            help="processes decoding and (on the CPU) embedding files, each with one torch "
            "thread and its own batch in memory (default: one per core; with a GPU, min(4, "
            "cores) decoding only); "
            "with --ray: embed actors (default: one per GPU, else per free CPU of the cluster)",
        ),
        ray: str | None = typer.Option(
            None, "--ray", metavar="[ADDRESS]",
            help="ingest on Ray Data (extra `ray`): alone (after PATH), a local Ray instance; "
            "with ADDRESS, that cluster (auto, ray://host:10001); files and model must be on "
            "a path every node sees",
        ),
        progress: bool = typer.Option(True, "--progress/--no-progress"),
    ) -> None:
        """Embed a data set into the gallery (or a query set); running it again adds nothing."""
        from imgret.cli.jobs import gallery as commands
        from imgret.settings import get_settings

        report = commands.ingest(get_settings(), path, model=model, query_set=query_set,
                             batch_size=batch_size, chunk_size=chunk_size, workers=workers,
                             progress=progress, ray=ray)
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
        from imgret.cli.jobs import gallery as commands
        from imgret.settings import get_settings

        built = commands.build(get_settings(), factory=factory, model_version=model_version,
                           progress=progress)
        typer.echo(
            f"built {built.factory} index of model version {built.model_version}: "
            f"{built.size} vectors in {built.seconds:.1f}s -> {built.folder}"
        )
