"""The `imgret` command line: a Typer app whose commands live beside it in imgret/cli/.

Heavy libraries (torch, faiss, FastAPI) are imported inside each command, so `imgret --help`
starts instantly. Errors imgret raises on purpose are printed as one line naming the file and
the fix, without a traceback.
"""

from __future__ import annotations

import logging
import os
import sys

import typer
from pydantic import ValidationError

from imgret.cli import (
    backup,
    collections,
    data,
    demo,
    evaluate,
    gallery,
    keys,
    models,
    serve,
    train,
)
from imgret.errors import ImgretError

app = typer.Typer(
    name="imgret",
    help="Image retrieval: train embeddings, index a gallery, search and evaluate over HTTP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema (Alembic).", no_args_is_help=True)
index_app = typer.Typer(help="The FAISS index derived from the gallery.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(index_app, name="index")

for module in (train, data, gallery, models, serve, evaluate, demo, backup, collections,
               keys):
    module.register(app, db_app=db_app, index_app=index_app)


@app.callback()
def _global_options(
    collection: str = typer.Option(
        None, "--collection", envvar="IMGRET_COLLECTION", show_default="default",
        help="the collection the gallery, model and evaluation commands work in "
             "(may also follow the command: `imgret ingest PATH --collection NAME`)"),
) -> None:
    if collection:
        os.environ["IMGRET_COLLECTION"] = collection


def hoist_collection(args: list[str]) -> list[str]:
    """``args`` with ``--collection NAME`` (or ``--collection=NAME``) moved before the
    command, wherever it was given: it is one option of the whole CLI."""
    rest: list[str] = []
    hoisted: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--collection" and i + 1 < len(args):
            hoisted += args[i:i + 2]
            i += 2
            continue
        if arg.startswith("--collection="):
            hoisted.append(arg)
        else:
            rest.append(arg)
        i += 1
    return hoisted + rest


# Options whose value may be left out (`imgret ingest PATH --ray [ADDRESS]`), and the value
# they then take. Typer has no optional-value options, so the command line is completed
# before it parses it.
OPTIONAL_VALUES = {"--ray": "local"}


def complete_optional_values(args: list[str]) -> list[str]:
    """``args`` with the value of each :data:`OPTIONAL_VALUES` option filled in where it is
    left out (the option ends the line or another option follows it)."""
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        following = args[i + 1] if i + 1 < len(args) else None
        if arg in OPTIONAL_VALUES and (following is None or following.startswith("-")):
            out.append(OPTIONAL_VALUES[arg])
    return out


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app(args=hoist_collection(complete_optional_values(sys.argv[1:])))
    except ImgretError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except FileNotFoundError as exc:
        typer.secho(f"error: {exc.filename}: file not found", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except ValidationError as exc:
        if exc.title != "Settings":  # only the environment's settings are the user's input
            raise
        typer.secho(f"error: {settings_problem(exc)}", fg=typer.colors.RED, err=True)
        sys.exit(2)


def settings_problem(exc: ValidationError) -> str:
    """One line for invalid ``IMGRET_*`` settings: each variable and what it should be (the
    value itself is not repeated)."""
    return "; ".join(
        f"IMGRET_{'_'.join(str(part) for part in error['loc']).upper()}: {error['msg']}"
        for error in exc.errors())


if __name__ == "__main__":
    main()
