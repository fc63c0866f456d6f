"""The model and its checkpoint: ModelSpec + EmbeddingNet, saved so that it rebuilds itself.

A checkpoint is untrusted input (it may be uploaded), so :func:`load_checkpoint` checks it in
an order where nothing large is allocated before it is known to fit, and every refusal is a
:class:`~imgret.errors.CheckpointError` naming what is wrong without quoting the file:

1. Size: the file (or bytes) at most ``max_bytes`` (:data:`MAX_CHECKPOINT_BYTES`, 512 MiB:
   vit_b_16, the largest backbone, is ~330 MiB in float32).
2. Zip directory, read with :mod:`zipfile` before ``torch.load`` (torch.save writes a zip):
   its end record names at most :data:`MAX_ARCHIVE_ENTRIES` entries in a directory of at most
   :data:`MAX_DIRECTORY_BYTES`; every entry is *stored* (torch.save never compresses, and a
   deflated entry is how a 200 KB file inflates to a 200 MB tensor); the uncompressed sizes
   sum to at most ``max_bytes``; the pickle (``data.pkl``) is at most
   :data:`MAX_PICKLE_BYTES` (unpickled objects can be ~40x their pickle). A file that is not
   a zip (torch's legacy format included) is refused.
3. ``torch.load(weights_only=True)``: only tensors and plain containers come back.
4. Structure: a dict with exactly ``format``, ``spec``, ``model_version``, ``state_dict`` and
   optionally ``extra`` (a dict); ``model_version`` a string.
5. Spec: :class:`ModelSpec`'s bounds: ``backbone`` a key of ``imgret.backbones.BACKBONES``,
   ``1 <= dim <=`` :data:`MAX_DIM`, :data:`MIN_IMAGE_SIZE` ``<= image_size <=``
   :data:`MAX_IMAGE_SIZE`, ``mean`` finite, ``std`` finite and > 0.
6. Weights against the spec before any real model exists: the spec's network is built on the
   meta device (no memory), its size must fit ``max_bytes``, and the state dict must have
   exactly its tensor names and shapes, floating-point dtypes where it has them, and only
   finite values (a NaN or infinite weight makes every embedding NaN, which no index can
   rank, so such a model is refused rather than served).
7. A quantised version's graph (optional ``quantized``: ``scheme`` and ``graph``, the ONNX
   bytes as a uint8 tensor) passes :func:`imgret.onnx_graph.graph_problem`: its structure
   (no external data, allowed operators only, the spec's input and output shapes), its
   tensors' sizes by shape inference, then ONNX Runtime's own load and a trial run on one
   zero image.
8. Only then the real model is built and loaded, and ``model_version`` must be the version
   its weights, spec (and graph) hash to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from torch import nn

from imgret.backbones import BACKBONES, build_backbone
from imgret.config_rules import MAX_DIM, MAX_IMAGE_SIZE, MIN_IMAGE_SIZE
from imgret.errors import CheckpointError
from imgret.files import write_atomic_with

CHECKPOINT_FILE = "model.pt"
FORMAT = "imgret-checkpoint-v1"

MIB = 1 << 20
# The default byte budget of a checkpoint: the file, its uncompressed contents and the model
# its spec describes (float32) must each fit.
MAX_CHECKPOINT_BYTES = 512 * MIB
# torch.save writes one entry per storage plus ~6 (resnet50: 326, efficientnet_b0: ~366).
MAX_ARCHIVE_ENTRIES = 4096
# Central directory records are ~60-100 bytes each for torch's short names.
MAX_DIRECTORY_BYTES = 1 * MIB
# The pickle holds tensor names and ``extra`` (config, metrics): a few KB to a few hundred.
MAX_PICKLE_BYTES = 4 * MIB
PAYLOAD_KEYS = ("format", "spec", "model_version", "state_dict", "extra", "quantized")
# How a quantised version's own graph was made (:mod:`imgret.quantize`); part of its name.
QUANT_SCHEMES = ("int8",)

_Mean = Annotated[float, Field(allow_inf_nan=False)]
_Std = Annotated[float, Field(gt=0, allow_inf_nan=False)]


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ModelSpec:
    """Everything needed to rebuild the network and preprocess its input.

    A pydantic dataclass, so the ``spec`` dict of a checkpoint is checked field by field when
    it is loaded (unknown keys, wrong types; JSON lists become tuples).

    Attributes:
        backbone: a key of ``imgret.backbones.BACKBONES``.
        dim: embedding size (output of the projection head), 1 to :data:`MAX_DIM`.
        image_size: square input side in pixels, :data:`MIN_IMAGE_SIZE` to
            :data:`MAX_IMAGE_SIZE`.
        mean, std: per-channel normalisation of the input (RGB, 0..1 scale); finite, std > 0.
        grayscale: inputs are greyscale images replicated to 3 channels (Fashion-MNIST).
        neck: ``none`` (the linear head feeds the L2 normalisation) or ``bn`` (a BatchNorm1d
            between them: the proxy and classifier losses' recipe, ``imgret.training.recipe``).
            Left out of :meth:`to_dict` when ``none``, so a checkpoint saved before the field
            existed has the same spec, digest and version as before.
    """

    backbone: str = "resnet18"
    dim: int = Field(128, ge=1, le=MAX_DIM)
    image_size: int = Field(224, ge=MIN_IMAGE_SIZE, le=MAX_IMAGE_SIZE)
    mean: tuple[_Mean, _Mean, _Mean] = (0.485, 0.456, 0.406)
    std: tuple[_Std, _Std, _Std] = (0.229, 0.224, 0.225)
    grayscale: bool = False
    neck: Literal["none", "bn"] = "none"

    @field_validator("backbone")
    @classmethod
    def _known_backbone(cls, name: str) -> str:
        # The message lists the valid names and never repeats the value (it may come from an
        # uploaded file).
        if name not in BACKBONES:
            raise ValueError(f"must be one of {', '.join(sorted(BACKBONES))}")
        return name

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (tuples kept: ``torch.load(weights_only=True)`` reads them);
        ``neck`` only when it is not ``none``."""
        data = dataclasses.asdict(self)
        if data["neck"] == "none":
            del data["neck"]
        return data


class EmbeddingNet(nn.Module):
    """Backbone trunk + linear projection head (+ BatchNorm1d neck) + L2 normalisation.

    ``forward((n, 3, H, W) float) -> (n, dim)`` unit-norm embeddings. In eval mode the neck
    is a fixed affine map (its running statistics), which ONNX exports as such.
    """

    def __init__(self, spec: ModelSpec, backbone_weights: str | Path | None = None):
        super().__init__()
        self.spec = spec
        self.trunk, features = build_backbone(
            spec.backbone, image_size=spec.image_size, weights=backbone_weights
        )
        self.head = nn.Linear(features, spec.dim)
        if spec.neck == "bn":
            self.neck = nn.BatchNorm1d(spec.dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        embeddings = self.head(self.trunk(images))
        if self.spec.neck == "bn":
            embeddings = self.neck(embeddings)
        return F.normalize(embeddings.float(), dim=1)


@dataclass(frozen=True)
class Quantized:
    """A quantised version's network: an ONNX graph made from the checkpoint's weights
    (:mod:`imgret.quantize`), run by ONNX Runtime in place of the float network. The float
    weights stay in the checkpoint: they are what the graph was made from, and what the
    spec, the weight checks and the lineage of the version rest on."""

    scheme: str
    graph: bytes


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model (eval mode, CPU), its spec and version, and the rest."""

    model: EmbeddingNet
    spec: ModelSpec
    model_version: str
    extra: dict[str, Any] = field(default_factory=dict)
    # The full SHA-256 of config + weights (:func:`content_digest`); the version is its prefix.
    digest: str = ""
    # A quantised version's own graph; None for a float version (the network is the model).
    quantized: Quantized | None = None


def content_digest(model: nn.Module, spec: ModelSpec, quantized: Quantized | None = None) -> str:
    """The full SHA-256 (hex) of the config and the weights (and a quantised version's
    scheme and graph): a model's identity. The version name carries only its first 12
    digits, so two different models may share a name; the full digest tells them apart."""
    digest = hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16
            tensor = tensor.float()
        digest.update(tensor.numpy().tobytes())
    if quantized is not None:
        digest.update(f"quantized:{quantized.scheme}:".encode())
        digest.update(quantized.graph)
    return digest.hexdigest()


def version_name(spec: ModelSpec, digest: str, scheme: str | None = None) -> str:
    """The model version: backbone, dimension, a quantised version's scheme and the first 12
    digits of the content digest (``resnet18-d128-3f9a…``, ``resnet18-d128-int8-b71c…``)."""
    return f"{spec.backbone}-d{spec.dim}-{scheme + '-' if scheme else ''}{digest[:12]}"


def model_version_of(model: nn.Module, spec: ModelSpec, quantized: Quantized | None = None) -> str:
    """A content hash of the weights and config: same weights + config, same version."""
    return version_name(spec, content_digest(model, spec, quantized),
                        quantized.scheme if quantized else None)


def resolve_checkpoint_path(path: str | Path) -> Path:
    """Accept a run directory or its model.pt (the rule for every ``--model`` option)."""
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
    version, payload = _payload(model, extra, None)
    write_atomic_with(path, lambda handle: torch.save(payload, handle))
    return version


def checkpoint_bytes(model: EmbeddingNet, extra: dict[str, Any] | None = None,
                     quantized: Quantized | None = None) -> tuple[str, bytes]:
    """The version and the bytes :func:`save_checkpoint` would write; with ``quantized``, a
    quantised version's checkpoint (its graph beside the float weights)."""
    version, payload = _payload(model, extra, quantized)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return version, buffer.getvalue()


def _payload(model: EmbeddingNet, extra: dict[str, Any] | None,
             quantized: Quantized | None) -> tuple[str, dict[str, Any]]:
    version = model_version_of(model, model.spec, quantized)
    payload: dict[str, Any] = {
        "format": FORMAT,
        "spec": model.spec.to_dict(),
        "model_version": version,
        "state_dict": {k: v.detach().to("cpu") for k, v in model.state_dict().items()},
        "extra": extra or {},
    }
    if quantized is not None:
        graph = torch.frombuffer(bytearray(quantized.graph), dtype=torch.uint8)
        payload["quantized"] = {"scheme": quantized.scheme, "graph": graph}
    return version, payload


def load_checkpoint(
    source: str | Path | bytes, *, max_bytes: int = MAX_CHECKPOINT_BYTES
) -> Checkpoint:
    """Rebuild the model from ``model.pt`` (or its run directory, or the file's bytes) on the
    CPU, in eval mode, after the checks of this module's docstring.

    Args:
        source: a run directory, a ``model.pt`` path, or the file's bytes.
        max_bytes: the byte budget (file, uncompressed contents, model).

    Raises:
        CheckpointError: anything missing, malformed, over the budget or inconsistent.
    """
    if isinstance(source, bytes | bytearray | memoryview):
        if len(source) > max_bytes:
            raise CheckpointError(f"checkpoint: {_over('the file', len(source), max_bytes)}")
        return _load(io.BytesIO(source), "checkpoint", max_bytes)
    path = resolve_checkpoint_path(source)
    try:
        handle = path.open("rb")
    except OSError:
        raise CheckpointError(f"{path}: cannot open the checkpoint") from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if size > max_bytes:
            raise CheckpointError(f"{path}: {_over('the file', size, max_bytes)}")
        # One open file for the checks and torch.load: both read the same bytes.
        return _load(handle, str(path), max_bytes)


def _over(what: str, size: int, budget: int) -> str:
    return f"{what} is {size / MIB:.1f} MiB, over the budget of {budget / MIB:.1f} MiB"


def _load(handle: IO[bytes], label: str, max_bytes: int) -> Checkpoint:
    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(f"{label}: {problem}")

    problem = _archive_problem(handle, max_bytes)
    if problem:
        raise refuse(problem)
    handle.seek(0)
    try:
        payload = torch.load(handle, map_location="cpu", weights_only=True)
    except Exception:  # torch raises many types; their text may quote the file
        raise refuse("cannot read checkpoint: not a torch checkpoint, truncated or "
                     "corrupt") from None
    spec, state = _checked_payload(payload, refuse)
    problem = _weights_problem(spec, state, max_bytes)
    if problem:
        raise refuse(problem)
    quantized = _quantized(payload.get("quantized"), spec, refuse)
    model = EmbeddingNet(spec)
    try:
        model.load_state_dict(state)
    except Exception:  # names, shapes and dtypes are checked: not expected to happen
        raise refuse("weights do not match the config (a tensor's data is corrupt)") from None
    model.eval()
    digest = content_digest(model, spec, quantized)
    version = version_name(spec, digest, quantized.scheme if quantized else None)
    if payload["model_version"] != version:
        raise refuse(f"model_version is not the hash of its weights and config ({version}); "
                     "save it again with imgret.checkpoint.save_checkpoint")
    return Checkpoint(model, spec, version, payload.get("extra", {}), digest=digest,
                      quantized=quantized)


def _quantized(entry: Any, spec: ModelSpec, refuse: Any) -> Quantized | None:
    """A quantised version's graph, checked (:func:`imgret.onnx_graph.graph_problem`);
    None when the checkpoint has none."""
    from imgret.onnx_graph import graph_problem

    if entry is None:
        return None
    if not isinstance(entry, dict) or set(entry) != {"scheme", "graph"}:
        raise refuse("quantized should be a dict of exactly scheme and graph")
    if entry["scheme"] not in QUANT_SCHEMES:
        raise refuse(f"quantized.scheme must be one of {', '.join(QUANT_SCHEMES)}")
    graph = entry["graph"]
    if (not isinstance(graph, torch.Tensor) or graph.dtype != torch.uint8 or graph.dim() != 1
            or graph.layout != torch.strided or graph.device.type != "cpu"):
        raise refuse("quantized.graph should be a 1-d uint8 CPU tensor (the ONNX bytes)")
    data = graph.contiguous().numpy().tobytes()
    problem = graph_problem(data, image_size=spec.image_size, dim=spec.dim)
    if problem:
        raise refuse(f"quantized.graph: {problem}")
    return Quantized(entry["scheme"], data)


def _archive_problem(handle: IO[bytes], max_bytes: int) -> str | None:
    """What makes the zip directory unsafe to hand to ``torch.load``; None when it is fine.
    Reads only the directory, never an entry's data."""
    not_zip = "cannot read checkpoint: not a zip archive (torch.save writes one)"
    try:
        # zipfile's own reader of the end record: the directory's size and entry count are
        # known before zipfile builds one object per entry.
        end = zipfile._EndRecData(handle)
        if end is None:
            return not_zip
        if end[zipfile._ECD_ENTRIES_TOTAL] > MAX_ARCHIVE_ENTRIES:
            return f"too many archive entries (at most {MAX_ARCHIVE_ENTRIES})"
        if end[zipfile._ECD_SIZE] > MAX_DIRECTORY_BYTES:
            return _over("the archive directory", end[zipfile._ECD_SIZE],
                         MAX_DIRECTORY_BYTES)
        handle.seek(0)
        entries = zipfile.ZipFile(handle).infolist()
    except Exception:  # zipfile raises BadZipFile, OSError, struct.error, ...
        return not_zip
    if len(entries) > MAX_ARCHIVE_ENTRIES:
        return f"too many archive entries (at most {MAX_ARCHIVE_ENTRIES})"
    if any(e.compress_type != zipfile.ZIP_STORED or e.compress_size != e.file_size
           for e in entries):
        return "the archive has compressed entries (torch.save writes them stored)"
    total = sum(e.file_size for e in entries)
    if total > max_bytes:
        return _over("the uncompressed content", total, max_bytes)
    pickle_size = max((e.file_size for e in entries if e.filename.endswith("data.pkl")),
                      default=0)
    if pickle_size > MAX_PICKLE_BYTES:
        return _over("the pickled structure (data.pkl)", pickle_size, MAX_PICKLE_BYTES)
    return None


def _checked_payload(payload: Any, refuse: Any) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The spec and the state dict of a loaded payload whose structure is checked."""
    if not isinstance(payload, dict):
        raise refuse(f"not an imgret checkpoint (it holds a {type(payload).__name__}, "
                     "not a dict)")
    if payload.get("format") != FORMAT:
        raise refuse(f"not an imgret checkpoint (expected format {FORMAT})")
    if not set(payload) <= set(PAYLOAD_KEYS):
        raise refuse(f"unknown top-level keys (allowed: {', '.join(PAYLOAD_KEYS)})")
    for key, kind in (("spec", dict), ("state_dict", dict), ("model_version", str)):
        if key not in payload:
            raise refuse(f"no {key}")
        if not isinstance(payload[key], kind):
            raise refuse(f"{key} should be a {kind.__name__}, not {type(payload[key]).__name__}")
    if not isinstance(payload.get("extra", {}), dict):
        raise refuse(f"extra should be a dict, not {type(payload['extra']).__name__}")
    try:
        spec = TypeAdapter(ModelSpec).validate_python(payload["spec"])
    except ValidationError as exc:
        raise refuse(f"bad model config ({_spec_problems(exc)})") from None
    return spec, payload["state_dict"]


def _spec_problems(exc: ValidationError) -> str:
    """pydantic's messages, without the values and without keys that are not fields (both
    come from the file)."""
    fields = [f.name for f in dataclasses.fields(ModelSpec)]
    problems = []
    for error in exc.errors():
        loc = error["loc"]
        if loc and loc[0] in fields:
            name = "spec." + ".".join(map(str, loc))
            problems.append(f"{name}: {error['msg'].removeprefix('Value error, ')}")
        elif error["type"] == "unexpected_keyword_argument":
            problems.append(f"spec has an unknown field (fields: {', '.join(fields)})")
        elif loc:
            problems.append("spec has a key that is not a field name")
        else:
            problems.append(f"spec: {error['msg']}")
    return "; ".join(dict.fromkeys(problems))


def expected_state(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The state dict the spec's network has, as meta tensors (names, shapes, dtypes; no
    memory is allocated, whatever the spec's size). ``torch.device`` as a context is
    thread-local: models built meanwhile in other threads stay real.

    Raises:
        CheckpointError: the backbone cannot be built with this spec.
    """
    try:
        with torch.device("meta"):
            return EmbeddingNet(spec).state_dict()
    except Exception:  # e.g. ViT needs image_size divisible by its patch size
        raise CheckpointError(f"the {spec.backbone} backbone cannot be built at image_size "
                              f"{spec.image_size}") from None


def _weights_problem(spec: ModelSpec, state: Mapping[Any, Any], max_bytes: int) -> str | None:
    """What is wrong with the state dict for this spec; None when it fits exactly. Names
    from the file are never quoted: only the expected ones."""
    try:
        expected = expected_state(spec)
    except CheckpointError as exc:
        return str(exc)
    needed = sum(t.numel() * t.element_size() for t in expected.values())
    if needed > max_bytes:
        return _over(f"the model the spec describes ({spec.backbone}, dim {spec.dim}, "
                     f"image_size {spec.image_size})", needed, max_bytes)
    missing = [name for name in expected if name not in state]
    unexpected = sum(1 for name in state if name not in expected)
    if missing or unexpected:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        return (f"weights do not match the config: {len(missing)} missing tensors"
                f"{f' ({shown})' if missing else ''}, {unexpected} unexpected")
    for name, want in expected.items():
        got = state[name]
        if (not isinstance(got, torch.Tensor) or got.layout != torch.strided
                or got.device.type != "cpu"):
            return f"state_dict.{name} is not a dense CPU tensor"
        if tuple(got.shape) != tuple(want.shape):
            return (f"state_dict.{name} has shape {tuple(got.shape)}, the config needs "
                    f"{tuple(want.shape)}")
        if want.is_floating_point():
            if not got.is_floating_point():
                return f"state_dict.{name} is {got.dtype}, not a floating-point tensor"
            if not bool(torch.isfinite(got).all()):
                return f"state_dict.{name} holds NaN or infinite values"
        elif got.dtype != want.dtype:
            return f"state_dict.{name} is {got.dtype}, the config needs {want.dtype}"
    return None
