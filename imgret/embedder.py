"""The Embedder: the one path from images to vectors (training validation, ingest, search)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from imgret import onnx_runtime
from imgret.checkpoint import (
    Checkpoint,
    EmbeddingNet,
    ModelSpec,
    Quantized,
    load_checkpoint,
    model_version_of,
)
from imgret.errors import CheckpointError, ModelRunError
from imgret.onnx_export import onnx_bytes
from imgret.onnx_runtime import OnnxRuntimeModel
from imgret.settings import resolve_device
from imgret.transforms import eval_transform

logger = logging.getLogger(__name__)

# What runs the network (IMGRET_RUNTIME): ``auto`` = ONNX Runtime where it gives torch's
# vectors on the version's sample (:data:`EQUALITY_BOUND`), else torch.
RUNTIMES = ("auto", "torch", "onnxruntime")
# The equality check of ``auto``: the largest difference, in any coordinate of any unit-norm
# vector, between ONNX Runtime and torch on the version's sample. Measured differences are
# 1e-7 to 3e-7 (float32 rounding in another order of operations, docs/onnx.md); a graph 1e-4
# away from its network is not the same model, and cosine scores would move in the fourth
# decimal, where thresholds are calibrated.
EQUALITY_BOUND = 1e-4
# The sample: this many seeded noise images through the version's own preprocessing, run
# as one batch and the first alone (the batch axis is dynamic in the graph).
EQUALITY_SAMPLE = 8
# Graphs exported and checked in this process, by model version (a content digest of the
# weights, so one version is one graph), at most this many bytes of graphs: a service that
# loads a version again (the version cache dropped it; a test's next app) pays neither the
# export (about a second for resnet18) nor the check again.
GRAPH_CACHE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class RuntimeChoice:
    """What runs a version's network in this process, and why (``GET /models/{v}``, the
    start-up log).

    Attributes:
        asked: ``IMGRET_RUNTIME`` (``auto``, ``torch``, ``onnxruntime``).
        runtime: what runs it: ``torch`` or ``onnxruntime``.
        reason: one sentence.
        max_abs_diff: ONNX Runtime against torch on the sample, when compared.
        bound: the bound it was held to (:data:`EQUALITY_BOUND`), when compared.
    """

    asked: str
    runtime: str
    reason: str
    max_abs_diff: float | None = None
    bound: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _GraphCache:
    """Exported graphs with their measured difference from torch, least recently used
    first, bounded in bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str], tuple[bytes, float | None]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> tuple[bytes, float | None] | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: tuple[str, str], graph: bytes, diff: float | None) -> None:
        if len(graph) > self.max_bytes:
            return
        with self._lock:
            self._items[key] = (graph, diff)
            self._items.move_to_end(key)
            while sum(len(g) for g, _ in self._items.values()) > self.max_bytes:
                self._items.popitem(last=False)


_GRAPHS = _GraphCache(GRAPH_CACHE_BYTES)


# Every live Embedder of this process, for :func:`_free_locks_after_fork`.
_EMBEDDERS: weakref.WeakSet[Embedder] = weakref.WeakSet()


def _free_locks_after_fork() -> None:
    """In a forked child, give every Embedder a new, free forward lock.

    A lock that another thread held at the fork (a search batch in its forward pass while an
    ingest forks its embedding workers, a training step while a DataLoader forks) is copied
    locked, and the thread that would release it does not exist in the child: the child's
    first forward pass would wait forever. The child has one thread, so nothing else can be
    inside a forward pass there.
    """
    for embedder in list(_EMBEDDERS):
        embedder._forward_lock = threading.Lock()
        onnx = getattr(embedder, "_onnx", None)
        if onnx is not None:  # its session lock, for the same reason, and its session
            onnx.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_locks_after_fork)


class Embedder:
    """Turns PIL images into L2-normalised float32 vectors with one model.

    On CUDA the model runs channels_last under bf16 autocast; everywhere under
    ``torch.inference_mode``. The model's train/eval mode is restored after each call, so a
    training loop can validate through ``Embedder.from_model`` without side effects.

    ``runtime`` (``IMGRET_RUNTIME``) picks what runs the network: ``torch`` (eager PyTorch),
    ``onnxruntime`` (the same network exported to ONNX in memory at load,
    :mod:`imgret.onnx_runtime`; on a CUDA device with ONNX Runtime's CUDA or TensorRT
    provider) or ``auto``: ONNX Runtime where its vectors are within :data:`EQUALITY_BOUND`
    of torch's on the version's sample, torch otherwise (the service's and the CLI's
    default; ONNX Runtime ran the network 1.3-1.9x faster than torch here, docs/onnx.md).
    Inputs, preprocessing and outputs are the same, and the vectors agree within 1e-4, so a
    version's served vectors do not depend on it. ONNX Runtime falls back to torch where it
    cannot run (with a warning when asked for by name): not installed,
    a CUDA device without a GPU provider (the CPU wheel; torch's bf16 path runs there), or a
    graph it cannot export or load. :attr:`runtime` says which one runs and
    :attr:`runtime_choice` why. The constructor's own default is ``torch``: training
    validates a network whose weights change every step, where an export would cost more
    than it saves.

    A quantised version (``quantized``, :mod:`imgret.quantize`) runs its own graph with ONNX
    Runtime whatever ``runtime`` says: its vectors are that graph's, so torch cannot stand in
    for it, and without onnxruntime it does not load at all.
    """

    def __init__(
        self, model: EmbeddingNet, spec: ModelSpec, *, device: str = "auto",
        model_version: str | None = None, batch_size: int = 64, runtime: str = "torch",
        quantized: Quantized | None = None,
    ):
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
        self.device = resolve_device(device)
        self.spec = spec
        self.model = model.to(self.device)
        if self.device == "cuda":
            self.model = self.model.to(memory_format=torch.channels_last)
        self.model_version = model_version or model_version_of(model, spec, quantized)
        # "int8" for a quantised version, None for the float network.
        self.scheme = quantized.scheme if quantized else None
        self.batch_size = batch_size
        self.transform = eval_transform(spec)
        # One forward pass at a time, whatever the number of threads (search batches, gallery
        # uploads, /evaluate uploads, ingest): torch already spreads one pass over every CPU
        # core, so concurrent passes gain no speed and only multiply the activation memory
        # (six concurrent resnet18 passes at batch 64, 224 px, held 2+ GB), and on a GPU they
        # would queue on the device anyway. Taken per chunk of ``batch_size``, so a large
        # upload interleaves with the search batches instead of holding them up.
        self._forward_lock = threading.Lock()
        self._onnx: OnnxRuntimeModel | None = None
        if quantized is not None:
            self._onnx = self._quantized_runtime(quantized)
            self.runtime_choice = RuntimeChoice(
                runtime, "onnxruntime", f"a {quantized.scheme} version runs its own graph "
                "with ONNX Runtime")
        elif runtime == "torch":
            self.runtime_choice = RuntimeChoice(runtime, "torch", "IMGRET_RUNTIME=torch")
        else:
            self._onnx, self.runtime_choice = self._onnx_runtime(runtime)
        self.runtime = "onnxruntime" if self._onnx is not None else "torch"
        _EMBEDDERS.add(self)

    def _providers(self) -> list[str]:
        return onnx_runtime.providers_for(self.device, onnx_runtime.installed_providers())

    def _quantized_runtime(self, quantized: Quantized) -> OnnxRuntimeModel:
        if not onnx_runtime.available():
            raise CheckpointError(
                f"{self.model_version} is a {quantized.scheme} version: it runs with "
                "onnxruntime only, which is not installed (pip install onnxruntime)")
        return OnnxRuntimeModel(quantized.graph, self._providers())

    def _onnx_runtime(self, asked: str) -> tuple[OnnxRuntimeModel | None, RuntimeChoice]:
        """ONNX Runtime's model and the choice, or None and why torch runs instead.

        ``onnxruntime`` (asked by name) takes the graph unless it cannot run, and warns when
        it cannot; ``auto`` also holds the graph to :data:`EQUALITY_BOUND` against torch on
        the version's sample, and falls back without a warning (nothing was asked for)."""
        def torch_instead(reason: str) -> tuple[None, RuntimeChoice]:
            log = logger.warning if asked == "onnxruntime" else logger.info
            log("%s runs with torch: %s", self.model_version, reason)
            return None, RuntimeChoice(asked, "torch", reason)

        if not onnx_runtime.available():
            return torch_instead("onnxruntime is not installed")
        providers = self._providers()
        if self.device != "cpu" and providers == [onnx_runtime.CPU_PROVIDER]:
            return torch_instead(f"the installed onnxruntime has no provider for "
                                 f"{self.device}")
        key = (self.model_version, self.device)
        cached = _GRAPHS.get(key)
        try:
            graph = cached[0] if cached else onnx_bytes(self.model, self.spec)
            model = OnnxRuntimeModel(graph, providers)
            diff = cached[1] if cached else None
            if asked == "auto" and diff is None:
                diff = self._difference(model)
        except Exception as exc:  # export or session errors of many types
            logger.info("%s: the ONNX graph failed (%s)", self.model_version,
                        type(exc).__name__, exc_info=True)
            return torch_instead(f"its ONNX graph cannot be exported or run "
                                 f"({type(exc).__name__})")
        _GRAPHS.put(key, graph, diff)
        if asked == "onnxruntime":
            return model, RuntimeChoice(asked, "onnxruntime", "IMGRET_RUNTIME=onnxruntime",
                                        diff)
        assert diff is not None
        if not diff <= EQUALITY_BOUND:  # also NaN
            return torch_instead(f"ONNX Runtime's vectors differ from torch's by {diff:.1e} "
                                 f"on the version's sample, over the bound {EQUALITY_BOUND:g}")
        return model, RuntimeChoice(
            asked, "onnxruntime", "ONNX Runtime gives torch's vectors on the version's sample "
            "and runs faster", diff, EQUALITY_BOUND)

    def _difference(self, model: OnnxRuntimeModel) -> float:
        """The largest coordinate difference between ONNX Runtime's and torch's vectors on
        the version's sample (:data:`EQUALITY_SAMPLE` seeded noise images through the
        version's preprocessing; as one batch, and the first image alone)."""
        rng = np.random.default_rng(0)
        size = self.spec.image_size
        images = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
                  for _ in range(EQUALITY_SAMPLE)]
        batch = self.preprocess(images)
        with self._inference():
            by_torch = self.model(batch.to(self.device)).float().cpu().numpy()
        diffs = [np.abs(model.run(batch.numpy()) - by_torch).max(),
                 np.abs(model.run(batch[:1].numpy()) - by_torch[:1]).max()]
        return float(max(diffs))

    @classmethod
    def from_checkpoint(cls, source: str | Path | Checkpoint, *, device: str = "auto",
                        **kwargs) -> Embedder:
        """Wrap a loaded checkpoint, or load ``model.pt`` (or its run directory) first."""
        ckpt = source if isinstance(source, Checkpoint) else load_checkpoint(source)
        return cls(ckpt.model, ckpt.spec, device=device, model_version=ckpt.model_version,
                   quantized=ckpt.quantized, **kwargs)

    @classmethod
    def from_model(cls, model: EmbeddingNet, spec: ModelSpec | None = None, **kwargs) -> Embedder:
        """Wrap a live model (training validation); the device defaults to the model's."""
        kwargs.setdefault("device", next(model.parameters()).device.type)
        return cls(model, spec or model.spec, **kwargs)

    @property
    def onnx_graph(self) -> bytes | None:
        """The ONNX graph ONNX Runtime runs; None when torch runs the network."""
        return self._onnx.graph if self._onnx is not None else None

    @property
    def runtime_bytes(self) -> int:
        """Memory the runtime holds besides the torch model: with ONNX Runtime, the graph
        (kept to open sessions) and the session's copy of the weights, about its size
        again."""
        return 2 * len(self.onnx_graph or b"")

    @property
    def dim(self) -> int:
        return self.spec.dim

    def preprocess(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """``(n, 3, S, S)`` float32 CPU tensor, the model's input."""
        return torch.stack([self.transform(image) for image in images])

    def embed(self, images: Sequence[Image.Image]) -> np.ndarray:
        """Embed RGB images.

        Args:
            images: decoded images (see ``imgret.images.decode_image``).

        Returns:
            ``(n, dim)`` float32, each row of unit L2 norm.

        Raises:
            ModelRunError: the model cannot run, or gave vectors that are not finite.
        """
        if len(images) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.embed_tensors(self.preprocess(images))

    def embed_tensors(self, batch: torch.Tensor) -> np.ndarray:
        """Embed already preprocessed ``(n, 3, S, S)`` tensors (datasets that load tensors);
        ``(0, dim)`` for an empty batch (a slice whose every image failed to decode)."""
        if len(batch) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self._onnx is not None:
            return self._usable(self._embed_onnx(batch), len(batch))
        out = []
        for chunk in device_chunks(batch, self.batch_size, self.device):
            with self._forward_lock, self._inference():
                out.append(self.model(chunk).float().cpu())
        return self._usable(torch.cat(out).numpy().astype(np.float32, copy=False), len(batch))

    def _usable(self, vectors: np.ndarray, n: int) -> np.ndarray:
        """``vectors`` when they are ``(n, dim)`` and finite. A NaN or infinite vector has no
        rank in any index (its scores are NaN, which JSON cannot carry and metrics cannot
        order), so no caller (ingest, re-embedding, search, evaluation) gets one: the model
        is refused where it runs, whichever runtime runs it.

        Raises:
            ModelRunError: the wrong shape, or a value that is not finite.
        """
        if vectors.shape != (n, self.dim):
            raise ModelRunError(f"model version {self.model_version} gave vectors of shape "
                                f"{tuple(vectors.shape)} for {n} images, not ({n}, {self.dim})")
        if not np.isfinite(vectors).all():
            raise ModelRunError(f"model version {self.model_version} produced non-finite "
                                "vectors (NaN or infinite values); it cannot be used")
        return vectors

    def _embed_onnx(self, batch: torch.Tensor) -> np.ndarray:
        assert self._onnx is not None
        out = []
        for start in range(0, len(batch), self.batch_size):
            chunk = batch[start : start + self.batch_size].detach().cpu().numpy()
            with self._forward_lock:
                out.append(self._onnx.run(chunk))
        return np.concatenate(out).astype(np.float32, copy=False)

    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.device == "cuda"
            else contextlib.nullcontext()
        )
        try:
            with torch.inference_mode(), autocast:
                yield
        finally:
            self.model.train(was_training)


def device_chunks(batch: torch.Tensor, size: int, device: str) -> Iterator[torch.Tensor]:
    """``batch`` in chunks of ``size`` rows on ``device``.

    On CUDA each chunk is copied from pinned host memory on a side stream while the previous
    one is computed, so the copy leaves the critical path (a pageable host tensor is copied
    synchronously, through a staging buffer): the chunk after the one being yielded is
    already on its way. The compute stream waits for a chunk's copy before using it, and the
    chunk is recorded on the compute stream so its memory is not reused while in use.
    Chunks are channels-last there (the layout the bf16 convolutions want). Elsewhere they
    are plain slices.
    """
    starts = range(0, len(batch), size)
    if device != "cuda":
        for start in starts:
            yield batch[start : start + size]
        return
    copies = torch.cuda.Stream()
    compute = torch.cuda.current_stream()

    def send(start: int) -> torch.Tensor:
        host = batch[start : start + size]
        if not host.is_pinned():
            host = host.pin_memory()
        with torch.cuda.stream(copies):
            return host.to(device, non_blocking=True).contiguous(
                memory_format=torch.channels_last)

    pending = send(0) if len(batch) else None
    for start in starts:
        chunk = pending
        assert chunk is not None
        compute.wait_stream(copies)
        chunk.record_stream(compute)
        following = start + size
        pending = send(following) if following < len(batch) else None
        yield chunk
