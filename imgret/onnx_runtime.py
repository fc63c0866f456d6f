"""The network run by ONNX Runtime: the Embedder's second runtime (``IMGRET_RUNTIME``).

For a float version the graph is exported in memory from the loaded model
(:func:`imgret.onnx_export.onnx_bytes`) when the Embedder is built, so a version needs no file
besides its checkpoint, and the graph is the checkpoint's weights: the vectors are those of
the PyTorch network (within 1e-4, ``tests/unit/core/test_onnx_runtime.py``). A quantised
version brings its own graph (:mod:`imgret.quantize`), and ONNX Runtime is the only thing
that runs it.

Threads follow torch's: a session's intra-op pool has ``torch.get_num_threads()`` threads, the
number the process gave the model (one per core by default; fewer while ingest workers run;
one in a forked worker). When that number or the process changes, the next run opens a new
session: ONNX Runtime's pool threads are created with the session and do not exist in a
forked child, so a child (an ingest worker) opens its own rather than rely on the parent's.

Execution providers (:func:`providers_for`): on a CUDA device, TensorRT then CUDA where the
installed ONNX Runtime has them (the ``onnxruntime-gpu`` wheel), the CPU after them for any
operator they do not take; on the CPU, the CPU provider only.

A graph that ONNX Runtime cannot load or run (a stored graph registered before the checks of
:mod:`imgret.onnx_graph`, a provider that refuses what the CPU took) is a
:class:`~imgret.errors.ModelRunError` in imgret's words; ONNX Runtime's own message, which
quotes the graph's names, goes to the log only. A run takes at most
:data:`imgret.onnx_graph.MAX_RUN_BATCH` images, the batch the graph's sizes were checked at.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np
import torch

from imgret.errors import ModelRunError
from imgret.onnx_graph import INPUT_NAME, MAX_RUN_BATCH, open_session

logger = logging.getLogger(__name__)

# Tried in this order on a CUDA device; the CPU provider is always last.
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
CPU_PROVIDER = "CPUExecutionProvider"


def available() -> bool:
    """Whether ``onnxruntime`` can be imported (the ``onnx`` extra)."""
    return bool(installed_providers())


def installed_providers() -> list[str]:
    """The execution providers of the installed ONNX Runtime ([] when it is not installed)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return []
    return list(ort.get_available_providers())


def providers_for(device: str, installed: list[str]) -> list[str]:
    """The providers a session on ``device`` uses, best first: on CUDA, those of
    :data:`GPU_PROVIDERS` that are installed, then the CPU; elsewhere the CPU only."""
    gpu = [p for p in GPU_PROVIDERS if p in installed] if device == "cuda" else []
    return [*gpu, CPU_PROVIDER]


# Sessions inherited across a fork, kept alive for good: destroying one in the child joins its
# intra-op pool threads, which exist only in the parent, and waits forever.
_INHERITED: list[Any] = []


class OnnxRuntimeModel:
    """``run((n, 3, S, S) float32) -> (n, dim) float32``: one ONNX graph run by ONNX Runtime
    with ``providers`` (:func:`providers_for`)."""

    def __init__(self, graph: bytes, providers: list[str] | None = None):
        self.graph = graph
        self.providers = providers or [CPU_PROVIDER]
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
                try:
                    self._session = open_session(self.graph, threads=key[1],
                                                 providers=self.providers)
                except Exception:  # ONNX Runtime's errors quote the graph's names
                    logger.warning("ONNX Runtime cannot load a graph", exc_info=True)
                    raise ModelRunError("ONNX Runtime cannot load this model's graph") from None
                self._key = key
            return self._session

    def after_fork(self) -> None:
        """In a forked child: a free lock, and the parent's session set aside, never
        destroyed (see :data:`_INHERITED`); the next run opens the child's own."""
        self._lock = threading.Lock()
        if self._session is not None:
            _INHERITED.append(self._session)
        self._session, self._key = None, None

    @property
    def threads(self) -> int:
        """The intra-op threads of the current session."""
        return self._key[1] if self._key else 0

    def run(self, batch: np.ndarray) -> np.ndarray:
        """The graph's output for ``batch``, in runs of at most ``MAX_RUN_BATCH`` images.

        Raises:
            ModelRunError: ONNX Runtime cannot load or run the graph.
        """
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        session = self.session()
        out = []
        for start in range(0, len(batch), MAX_RUN_BATCH):
            try:
                (part,) = session.run(None, {INPUT_NAME: batch[start : start + MAX_RUN_BATCH]})
            except Exception:  # as in session()
                logger.warning("ONNX Runtime cannot run a graph", exc_info=True)
                raise ModelRunError("ONNX Runtime failed running this model's graph") from None
            out.append(np.asarray(part, dtype=np.float32))
        return np.concatenate(out) if len(out) != 1 else out[0]
