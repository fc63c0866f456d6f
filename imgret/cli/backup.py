"""CLI commands `imgret backup DEST` and `imgret restore SRC`: each calls one function of
``imgret.gallery.backup`` (the same code as ``POST /admin/backup``).

Settings (``IMGRET_DATABASE_URL``, ``IMGRET_DATA_DIR``, ``IMGRET_DEVICE``, and the retention
and free-space rules ``IMGRET_BACKUP_KEEP``, ``IMGRET_BACKUP_MAX_BYTES``,
``IMGRET_BACKUP_FREE_MARGIN_BYTES``, the same as ``POST /admin/backup``'s) come from the
environment. Retention applies to the folder that holds DEST: only complete imgret backups
there are counted and ever removed. Errors are one line naming the folder and the fix
(``imgret.errors.ImgretError``).
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer, **_groups: typer.Typer) -> None:
    """Add this area's commands to the CLI."""

    @app.command("backup")
    def backup_command(
        dest: Path = typer.Argument(..., help="a new folder to write the backup into"),
        prune: bool = typer.Option(
            True, "--prune/--no-prune",
            help="after the backup, remove the oldest imgret backups beside DEST past "
                 "IMGRET_BACKUP_KEEP / IMGRET_BACKUP_MAX_BYTES (never DEST)",
        ),
    ) -> None:
        """Back up the database, the media files it refers to, the model checkpoints and the
        indexes, consistently, while the service keeps serving (writes pause for milliseconds).
        Every collection, or with --collection NAME that one alone (and an empty default).

        Refused, with nothing written, when the volume would keep less than
        IMGRET_BACKUP_FREE_MARGIN_BYTES free."""
        from imgret.gallery.backup import create_backup, prune_backups
        from imgret.settings import get_settings

        settings = get_settings()
        report = create_backup(settings, dest, on_phase=_phase)
        if prune:
            for old in prune_backups(Path(report.path).parent, keep=settings.backup_keep,
                                     max_bytes=settings.backup_max_bytes, protect=report.path):
                typer.echo(f"  removed the old backup {old}", err=True)
        typer.echo(
            f"backup of {report.database} (revision {report.alembic_revision}) -> {report.path}: "
            f"{report.gallery_items} gallery items, {report.query_items} query items, "
            f"{report.media_files} media files, {len(report.model_versions)} model versions, "
            f"{len(report.indexes)} indexes, {report.bytes / 1e6:.1f} MB in "
            f"{report.seconds:.1f}s (writes paused {report.write_pause_ms:.1f} ms)"
        )

    @app.command("restore")
    def restore_command(
        src: Path = typer.Argument(..., help="a backup folder made by `imgret backup`"),
        check: bool = typer.Option(
            False, "--check", help="only verify the backup's checksums; write nothing"
        ),
    ) -> None:
        """Restore a backup into an empty data dir and an empty database (SQLite or
        PostgreSQL, whatever the backup came from), after verifying every checksum."""
        from imgret.gallery.backup import restore_backup, verify_backup
        from imgret.settings import get_settings

        if check:
            backup = verify_backup(src)
            snap = backup.snapshot
            typer.echo(f"{backup.path}: complete, every checksum holds "
                       f"({len(backup.document['files'])} files, {snap['gallery_items']} gallery "
                       f"items, revision {backup.revision})")
            return
        settings = get_settings()
        report = restore_backup(settings, src, on_phase=_phase)
        indexes = ", ".join(f"{v} {state}" for v, state in report.indexes.items()) or "none"
        typer.echo(
            f"restored {src} into {report.database} and {settings.data_dir}: "
            f"{report.gallery_items} gallery items, {report.media_files} media files, active "
            f"model {report.active_version}, indexes: {indexes} ({report.seconds:.1f}s)"
        )


def _phase(name: str) -> None:
    typer.echo(f"  {name}", err=True)
