"""Intervals: the one place that turns per-seed or per-query numbers into a 95% interval.

* :func:`mean_ci`: Student-t interval of a mean over seeds (scipy's t quantile). The benchmark
  runner and its plots report it (Reality Check: mean ± 95% CI over several seeds).
* :func:`paired_mean_ci`: Student-t interval of the mean paired difference ``a_k - b_k`` (seed
  ``k`` of one method against seed ``k`` of another); the benchmark's pairwise verdicts
  (``imgret.training.analysis``) use it.
* :func:`bootstrap_ci`: percentile bootstrap interval of the column means of per-query values.
  Every metric report (``imgret.metrics``, hence training and ``/evaluate``) carries it as
  ``ci95``.
* :func:`paired_bootstrap_ci`: percentile bootstrap interval of the mean difference between two
  sets of per-query values on the same queries; the model comparison of ``/evaluate``
  (``imgret.index.evaluation.compare_versions``) reports it.

The bootstraps draw with NumPy's PCG64 from ``seed``: the same input and seed give the same
interval, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# Percentiles of the resampled means that bound a 95% percentile interval.
_TAILS_95 = [2.5, 97.5]


def mean_ci(values: Sequence[float] | np.ndarray,
            confidence: float = 0.95) -> tuple[float, list[float]]:
    """Mean and Student-t interval: ``mean ± t_{(1+c)/2, n-1} · s / sqrt(n)``.

    With one value the interval is that value (no spread can be estimated).
    """
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, [mean, mean]
    # Imported here: scipy.stats costs ~0.5 s of start-up to every server and CLI process,
    # and only seed-level summaries (training reports, benchmarks) need the t quantile.
    from scipy import stats

    t = float(stats.t.ppf((1 + confidence) / 2, df=len(x) - 1))
    half = t * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, [mean - half, mean + half]


def paired_mean_ci(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray,
                   confidence: float = 0.95) -> tuple[float, list[float]]:
    """Mean of the paired differences ``a - b`` and its Student-t interval (:func:`mean_ci`).

    Pairing (the same seed on both sides) removes the variance the two share, so the interval
    is narrower than the overlap of two unpaired ones when the seeds move both alike.

    Raises:
        ValueError: ``a`` and ``b`` differ in length.
    """
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"paired values must match: {x.shape} vs {y.shape}")
    return mean_ci(x - y, confidence)


def bootstrap_ci(values: np.ndarray, resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Percentile 95% interval of each column's mean, resampling rows with replacement.

    Args:
        values: ``(n, m)`` floats: one row per query, one column per metric.
        resamples: number of bootstrap resamples (>= 1).
        seed: seed of the generator.

    Returns:
        ``(low, high)``, each ``(m,)``: the 2.5th and 97.5th percentiles of the resampled means.

    Each resample is summarised by how often it draws every row (a bincount), so a batch of
    resamples is one small matrix product with the values; batches stay ~8 MB.
    """
    n = len(values)
    rng = np.random.default_rng(seed)
    means = np.empty((resamples, values.shape[1]))
    batch = max(1, min(resamples, (1 << 20) // n))
    weights = np.empty((batch, n))
    for s in range(0, resamples, batch):
        nb = min(batch, resamples - s)
        draws = rng.integers(0, n, size=(nb, n))
        for j in range(nb):
            weights[j] = np.bincount(draws[j], minlength=n)
        means[s : s + nb] = (weights[:nb] @ values) / n
    low, high = np.percentile(means, _TAILS_95, axis=0)
    return low, high


def paired_bootstrap_ci(a: np.ndarray, b: np.ndarray, resamples: int,
                        seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Percentile 95% interval of each column's mean difference ``b - a`` over paired rows.

    Row ``i`` of ``a`` and of ``b`` belong to the same query; one set of resampled rows serves
    both sides (and every column), which removes the between-query variance that two
    unpaired intervals would carry.

    Args:
        a, b: ``(n, m)`` floats, paired by row: one column per metric.
        resamples: number of bootstrap resamples (>= 1).
        seed: seed of the generator.

    Returns:
        ``(low, high)``, each ``(m,)``.
    """
    diff = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    n = len(diff)
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    low, high = np.empty(diff.shape[1]), np.empty(diff.shape[1])
    for j in range(diff.shape[1]):
        low[j], high[j] = np.percentile(diff[:, j][draws].mean(axis=1), _TAILS_95)
    return low, high
