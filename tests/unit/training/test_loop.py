"""End to end: `imgret train` on generated images writes a complete run directory; --resume."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import imgret.training.loop as loop
from imgret.checkpoint import load_checkpoint
from imgret.cli.main import app
from imgret.training.config import LossConfig, TrainConfig, TrainConfigError
from imgret.training.loop import train
from imgret.training.run_dir import LAST_FILE
from tests.conftest import TEST_DEVICE

REPORTED = ("map_at_r", "r_precision", "precision_at_1")


@pytest.mark.usefixtures("untrained_scores_zero")
def test_train_cli_writes_the_run_directory(eight_classes: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--data", str(eight_classes), "--loss", "triplet", "--backbone", "tiny_cnn",
        "--dim", "8", "--image-size", "16", "--epochs", "2", "--batch-size", "8",
        "--device", TEST_DEVICE, "--no-progress", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "test MAP@R" in result.output and "class-disjoint split" in result.output
    for name in ("model.pt", "metrics.json", "curves.png", "split.json", LAST_FILE):
        assert (out / name).is_file(), name

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished"
    assert [row["epoch"] for row in metrics["epochs"]] == [0, 1, 2]
    for row in metrics["epochs"][1:]:
        assert row["train_loss"] is not None and row["train_time_s"] > 0
        assert 0 <= row["val"]["map_at_r"] <= 1 and "map_at_r" in row["val"]["ci95"]
    for block in (metrics["test"], *metrics["baselines"].values()):
        assert all(0 <= block[m] <= 1 for m in REPORTED)
        assert len(block["ci95"]["map_at_r"]) == 2
    assert set(metrics["baselines"]) == {"raw_pixels", "untrained"}
    assert metrics["config"]["loss"]["name"] == "triplet"
    assert metrics["loss"]["miner"] == "semihard"
    assert metrics["split"]["protocol"] == "class-disjoint"

    # model.pt rebuilds itself and carries config, split and metrics in `extra`.
    ckpt = load_checkpoint(out)
    assert ckpt.spec.backbone == "tiny_cnn" and ckpt.spec.dim == 8
    assert ckpt.extra["config"] == metrics["config"]
    assert ckpt.extra["test"]["map_at_r"] == metrics["test"]["map_at_r"]
    assert ckpt.extra["split"]["digest"] == metrics["split"]["digest"]
    assert ckpt.model_version == metrics["model_version"]

    # The same command with --resume finds the run finished and reports it again.
    again = CliRunner().invoke(app, [
        "train", "--data", str(eight_classes), "--loss", "triplet", "--backbone", "tiny_cnn",
        "--dim", "8", "--image-size", "16", "--epochs", "2", "--batch-size", "8",
        "--device", TEST_DEVICE, "--no-progress", "--out", str(out), "--resume",
    ])
    assert again.exit_code == 0, again.output + repr(again.exception)
    assert metrics["model_version"] in again.output

    split = json.loads((out / "split.json").read_text())
    classes = [set(split["splits"][s]["classes"]) for s in ("train", "val", "test")]
    assert not (classes[0] & classes[1]) and not (classes[0] & classes[2])


def test_existing_run_needs_resume(tiny_config: TrainConfig, tmp_path: Path) -> None:
    train(tiny_config, tmp_path / "run", progress=False)
    with pytest.raises(TrainConfigError, match="--resume"):
        train(tiny_config, tmp_path / "run", progress=False)


class _Crash(Exception):
    """Stands for a killed process."""


@pytest.mark.usefixtures("untrained_scores_zero")
def test_resume_continues_where_the_run_stopped(
    tiny_config: TrainConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = dataclasses.replace(tiny_config, epochs=3)
    full = train(config, tmp_path / "full", progress=False)

    # The same run, killed right after epoch 1's state is saved.
    real_save = loop._save_state

    def save_then_crash(*args, epoch: int):
        real_save(*args, epoch=epoch)
        if epoch >= 1:
            raise _Crash

    monkeypatch.setattr(loop, "_save_state", save_then_crash)
    with pytest.raises(_Crash):
        train(config, tmp_path / "partial", progress=False)
    monkeypatch.setattr(loop, "_save_state", real_save)
    assert not (tmp_path / "partial" / "metrics.json").read_text().count('"finished"')

    resumed = train(config, tmp_path / "partial", resume=True, progress=False)
    metrics = json.loads((tmp_path / "partial" / "metrics.json").read_text())
    reference = json.loads((tmp_path / "full" / "metrics.json").read_text())
    assert [row["epoch"] for row in metrics["epochs"]] == [0, 1, 2, 3]
    # Same batches, augmentation and optimiser state: the same numbers as the unbroken run.
    for a, b in zip(metrics["epochs"], reference["epochs"], strict=True):
        if a["epoch"] > 0:  # epoch 0 is the untrained network: no training loss
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
        assert a["val"]["map_at_r"] == pytest.approx(b["val"]["map_at_r"], rel=1e-4)
    assert resumed.model_version == full.model_version
    assert resumed.test["map_at_r"] == pytest.approx(full.test["map_at_r"])
    # Resuming a finished run does nothing and returns its result.
    again = train(config, tmp_path / "partial", resume=True, progress=False)
    assert again.model_version == resumed.model_version


def test_resume_with_different_config_is_refused(
    tiny_config: TrainConfig, tmp_path: Path
) -> None:
    train(tiny_config, tmp_path / "run", progress=False)
    other = dataclasses.replace(tiny_config, lr=0.5)
    with pytest.raises(TrainConfigError, match="lr"):
        train(other, tmp_path / "run", resume=True, progress=False)


@pytest.mark.usefixtures("untrained_scores_zero")
@pytest.mark.parametrize("loss", ["proxy_anchor", "cross_entropy"])
def test_losses_with_parameters_train_end_to_end(
    tiny_config: TrainConfig, tmp_path: Path, loss: str
) -> None:
    config = dataclasses.replace(tiny_config, epochs=1, loss=LossConfig(loss))
    result = train(config, tmp_path / loss, progress=False)
    state = torch.load(tmp_path / loss / LAST_FILE, weights_only=True)
    assert len(state["optimizers"]) == 2  # the loss's parameters have their own optimiser
    assert 0 <= result.test["map_at_r"] <= 1


@pytest.mark.usefixtures("untrained_scores_zero")
def test_closed_set_protocol_queries_against_the_training_images(
    tiny_config: TrainConfig, tmp_path: Path
) -> None:
    config = dataclasses.replace(tiny_config, epochs=1, protocol="closed-set")
    result = train(config, tmp_path / "closed", progress=False)
    assert result.split["protocol"] == "closed-set"
    splits = result.split["splits"]
    assert splits["test"]["classes"] == splits["train"]["classes"]
    assert result.test["num_queries"] == splits["test"]["num_images"]


def test_unknown_loss_is_refused_before_training(eight_classes: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, [
        "train", "--data", str(eight_classes), "--loss", "nope", "--out", str(tmp_path / "x"),
    ])
    assert result.exit_code != 0
    assert "valid:" in str(result.exception) and "arcface" in str(result.exception)
    assert not (tmp_path / "x").exists()
