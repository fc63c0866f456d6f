"""The only inference preprocessing: PIL RGB image -> normalised (3, S, S) float tensor."""

from __future__ import annotations

import torch
from torchvision.transforms import v2

from imgret.checkpoint import ModelSpec


def eval_transform(spec: ModelSpec) -> v2.Compose:
    """Resize to a square of ``spec.image_size``, to float, normalise with the spec's stats.

    A plain resize (no crop) keeps the whole object in view, which matters for retrieval of
    product photos and re-ID crops whose aspect ratio carries little information.
    """
    steps: list[v2.Transform] = [v2.ToImage()]
    if spec.grayscale:
        steps.append(v2.Grayscale(num_output_channels=3))
    steps += [
        v2.Resize((spec.image_size, spec.image_size), antialias=True),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=list(spec.mean), std=list(spec.std)),
    ]
    return v2.Compose(steps)
