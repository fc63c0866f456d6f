"""The per-family recipe: batches, BatchNorm neck, loss-parameter rate and scales by family;
checkpoints that record the neck."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from imgret.checkpoint import EmbeddingNet, ModelSpec, load_checkpoint, save_checkpoint
from imgret.training.config import LossConfig, TrainConfig
from imgret.training.data import RandomBatchSampler
from imgret.training.loop import train
from imgret.training.recipe import (
    adacos_scale,
    class_count_options,
    loss_param_lr,
    normface_scale,
    recipe_for,
)
from imgret.training.registry import SoftmaxClassifierLoss
from tests.conftest import TEST_DEVICE


def _config(loss: str, **changes) -> TrainConfig:
    return TrainConfig(data="d", loss=LossConfig(loss), **changes)


def test_each_family_gets_its_recipe() -> None:
    pair = recipe_for(_config("multi_similarity"))
    assert (pair.family, pair.sampler, pair.neck) == ("pair", "m_per_class", "none")
    proxy = recipe_for(_config("proxy_anchor"))
    assert (proxy.family, proxy.sampler, proxy.neck, proxy.head_warmup_epochs) == (
        "proxy", "random", "bn", 1)
    classifier = recipe_for(_config("arcface"))
    assert (classifier.family, classifier.sampler, classifier.neck) == (
        "classifier", "random", "bn")
    shared = recipe_for(_config("arcface", recipe="shared"))
    assert (shared.sampler, shared.neck, shared.head_warmup_epochs) == ("m_per_class", "none", 0)


def test_loss_parameters_learn_at_an_absolute_rate_unless_a_multiple_is_set() -> None:
    assert loss_param_lr(_config("proxy_anchor", lr=1e-3)) == 1e-2
    assert loss_param_lr(_config("proxy_anchor", lr=1e-4)) == 1e-2  # not tied to the trunk
    assert loss_param_lr(_config("proxy_anchor", lr=1e-3, recipe="shared")) == pytest.approx(0.1)
    tuned = TrainConfig(data="d", lr=1e-3, loss=LossConfig("arcface", param_lr_mult=3.0))
    assert loss_param_lr(tuned) == pytest.approx(3e-3)


def test_scales_follow_the_number_of_classes() -> None:
    assert adacos_scale(375) == pytest.approx(math.sqrt(2) * math.log(374))  # about 8.4
    assert normface_scale(375) == pytest.approx(374 / 375 * math.log(374 * 9))
    assert adacos_scale(3) == normface_scale(3) > 1  # AdaCos alone would give 0.98
    assert class_count_options(_config("arcface"), 375) == {"scale": adacos_scale(375)}
    assert class_count_options(_config("cross_entropy"), 375) == {"scale": normface_scale(375)}
    user = TrainConfig(data="d", loss=LossConfig("cosface", options={"scale": 30.0}))
    assert class_count_options(user, 375) == {"scale": 30.0}
    assert class_count_options(_config("arcface", recipe="shared"), 375) == {}

    # NormFace's classifier: logits are scale x cosines, whatever the weights' norms.
    loss = SoftmaxClassifierLoss(4, 8, scale=10.0)
    x, labels = torch.randn(6, 8), torch.zeros(6, dtype=torch.long)
    with torch.no_grad():
        before = float(loss(x, labels))
        loss.classifier.weight.mul_(100)
        assert float(loss(x, labels)) == pytest.approx(before, rel=1e-5)


def test_random_batches_are_seeded_and_cover_the_epoch() -> None:
    sampler = RandomBatchSampler(10, 4, seed=3)
    sampler.set_epoch(1)
    first = list(sampler)
    assert len(first) == 8 and len(set(first)) == 8
    assert list(sampler) == first
    sampler.set_epoch(2)
    assert list(sampler) != first


def test_a_checkpoint_records_the_neck_and_old_specs_load_unchanged(tmp_path: Path) -> None:
    old = ModelSpec(backbone="tiny_cnn", dim=8, image_size=16)
    assert "neck" not in old.to_dict()  # same spec dict, digest and version as before
    torch.manual_seed(0)
    model = EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=8, image_size=16, neck="bn"))
    model.train()
    model(torch.randn(5, 3, 16, 16))  # moves the BatchNorm's running statistics
    model.eval()
    version = save_checkpoint(tmp_path, model)
    loaded = load_checkpoint(tmp_path)
    assert loaded.spec.neck == "bn" and loaded.model_version == version
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(loaded.model(images), model(images), atol=1e-6)

    from imgret.onnx_export import onnx_bytes

    assert len(onnx_bytes(loaded.model, loaded.spec)) > 0  # eval-mode BatchNorm exports


@pytest.fixture(scope="module")
def forty_glyphs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.images import write_glyph_folder

    return write_glyph_folder(tmp_path_factory.mktemp("glyphs40"), classes=40, per_class=8,
                              size=16)


def test_the_recipe_is_recorded(forty_glyphs: Path, tmp_path: Path) -> None:
    config = TrainConfig(
        data=str(forty_glyphs), backbone="small_cnn", dim=16, image_size=16, epochs=1,
        batch_size=32, augmentation="none", device=TEST_DEVICE, loss=LossConfig("arcface"),
    )
    train(dataclasses.replace(config), tmp_path / "run", progress=False, test=False)
    record = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert record["recipe"]["neck"] == "bn" and record["model"]["neck"] == "bn"
    assert record["loss"]["options"]["scale"] == pytest.approx(adacos_scale(12))
    assert record["loss"]["param_lr"] == 1e-2
    assert record["config"]["recipe"] == "family"
