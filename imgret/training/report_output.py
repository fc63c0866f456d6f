"""What a finished benchmark writes: ``results.json``, ``bars.png``, ``curves.png`` and the
Markdown tables of ``results.md`` (per loss, controls, verdicts,
convergence, tuning and its correlation), computed by :mod:`imgret.training.report`,
:mod:`imgret.training.analysis` and :mod:`imgret.training.tune`."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from imgret.training.analysis import (
    CONVERGENCE_FRACTIONS,
    fraction_key,
)
from imgret.training.plots import plot_benchmark_bars, plot_benchmark_curves
from imgret.training.registry import LOSSES
from imgret.training.report import METRIC_NAMES, REPORTED

RESULTS_MD, RESULTS_JSON = "results.md", "results.json"
BARS_PNG, CURVES_PNG = "bars.png", "curves.png"


def write_report(results: dict[str, Any], out: Path) -> None:
    """``results.json``, ``results.md``, ``bars.png`` and ``curves.png`` in ``out``."""
    split = results["split"]
    title = (f"test split: {split['protocol']} {split['digest']} of {split['source']} "
             f"({split['splits']['test']['num_images']} images, "
             f"{split['splits']['test']['num_classes']} classes)")
    plot_benchmark_bars([row for row in results["rows"] if row["metrics"] is not None],
                        out / BARS_PNG, metrics=REPORTED, title=title)
    plot_benchmark_curves(results["curves"], out / CURVES_PNG,
                          title=f"validation MAP@R, mean ± 95% CI over seeds; {title}",
                          convergence=results.get("convergence"))
    slim = {k: v for k, v in results.items() if k != "curves"}
    (out / RESULTS_JSON).write_text(json.dumps(slim, indent=1))
    (out / RESULTS_MD).write_text(render_markdown(results))


def render_markdown(results: dict[str, Any]) -> str:
    """The results table and everything needed to read it: the split and its difficulty, the
    verdicts, convergence, tuning (when the losses were tuned), shared config, command."""
    split, base = results["split"], results["base"]
    parts = split["splits"]
    difficulty = results.get("test_difficulty")
    saturated = bool(difficulty and difficulty["saturated"])
    tier_of = _tier_index(results, "map_at_r")
    reach = results.get("convergence", {})
    tuning = results.get("tuning") or {}
    title = "# Metric-learning losses on one base config (Reality-Check protocol)"
    if tuning.get("lr_ablation"):
        title = ("# Ablation: the trunk learning rate tuned per loss (not the protocol's one "
                 "shared rate)")
    lines = [
        title, "",
        f"Split: **{split['protocol']}**, `{split['digest']}` of `{split['source']}`: "
        f"test = {parts['test']['num_images']} images of {parts['test']['num_classes']} classes "
        f"({_classes(parts['test'])}); validation = {parts['val']['num_images']} images of "
        f"{parts['val']['num_classes']} classes ({_classes(parts['val'])}); training = "
        f"{parts['train']['num_images']} images of {parts['train']['num_classes']} classes "
        f"({_classes(parts['train'])}).  ",
        f"Rule: {results.get('split_rule', '') or split.get('rule', '')}", "",
    ]
    if difficulty:
        lines += ([f"> **WARNING: saturated test split.** {difficulty['message']}.", ""]
                  if saturated else [f"Test difficulty: {difficulty['message']}.", ""])
    if "cross_validation" in results:
        lines += _cv_table(results, tier_of, saturated)
    else:
        lines += _single_split_table(results, tier_of, saturated)
    lines += _controls_markdown(results["rows"])
    lines += _verdicts_markdown(results.get("verdicts", {}))
    if results.get("verdicts_separate"):
        lines += ["", "Fold models tested alone (MAP@R tiers, paired by run): " + " > ".join(
            "{" + ", ".join(tier) + "}"
            for tier in results["verdicts_separate"]["map_at_r"]["tiers"])]
    lines += _convergence_markdown(reach)
    if tuning:
        lines += tuning_markdown(tuning)
    lines += ["", "Shared base config (every loss; only the loss block and the seed vary):", "",
              "| key | value |", "|---|---|"]
    lines += [f"| {k} | `{v}` |" for k, v in base.items()]
    lines += ["", "Loss options used, beside the documented defaults "
              "(imgret.training.registry):", ""]
    for row in results["rows"]:
        if row["kind"] == "loss":
            name = row["name"].split("-")[0]
            spec = LOSSES[name]
            lines.append(f"- `{row['name']}`: used {row['options']}; defaults "
                         f"{dict(spec.defaults)}: {spec.source}")
    env = results["environment"]
    lines += ["", f"Environment: {env}", ""]
    if results.get("command"):
        lines += ["Reproduce:", "", "```", results["command"], "```", ""]
    lines += ["![test metrics](bars.png)", "", "![convergence](curves.png)", ""]
    return "\n".join(lines)


def _single_split_table(
    results: dict[str, Any], tier_of: dict[str, int], saturated: bool
) -> list[str]:
    reach = results.get("convergence", {})
    first = fraction_key(CONVERGENCE_FRACTIONS[0])
    lines = [
        "Test metrics of the checkpoint selected by validation MAP@R; losses: mean ± 95% "
        "t-interval over seeds; untrained network: over the same seeds; raw pixels: one "
        "deterministic value with its bootstrap 95% interval over queries. Tier: MAP@R tier "
        "of \"tied with the best\" (1 = indistinguishable from the best; see below). "
        f"To {first}: epochs / training seconds until validation MAP@R first reached "
        f"{first} of the run's final value.", "",
        "| method | miner | seeds | MAP@R | R-Precision | P@1 | tier | "
        f"to {first} (epochs / s) | best epochs | train time (s) |"
        + (" ⚠ saturated split |" if saturated else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if saturated else ""),
    ]
    for row in results["rows"]:
        cells = [_metric_cell(row, m) for m in REPORTED]
        speed = reach.get(row["name"], {}).get(first)
        lines.append(
            f"| {_display_name(row)} | {row.get('miner', '-')} | {len(row['seeds']) or '-'} | "
            + " | ".join(cells)
            + f" | {tier_of.get(row['name'], '-')} | "
            + (f"{_fmt(speed['epochs'], 1)} / {_fmt(speed['seconds'], 0)}" if speed else "-")
            + f" | {','.join(map(str, row.get('best_epoch', []))) or '-'} | "
            + (f"{row['train_time_s']:.0f}" if "train_time_s" in row else "-") + " |"
            + (" ⚠ |" if saturated else "")
        )
    return lines


def _cv_table(results: dict[str, Any], tier_of: dict[str, int], saturated: bool) -> list[str]:
    """The cross-validated table: each run's fold models concatenated and tested alone,
    convergence to both shares, where the folds stopped."""
    cv = results["cross_validation"]
    reach = results.get("convergence", {})
    keys = [fraction_key(f) for f in CONVERGENCE_FRACTIONS]
    k, dim, cat = cv["folds"], cv["dim"], cv["concatenated_dim"]
    lines = [
        f"**{k}-fold cross-validation** (class-disjoint folds of the non-test classes), "
        f"{cv['runs']} runs of {k} fold models each; early stopping: "
        + (f"patience {cv['patience']} epochs" if cv.get("patience") else "none")
        + f". *Concatenated*: each run's {k} fold models' {dim}-d embeddings, each "
        f"L2-normalised, side by side ({cat}-d), tested as one model; *alone*: each fold model "
        f"tested by itself ({dim}-d), the mean over the run's {k} folds. Mean ± 95% "
        "t-interval over runs (untrained network: over the same seeds; raw pixels: its "
        "bootstrap interval over queries). Tier: MAP@R tier of the concatenated models (see "
        "below). To 90% / 95%: epochs / training seconds until validation MAP@R first "
        "reached that share of the fold run's best value, mean over the run's folds.", "",
        f"| method | runs | MAP@R ({cat}-d) | R-Precision ({cat}-d) | P@1 ({cat}-d) | "
        f"MAP@R alone ({dim}-d) | R-Precision alone | P@1 alone | tier | "
        + " | ".join(f"to {key} (epochs / s)" for key in keys)
        + " | stopped at epoch (mean) | train time per run (s) |"
        + (" ⚠ saturated split |" if saturated else ""),
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(keys) + "---|---|"
        + ("---|" if saturated else ""),
    ]
    for row in results["rows"]:
        alone = {**row, "metrics": row.get("separate") or row["metrics"]}
        speed = reach.get(row["name"], {})
        stopped = [e for e in row.get("stopped_epoch", []) if e is not None]
        concatenated = row["kind"] == "baseline" or (
            "separate" in row and row.get("control") != "oracle")
        cells = [
            _display_name(row), str(len(row["seeds"]) or "-"),
            *[_metric_cell(row, m) if concatenated else "-" for m in REPORTED],
            *[_metric_cell(alone, m) for m in REPORTED], str(tier_of.get(row["name"], "-")),
            *[f"{_fmt(speed[key]['epochs'], 1)} / {_fmt(speed[key]['seconds'], 0)}"
              if key in speed else "-" for key in keys],
            f"{sum(stopped) / len(stopped):.1f}" if stopped else "-",
            f"{row['train_time_s']:.0f}" if "train_time_s" in row else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |" + (" ⚠ |" if saturated else ""))
    return lines


def _metric_cell(row: dict[str, Any], metric: str) -> str:
    """A row's metric as mean ± half-interval, or why it has none."""
    if row["metrics"] is None:
        return did_not_learn(row)
    return _fmt(row["metrics"][metric])


def did_not_learn(row: dict[str, Any]) -> str:
    """``did not learn (2 of 5 runs)``: what a row without numbers says instead."""
    missing = row.get("did_not_learn") or {}
    return f"did not learn ({missing.get('runs', '?')} of {missing.get('of', '?')} runs)"


def _display_name(row: dict[str, Any]) -> str:
    if row.get("control"):
        return f"{row['name']} (control, {row['loss']})"
    return row["name"]


def _controls_markdown(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the controls are, and the oracle's baselines on its own test images."""
    controls = {row["control"]: row for row in rows if row.get("control")}
    if not controls:
        return []
    lines = ["", "Controls (same base config, the named loss's configuration):", ""]
    if "shuffled_labels" in controls:
        lines.append("- `shuffled_labels`: trained with the training labels permuted over the "
                     "images; nothing it learns transfers, so it should land near the untrained "
                     "network (above it: the test classes leak into training, or the protocol "
                     "rewards something other than learning).")
    if "oracle" in controls:
        row = controls["oracle"]
        base = row.get("baselines_on_its_test", {})
        extra = ""
        if base:
            extra = (f" On those images raw pixels score MAP@R "
                     f"{_fmt(base['raw_pixels']['map_at_r'])} and the untrained network "
                     f"{_fmt(base['untrained']['map_at_r'])}.")
        lines.append("- `oracle`: one model per seed trained on the test classes themselves "
                     "(a held-out share of each test class's images validates and tests it): the "
                     "ceiling of a model that has seen the test classes. Its numbers come from "
                     "its own held-out images (fewer per class than the test split), not from "
                     "the test split the other rows use, so it has no tier and is in no paired "
                     "comparison; compare it with its own baselines." + extra)
    return lines


def _classes(part: dict[str, Any]) -> str:
    return ", ".join(map(str, part["classes"]))


def _tier_index(results: dict[str, Any], metric: str) -> dict[str, int]:
    tiers = results.get("verdicts", {}).get(metric, {}).get("tiers", [])
    return {name: i for i, tier in enumerate(tiers, start=1) for name in tier}


def _verdicts_markdown(verdicts: dict[str, Any]) -> list[str]:
    """Tiers per metric and the pairwise table (A - B per metric, 95% interval, winner)."""
    if not verdicts:
        return []
    metrics = [m for m in REPORTED if m in verdicts]
    lines = [
        "", "## Which differences are real", "",
        "Paired by seed: for every two methods, the difference A − B of seed k against seed "
        "k, mean and 95% t-interval over the shared seeds (raw pixels: a constant). A "
        "difference is real when its interval excludes 0; intervals are per pair, not "
        "adjusted for the number of pairs. Tiers: tier 1 = the best method and every method "
        "tied with it; each next tier repeats the rule on the methods left.", "",
    ]
    for metric in metrics:
        tiers = verdicts[metric]["tiers"]
        lines.append(f"- {METRIC_NAMES[metric]}: " + " > ".join(
            "{" + ", ".join(tier) + "}" for tier in tiers))
    lines += ["", "| A | B | seeds | " + " | ".join(f"{METRIC_NAMES[m]} A − B" for m in metrics)
              + " |", "|---|---|---|" + "---|" * len(metrics)]
    by_metric = [verdicts[m]["pairs"] for m in metrics]
    for pairs in zip(*by_metric, strict=True):
        head = pairs[0]
        cells = [f"{p['mean']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] "
                 + (f"**{p['verdict']}**" if p["verdict"] in (p["a"], p["b"]) else p["verdict"])
                 for p in pairs]
        lines.append(f"| {head['a']} | {head['b']} | {len(head['seeds'])} | "
                     + " | ".join(cells) + " |")
    return lines


def _convergence_markdown(reach: dict[str, Any]) -> list[str]:
    if not reach:
        return []
    keys = [fraction_key(f) for f in CONVERGENCE_FRACTIONS]
    lines = [
        "", "## Convergence", "",
        "Per loss, the first validated epoch whose validation MAP@R reached a share of that "
        "run's final validation MAP@R, and the training seconds by then (validation time "
        "excluded; validation runs at epoch ends, so these are upper bounds); mean ± 95% "
        "t-interval over seeds. Marked on curves.png.", "",
        "| loss | final val MAP@R | " + " | ".join(f"epochs to {k} | s to {k}" for k in keys)
        + " |", "|---|---|" + "---|---|" * len(keys),
    ]
    for name, entry in reach.items():
        cells = [f"{_fmt(entry[k]['epochs'], 1)} | {_fmt(entry[k]['seconds'], 0)}" for k in keys]
        lines.append(f"| {name} | {_fmt(entry['final'])} | " + " | ".join(cells) + " |")
    return lines


def tuning_markdown(tuning: dict[str, Any]) -> list[str]:
    """The equal-budget tuning (``imgret.training.tune``'s ``results["tuning"]``): the trial budget,
    how trials were proposed and judged, and each loss's search space and best trial."""
    per_trial = tuning.get("per_trial", {})
    budget = f"{per_trial.get('epochs', '?')} epochs"
    if per_trial.get("time_budget_s") is not None:
        budget += f" or {per_trial['time_budget_s']:g} s"
    lines = [
        "", "## Equal-budget tuning", "",
        f"Every loss: **{tuning['trials']} trials** of {budget} each, judged on "
        f"{tuning.get('objective', 'validation MAP@R')}; sampler {tuning.get('sampler', '?')}"
        f" ({tuning.get('startup_trials', '?')} random start-up trials); pruning: "
        f"{tuning.get('pruning', '?')}. Each loss's best configuration was retrained with "
        "every seed and tested once per seed.", "",
        "| loss | search space | best (validation MAP@R, trial) | diverged trials |",
        "|---|---|---|---|",
    ]
    for name, space in tuning.get("spaces", {}).items():
        best = tuning.get("best", {}).get(name, {})
        ranges = "; ".join(f"{key} ∈ [{p['low']:g}, {p['high']:g}]" + (" log" if p.get("log")
                           else "") for key, p in space.items())
        chosen = ", ".join(f"{key}={v:.3g}" if isinstance(v, float) and math.isfinite(v)
                           else f"{key}={v}" for key, v in best.get("params", {}).items())
        score = best.get("val_map_at_r")
        lines.append(f"| {name} | {ranges} | {chosen} ("
                     + (f"{score:.3f}" if score is not None else "-")
                     + f", #{best.get('trial', '-')}) | "
                     f"{tuning.get('diverged', {}).get(name, 0)} |")
    if "lr_tuned" in tuning:
        lines += ["", "Network learning rate: " + (
            "tuned per loss (`lr` in the spaces above)" if tuning["lr_tuned"] else
            f"one for every loss, the base config's `lr` ({per_trial.get('lr', 'base')}); "
            "only loss, miner and loss-parameter settings are tuned") + "."]
    if tuning.get("correlation"):
        lines += correlation_markdown(tuning["correlation"])
    return lines


def correlation_markdown(correlation: dict[str, Any]) -> list[str]:
    """Spearman's rho between the trials' validation and test MAP@R (all trials, per loss)."""
    def cell(stat: dict[str, Any]) -> str:
        if stat["rho"] is None:
            return f"- (n = {stat['n']})"
        return f"{stat['rho']:+.3f} (p = {stat['p']:.2g}, n = {stat['n']})"

    lines = [
        "", "### Does validation predict test?", "",
        "Spearman's rank correlation (scipy.stats.spearmanr) between each tuning trial's "
        "validation MAP@R (its objective) and its test MAP@R, measured only after every study "
        "had finished and chosen its winner, so the test split played no part in the choice. "
        "*Concatenated*: the trial's fold models tested together; *alone*: their mean tested "
        "one by one.", "",
        "| trials | rho (concatenated) | rho (alone) |", "|---|---|---|",
        f"| all | {cell(correlation['all']['test'])} | {cell(correlation['all']['test_alone'])} |",
    ]
    for name, stats in correlation.get("per_loss", {}).items():
        lines.append(f"| {name} | {cell(stats['test'])} | {cell(stats['test_alone'])} |")
    return lines


def _fmt(stat: dict[str, Any], digits: int = 3) -> str:
    lo, hi = stat["ci"]
    return f"{stat['mean']:.{digits}f} ± {(hi - lo) / 2:.{digits}f}"



