"""The rank engine: the exact 1-based rank of every relevant gallery item of every query.

For a query whose relevant items score ``v_1..v_R``, the rank of item ``j`` is
``1 + #{gallery items that beat v_j}``, where an item beats ``v_j`` with a higher score, or an
equal score and a lower gallery index (the order of a stable sort on descending score). That
count is all any metric needs: the gallery is never sorted and no top-k is selected, however
deep the relevant items rank.

Per chunk of queries: one float32 GEMM gives the scores (torch, on the caller's ``device``),
then a numba-compiled kernel, parallel over the chunk's rows, counts the ranks
(:func:`rank_kernel`). The next chunk's GEMM runs in a helper thread while the kernel works on
this one. Thread counts are whatever torch and numba are configured with: nothing process-wide
is changed here.

One engine (issue 11): this was the fastest of the three exact engines the module had, measured
on the CPU (2 cores, ``benchmarks/metrics_bench.py`` data, best of 3): 10,000 x 10,000
leave-one-out at noise 1.5 / 2.0: numba 0.61 / 0.70 s, a NumPy block algorithm 0.68 / 1.03 s,
torch ``searchsorted`` 7.0 / 5.8 s; 2,000 x 200,000: 1.9 / 2.4 / 15.4 s. The torch engine
served ``device="cuda"``; its CUDA speed was never measured, and no caller hands over tensors
already on a GPU (training and the demo pass NumPy embeddings), so it went too. With a CUDA
``device`` the GEMM runs on the GPU and each chunk's scores are copied to the host for the
kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from imgret.metrics.relevance import RelevancePlan

# Default size of one chunk of the float32 score matrix (chunk_size x gallery); two are held
# (the next chunk's GEMM overlaps this chunk's rank counting).
CHUNK_BYTES = 256 << 20

Consumer = Callable[[int, int, np.ndarray, np.ndarray], None]


def exact_ranks(
    q: torch.Tensor,
    g: torch.Tensor,
    plan: RelevancePlan,
    evaluated: np.ndarray,
    chunk_size: int,
    consume: Consumer,
) -> None:
    """Exact ranks of the relevant items of every evaluated query, handed to ``consume``.

    ``q`` and ``g`` are float32 tensors on one device; ``evaluated`` the query indices with
    ``R > 0``. ``consume(lo, hi, ranks, offsets)`` receives the evaluated queries ``lo:hi``
    (positions in ``evaluated``), chunk by chunk, with their relevant ranks in ascending order,
    CSR by ``offsets``: memory holds one chunk's scores and ranks, never all of them.
    """
    kernel = compiled_kernel()
    n_g = g.shape[0]
    chunk = min(chunk_size, len(evaluated))
    starts = list(range(0, len(evaluated), chunk))
    bufs = [np.empty((chunk, n_g), np.float32) for _ in range(min(2, len(starts)))]

    def gemm(i: int) -> None:
        rows = torch.from_numpy(evaluated[starts[i] : starts[i] + chunk]).to(q.device)
        out = torch.from_numpy(bufs[i % 2][: len(rows)])
        if q.device.type == "cpu":
            torch.mm(q[rows], g.T, out=out)
        else:  # the kernel runs on the host: bring the scores there
            out.copy_(q[rows] @ g.T)

    with ThreadPoolExecutor(max_workers=1) as helper:
        gemm(0)
        for i, lo in enumerate(starts):
            pending = helper.submit(gemm, i + 1) if i + 1 < len(starts) else None
            qs = evaluated[lo : lo + chunk]
            S = bufs[i % 2][: len(qs)]
            rel_row, rel_col, rm_row, rm_col = plan.pairs(qs)
            if rm_row.size:
                S.reshape(-1)[rm_row * n_g + rm_col] = -np.inf
            offsets = np.concatenate([[0], np.cumsum(np.bincount(rel_row, minlength=len(qs)))])
            ranks = np.empty(len(rel_col), np.int64)
            kernel(S, offsets, rel_col, ranks)
            # The metrics read each query's ranks in ranking order.
            key = rel_row * (n_g + 1)
            consume(lo, lo + len(qs), np.sort(key + ranks) - key, offsets)
            if pending is not None:
                pending.result()


# numba.prange once compiled_kernel has imported numba; plain range for the uncompiled kernel.
_prange = range


def rank_kernel(S, rel_off, rel_col, out):
    """Exact 1-based ranks of the relevant items of score rows ``S`` (b, n) float32 into ``out``.

    Row ``r``'s relevant items are the gallery columns ``rel_col[rel_off[r]:rel_off[r + 1]]``
    (every row has at least one; removed items are already -inf in ``S``); ``out`` receives
    their ranks at the same positions.

    rank(j) = 1 + #{items with a higher score} + #{items with an equal score and a lower
    gallery index}. Per row, without a sort or a binary search:

    1. Cells: a monotone float32 map (multiply, add, clip, truncate) puts every score in one of
       ``n_cells`` cells spanning the row's relevant scores; the relevant scores are read back
       from the same cells, so a score in a higher cell than a relevant score is higher than
       it, exactly.
    2. A histogram of the cells and its suffix sums give "items in strictly higher cells".
    3. Only items that share a cell with a relevant score are compared with it one by one,
       ties included.

    Plain Python over NumPy scalars; :func:`compiled_kernel` is the same function compiled by
    numba (parallel over rows). Run uncompiled it is far too slow for real use and only lets
    the tests check the algorithm step by step.
    """
    b, n = S.shape
    for r in _prange(b):
        lo = rel_off[r]
        n_rel = rel_off[r + 1] - lo
        row = S[r]
        umin = np.float32(np.inf)
        umax = np.float32(-np.inf)
        for j in range(n_rel):
            x = row[rel_col[lo + j]]
            umin = min(umin, x)
            umax = max(umax, x)
        n_cells = min(max(64, 8 * n_rel), max(64, n))
        span = np.float64(umax) - np.float64(umin)
        w64 = (n_cells - 2) / span if span > 0 else 1.0
        # Cap the slope so that |umin * w| < 2**22: the float32 map then stays accurate to
        # < 1 cell (a near-zero span only puts more items in the relevant scores' cells,
        # which is slower, never wrong).
        w = np.float32(min(w64, 2.0**22 / max(abs(np.float64(umin)), 1.0)))
        bias = np.float32(1.5) - umin * w
        top = np.float32(n_cells + 1)
        cells = np.empty(n, np.int32)
        for e in range(n):  # vectorised
            cells[e] = np.int32(max(min(row[e] * w + bias, top), np.float32(0.0)))
        # Relevant items grouped by cell (counting sort). Their cells are read from
        # `cells`, so an item and its own score always agree.
        tstart = np.zeros(n_cells + 3, np.int64)
        for j in range(n_rel):
            tstart[cells[rel_col[lo + j]] + 2] += 1
        for c in range(2, n_cells + 3):
            tstart[c] += tstart[c - 1]
        torder = np.empty(n_rel, np.int64)
        for j in range(n_rel):
            c = cells[rel_col[lo + j]] + 1
            torder[tstart[c]] = j
            tstart[c] += 1
        # Two interleaved histograms break the store-to-load chain of repeated cells.
        hist = np.zeros(n_cells + 2, np.int64)
        hist2 = np.zeros(n_cells + 2, np.int64)
        for e in range(n // 2):
            hist[cells[2 * e]] += 1
            hist2[cells[2 * e + 1]] += 1
        if n % 2:
            hist[cells[n - 1]] += 1
        flag = np.zeros(n_cells + 2, np.uint8)
        for c in range(n_cells + 2):
            hist[c] += hist2[c]
            flag[c] = c > 0 and tstart[c + 1] > tstart[c]
        beats = np.zeros(n_rel, np.int64)
        for e in range(n):
            c = cells[e]
            if flag[c]:
                s = row[e]
                for p in range(tstart[c], tstart[c + 1]):
                    t = torder[p]
                    col = rel_col[lo + t]
                    if s > row[col] or (s == row[col] and e < col):
                        beats[t] += 1
        acc = 0
        for c in range(n_cells + 1, -1, -1):  # hist[c] := items in strictly higher cells
            h = hist[c]
            hist[c] = acc
            acc += h
        for j in range(n_rel):
            out[lo + j] = 1 + hist[cells[rel_col[lo + j]]] + beats[j]


@functools.cache
def compiled_kernel():
    """:func:`rank_kernel` compiled by numba, parallel over rows; compiled on first use and
    cached on disk when the package directory is writable."""
    # Imported here: numba's import costs ~0.5 s, which only an evaluation should pay.
    import numba

    global _prange
    _prange = numba.prange  # resolved as a global when numba compiles rank_kernel
    options = {"parallel": True, "nogil": True, "boundscheck": False}
    try:
        return numba.njit(cache=True, **options)(rank_kernel)
    except RuntimeError:  # no writable cache location: compile without caching
        return numba.njit(**options)(rank_kernel)
