"""The shape of a set of embeddings, and the collapse rule read from it.

A metric-learning run can *collapse*: every image is mapped to nearly the same direction,
retrieval falls to chance, and the loss may still look busy. It shows in two numbers of the
validation embeddings (unit rows), recorded every epoch in the run's ``metrics.json``:

- ``mean_cosine``: the mean cosine similarity over every pair of distinct rows; near 1 when
  the rows crowd into one direction, near 0 when they spread over the sphere;
- ``effective_rank``: ``exp`` of the entropy of the normalised singular values (Roy & Vetterli
  2007, "The effective rank: a measure of effective dimensionality"); how many directions the
  rows really use, from 1 to the dimension.

:func:`collapse` is the rule that stops a run: an epoch's mean cosine above
:data:`COLLAPSE_MEAN_COSINE` after an earlier epoch of the run (the untrained network, epoch 0,
included) was at or below it, while its validation MAP@R is no better than the best earlier
epoch's. "After having been lower" because some untrained networks start crowded
(non-negative pooled features give a shared direction) and only a move *into* the crowd is
the run's doing; "no better" because ranking needs only order, not angle: a few classes can be
ranked perfectly inside a narrow cone (seen on a two-class validation split: mean cosine 0.976
at MAP@R 1.0). The effective rank is recorded but does not stop a run: a validation split of
two classes is well embedded on a line (rank near 1), so a low rank alone is not a failure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Above it, the validation embeddings of many classes share one direction: the measured
# collapse of proxy and classifier losses went from 0.755 to 0.994-0.999 in one epoch, while
# the runs that learn stay far below (a well-spread embedding of many classes is near 0).
COLLAPSE_MEAN_COSINE = 0.95


def embedding_geometry(embeddings: np.ndarray) -> dict[str, float]:
    """``mean_cosine`` and ``effective_rank`` of ``(n, d)`` embeddings (rows normalised here,
    so any nonzero rows will do).

    Returns:
        ``{"mean_cosine": float, "effective_rank": float}``; for fewer than 2 rows, the
        mean cosine is 1 and the effective rank 1 (nothing is spread).
    """
    rows = np.asarray(embeddings, dtype=np.float64)
    n = len(rows)
    if n < 2:
        return {"mean_cosine": 1.0, "effective_rank": 1.0}
    rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    # The sum over all pairs is |sum of rows|^2 minus the n self-pairs: O(n d), no n x n matrix.
    total = rows.sum(axis=0)
    mean_cosine = (float(total @ total) - n) / (n * (n - 1))
    singular = np.linalg.svd(rows, compute_uv=False)
    p = singular / max(float(singular.sum()), 1e-12)
    p = p[p > 0]
    effective_rank = float(np.exp(-(p * np.log(p)).sum()))
    return {"mean_cosine": mean_cosine, "effective_rank": effective_rank}


def collapse(epochs: Sequence[Mapping[str, Any]], threshold: float = COLLAPSE_MEAN_COSINE,
             metric: str = "map_at_r") -> dict[str, Any] | None:
    """Whether the last recorded epoch has collapsed (the rule of this module's docstring).

    Args:
        epochs: the run's ``metrics.json`` ``epochs`` rows, in order; a row without
            ``geometry`` (a run recorded before it was measured) is skipped; the last row
            is the epoch judged.
        threshold: the mean cosine above which the embeddings count as collapsed.
        metric: the validation metric that must not have improved (the selection metric).

    Returns:
        ``None``, or ``{"epoch", "mean_cosine", "effective_rank", "earlier_mean_cosine",
        "threshold", "message"}`` describing the collapse.
    """
    if len(epochs) < 2 or not epochs[-1].get("geometry"):
        return None
    last, before = epochs[-1], epochs[:-1]
    measured = [row["geometry"]["mean_cosine"] for row in before if row.get("geometry")]
    if not measured:
        return None
    cosine, lowest = last["geometry"]["mean_cosine"], min(measured)
    best_before = max(row["val"][metric] for row in before)
    if cosine <= threshold or lowest > threshold or last["val"][metric] > best_before:
        return None
    message = (
        f"embedding collapse at epoch {last['epoch']}: the validation embeddings' mean "
        f"pairwise cosine is {cosine:.3f} (above {threshold}; it was {lowest:.3f} earlier) "
        f"and their effective rank {last['geometry']['effective_rank']:.1f}, with validation "
        f"{metric} {last['val'][metric]:.4f} (best before: {best_before:.4f}): every image "
        "maps to nearly one direction. Training stops; the loss's recipe (batches, "
        "loss-parameter learning rate, scale, embedding head) does not suit this data"
    )
    return {"epoch": last["epoch"], "mean_cosine": cosine,
            "effective_rank": last["geometry"]["effective_rank"],
            "earlier_mean_cosine": lowest, "threshold": threshold, "message": message}
