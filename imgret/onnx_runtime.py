"""The network run by ONNX Runtime: the Embedder's second runtime (``IMGRET_RUNTIME``).

The graph is exported in memory from the loaded model (:func:`imgret.onnx_export.onnx_bytes`)
when the Embedder is built, so a version needs no file besides its checkpoint, and the graph
is the checkpoint's weights: the vectors are those of the PyTorch network (within 1e-4,
``tests/unit/core/test_onnx_runtime.py``).

Threads follow torch's: a session's intra-op pool has ``torch.get_num_threads()`` threads, the
number the process gave the model (one per core by default; fewer while ingest workers run;
one in a forked worker). When that number or the process changes, the next run opens a new
session: ONNX Runtime's pool threads are created with the session and do not exist in a
forked child, so a child (an ingest worker) opens its own rather than rely on the parent's.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch

from imgret.checkpoint import EmbeddingNet, ModelSpec
from imgret.onnx_export import INPUT_NAME, onnx_bytes


def available() -> bool:
    """Whether ``onnxruntime`` can be imported (the ``onnx`` extra)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


class OnnxRuntimeModel:
    """``run((n, 3, S, S) float32) -> (n, dim) float32`` with ONNX Runtime on the CPU."""

    def __init__(self, model: EmbeddingNet, spec: ModelSpec):
        self.graph = onnx_bytes(model, spec)
        self._session: Any = None
        self._key: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self.session()  # a graph ONNX Runtime refuses fails here, at load

    def session(self) -> Any:
        """The session for this process and torch's thread count (opened when either
        changed)."""
        key = (os.getpid(), torch.get_num_threads())
        with self._lock:
            if self._key != key:
                self._session = _open(self.graph, threads=key[1])
                self._key = key
            return self._session

    @property
    def threads(self) -> int:
        """The intra-op threads of the current session."""
        return self._key[1] if self._key else 0

    def run(self, batch: np.ndarray) -> np.ndarray:
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        (out,) = self.session().run(None, {INPUT_NAME: batch})
        return np.asarray(out, dtype=np.float32)


def _open(graph: bytes, *, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    # One graph, run one batch at a time (the Embedder's forward lock): no inter-op pool.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
