"""Plots of a run (curves.png) and of a benchmark (bars with error bars, convergence curves).

Matplotlib runs on the Agg backend (no display needed); every function writes one PNG.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

logger = logging.getLogger(__name__)


def plot_run_curves(record: Mapping[str, Any], path: Path) -> None:
    """``curves.png`` of one run: train loss, and validation MAP@R (95% CI band) against
    epoch and against training wall time; the best epoch is marked."""
    rows = record["epochs"]
    epochs = [r["epoch"] for r in rows]
    times = [r["train_time_s"] for r in rows]
    val = np.array([r["val"]["map_at_r"] for r in rows])
    ci = np.array([(r["val"].get("ci95") or {}).get("map_at_r", [v, v])
                   for r, v in zip(rows, val, strict=True)])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    loss_rows = [r for r in rows if r["train_loss"] is not None]
    axes[0].plot([r["epoch"] for r in loss_rows], [r["train_loss"] for r in loss_rows], "o-")
    axes[0].set(xlabel="epoch", ylabel="train loss", title=f"loss: {record['loss']['name']}")
    for ax, x, label in ((axes[1], epochs, "epoch"), (axes[2], times, "training time (s)")):
        ax.plot(x, val, "o-", label="validation MAP@R")
        ax.fill_between(x, ci[:, 0], ci[:, 1], alpha=0.25, label="95% CI (bootstrap)")
        ax.set(xlabel=label, ylabel="MAP@R")
        ax.grid(alpha=0.3)
    best = record.get("best")
    if best is not None:
        axes[1].axvline(best["epoch"], color="grey", ls="--", label=f"best (epoch {best['epoch']})")
    axes[1].legend(fontsize=8)
    split = record["split"]
    fig.suptitle(f"{split['protocol']} split {split['digest']} of {split['source']} "
                 f"(validation: {split['splits']['val']['num_classes']} classes)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def plot_benchmark_bars(
    rows: Sequence[Mapping[str, Any]], path: Path, *, metrics: Sequence[str], title: str
) -> None:
    """Grouped bars of test metrics, mean with 95% CI error bars, one group per row.

    Args:
        rows: ``{"name": str, "metrics": {metric: {"mean", "ci": [lo, hi]}}}`` per loss or
            baseline.
        metrics: which metrics to draw (e.g. map_at_r, r_precision, precision_at_1).
    """
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) * len(metrics) / 2 + 3), 4.5))
    width = 0.8 / len(metrics)
    x = np.arange(len(rows))
    for i, metric in enumerate(metrics):
        means = np.array([r["metrics"][metric]["mean"] for r in rows])
        lo = np.array([r["metrics"][metric]["ci"][0] for r in rows])
        hi = np.array([r["metrics"][metric]["ci"][1] for r in rows])
        ax.bar(x + (i - (len(metrics) - 1) / 2) * width, means, width,
               yerr=np.vstack([means - lo, hi - means]), capsize=3, label=metric)
    ax.set_xticks(x, [r["name"] for r in rows], rotation=30, ha="right")
    ax.set(ylabel="test score (mean ± 95% CI)", title=title)
    ax.set_ylim(0, 1.15)  # headroom for the legend above the bars
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=len(metrics), loc="upper center")
    fig.tight_layout()
    _save(fig, path)


def plot_benchmark_curves(
    curves: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, *, title: str,
    convergence: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Validation MAP@R against epoch and against training time, mean over seeds with a 95%
    t-interval band, one line per loss; with ``convergence``, each loss's time to each share
    of its final MAP@R is marked (mean, with its 95% interval as a horizontal bar).

    Args:
        curves: loss name -> one ``metrics.json`` ``epochs`` list per seed.
        convergence: :func:`imgret.training.analysis.convergence` of ``curves``.
    """
    from imgret.stats import mean_ci

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, runs in curves.items():
        # Runs of one loss can end at different epochs (early stopping): each point is the
        # mean over the runs still training there, drawn while at least half of them are.
        n_epochs = _alive_horizon([len(run) for run in runs])
        stats = [mean_ci([run[e]["val"]["map_at_r"] for run in runs if len(run) > e])
                 for e in range(n_epochs)]
        means = np.array([s[0] for s in stats])
        band = np.array([s[1] for s in stats])
        (line,) = axes[0].plot(range(n_epochs), means, "o-", ms=3, label=name)
        axes[0].fill_between(range(n_epochs), band[:, 0], band[:, 1], alpha=0.2,
                             color=line.get_color())
        # Wall time: each run's curve interpolated on a common grid, the same rule.
        ends = [run[-1]["train_time_s"] for run in runs]
        horizon = sorted(ends, reverse=True)[(len(ends) - 1) // 2]
        grid = np.linspace(0, horizon, 50) if horizon > 0 else np.zeros(1)
        stats_t = [mean_ci([
            np.interp(t, [r["train_time_s"] for r in run], [r["val"]["map_at_r"] for r in run])
            for run, end in zip(runs, ends, strict=True) if end >= t]) for t in grid]
        axes[1].plot(grid, [s[0] for s in stats_t], "-", color=line.get_color(), label=name)
        axes[1].fill_between(grid, [s[1][0] for s in stats_t], [s[1][1] for s in stats_t],
                             alpha=0.2, color=line.get_color())
        if convergence and name in convergence:
            _mark_convergence(axes, convergence[name], line.get_color())
    if convergence:
        axes[0].plot([], [], "kv", ms=6, mfc="none", label="90% / 95% of final (▽ / ▼)")
    axes[0].set(xlabel="epoch (0 = untrained)", ylabel="validation MAP@R")
    axes[1].set(xlabel="training time (s)", ylabel="validation MAP@R")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def _alive_horizon(lengths: Sequence[int]) -> int:
    """The number of leading points at least half of the runs have (runs of equal length:
    all of them)."""
    return sorted(lengths, reverse=True)[(len(lengths) - 1) // 2]


def _mark_convergence(axes: Sequence[Any], entry: Mapping[str, Any], color: str) -> None:
    """Triangles at (mean time to a share, share × mean final MAP@R): hollow for the first
    share (90%), filled for the next (95%); the horizontal bar is the time's 95% interval."""
    final = entry["final"]["mean"]
    shares = sorted((k for k in entry if k.endswith("%")), key=lambda k: float(k[:-1]))
    for i, key in enumerate(shares):
        y = float(key[:-1]) / 100 * final
        for ax, unit in ((axes[0], "epochs"), (axes[1], "seconds")):
            stat = entry[key][unit]
            lo, hi = stat["ci"]
            ax.errorbar([stat["mean"]], [y], xerr=[[stat["mean"] - lo], [hi - stat["mean"]]],
                        fmt="v", ms=7, color=color, mfc="none" if i == 0 else color,
                        capsize=2, lw=1)


def _save(fig: Any, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    logger.debug("wrote %s", path)
