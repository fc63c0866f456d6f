"""Fixtures of the training tests: a small generated ImageFolder and a tiny base config."""

from __future__ import annotations

from pathlib import Path

import pytest

from imgret.training.config import LossConfig, TrainConfig
from tests.conftest import TEST_DEVICE


@pytest.fixture(scope="session")
def eight_classes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 classes x 6 generated 16 px images: enough for a class-disjoint split (2 train / 2 val /
    4 test classes by default)."""
    from tests.support.images import write_image_folder

    return write_image_folder(tmp_path_factory.mktemp("data") / "images", classes=8,
                              per_class=6, size=16)


@pytest.fixture
def tiny_config(eight_classes: Path) -> TrainConfig:
    """A run that takes about a second on a CPU: tiny_cnn, 16 px, 2 epochs of 24 images (on
    ``IMGRET_TEST_DEVICE``: the CUDA path, bf16 autocast included, on a GPU machine)."""
    return TrainConfig(
        data=str(eight_classes), backbone="tiny_cnn", dim=8, image_size=16, epochs=2,
        batch_size=8, lr=1e-2, device=TEST_DEVICE, loss=LossConfig("triplet"),
    )

