"""The metric definitions: from the ranks of each query's relevant items to the report.

Pure NumPy over a CSR layout (each query's relevant ranks, ascending, delimited by
``offsets``), shared by both entry points of :mod:`imgret.metrics`. The formulas are stated in
:func:`imgret.metrics.ranking_metrics`'s docstring; ``ci95`` is
:func:`imgret.stats.bootstrap_ci` over the per-query values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
    ``R`` (> 0) the number of relevant items. Returns ``(values (n, m) float64, first (n,))``
    with ``first`` = inf where no relevant item is ranked.
    """
    n = len(R)
    counts = np.diff(offsets)
    qid = np.repeat(np.arange(n), counts)
    # Position of each relevant item among the query's relevant items: P(rank) = pos / rank.
    pos = np.arange(1, len(ranks) + 1) - np.repeat(offsets[:-1], counts)
    prec = pos / ranks
    Rf = R.astype(np.float64)
    first = np.full(n, np.inf)
    has = counts > 0
    first[has] = ranks[offsets[:-1][has]]
    out = np.empty((n, len(SCALAR_METRICS) + len(K_METRICS) * len(ks)))
    # Only ranks <= R matter for MAP@R and R-precision, only ranks <= max(k) for @k metrics:
    # filter once, so that the many per-k sums run on short arrays.
    in_r = ranks <= R[qid]
    q_r, p_r = qid[in_r], prec[in_r]
    out[:, 0] = np.bincount(q_r, p_r, minlength=n) / Rf  # map_at_r
    out[:, 1] = np.bincount(q_r, minlength=n) / Rf  # r_precision
    out[:, 2] = first == 1  # precision_at_1
    out[:, 3] = np.bincount(qid, prec, minlength=n) / Rf  # mean_average_precision
    out[:, 4] = np.where(has, 1.0 / first, 0.0)  # mrr
    top = ranks <= max(ks)
    q_k, r_k, p_k = qid[top], ranks[top], prec[top]
    gain = 1.0 / np.log2(r_k + 1.0)
    ideal = np.concatenate([[0.0], np.cumsum(1.0 / np.log2(np.arange(2, max(ks) + 2)))])
    col = len(SCALAR_METRICS)
    for kk in ks:  # columns in K_METRICS order
        in_k = r_k <= kk
        hits = np.bincount(q_k[in_k], minlength=n)
        out[:, col] = first <= kk  # recall_at_k
        ap_k = np.bincount(q_k[in_k], p_k[in_k], minlength=n)
        out[:, col + 1] = np.divide(ap_k, hits, out=np.zeros(n), where=hits > 0)  # map_at_k
        dcg = np.bincount(q_k[in_k], gain[in_k], minlength=n)
        out[:, col + 2] = dcg / ideal[np.minimum(R, kk)]  # ndcg_at_k
        out[:, col + 3] = hits / Rf  # recall_fraction_at_k
        col += len(K_METRICS)
    return out, first


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
