"""imgret.transforms: the direct-kernel eval transform equals torchvision's composed one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from imgret.checkpoint import ModelSpec
from imgret.transforms import eval_transform


def _composed(spec: ModelSpec) -> v2.Compose:
    """The reference: the transform objects EvalTransform calls the kernels of."""
    steps: list[v2.Transform] = [v2.ToImage()]
    if spec.grayscale:
        steps.append(v2.Grayscale(num_output_channels=3))
    steps += [
        v2.Resize((spec.image_size, spec.image_size), antialias=True),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=list(spec.mean), std=list(spec.std)),
    ]
    return v2.Compose(steps)


def _image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


@pytest.mark.parametrize("spec", [
    ModelSpec(backbone="tiny_cnn", dim=64, image_size=28, mean=(0.286,) * 3, std=(0.353,) * 3,
              grayscale=True),
    ModelSpec(backbone="resnet18", dim=128, image_size=64),
], ids=["gray-28", "rgb-64"])
@pytest.mark.parametrize("size", [(28, 28), (64, 64), (13, 9), (97, 40), (300, 301)])
def test_eval_transform_equals_the_composed_torchvision_transform(spec, size) -> None:
    image = _image(*size, seed=size[0] * 1000 + size[1])
    ours = eval_transform(spec)(image)
    reference = _composed(spec)(image)
    assert ours.shape == (3, spec.image_size, spec.image_size)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, reference.as_subclass(torch.Tensor))


@pytest.mark.parametrize("spec", [
    ModelSpec(backbone="small_cnn", dim=64, image_size=32, mean=(0.159,) * 3,
              std=(0.264,) * 3, grayscale=True),
    ModelSpec(backbone="resnet18", dim=128, image_size=32),
], ids=["gray-32", "rgb-32"])
def test_the_grey_table_equals_the_transform_of_every_image(spec) -> None:
    """In-memory greyscale arrays skip PIL through the table; it must give the very tensors
    the transform gives the decoded RGB image, at every grey level."""
    transform = eval_transform(spec)
    pixels = np.random.default_rng(3).integers(0, 256, (6, 32, 32), dtype=np.uint8)
    pixels[0] = np.arange(32 * 32).reshape(32, 32) % 256  # every level once
    batch = transform.grey_tensor(pixels)
    expected = torch.stack([transform(Image.fromarray(p, "L").convert("RGB")) for p in pixels])
    assert batch.shape == (6, 3, 32, 32)
    assert torch.equal(batch, expected)
    assert torch.equal(transform.grey_tensor(pixels[2]), expected[2])


def test_no_grey_table_where_the_transform_resizes() -> None:
    spec = ModelSpec(backbone="small_cnn", dim=64, image_size=32, grayscale=True)
    transform = eval_transform(spec)
    assert transform.grey_table(28, 28) is None  # a resize mixes pixels: no per-pixel table
    assert transform.grey_tensor(np.zeros((2, 28, 28), np.uint8)) is None
    assert transform.grey_table(32, 32) is not None
