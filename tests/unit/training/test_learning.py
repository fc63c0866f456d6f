"""Nothing untrained passes for trained: a run whose best epoch is the untrained network says
it did not learn (flag, exit status, no model.pt, "did not learn" rows), and a run whose
validation embeddings collapse into one direction is stopped."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from imgret.cli.main import app
from imgret.cli.train import NOT_LEARNED_EXIT
from imgret.training.benchmark import parse_losses, run_benchmark
from imgret.training.config import LossConfig, TrainConfig
from imgret.training.geometry import COLLAPSE_MEAN_COSINE, collapse, embedding_geometry
from imgret.training.loop import train
from imgret.training.run_dir import learned
from tests.conftest import TEST_DEVICE


def _rows(cosines: list[float], maps: list[float]) -> list[dict]:
    return [{"epoch": e, "val": {"map_at_r": m},
             "geometry": {"mean_cosine": c, "effective_rank": 3.0}}
            for e, (c, m) in enumerate(zip(cosines, maps, strict=True))]


def test_geometry_of_spread_and_collapsed_embeddings() -> None:
    rng = np.random.default_rng(0)
    spread = embedding_geometry(rng.normal(size=(500, 32)))
    assert abs(spread["mean_cosine"]) < 0.01
    assert spread["effective_rank"] > 25  # near the dimension

    direction = rng.normal(size=32)
    crowded = embedding_geometry(direction + 0.05 * rng.normal(size=(500, 32)))
    assert crowded["mean_cosine"] > 0.99
    assert crowded["effective_rank"] < spread["effective_rank"] / 5

    # Two antipodal clusters: spread on average (cosine near 0) but one line (rank near 1).
    line = np.concatenate([np.tile(direction, (50, 1)), np.tile(-direction, (50, 1))])
    both = embedding_geometry(line + 1e-3 * rng.normal(size=line.shape))
    assert abs(both["mean_cosine"]) < 0.02 and both["effective_rank"] < 1.1

    # The mean over pairs without the n x n matrix equals the matrix's off-diagonal mean.
    x = rng.normal(size=(40, 8))
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    gram = unit @ unit.T
    expected = (gram.sum() - 40) / (40 * 39)
    assert embedding_geometry(x)["mean_cosine"] == pytest.approx(expected)


def test_the_collapse_rule() -> None:
    # Into the crowd without a better validation score: collapse, with a message.
    fired = collapse(_rows([0.75, 0.99], [0.04, 0.02]))
    assert fired is not None and fired["epoch"] == 1
    assert "collapse at epoch 1" in fired["message"] and "0.990" in fired["message"]
    # Started crowded (tiny_cnn's pooled features): not the run's doing.
    assert collapse(_rows([0.97, 0.99], [0.04, 0.02])) is None
    # Crowded but ranking better than ever: ranking needs order, not angle.
    assert collapse(_rows([0.75, 0.97], [0.50, 0.90])) is None
    # Spread: nothing to say; and a row recorded before geometry existed is skipped.
    assert collapse(_rows([0.75, 0.60], [0.04, 0.02])) is None
    assert collapse([{"epoch": 0, "val": {"map_at_r": 0.1}},
                     *_rows([0.5, 0.99], [0.04, 0.02])[1:]]) is None
    assert COLLAPSE_MEAN_COSINE == 0.95


def test_a_run_that_cannot_improve_fails_loudly(eight_classes: Path, tmp_path: Path) -> None:
    """The colour classes are ranked perfectly by the untrained network (validation MAP@R
    1.0): no trained epoch can beat it, so the run must not hand back a model."""
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--data", str(eight_classes), "--loss", "triplet", "--backbone", "tiny_cnn",
        "--dim", "8", "--image-size", "16", "--epochs", "2", "--batch-size", "8",
        "--device", TEST_DEVICE, "--no-progress", "--out", str(out),
    ])
    assert result.exit_code == NOT_LEARNED_EXIT, result.output + repr(result.exception)
    assert "did not learn" in result.output
    assert "error: the run did not learn: no trained epoch beat the untrained network" in (
        result.output)
    assert not (out / "model.pt").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["learned"] is False and learned(metrics) is False
    assert metrics["status"] == "finished" and metrics["best"]["epoch"] == 0
    assert metrics["test"] is None and metrics["model_version"] is None
    assert set(metrics["baselines"]) == {"raw_pixels", "untrained"}  # still measured
    assert all("geometry" in row for row in metrics["epochs"])

    # Resuming the finished run reports the same failure.
    again = CliRunner().invoke(app, [
        "train", "--data", str(eight_classes), "--loss", "triplet", "--backbone", "tiny_cnn",
        "--dim", "8", "--image-size", "16", "--epochs", "2", "--batch-size", "8",
        "--device", TEST_DEVICE, "--no-progress", "--out", str(out), "--resume",
    ])
    assert again.exit_code == NOT_LEARNED_EXIT


def test_records_from_before_the_flag_read_learning_from_the_best_epoch() -> None:
    assert learned({"best": {"epoch": 0}}) is False
    assert learned({"best": {"epoch": 3}}) is True
    assert learned({"best": {"epoch": 3}, "learned": False}) is False


def test_benchmark_rows_of_runs_that_did_not_learn_report_no_numbers(
    tiny_config: TrainConfig, tmp_path: Path
) -> None:
    base = dataclasses.replace(tiny_config, epochs=1)
    results = run_benchmark(base, parse_losses("triplet"), [0], tmp_path, progress=False)
    row = results["rows"][0]
    assert row["name"] == "triplet" and row["metrics"] is None
    assert row["did_not_learn"] == {"runs": 1, "of": 1}
    assert "did not learn (1 of 1 runs)" in (tmp_path / "results.md").read_text()
    # The baselines are still measured and reported.
    assert results["rows"][1]["name"] == "untrained network"
    assert results["rows"][1]["metrics"]["map_at_r"]["mean"] == pytest.approx(1.0)


@pytest.fixture(scope="module")
def forty_glyphs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 stroke-drawn classes x 8 images at 16 px: 12 training classes."""
    from tests.support.images import write_glyph_folder

    return write_glyph_folder(tmp_path_factory.mktemp("glyphs40"), classes=40, per_class=8,
                              size=16)


def test_proxy_anchor_collapses_under_the_shared_recipe(
    forty_glyphs: Path, tmp_path: Path
) -> None:
    """m-per-class batches, proxies at 100x the trunk's rate, a bare linear head on
    non-negative features: the validation embeddings crowd into one direction and the
    detector stops the run; multi-similarity, on the same batches, spreads them."""
    config = TrainConfig(
        data=str(forty_glyphs), backbone="small_cnn", dim=16, image_size=16, epochs=3,
        batch_size=32, lr=1e-3, augmentation="none", device=TEST_DEVICE, recipe="shared",
        loss=LossConfig("proxy_anchor"),
    )
    train(config, tmp_path / "proxy_anchor", progress=False, test=False)
    record = json.loads((tmp_path / "proxy_anchor" / "metrics.json").read_text())
    assert record["collapse"] is not None, [r["geometry"] for r in record["epochs"]]
    assert record["collapse"]["mean_cosine"] > COLLAPSE_MEAN_COSINE
    assert record["epochs"][0]["geometry"]["mean_cosine"] < COLLAPSE_MEAN_COSINE

    pairs = dataclasses.replace(config, loss=LossConfig("multi_similarity"))
    train(pairs, tmp_path / "multi_similarity", progress=False, test=False)
    record = json.loads((tmp_path / "multi_similarity" / "metrics.json").read_text())
    assert record["collapse"] is None
    assert record["epochs"][-1]["geometry"]["mean_cosine"] < 0.8
