"""imgret.metrics.definitions: per-query values by hand, and the report's interval (ci95)."""

from __future__ import annotations

import math

import numpy as np

from imgret.metrics import retrieval_metrics
from imgret.metrics.definitions import (
    K_METRICS,
    SCALAR_METRICS,
    build_report,
    per_query_values,
    value_names,
)
from imgret.stats import bootstrap_ci
from tests.unit.metrics.cases import clustered


def test_bootstrap_is_deterministic_and_contains_the_estimate():
    x, y = clustered(300, classes=6, noise=2.0, seed=7)
    a = retrieval_metrics(x, y, x, y, query_in_gallery=True, bootstrap=500, seed=1)
    b = retrieval_metrics(x, y, x, y, query_in_gallery=True, bootstrap=500, seed=1)
    c = retrieval_metrics(x, y, x, y, query_in_gallery=True, bootstrap=500, seed=2)
    assert a["ci95"] == b["ci95"]
    assert a["ci95"] != c["ci95"]
    for name in SCALAR_METRICS:
        low, high = a["ci95"][name]
        assert low <= a[name] <= high, name
        assert low < high or a[name] in (0.0, 1.0)
    for name in K_METRICS:
        for k, (low, high) in a["ci95"][name].items():
            assert low <= a[name][k] <= high, (name, k)


def test_per_query_values_by_hand():
    # Query 0: ranks 1, 3 of R = 2; query 1: ranks 2, 5 of R = 3; query 2: rank 1 of R = 1.
    ranks, offsets, R = np.array([1, 3, 2, 5, 1]), np.array([0, 2, 4, 5]), np.array([2, 3, 1])
    values, first = per_query_values(ranks, offsets, R, [1, 3])
    column = dict(zip(value_names([1, 3]), values.T, strict=True))
    np.testing.assert_allclose(column["map_at_r"], [1 / 2, (1 / 2) / 3, 1])
    np.testing.assert_allclose(column["r_precision"], [1 / 2, 1 / 3, 1])
    np.testing.assert_allclose(column["mean_average_precision"],
                               [(1 + 2 / 3) / 2, (1 / 2 + 2 / 5) / 3, 1])
    np.testing.assert_allclose(column["mrr"], [1, 1 / 2, 1])
    np.testing.assert_allclose(column["recall_at_k/1"], [1, 0, 1])
    np.testing.assert_allclose(column["map_at_k/3"], [(1 + 2 / 3) / 2, 1 / 2, 1])
    np.testing.assert_allclose(column["recall_fraction_at_k/3"], [1, 1 / 3, 1])
    np.testing.assert_allclose(column["ndcg_at_k/3"], [
        (1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3)),
        (1 / math.log2(3)) / (1 + 1 / math.log2(3) + 1 / math.log2(4)),
        1,
    ])
    np.testing.assert_array_equal(first, [1, 2, 1])


def test_ci95_is_the_percentile_bootstrap_of_the_per_query_values():
    ranks, offsets = np.array([1, 3, 2, 5, 1, 4]), np.array([0, 2, 4, 5, 6])
    R = np.array([2, 3, 1, 1])  # a fifth query had R = 0: skipped
    values, first = per_query_values(ranks, offsets, R, [1, 3])
    rep = build_report(values, first, R, np.arange(4), num_queries=5, ks=[1, 3],
                       bootstrap=300, seed=4, per_query=True)
    low, high = bootstrap_ci(values, 300, 4)
    names = value_names([1, 3])
    assert rep["ci95"]["map_at_r"] == [low[0], high[0]]
    i = names.index("ndcg_at_k/3")
    assert rep["ci95"]["ndcg_at_k"][3] == [low[i], high[i]]
    assert rep["num_skipped"] == 1
    assert rep["per_query"]["first_relevant_rank"] == [1, 2, 1, 4]
