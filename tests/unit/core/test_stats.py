"""imgret.stats: the t-interval against scipy, the bootstraps against plain resampling loops."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as scipy_stats

from imgret.stats import bootstrap_ci, mean_ci, paired_bootstrap_ci


def test_mean_ci_is_scipys_t_interval():
    values = [0.61, 0.64, 0.58, 0.66, 0.63]
    mean, (low, high) = mean_ci(values, confidence=0.9)
    ref = scipy_stats.t.interval(0.9, len(values) - 1, loc=np.mean(values),
                                 scale=scipy_stats.sem(values))
    assert mean == pytest.approx(np.mean(values))
    assert (low, high) == pytest.approx(ref)


@pytest.mark.parametrize("n", [40, 5000])  # one batch of resamples; several batches
def test_bootstrap_ci_is_deterministic_and_brackets_the_means(n):
    values = np.random.default_rng(0).random((n, 3))
    low, high = bootstrap_ci(values, 400, seed=7)
    again = bootstrap_ci(values, 400, seed=7)
    other = bootstrap_ci(values, 400, seed=8)
    np.testing.assert_array_equal(low, again[0])
    np.testing.assert_array_equal(high, again[1])
    assert not np.array_equal(low, other[0])
    assert np.all(low < values.mean(axis=0)) and np.all(values.mean(axis=0) < high)


def test_bootstrap_ci_equals_a_plain_resampling_loop():
    # With one batch the draws are those of one rng.integers call of all resamples.
    values = np.random.default_rng(1).random((50, 2))
    draws = np.random.default_rng(3).integers(0, 50, size=(300, 50))
    means = np.stack([values[d].mean(axis=0) for d in draws])
    low, high = bootstrap_ci(values, 300, seed=3)
    np.testing.assert_allclose(low, np.percentile(means, 2.5, axis=0), rtol=1e-12)
    np.testing.assert_allclose(high, np.percentile(means, 97.5, axis=0), rtol=1e-12)


def test_paired_bootstrap_ci_equals_a_plain_resampling_loop():
    rng = np.random.default_rng(2)
    a, b = rng.random((60, 2)), rng.random((60, 2))
    draws = np.random.default_rng(5).integers(0, 60, size=(200, 60))
    low, high = paired_bootstrap_ci(a, b, 200, seed=5)
    for j in range(2):
        means = [(b[d, j] - a[d, j]).mean() for d in draws]
        assert [low[j], high[j]] == pytest.approx(np.percentile(means, [2.5, 97.5]), rel=1e-12)


def test_paired_bootstrap_ci_of_a_constant_shift_is_that_shift():
    a = np.random.default_rng(4).random((30, 1))
    low, high = paired_bootstrap_ci(a, a + 0.25, 100, seed=0)
    assert (low[0], high[0]) == pytest.approx((0.25, 0.25))
    low, high = paired_bootstrap_ci(a, a, 100, seed=0)
    assert (low[0], high[0]) == (0.0, 0.0)


def test_pairing_removes_the_between_query_spread():
    # B is A plus a small improvement: paired, the interval is about the improvement's spread;
    # unpaired intervals of each side would be as wide as the spread between queries.
    rng = np.random.default_rng(6)
    a = rng.random((200, 1))
    b = a + 0.02 + 0.01 * rng.standard_normal((200, 1))
    low, high = paired_bootstrap_ci(a, b, 1000, seed=1)
    a_low, a_high = bootstrap_ci(a, 1000, seed=1)
    assert 0 < low[0] < 0.02 < high[0]
    assert high[0] - low[0] < (a_high[0] - a_low[0]) / 5
