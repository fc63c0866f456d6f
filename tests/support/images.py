"""Seeded synthetic images: each class has its own colour and stripe pattern."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def class_image(label: int, index: int, *, size: int = 32, seed: int = 0) -> Image.Image:
    """An RGB image of class ``label``: a class colour + stripes, with per-image noise."""
    rng = np.random.default_rng([seed, label, index])
    base = np.array([(label * 67) % 256, (label * 131) % 256, (label * 29 + 80) % 256], float)
    y, x = np.mgrid[0:size, 0:size]
    period = 3 + label % 5
    stripes = ((x + (label % 3) * y) // period % 2)[..., None] * 60.0
    pixels = base + stripes + rng.normal(0, 12, (size, size, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"), "RGB")


def glyph_image(label: int, index: int, *, size: int = 32, seed: int = 0) -> Image.Image:
    """A "glyph" of class ``label``: three strokes of a class prototype, drawn per image with
    a shift, moved endpoints, a random width and pixel noise. Unlike :func:`class_image`,
    raw pixels do not solve a many-class set of these, and a network has something to
    learn (strokes, not colours)."""
    proto = np.random.default_rng([seed, label, 99]).uniform(0.15, 0.85, (3, 4))
    rng = np.random.default_rng([seed, label, index, 1])
    points = proto + rng.normal(0, 0.05, proto.shape) + np.tile(rng.normal(0, 0.07, 2), 2)
    canvas = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(canvas)
    width = int(rng.integers(1, max(2, size // 10) + 1))
    for x0, y0, x1, y1 in np.clip(points, 0, 1) * (size - 1):
        draw.line([(x0, y0), (x1, y1)], fill=255, width=width)
    pixels = np.asarray(canvas, dtype=float) + rng.normal(0, 30, (size, size))
    return Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"), "L").convert("RGB")


def write_glyph_folder(
    root: Path, *, classes: int = 40, per_class: int = 8, size: int = 32, seed: int = 0
) -> Path:
    """An ImageFolder tree of :func:`glyph_image` classes ``root/glyph_<c>/<i>.png``."""
    for label in range(classes):
        folder = root / f"glyph_{label:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            glyph_image(label, index, size=size, seed=seed).save(folder / f"{index:03d}.png")
    return root


def image_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def write_image_folder(
    root: Path, *, classes: int = 4, per_class: int = 5, size: int = 32, seed: int = 0
) -> Path:
    """An ImageFolder tree ``root/class_<c>/<i>.png``; returns ``root``."""
    for label in range(classes):
        folder = root / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            class_image(label, index, size=size, seed=seed).save(folder / f"{index:03d}.png")
    return root


def write_market_folder(
    root: Path, *, identities: int = 6, cameras: int = 3, per_camera: int = 2, size: int = 32
) -> Path:
    """A Market-1501-style folder (bounding_box_train, bounding_box_test, query).

    File names follow ``<pid>_c<cam>s1_<frame>_<det>.jpg``; the test gallery also gets junk
    (pid -1) and distractor (pid 0000) images, as in the real data set.
    """
    for split in ("bounding_box_train", "bounding_box_test", "query"):
        (root / split).mkdir(parents=True, exist_ok=True)
    frame = 0
    for pid in range(1, identities + 1):
        split = "bounding_box_train" if pid <= identities // 2 else "bounding_box_test"
        for cam in range(1, cameras + 1):
            for j in range(per_camera):
                frame += 1
                name = f"{pid:04d}_c{cam}s1_{frame:06d}_{j:02d}.jpg"
                class_image(pid, frame, size=size).save(root / split / name)
        if split == "bounding_box_test":
            frame += 1
            class_image(pid, frame, size=size).save(
                root / "query" / f"{pid:04d}_c1s1_{frame:06d}_00.jpg"
            )
    class_image(900, 0, size=size).save(root / "bounding_box_test" / "-1_c1s1_000001_00.jpg")
    class_image(901, 0, size=size).save(root / "bounding_box_test" / "0000_c2s1_000002_00.jpg")
    return root
