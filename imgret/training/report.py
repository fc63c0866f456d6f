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
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from imgret.errors import ImgretError
from imgret.stats import mean_ci
from imgret.training.analysis import (
    convergence_over_folds,
    verdicts,
)
from imgret.training.config import base_config, config_diff
from imgret.training.crossval import RUN_TEST_FILE
from imgret.training.run_dir import METRICS_FILE, learned

logger = logging.getLogger(__name__)






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
