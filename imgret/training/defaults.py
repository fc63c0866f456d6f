"""What plain ``imgret train DATA`` chooses for the options it is not given.

``TrainConfig``'s own field defaults are what ``imgret benchmark``, ``imgret tune``, the
benchmark scripts and every saved config are read against; they do not change. The train
command alone starts from :data:`TRAIN_DEFAULTS`, chosen to fit a many-class image folder as
it comes on a 2-core CPU:

- **Trunk**: ``mobilenet_v2`` from the ImageNet weights the ``pretrained`` extra ships
  (:mod:`imgret.pretrained`); without that package, :data:`FALLBACK_BACKBONE` from random
  init, with a warning (:func:`default_trunk`). An explicit ``--backbone`` keeps random init
  unless ``--backbone-weights`` says otherwise.
- **Image size**: from the training images, not from the data set's name
  (:func:`auto_image_size`, applied by the training loop to ``TrainConfig.image_size=None``);
  at least :data:`PRETRAINED_MIN_SIDE` for a trunk that starts from ImageNet weights.
- **Augmentation**: none. The standard one (random resized crop + horizontal flip) changes
  what a character, a glyph or a logo is; ``--augmentation standard`` still asks for it.
- **Loss**: ``multi_similarity``; **budget**: :data:`DEFAULT_EPOCHS` epochs or
  :data:`DEFAULT_TIME_BUDGET_S` seconds of training, whichever ends first.

Imports nothing heavy: the CLI reads it before torch loads.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Iterable
from typing import Any

from imgret.pretrained import IMAGENET, PACKAGED

logger = logging.getLogger(__name__)

DEFAULT_BACKBONE = "mobilenet_v2"
# From random init when the packaged ImageNet weights are missing: the demo's network, which
# learns from scratch in a few CPU epochs (a scratch mobilenet_v2 did not learn in two).
FALLBACK_BACKBONE = "small_cnn"
DEFAULT_LOSS = "multi_similarity"
DEFAULT_EPOCHS = 8
# Training seconds (validation excluded) after which a default run stops, validates and tests:
# a big folder still ends on a CPU; a few thousand images at 64 px take 8 epochs well within.
DEFAULT_TIME_BUDGET_S = 600.0
# Fields of TrainConfig whose default the train command replaces (backbone and its weights
# are chosen together by default_trunk; image_size None = from the images).
TRAIN_DEFAULTS: dict[str, Any] = {
    "backbone": None, "backbone_weights": None, "image_size": None,
    "epochs": DEFAULT_EPOCHS, "time_budget_s": DEFAULT_TIME_BUDGET_S, "augmentation": "none",
}
# The automatic input side: the median of SAMPLE_IMAGES training images' sides (the side of a
# square of the image's pixel count, sqrt(w x h)), rounded to a multiple of SIDE_STEP and
# clamped to the backbone's range: small enough for a CPU, large enough for its downsampling.
SAMPLE_IMAGES = 256
SIDE_STEP = 16
IMAGE_SIZE_RANGE = (32, 128)
# small_cnn flattens a (S/4)^2 feature map: its head grows with the square of the side.
IMAGE_SIZE_RANGES = {"tiny_cnn": (32, 64), "small_cnn": (32, 64)}
# A trunk that starts from ImageNet weights gets small images upsampled to at least this
# side: its filters were learned on objects tens of pixels wide, and at 32 px mobilenet_v2's
# last feature map is 1 x 1. Measured on 200 glyph identities (32 px images; `imgret train`
# defaults, 8 epochs; test MAP@R on 100 unseen identities): 0.134 at 32 px, 0.404 at 64,
# 0.452 at 96 (the side benchmarks/pretrained_bench.py uses).
PRETRAINED_MIN_SIDE = 96


def image_size_range(backbone: str, pretrained: bool = False) -> tuple[int, int]:
    """``(smallest, largest)`` automatic input side for a backbone (``pretrained``: it
    starts from ImageNet weights, so small images are upsampled)."""
    low, high = IMAGE_SIZE_RANGES.get(backbone, IMAGE_SIZE_RANGE)
    if pretrained:
        low = min(max(low, PRETRAINED_MIN_SIDE), high)
    return low, high


def auto_image_size(sizes: Iterable[tuple[int, int]], backbone: str,
                    pretrained: bool = False) -> int:
    """The input side for images of these ``(width, height)``: the median of
    ``sqrt(width x height)``, rounded to a multiple of :data:`SIDE_STEP`, clamped to
    :func:`image_size_range`. Nothing to measure gives the range's lower end."""
    low, high = image_size_range(backbone, pretrained)
    sides = sorted(math.sqrt(w * h) for w, h in sizes)
    if not sides:
        return low
    middle = len(sides) // 2
    median = sides[middle] if len(sides) % 2 else (sides[middle - 1] + sides[middle]) / 2
    return min(max(SIDE_STEP * round(median / SIDE_STEP), low), high)


def pretrained_available(backbone: str = DEFAULT_BACKBONE) -> bool:
    """Whether the package that ships ``backbone``'s ImageNet weights is installed (found,
    not imported)."""
    try:
        return importlib.util.find_spec(PACKAGED[backbone].module) is not None
    except (ImportError, ValueError):
        return False


def default_trunk() -> tuple[str, str | None]:
    """``(backbone, backbone_weights)`` when neither is given: ``mobilenet_v2`` from its
    packaged ImageNet weights, else :data:`FALLBACK_BACKBONE` from random init (warned)."""
    if pretrained_available(DEFAULT_BACKBONE):
        return DEFAULT_BACKBONE, IMAGENET
    package = PACKAGED[DEFAULT_BACKBONE]
    logger.warning(
        "%s is not installed, so the default trunk falls back to %s from random init "
        "(slower to learn, weaker on unseen classes); install the ImageNet %s with "
        "pip install 'imgret[pretrained]' (make setup does), or choose --backbone",
        package.distribution, FALLBACK_BACKBONE, DEFAULT_BACKBONE)
    return FALLBACK_BACKBONE, None
