"""Render a many-class ImageFolder of letters, digits and signs, for `imgret train FOLDER`.

Not the glyph set (:mod:`imgret.training.data.glyphs`, CJK ideographs, white on black,
32 px, CJK fonts): here the classes are Latin, Greek and Cyrillic letters, digits and signs
(:data:`CHARACTERS`, characters that look alike across scripts left out: Latin ``A`` is in,
Greek ``Α`` and Cyrillic ``А`` are not), drawn from Debian's DejaVu and Liberation fonts
(:data:`FONTS`) in dark ink on a light background, as RGB PNGs of varying size (48-80 px a
side, not square), each with a seeded rotation, scale, shift, ink and paper shade. Every
image depends only on (character, font, copy, seed), so the same options write the same
files.

Layout: ``OUT/<U+XXXX>/<font>-<copy>.png`` and ``OUT/letters.json`` (classes, fonts,
options). Run: ``python benchmarks/render_letters.py OUT [--copies 2] [--seed 0]``, then
``imgret train OUT``.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

_DEJAVU = Path("/usr/share/fonts/truetype/dejavu")
_LIBERATION = Path("/usr/share/fonts/truetype/liberation")
# (key, file): Debian's fonts-dejavu-core / fonts-dejavu-extra and fonts-liberation; each
# covers every character below.
FONTS = (
    ("dejavu-sans", _DEJAVU / "DejaVuSans.ttf"),
    ("dejavu-sans-bold", _DEJAVU / "DejaVuSans-Bold.ttf"),
    ("dejavu-sans-oblique", _DEJAVU / "DejaVuSans-Oblique.ttf"),
    ("dejavu-sans-light", _DEJAVU / "DejaVuSans-ExtraLight.ttf"),
    ("dejavu-condensed", _DEJAVU / "DejaVuSansCondensed.ttf"),
    ("dejavu-serif", _DEJAVU / "DejaVuSerif.ttf"),
    ("dejavu-serif-bold", _DEJAVU / "DejaVuSerif-Bold.ttf"),
    ("dejavu-serif-italic", _DEJAVU / "DejaVuSerif-Italic.ttf"),
    ("dejavu-mono", _DEJAVU / "DejaVuSansMono.ttf"),
    ("liberation-sans", _LIBERATION / "LiberationSans-Regular.ttf"),
    ("liberation-sans-bold", _LIBERATION / "LiberationSans-Bold.ttf"),
    ("liberation-sans-italic", _LIBERATION / "LiberationSans-Italic.ttf"),
    ("liberation-serif", _LIBERATION / "LiberationSerif-Regular.ttf"),
    ("liberation-serif-italic", _LIBERATION / "LiberationSerif-Italic.ttf"),
    ("liberation-mono", _LIBERATION / "LiberationMono-Regular.ttf"),
    ("liberation-narrow", _LIBERATION / "LiberationSansNarrow-Regular.ttf"),
)
CHARACTERS = (
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    "abdefghijkmnpqrtuy"  # not c o s v w x z (their capitals at another scale), nor l
    "23456789"  # not 0 and 1 (O, I)
    "ΓΔΘΛΞΠΣΦΨΩ"
    "αβγδεζηθλμξπςστφχψω"  # not ρ (p)
    "БДЖИЙЛЦЧШЩЪЫЬЭЮЯ"
    "бгджзйлфцчшщъыьэюя"  # not и п т (u n m in italics)
    "&@#$%?!§¶€£¥+=<>"
)
SIDES = (48, 80)  # each side of an image, drawn uniformly
EM = (0.55, 0.8)  # the character's em, as a share of the shorter side


def render_one(char: str, font_path: Path, rng: np.random.Generator) -> Image.Image:
    """One image of one character: size, rotation, scale, shift and shades from ``rng``."""
    width, height = (int(v) for v in rng.integers(SIDES[0], SIDES[1] + 1, size=2))
    em = int(min(width, height) * rng.uniform(*EM))
    font = ImageFont.truetype(str(font_path), size=max(em, 8))
    big = Image.new("L", (2 * width, 2 * height), 0)
    draw = ImageDraw.Draw(big)
    draw.text((width, height), char, fill=255, font=font, anchor="mm")
    big = big.rotate(float(rng.uniform(-12, 12)), resample=Image.BILINEAR,
                     translate=tuple(int(v) for v in rng.integers(-em // 6, em // 6 + 1, 2)))
    ink = big.crop((width // 2, height // 2, width // 2 + width, height // 2 + height))
    paper = rng.uniform(200, 255, 3)
    pen = rng.uniform(0, 90, 3)
    alpha = np.asarray(ink, dtype=np.float64)[..., None] / 255
    pixels = paper * (1 - alpha) + pen * alpha + rng.normal(0, 4, (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def render(out: Path, copies: int, seed: int) -> None:
    """Write the folder (refuses a non-empty ``out``)."""
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: exists and is not empty")
    missing = [str(path) for _, path in FONTS if not path.is_file()]
    if missing:
        raise SystemExit(f"missing fonts (apt-get install fonts-dejavu fonts-liberation): "
                         f"{', '.join(missing)}")
    if len(set(CHARACTERS)) != len(CHARACTERS):
        raise SystemExit("CHARACTERS repeats a character")
    for char in CHARACTERS:
        folder = out / f"U+{ord(char):04X}"
        folder.mkdir(parents=True)
        for key, path in FONTS:
            for copy in range(copies):
                rng = np.random.default_rng([seed, ord(char), zlib.crc32(key.encode()), copy])
                render_one(char, path, rng).save(folder / f"{key}-{copy}.png")
    (out / "letters.json").write_text(json.dumps({
        "classes": {f"U+{ord(c):04X}": c for c in CHARACTERS},
        "fonts": {key: str(path) for key, path in FONTS},
        "copies": copies, "seed": seed, "sides": SIDES, "em": EM,
    }, indent=1, ensure_ascii=False), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--copies", type=int, default=2, help="images per character and font")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    render(args.out, args.copies, args.seed)
    print(f"{args.out}: {len(CHARACTERS)} classes x {len(FONTS) * args.copies} images")


if __name__ == "__main__":
    main()
