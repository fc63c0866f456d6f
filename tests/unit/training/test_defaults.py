"""The input side of a run that does not set one: measured on its training images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import imgret.training.loop as loop
from imgret.training.config import LossConfig, TrainConfig
from imgret.training.data import open_source
from imgret.training.defaults import auto_image_size
from imgret.training.run_dir import METRICS_FILE

DEFAULT_BACKBONE = "mobilenet_v2"


def _folder(root: Path, size: tuple[int, int], classes: int = 4, per_class: int = 3) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i}.png")
    return root



# ---------------------------------------------------------------------------- image size


def test_the_side_is_the_median_rounded_and_clamped() -> None:
    assert auto_image_size([(28, 28)] * 5, DEFAULT_BACKBONE) == 32  # Fashion-MNIST
    assert auto_image_size([(64, 48), (60, 70), (80, 80)], DEFAULT_BACKBONE) == 64
    assert auto_image_size([(640, 480)] * 3, DEFAULT_BACKBONE) == 128  # photos: the CPU cap
    assert auto_image_size([(640, 480)] * 3, "small_cnn") == 64  # its head grows with S^2
    assert auto_image_size([(10, 10), (100, 100), (1000, 1000)], DEFAULT_BACKBONE) == 96
    assert auto_image_size([], DEFAULT_BACKBONE) == 32


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
