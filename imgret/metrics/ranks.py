"""The rank engine: the exact 1-based rank of every relevant gallery item of every query.

For a query whose relevant items score ``v_1..v_R``, the rank of item ``j`` is
``1 + #{gallery items that beat v_j}``, where an item beats ``v_j`` with a higher score, or an
equal score and a lower gallery index (the order of a stable sort on descending score). That
count is all any metric needs: the gallery is never sorted and no top-k is selected, however
deep the relevant items rank.

Per chunk of queries: one float32 GEMM gives the scores (torch, on the caller's ``device``),
then a numba-compiled kernel, parallel over the chunk's rows, counts the ranks
(:func:`rank_kernel`), one pass over each score row. GEMM and kernel run one after the other
(each uses every core; overlapping them only oversubscribed the two cores this was measured
on). Thread counts are whatever torch and numba are configured with: nothing process-wide is
changed here.

How the kernel keeps its single pass cheap: cells are computed and compressed LANES at a time in
vector registers (AVX-512 or AVX2 where the CPU has them, else a portable path); two uint16
histograms are flushed into int64 totals and summed by one suffix pass; the relevant items are
laid out in cell order and each candidate's cell is kept from the counting pass; a candidate is
one int64 store (gallery index << 32 | cell) with an unsigned count, so numba emits no
negative-index wrap-around in the counting loop; the next score row is prefetched into L2
while one is counted (a chunk comes back from DRAM); each query's ranks are written already
ascending, so nothing is sorted afterwards.

Why one engine: a NumPy block algorithm and torch ``searchsorted`` were both slower on the CPU,
and no caller hands over tensors already on a GPU (training and the demo pass NumPy
embeddings). With a CUDA ``device`` the GEMM runs on the GPU and each chunk's scores are copied
to the host for the kernel. Timings against the bare product and against
pytorch-metric-learning: docs/metrics_bench.md (``benchmarks/metrics_bench.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from imgret.metrics.jit import compile_loop, with_globals
from imgret.metrics.relevance import RelevancePlan
from imgret.timing import timed

# Default size of one chunk of the float32 score matrix (chunk_size x gallery); one is held.
CHUNK_BYTES = 256 << 20


def default_chunk_size(n_queries: int, n_gallery: int) -> int:
    """Queries per chunk when the caller gives none: as many as fit CHUNK_BYTES of scores."""
    return max(1, min(n_queries, CHUNK_BYTES // (4 * n_gallery)))

Consumer = Callable[[int, int, np.ndarray, np.ndarray], None]


def exact_ranks(
    q: torch.Tensor,
    g: torch.Tensor,
    plan: RelevancePlan,
    evaluated: np.ndarray,
    chunk_size: int,
    consume: Consumer,
    record: Callable[[str, float], object] | None = None,
) -> None:
    """Exact ranks of the relevant items of every evaluated query, handed to ``consume``.

    ``q`` and ``g`` are float32 tensors on one device; ``evaluated`` the query indices with
    ``R > 0``. ``consume(lo, hi, ranks, offsets)`` receives the evaluated queries ``lo:hi``
    (positions in ``evaluated``), chunk by chunk, with their relevant ranks in ascending order,
    CSR by ``offsets``: memory holds one chunk's scores and ranks, never all of them.
    ``record(part, seconds)``, when given, is called per chunk with the seconds of
    ``"product"`` (the scores) and ``"ranks"`` (relevance pairs and the rank kernel), so that
    ``benchmarks/metrics_bench.py`` can set each beside its floor.
    """
    kernel = compiled_kernel()
    spend = record or (lambda part, seconds: None)
    n_g = g.shape[0]
    chunk = min(chunk_size, len(evaluated))
    # Allocated by torch: 64-byte aligned, where NumPy's large arrays start 16 bytes past a
    # page, and torch.mm writing into a misaligned out= buffer is about a third slower
    # (docs/metrics_bench.md).
    buf = torch.empty((chunk, n_g), dtype=torch.float32).numpy()
    for lo in range(0, len(evaluated), chunk):
        qs = evaluated[lo : lo + chunk]
        S = buf[: len(qs)]
        with timed(functools.partial(spend, "product")):
            rows = torch.from_numpy(qs).to(q.device)
            if q.device.type == "cpu":
                torch.mm(q[rows], g.T, out=torch.from_numpy(S))
            else:  # the kernel runs on the host: bring the scores there
                torch.from_numpy(S).copy_(q[rows] @ g.T)
        with timed(functools.partial(spend, "ranks")):
            rel_row, rel_col, rm_row, rm_col = plan.pairs(qs)
            if rm_row.size:
                S.reshape(-1)[rm_row * n_g + rm_col] = -np.inf
            offsets = np.concatenate([[0], np.cumsum(np.bincount(rel_row, minlength=len(qs)))])
            ranks = np.empty(len(rel_col), np.int64)
            kernel(S, offsets, rel_col, ranks)  # each query's ranks in ascending order
        consume(lo, lo + len(qs), ranks, offsets)


# Names rank_kernel calls: the plain-Python versions here; compiled_kernel compiles a copy of
# rank_kernel in which they are numba.prange and compiled functions.
_prange = range

# A row is scanned in blocks of BLOCK items, LANES at a time (one 512-bit vector of float32).
BLOCK = 512
LANES = 16
# Cells per relevant item, and interleaved histograms.
CELLS_PER_ITEM = 8
WAYS = 2
# The histograms count in uint16 (two ways of a 1,600-cell histogram fit in 6.4 KB of L1,
# against 25 KB for four ways of int32, most of L1d beside the streaming score row) and
# are added into int64 totals every FLUSH_BLOCKS blocks, before any count can pass 65,535
# (a way gains at most BLOCK per block).
FLUSH_BLOCKS = 65535 // BLOCK


def cell_of(x, w, bias, top):
    """The cell of score ``x`` (float32): ``trunc(clip(x * w + bias, 0, top))``."""
    return np.int64(max(min(x * w + bias, top), np.float32(0.0)))


def compress_cells(row, pos, cells, idx, k, w, bias, top):
    """Cells of ``row[pos:pos + LANES]``; those >= 1 are appended, with their item indices, at
    ``cells[k:]`` and ``idx[k:]`` (which have LANES - 1 spare slots). Returns the new ``k``.

    Branch-free (an item in cell 0 is written and then overwritten). On CPUs with AVX-512 or
    AVX2, :func:`compiled_kernel` replaces this with vector code (:func:`_vector_compress`).
    """
    for i in range(pos, pos + LANES):
        c = _cell(row[i], w, bias, top)
        cells[k] = c
        idx[k] = i
        k += c >= 1
    return k


_cell = cell_of
_compress = compress_cells


def add_counts(hist, totals, n_used, stride):
    """Add the WAYS histograms' first ``n_used`` cells into ``totals`` and zero them."""
    for u in range(WAYS):
        for c in range(n_used):
            totals[c] += hist[u * stride + c]
            hist[u * stride + c] = 0


_add_counts = add_counts


def prefetch(row, pos):
    """Hint that ``row[pos]`` will be read soon (a no-op here; :func:`compiled_kernel` makes
    it an L2 prefetch)."""


_prefetch = prefetch


def rank_kernel(S, rel_off, rel_col, out):
    """Exact 1-based ranks of the relevant items of score rows ``S`` (b, n) float32 into ``out``.

    Row ``r``'s relevant items are the gallery columns ``rel_col[rel_off[r]:rel_off[r + 1]]``
    (every row has at least one; removed items are already -inf in ``S``);
    ``out[rel_off[r]:rel_off[r + 1]]`` receives their ranks in ascending order.

    rank(j) = 1 + #{items with a higher score} + #{items with an equal score and a lower
    gallery index}. Per row, one pass over the scores, without a sort or a binary search:

    1. Cells: a monotone float32 map (:func:`cell_of`: multiply, add, clip, truncate) puts
       every score in one of ``n_cells`` cells spanning the row's relevant scores; cell 0 holds
       the items below every relevant score, which no rank counts. A score in a higher cell
       than a relevant score is higher than it, exactly. The relevant scores' own cells are
       computed first, with the same expression, and flag the cells that need a closer look.
    2. One pass over the row, LANES items at a time: their cells are computed and the items
       in cells >= 1 are compressed into a small buffer (:func:`compress_cells`; vector code
       with AVX-512 or AVX2); each of those adds one to its cell's count (WAYS
       interleaved uint16 histograms, so that runs of one cell do not chain on one counter,
       added into int64 totals every FLUSH_BLOCKS blocks and at the row's end) and is
       appended with its cell, without a branch, to a candidate list that only advances in a
       flagged cell.
    3. Only the candidates are compared with the relevant scores of their cell one by one,
       ties included; suffix sums of the totals count the items in strictly higher cells.

    Rows are split into contiguous segments, one per parallel task, each with its own scratch
    buffers. Plain Python over NumPy scalars; :func:`compiled_kernel` is the same function
    compiled by numba (parallel over segments). Run uncompiled it is far too slow for real use
    and only lets the tests check the algorithm step by step.
    """
    b, n = S.shape
    max_rel = 1
    for r in range(b):
        max_rel = max(max_rel, rel_off[r + 1] - rel_off[r])
    max_cells = min(max(64, CELLS_PER_ITEM * max_rel), max(64, n))
    stride = max_cells + 2
    n_seg = min(b, 16)
    for s in _prange(n_seg):
        hist = np.zeros(WAYS * stride, np.uint16)  # add_counts leaves it zeroed
        totals = np.empty(stride, np.int64)
        flag = np.empty(stride, np.uint8)
        cells = np.empty(BLOCK + LANES, np.int32)
        idx = np.empty(BLOCK + LANES, np.int32)
        cand = np.empty(n, np.int64)  # the candidates: gallery index << 32 | cell
        vals = np.empty(max_rel, np.float32)
        rcell = np.empty(max_rel, np.int64)
        tstart = np.empty(stride + 1, np.int64)
        # The relevant items in cell order (counting sort): score, gallery index, cell, and
        # how many candidates beat each.
        svals = np.empty(max_rel, np.float32)
        scol = np.empty(max_rel, np.int64)
        scell = np.empty(max_rel, np.int64)
        beats = np.empty(max_rel, np.int64)
        for r in range(s * b // n_seg, (s + 1) * b // n_seg):
            lo = rel_off[r]
            n_rel = rel_off[r + 1] - lo
            row = S[r]
            ahead = S[min(r + 1, b - 1)]  # the next row, fetched while this one is counted
            umin = np.float32(np.inf)
            umax = np.float32(-np.inf)
            for j in range(n_rel):
                x = row[rel_col[lo + j]]
                vals[j] = x
                umin = min(umin, x)
                umax = max(umax, x)
            n_cells = min(max(64, CELLS_PER_ITEM * n_rel), max(64, n))
            span = np.float64(umax) - np.float64(umin)
            w64 = (n_cells - 2) / span if span > 0 else 1.0
            # Cap the slope so that |umin * w| < 2**22: the float32 map then stays accurate to
            # < 1 cell (a near-zero span only puts more items in the relevant scores' cells,
            # which is slower, never wrong).
            w = np.float32(min(w64, 2.0**22 / max(abs(np.float64(umin)), 1.0)))
            bias = np.float32(1.5) - umin * w
            top = np.float32(n_cells + 1)
            # Relevant items grouped by cell (counting sort), and the cells they flag.
            for c in range(n_cells + 3):
                tstart[c] = 0
            for c in range(n_cells + 2):
                flag[c] = 0
            for j in range(n_rel):
                c = _cell(vals[j], w, bias, top)
                rcell[j] = c
                flag[c] = 1
                tstart[c + 2] += 1
            for c in range(2, n_cells + 3):
                tstart[c] += tstart[c - 1]
            for j in range(n_rel):
                c = rcell[j] + 1
                q = tstart[c]
                svals[q] = vals[j]
                scol[q] = rel_col[lo + j]
                scell[q] = rcell[j]
                tstart[c] += 1
            for c in range(n_cells + 2):
                totals[c] = 0
            n_cand = np.uint64(0)
            for b0 in range(0, n, BLOCK):
                if b0 > 0 and b0 % (FLUSH_BLOCKS * BLOCK) == 0:
                    _add_counts(hist, totals, n_cells + 2, stride)
                m = min(BLOCK, n - b0)
                for i in range(b0, b0 + m, LANES):  # one cache line each
                    _prefetch(ahead, i)
                k = 0
                for i in range(b0, b0 + m - LANES + 1, LANES):
                    k = _compress(row, i, cells, idx, k, w, bias, top)
                for i in range(b0 + m - m % LANES, b0 + m):
                    c = _cell(row[i], w, bias, top)
                    cells[k] = c
                    idx[k] = i
                    k += c >= 1
                k4 = k - k % WAYS
                for i in range(0, k4, WAYS):
                    for u in range(WAYS):  # unrolled: WAYS independent counters
                        c0 = np.uint32(cells[i + u])
                        hist[u * stride + c0] += 1
                        cand[n_cand] = (np.int64(idx[i + u]) << 32) | c0
                        n_cand += flag[c0]
                for i in range(k4, k):
                    c0 = np.uint32(cells[i])
                    hist[c0] += 1
                    cand[n_cand] = (np.int64(idx[i]) << 32) | c0
                    n_cand += flag[c0]
            _add_counts(hist, totals, n_cells + 2, stride)
            for j in range(n_rel):
                beats[j] = 0
            for p in range(n_cand):
                e = cand[p] >> 32
                x = row[e]
                c = cand[p] & 0xFFFFFFFF  # kept from the counting pass, not recomputed from x
                q0 = tstart[c]  # a flagged cell holds at least one relevant item
                v = svals[q0]
                beats[q0] += (x > v) | ((x == v) & (e < scol[q0]))
                for q in range(q0 + 1, tstart[c + 1]):  # mostly none: predictable
                    v = svals[q]
                    beats[q] += (x > v) | ((x == v) & (e < scol[q]))
            # totals[c] becomes the count of items in strictly higher cells (one branch-free
            # pass from the top, in place).
            above = 0
            for c in range(n_cells + 1, -1, -1):
                count = totals[c]
                totals[c] = above
                above += count
            # Ranks, cell by cell from the top: every relevant item in a higher cell ranks before
            # every one in a lower cell, so they come out ascending; the few in one cell are
            # sorted in place.
            o = lo
            for q in range(n_rel - 1, -1, -1):
                rank = 1 + totals[scell[q]] + beats[q]
                i = o
                while i > lo and out[i - 1] > rank:
                    out[i] = out[i - 1]
                    i -= 1
                out[i] = rank
                o += 1


def _vector_cells(context, builder, sig, args, pos, lanes):
    """IR of ``lanes`` cells of ``row[pos:pos + lanes]`` (an intrinsic's codegen args, as
    :func:`compress_cells` takes them): ``(cell, keep, item)`` vectors, each cell computed with
    :func:`cell_of`'s float32 operations (so each equals it), ``keep`` = cell >= 1."""
    from llvmlite import ir

    row_a, _, _, _, _, w_v, bias_v, top_v = args
    i32 = ir.IntType(32)
    vf = ir.VectorType(ir.FloatType(), lanes)
    vi = ir.VectorType(i32, lanes)

    def splat(x, ty):
        one = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(i32, 0))
        return builder.shuffle_vector(
            one, ir.Constant(ty, ir.Undefined), ir.Constant(vi, [0] * lanes)
        )

    data = context.make_array(sig.args[0])(context, builder, row_a).data
    src = builder.bitcast(builder.gep(data, [pos]), vf.as_pointer())
    x = builder.fadd(builder.fmul(builder.load(src, align=4), splat(w_v, vf)), splat(bias_v, vf))
    top_s = splat(top_v, vf)
    zero = ir.Constant(vf, [0.0] * lanes)
    x = builder.select(builder.fcmp_ordered("<", x, top_s), x, top_s)
    x = builder.select(builder.fcmp_ordered(">", x, zero), x, zero)
    cell = builder.fptosi(x, vi)
    keep = builder.fcmp_ordered(">=", x, ir.Constant(vf, [1.0] * lanes))
    item = builder.add(splat(builder.trunc(pos, i32), vi), ir.Constant(vi, list(range(lanes))))
    return cell, keep, item


def _vector_compress(kind: str):
    """:func:`compress_cells` in vector registers; the lanes past the new ``k`` are scratch.

    ``"avx512"``: the LANES cells in one vector, compressed in a register (``vpcompressd``)
    and stored whole (a compress straight to memory is microcoded and slow on some CPUs, AMD
    Zen 4 among them). ``"avx2"`` (no compress instruction): two halves of 8 lanes, each
    packed with ``vpermd`` by the permutation a 256-entry table gives for its lane mask, and
    stored at the ``k`` the half before left (so at most LANES - 1 slots past the new ``k``
    are written, as with AVX-512)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    part = LANES if kind == "avx512" else 8
    # The avx2 table: for each mask of 8 lanes, the kept lanes' indices first, in order.
    table = [[lane for lane in range(8) if mask >> lane & 1] for mask in range(256)]
    table = [lanes + [0] * (8 - len(lanes)) for lanes in table]

    @intrinsic
    def compress(typingctx, row, pos, cells, idx, k, w, bias, top):
        sig = types.intp(
            row, types.intp, cells, idx, types.intp, types.float32, types.float32, types.float32
        )

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            vi = ir.VectorType(i32, part)
            vm = ir.VectorType(ir.IntType(1), part)
            mask_t = ir.IntType(part)
            module = builder.module
            targets = [context.make_array(sig.args[i])(context, builder, args[i]).data
                       for i in (2, 3)]
            popcount = cgutils.get_or_insert_function(
                module, ir.FunctionType(mask_t, [mask_t]), f"llvm.ctpop.i{part}")
            if kind == "avx512":
                pack = cgutils.get_or_insert_function(
                    module, ir.FunctionType(vi, [vi, vi, vm]),
                    "llvm.x86.avx512.mask.compress.v16i32")
            else:
                pack = cgutils.get_or_insert_function(
                    module, ir.FunctionType(vi, [vi, vi]), "llvm.x86.avx2.permd")
                lut = cgutils.global_constant(builder, "imgret_compress_lut", ir.Constant(
                    ir.ArrayType(vi, 256), [ir.Constant(vi, lanes) for lanes in table]))
            k_v = args[4]
            for half in range(0, LANES, part):
                pos = builder.add(args[1], ir.Constant(args[1].type, half))
                cell, keep, item = _vector_cells(context, builder, sig, args, pos, part)
                mask = builder.bitcast(keep, mask_t)
                if kind == "avx2":
                    perm = builder.load(builder.gep(
                        lut, [ir.Constant(i32, 0), builder.zext(mask, ir.IntType(64))]),
                        align=4)
                for value, dst in zip((cell, item), targets, strict=True):
                    packed = (builder.call(pack, [value, ir.Constant(vi, ir.Undefined), keep])
                              if kind == "avx512" else builder.call(pack, [value, perm]))
                    builder.store(
                        packed, builder.bitcast(builder.gep(dst, [k_v]), vi.as_pointer()),
                        align=4)
                kept = builder.call(popcount, [mask])
                k_v = builder.add(k_v, builder.zext(kept, k_v.type))
            return k_v

        return sig, codegen

    return compress


@functools.cache
def compiled_kernel():
    """:func:`rank_kernel` compiled by numba, parallel over row segments, with
    :func:`compress_cells` as vector code where the CPU has AVX-512 or else AVX2 (the
    portable path is slower: docs/metrics_bench.md); compiled on first use and cached on disk
    when the package directory is writable."""
    from llvmlite import binding

    features = binding.get_host_cpu_features().flatten().split(",")
    compress = ("avx512" if "+avx512f" in features
                else "avx2" if "+avx2" in features else "portable")
    return compile_loop(rank_kernel, kernel_names(compress), parallel=True)


def kernel_names(compress: str) -> dict:
    """The compiled functions :func:`rank_kernel` calls (every name it swaps, ``_prange``
    aside), with :func:`compress_cells` as ``compress``: ``"avx512"`` or ``"avx2"`` vector
    code (:func:`_vector_compress`), or ``"portable"``, the function itself compiled. The
    tests compile each variant from these too."""
    import numba

    inline = numba.njit(inline="always")
    names = {"_cell": inline(cell_of), "_add_counts": inline(add_counts),
             "_prefetch": _prefetch_l2()}
    names["_compress"] = (inline(with_globals(compress_cells, names)) if compress == "portable"
                          else _vector_compress(compress))
    return names


def _prefetch_l2():
    """:func:`prefetch` as ``llvm.prefetch`` (read, keep in L2)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def prefetch_l2(typingctx, row, pos):
        sig = types.none(row, types.intp)

        def codegen(context, builder, sig, args):
            row_a, pos_v = args
            data = context.make_array(sig.args[0])(context, builder, row_a).data
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                "llvm.prefetch.p0i8",
            )
            addr = builder.bitcast(builder.gep(data, [pos_v]), i8p)
            builder.call(fn, [addr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return sig, codegen

    return prefetch_l2
