"""The training split as a torch ``Dataset``, and its augmentation.

A file that fails to decode is logged once and replaced by the next image of its class, so
one corrupt JPEG does not stop a long run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from imgret.checkpoint import ModelSpec
from imgret.datasets import DatasetError
from imgret.errors import ImageDecodeError
from imgret.training.data.sources import ImageSource, grey_pixels
from imgret.transforms import EvalTransform, eval_transform

logger = logging.getLogger(__name__)

# PIL image -> (3, S, S) float32 model input.
Transform = Callable[[Image.Image], torch.Tensor]


def train_transform(spec: ModelSpec, augmentation: str) -> Transform:
    """The training augmentation for a model spec.

    ``standard``: random resized crop (scale 0.5-1, so a small image keeps most of the object)
    + horizontal flip (+ mild colour jitter for colour data), then the same float conversion
    and normalisation as ``imgret.transforms.eval_transform``. ``none``: the eval transform.
    """
    if augmentation == "none":
        return eval_transform(spec)
    steps: list[v2.Transform] = [v2.ToImage()]
    if spec.grayscale:
        steps.append(v2.Grayscale(num_output_channels=3))
    steps += [
        v2.RandomResizedCrop((spec.image_size, spec.image_size), scale=(0.5, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
    ]
    if not spec.grayscale:
        steps.append(v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2))
    steps += [
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=list(spec.mean), std=list(spec.std)),
    ]
    return v2.Compose(steps)


class TrainDataset(Dataset):
    """The training split as ``(image (3, S, S) float32, label int64 in 0..C-1)`` pairs.

    A file that fails to decode is logged once and replaced by the next image of its class,
    so one corrupt JPEG does not stop a long run.

    Attributes:
        class_names: the training classes; label ``i`` is ``class_names[i]``.
        targets: ``(k,)`` int64 labels of the items (for the sampler).
    """

    def __init__(self, source: ImageSource, indices: np.ndarray, transform: Transform):
        self.source = source
        self.indices = np.asarray(indices, dtype=np.int64)
        self.transform = transform
        self.class_names = sorted(set(source.labels[self.indices].tolist()))
        lookup = {name: i for i, name in enumerate(self.class_names)}
        self.targets = np.array([lookup[x] for x in source.labels[self.indices]], dtype=np.int64)
        self._by_class = {c: np.flatnonzero(self.targets == c) for c in range(len(lookup))}
        self._bad: set[int] = set()
        pixels = grey_pixels(source)
        self._grey = (pixels is not None and isinstance(transform, EvalTransform)
                      and transform.grey_table(*pixels.shape[1:]) is not None)

    def shuffle_labels(self, rng: np.random.Generator) -> None:
        """Permute the labels over the items (the shuffled-labels control): every class keeps
        its size, but an item's label no longer says what it shows, so there is nothing to
        learn that transfers to unseen classes."""
        self.targets = rng.permutation(self.targets)
        self._by_class = {c: np.flatnonzero(self.targets == c)
                          for c in range(len(self.class_names))}

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> tuple[torch.Tensor, int]:
        label = int(self.targets[position])
        if self._grey:  # an in-memory greyscale array: per-pixel table, no PIL
            return self.transform.grey_tensor(self.source.pixels[self.indices[position]]), label
        candidates = self._by_class[label]
        start = int(np.searchsorted(candidates, position))
        for step in range(len(candidates)):
            pos = int(candidates[(start + step) % len(candidates)])
            if pos in self._bad:
                continue
            try:
                image = self.source.image(int(self.indices[pos]))
            except ImageDecodeError as exc:
                self._bad.add(pos)
                logger.warning("skipping undecodable training image: %s", exc)
                continue
            return self.transform(image), label
        raise DatasetError(
            f"{self.source.name}: no image of class {self.class_names[label]!r} can be decoded"
        )
