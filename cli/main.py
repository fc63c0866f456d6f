"""The `imgret` command line: a Typer app whose commands live beside it in cli/.

Heavy libraries (torch, faiss, FastAPI) are imported inside each command, so `imgret --help`
starts instantly. Errors imgret raises on purpose are printed as one line naming the file and
the fix, without a traceback.
"""

from __future__ import annotations

import logging
import sys

import typer

from cli import backup, demo, gallery, models, serve, train
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

for module in (train, gallery, models, serve, demo, backup):
    module.register(app, db_app=db_app, index_app=index_app)


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app()
    except ImgretError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except FileNotFoundError as exc:
        typer.secho(f"error: {exc.filename}: file not found", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
