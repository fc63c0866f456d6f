"""The metric definitions: from the ranks of each query's relevant items to the report.

NumPy and one numba loop over a CSR layout (each query's relevant ranks, ascending, delimited by
``offsets``), shared by both entry points of :mod:`imgret.metrics`. The formulas are stated in
:func:`imgret.metrics.ranking_metrics`'s docstring; ``ci95`` is
:func:`imgret.stats.bootstrap_ci` over the per-query values.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from imgret.metrics.jit import compile_loop
from imgret.stats import bootstrap_ci

SCALAR_METRICS = ("map_at_r", "r_precision", "precision_at_1", "mean_average_precision", "mrr")
K_METRICS = ("recall_at_k", "map_at_k", "ndcg_at_k", "recall_fraction_at_k")


def value_names(ks: list[int]) -> list[str]:
    """Column names of :func:`per_query_values`, in order."""
    names = list(SCALAR_METRICS)
    for kk in ks:
        names += [f"{m}/{kk}" for m in K_METRICS]
    return names


def per_query_values(ranks, offsets, R, ks):
    """Per-query metric values, columns as :func:`value_names`, and first relevant ranks.

    ``ranks`` holds each query's relevant ranks in ascending order, CSR by ``offsets``;
    ``R`` (> 0) the number of relevant items; ``ks`` the sorted cut-offs. Returns
    ``(values (n, m) float64, first (n,))`` with ``first`` = inf where no relevant item is
    ranked. One pass over each query's ranks (:func:`fill_values`, compiled by numba).
    """
    n = len(R)
    ks = np.asarray(ks, np.int64)
    # ideal[m]: DCG of m relevant items at the top.
    ideal = np.concatenate([[0.0], np.cumsum(1.0 / np.log2(np.arange(2, ks.max() + 2)))])
    out = np.empty((n, len(SCALAR_METRICS) + len(K_METRICS) * len(ks)))
    first = np.empty(n)
    compiled_values()(
        np.ascontiguousarray(ranks, np.int64),
        np.ascontiguousarray(offsets, np.int64),
        np.ascontiguousarray(R, np.int64),
        ks,
        ideal,
        out,
        first,
    )
    return out, first


def fill_values(ranks, offsets, R, ks, ideal, out, first):
    """:func:`per_query_values`'s loop: row ``i`` of ``out`` and ``first[i]`` for query ``i``.

    Sums run in rank order (P(i) = position / rank), so each value is the same float64 sum
    however it is computed. Plain Python; :func:`compiled_values` compiles it.
    """
    n_k = len(K_METRICS)
    for i in _prange(len(R)):
        a = offsets[i]
        b = offsets[i + 1]
        r_q = R[i]
        rf = np.float64(r_q)
        s_r = 0.0
        c_r = 0
        s_all = 0.0
        for p in range(a, b):
            prec = (p - a + 1) / ranks[p]
            s_all += prec
            if ranks[p] <= r_q:
                s_r += prec
                c_r += 1
        f = np.float64(ranks[a]) if b > a else np.inf
        first[i] = f
        out[i, 0] = s_r / rf  # map_at_r
        out[i, 1] = c_r / rf  # r_precision
        out[i, 2] = f == 1.0  # precision_at_1
        out[i, 3] = s_all / rf  # mean_average_precision
        out[i, 4] = 1.0 / f if b > a else 0.0  # mrr
        for j in range(len(ks)):  # columns in K_METRICS order
            kk = ks[j]
            hits = 0
            ap = 0.0
            dcg = 0.0
            p = a
            while p < b and ranks[p] <= kk:
                ap += (p - a + 1) / ranks[p]
                dcg += 1.0 / np.log2(ranks[p] + 1.0)
                hits += 1
                p += 1
            col = len(SCALAR_METRICS) + n_k * j
            out[i, col] = f <= kk  # recall_at_k
            out[i, col + 1] = ap / hits if hits > 0 else 0.0  # map_at_k
            out[i, col + 2] = dcg / ideal[min(r_q, kk)]  # ndcg_at_k
            out[i, col + 3] = hits / rf  # recall_fraction_at_k


_prange = range


@functools.cache
def compiled_values():
    """:func:`fill_values` compiled by numba, parallel over queries."""
    return compile_loop(fill_values, parallel=True)


def build_report(
    values,
    first,
    R,
    query_index,
    *,
    num_queries,
    ks,
    bootstrap,
    seed,
    per_query,
    num_truncated=0,
) -> dict[str, Any]:
    """Assemble the JSON-friendly report from per-query values (see ``ranking_metrics``).

    ``values`` are :func:`per_query_values`'s for the cut-offs ``ks``; ``R`` and
    ``query_index`` describe the evaluated queries (one row each) of ``num_queries`` given.
    """
    names = value_names(ks)
    means = values.mean(axis=0)
    out: dict[str, Any] = {}
    for m in SCALAR_METRICS:
        out[m] = float(means[names.index(m)])
    for m in K_METRICS:
        out[m] = {kk: float(means[names.index(f"{m}/{kk}")]) for kk in ks}
    out["num_queries"] = int(num_queries)
    out["num_skipped"] = int(num_queries - len(R))
    out["num_truncated"] = int(num_truncated)
    out["k"] = list(ks)
    if bootstrap:
        lo, hi = bootstrap_ci(values, int(bootstrap), int(seed))
        ci: dict[str, Any] = {}
        for m in SCALAR_METRICS:
            i = names.index(m)
            ci[m] = [float(lo[i]), float(hi[i])]
        for m in K_METRICS:
            ci[m] = {}
            for kk in ks:
                i = names.index(f"{m}/{kk}")
                ci[m][kk] = [float(lo[i]), float(hi[i])]
        out["ci95"] = ci
    else:
        out["ci95"] = None
    if per_query:
        out["per_query"] = {
            "query_index": [int(i) for i in query_index],
            "num_relevant": [int(r) for r in R],
            "average_precision": values[:, names.index("mean_average_precision")].tolist(),
            "map_at_r": values[:, names.index("map_at_r")].tolist(),
            "first_relevant_rank": [int(f) if np.isfinite(f) else None for f in first],
        }
    return out


def per_query_table(per_query: dict[str, list]) -> dict[int, dict[str, float]]:
    """A report's ``per_query`` block as ``{query index: {metric: value}}`` for the metrics
    that have a per-query value: AP@R, AP, P@1 and reciprocal rank (R-Precision has none
    here). Two reports on the same queries are paired on these keys."""
    table = {}
    for i, query in enumerate(per_query["query_index"]):
        first = per_query["first_relevant_rank"][i]
        table[query] = {
            "map_at_r": per_query["map_at_r"][i],
            "mean_average_precision": per_query["average_precision"][i],
            "precision_at_1": float(first == 1),
            "mrr": 1.0 / first if first else 0.0,
        }
    return table
