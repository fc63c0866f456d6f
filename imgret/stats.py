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
  (``imgret.gallery.evaluation.comparison.compare_versions``) reports it.
* :func:`paired_comparison` and :func:`verdict`: B − A per metric on the same queries, its
  paired interval and the verdict read from it (better / worse / no detectable difference).
  The model comparison of ``/evaluate`` and a training run's verdict against its baselines
  (``imgret.training.scoring.baseline_verdicts``) both use them, so the two read a difference
  the same way.

The bootstraps draw with NumPy's PCG64 from ``seed``: the same input and seed give the same
interval, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# Percentiles of the resampled means that bound a 95% percentile interval.
_TAILS_95 = [2.5, 97.5]

# Smallest |B − A| (metrics on [0, 1]) a verdict calls better or worse: 0.1 points, below the
# 4 decimals reports show and far below what a retraining is run for.
MIN_EFFECT = 1e-3
BETTER = "better"
WORSE = "worse"
NO_DIFFERENCE = "no detectable difference"
VERDICTS = (BETTER, WORSE, NO_DIFFERENCE)


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


def verdict(low: float, high: float, difference: float, *,
            min_effect: float = MIN_EFFECT) -> str:
    """B relative to A from the 95% interval ``[low, high]`` of B − A and the observed mean
    ``difference``: :data:`BETTER` when the interval lies above 0 and the difference is at
    least ``min_effect``, :data:`WORSE` when it lies below 0 and the difference is at most
    ``-min_effect``, otherwise :data:`NO_DIFFERENCE`."""
    if low > 0 and difference >= min_effect:
        return BETTER
    if high < 0 and difference <= -min_effect:
        return WORSE
    return NO_DIFFERENCE


def paired_comparison(a: np.ndarray, b: np.ndarray, resamples: int, seed: int, *,
                      min_effect: float = MIN_EFFECT) -> list[dict[str, float | list | str]]:
    """B − A per column on paired rows: the means, the mean difference, its
    :func:`paired_bootstrap_ci` and its :func:`verdict`.

    Args:
        a, b: ``(n, m)`` floats, paired by row (the same query), one column per metric.
        resamples, seed: of the bootstrap.
        min_effect: the smallest ``|b - a|`` called better or worse.

    Returns:
        One dict per column: ``{"a", "b", "difference", "ci95": [low, high], "num_paired",
        "min_effect", "verdict"}``.

    Raises:
        ValueError: ``a`` and ``b`` differ in shape, or hold no row.
    """
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 2 or len(x) == 0:
        raise ValueError(f"paired values must be two (n, m) arrays, n >= 1: {x.shape} vs "
                         f"{y.shape}")
    low, high = paired_bootstrap_ci(x, y, resamples, seed)
    out = []
    for j in range(x.shape[1]):
        difference = float((y[:, j] - x[:, j]).mean())
        out.append({
            "a": float(x[:, j].mean()), "b": float(y[:, j].mean()), "difference": difference,
            "ci95": [float(low[j]), float(high[j])], "num_paired": len(x),
            "min_effect": min_effect,
            "verdict": verdict(float(low[j]), float(high[j]), difference, min_effect=min_effect),
        })
    return out
