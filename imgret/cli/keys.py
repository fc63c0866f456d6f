"""CLI commands: `imgret keys create|list|revoke`, the twins of ``/keys``."""

from __future__ import annotations

import json

import typer

keys_app = typer.Typer(help="API keys: roles per collection, stored hashed.",
                       no_args_is_help=True)


def register(app: typer.Typer, **_: typer.Typer) -> None:
    """Add this area's commands to the CLI."""
    app.add_typer(keys_app, name="keys")


def _settings():
    from imgret.settings import get_settings

    return get_settings()


def parse_roles(values: list[str]) -> dict[str, str]:
    """``["shop=read", "cams=write"]`` -> ``{"shop": "read", "cams": "write"}``.

    Raises:
        ImgretError: a value without ``=``, or a collection named twice.
    """
    from imgret.errors import ImgretError

    roles: dict[str, str] = {}
    for value in values:
        collection, sep, role = value.partition("=")
        if not sep or collection in roles:
            raise ImgretError(f"--role {value!r}: give COLLECTION=read|write|admin, each "
                              "collection once")
        roles[collection] = role
    return roles


@keys_app.command("create")
def create_command(
    name: str = typer.Argument(..., help="who or what holds the key"),
    role: list[str] = typer.Option([], "--role", help="COLLECTION=read|write|admin "
                                                      "(repeat for several collections)"),
    admin: bool = typer.Option(False, "--admin", help="every role on every collection, and "
                                                      "collections, keys and backups"),
) -> None:
    """Create a key and print it once (only its hash is stored)."""
    from imgret.cli.jobs import gallery as commands
    from imgret.errors import ImgretError

    try:
        record, key = commands.create_key(_settings(), name, roles=parse_roles(role),
                                          admin=admin)
    except ValueError as exc:
        raise ImgretError(str(exc)) from None
    typer.echo(f"created key {record.id} ({record.name}); send it as the X-API-Key header. "
               "It is shown once:")
    typer.echo(key)


@keys_app.command("list")
def list_command(
    as_json: bool = typer.Option(False, "--json", help="print GET /keys's JSON"),
) -> None:
    """Every key with its roles (revoked ones too; never a secret)."""
    from imgret.cli.jobs import gallery as commands

    records = [r.to_dict() for r in commands.list_keys(_settings())]
    if as_json:
        typer.echo(json.dumps({"keys": records}, default=str, indent=2))
        return
    typer.echo("| id | name | roles | revoked |")
    typer.echo("|---:|---|---|---|")
    for r in records:
        roles = "admin (all)" if r["admin"] else ", ".join(
            f"{c}={role}" for c, role in sorted(r["roles"].items()))
        typer.echo(f"| {r['id']} | {r['name']} | {roles} | {r['revoked_at'] or ''} |")


@keys_app.command("revoke")
def revoke_command(key_id: int = typer.Argument(..., min=1, help="the key's id")) -> None:
    """Revoke a key for good; every server refuses it within its follower interval."""
    from imgret.cli.jobs import gallery as commands

    record = commands.revoke_key(_settings(), key_id)
    typer.echo(f"revoked key {record.id} ({record.name})")
