"""The benchmark runner: one base config for every loss, mean ± t-interval, resumable."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import imgret.training.benchmark as benchmark
from imgret.errors import UnknownName
from imgret.stats import mean_ci
from imgret.training.benchmark import (
    BenchmarkMismatch,
    check_comparable,
    parse_losses,
    plan_cells,
    run_benchmark,
)
from imgret.training.config import LossConfig, TrainConfig


def test_mean_ci_is_the_student_t_interval() -> None:
    mean, (lo, hi) = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0
    # t_{0.975, 2} = 4.303, s = 1, n = 3
    assert hi - mean == pytest.approx(4.303 / 3**0.5, rel=1e-4)
    assert mean - lo == pytest.approx(hi - mean)
    assert mean_ci([0.5]) == (0.5, [0.5, 0.5])


def test_cells_differ_only_in_loss_and_seed() -> None:
    base = TrainConfig(data="d", lr=3e-4, dim=32)
    cells = plan_cells(base, parse_losses("triplet,arcface"), [0, 1], Path("out"))
    assert [(c.name, c.config.seed) for c in cells] == [
        ("triplet", 0), ("triplet", 1), ("arcface", 0), ("arcface", 1)]
    for cell in cells:
        assert dataclasses.replace(cell.config, loss=base.loss, seed=base.seed) == base


def test_parse_losses_refuses_unknown_names_up_front() -> None:
    assert parse_losses("triplet:hard")[0] == LossConfig("triplet", "hard")
    with pytest.raises(UnknownName, match="valid: .*multi_similarity"):
        parse_losses("triplet,multisimilarity")
    with pytest.raises(UnknownName, match="miner"):
        parse_losses("triplet:hardest")


def _record(config: TrainConfig, digest: str = "abc") -> dict:
    return {"config": config.to_dict(), "split": {"digest": digest}}


@pytest.mark.parametrize(
    ("change", "key"),
    [({"lr": 1e-2}, "lr"), ({"backbone": "resnet18"}, "backbone"), ({"epochs": 7}, "epochs"),
     ({"augmentation": "none"}, "augmentation"), ({"batch_size": 128}, "batch_size")],
)
def test_runs_with_different_base_configs_are_refused(change: dict, key: str) -> None:
    base = TrainConfig(data="d", backbone="tiny_cnn", loss=LossConfig("triplet"))
    other = dataclasses.replace(base, loss=LossConfig("arcface"), seed=1, **change)
    with pytest.raises(BenchmarkMismatch, match=key):
        check_comparable([("a", _record(base)), ("b", _record(other))])


def test_runs_differing_in_loss_and_seed_only_are_comparable() -> None:
    base = TrainConfig(data="d", loss=LossConfig("triplet"))
    other = dataclasses.replace(base, loss=LossConfig("arcface", options={}), seed=4)
    check_comparable([("a", _record(base)), ("b", _record(other))])
    with pytest.raises(BenchmarkMismatch, match="different splits"):
        check_comparable([("a", _record(base)), ("b", _record(other, digest="xyz"))])


def test_benchmark_dir_with_another_base_config_is_refused(
    tiny_config: TrainConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    monkeypatch.setattr(benchmark, "train", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(benchmark, "aggregate", lambda *a, **k: {})
    monkeypatch.setattr(benchmark, "write_report", lambda *a, **k: None)
    run_benchmark(tiny_config, parse_losses("triplet"), [0], tmp_path)
    assert len(calls) == 1
    changed = dataclasses.replace(tiny_config, dim=16)
    with pytest.raises(BenchmarkMismatch, match="dim: 8 vs 16"):
        run_benchmark(changed, parse_losses("triplet"), [0], tmp_path)
    assert len(calls) == 1  # refused before training anything


@pytest.mark.usefixtures("untrained_scores_zero")
def test_benchmark_end_to_end_and_resumable(
    tiny_config: TrainConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = dataclasses.replace(tiny_config, epochs=1)
    losses = parse_losses("triplet,proxy_anchor")
    results = run_benchmark(base, losses, [0, 1], tmp_path, command="imgret benchmark ...")
    for name in ("results.md", "results.json", "bars.png", "curves.png", "benchmark.json"):
        assert (tmp_path / name).is_file(), name
    names = [row["name"] for row in results["rows"]]
    assert names == ["triplet", "proxy_anchor", "untrained network", "raw pixels"]
    for row in results["rows"]:
        stat = row["metrics"]["map_at_r"]
        assert stat["ci"][0] <= stat["mean"] <= stat["ci"][1]
    assert results["rows"][0]["seeds"] == [0, 1]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["split"]["protocol"] == "class-disjoint"
    markdown = (tmp_path / "results.md").read_text()
    assert "| triplet |" in markdown and "raw pixels" in markdown and "imgret benchmark" in markdown

    # A second call finds every cell finished and trains nothing.
    import imgret.training.loop as loop
    monkeypatch.setattr(loop.EmbeddingNet, "__init__", _fail)
    again = run_benchmark(base, losses, [0, 1], tmp_path)
    assert again["rows"][0]["metrics"] == results["rows"][0]["metrics"]


def _fail(*args, **kwargs):
    raise AssertionError("a finished cell was trained again")
