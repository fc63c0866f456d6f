"""Training on the real Fashion-MNIST files (Debian's dataset-fashion-mnist), when installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from imgret.datasets import FASHION_MNIST_CLASSES, FASHION_MNIST_DIR
from tests.conftest import require


@pytest.fixture(autouse=True)
def _fashion_mnist() -> None:
    require(any(FASHION_MNIST_DIR.glob("t10k-images-idx3-ubyte*")),
            f"Fashion-MNIST in {FASHION_MNIST_DIR} (apt-get install dataset-fashion-mnist)")


def test_fashion_mnist_split_is_the_documented_one() -> None:
    from imgret.training.config import TrainConfig
    from imgret.training.data import make_split, open_source
    from imgret.training.data.splits import FASHION_SPLIT

    source = open_source("fashion-mnist")
    split = make_split(source, TrainConfig(data="fashion-mnist"))
    summary = split.summary(source)
    for name, ids in FASHION_SPLIT.items():
        assert summary["splits"][name]["classes"] == sorted(FASHION_MNIST_CLASSES[i] for i in ids)
        assert summary["splits"][name]["num_images"] == 7000 * len(ids)


@pytest.mark.slow
def test_train_on_fashion_mnist_reports_model_and_baselines(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from imgret.cli.main import app

    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--data", "fashion-mnist", "--loss", "multi_similarity", "--backbone",
        "tiny_cnn", "--dim", "16", "--epochs", "1", "--max-train-images", "600",
        "--max-eval-images", "200", "--device", "cpu", "--no-progress", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output + repr(result.exception)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["split"]["splits"]["test"]["classes"] == [
        "Ankle boot", "Bag", "Sandal", "Shirt", "Sneaker"]
    assert metrics["model"]["grayscale"] is True
    for block in (metrics["test"], metrics["baselines"]["raw_pixels"],
                  metrics["baselines"]["untrained"]):
        assert 0 < block["map_at_r"] <= 1
    # Training must beat the same network untrained on the unseen test classes.
    assert metrics["test"]["map_at_r"] > metrics["baselines"]["untrained"]["map_at_r"]
