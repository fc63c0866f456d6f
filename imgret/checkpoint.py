"""The model and its checkpoint: ModelSpec + EmbeddingNet, saved so that it rebuilds itself."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from torch import nn

from imgret.backbones import build_backbone
from imgret.errors import CheckpointError
from imgret.files import write_atomic_with
from imgret.validation import describe

CHECKPOINT_FILE = "model.pt"
FORMAT = "imgret-checkpoint-v1"


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ModelSpec:
    """Everything needed to rebuild the network and preprocess its input.

    A pydantic dataclass, so the ``spec`` dict of a checkpoint is checked field by field when
    it is loaded (unknown keys, wrong types; JSON lists become tuples).

    Attributes:
        backbone: a key of ``imgret.backbones.BACKBONES``.
        dim: embedding size (output of the projection head).
        image_size: square input side in pixels.
        mean, std: per-channel normalisation of the input (RGB, 0..1 scale).
        grayscale: inputs are greyscale images replicated to 3 channels (Fashion-MNIST).
    """

    backbone: str = "resnet18"
    dim: int = 128
    image_size: int = 224
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    grayscale: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (tuples kept: ``torch.load(weights_only=True)`` reads them)."""
        return dataclasses.asdict(self)


class EmbeddingNet(nn.Module):
    """Backbone trunk + linear projection head + L2 normalisation.

    ``forward((n, 3, H, W) float) -> (n, dim)`` unit-norm embeddings.
    """

    def __init__(self, spec: ModelSpec, backbone_weights: str | Path | None = None):
        super().__init__()
        self.spec = spec
        self.trunk, features = build_backbone(
            spec.backbone, image_size=spec.image_size, weights=backbone_weights
        )
        self.head = nn.Linear(features, spec.dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.head(self.trunk(images)).float(), dim=1)


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model (eval mode, CPU), its spec and version, and the rest."""

    model: EmbeddingNet
    spec: ModelSpec
    model_version: str
    extra: dict[str, Any] = field(default_factory=dict)
    # The full SHA-256 of config + weights (:func:`content_digest`); the version is its prefix.
    digest: str = ""


def content_digest(model: nn.Module, spec: ModelSpec) -> str:
    """The full SHA-256 (hex) of the config and the weights: a model's identity. The version
    name carries only its first 12 digits, so two different models may share a name; the
    full digest tells them apart."""
    digest = hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16
            tensor = tensor.float()
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def version_name(spec: ModelSpec, digest: str) -> str:
    """The model version: backbone, dimension and the first 12 digits of the content digest."""
    return f"{spec.backbone}-d{spec.dim}-{digest[:12]}"


def model_version_of(model: nn.Module, spec: ModelSpec) -> str:
    """A content hash of the weights and config: same weights + config, same version."""
    return version_name(spec, content_digest(model, spec))


def resolve_checkpoint_path(path: str | Path) -> Path:
    """Accept a run directory or its model.pt (the contract's ``--model`` rule)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path}: no checkpoint here; pass a run directory from `imgret train` or its model.pt"
        )
    return path


def save_checkpoint(
    path: str | Path, model: EmbeddingNet, extra: dict[str, Any] | None = None
) -> str:
    """Write ``model.pt`` atomically (temp file + rename) and return the model version.

    Args:
        path: the file, or a directory to write ``model.pt`` into.
        model: the network; its ``spec`` is saved beside the weights.
        extra: anything else worth keeping (training config, metrics, split); must be
            JSON-like (dicts, lists, str, numbers) so that loading stays ``weights_only``.
    """
    path = Path(path)
    if path.is_dir() or path.suffix != ".pt":
        path.mkdir(parents=True, exist_ok=True)
        path = path / CHECKPOINT_FILE
    version = model_version_of(model, model.spec)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    payload = {
        "format": FORMAT,
        "spec": model.spec.to_dict(),
        "model_version": version,
        "state_dict": state,
        "extra": extra or {},
    }
    write_atomic_with(path, lambda handle: torch.save(payload, handle))
    return version


def load_checkpoint(source: str | Path | bytes) -> Checkpoint:
    """Rebuild the model from ``model.pt`` (or its run directory, or the file's bytes) on the
    CPU, in eval mode."""
    if isinstance(source, bytes | bytearray):
        path: Path | str = "checkpoint"
        handle: Any = io.BytesIO(source)
    else:
        path = handle = resolve_checkpoint_path(source)
    try:
        payload = torch.load(handle, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        raise CheckpointError(f"{path}: cannot read checkpoint ({exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an imgret checkpoint (expected {FORMAT})")
    try:
        spec = TypeAdapter(ModelSpec).validate_python(payload["spec"])
    except ValidationError as exc:
        raise CheckpointError(f"{path}: bad model config ({describe(exc)})") from None
    model = EmbeddingNet(spec)
    try:
        model.load_state_dict(payload["state_dict"])
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: weights do not match the config ({exc})") from None
    model.eval()
    return Checkpoint(model, spec, payload["model_version"], payload.get("extra", {}),
                      digest=content_digest(model, spec))

