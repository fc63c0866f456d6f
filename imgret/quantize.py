"""int8 networks: ONNX Runtime's static quantisation of a model's exported graph, and the
speed of two embedders side by side.

:func:`quantize_int8` exports the float network (:func:`imgret.onnx_export.onnx_bytes`),
runs ONNX Runtime's pre-processing (constant folding, fusions; symbolic shape inference is
skipped, it cannot follow the ``Expand`` of the L2 normalisation), then
``quantize_static``:

- QDQ format (``QuantizeLinear``/``DequantizeLinear`` pairs around each quantised operator),
  which ONNX Runtime fuses into integer kernels on the CPU and which TensorRT reads too;
- weights int8, per output channel (one scale per filter keeps small filters usable);
  activations uint8, per tensor, their ranges the min/max seen on the calibration batches;
- only the convolutions, the projection (``Gemm``/``MatMul``) and the operators between
  them are quantised; the L2 normalisation at the end stays float, so vectors keep unit norm.

The ranges come from the calibration images, so they should be images like those the version
will embed: :mod:`imgret.index.quantization` takes them from the stored gallery. Whether the
result may serve is not decided here: it is a new version, and the paired A/B verdict
against its parent decides (``imgret models activate --require not_worse``).

Integer kernels differ by CPU: ONNX Runtime's u8s8 path is exact on CPUs with VNNI (AVX512
VNNI, AVX-VNNI) and may saturate on AVX2-only CPUs, where its documentation advises
``reduce_range``. Embed and compare on the machine class that will serve.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from imgret.checkpoint import EmbeddingNet, ModelSpec
from imgret.onnx_export import onnx_bytes
from imgret.onnx_graph import INPUT_NAME

# The operators quantised; everything after the projection (ReduceL2, Div) stays float.
QUANTIZED_OPS = ("Conv", "Gemm", "MatMul", "Add", "Relu", "MaxPool", "GlobalAveragePool",
                 "AveragePool", "Flatten")


def quantize_int8(model: EmbeddingNet, spec: ModelSpec, batches: Iterable[np.ndarray]) -> bytes:
    """The int8 graph of ``model`` (see the module docstring), its activation ranges
    calibrated on ``batches`` (``(n, 3, S, S)`` float32 model inputs, preprocessed as the
    Embedder does).

    Raises:
        ValueError: no calibration batch.
    """
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    inputs = [np.ascontiguousarray(b, dtype=np.float32) for b in batches]
    if not inputs or not sum(len(b) for b in inputs):
        raise ValueError("int8 calibration needs at least one image")

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter(inputs)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self._batches, None)
            return None if batch is None else {INPUT_NAME: batch}

    with tempfile.TemporaryDirectory(prefix="imgret-int8-") as tmp:
        # quantize_static works on files (and writes its calibration graph beside them).
        float_path, prepared, out = (Path(tmp) / n for n in ("f.onnx", "p.onnx", "q.onnx"))
        float_path.write_bytes(onnx_bytes(model, spec))
        quant_pre_process(str(float_path), str(prepared), skip_symbolic_shape=True)
        quantize_static(
            str(prepared), str(out), Reader(), quant_format=QuantFormat.QDQ,
            per_channel=True, weight_type=QuantType.QInt8, activation_type=QuantType.QUInt8,
            calibrate_method=CalibrationMethod.MinMax, op_types_to_quantize=list(QUANTIZED_OPS),
        )
        return out.read_bytes()


class _Embeds(Protocol):
    def embed_tensors(self, batch: torch.Tensor) -> np.ndarray: ...


def throughput(embedders: Mapping[str, _Embeds], batch: torch.Tensor, *, seconds: float = 5.0,
               warmup: int = 2, min_rounds: int = 3) -> dict[str, dict[str, Any]]:
    """Images per second of each embedder's ``embed_tensors`` on the same batch.

    The embedders alternate round by round, so a change in the machine's load falls on all of
    them; each figure is the median round. Preprocessing, the same for all, is left out.

    Returns:
        ``{name: {"images_per_s", "rounds", "batch"}}``.
    """
    for embedder in embedders.values():
        for _ in range(warmup):
            embedder.embed_tensors(batch)
    times: dict[str, list[float]] = {name: [] for name in embedders}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or min(len(t) for t in times.values()) < min_rounds:
        for name, embedder in embedders.items():
            start = time.perf_counter()
            embedder.embed_tensors(batch)
            times[name].append(time.perf_counter() - start)
    return {name: {"images_per_s": len(batch) / statistics.median(t), "rounds": len(t),
                   "batch": len(batch)}
            for name, t in times.items()}
