"""imgret.metrics.ranks: the rank engine against a full stable sort of every score row."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from imgret.metrics.jit import with_globals
from imgret.metrics.ranks import (
    BLOCK,
    LANES,
    compiled_kernel,
    exact_ranks,
    kernel_names,
    rank_kernel,
)
from imgret.metrics.relevance import RelevancePlan
from tests.unit.metrics.cases import clustered, integer_embeddings


def sorted_ranks(S, rel_row, rel_col):
    """Reference: 1-based rank of each relevant (row, col) in a stable descending sort of its
    row (ties: lower gallery index first; removed items are -inf and sort last)."""
    out = np.empty(len(rel_col), np.int64)
    for r in np.unique(rel_row):
        position = np.empty(S.shape[1], np.int64)
        position[np.argsort(-S[r], kind="stable")] = np.arange(1, S.shape[1] + 1)
        sel = rel_row == r
        out[sel] = position[rel_col[sel]]
    return out


def engine_ranks(x, plan, evaluated, chunk_size):
    """exact_ranks's output, per evaluated query, as lists."""
    got = {}

    def consume(lo, hi, ranks, offsets):
        for i in range(hi - lo):
            got[lo + i] = ranks[offsets[i] : offsets[i + 1]].tolist()

    xt = torch.from_numpy(x)
    exact_ranks(xt, xt, plan, evaluated, chunk_size, consume)
    return [got[i] for i in range(len(evaluated))]


def block(x, plan, evaluated):
    """A block of score rows with the removed items at -inf, and its relevant pairs."""
    S = (x[evaluated] @ x.T).astype(np.float32)
    rel_row, rel_col, rm_row, rm_col = plan.pairs(evaluated)
    S.reshape(-1)[rm_row * S.shape[1] + rm_col] = -np.inf
    offsets = np.concatenate([[0], np.cumsum(np.bincount(rel_row, minlength=len(evaluated)))])
    return S, offsets, rel_row, rel_col


def ascending_per_row(ranks, offsets):
    """The kernel's layout: each row's ranks in ascending order."""
    bounds = zip(offsets[:-1], offsets[1:], strict=True)
    return np.concatenate([np.sort(ranks[a:b]) for a, b in bounds])


def kernel_output(kernel, S, offsets, rel_col):
    out = np.empty(len(rel_col), np.int64)
    kernel(S.copy(), offsets, rel_col, out)
    return out


@pytest.mark.parametrize("chunk_size", [1, 64, 1000])
@pytest.mark.parametrize(("loo", "cameras"), [(True, False), (False, True), (False, False)])
def test_exact_ranks_match_a_full_sort(loo, cameras, chunk_size):
    # Small-integer embeddings: every score is exact in float32 and ties abound.
    x, y = integer_embeddings(300, seed=9)
    cam = np.random.default_rng(1).integers(0, 2, 300) if cameras else None
    plan = RelevancePlan(y, y, cam, cam, 300, 300, loo)
    evaluated = np.flatnonzero(plan.num_relevant > 0)
    S, offsets, rel_row, rel_col = block(x, plan, evaluated)
    ref = sorted_ranks(S, rel_row, rel_col)
    expected = [sorted(ref[offsets[i] : offsets[i + 1]].tolist()) for i in range(len(evaluated))]
    assert engine_ranks(x, plan, evaluated, chunk_size) == expected
    assert sum(map(len, expected)) == plan.num_relevant[evaluated].sum()


def test_record_gets_each_chunks_product_and_rank_seconds():
    x, y = integer_embeddings(300, seed=9)
    plan = RelevancePlan(y, y, None, None, 300, 300, True)
    evaluated = np.flatnonzero(plan.num_relevant > 0)
    calls = []
    xt = torch.from_numpy(x)
    exact_ranks(xt, xt, plan, evaluated, 128, lambda *_: None,
                lambda part, seconds: calls.append((part, seconds)))
    chunks = -(-len(evaluated) // 128)
    assert [part for part, _ in calls] == ["product", "ranks"] * chunks
    assert all(seconds > 0 for _, seconds in calls)


@pytest.mark.parametrize("noise", [0.5, 2.5])  # sparse and dense sets of close competitors
@pytest.mark.parametrize("rows", [1, 240])  # one score row, many rows in parallel
def test_compiled_kernel_matches_a_full_sort(noise, rows):
    x, y = clustered(240, d=8, classes=6, noise=noise, seed=12)
    plan = RelevancePlan(y, y, None, None, 240, 240, True)
    evaluated = np.flatnonzero(plan.num_relevant > 0)[:rows]
    S, offsets, rel_row, rel_col = block(x, plan, evaluated)
    got = kernel_output(compiled_kernel(), S, offsets, rel_col)
    want = ascending_per_row(sorted_ranks(S, rel_row, rel_col), offsets)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("loo", [True, False])
def test_plain_python_kernel_matches_a_full_sort(loo):
    # The kernel's algorithm as plain Python (uncompiled), on a tiny problem.
    x, y = integer_embeddings(40, d=4, classes=3, seed=13)
    plan = RelevancePlan(y, y, None, None, 40, 40, loo)
    evaluated = np.flatnonzero(plan.num_relevant > 0)[:12]
    S, offsets, rel_row, rel_col = block(x, plan, evaluated)
    got = kernel_output(rank_kernel, S, offsets, rel_col)
    want = ascending_per_row(sorted_ranks(S, rel_row, rel_col), offsets)
    np.testing.assert_array_equal(got, want)


def test_compiled_kernel_matches_plain_python_kernel_on_ties():
    x, y = integer_embeddings(120, seed=15)  # many exact ties
    cam = np.random.default_rng(3).integers(0, 3, 120)
    plan = RelevancePlan(y, y, cam, cam, 120, 120, False)
    evaluated = np.flatnonzero(plan.num_relevant > 0)[:30]
    S, offsets, _, rel_col = block(x, plan, evaluated)
    np.testing.assert_array_equal(
        kernel_output(compiled_kernel(), S, offsets, rel_col),
        kernel_output(rank_kernel, S, offsets, rel_col),
    )


@functools.cache  # numba compiles a parallel kernel in ~10 s: once per test run
def scalar_compiled_kernel():
    """The kernel compiled with the portable compress (what a CPU without AVX-512 runs)."""
    return _compile_uncached("portable")


@functools.cache
def avx2_compiled_kernel():
    """The kernel compiled with the AVX2 compress (what a CPU with AVX2 but no AVX-512 runs),
    or ``None`` on a CPU without AVX2."""
    from llvmlite import binding

    if "+avx2" not in binding.get_host_cpu_features().flatten().split(","):
        return None
    return _compile_uncached("avx2")


def _compile_uncached(compress: str):
    # Not compile_loop: its on-disk cache is keyed by the function, not by the names swapped
    # in, so two variants of rank_kernel must not share it.
    import numba

    names = {"_prange": numba.prange, **kernel_names(compress)}
    return numba.njit(parallel=True, boundscheck=False)(with_globals(rank_kernel, names))


@pytest.mark.parametrize("n", [2 * BLOCK + LANES + 3, 3 * BLOCK])  # several blocks, a tail
@pytest.mark.parametrize("ties", [False, True])
def test_long_rows_many_relevant_both_compress_paths(n, ties):
    # Rows longer than a block, item counts that are no multiple of LANES, R in the hundreds
    # (more cells than the 64 minimum), and with ties: integer scores.
    rng = np.random.default_rng(n + ties)
    if ties:
        x, _ = integer_embeddings(n, d=6, seed=21)
    else:
        x, _ = clustered(n, d=8, classes=3, noise=1.0, seed=21)
    y = rng.integers(0, 3, n)
    plan = RelevancePlan(y, y, None, None, n, n, True)
    evaluated = np.flatnonzero(plan.num_relevant > 0)[:40]
    S, offsets, rel_row, rel_col = block(x, plan, evaluated)
    want = ascending_per_row(sorted_ranks(S, rel_row, rel_col), offsets)
    # The host's compiled kernel (AVX-512, AVX2 or portable), the portable one, and the AVX2
    # one wherever the CPU can run it (x86-64 since 2013), so an AVX-512 host tests it too.
    kernels = [compiled_kernel(), scalar_compiled_kernel(), avx2_compiled_kernel()]
    for kernel in filter(None, kernels):
        np.testing.assert_array_equal(kernel_output(kernel, S, offsets, rel_col), want)


def test_cell_counts_past_the_uint16_range():
    # The histograms count in uint16 and are added into int64 totals before any count can
    # pass 65,535: here ~140,000 items share one cell above a relevant item's, so a count that
    # wrapped would rank that item 65,536 or more places too high.
    n = 140_000  # more than WAYS x 65,535 items in one cell
    S = np.full((2, n), 0.5, np.float32)
    S[0, 3], S[1, 9], S[1, 60_000] = 0.0, 0.25, 0.75
    rel_row = np.array([0, 0, 1, 1, 1])
    rel_col = np.array([3, 5, 9, 10, 60_000])
    offsets = np.array([0, 2, 5])
    want = ascending_per_row(sorted_ranks(S, rel_row, rel_col), offsets)
    assert want.tolist() == [5, n, 1, 11, n]  # ties: the lower gallery index first
    kernels = [compiled_kernel(), scalar_compiled_kernel(), avx2_compiled_kernel()]
    for kernel in filter(None, kernels):
        np.testing.assert_array_equal(kernel_output(kernel, S, offsets, rel_col), want)
