"""CLI commands: `imgret data glyphs OUT`, a generated data set written as an ImageFolder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from imgret.training.config import GlyphOptions

data_app = typer.Typer(help="Generated data sets, written as ImageFolder trees.",
                       no_args_is_help=True)
_DEFAULTS = GlyphOptions()


def register(app: typer.Typer, **_: typer.Typer) -> None:
    """Add this area's commands to the CLI."""
    app.add_typer(data_app, name="data")


@data_app.command("glyphs")
def glyphs_command(
    out: Annotated[Path, typer.Argument(help="new (or empty) folder to write")],
    classes: Annotated[int, typer.Option(
        "--classes", help="characters, one class each")] = _DEFAULTS.classes,
    per_class: Annotated[int, typer.Option(
        "--per-class", help="images per character (a multiple of the faces)")] = (
        _DEFAULTS.per_class),
    seed: Annotated[int, typer.Option("--seed", help="seeds the distortions")] = _DEFAULTS.seed,
) -> None:
    """Render the glyph set (CJK characters x Debian fonts x seeded distortions; the same one
    `--data glyphs:classes=N,per_class=N,seed=N` trains on) and write OUT/<U+XXXX>/<n>.png
    and OUT/glyphs.json (fonts, parameters, content hash, every class)."""
    options = GlyphOptions(classes=classes, per_class=per_class, seed=seed)

    from imgret.training.data.glyphs import load_glyphs, write_image_folder

    glyphs = load_glyphs(options)
    write_image_folder(glyphs, out)
    typer.echo(f"wrote {len(glyphs.pixels)} images of {len(glyphs.codepoints)} characters "
               f"({len(glyphs.faces)} faces x {per_class // len(glyphs.faces)} distortions) "
               f"to {out}; content {glyphs.content_hash[:16]} (`--data {options.spec()}`)")
