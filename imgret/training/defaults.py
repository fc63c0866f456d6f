"""Defaults chosen from the data rather than from its name.

- **Image size**: ``TrainConfig.image_size=None`` is measured on the training images by the
  training loop (:func:`auto_image_size`), and the run saves the side it chose.

Imports nothing heavy: the CLI reads it before torch loads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# The automatic input side: the median of SAMPLE_IMAGES training images' sides (the side of a
# square of the image's pixel count, sqrt(w x h)), rounded to a multiple of SIDE_STEP and
# clamped to the backbone's range: small enough for a CPU, large enough for its downsampling.
SAMPLE_IMAGES = 256
SIDE_STEP = 16
IMAGE_SIZE_RANGE = (32, 128)
# small_cnn flattens a (S/4)^2 feature map: its head grows with the square of the side.
IMAGE_SIZE_RANGES = {"tiny_cnn": (32, 64), "small_cnn": (32, 64)}


def image_size_range(backbone: str) -> tuple[int, int]:
    """``(smallest, largest)`` automatic input side for a backbone."""
    return IMAGE_SIZE_RANGES.get(backbone, IMAGE_SIZE_RANGE)


def auto_image_size(sizes: Iterable[tuple[int, int]], backbone: str) -> int:
    """The input side for images of these ``(width, height)``: the median of
    ``sqrt(width x height)``, rounded to a multiple of :data:`SIDE_STEP`, clamped to
    :func:`image_size_range`. Nothing to measure gives the range's lower end."""
    low, high = image_size_range(backbone)
    sides = sorted(math.sqrt(w * h) for w, h in sizes)
    if not sides:
        return low
    middle = len(sides) // 2
    median = sides[middle] if len(sides) % 2 else (sides[middle - 1] + sides[middle]) / 2
    return min(max(SIDE_STEP * round(median / SIDE_STEP), low), high)
