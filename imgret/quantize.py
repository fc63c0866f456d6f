"""int8 networks: ONNX Runtime's static quantisation of a model's exported graph, and the
speed of embedding paths side by side.

:func:`quantize_int8` takes the float network's graph (:func:`imgret.onnx_export.onnx_bytes`),
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
will embed: :mod:`imgret.gallery.versions.quantization` takes them from the stored gallery. Whether
the result may serve is not decided here: it is a new version, and the paired A/B verdict
against its parent decides (``imgret models activate --require not_worse``).

Integer kernels differ by CPU: ONNX Runtime's u8s8 path is exact on CPUs with VNNI (AVX512
VNNI, AVX-VNNI) and may saturate on AVX2-only CPUs, where its documentation advises
``reduce_range``. Embed and compare on the machine class that will serve.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from imgret.onnx_graph import INPUT_NAME

# The operators quantised; everything after the projection (ReduceL2, Div) stays float.
QUANTIZED_OPS = ("Conv", "Gemm", "MatMul", "Add", "Relu", "MaxPool", "GlobalAveragePool",
                 "AveragePool", "Flatten")


def quantize_int8(float_graph: bytes, batches: Iterable[np.ndarray]) -> bytes:
    """The int8 graph of ``float_graph`` (a model's :func:`imgret.onnx_export.onnx_bytes`; see
    the module docstring), its activation ranges calibrated on ``batches`` (``(n, 3, S, S)``
    float32 model inputs, preprocessed as the Embedder does).

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
        float_path.write_bytes(float_graph)
        quant_pre_process(str(float_path), str(prepared), skip_symbolic_shape=True)
        quantize_static(
            str(prepared), str(out), Reader(), quant_format=QuantFormat.QDQ,
            per_channel=True, weight_type=QuantType.QInt8, activation_type=QuantType.QUInt8,
            calibrate_method=CalibrationMethod.MinMax, op_types_to_quantize=list(QUANTIZED_OPS),
        )
        return out.read_bytes()


def throughput(runs: Mapping[str, Callable[[], object]], images: int, *,
               seconds: float = 5.0, warmup: int = 2,
               min_rounds: int = 3) -> dict[str, dict[str, Any]]:
    """Images per second of each of ``runs``, every one of which handles ``images`` images
    per call (an Embedder's ``embed_tensors`` of one batch, the search path of one batch of
    uploads).

    The runs alternate round by round, so a change in the machine's load falls on all of
    them; each figure is the median round.

    Returns:
        ``{name: {"images_per_s", "rounds", "batch"}}``.
    """
    for run in runs.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or min(len(t) for t in times.values()) < min_rounds:
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: {"images_per_s": images / statistics.median(t), "rounds": len(t),
                   "batch": images}
            for name, t in times.items()}
