"""Image sources: what ``--data`` names, as labelled images addressed by index.

Sources are read through ``imgret.datasets`` (ImageFolder, CSV manifest, Market-1501,
Fashion-MNIST idx files) or rendered (the glyph set, :mod:`imgret.training.data.glyphs`) and
decoded through ``imgret.images.load_image_file`` (the only
decode path). A missing or empty source, or an unreadable idx file, is a
:class:`imgret.datasets.DatasetError` naming the path (raised by the adapters); a CSV row
pointing nowhere is skipped with a warning (by the adapter); a file that fails to decode is
skipped with a warning naming it (by :func:`iter_images` for evaluation; the training
dataset substitutes another image of the same class).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from imgret.checkpoint import ModelSpec
from imgret.datasets import FASHION_MNIST_CLASSES, list_records, load_fashion_mnist
from imgret.errors import ImageDecodeError
from imgret.images import load_image_file
from imgret.training.config import FASHION_MNIST, TrainConfig, parse_glyphs

logger = logging.getLogger(__name__)

# Fashion-MNIST pixel statistics (train file), replicated to the 3 input channels.
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530


class ImageSource(Protocol):
    """Labelled images addressed by index.

    Attributes:
        name: what ``--data`` named (for messages and split.json).
        labels: ``(n,)`` object array of class names (str).
        cameras: ``(n,)`` int64 camera ids (re-ID data) or ``None``.
        grayscale: the images are greyscale (Fashion-MNIST, the glyphs).
        description: what a generated data set is (parameters, content hash), recorded in
            every run's split; ``(full=False)`` is the compact form. ``None`` for files.
    """

    name: str
    labels: np.ndarray
    cameras: np.ndarray | None
    grayscale: bool
    description: Callable[..., dict[str, Any]] | None

    def image(self, index: int) -> Image.Image:
        """The decoded RGB image; raises ``ImageDecodeError`` naming the file."""
        ...

    def describe(self, index: int) -> str:
        """A stable name of one item (its path, ``fashion-mnist[i]``, or ``U+6C38/ipaexg/2``:
        a glyph's character, face and distortion)."""
        ...


class FileImageSource:
    """Image files listed by ``imgret.datasets.list_records``."""

    grayscale = False
    description = None

    def __init__(self, name: str, records: Sequence[Any]):
        self.name = name
        self.paths = [Path(r.path) for r in records]
        self.labels = np.array([str(r.label) for r in records], dtype=object)
        cams = [r.camera for r in records]
        self.cameras = (
            np.array(cams, dtype=np.int64) if cams and all(c is not None for c in cams) else None
        )
        root = Path(name)
        self._root = root if root.is_dir() else root.parent

    def image(self, index: int) -> Image.Image:
        return load_image_file(self.paths[index])

    def describe(self, index: int) -> str:
        path = self.paths[index]
        with contextlib.suppress(ValueError):
            return str(path.relative_to(self._root))
        return str(path)


class ArrayImageSource:
    """Greyscale uint8 images in memory (Fashion-MNIST, the glyphs).

    Attributes:
        pixels: ``(n, H, W)`` uint8.
        official_test: ``(n,)`` bool, the image comes from the data set's own test file.
        stats: pixel mean and standard deviation in [0, 1] (the model's normalisation).
    """

    cameras = None
    grayscale = True

    def __init__(
        self, name: str, pixels: np.ndarray, labels: np.ndarray, official_test: np.ndarray,
        *, stats: tuple[float, float] = (FASHION_MEAN, FASHION_STD),
        item_name: Callable[[int], str] | None = None,
        description: Callable[..., dict[str, Any]] | None = None,
    ):
        self.name = name
        self.pixels = pixels
        self.labels = labels
        self.official_test = official_test
        self.stats = stats
        self._item_name = item_name
        self.description = description

    def image(self, index: int) -> Image.Image:
        # RGB like every decoded file, so the Embedder sees one kind of input.
        return Image.fromarray(self.pixels[index]).convert("RGB")

    def describe(self, index: int) -> str:
        if self._item_name is not None:
            return self._item_name(index)
        return f"{self.name}[{index}]"


def grey_pixels(source: ImageSource) -> np.ndarray | None:
    """The ``(n, H, W)`` uint8 array behind an in-memory greyscale source, else ``None`` (its
    images can then be preprocessed in bulk: ``imgret.transforms.EvalTransform.grey_tensor``)."""
    if isinstance(source, ArrayImageSource) and source.pixels.ndim == 3:
        return source.pixels
    return None


def open_source(data: str) -> ImageSource:
    """Open ``--data``: ``fashion-mnist[:FOLDER]``, ``glyphs[:KEY=VALUE,...]``, a folder, or
    a CSV manifest.

    Raises:
        DatasetError: missing or unreadable source (the message names the path), bad glyph
            options or missing fonts.
    """
    glyph_options = parse_glyphs(data)
    if glyph_options is not None:
        from imgret.training.data.glyphs import load_glyphs

        glyphs = load_glyphs(glyph_options)
        logger.info("%s: %d images of %d characters (%s; content %s)", data, len(glyphs.pixels),
                    len(glyphs.codepoints), glyphs.source, glyphs.content_hash[:16])
        return ArrayImageSource(
            data, glyphs.pixels, glyphs.labels, np.zeros(len(glyphs.pixels), bool),
            stats=glyphs.pixel_stats, item_name=glyphs.item_name,
            description=glyphs.description,
        )
    if data == FASHION_MNIST or data.startswith(FASHION_MNIST + ":"):
        root = data.split(":", 1)[1] if ":" in data else None
        train_x, train_y = load_fashion_mnist(root, "train")
        test_x, test_y = load_fashion_mnist(root, "test")
        names = np.array(FASHION_MNIST_CLASSES, dtype=object)
        return ArrayImageSource(
            data,
            np.concatenate([train_x, test_x]),
            names[np.concatenate([train_y, test_y])],
            np.concatenate([np.zeros(len(train_y), bool), np.ones(len(test_y), bool)]),
        )
    return FileImageSource(data, list_records(data))


def image_sizes(source: ImageSource, indices: np.ndarray) -> list[tuple[int, int]]:
    """``(width, height)`` of these items: an in-memory set's array shape, a file's header
    (PIL reads no pixels for it); an unreadable file is left out."""
    if isinstance(source, ArrayImageSource):
        height, width = source.pixels.shape[1:3]
        return [(int(width), int(height))] * len(indices)
    sizes = []
    for index in indices:
        try:
            if isinstance(source, FileImageSource):
                with Image.open(source.paths[int(index)]) as image:
                    sizes.append(image.size)
            else:
                sizes.append(source.image(int(index)).size)
        except (OSError, ValueError, ImageDecodeError, Image.DecompressionBombError):
            continue
    return sizes


def model_spec_for(config: TrainConfig, source: ImageSource) -> ModelSpec:
    """The ModelSpec of a run: greyscale sources get their own normalisation statistics
    (Fashion-MNIST's train file; the glyph set's own, over all its images); the embedding
    head's neck is the loss recipe's (``imgret.training.recipe``)."""
    from imgret.training.recipe import recipe_for

    neck = recipe_for(config).neck
    if source.grayscale:
        mean, std = getattr(source, "stats", (FASHION_MEAN, FASHION_STD))
        return ModelSpec(
            backbone=config.backbone, dim=config.dim, image_size=config.image_size,
            mean=(mean,) * 3, std=(std,) * 3, grayscale=True, neck=neck,
        )
    return ModelSpec(backbone=config.backbone, dim=config.dim, image_size=config.image_size,
                     neck=neck)


def iter_images(
    source: ImageSource, indices: np.ndarray, chunk: int = 256
) -> Iterator[tuple[np.ndarray, list[Image.Image]]]:
    """Decode source items in chunks for evaluation: yields ``(kept indices, images)``; bad
    files are skipped with a warning naming them (the caller keeps the labels of the kept
    indices only)."""
    for start in range(0, len(indices), chunk):
        kept, images = [], []
        for index in indices[start : start + chunk]:
            try:
                images.append(source.image(int(index)))
            except ImageDecodeError as exc:
                logger.warning("skipping undecodable evaluation image: %s", exc)
                continue
            kept.append(int(index))
        yield np.array(kept, dtype=np.int64), images
