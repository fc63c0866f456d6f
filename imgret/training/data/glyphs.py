"""The glyph set: CJK ideographs rendered from Debian's fonts, one class per character.

Fashion-MNIST has 10 classes, too few for a class-disjoint metric-learning benchmark; this set
has thousands, built offline from font packages (``make system-deps`` installs them). What
varies inside a class is the *face* (:data:`FACES`: gothic, mincho, kai, ming, rounded, two
handwritings, a heavy Chinese sans) and a seeded *distortion* (affine, stroke weight, elastic
warp, blur, noise); what does not is the character.

- Classes: the CJK Unified Ideographs (U+4E00-U+9FFF) that every face's cmap covers and that
  every face draws with ink, ``classes`` of them evenly spaced over the sorted code points.
- Images: image ``j`` of a class is face ``j % F`` with distortion ``j // F`` (``F`` faces),
  greyscale 32 px, white ink on black (like MNIST). Every pixel depends only on (character,
  face, distortion index, seed): distortion ``k`` is the ``k``-th block of draws of a
  generator seeded with (seed, character, face), so the same options give byte-identical
  pixels, and asking for more images per class or more classes leaves the others as they
  were (except that more classes respace the chosen characters). The arithmetic is numpy
  elementwise and ``math`` on scalars (no BLAS, whose summation order depends on the CPU).
- Cache: ``<cache>/glyphs/glyphs-<key>.npz`` (:func:`cache_dir`), the key a hash of the fonts'
  sha256, the options, the distortion ranges, :data:`RENDERER_VERSION` and the versions of
  what draws (Pillow, FreeType, NumPy): a second open reads it back (its content hash
  checked), a change renders again.
- :meth:`GlyphSet.description`: class list, fonts (package, file, face, sha256, licence),
  parameters and one content hash of the pixels and labels, recorded in every run's split.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import time
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from imgret.datasets import DatasetError
from imgret.files import write_atomic
from imgret.training.config import GLYPHS, GlyphOptions
from imgret.training.data.distortion import (
    DISTORTIONS,
    IMAGE_SIZE,
    SUPERSAMPLE,
    distort,
    draw_distortions,
    stroke_levels,
)

logger = logging.getLogger(__name__)

# Bump when the rendering changes in a way the library versions do not capture.
RENDERER_VERSION = 1
CJK_UNIFIED = (0x4E00, 0x9FFF)
# The em of the font at the working size: leaves room for rotation, scale and translation.
EM_FRACTION = 0.72
# A drawn glyph with fewer inked working pixels than this is blank (a face maps the code point
# to an empty outline): such a character is not chosen.
MIN_INK_PIXELS = 20


@dataclass(frozen=True)
class Face:
    """One font face.

    Attributes:
        key: short stable name (item names, seeds).
        package: the Debian package that installs the file.
        path: the font file.
        index: the face inside a ``.ttc`` collection (0 for a ``.ttf``).
        licence: the font's licence (from the package's copyright file).
        style: what it looks like.
    """

    key: str
    package: str
    path: Path
    index: int
    licence: str
    style: str


_FONTS = Path("/usr/share/fonts")
# Chosen to look different from one another at 32 px and to keep the download small (about
# 44 MB of .debs): docs/training.md#the-glyph-set says what was left out and why.
FACES: tuple[Face, ...] = (
    Face("ipaexg", "fonts-ipaexfont-gothic", _FONTS / "opentype/ipaexfont-gothic/ipaexg.ttf",
         0, "IPA Font License 1.0", "Japanese gothic (sans)"),
    Face("ipaexm", "fonts-ipaexfont-mincho", _FONTS / "opentype/ipaexfont-mincho/ipaexm.ttf",
         0, "IPA Font License 1.0", "Japanese mincho (serif)"),
    Face("ukai", "fonts-arphic-ukai", _FONTS / "truetype/arphic/ukai.ttc",
         0, "Arphic Public License", "Chinese kai (brush), AR PL UKai CN"),
    Face("uming", "fonts-arphic-uming", _FONTS / "truetype/arphic/uming.ttc",
         0, "Arphic Public License", "Chinese ming (light serif), AR PL UMing CN"),
    Face("maru", "fonts-motoya-l-maruberi", _FONTS / "truetype/motoya-l-maruberi/MTLmr3m.ttf",
         0, "Apache-2.0", "Japanese rounded gothic, Motoya L Maru"),
    Face("seto", "fonts-seto", _FONTS / "truetype/seto/setofont.ttf",
         0, "OFL-1.1", "Japanese handwriting (felt pen), Seto"),
    Face("kiloji", "fonts-kiloji", _FONTS / "truetype/kiloji/kiloji.ttf",
         0, "BSD-3-Clause", "Japanese handwriting (thin longhand), Kiloji"),
    Face("microhei", "fonts-wqy-microhei", _FONTS / "truetype/wqy/wqy-microhei.ttc",
         0, "Apache-2.0 or GPL-3+ with font exception", "Chinese heavy sans, WenQuanYi Micro Hei"),
)


def cache_dir() -> Path:
    """Where rendered sets are kept: ``$IMGRET_CACHE_DIR``, else ``$XDG_CACHE_HOME/imgret``,
    else ``~/.cache/imgret``. Not the service's ``IMGRET_DATA_DIR``: that holds state worth a
    backup, and this is re-derivable."""
    if os.environ.get("IMGRET_CACHE_DIR"):
        return Path(os.environ["IMGRET_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "imgret"


def check_fonts(faces: Sequence[Face] = FACES) -> None:
    """Refuse missing font files, naming their packages and the fix.

    Raises:
        DatasetError: one or more font files are missing.
    """
    missing = [face for face in faces if not face.path.is_file()]
    if missing:
        packages = sorted({face.package for face in missing})
        raise DatasetError(
            f"{GLYPHS}: missing font files {', '.join(str(f.path) for f in missing)}; install "
            f"the Debian packages {' '.join(packages)} (`make system-deps`)"
        )


@dataclass
class GlyphSet:
    """A rendered glyph set.

    Attributes:
        pixels: ``(classes * per_class, 32, 32)`` uint8, class-major (image ``j`` of class
            ``c`` is row ``c * per_class + j``).
        codepoints: ``(classes,)`` int32, sorted.
        options: what was asked.
        faces: the faces, in rendering order.
        fonts: per face ``{key, package, file, face, sha256, licence, style}``.
        source: ``"cache"`` or ``"rendered"`` (how this open got the pixels).
    """

    pixels: np.ndarray
    codepoints: np.ndarray
    options: GlyphOptions
    faces: tuple[Face, ...]
    fonts: list[dict[str, Any]]
    source: str = "rendered"

    @property
    def per_class(self) -> int:
        return self.options.per_class

    @cached_property
    def class_names(self) -> np.ndarray:
        """``(classes,)`` object array ``U+4E00``-style names."""
        return np.array([f"U+{int(cp):04X}" for cp in self.codepoints], dtype=object)

    @cached_property
    def labels(self) -> np.ndarray:
        """``(n,)`` object array: each image's class name."""
        return np.repeat(self.class_names, self.per_class)

    def item_name(self, index: int) -> str:
        """``U+6C38/ipaexg/2``: class, face and distortion index of one image."""
        j = index % self.per_class
        face = self.faces[j % len(self.faces)]
        return f"{self.class_names[index // self.per_class]}/{face.key}/{j // len(self.faces)}"

    @cached_property
    def content_hash(self) -> str:
        """sha256 of the pixels, their shape and the code points (hence the labels)."""
        return _content_hash(self.pixels, self.codepoints)

    @cached_property
    def pixel_stats(self) -> tuple[float, float]:
        """Mean and standard deviation of the pixels in [0, 1] (the model's normalisation)."""
        x = self.pixels.astype(np.float64) / 255.0
        return float(x.mean()), float(x.std())

    def description(self, *, full: bool = True) -> dict[str, Any]:
        """What the set is: options, counts, fonts, parameters, content hash and (``full``)
        every class's code point and character. The compact form goes into each run's split
        summary (``metrics.json``); the full one into ``split.json`` and ``glyphs.json``."""
        mean, std = self.pixel_stats
        out: dict[str, Any] = {
            "name": GLYPHS, "spec": self.options.spec(), "content_hash": self.content_hash,
            "num_classes": len(self.codepoints), "per_class": self.per_class,
            "num_images": len(self.pixels), "image_size": IMAGE_SIZE,
            "faces": [face.key for face in self.faces],
            "pixel_mean": round(mean, 6), "pixel_std": round(std, 6),
        }
        if full:
            out["renderer"] = _renderer()
            out["distortions"] = {name: list(bounds) for name, bounds in DISTORTIONS.items()}
            out["fonts"] = self.fonts
            out["images_of_a_class"] = [
                {"n": j, "face": self.faces[j % len(self.faces)].key,
                 "distortion": j // len(self.faces)} for j in range(self.per_class)
            ]
            out["classes"] = [
                {"name": name, "codepoint": int(cp), "char": chr(int(cp))}
                for name, cp in zip(self.class_names, self.codepoints, strict=True)
            ]
        return out


# Sets read from the cache in this process, by (file, mtime, size): a tuning job opens the
# set once per fold run (hundreds of times), and reading and checking the file took 0.5 s of
# a fold run's 8. The arrays are made read-only, so sharing them is safe; at most 2 are kept.
_OPENED: dict[tuple[str, int, int], GlyphSet] = {}


def load_glyphs(
    options: GlyphOptions | None = None, *, faces: Sequence[Face] = FACES,
    cache: Path | None = None, use_cache: bool = True,
) -> GlyphSet:
    """The glyph set of ``options``: from the cache when its key matches, else rendered (and
    cached).

    Args:
        options: classes, images per class, seed (default :class:`GlyphOptions`).
        faces: the fonts (default :data:`FACES`).
        cache: the cache folder (default :func:`cache_dir`).
        use_cache: ``False`` renders without reading or writing the cache.

    Raises:
        DatasetError: missing fonts, ``per_class`` not a multiple of the number of faces, or
            more classes than the faces share.
    """
    options = options or GlyphOptions()
    faces = tuple(faces)
    if options.per_class % len(faces):
        lower = options.per_class // len(faces) * len(faces)
        raise DatasetError(
            f"{GLYPHS}: per_class={options.per_class} is not a multiple of the {len(faces)} "
            f"faces (each face draws every character equally often): use "
            + (f"{lower} or " if lower else "") + f"{lower + len(faces)}"
        )
    check_fonts(faces)
    fonts = [
        {"key": f.key, "package": f.package, "file": str(f.path), "face": f.index,
         "sha256": _file_sha256(f.path), "licence": f.licence, "style": f.style}
        for f in faces
    ]
    key_text = json.dumps({"renderer": _renderer(), "fonts": fonts,
                           "options": options.spec(), "distortions": DISTORTIONS},
                          sort_keys=True)
    path = (cache or cache_dir()) / GLYPHS / (
        f"glyphs-{hashlib.sha256(key_text.encode()).hexdigest()[:20]}.npz")
    if use_cache and path.is_file():
        stat = path.stat()
        opened_key = (str(path), stat.st_mtime_ns, stat.st_size)
        if opened_key in _OPENED:
            return _OPENED[opened_key]
        cached = _read_cache(path)
        if cached is not None:
            pixels, codepoints = cached
            for array in cached:
                array.setflags(write=False)  # shared by every later open in this process
            glyphs = GlyphSet(pixels, codepoints, options, faces, fonts, source="cache")
            if len(_OPENED) >= 2:
                _OPENED.clear()
            _OPENED[opened_key] = glyphs
            return glyphs
    start = time.perf_counter()
    codepoints, pixels = render(options, faces)
    glyphs = GlyphSet(pixels, codepoints, options, faces, fonts)
    logger.info("rendered %d glyph images (%d classes x %d) in %.1f s", len(pixels),
                len(codepoints), options.per_class, time.perf_counter() - start)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez_compressed(buffer, pixels=pixels, codepoints=codepoints,
                            content_hash=np.array(glyphs.content_hash))
        write_atomic(path, buffer.getvalue())
    return glyphs


def render(options: GlyphOptions, faces: Sequence[Face]) -> tuple[np.ndarray, np.ndarray]:
    """Choose the characters and draw every image (no cache).

    Returns:
        ``(codepoints (classes,) int32, pixels (classes * per_class, 32, 32) uint8)``.
    """
    from PIL import ImageFont

    fonts = [ImageFont.truetype(str(f.path), _em_px(), index=f.index,
                                layout_engine=ImageFont.Layout.BASIC) for f in faces]
    candidates = covered_codepoints(faces)
    if options.classes > len(candidates):
        raise DatasetError(
            f"{GLYPHS}: classes={options.classes}, but the {len(faces)} faces share only "
            f"{len(candidates)} CJK ideographs; ask for at most that many"
        )
    chosen: dict[int, list[np.ndarray]] = {}
    # Evenly spaced positions over the sorted common code points; a character that some face
    # draws blank gives way to the next one.
    for i in range(options.classes):
        position = (2 * i + 1) * len(candidates) // (2 * options.classes)
        while position < len(candidates):
            cp = candidates[position]
            position += 1
            if cp in chosen:
                continue
            drawn = [_draw(font, cp) for font in fonts]
            if all(int((d > 127).sum()) >= MIN_INK_PIXELS for d in drawn):
                chosen[cp] = drawn
                break
    if len(chosen) < options.classes:
        raise DatasetError(f"{GLYPHS}: only {len(chosen)} characters are drawn by every face; "
                           f"ask for at most that many classes")
    codepoints = sorted(chosen)
    pixels = np.empty((len(codepoints), options.per_class, IMAGE_SIZE, IMAGE_SIZE), np.uint8)
    face_seeds = [zlib.crc32(f.key.encode()) for f in faces]
    for start in range(0, len(codepoints), _CLASSES_PER_BATCH):
        batch = codepoints[start:start + _CLASSES_PER_BATCH]
        levels = stroke_levels(np.stack([d for cp in batch for d in chosen[cp]]))
        # One generator per (character, face): its k-th block of draws is distortion k,
        # whatever per_class is.
        rngs = [np.random.default_rng([options.seed, cp, face_seed])
                for cp in batch for face_seed in face_seeds]
        which = np.array([c * len(faces) + j % len(faces)
                          for c in range(len(batch)) for j in range(options.per_class)])
        draws = [draw_distortions(rngs[w]) for w in which]  # in (face, distortion) order
        pixels[start:start + len(batch)] = distort(levels, which, draws).reshape(
            len(batch), options.per_class, IMAGE_SIZE, IMAGE_SIZE)
    return np.array(codepoints, dtype=np.int32), pixels.reshape(-1, IMAGE_SIZE, IMAGE_SIZE)


# Classes distorted together (bounds memory: about 200 MB of float32 working arrays).
_CLASSES_PER_BATCH = 64


def covered_codepoints(faces: Sequence[Face]) -> list[int]:
    """The sorted CJK Unified Ideographs that every face's cmap maps."""
    return list(_covered(tuple(faces)))


@functools.cache
def _covered(faces: tuple[Face, ...]) -> tuple[int, ...]:
    from fontTools.ttLib import TTFont

    common: set[int] | None = None
    for face in faces:
        with TTFont(str(face.path), fontNumber=face.index, lazy=True) as font:
            # Placeholder glyph names: the real ones (post table) cost seconds and are unused.
            font.setGlyphOrder([f"g{i}" for i in range(font["maxp"].numGlyphs)])
            cmap = font["cmap"].getBestCmap() or {}
        covered = {cp for cp in cmap if CJK_UNIFIED[0] <= cp <= CJK_UNIFIED[1]}
        common = covered if common is None else common & covered
    return tuple(sorted(common or ()))


def _em_px() -> int:
    return int(round(EM_FRACTION * IMAGE_SIZE * SUPERSAMPLE))


def _draw(font: Any, codepoint: int) -> np.ndarray:
    """The glyph drawn at the working size, its ink box centred: ``(64, 64)`` uint8."""
    from PIL import Image, ImageDraw

    side = IMAGE_SIZE * SUPERSAMPLE
    canvas = Image.new("L", (2 * side, 2 * side), 0)
    ImageDraw.Draw(canvas).text((side, side), chr(codepoint), font=font, fill=255, anchor="mm")
    out = Image.new("L", (side, side), 0)
    box = canvas.getbbox()
    if box is not None:
        ink = canvas.crop(box)
        out.paste(ink, ((side - ink.width) // 2, (side - ink.height) // 2))
    return np.asarray(out)


def _read_cache(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached pixels and code points, or ``None`` (re-render) when the file is unreadable
    or its content no longer matches its hash."""
    try:
        with np.load(path) as data:
            pixels, codepoints = data["pixels"], data["codepoints"]
            expected = str(data["content_hash"])
    except (OSError, ValueError, KeyError, zlib.error, zipfile.BadZipFile) as exc:
        logger.warning("%s: unreadable glyph cache (%s); rendering again", path, exc)
        return None
    if _content_hash(pixels, codepoints) != expected:
        logger.warning("%s: glyph cache does not match its hash; rendering again", path)
        return None
    return pixels, codepoints


def _content_hash(pixels: np.ndarray, codepoints: np.ndarray) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(list(pixels.shape)).encode())
    digest.update(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes())
    digest.update(np.ascontiguousarray(codepoints, dtype="<i4").tobytes())
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _renderer() -> dict[str, Any]:
    """The renderer's version and the versions of what draws the pixels."""
    import PIL
    from PIL import features

    return {"version": RENDERER_VERSION, "pillow": PIL.__version__,
            "freetype": features.version("freetype2"), "numpy": np.__version__}


def write_image_folder(glyphs: GlyphSet, out: Path) -> Path:
    """Write the set as an ImageFolder: ``out/<U+XXXX>/<n>.png`` (``n`` = image of the class,
    face ``n % F``, distortion ``n // F``) and ``out/glyphs.json`` (the full description).

    Written into a sibling folder first and renamed into place, so ``out`` is whole or absent.

    Raises:
        DatasetError: ``out`` exists and is not an empty folder.
    """
    from PIL import Image

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DatasetError(f"{out}: exists and is not an empty folder; choose another OUT")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    partial.mkdir()
    try:
        width = len(str(glyphs.per_class - 1))
        for c, name in enumerate(glyphs.class_names):
            folder = partial / name
            folder.mkdir()
            for j in range(glyphs.per_class):
                Image.fromarray(glyphs.pixels[c * glyphs.per_class + j]).save(
                    folder / f"{j:0{width}d}.png")
        (partial / "glyphs.json").write_text(
            json.dumps(glyphs.description(), indent=1, ensure_ascii=False), encoding="utf-8")
        if out.exists():
            out.rmdir()
        partial.rename(out)
    except BaseException:
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out
