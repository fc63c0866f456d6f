"""How a CPU search spends the cores: OpenMP threads by batch size, and BLAS for small
exact batches.

Measured on the 2-core CPU (100k x 128 float32 gallery, k = 10; ``benchmarks/index_bench.py``
and the QPS below, best of alternating rounds, load from a neighbour's tests):

=========  ===========  ============  ============  =======================================
batch      NumPy        FAISS,        FAISS,        BLAS product + FAISS heap, 1 OpenMP
           brute force  1 thread      2 threads     thread (the path below for Flat)
=========  ===========  ============  ============  =======================================
1          971          579           529           1,169
8          2,481        586           1,144         3,860
32         2,298        598           1,144         5,879
1,000      2,596        4,338         7,954         5,557
=========  ===========  ============  ============  =======================================

Two facts explain the table:

- Below ``distance_compute_blas_threshold`` (``n x d < 128,000``: fewer than 1,000 queries of
  128-d), FAISS's flat search scans the whole gallery once *per query* (one query per
  OpenMP thread), so 8 or 32 queries read it 8 or 32 times; one matrix product reads it once.
  So an exact inner-product ``Flat`` index is searched below that threshold with one BLAS
  product per block (NumPy's, multi-threaded) and FAISS's top-k heaps (:class:`ExactFlat`);
  at and above it, FAISS's own BLAS path with all threads wins.
- Two thread pools on two cores fight: FAISS's OpenMP workers spin at their barriers while
  NumPy's OpenBLAS workers want the same cores (the heap with 2 OpenMP threads right after a
  NumPy product ran at 87 QPS for one query), and a single query has nothing to share (FAISS
  parallelises over queries; with one query its only parallel region is IndexIDMap's id
  translation, which costs a thread wake-up, or a time slice when a neighbour holds the other
  core). So FAISS runs on one OpenMP thread for a single query and for the heap of the BLAS
  path, and on ``min(batch, threads)`` otherwise (:func:`faiss_threads`).

Concurrency. ``faiss.omp_set_num_threads`` sets the OpenMP ``nthreads-var`` ICV, which OpenMP
keeps per thread (libgomp, which FAISS's wheel bundles, gives every thread that sets it its own
copy; ``tests/unit/gallery/test_search_threads.py`` checks it): two searches that overlap in two
threads each set and restore their own thread's count, and neither sees the other's. The count
is restored after the call so that other FAISS work on the same thread (an index build, the
metrics) keeps the thread count it had.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import faiss
import numpy as np

# One BLAS product covers up to _QUERY_BLOCK queries and as many gallery rows as keep its
# scores within _SCORE_BLOCK floats (16 MiB), at least _GALLERY_BLOCK rows: a single query is
# one product over a 100k gallery, 256 queries take 16,384 rows (8 MiB at 128-d) at a time.
_QUERY_BLOCK = 256
_GALLERY_BLOCK = 16_384
_SCORE_BLOCK = 4 * 1024 * 1024
# Each searching thread keeps the buffer its products are written into (at most _SCORE_BLOCK
# floats, 16 MiB): a fresh one per search would pay its page faults every time, a few percent
# of a single query over 100k vectors.
_scratch = threading.local()
# The "something more urgent is running" test of a thread that searches in the background
# (:func:`yielding_to`), per thread.
_pacing = threading.local()


def limit_pthreads_blas(n: int) -> int:
    """Limit every loaded BLAS that keeps a pthreads pool of its own (NumPy's OpenBLAS) to at
    most ``n`` threads, process-wide; returns how many libraries it limited.

    For a process whose cores belong to something else, the search service: after each product
    OpenBLAS's workers spin on their cores for a while (``OPENBLAS_THREAD_TIMEOUT``, about
    2^28 cycles by default) before they sleep, so a search batch (the :class:`ExactFlat`
    product) followed by the next batch's forward pass left torch's OpenMP team fighting two
    spinning threads for the two cores (a forward pass several times slower after a search:
    docs/service_bench.md).
    A single-threaded product costs a service batch little (it is well under a millisecond on
    a few thousand vectors, against tens of milliseconds of model).

    The OpenMP BLAS that FAISS bundles follows FAISS's OpenMP thread count
    (:func:`faiss_threads`) and is left alone. Needs ``threadpoolctl`` (installed with
    scikit-learn, which pytorch-metric-learning requires); without it nothing changes.
    """
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - a dependency of a dependency
        return 0
    limited = 0
    for lib in ThreadpoolController().lib_controllers:
        if lib.user_api == "blas" and getattr(lib, "threading_layer", None) == "pthreads":
            if lib.num_threads > n:
                lib.set_num_threads(max(1, n))
            limited += 1
    return limited


@contextmanager
def faiss_threads(n: int) -> Iterator[int]:
    """Run the FAISS calls of the block on at most ``n`` OpenMP threads, and never more than
    this thread has now; then restore this thread's count. Yields the count in force.

    Pass a search's batch size: one thread per query (FAISS parallelises over queries), so a
    single query runs on one thread.
    """
    before = faiss.omp_get_max_threads()
    wanted = max(1, min(int(n), before))
    if wanted == before:
        yield before
        return
    faiss.omp_set_num_threads(wanted)
    try:
        yield wanted
    finally:
        faiss.omp_set_num_threads(before)


@contextmanager
def yielding_to(busy: Callable[[], bool], *, max_wait_s: float = 0.02,
                poll_s: float = 0.001) -> Iterator[None]:
    """Make the exact searches of this thread, within the block, background work: before each
    block product (:class:`ExactFlat`, ~10 ms at most over 100k vectors) the thread waits
    while ``busy()`` says more urgent work runs, up to ``max_wait_s`` per block, so it never
    starves.

    Why: on a 2-core machine a re-ranking (hundreds of neighbourhood searches in a few large
    products) that runs beside a search batch's forward pass takes a core from the model
    thread's OpenMP team, and every plain search of that batch waits for it; a lower CPU
    priority alone was not enough (``benchmarks/rerank_flood_bench.py``). Pausing between
    products bounds what a background search takes from a batch to about one product.

    The pause happens under the Searcher's read lock, so a writer that waits meanwhile (and
    the searches queued behind it) waits at most ``max_wait_s`` per block more.
    """
    before = getattr(_pacing, "busy", None), getattr(_pacing, "limits", None)
    _pacing.busy, _pacing.limits = busy, (max_wait_s, poll_s)
    try:
        yield
    finally:
        _pacing.busy, _pacing.limits = before


def pause_point() -> None:
    """Wait while this thread's :func:`yielding_to` test says busy (bounded); else return."""
    busy = getattr(_pacing, "busy", None)
    if busy is None or not busy():
        return
    max_wait_s, poll_s = _pacing.limits
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if not busy():
            return


def uses_blas_path(n_queries: int, dim: int) -> bool:
    """Whether FAISS's flat search takes its BLAS path for this batch (else it scans the
    gallery once per query)."""
    return n_queries * dim >= faiss.cvar.distance_compute_blas_threshold


def _products(rows: int, cols: int) -> np.ndarray:
    """This thread's ``(rows, cols)`` float32 C-ordered buffer for a block's scores."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < rows * cols:
        buffer = _scratch.buffer = np.empty(rows * cols, dtype=np.float32)
    return buffer[: rows * cols].reshape(rows, cols)


class ExactFlat:
    """An exact inner-product ``Flat`` index, searched with BLAS products and FAISS's heaps.

    Only ``IndexIDMap``/``IndexIDMap2`` directly over an ``IndexFlat`` with the inner-product
    metric qualifies (:meth:`of`). :meth:`search` reads the index's vectors and ids in place
    (no copy): call it only while no add or remove can run (the Searcher's read lock).
    """

    def __init__(self, idmap: faiss.IndexIDMap | faiss.IndexIDMap2, flat: faiss.IndexFlat):
        self._idmap, self._flat = idmap, flat

    @classmethod
    def of(cls, index: faiss.Index) -> ExactFlat | None:
        """The BLAS search of ``index``, or ``None`` when it is not an exact IP ``Flat``."""
        top = faiss.downcast_index(index)
        if not isinstance(top, (faiss.IndexIDMap, faiss.IndexIDMap2)):
            return None
        flat = faiss.downcast_index(top.index)
        if type(flat) not in (faiss.IndexFlatIP, faiss.IndexFlat):
            return None
        if flat.metric_type != faiss.METRIC_INNER_PRODUCT:
            return None
        return cls(top, flat)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact inner-product top ``k`` of each query: blocks of ``queries @ vectors.T``
        (NumPy's BLAS, its own threads) fed to FAISS's heaps on one OpenMP thread (see the
        module docstring).

        Args:
            queries: ``(m, d)`` float32, C-contiguous.
            k: results per query, at least 1.

        Returns:
            ``(scores (m, k) float32, ids (m, k) int64)``, best first, like
            ``imgret.gallery.search``: ``-1`` ids (and ``-inf``-like scores) where the index holds
            fewer than ``k`` vectors.
        """
        n, d = int(self._flat.ntotal), int(self._flat.d)
        m = len(queries)
        scores = np.empty((m, k), dtype=np.float32)
        rows = np.empty((m, k), dtype=np.int64)
        heaps = faiss.float_minheap_array_t()  # min-heaps keep the k largest scores
        heaps.nh, heaps.k = m, k
        heaps.val, heaps.ids = faiss.swig_ptr(scores), faiss.swig_ptr(rows)
        with faiss_threads(1):
            heaps.heapify()
            if n:
                vectors = faiss.rev_swig_ptr(self._flat.get_xb(), n * d).reshape(n, d)
                q_block = min(m, _QUERY_BLOCK)
                g_block = max(_GALLERY_BLOCK, _SCORE_BLOCK // q_block)
                for q0 in range(0, m, q_block):
                    block = queries[q0 : q0 + q_block]
                    for j0 in range(0, n, g_block):
                        pause_point()
                        part = vectors[j0 : j0 + g_block]
                        products = np.matmul(block, part.T,
                                             out=_products(len(block), len(part)))
                        heaps.addn(products.shape[1], faiss.swig_ptr(products), j0, q0,
                                   len(block))
            heaps.reorder()
        if not n:
            return scores, rows
        ids = faiss.rev_swig_ptr(self._idmap.id_map.data(), n)
        found = rows >= 0
        return scores, np.where(found, ids[np.where(found, rows, 0)], -1)
