"""The benchmark report: read the finished runs, aggregate over seeds, write the results.

``aggregate(out, cells)`` loads each cell's ``metrics.json`` (refusing runs whose base configs
or splits differ), and gives test MAP@R, R-Precision and P@1 as mean ± 95% t-interval over
seeds per loss, with the two baselines (raw pixels, the untrained network) as rows.
The results also carry the analysis of :mod:`imgret.training.analysis` (paired verdicts between
every two rows, tiers of "tied with the best", each loss's time to 90% / 95% of its final
validation MAP@R) and the test split's difficulty (raw pixels' P@1 and MAP@R; a split where raw
pixels reach P@1 > 0.95 is flagged as saturated, loudly, in the log and the report).
``write_report(results, out)`` writes ``results.json``, ``results.md``, ``bars.png`` and
``curves.png``. The runner (:mod:`imgret.training.benchmark`) calls both after training.
"""

from __future__ import annotations

import json
import logging
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from imgret.errors import ImgretError
from imgret.stats import mean_ci
from imgret.training.analysis import CONVERGENCE_FRACTIONS, convergence, fraction_key, verdicts
from imgret.training.config import base_config, config_diff
from imgret.training.plots import plot_benchmark_bars, plot_benchmark_curves
from imgret.training.registry import LOSSES
from imgret.training.run_dir import METRICS_FILE

logger = logging.getLogger(__name__)

RESULTS_MD, RESULTS_JSON = "results.md", "results.json"
BARS_PNG, CURVES_PNG = "bars.png", "curves.png"
REPORTED = ("map_at_r", "r_precision", "precision_at_1")
METRIC_NAMES = {"map_at_r": "MAP@R", "r_precision": "R-Precision", "precision_at_1": "P@1"}
# Raw pixels above this P@1 leave no room to tell methods apart (the old 2-class Fashion-MNIST
# test: P@1 0.98-0.999 for every method, raw pixels included).
SATURATED_P1 = 0.95


class BenchmarkMismatch(ImgretError, ValueError):
    """Runs that do not share one base config (or one split) cannot be compared."""


class RunCell(Protocol):
    """What the report needs of a benchmark cell: its row name and its run directory."""

    name: str
    out: Path


def load_cell_records(cells: Sequence[RunCell]) -> list[tuple[RunCell, dict[str, Any]]]:
    """The finished ``metrics.json`` of each cell, checked to share one base config and split.

    Raises:
        BenchmarkMismatch: two runs with different base configs or splits, or an unfinished run.
    """
    loaded = []
    for cell in cells:
        path = cell.out / METRICS_FILE
        if not path.exists():
            raise BenchmarkMismatch(f"{cell.out}: no {METRICS_FILE}; run the benchmark first")
        record = json.loads(path.read_text())
        if record.get("status") != "finished":
            raise BenchmarkMismatch(f"{cell.out}: run not finished; rerun to resume it")
        loaded.append((cell, record))
    check_comparable([(str(c.out), r) for c, r in loaded])
    return loaded


def check_comparable(records: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Refuse runs whose base configs (everything but loss and seed) or splits differ.

    Args:
        records: ``(name, metrics.json dict)`` per run.

    Raises:
        BenchmarkMismatch: naming the two runs and the differing keys.
    """
    if not records:
        return
    ref_name, ref = records[0]
    ref_base = base_config(ref["config"])
    for name, record in records[1:]:
        diff = config_diff(ref_base, base_config(record["config"]))
        if diff:
            raise BenchmarkMismatch(
                f"runs {ref_name} and {name} have different base configs, so their losses are "
                f"not compared on equal terms: {describe_diff(diff)}"
            )
        if record["split"]["digest"] != ref["split"]["digest"]:
            rules = (ref["split"].get("rule"), record["split"].get("rule"))
            raise BenchmarkMismatch(
                f"runs {ref_name} and {name} were tested on different splits "
                f"({ref['split']['digest']} vs {record['split']['digest']}"
                + (f"; rules: {rules[0]!r} vs {rules[1]!r}" if rules[0] != rules[1] else "")
                + "). Runs made before a split change (e.g. the 5 / 5 Fashion-MNIST "
                "classes) cannot join newer ones: benchmark into a new --out."
            )


def aggregate(out: Path, cells: Sequence[RunCell]) -> dict[str, Any]:
    """Mean ± 95% t-interval over seeds of each loss's test metrics, plus the baselines."""
    loaded = load_cell_records(cells)
    by_loss: dict[str, list[dict[str, Any]]] = {}
    for cell, record in loaded:
        by_loss.setdefault(cell.name, []).append(record)
    first = loaded[0][1]
    rows = []
    for name, records in by_loss.items():
        rows.append({
            "name": name, "kind": "loss", "seeds": [r["config"]["seed"] for r in records],
            "miner": records[0]["loss"]["miner"], "options": records[0]["loss"]["options"],
            "metrics": _over_seeds([r["test"] for r in records]),
            "best_epoch": [r["best"]["epoch"] for r in records],
            "train_time_s": mean_ci([r["epochs"][-1]["train_time_s"] for r in records])[0],
        })
    all_records = [r for _, r in loaded]
    untrained = {}
    for r in all_records:  # the untrained net depends on the seed only, not on the loss
        untrained.setdefault(r["config"]["seed"], r["baselines"]["untrained"])
    seeds = sorted(untrained)
    rows.append({"name": "untrained network", "kind": "baseline", "seeds": seeds,
                 "metrics": _over_seeds([untrained[s] for s in seeds])})
    pixels = first["baselines"]["raw_pixels"]
    rows.append({
        "name": "raw pixels", "kind": "baseline", "seeds": [],
        "metrics": {m: {"mean": pixels[m], "ci": pixels["ci95"][m], "values": [pixels[m]],
                        "ci_kind": "bootstrap over queries (deterministic)"} for m in REPORTED},
    })
    curves = {name: [r["epochs"] for r in recs] for name, recs in by_loss.items()}
    return {
        "base": base_config(first["config"]), "split": first["split"],
        "split_rule": first.get("split_rule", ""), "rows": rows,
        "test_difficulty": test_difficulty(pixels),
        "verdicts": verdicts(rows, REPORTED), "convergence": convergence(curves),
        "curves": curves, "environment": _environment(first),
    }


def test_difficulty(pixels: dict[str, Any]) -> dict[str, Any]:
    """Is the test split left room to show learning? Raw pixels' P@1 and MAP@R, and whether
    their P@1 exceeds :data:`SATURATED_P1` (logged as a warning when it does)."""
    p1, map_r = float(pixels["precision_at_1"]), float(pixels["map_at_r"])
    saturated = p1 > SATURATED_P1
    message = (f"raw pixels on the test split: P@1 {p1:.3f}, MAP@R {map_r:.3f}; "
               + (f"SATURATED (P@1 > {SATURATED_P1}): every method scores near the top, so "
                  "this split cannot tell losses apart" if saturated
                  else f"not saturated (P@1 <= {SATURATED_P1})"))
    (logger.warning if saturated else logger.info)(message)
    return {"raw_pixels_precision_at_1": p1, "raw_pixels_map_at_r": map_r,
            "saturated_above_precision_at_1": SATURATED_P1, "saturated": saturated,
            "message": message}


def _over_seeds(tests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for metric in REPORTED:
        values = [float(t[metric]) for t in tests]
        mean, ci = mean_ci(values)
        out[metric] = {"mean": mean, "ci": ci, "values": values,
                       "ci_kind": f"t-interval over {len(values)} seeds"}
    return out


def write_report(results: dict[str, Any], out: Path) -> None:
    """``results.json``, ``results.md``, ``bars.png`` and ``curves.png`` in ``out``."""
    split = results["split"]
    title = (f"test split: {split['protocol']} {split['digest']} of {split['source']} "
             f"({split['splits']['test']['num_images']} images, "
             f"{split['splits']['test']['num_classes']} classes)")
    plot_benchmark_bars(results["rows"], out / BARS_PNG, metrics=REPORTED, title=title)
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
    first = fraction_key(CONVERGENCE_FRACTIONS[0])
    lines = [
        "# Metric-learning losses on one base config (Reality-Check protocol)", "",
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
    lines += [
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
        cells = [_fmt(row["metrics"][m]) for m in REPORTED]
        speed = reach.get(row["name"], {}).get(first)
        lines.append(
            f"| {row['name']} | {row.get('miner', '-')} | {len(row['seeds']) or '-'} | "
            + " | ".join(cells)
            + f" | {tier_of.get(row['name'], '-')} | "
            + (f"{_fmt(speed['epochs'], 1)} / {_fmt(speed['seconds'], 0)}" if speed else "-")
            + f" | {','.join(map(str, row.get('best_epoch', []))) or '-'} | "
            + (f"{row['train_time_s']:.0f}" if "train_time_s" in row else "-") + " |"
            + (" ⚠ |" if saturated else "")
        )
    lines += _verdicts_markdown(results.get("verdicts", {}))
    lines += _convergence_markdown(reach)
    if results.get("tuning"):
        lines += tuning_markdown(results["tuning"])
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
    return lines


def _fmt(stat: dict[str, Any], digits: int = 3) -> str:
    lo, hi = stat["ci"]
    return f"{stat['mean']:.{digits}f} ± {(hi - lo) / 2:.{digits}f}"


def describe_diff(diff: dict[str, tuple[Any, Any]]) -> str:
    """``{key: (a, b)}`` -> ``"key: a vs b; ..."`` for refusal messages."""
    return "; ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in diff.items())


def _environment(record: dict[str, Any]) -> str:
    import torch

    device = record["config"]["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    return f"torch {torch.__version__}, device {device} ({name}), {platform.platform()}"
