"""The forked worker pool of a bulk ingest: decoding, preprocessing and (on the CPU) the
forward passes in child processes, slices handed back through shared memory.

See :class:`EmbedWorkers` for why processes, why forked, and the protocol; measurements of
the choices made here are in docs/ingest_bench.md.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from imgret.embedder import Embedder
from imgret.files import read_file
from imgret.gallery.ingest.decode import decode_slice
from imgret.gallery.ingest.plan import Candidate
from imgret.gallery.media.files import MediaStore, sha256_hex

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def default_workers(embedder: Embedder) -> int:
    """Worker processes of a bulk ingest: one per core when they embed (a CPU model: one
    torch thread each), else ``min(4, cores)`` decoders beside this process's GPU."""
    cores = os.cpu_count() or 1
    return cores if embedder.device == "cpu" else min(4, cores)


@dataclass
class Slice:
    """What became of one slice: the vectors of the candidates that decoded (``(k, d)``
    float32, in order), per candidate ``None`` or why it failed and the temporary media file
    staged for it (or ``None``), and the seconds spent decoding and embedding it, wherever
    that ran."""

    vectors: np.ndarray
    errors: list[str | None]
    staged: list[str | None]
    decode_seconds: float = 0.0
    embed_seconds: float = 0.0


@dataclass
class _Task:
    """One slice handed to the workers, and where it stands."""

    work: list[Candidate]
    stage: list[bool]  # per candidate: also stage its bytes in the media store
    worker: int | None = None  # the worker it was sent to; None: not sent (yet)
    slot: int = -1
    done: Slice | None = None  # embedded in this process


class EmbedWorkers:
    """Decoding, preprocessing (``decode_for_embedding`` + ``Embedder.preprocess``, the
    served path's) and, on the CPU, the forward passes, in forked worker processes,
    overlapped with this process's reading, hashing, planning, media writes and SQL.

    Why processes: per image, decoding and preprocessing are mostly Python (Pillow's file
    parsing, torchvision's transforms) that holds the GIL; threads cannot run them beside
    each other. Forked (not spawned): the workers start in milliseconds with the model, its
    transform and the decoding code already loaded, and nothing is pickled but file paths.

    Why the forward passes too (on the CPU): with decoding cheap, the forward passes are the
    ingest's critical path, and this process would run them on the one torch thread the
    workers leave. Each worker runs whole slices with one torch thread (a forked child cannot
    use more once this process has run OpenMP on several), so on the CPU there is one worker
    per core by default: as many forward passes at a time as cores, no OpenMP team to stall
    when this process's writer takes a core, and only vectors come back. On a GPU the workers
    only decode (a forked child cannot use CUDA; ``min(4, cores)`` of them) and this process
    runs the model. Memory: the weights are shared with this process (forked, never
    written), but each worker holds one batch's activations at a time, so ``workers``
    forward passes are in memory at once (``--workers`` / ``--batch-size`` bound it).

    Protocol: a task is one slice of candidates (at most ``batch_size``: one forward pass),
    sent as ``(slot, [(path, sha256, stage), ...])``; the worker reads each file again, checks
    that its bytes still hash to ``sha256`` (a file changed since it was hashed fails),
    decodes and preprocesses it, embeds the slice (on the CPU), writes the ``(k, d)`` vectors
    (or the ``(k, 3, S, S)`` inputs) into that slot of its shared-memory buffer and answers
    ``(k, errors, staged, decode seconds, embed seconds)``. With ``stage`` (an image the
    plan creates) it also writes the bytes to a temporary file in the media store
    (``MediaStore.stage``: file creation is most of a media write's cost), which the chunk's
    write transaction syncs and renames under the gallery write lock (``put_many``); a worker
    removes the temporary files it made that are still there when it exits. Messages are a few
    hundred bytes, so no pipe ever fills. Each worker has ``_SLOTS`` slots; slices wait in a
    queue until a slot is free (:meth:`release` frees one), which bounds the memory whatever
    the chunk size. A worker ignores SIGINT and exits when its pipe closes (this process
    ended, or was killed), or when :meth:`finish` says no slice is left (it then leaves its
    staged files to this process). If a worker dies, the rest of the run is embedded in this
    process; with ``workers == 0`` (or no ``fork``) everything is, when :meth:`result` asks
    for it.

    While workers run, torch's intra-op threads in this process are limited to the cores the
    workers leave (at least one), and restored on exit.
    """

    def __init__(self, embedder: Embedder, max_pixels: int, workers: int, *,
                 media: MediaStore | None = None, embed_in_workers: bool | None = None):
        self.embedder = embedder
        self.max_pixels = max_pixels
        self.media = media
        size = embedder.spec.image_size
        self.shape = (3, size, size)
        self.workers = workers if workers > 0 and _can_fork() else 0
        # What a worker hands back per image: its vector, or (a GPU model: a forked child
        # cannot use CUDA) its model input. ``embed_in_workers`` forces either (tests).
        self.embeds = (embedder.device == "cpu" if embed_in_workers is None
                       else embed_in_workers)
        self.row_shape = (embedder.dim,) if self.embeds else self.shape
        self.slot_bytes = embedder.batch_size * int(np.prod(self.row_shape)) * 4
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._buffers: list[mmap.mmap] = []
        self._free: list[list[int]] = []  # free slots, per worker
        self._sent: list[collections.deque[int]] = []  # tickets in flight, per worker, in order
        self._tasks: dict[int, _Task] = {}
        self._queue: collections.deque[int] = collections.deque()  # tickets not sent yet
        self._next = 0
        self._threads: int | None = None
        self.finished = False  # finish() was called: the workers' staged files are ours

    def __enter__(self) -> EmbedWorkers:
        if self.workers:
            try:
                self._start()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- lifecycle

    def _start(self) -> None:
        import multiprocessing

        import torch

        context = multiprocessing.get_context("fork")
        parent_ends: list[Any] = []
        for _ in range(self.workers):
            buffer = mmap.mmap(-1, _SLOTS * self.slot_bytes)  # MAP_SHARED: the child's too
            mine, theirs = context.Pipe()
            parent_ends.append(mine)
            process = context.Process(
                target=_embed_worker, name="imgret-ingest-worker", daemon=True,
                args=(theirs, list(parent_ends), buffer, self.slot_bytes, self.embedder,
                      self.max_pixels, self.media, self.embeds),
            )
            process.start()
            theirs.close()
            self._procs.append(process)
            self._conns.append(mine)
            self._buffers.append(buffer)
            self._free.append(list(range(_SLOTS)))
            self._sent.append(collections.deque())
        self._threads = torch.get_num_threads()
        torch.set_num_threads(max(1, min(self._threads, (os.cpu_count() or 1) - self.workers)))
        logger.debug("%d workers (%s); torch threads here %d -> %d", self.workers,
                     "decode + embed" if self.embeds else "decode", self._threads,
                     torch.get_num_threads())

    def finish(self) -> None:
        """No more slices: each worker exits now, beside this process's last writes,
        instead of at :meth:`close`. Call once every ticket was collected; the files the
        workers staged are then this process's to rename or remove (a worker leaves them).
        If this process is killed before it does, those files stay until ``imgret gc``
        sweeps them (``MediaStore.sweep_temporaries``: their writers are gone), where a
        worker seeing its parent die would have removed them: a window of the run's last
        write or two."""
        self.finished = True
        for conn in self._conns:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(_FINISH)

    def close(self) -> None:
        for conn in self._conns:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(None)
                conn.close()
        for process in self._procs:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        # The buffers are unmapped with their last view (a caller may still hold inputs).
        self._procs, self._conns, self._buffers = [], [], []
        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)
            self._threads = None

    # -- tasks

    def submit(self, work: list[Candidate], stage: list[bool] | None = None) -> int:
        """Queue a slice (at most ``batch_size`` candidates) for embedding, and for staging
        the bytes of those flagged in ``stage``; returns its ticket. Tickets must be collected
        (:meth:`result`, then :meth:`release`) in this order."""
        ticket, self._next = self._next, self._next + 1
        self._tasks[ticket] = _Task(work, stage or [False] * len(work))
        self._queue.append(ticket)
        self._pump()
        return ticket

    def result(self, ticket: int) -> Slice:
        """The slice's vectors, errors and staged files (see :class:`Slice`)."""
        task = self._tasks[ticket]
        self._pump()
        if task.worker is not None:
            try:
                while True:  # a worker answers in the order it got its tasks
                    count, errors, staged, decode_s, embed_s = self._conns[task.worker].recv()
                    if self._sent[task.worker].popleft() == ticket:
                        break
            except (EOFError, OSError):
                self._lost(task.worker)
            else:
                rows = np.frombuffer(
                    self._buffers[task.worker], dtype=np.float32,
                    count=count * int(np.prod(self.row_shape)),
                    offset=task.slot * self.slot_bytes,
                ).reshape(count, *self.row_shape)
                if self.embeds:  # copied: the slot takes another slice once released
                    return Slice(rows.copy(), errors, staged, decode_s, embed_s)
                import torch

                vectors, embed_s = self._embed(torch.from_numpy(rows))
                return Slice(vectors, errors, staged, decode_s, embed_s)
        if task.done is None:
            self._queue.remove(ticket)
            task.done = self.embed_here(task.work)
        return task.done

    def release(self, ticket: int) -> None:
        """The slice's inputs are no longer used: its slot takes the next queued slice."""
        task = self._tasks.pop(ticket)
        if task.worker is not None and self._conns[task.worker] is not None:
            self._free[task.worker].append(task.slot)
        self._pump()

    def _pump(self) -> None:
        """Send queued slices, oldest first, to the workers with free slots."""
        while self._queue:
            live = [w for w, conn in enumerate(self._conns) if conn is not None and self._free[w]]
            if not live:
                return
            worker = max(live, key=lambda w: len(self._free[w]))
            ticket = self._queue[0]
            task = self._tasks[ticket]
            slot = self._free[worker].pop()
            try:
                self._conns[worker].send((slot, [(c.origin, c.sha256, flag) for c, flag
                                                 in zip(task.work, task.stage, strict=True)]))
            except OSError:
                self._lost(worker)
                continue
            self._queue.popleft()
            task.worker, task.slot = worker, slot
            self._sent[worker].append(ticket)

    def _lost(self, worker: int) -> None:
        """A worker died: stop using workers; whatever was sent is embedded here instead."""
        process = self._procs[worker]
        process.join(timeout=1)
        logger.warning("ingest worker %s ended (exit code %s); embedding in this process",
                       process.pid, process.exitcode)
        for index, conn in enumerate(self._conns):
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(None)
                conn.close()
                self._conns[index] = None
        for sent in self._sent:
            for ticket in sent:
                self._tasks[ticket].worker = None
            sent.clear()
        # Not sent: they stay in the queue, which is decoded here from now on, in order.
        self._queue = collections.deque(sorted(
            [t for t, task in self._tasks.items() if task.worker is None and task.done is None]
        ))

    def embed_here(self, work: list[Candidate]) -> Slice:
        """Decode, preprocess and embed a slice in this process, outside the ticket order."""
        import torch

        start = time.perf_counter()
        inputs, errors = decode_slice([(c.data, c.sha256, None) for c in work], self.embedder,
                                      self.max_pixels)
        decode_s = time.perf_counter() - start
        vectors, embed_s = self._embed(torch.from_numpy(inputs))
        return Slice(vectors, errors, [None] * len(work), decode_s, embed_s)

    def _embed(self, inputs: torch.Tensor) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        vectors = self.embedder.embed_tensors(inputs)
        return vectors, time.perf_counter() - start


# Shared-memory slots per worker: one being written, one waiting to be collected, one queued
# ahead.
_SLOTS = 3
# Told to a worker by EmbedWorkers.finish (None, or its pipe closing, ends it too, but
# removes the files it staged).
_FINISH = "finish"


def _can_fork() -> bool:
    import multiprocessing

    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _embed_worker(conn, close: list, buffer: mmap.mmap, slot_bytes: int, embedder: Embedder,
                  max_pixels: int, media: MediaStore | None, embeds: bool) -> None:
    """A worker's loop (a forked child of the ingesting process)."""
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    for other in close:  # the parent's ends: EOF here once the parent is gone
        other.close()
    # One thread: a child forked after its parent ran OpenMP regions on several threads
    # hangs in its first multi-threaded region (GNU libgomp keeps no pool across fork: a
    # resnet18 forward with 2 threads in the child never returns).
    torch.set_num_threads(1)
    _warm_up(embedder, max_pixels, embeds)
    temps: list[str] = []
    try:
        while True:
            try:
                task = conn.recv()
            except (EOFError, OSError):
                return
            if task is None:
                return
            if task == _FINISH:
                temps = []  # every slice was collected: the parent renames or removes them
                return
            slot, items = task
            blobs: list[tuple[bytes | None, str, str | None]] = []
            for path, sha, _ in items:
                try:
                    blobs.append((read_file(path), sha, None))
                except OSError as exc:
                    blobs.append((None, sha, f"cannot read file ({exc.strerror})"))
            decoded = time.perf_counter()
            inputs, errors = decode_slice(blobs, embedder, max_pixels)
            embedded = time.perf_counter()
            rows = embedder.embed_tensors(torch.from_numpy(inputs)) if embeds else inputs
            done = time.perf_counter()
            staged: list[str | None] = [None] * len(items)
            if media is not None:
                for index, ((data, _, _), (_, sha, stage)) in enumerate(zip(blobs, items,
                                                                             strict=True)):
                    if stage and errors[index] is None and data is not None:
                        with contextlib.suppress(OSError):  # the writer writes it instead
                            staged[index] = media.stage(data, sha)
                            temps.append(staged[index])
            flat = rows.reshape(-1)
            np.frombuffer(buffer, dtype=np.float32, count=flat.size,
                          offset=slot * slot_bytes)[:] = flat
            try:
                conn.send((len(rows), errors, staged, embedded - decoded, done - embedded))
            except OSError:
                return
    finally:
        # Those the parent renamed are gone; the rest (a failed or killed run) are removed.
        for temp in temps:
            with contextlib.suppress(OSError):
                os.unlink(temp)


def _warm_up(embedder: Embedder, max_pixels: int, embeds: bool) -> None:
    """Decode (and embed) one blank image, so that a fresh worker's one-off costs (Pillow
    and torch setting up, first-call paths) are paid before its first slice, while the
    parent lists and reads (measured in docs/ingest_bench.md). Best effort: a failure here
    is the first slice's to report."""
    import io

    import torch
    from PIL import Image

    try:
        size = embedder.spec.image_size
        buffer = io.BytesIO()
        Image.new("RGB", (size, size)).save(buffer, "PNG")
        data = buffer.getvalue()
        inputs, _ = decode_slice([(data, sha256_hex(data), None)], embedder, max_pixels)
        if embeds and len(inputs):
            embedder.embed_tensors(torch.from_numpy(inputs))
    except Exception:  # noqa: BLE001 - only a warm-up
        logger.debug("ingest worker warm-up failed", exc_info=True)
