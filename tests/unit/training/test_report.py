"""The benchmark report's analysis: paired verdicts, tiers, convergence, test difficulty."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from imgret.stats import mean_ci, paired_mean_ci
from imgret.training.analysis import convergence, paired_differences, tiers, time_to_fraction
from imgret.training.config import LossConfig, TrainConfig
from imgret.training.report import BenchmarkMismatch, aggregate
from imgret.training.report_output import render_markdown, write_report

# Three losses over seeds 0-2. A - B is +0.1 on every seed: a real difference even though
# the unpaired intervals (0.6 ± 0.25 and 0.5 ± 0.25) overlap; C moves against both.
VALUES = {"A": {0: 0.5, 1: 0.6, 2: 0.7}, "B": {0: 0.4, 1: 0.5, 2: 0.6},
          "C": {0: 0.45, 1: 0.62, 2: 0.58}}


def test_paired_mean_ci_is_the_t_interval_of_the_differences() -> None:
    # A - C = [0.05, -0.02, 0.12]: mean 0.05, s = 0.07, t_{0.975,2} = 4.303
    mean, (lo, hi) = paired_mean_ci([0.5, 0.6, 0.7], [0.45, 0.62, 0.58])
    assert mean == pytest.approx(0.05)
    assert hi - mean == pytest.approx(4.303 * 0.07 / 3**0.5, rel=1e-3)
    with pytest.raises(ValueError, match="match"):
        paired_mean_ci([1.0, 2.0], [1.0])


def test_paired_verdicts_by_hand() -> None:
    pairs = {(p["a"], p["b"]): p for p in paired_differences(VALUES)}
    assert list(pairs) == [("A", "B"), ("A", "C"), ("B", "C")]
    ab = pairs["A", "B"]
    assert ab["mean"] == pytest.approx(0.1) and ab["ci"] == pytest.approx([0.1, 0.1])
    assert ab["verdict"] == "A" and ab["seeds"] == [0, 1, 2]
    assert pairs["A", "C"]["verdict"] == "tie"
    assert pairs["B", "C"]["mean"] == pytest.approx(-0.05)
    assert pairs["B", "C"]["verdict"] == "tie"
    # Unpaired, A and B overlap: only the pairing finds the difference.
    assert mean_ci([0.5, 0.6, 0.7])[1][0] < mean_ci([0.4, 0.5, 0.6])[1][1]
    one = paired_differences({"A": {0: 0.9}, "B": {0: 0.1}})
    assert one[0]["verdict"] == "too few seeds"


def test_tiers_are_tied_with_the_best_groups() -> None:
    # Means A 0.6 > C 0.55 > B 0.5; A beats B, C ties both. Tier 1 = A and what ties A (C);
    # B ties C but is beaten by the best, so it starts tier 2.
    assert tiers(VALUES, paired_differences(VALUES)) == [["A", "C"], ["B"]]
    flat = {"x": {0: 0.5, 1: 0.5}, "y": {0: 0.5, 1: 0.5}}
    assert tiers(flat, paired_differences(flat)) == [["x", "y"]]


def _epochs(values: list[float], times: list[float]) -> list[dict]:
    return [{"epoch": e, "train_time_s": t, "val": {"map_at_r": v}}
            for e, (v, t) in enumerate(zip(values, times, strict=True))]


def test_time_to_90_and_95_percent_of_the_final_value() -> None:
    run = _epochs([0.2, 0.5, 0.75, 0.8, 0.78, 0.8], [0, 10, 20, 30, 40, 50])
    assert time_to_fraction(run, 0.9) == {"epoch": 2, "seconds": 20.0, "final": 0.8}  # >= 0.72
    assert time_to_fraction(run, 0.95)["epoch"] == 3  # >= 0.76
    fast = _epochs([0.1, 0.74, 0.8], [0, 5, 10])
    result = convergence({"loss": [run, fast]})["loss"]
    assert result["90%"]["epochs"]["values"] == [2, 1]
    assert result["90%"]["epochs"]["mean"] == pytest.approx(1.5)
    assert result["95%"]["seconds"]["values"] == [30.0, 10.0]
    assert result["final"]["mean"] == pytest.approx(0.8)


def _record(seed: int, loss: str, score: float, p1_pixels: float, rule: str = "r") -> dict:
    metrics = {"map_at_r": score, "r_precision": score, "precision_at_1": score + 0.1}
    config = TrainConfig(data="d", seed=seed, loss=LossConfig(loss)).to_dict()
    return {
        "status": "finished", "config": config, "loss": {"miner": None, "options": {}},
        "split": {"protocol": "class-disjoint", "digest": f"d-{rule}", "source": "s",
                  "rule": rule, "splits": {
                      s: {"classes": ["a", "b"], "num_classes": 2, "num_images": 8}
                      for s in ("train", "val", "test")}},
        "test": metrics, "best": {"epoch": 2},
        "epochs": _epochs([0.2, 0.3 + seed / 100, score], [0, 1.0 + seed, 2.0 + seed]),
        "baselines": {
            "untrained": {"map_at_r": 0.2, "r_precision": 0.2, "precision_at_1": 0.4 + seed / 100},
            "raw_pixels": {"map_at_r": 0.4, "r_precision": 0.4, "precision_at_1": p1_pixels,
                           "ci95": {"map_at_r": [0.3, 0.5], "r_precision": [0.3, 0.5],
                                    "precision_at_1": [p1_pixels - 0.01, p1_pixels]}},
        },
    }


@dataclass
class _Cell:
    name: str
    out: Path


def _cells(tmp_path: Path, p1_pixels: float = 0.7, rules: tuple[str, ...] = ("r",)) -> list:
    cells = []
    for loss, base in (("triplet", 0.5), ("arcface", 0.6)):
        for seed in (0, 1, 2):
            cell = _Cell(loss, tmp_path / loss / f"seed{seed}")
            cell.out.mkdir(parents=True)
            rule = rules[min(seed, len(rules) - 1)]
            record = _record(seed, loss, base + seed / 50, p1_pixels, rule)
            (cell.out / "metrics.json").write_text(json.dumps(record))
            cells.append(cell)
    return cells


def test_report_has_verdicts_convergence_and_difficulty(tmp_path: Path) -> None:
    results = aggregate(tmp_path, _cells(tmp_path))
    results["tuning"] = {"trials": 4, "per_trial": {"epochs": 3, "time_budget_s": None},
                         "spaces": {"triplet": {"lr": {"low": 1e-4, "high": 1e-2, "log": True}}},
                         "best": {"triplet": {"trial": 2, "val_map_at_r": 0.5,
                                              "params": {"lr": 0.0031}}}}
    write_report(results, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["test_difficulty"]["saturated"] is False
    assert saved["verdicts"]["map_at_r"]["tiers"][0] == ["arcface"]  # +0.1 on every seed
    assert saved["convergence"]["triplet"]["90%"]["epochs"]["values"] == [2, 2, 2]
    markdown = (tmp_path / "results.md").read_text()
    for section in ("## Which differences are real", "## Convergence", "## Equal-budget tuning",
                    "Test difficulty: raw pixels on the test split: P@1 0.700",
                    "| triplet | arcface | 3 | -0.100 [-0.100, -0.100] **arcface**",
                    "lr ∈ [0.0001, 0.01] log", "lr=0.0031 (0.500, #2)"):
        assert section in markdown, section
    assert "WARNING" not in markdown
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_a_saturated_test_split_is_flagged_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        results = aggregate(tmp_path, _cells(tmp_path, p1_pixels=0.99))
    assert results["test_difficulty"]["saturated"] is True
    assert "SATURATED" in caplog.text
    markdown = render_markdown(results)
    assert "**WARNING: saturated test split.**" in markdown and "⚠ saturated split" in markdown


def test_runs_from_before_a_split_change_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkMismatch, match="new --out"):
        aggregate(tmp_path, _cells(tmp_path, rules=("old", "new")))
