"""Comparing two model versions on one query set, and the activation gate built on it.

Comparing two versions (:func:`compare_versions`): per metric, B − A on the queries both
evaluated, with a paired bootstrap 95% interval and a :func:`verdict` (B relative to A):
"better" when the interval lies above 0 and B − A is at least :data:`MIN_EFFECT`, "worse"
when it lies below 0 and A − B is at least that, otherwise "no detectable difference" (an
interval touching 0, including [0, 0] for identical per-query values, or a difference too
small to matter). The minimum effect is there because the interval alone calls sub-1e-4
differences real: the same model saved again with float-level changes reorders a few
near-tied tail neighbours of a few queries, every one of them the same way, and a paired
bootstrap of those tiny, same-signed changes gives an interval like [-0.0001, -0.0000]
that excludes 0. Nobody should roll back (or be refused a switch) over that.
:func:`gate` turns a comparison into the activation decision of ``require=better`` /
``require=not_worse``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from imgret.gallery.evaluation.retrieval import BOOTSTRAP, SEED, Evaluation, EvaluationError
from imgret.metrics import per_query_table

# The verdict rule and its words live with the intervals (imgret.stats); they are named here
# too because the service and the version lifecycle read them from this module.
from imgret.stats import (  # noqa: F401
    BETTER,
    MIN_EFFECT,
    NO_DIFFERENCE,
    VERDICTS,
    WORSE,
    paired_comparison,
    verdict,
)

# Paired in comparisons. ``ranking_metrics``'s per-query values hold AP@R, AP and the first
# relevant rank (hence P@1 and MRR), not R-Precision, so R-Precision is not paired.
_PAIRED_METRICS = ("map_at_r", "mean_average_precision", "precision_at_1", "mrr")


REQUIREMENTS = ("better", "not_worse")


def compare_versions(
    a: Evaluation, b: Evaluation, *, bootstrap: int = BOOTSTRAP, seed: int = SEED,
    min_effect: float = MIN_EFFECT,
) -> dict[str, Any]:
    """B − A on the same queries, with a paired bootstrap 95% interval per metric
    (:func:`imgret.stats.paired_bootstrap_ci`) and its :func:`verdict`.

    Both must come from :func:`evaluate` on the same query set: per-query values are paired
    by query index (queries evaluated in only one of them are dropped). Resampling the same
    queries for both sides removes the between-query variance that unpaired intervals carry.

    Returns:
        ``{metric: {"a", "b", "difference", "ci95": [low, high], "num_paired", "min_effect",
        "verdict"}}``
        for MAP@R, mAP, P@1 and MRR; ``"verdict"``: ``{metric: verdict}`` (B relative to A);
        ``"b_better"`` / ``"a_better"``: the metrics whose verdict is "better" / "worse".

    Raises:
        EvaluationError: no query evaluated in both.
    """
    table_a, table_b = per_query_table(a.per_query), per_query_table(b.per_query)
    common = sorted(set(table_a) & set(table_b))
    if not common:
        raise EvaluationError("the two versions have no evaluated query in common")
    va = np.array([[table_a[q][m] for m in _PAIRED_METRICS] for q in common], dtype=float)
    vb = np.array([[table_b[q][m] for m in _PAIRED_METRICS] for q in common], dtype=float)
    rows = paired_comparison(va, vb, bootstrap, seed, min_effect=min_effect)
    out: dict[str, Any] = dict(zip(_PAIRED_METRICS, rows, strict=True))
    out["verdict"] = {m: out[m]["verdict"] for m in _PAIRED_METRICS}
    out["b_better"] = [m for m in _PAIRED_METRICS if out[m]["verdict"] == BETTER]
    out["a_better"] = [m for m in _PAIRED_METRICS if out[m]["verdict"] == WORSE]
    return out


def gate(comparison: dict[str, Any], require: str) -> tuple[bool, str]:
    """The activation gate on a comparison of the active version (A) and a candidate (B).

    ``require="better"``: allowed iff MAP@R's verdict is "better" and no metric's is
    "worse". ``require="not_worse"``: allowed iff no metric's verdict is "worse".

    Args:
        comparison: :func:`compare_versions`'s result, or a body that holds its metric
            entries under ``"difference"`` (``POST /evaluate``'s comparison).
        require: ``"better"`` or ``"not_worse"``.

    Returns:
        ``(allowed, message)``; the message names the metric that decided, with its
        difference and interval.

    Raises:
        ValueError: an unknown ``require``, or (``"better"``) no MAP@R in the comparison.
    """
    if require not in REQUIREMENTS:
        raise ValueError(f"require must be one of {', '.join(REQUIREMENTS)}, not {require!r}")
    table = comparison.get("difference", comparison)
    metrics = {m: v for m, v in table.items() if isinstance(v, dict) and "ci95" in v}

    def min_effect_of(metric: str) -> float:
        return metrics[metric].get("min_effect", MIN_EFFECT)

    def verdict_of(metric: str) -> str:
        entry = metrics[metric]
        return entry.get("verdict") or verdict(*entry["ci95"], entry["difference"],
                                               min_effect=min_effect_of(metric))

    def describe(metric: str) -> str:
        entry = metrics[metric]
        low, high = entry["ci95"]
        return (f"{metric} {verdict_of(metric)}: B - A = {entry['difference']:+.4f}, 95% "
                f"interval [{low:+.4f}, {high:+.4f}] over {entry['num_paired']} queries")

    worse = [m for m in metrics if verdict_of(m) == WORSE]
    if worse:
        return False, "; ".join(describe(m) for m in worse)
    if require == "better":
        if "map_at_r" not in metrics:
            raise ValueError("the comparison has no map_at_r entry")
        if verdict_of("map_at_r") != BETTER:
            return False, (f"{describe('map_at_r')} (require=better needs the interval above 0 "
                           f"and B - A >= {min_effect_of('map_at_r'):g})")
        return True, f"{describe('map_at_r')}; no metric worse"
    summary = describe("map_at_r") if "map_at_r" in metrics else ""
    return True, "no metric worse" + (f" ({summary})" if summary else "")
