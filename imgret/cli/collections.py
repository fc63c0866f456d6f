"""CLI commands: `imgret collections list|create|delete`, the twins of ``/collections``; and
the global ``--collection NAME`` that points the gallery, model and evaluation commands at
one collection (``IMGRET_COLLECTION``; default: ``default``)."""

from __future__ import annotations

import json

import typer

collections_app = typer.Typer(help="Collections: named galleries with their own items, "
                                   "versions and index.", no_args_is_help=True)


def register(app: typer.Typer, **_: typer.Typer) -> None:
    """Add this area's commands to the CLI."""
    app.add_typer(collections_app, name="collections")


def _settings():
    from imgret.settings import get_settings

    return get_settings()


@collections_app.command("list")
def list_command(
    as_json: bool = typer.Option(False, "--json", help="print GET /collections's JSON"),
) -> None:
    """Every collection: its live items, served version and whether reads are public."""
    from imgret.cli.jobs import gallery as commands

    listing = [info.to_dict() for info in commands.list_collections(_settings())]
    if as_json:
        typer.echo(json.dumps({"collections": listing}, default=str, indent=2))
        return
    typer.echo("| collection | items | version | public |")
    typer.echo("|---|---:|---|---|")
    for info in listing:
        typer.echo(f"| {info['name']} | {info['items']} | {info['active_version'] or ''} | "
                   f"{'yes' if info['public'] else 'no'} |")


@collections_app.command("create")
def create_command(
    name: str = typer.Argument(..., help="1-64 lower-case letters, digits, '-' or '_'"),
    version: str = typer.Option(None, "--model-version",
                                help="a stored version to serve (default: the default "
                                     "collection's)"),
    private: bool = typer.Option(False, "--private", help="reads need a key too"),
) -> None:
    """Create an empty collection; fill it with `imgret --collection NAME ingest PATH`."""
    from imgret.cli.jobs import gallery as commands

    info = commands.create_collection(_settings(), name, version=version, public=not private)
    typer.echo(f"created collection {info.name} serving {info.active_version}")


@collections_app.command("delete")
def delete_command(
    name: str = typer.Argument(..., help="the collection to delete, with all it holds"),
    yes: bool = typer.Option(False, "--yes", help="confirm: items, vectors, images, query "
                                                 "sets and versions are deleted for good"),
) -> None:
    """Delete a collection and everything it holds (not `default`)."""
    from imgret.cli.jobs import gallery as commands
    from imgret.errors import ImgretError

    if not yes:
        raise ImgretError(f"deleting collection {name} removes all it holds for good; "
                          "add --yes to confirm")
    items = commands.delete_collection(_settings(), name)
    typer.echo(f"deleted collection {name} ({items} items)")
