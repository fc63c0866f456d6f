"""The only inference preprocessing: PIL RGB image -> normalised (3, S, S) float tensor."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from imgret.checkpoint import ModelSpec


class EvalTransform:
    """Resize to a square of ``spec.image_size``, to float, normalise with the spec's stats.

    A plain resize (no crop) keeps the whole object in view, which matters for retrieval of
    product photos and re-ID crops whose aspect ratio carries little information.

    The steps of ``v2.Compose([ToImage(), (Grayscale(3)), Resize((S, S), antialias=True),
    ToDtype(float32, scale=True), Normalize(mean, std)])``, calling the same torchvision
    kernels directly: equal output (``tests/unit/test_transforms.py``) without the per-call
    dispatch of five transform objects, most of the cost of preparing a small query (the
    search pipeline decodes every query in Python).
    The result is a plain tensor (not a ``tv_tensors.Image``).
    """

    def __init__(self, spec: ModelSpec):
        self.size = (spec.image_size, spec.image_size)
        self.grayscale = spec.grayscale
        self.mean = list(spec.mean)
        self.std = list(spec.std)
        self._grey_table: np.ndarray | None = None

    def __call__(self, image: Image.Image) -> torch.Tensor:
        x = F.pil_to_tensor(image)
        if self.grayscale:
            x = F.rgb_to_grayscale(x, num_output_channels=3)
        if tuple(x.shape[-2:]) != self.size:  # Resize returns an equal-size image unchanged
            x = F.resize(x, list(self.size), antialias=True)
        x = F.to_dtype(x, torch.float32, scale=True)
        return F.normalize(x, mean=self.mean, std=self.std)

    def grey_table(self, height: int, width: int) -> np.ndarray | None:
        """``(3, 256)`` float32 array: what :meth:`__call__` makes of each grey level of an RGB
        image of ``height x width`` pixels with R = G = B (an ``L`` image converted to RGB,
        as greyscale arrays are decoded), or ``None`` when such an image would be resized (a
        resize mixes neighbouring pixels, so no per-pixel table exists).

        Without a resize every step is per pixel, so ``table[:, grey]`` equals the transform
        of the image exactly; the table is computed by :meth:`__call__` itself, on one image
        holding every level, so it cannot drift from it (``tests/unit/test_transforms.py``).
        In-memory greyscale data sets (the glyphs, Fashion-MNIST) use it to skip the PIL
        round trip of every image, most of the cost of a small model's epoch on a CPU.
        """
        if (height, width) != self.size or height * width < 256:
            return None
        if self._grey_table is None:
            levels = (np.arange(height * width) % 256).astype(np.uint8).reshape(height, width)
            out = self(Image.fromarray(levels, mode="L").convert("RGB"))
            self._grey_table = np.ascontiguousarray(out.reshape(3, -1)[:, :256].numpy())
        return self._grey_table

    def grey_tensor(self, pixels: np.ndarray) -> torch.Tensor | None:
        """``(H, W)`` or ``(n, H, W)`` uint8 greyscale -> ``(3, S, S)`` or ``(n, 3, S, S)``
        float32 through :meth:`grey_table`, equal to :meth:`__call__` of each image converted
        to RGB; ``None`` when there is no table (the caller falls back to PIL images). numpy's
        take: torch's advanced indexing costs a hundred times more on a small image."""
        table = self.grey_table(*pixels.shape[-2:])
        if table is None:
            return None
        channels_first = np.moveaxis(np.take(table, pixels, axis=1), 0, -3)
        return torch.from_numpy(np.ascontiguousarray(channels_first))


def eval_transform(spec: ModelSpec) -> EvalTransform:
    """The inference preprocessing of a model spec (also training's ``augmentation: none``)."""
    return EvalTransform(spec)
