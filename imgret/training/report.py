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

A row with a run that did not learn (its best epoch is the untrained network, so it has no
model: ``imgret.training.run_dir.learned``) reports no numbers: its ``metrics`` are ``None``,
``did_not_learn`` counts the runs, the tables say "did not learn", and it takes part in no
verdict, bar or convergence figure (its curves are still drawn).
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
from imgret.training.analysis import (
    CONVERGENCE_FRACTIONS,
    convergence_over_folds,
    fraction_key,
    verdicts,
)
from imgret.training.config import base_config, config_diff
from imgret.training.crossval import RUN_TEST_FILE
from imgret.training.plots import plot_benchmark_bars, plot_benchmark_curves
from imgret.training.registry import LOSSES
from imgret.training.run_dir import METRICS_FILE, learned

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
    first_name, first = records[0]
    first_base = _requested_base(first)
    # Fold runs validate on different folds, and the oracle control tests on its own share
    # of the test classes: splits are compared within each (fold, oracle) group.
    refs = {_split_group(first): (first_name, first)}
    for name, record in records[1:]:
        diff = config_diff(first_base, _requested_base(record))
        if diff:
            raise BenchmarkMismatch(
                f"runs {first_name} and {name} have different base configs, so their losses "
                f"are not compared on equal terms: {describe_diff(diff)}"
            )
        ref_name, ref = refs.setdefault(_split_group(record), (name, record))
        if record["split"]["digest"] != ref["split"]["digest"]:
            rules = (ref["split"].get("rule"), record["split"].get("rule"))
            raise BenchmarkMismatch(
                f"runs {ref_name} and {name} were tested on different splits "
                f"({ref['split']['digest']} vs {record['split']['digest']}"
                + (f"; rules: {rules[0]!r} vs {rules[1]!r}" if rules[0] != rules[1] else "")
                + "). Runs made before a split change (e.g. the 5 / 5 Fashion-MNIST "
                "classes) cannot join newer ones: benchmark into a new --out."
            )


def _requested_base(record: dict[str, Any]) -> dict[str, Any]:
    """A run's base config as asked: the batch composition before it was fitted to the
    training split (the oracle's split, on other classes, may fit it differently)."""
    return base_config(record["config"] | record.get("requested_batch", {}))


def _split_group(record: dict[str, Any]) -> tuple[Any, bool]:
    config = record["config"]
    return config.get("fold"), config.get("control") == "oracle"


def aggregate(out: Path, cells: Sequence[RunCell]) -> dict[str, Any]:
    """Mean ± 95% t-interval over seeds of each loss's test metrics, plus the baselines.

    Under cross-validation (fold cells) a seed's value is its run's: ``metrics`` = the k fold
    models concatenated (the run's ``test.json``), ``separate`` = the mean of the k fold
    models tested alone; controls are rows of kind ``control`` (the oracle: one model per
    seed, tested on its own share of the test classes, with its baselines on that share).
    """
    loaded = load_cell_records(cells)
    # name -> seed -> the fold records of that run (one record without folds), cell order.
    by_loss: dict[str, dict[int, list[tuple[RunCell, dict[str, Any]]]]] = {}
    for cell, record in loaded:
        by_loss.setdefault(cell.name, {}).setdefault(record["config"]["seed"], []).append(
            (cell, record))
    cv = any(r["config"].get("fold") is not None for _, r in loaded)
    shared = [r for _, r in loaded if r["config"].get("control") != "oracle"] or [loaded[0][1]]
    first = shared[0]
    rows = []
    for name, by_seed in by_loss.items():
        runs = list(by_seed.values())
        records = [r for run in runs for _, r in run]
        control = records[0]["config"].get("control")
        unlearned = sum(not all(learned(r) for _, r in run) for run in runs)
        row: dict[str, Any] = {
            "name": name, "kind": "control" if control else "loss", "seeds": list(by_seed),
            "miner": records[0]["loss"]["miner"], "options": records[0]["loss"]["options"],
            # A run without a model has no test number; averaging the others would hide it.
            "metrics": None if unlearned else _over_seeds([_run_test(run) for run in runs]),
            "best_epoch": [r["best"]["epoch"] for r in records],
            "train_time_s": mean_ci([sum(r["epochs"][-1]["train_time_s"] for _, r in run)
                                     for run in runs])[0],
        }
        if unlearned:
            row["did_not_learn"] = {"runs": unlearned, "of": len(runs)}
            logger.warning("%s: %d of %d runs did not learn (best epoch = the untrained "
                           "network); the row reports no numbers", name, unlearned, len(runs))
        if control:
            row["control"] = control
            row["loss"] = records[0]["config"]["loss"]["name"]
        if cv:
            row["folds"] = len(runs[0])
            row["separate"] = None if unlearned else _over_seeds(
                [_mean_tests([r["test"] for _, r in run]) for run in runs])
            row["stopped_epoch"] = [r.get("stopped_epoch") for r in records]
        if control == "oracle":
            row["baselines_on_its_test"] = {
                name: _over_seeds([r["baselines"][name] for r in records])
                for name in ("untrained", "raw_pixels")}
        rows.append(row)
    untrained = {}
    for r in shared:  # the untrained net depends on the seed only, not on the loss
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
    # Plotted: every fold run's curve; convergence: per run, the mean over its folds.
    curves = {name: [r["epochs"] for run in by_seed.values() for _, r in run]
              for name, by_seed in by_loss.items()}
    scored = {row["name"] for row in rows if row["metrics"] is not None}
    fold_curves = {name: [[r["epochs"] for _, r in run] for run in by_seed.values()]
                   for name, by_seed in by_loss.items() if name in scored}
    same_test = [row for row in rows
                 if row.get("control") != "oracle" and row["metrics"] is not None]
    results = {
        "base": base_config(first["config"]), "split": first["split"],
        "split_rule": first.get("split_rule", ""), "rows": rows,
        "test_difficulty": test_difficulty(pixels),
        # The oracle is scored on other images (its share of the test classes): it is not
        # paired with the rows scored on the test split.
        "verdicts": verdicts(same_test, REPORTED),
        "convergence": convergence_over_folds(fold_curves),
        "curves": curves, "environment": _environment(first),
    }
    if cv:
        with_folds = [{**row, "metrics": row["separate"]} for row in same_test
                      if row.get("separate") is not None]
        results["verdicts_separate"] = verdicts(with_folds, REPORTED)
        results["cross_validation"] = {
            "folds": first["config"]["cv_folds"], "runs": len(untrained),
            "dim": first["config"]["dim"],
            "concatenated_dim": first["config"]["dim"] * first["config"]["cv_folds"],
            "patience": first["config"].get("patience"),
        }
    return results


def _run_test(run: Sequence[tuple[RunCell, dict[str, Any]]]) -> dict[str, Any]:
    """A run's test metrics: its one model's, or its fold models' concatenated."""
    if len(run) == 1 and run[0][1]["config"].get("fold") is None:
        return run[0][1]["test"]
    cell = run[0][0]
    run_dir = getattr(cell, "run", None) or cell.out.parent
    path = run_dir / RUN_TEST_FILE
    if not path.exists():
        raise BenchmarkMismatch(f"{run_dir}: no {RUN_TEST_FILE} (the fold models' concatenated "
                                "test); rerun the benchmark to compute it")
    return json.loads(path.read_text())["concatenated"]


def _mean_tests(tests: Sequence[dict[str, Any]]) -> dict[str, float]:
    return {m: sum(float(t[m]) for t in tests) / len(tests) for m in REPORTED}


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
