"""Intervals: the one place that turns per-seed or per-query numbers into a 95% interval.

``mean_ci`` is the t-interval over seeds that the benchmark runner and its plots report
(Reality Check: mean ± 95% CI over several seeds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats


def mean_ci(values: Sequence[float] | np.ndarray,
            confidence: float = 0.95) -> tuple[float, list[float]]:
    """Mean and Student-t interval: ``mean ± t_{(1+c)/2, n-1} · s / sqrt(n)``.

    With one value the interval is that value (no spread can be estimated).
    """
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, [mean, mean]
    t = float(stats.t.ppf((1 + confidence) / 2, df=len(x) - 1))
    half = t * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, [mean - half, mean + half]
