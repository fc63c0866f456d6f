"""CLI commands: demo."""

from __future__ import annotations

import typer


def register(app: typer.Typer, *, db_app: typer.Typer, index_app: typer.Typer) -> None:
    """Add this area's commands to the CLI."""
