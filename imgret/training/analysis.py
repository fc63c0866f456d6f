"""Which differences between losses are real, and how fast each loss gets where it ends.

Verdicts. Every loss is trained with the same seeds, and seed ``k``
fixes the initialisation, the batches and the augmentation for every loss alike, so two
losses are compared *paired*: the difference ``A_k - B_k`` per seed, its mean and Student-t
95% interval (:func:`imgret.stats.paired_mean_ci`). A pair is a real difference when the
interval excludes 0, a tie when it contains 0, and undecided with fewer than 2 shared seeds
(no spread can be estimated). The untrained network is paired by seed too; raw pixels are one
deterministic number, compared as a constant (its bootstrap interval over queries is not
propagated). The intervals are per pair and not adjusted for multiplicity: among 28 pairs of
8 equal losses, one or two would show a "difference" by chance.

Ranking: **tiers of "tied with the best"**. Tier 1 is the loss with the highest mean and every
loss whose paired interval against it contains 0; the tiers below repeat the rule on the
losses left. Every loss lands in exactly one tier, and a loss in tier 1 is one the data cannot
tell from the best. (A compact letter display would also show the ties between lower losses,
but its overlapping letters are harder to read in a table; the pairwise table has them all.)

Convergence: from each run's per-epoch validation MAP@R (``metrics.json``
``epochs``: epoch 0 = the untrained network), the first validated epoch whose MAP@R reaches
90% (95%) of that run's *final* validation MAP@R, and the training seconds (validation time
excluded) spent by then; mean ± 95% t-interval over seeds. The final value is the run's best
validated epoch, the one its checkpoint keeps (with early stopping, the last epochs are the
patience spent after it, below the best). Validation happens at epoch ends, so the time is
the first epoch end past the threshold (an upper bound, no interpolation). A cross-validated
run has one such time per fold (each fold validates on its own classes); the run's time is
the mean over its folds, and the interval is over runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations
from typing import Any

from imgret.stats import mean_ci, paired_mean_ci

CONVERGENCE_FRACTIONS = (0.9, 0.95)
CONVERGENCE_METRIC = "map_at_r"


def per_seed_values(rows: Sequence[Mapping[str, Any]], metric: str) -> dict[str, dict[int, float]]:
    """``{row name: {seed: value}}`` of one metric from the report's rows. A row without seeds
    (raw pixels: one deterministic value) gets its value on every seed seen in the others."""
    seeds = sorted({s for row in rows for s in row["seeds"]})
    out = {}
    for row in rows:
        values = row["metrics"][metric]["values"]
        if row["seeds"]:
            out[row["name"]] = dict(zip(row["seeds"], values, strict=True))
        else:
            out[row["name"]] = dict.fromkeys(seeds, values[0])
    return out


def paired_differences(values: Mapping[str, Mapping[int, float]]) -> list[dict[str, Any]]:
    """Every pair ``(a, b)`` in the given order: ``a - b`` over their shared seeds.

    Returns:
        ``{"a", "b", "seeds", "mean", "ci": [lo, hi], "verdict"}`` per pair, where the verdict
        is ``a`` or ``b`` (that one is higher: the interval excludes 0), ``tie`` or
        ``too few seeds``.
    """
    pairs = []
    for a, b in combinations(values, 2):
        seeds = sorted(set(values[a]) & set(values[b]))
        if not seeds:
            continue
        mean, ci = paired_mean_ci([values[a][s] for s in seeds], [values[b][s] for s in seeds])
        if len(seeds) < 2:
            verdict = "too few seeds"
        elif ci[0] > 0:
            verdict = a
        elif ci[1] < 0:
            verdict = b
        else:
            verdict = "tie"
        pairs.append({"a": a, "b": b, "seeds": seeds, "mean": mean, "ci": ci,
                      "verdict": verdict})
    return pairs


def tiers(values: Mapping[str, Mapping[int, float]],
          pairs: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Groups of "tied with the best", best first (see the module docstring).

    Args:
        values: ``{name: {seed: value}}``.
        pairs: :func:`paired_differences` of ``values``.

    Returns:
        Names per tier, each tier ordered by mean, highest first.
    """
    beaten = {(p["a"], p["b"]) if p["verdict"] == p["a"] else (p["b"], p["a"])
              for p in pairs if p["verdict"] in (p["a"], p["b"])}
    means = {name: sum(v.values()) / len(v) for name, v in values.items() if v}
    remaining = sorted(means, key=lambda n: -means[n])
    out = []
    while remaining:
        best = remaining[0]
        tier = [n for n in remaining if (best, n) not in beaten]
        out.append(tier)
        remaining = [n for n in remaining if n not in tier]
    return out


def verdicts(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> dict[str, Any]:
    """Pairwise differences and tiers of every metric, over the report's rows."""
    out = {}
    for metric in metrics:
        values = per_seed_values(rows, metric)
        pairs = paired_differences(values)
        out[metric] = {"pairs": pairs, "tiers": tiers(values, pairs)}
    return out


def time_to_fraction(epochs: Sequence[Mapping[str, Any]], fraction: float,
                     metric: str = CONVERGENCE_METRIC) -> dict[str, float]:
    """The first validated epoch of one run reaching ``fraction`` of its final validation
    ``metric``, and the training seconds spent by then.

    Args:
        epochs: the run's ``metrics.json`` ``epochs`` rows (``epoch``, ``train_time_s``,
            ``val``), in order.

    Returns:
        ``{"epoch", "seconds", "final"}`` where ``final`` is the best validated value (the
        kept checkpoint's). The best epoch always qualifies.
    """
    final = max(float(r["val"][metric]) for r in epochs)
    target = fraction * final
    row = next(r for r in epochs if float(r["val"][metric]) >= target)
    return {"epoch": int(row["epoch"]), "seconds": float(row["train_time_s"]), "final": final}


def convergence(curves: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
                fractions: Sequence[float] = CONVERGENCE_FRACTIONS) -> dict[str, Any]:
    """Per loss: time to 90% / 95% of its own final validation MAP@R, over seeds.

    Args:
        curves: loss name -> one ``epochs`` list per seed.

    Returns:
        ``{loss: {"final": stat, "90%": {"epochs": stat, "seconds": stat}, ...}}`` where a
        stat is ``{"mean", "ci", "values"}`` (values in seed order).
    """
    out: dict[str, Any] = {}
    for name, runs in curves.items():
        entry: dict[str, Any] = {}
        for fraction in fractions:
            reached = [time_to_fraction(run, fraction) for run in runs]
            entry[fraction_key(fraction)] = {
                unit: _stat([r[field] for r in reached])
                for unit, field in (("epochs", "epoch"), ("seconds", "seconds"))
            }
        entry["final"] = _stat([time_to_fraction(run, 1.0)["final"] for run in runs])
        out[name] = entry
    return out


def convergence_over_folds(
    runs: Mapping[str, Sequence[Sequence[Sequence[Mapping[str, Any]]]]],
    fractions: Sequence[float] = CONVERGENCE_FRACTIONS,
) -> dict[str, Any]:
    """:func:`convergence` of cross-validated runs: a run's time to each share (and its
    final value) is the mean over its fold runs; stats are over runs.

    Args:
        runs: loss name -> one list per run of its fold runs' ``epochs`` lists (a run
            without folds: a list of one).

    Returns:
        As :func:`convergence`, one value per run.
    """
    out: dict[str, Any] = {}
    for name, per_run in runs.items():
        entry: dict[str, Any] = {}
        for fraction in fractions:
            reached = [[time_to_fraction(fold, fraction) for fold in run] for run in per_run]
            entry[fraction_key(fraction)] = {
                unit: _stat([sum(r[field] for r in run) / len(run) for run in reached])
                for unit, field in (("epochs", "epoch"), ("seconds", "seconds"))
            }
        entry["final"] = _stat([
            sum(time_to_fraction(fold, 1.0)["final"] for fold in run) / len(run)
            for run in per_run])
        out[name] = entry
    return out


def fraction_key(fraction: float) -> str:
    """``0.9`` -> ``"90%"``: the key of one threshold in :func:`convergence`'s output."""
    return f"{round(fraction * 100)}%"


def _stat(values: Sequence[float]) -> dict[str, Any]:
    mean, ci = mean_ci(values)
    return {"mean": mean, "ci": ci, "values": list(values)}
