"""The only inference preprocessing: PIL RGB image -> normalised (3, S, S) float tensor."""

from __future__ import annotations

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

    def __call__(self, image: Image.Image) -> torch.Tensor:
        x = F.pil_to_tensor(image)
        if self.grayscale:
            x = F.rgb_to_grayscale(x, num_output_channels=3)
        if tuple(x.shape[-2:]) != self.size:  # Resize returns an equal-size image unchanged
            x = F.resize(x, list(self.size), antialias=True)
        x = F.to_dtype(x, torch.float32, scale=True)
        return F.normalize(x, mean=self.mean, std=self.std)


def eval_transform(spec: ModelSpec) -> EvalTransform:
    """The inference preprocessing of a model spec (also training's ``augmentation: none``)."""
    return EvalTransform(spec)
