"""The benchmark report: read the finished runs, aggregate over seeds, write the results.

``aggregate(out, cells)`` loads each cell's ``metrics.json`` (refusing runs whose base configs
or splits differ), and gives test MAP@R, R-Precision and P@1 as mean ± 95% t-interval over
seeds per loss, with the two baselines (raw pixels, the untrained network) as rows.
``write_report(results, out)`` writes ``results.json``, ``results.md``, ``bars.png`` and
``curves.png``. The runner (:mod:`training.benchmark`) calls both after training.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from imgret.errors import ImgretError
from imgret.stats import mean_ci
from training.config import base_config, config_diff
from training.plots import plot_benchmark_bars, plot_benchmark_curves
from training.registry import LOSSES
from training.run_dir import METRICS_FILE

RESULTS_MD, RESULTS_JSON = "results.md", "results.json"
BARS_PNG, CURVES_PNG = "bars.png", "curves.png"
REPORTED = ("map_at_r", "r_precision", "precision_at_1")


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
            raise BenchmarkMismatch(
                f"runs {ref_name} and {name} were tested on different splits "
                f"({ref['split']['digest']} vs {record['split']['digest']})"
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
    rows.append({"name": "untrained network", "kind": "baseline", "seeds": sorted(untrained),
                 "metrics": _over_seeds(list(untrained.values()))})
    pixels = first["baselines"]["raw_pixels"]
    rows.append({
        "name": "raw pixels", "kind": "baseline", "seeds": [],
        "metrics": {m: {"mean": pixels[m], "ci": pixels["ci95"][m], "values": [pixels[m]],
                        "ci_kind": "bootstrap over queries (deterministic)"} for m in REPORTED},
    })
    return {
        "base": base_config(first["config"]), "split": first["split"],
        "split_rule": first.get("split_rule", ""), "rows": rows,
        "curves": {name: [r["epochs"] for r in recs] for name, recs in by_loss.items()},
        "environment": _environment(first),
    }


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
                          title=f"validation MAP@R, mean ± 95% CI over seeds; {title}")
    slim = {k: v for k, v in results.items() if k != "curves"}
    (out / RESULTS_JSON).write_text(json.dumps(slim, indent=1))
    (out / RESULTS_MD).write_text(render_markdown(results))


def render_markdown(results: dict[str, Any]) -> str:
    """The results table and everything needed to read it (split, shared config, command)."""
    split, base = results["split"], results["base"]
    test = split["splits"]["test"]
    lines = [
        "# Metric-learning losses on one base config (Reality-Check protocol)", "",
        f"Test split: **{split['protocol']}**, split `{split['digest']}` of `{split['source']}`: "
        f"{test['num_images']} test images of {test['num_classes']} classes "
        f"({', '.join(map(str, test['classes']))}); {split['splits']['train']['num_images']} "
        f"training images of {split['splits']['train']['num_classes']} classes.  ",
        f"Rule: {results.get('split_rule', '')}", "",
        "Test metrics of the checkpoint selected by validation MAP@R; losses: mean ± 95% "
        "t-interval over seeds; untrained network: over the same seeds; raw pixels: one "
        "deterministic value with its bootstrap 95% interval over queries.", "",
        "| method | miner | seeds | MAP@R | R-Precision | P@1 | best epochs | train time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        cells = [_fmt(row["metrics"][m]) for m in REPORTED]
        lines.append(
            f"| {row['name']} | {row.get('miner', '-')} | {len(row['seeds']) or '-'} | "
            + " | ".join(cells)
            + f" | {','.join(map(str, row.get('best_epoch', []))) or '-'} | "
            + (f"{row['train_time_s']:.0f}" if "train_time_s" in row else "-") + " |"
        )
    lines += ["", "Shared base config (every loss; only the loss block and the seed vary):", "",
              "| key | value |", "|---|---|"]
    lines += [f"| {k} | `{v}` |" for k, v in base.items()]
    lines += ["", "Loss defaults (training.registry):", ""]
    for row in results["rows"]:
        if row["kind"] == "loss":
            name = row["name"].split("-")[0]
            spec = LOSSES[name]
            lines.append(f"- `{row['name']}`: {row['options']}; {spec.source}")
    env = results["environment"]
    lines += ["", f"Environment: {env}", ""]
    if results.get("command"):
        lines += ["Reproduce:", "", "```", results["command"], "```", ""]
    lines += ["![test metrics](bars.png)", "", "![convergence](curves.png)", ""]
    return "\n".join(lines)


def _fmt(stat: dict[str, Any]) -> str:
    lo, hi = stat["ci"]
    return f"{stat['mean']:.3f} ± {(hi - lo) / 2:.3f}"


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
