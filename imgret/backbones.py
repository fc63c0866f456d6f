"""Backbones: name -> a torchvision trunk that maps (n, 3, H, W) images to (n, features)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from imgret.errors import CheckpointError, UnknownName
from imgret.pretrained import IMAGENET, load_packaged_weights


def _two_convs() -> list[nn.Module]:
    return [
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
    ]


def _tiny_cnn(image_size: int) -> tuple[nn.Module, int]:
    # A few thousand parameters: fast enough for tests and CI on a 2-core CPU.
    return nn.Sequential(*_two_convs(), nn.AdaptiveAvgPool2d(1), nn.Flatten()), 32


def _small_cnn(image_size: int) -> tuple[nn.Module, int]:
    # tiny_cnn's two convolutions, but the feature map is flattened instead of averaged: where
    # a stroke is matters for small centred images (Fashion-MNIST), and averaging loses it
    # (the demo's lesson). 32 x (S/4)^2 features: meant for inputs of a few dozen pixels.
    trunk = nn.Sequential(*_two_convs(), nn.MaxPool2d(2), nn.Flatten())
    return trunk, 32 * (image_size // 4) ** 2


def _resnet(name: str) -> Callable[[int], tuple[nn.Module, int]]:
    def build(image_size: int) -> tuple[nn.Module, int]:
        import torchvision.models as tvm

        model = getattr(tvm, name)(weights=None)
        features = model.fc.in_features
        model.fc = nn.Identity()
        return model, features

    return build


def _efficientnet_b0(image_size: int) -> tuple[nn.Module, int]:
    import torchvision.models as tvm

    model = tvm.efficientnet_b0(weights=None)
    features = model.classifier[1].in_features
    model.classifier = nn.Identity()
    return model, features


def _mobilenet_v2(image_size: int) -> tuple[nn.Module, int]:
    import torchvision.models as tvm

    # features, global average pooling, then the classifier (dropout + linear), dropped.
    model = tvm.mobilenet_v2(weights=None)
    features = model.classifier[1].in_features
    model.classifier = nn.Identity()
    return model, features


def _convnext_tiny(image_size: int) -> tuple[nn.Module, int]:
    import torchvision.models as tvm

    model = tvm.convnext_tiny(weights=None)
    features = model.classifier[2].in_features
    model.classifier[2] = nn.Identity()
    return model, features


def _vit_b_16(image_size: int) -> tuple[nn.Module, int]:
    import torchvision.models as tvm

    # ViT's position embeddings are sized for one image size, given at construction.
    model = tvm.vit_b_16(weights=None, image_size=image_size)
    features = model.heads.head.in_features
    model.heads = nn.Identity()
    return model, features


BACKBONES: dict[str, Callable[[int], tuple[nn.Module, int]]] = {
    "tiny_cnn": _tiny_cnn,
    "small_cnn": _small_cnn,
    "resnet18": _resnet("resnet18"),
    "resnet50": _resnet("resnet50"),
    "efficientnet_b0": _efficientnet_b0,
    "mobilenet_v2": _mobilenet_v2,
    "convnext_tiny": _convnext_tiny,
    "vit_b_16": _vit_b_16,
}


def build_backbone(
    name: str, *, image_size: int, weights: str | Path | None = None
) -> tuple[nn.Module, int]:
    """Build a trunk without its classifier.

    Args:
        name: a key of :data:`BACKBONES`.
        image_size: the square input size (ViT needs it at construction).
        weights: optional local file of torchvision weights (a state dict, e.g. the
            ``resnet18-f37072fd.pth`` file torchvision would download), or ``"imagenet"``:
            the ImageNet weights an installed package ships (:mod:`imgret.pretrained`).
            Nothing is downloaded.

    Returns:
        ``(trunk, feature_dim)``.
    """
    if name not in BACKBONES:
        raise UnknownName("backbone", name, list(BACKBONES))
    trunk, features = BACKBONES[name](image_size)
    if weights == IMAGENET:
        load_packaged_weights(trunk, name)
    elif weights is not None:
        load_backbone_weights(trunk, Path(weights))
    return trunk, features


def load_backbone_weights(trunk: nn.Module, path: Path) -> None:
    """Load a local state dict into a trunk, ignoring only the dropped classifier's keys."""
    if not path.is_file():
        raise CheckpointError(f"{path}: backbone weights file not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        raise CheckpointError(f"{path}: not a torch state dict ({exc})") from None
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    result = trunk.load_state_dict(state, strict=False)
    classifier = ("fc.", "classifier.", "heads.")
    unexpected = [k for k in result.unexpected_keys if not k.startswith(classifier)]
    if result.missing_keys or unexpected:
        raise CheckpointError(
            f"{path}: weights do not fit this backbone "
            f"(missing {result.missing_keys[:5]}, unexpected {unexpected[:5]})"
        )
