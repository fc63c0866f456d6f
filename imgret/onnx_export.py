"""A model as ONNX: the network's graph, its preprocessing written down, a Triton layout.

What leaves the process is the network only (``EmbeddingNet``: trunk, head, L2
normalisation), with a dynamic batch axis. Preprocessing stays outside the graph, as in
:mod:`imgret.transforms`; :func:`preprocessing_contract` states it exactly, so a client (a
Triton ensemble, another language) can reproduce the input this process would feed.

The graph comes from torch's TorchScript-based exporter (``torch.onnx.export(dynamo=False)``):
the ``torch.export`` one needs ``onnxscript``, another dependency, and gives the same graph
for these convolutional networks. Either way the exported graph is checked against the
PyTorch network (``tests/unit/core/test_onnx_export.py``: at most 1e-4 apart).
"""

from __future__ import annotations

import io
import json
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from imgret.checkpoint import EmbeddingNet, ModelSpec
from imgret.onnx_graph import INPUT_NAME, OUTPUT_NAME

# ONNX opset of the exported graph: recent (2022), and run by every ONNX Runtime the `onnx`
# extra allows and by Triton's onnxruntime backend since 22.x.
OPSET = 18
MODEL_FILE = "model.onnx"
PREPROCESSING_FILE = "preprocessing.json"
TRITON_DIR = "triton"
# Triton's dynamic batcher: the largest batch it forms, and how long it waits to form one
# (the service's own defaults, IMGRET_BATCH_MAX_SIZE and IMGRET_BATCH_MAX_WAIT_MS).
TRITON_MAX_BATCH = 32
TRITON_QUEUE_DELAY_US = 5000
# torch.onnx.export keeps its state in process globals (GLOBALS.in_onnx_export and others):
# two exports at once in one process fail each other ("in_onnx_export must be True"). The
# service loads versions from several threads, and two quantisations may run at once.
_EXPORT_LOCK = threading.Lock()


def onnx_bytes(model: EmbeddingNet, spec: ModelSpec | None = None) -> bytes:
    """The network's ONNX graph (serialised ``ModelProto``): input ``images``
    ``(batch, 3, S, S)`` float32, output ``embeddings`` ``(batch, dim)`` float32, batch
    dynamic. The model is exported in eval mode on the CPU (a copy when it lives elsewhere)
    and left in the mode it was in.
    """
    spec = spec or model.spec
    was_training = model.training
    device = next(model.parameters()).device
    net = model if device.type == "cpu" else _cpu_copy(model, spec)
    net.eval()
    example = torch.zeros(2, 3, spec.image_size, spec.image_size)
    buffer = io.BytesIO()
    try:
        with _EXPORT_LOCK, warnings.catch_warnings():
            # The exporter announces its own deprecation in favour of the dynamo one.
            warnings.simplefilter("ignore")
            torch.onnx.export(
                net, (example,), buffer, dynamo=False, opset_version=OPSET,
                input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                do_constant_folding=True,
            )
    finally:
        model.train(was_training)
    return buffer.getvalue()


def _cpu_copy(model: EmbeddingNet, spec: ModelSpec) -> EmbeddingNet:
    copy = EmbeddingNet(spec)
    copy.load_state_dict({k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    return copy


def preprocessing_contract(spec: ModelSpec, *, model_version: str | None = None) -> dict[str, Any]:
    """What :class:`imgret.transforms.EvalTransform` does to a decoded RGB image, step by
    step, and what the graph takes and gives: the file a client reproduces the model's
    input from."""
    size = spec.image_size
    steps: list[dict[str, Any]] = [
        {"op": "to_uint8_chw", "note": "decoded RGB image, 8 bits per channel, (3, H, W)"},
    ]
    if spec.grayscale:
        steps.append({
            "op": "grayscale", "weights_rgb": [0.2989, 0.587, 0.114], "rounding": "truncate",
            "output_channels": 3,
            "note": "on the uint8 image: L = 0.2989 R + 0.587 G + 0.114 B, truncated to uint8, "
                    "replicated to 3 channels (torchvision rgb_to_grayscale)",
        })
    steps += [
        {"op": "resize", "size": [size, size], "interpolation": "bilinear", "antialias": True,
         "keep_aspect_ratio": False, "crop": None,
         "note": "a plain resize of the whole image to a square (no crop; an image already "
                 "that size is left as is), on the uint8 image (torchvision resize)"},
        {"op": "to_float", "scale": 1 / 255, "note": "uint8 / 255 -> float32 in [0, 1]"},
        {"op": "normalize", "mean": list(spec.mean), "std": list(spec.std),
         "note": "(x - mean[c]) / std[c] per channel"},
    ]
    return {
        "model_version": model_version,
        "spec": spec.to_dict(),
        "input": {"name": INPUT_NAME, "dtype": "float32", "layout": "NCHW",
                  "shape": [-1, 3, size, size], "color": "RGB"},
        "output": {"name": OUTPUT_NAME, "dtype": "float32", "shape": [-1, spec.dim],
                   "l2_normalized": True},
        "image_size": size,
        "mean": list(spec.mean),
        "std": list(spec.std),
        "grayscale": spec.grayscale,
        "resize": "stretch to a square of image_size (bilinear, antialiased), no crop",
        "steps": steps,
    }


def triton_config(name: str, spec: ModelSpec, *, max_batch_size: int = TRITON_MAX_BATCH,
                  queue_delay_us: int = TRITON_QUEUE_DELAY_US) -> str:
    """``config.pbtxt`` of the model in a Triton model repository: the onnxruntime backend,
    the batch dimension left to Triton (``max_batch_size``, dims without it), dynamic
    batching."""
    size = spec.image_size
    return (
        f'name: "{name}"\n'
        'backend: "onnxruntime"\n'
        f"max_batch_size: {max_batch_size}\n"
        "input [\n"
        "  {\n"
        f'    name: "{INPUT_NAME}"\n'
        "    data_type: TYPE_FP32\n"
        "    format: FORMAT_NCHW\n"
        f"    dims: [ 3, {size}, {size} ]\n"
        "  }\n"
        "]\n"
        "output [\n"
        "  {\n"
        f'    name: "{OUTPUT_NAME}"\n'
        "    data_type: TYPE_FP32\n"
        f"    dims: [ {spec.dim} ]\n"
        "  }\n"
        "]\n"
        "dynamic_batching {\n"
        f"  max_queue_delay_microseconds: {queue_delay_us}\n"
        "}\n"
        "instance_group [\n"
        "  {\n"
        "    kind: KIND_AUTO\n"
        "  }\n"
        "]\n"
    )


def triton_name(model_version: str) -> str:
    """A Triton model name from a version: Triton names are directory names, and versions
    are ``[a-z0-9_-]`` already; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in model_version)


@dataclass(frozen=True)
class OnnxExport:
    """The files one export wrote."""

    model: Path
    preprocessing: Path
    triton_config: Path
    triton_model: Path

    def to_dict(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.__dict__.items()}


def export_onnx(model: EmbeddingNet, spec: ModelSpec, out_dir: str | Path, *,
                model_version: str, graph: bytes | None = None) -> OnnxExport:
    """Write ``model.onnx``, ``preprocessing.json`` and a Triton model repository
    (``triton/<name>/config.pbtxt``, ``triton/<name>/1/model.onnx``) into ``out_dir``.

    Args:
        graph: the graph to write (a quantised version's own); default: ``model`` exported.
    """
    out = Path(out_dir)
    graph = graph if graph is not None else onnx_bytes(model, spec)
    name = triton_name(model_version)
    files = OnnxExport(
        model=out / MODEL_FILE, preprocessing=out / PREPROCESSING_FILE,
        triton_config=out / TRITON_DIR / name / "config.pbtxt",
        triton_model=out / TRITON_DIR / name / "1" / MODEL_FILE,
    )
    files.triton_model.parent.mkdir(parents=True, exist_ok=True)
    files.model.write_bytes(graph)
    files.triton_model.write_bytes(graph)
    contract = preprocessing_contract(spec, model_version=model_version)
    files.preprocessing.write_text(json.dumps(contract, indent=2) + "\n")
    files.triton_config.write_text(triton_config(name, spec))
    return files
