"""Plain `imgret train DATA`: the input side measured on the training images, no identity-
changing augmentation, the pretrained trunk or its warned fallback, explicit options winning,
old runs resuming with their own values; benchmark and tune keep TrainConfig's defaults."""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import imgret.training.loop as loop
from imgret.cli.main import app
from imgret.cli.train import benchmark_command, default_out, tune_command
from imgret.pretrained import IMAGENET, PACKAGED
from imgret.training.config import LossConfig, TrainConfig
from imgret.training.data import open_source, train_transform
from imgret.training.data.sources import model_spec_for
from imgret.training.defaults import (
    DEFAULT_BACKBONE,
    DEFAULT_EPOCHS,
    DEFAULT_TIME_BUDGET_S,
    FALLBACK_BACKBONE,
    auto_image_size,
    default_trunk,
)
from imgret.training.run_dir import METRICS_FILE

PACKAGE = PACKAGED[DEFAULT_BACKBONE]


def _folder(root: Path, size: tuple[int, int], classes: int = 4, per_class: int = 3) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i}.png")
    return root


def _set_package(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    """The weights' package found (a stand-in spec) or not, wherever this runs."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        (SimpleNamespace(name=name) if installed else None) if name == PACKAGE.module
        else find_spec(name, *args)))


class _Stop(Exception):
    """Raised by the stand-in training loop: carries the config the command built."""

    def __init__(self, config: TrainConfig, out: Path, resume: bool):
        super().__init__()
        self.config, self.out, self.resume = config, out, resume


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Runs `imgret train ARGS` up to the training loop; returns (config, out, resume)."""
    monkeypatch.chdir(tmp_path)

    def stop(config: TrainConfig, out: Path, *, resume: bool, progress: bool) -> None:
        raise _Stop(config, Path(out), resume)

    monkeypatch.setattr(loop, "train", stop)

    def run(*args: str) -> _Stop:
        result = CliRunner().invoke(app, ["train", *args])
        assert isinstance(result.exception, _Stop), result.output + repr(result.exception)
        return result.exception

    return run


# ---------------------------------------------------------------------------- image size


def test_the_side_is_the_median_rounded_and_clamped() -> None:
    assert auto_image_size([(28, 28)] * 5, DEFAULT_BACKBONE) == 32  # Fashion-MNIST
    assert auto_image_size([(64, 48), (60, 70), (80, 80)], DEFAULT_BACKBONE) == 64
    assert auto_image_size([(640, 480)] * 3, DEFAULT_BACKBONE) == 128  # photos: the CPU cap
    assert auto_image_size([(640, 480)] * 3, "small_cnn") == 64  # its head grows with S^2
    assert auto_image_size([(10, 10), (100, 100), (1000, 1000)], DEFAULT_BACKBONE) == 96
    assert auto_image_size([], DEFAULT_BACKBONE) == 32
    # From ImageNet weights, small images are upsampled; large ones keep the CPU cap.
    assert auto_image_size([(28, 28)] * 5, DEFAULT_BACKBONE, pretrained=True) == 96
    assert auto_image_size([(640, 480)] * 3, DEFAULT_BACKBONE, pretrained=True) == 128
    assert auto_image_size([(28, 28)] * 5, "small_cnn", pretrained=True) == 64


@pytest.mark.parametrize(("size", "side"), [((20, 24), 32), ((300, 200), 128), ((90, 100), 96)])
def test_the_side_of_a_folder_comes_from_its_training_images(
        tmp_path: Path, size: tuple[int, int], side: int) -> None:
    folder = _folder(tmp_path / "images", size)
    config = TrainConfig(data=str(folder), backbone=DEFAULT_BACKBONE, image_size=None)
    source = open_source(config.data)
    assert loop.measure_image_size(config, source, np.arange(6)) == side


def test_a_run_saves_the_measured_side_and_resumes_without_it(
        tiny_config: TrainConfig, tmp_path: Path) -> None:
    config = TrainConfig(**{**tiny_config.to_dict(), "image_size": None,
                            "loss": LossConfig("triplet"), "epochs": 1})
    result = loop.train(config, tmp_path / "run", progress=False)
    saved = json.loads((tmp_path / "run" / METRICS_FILE).read_text())["config"]
    assert saved["image_size"] == 32  # 16 px images, tiny_cnn's floor
    again = loop.train(config, tmp_path / "run", resume=True, progress=False)
    assert again.best_epoch == result.best_epoch


# ---------------------------------------------------------------------------- augmentation


def test_no_flip_and_no_crop_by_default(asked, eight_classes: Path) -> None:
    config = asked(str(eight_classes)).config
    assert config.augmentation == "none"
    spec = model_spec_for(TrainConfig(data=str(eight_classes), backbone="tiny_cnn",
                                      image_size=16), open_source(str(eight_classes)))
    image = Image.fromarray(np.tri(16, dtype=np.uint8) * 255).convert("RGB")
    plain = train_transform(spec, config.augmentation)
    torch.manual_seed(0)
    first = [plain(image) for _ in range(8)]
    assert all(torch.equal(first[0], other) for other in first)  # deterministic: no flips
    standard = train_transform(spec, "standard")
    names = {type(step).__name__ for step in standard.transforms}
    assert {"RandomHorizontalFlip", "RandomResizedCrop"} <= names


# ---------------------------------------------------------------------------- trunk


def test_the_default_trunk_is_the_pretrained_mobilenet(
        asked, eight_classes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _set_package(monkeypatch, installed=True)
    got = asked(str(eight_classes))
    config = got.config
    assert (config.backbone, config.backbone_weights) == (DEFAULT_BACKBONE, IMAGENET)
    assert config.image_size is None and config.augmentation == "none"
    assert (config.epochs, config.time_budget_s) == (DEFAULT_EPOCHS, DEFAULT_TIME_BUDGET_S)
    assert config.loss.name == "multi_similarity" and config.data == str(eight_classes)
    assert got.out == Path("runs") / eight_classes.name and not got.resume


def test_without_the_package_the_fallback_is_warned(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _set_package(monkeypatch, installed=False)
    with caplog.at_level(logging.WARNING, logger="imgret.training.defaults"):
        assert default_trunk() == (FALLBACK_BACKBONE, None)
    assert PACKAGE.distribution in caplog.text and "imgret[pretrained]" in caplog.text
    assert FALLBACK_BACKBONE in caplog.text


def test_the_cli_falls_back_without_the_package(
        asked, eight_classes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _set_package(monkeypatch, installed=False)
    config = asked(str(eight_classes)).config
    assert (config.backbone, config.backbone_weights) == (FALLBACK_BACKBONE, None)


def test_explicit_options_win(asked, eight_classes: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    _set_package(monkeypatch, installed=True)
    config = asked(
        "--data", str(eight_classes), "--backbone", "resnet18", "--image-size", "224",
        "--augmentation", "standard", "--epochs", "10", "--loss", "triplet",
        "--out", "elsewhere",
    ).config
    assert (config.backbone, config.backbone_weights, config.image_size) == ("resnet18", None,
                                                                             224)
    assert (config.augmentation, config.epochs, config.loss.name) == ("standard", 10, "triplet")
    # An explicit mobilenet_v2 is random init unless the weights are asked for.
    assert asked(str(eight_classes), "--backbone", DEFAULT_BACKBONE).config \
        .backbone_weights is None
    # Weights without a backbone are for the default trunk, installed or not.
    _set_package(monkeypatch, installed=False)
    weights = asked(str(eight_classes), "--backbone-weights", IMAGENET).config
    assert (weights.backbone, weights.backbone_weights) == (DEFAULT_BACKBONE, IMAGENET)


def test_data_as_argument_or_option_but_not_two(eight_classes: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train", str(eight_classes), "--data", str(tmp_path)])
    assert result.exit_code == 2 and "different data" in result.output
    result = CliRunner().invoke(app, ["train"])
    assert result.exit_code == 2 and "DATA" in result.output


# ---------------------------------------------------------------------------- resume


def test_an_old_run_resumes_with_its_own_values(asked, eight_classes: Path) -> None:
    # Made before these defaults: resnet18 at 224 px, standard augmentation, 10 epochs, and
    # before the recipes (no "recipe" key: the shared one).
    old = TrainConfig(data=str(eight_classes), backbone="resnet18", image_size=224,
                      recipe="shared", loss=LossConfig("triplet", options={"margin": 0.1}))
    out = Path("runs/old")
    out.mkdir(parents=True)
    (out / METRICS_FILE).write_text(json.dumps({
        "status": "running", "config": old.to_dict(),
        "requested_batch": {"batch_size": 64, "m_per_class": None}}))
    assert "recipe" not in old.to_dict()
    got = asked("--out", str(out), "--resume")
    assert got.config.to_dict() == old.to_dict() and got.resume
    # Given options still win (the loop then refuses a different config, naming it).
    assert asked("--out", str(out), "--resume", "--epochs", "4").config.epochs == 4


def test_default_run_directories_are_numbered(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_out("/data/My Photos/", resume=False) == Path("runs/My-Photos")
    assert default_out("glyphs:classes=254", resume=False) == Path("runs/glyphs-classes-254")
    for name in ("letters", "letters-2"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / METRICS_FILE).write_text("{}")
    assert default_out("/x/letters", resume=False) == Path("runs/letters-3")
    assert default_out("/x/letters", resume=True) == Path("runs/letters-2")
    assert default_out("/x/other", resume=True) == Path("runs/other")


# ---------------------------------------------------------------------------- help, others


def _help(*args: str) -> str:
    output = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"}).output
    return re.sub(r"[\s│]+", " ", output)


def test_train_help_shows_the_new_defaults() -> None:
    text = _help("train")
    assert "[DATA]" in text
    for shown in (f"--epochs <int> [default: {DEFAULT_EPOCHS}]", "[default: none]",
                  f"[default: {DEFAULT_TIME_BUDGET_S}]",
                  "[default: multi_similarity]", "default: mobilenet_v2 from its ImageNet",
                  f"or {FALLBACK_BACKBONE} from random init", "the median side",
                  "32-128 px"):
        assert shown in text, shown


def test_benchmark_and_tune_keep_the_config_defaults() -> None:
    for command in (benchmark_command, tune_command):
        parameters = inspect.signature(command).parameters
        assert parameters["backbone"].default == "resnet18"
        assert parameters["epochs"].default == 10
        assert parameters["augmentation"].default == "standard"
        assert parameters["backbone_weights"].default is None
        assert parameters["time_budget_s"].default is None
    assert "[default: resnet18]" in _help("benchmark")
