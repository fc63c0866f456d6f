"""An int8 version of a registered one: its activation ranges calibrated on stored gallery
images, registered as a version of its own (``imgret export VERSION --quantize int8``).

The int8 version is a new version, not a faster way to run the old one: its vectors are its
graph's (:mod:`imgret.quantize`), so it is re-embedded like any other version, and it serves
only after the paired A/B verdict against its parent says it may
(``imgret models activate VERSION --require not_worse --query-set NAME``). Its checkpoint
keeps the parent's float weights beside the graph and names the parent in ``extra``.

Calibration images: up to ``images`` live gallery items spread evenly over the id order
(:func:`imgret.gallery.storage.item_store.spread_items`), decoded under the same pixel limit as
ingest and preprocessed by the parent's Embedder, so the ranges are those of the inputs the version
will see. Unreadable stored images are skipped.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sqlalchemy.orm import Session, sessionmaker

from imgret.checkpoint import Quantized, checkpoint_bytes
from imgret.embedder import Embedder
from imgret.errors import GalleryError, ImgretError
from imgret.gallery.media.files import MediaBackend
from imgret.gallery.storage import item_store
from imgret.gallery.versions import intake
from imgret.images import preprocess_encoded
from imgret.onnx_export import onnx_bytes
from imgret.quantize import quantize_int8, throughput

logger = logging.getLogger(__name__)

# Calibration images by default: ONNX Runtime's min/max ranges settle within a few hundred.
CALIBRATION_IMAGES = 256
CALIBRATION_BATCH = 32
SCHEME = "int8"


@dataclass
class Int8Version:
    """What :func:`quantize_version` made and measured."""

    parent: str
    version: str
    calibration_images: int
    float_graph_bytes: int
    int8_graph_bytes: int
    # Cosine of each calibration image's int8 vector with its parent vector.
    cosine_mean: float
    cosine_min: float
    # images/s per runtime on one calibration batch ({} when not measured).
    speed: dict[str, dict[str, Any]] = field(default_factory=dict)
    registered: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def quantize_version(
    version: str, *, session_factory: sessionmaker[Session], data_dir: str | Path,
    media: MediaBackend, max_pixels: int, images: int = CALIBRATION_IMAGES,
    speed_seconds: float = 0.0,
) -> Int8Version:
    """Quantise ``version`` to int8, calibrated on stored gallery images, and register the
    result (see the module docstring).

    Args:
        speed_seconds: time spent measuring images/s of the parent (torch eager and ONNX
            Runtime) and the int8 graph on one calibration batch; 0 skips it.

    Raises:
        VersionNotFound: unknown version.
        GalleryError: ``version`` is itself quantised, or no stored gallery image could be
            read to calibrate on.
    """
    loaded = intake.load_version_checkpoint(version, session_factory=session_factory,
                                            data_dir=data_dir)
    if loaded.quantized is not None:
        raise GalleryError(f"{version} is already a {loaded.quantized.scheme} version; "
                           "quantise its parent")
    parent = Embedder.from_checkpoint(loaded, device="cpu")
    inputs = calibration_inputs(parent, session_factory=session_factory, media=media,
                                images=images, max_pixels=max_pixels)
    batches = [inputs[i:i + CALIBRATION_BATCH].numpy()
               for i in range(0, len(inputs), CALIBRATION_BATCH)]
    float_graph = onnx_bytes(loaded.model, loaded.spec)
    graph = quantize_int8(float_graph, batches)
    quantized = Quantized(SCHEME, graph)
    extra = {"quantized_from": version, "calibration": {
        "images": len(inputs), "source": "stored gallery, spread over the id order",
        "method": "minmax", "weights": "int8 per channel", "activations": "uint8 per tensor",
    }}
    _, data = checkpoint_bytes(loaded.model, extra, quantized)
    registered = intake.register_bytes(data, session_factory=session_factory,
                                       data_dir=data_dir, name=f"the int8 version of {version}")
    int8 = Embedder(loaded.model, loaded.spec, device="cpu",
                    model_version=registered["version"], quantized=quantized)
    cosine = np.sum(parent.embed_tensors(inputs) * int8.embed_tensors(inputs), axis=1)
    result = Int8Version(
        parent=version, version=registered["version"], calibration_images=len(inputs),
        float_graph_bytes=len(float_graph), int8_graph_bytes=len(graph),
        cosine_mean=float(cosine.mean()), cosine_min=float(cosine.min()), registered=registered,
    )
    if speed_seconds > 0:
        parent_onnx = Embedder.from_checkpoint(loaded, device="cpu", runtime="onnxruntime")
        batch = inputs[:CALIBRATION_BATCH]
        result.speed = throughput(
            {name: functools.partial(embedder.embed_tensors, batch) for name, embedder in
             (("torch eager", parent), ("onnxruntime", parent_onnx), (SCHEME, int8))},
            len(batch), seconds=speed_seconds)
    return result


def calibration_inputs(embedder: Embedder, *, session_factory: sessionmaker[Session],
                       media: MediaBackend, images: int, max_pixels: int) -> torch.Tensor:
    """``(n, 3, S, S)`` model inputs of up to ``images`` stored gallery images.

    Raises:
        GalleryError: the gallery has no readable stored image.
    """
    with session_factory() as session:
        picked = item_store.spread_items(images, session=session)
    inputs = []
    for (item_id, _), data in zip(picked, media.read_many([p for _, p in picked]), strict=True):
        if data is None:
            continue  # deleted since the scan
        try:
            inputs.append(preprocess_encoded(data, embedder=embedder, max_pixels=max_pixels))
        except ImgretError as exc:
            logger.warning("item %d is not used to calibrate: %s", item_id, exc)
    if not inputs:
        raise GalleryError("int8 calibration needs stored gallery images, and none could be "
                           "read: ingest images first")
    return torch.cat(inputs)
