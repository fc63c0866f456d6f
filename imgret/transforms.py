"""The only inference preprocessing: PIL RGB image -> normalised (3, S, S) float tensor.

Written on torch alone, step for step as torchvision's v2 kernels do it: importing torchvision
costs a server or CLI process about 1.3 s at start (it imports its detection ops, which import
torch's compiler), and a model without a torchvision trunk has no other use for it.
"""

from __future__ import annotations

import platform

import numpy as np
import torch
from PIL import Image
from torch.nn.functional import interpolate

from imgret.checkpoint import ModelSpec


class EvalTransform:
    """Resize to a square of ``spec.image_size``, to float, normalise with the spec's stats.

    A plain resize (no crop) keeps the whole object in view, which matters for retrieval of
    product photos and re-ID crops whose aspect ratio carries little information.

    The steps of ``v2.Compose([ToImage(), (Grayscale(3)), Resize((S, S), antialias=True),
    ToDtype(float32, scale=True), Normalize(mean, std)])``, as the torch calls those
    torchvision kernels make: equal output (``tests/unit/test_transforms.py``) without the
    per-call dispatch of five transform objects, most of the cost of preparing a small query
    (the search pipeline decodes every query in Python).
    The result is a plain tensor (not a ``tv_tensors.Image``).
    """

    def __init__(self, spec: ModelSpec):
        self.size = (spec.image_size, spec.image_size)
        self.grayscale = spec.grayscale
        self.mean = list(spec.mean)
        self.std = list(spec.std)
        self._grey_table: np.ndarray | None = None

    def __call__(self, image: Image.Image) -> torch.Tensor:
        x = _pil_to_tensor(image)
        if self.grayscale:
            x = _rgb_to_grey3(x)
        if tuple(x.shape[-2:]) != self.size:  # Resize returns an equal-size image unchanged
            x = _resize_bilinear_aa(x, self.size)
        x = x.to(torch.float32).mul_(1.0 / 255)
        mean = torch.as_tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
        return x.sub(mean).div_(std)

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


def _pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """uint8 ``(C, H, W)``, a channels-last view of a copy of the pixels (as torchvision's)."""
    x = torch.as_tensor(np.array(image, copy=True))
    return x.view(image.size[1], image.size[0], len(image.getbands())).permute((2, 0, 1))


def _rgb_to_grey3(x: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma, cast back to uint8 and repeated over 3 channels (torchvision's)."""
    r, g, b = x.unbind(dim=-3)
    grey = r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114)
    return grey.unsqueeze(dim=-3).to(x.dtype).expand(x.shape)


def _native_uint8_resize() -> bool:
    # torch resizes uint8 itself where it has a vectorised kernel; elsewhere through float32.
    return (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
            or platform.machine() in ("aarch64", "arm64"))


def _resize_bilinear_aa(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of a uint8 ``(C, H, W)`` image, as torchvision's."""
    channels, height, width = x.shape
    numel = x.numel()
    x = x.reshape(-1, channels, height, width)
    strides = x.stride()
    if x.is_contiguous(memory_format=torch.channels_last) and numel != strides[0]:
        # Keeps the output channels-last, as torchvision does (pytorch/pytorch#68430).
        x = x.as_strided((1, channels, height, width), [numel, *strides[1:]])
    cast = not _native_uint8_resize()
    if cast:
        x = x.to(torch.float32)
    x = interpolate(x, size=list(size), mode="bilinear", align_corners=False, antialias=True)
    if cast:
        x = x.round_().to(torch.uint8)
    return x.reshape(channels, *size)


def eval_transform(spec: ModelSpec) -> EvalTransform:
    """The inference preprocessing of a model spec (also training's ``augmentation: none``)."""
    return EvalTransform(spec)
