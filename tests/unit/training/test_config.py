"""TrainConfig: pydantic field checks raise TrainConfigError; the saved dict keeps its keys."""

from __future__ import annotations

import dataclasses
import json

import pytest

from imgret.errors import ImgretError
from imgret.training.config import (
    LossConfig,
    TrainConfig,
    TrainConfigError,
    base_config,
    config_diff,
)

# The keys of the config dict in metrics.json, model.pt and benchmark.json, in their order.
SAVED_KEYS = [
    "data", "protocol", "split_seed", "val_fraction", "test_fraction", "backbone", "dim",
    "image_size", "backbone_weights", "epochs", "time_budget_s", "max_train_images",
    "max_eval_images", "batch_size", "m_per_class", "lr", "weight_decay", "warmup_epochs",
    "augmentation", "seed", "device", "num_workers", "recipe", "loss",
]


@pytest.mark.parametrize(
    ("change", "field"),
    [({"protocol": "open-set"}, "protocol"), ({"augmentation": "heavy"}, "augmentation"),
     ({"device": "gpu"}, "device"), ({"val_fraction": 0.0}, "val_fraction"),
     ({"test_fraction": 1.0}, "test_fraction"), ({"dim": 0}, "dim"),
     ({"image_size": 4}, "image_size"), ({"epochs": 0}, "epochs"),
     # Past the checkpoint's spec bounds: refused here, before a model is built.
     ({"dim": 8192}, "dim"), ({"image_size": 1024}, "image_size"),
     ({"batch_size": 1}, "batch_size"), ({"m_per_class": 1}, "m_per_class"),
     ({"lr": 0.0}, "lr"), ({"weight_decay": -1e-4}, "weight_decay"),
     ({"warmup_epochs": -1}, "warmup_epochs"), ({"time_budget_s": 0}, "time_budget_s"),
     ({"max_train_images": 1}, "max_train_images"), ({"max_eval_images": 3}, "max_eval_images"),
     ({"num_workers": -1}, "num_workers"), ({"dim": "wide"}, "dim"),
     ({"loss": {"name": "triplet", "margin": 0.1}}, "loss.margin"),
     ({"learning_rate": 0.1}, "learning_rate")],
)
def test_a_bad_value_names_its_field(change: dict, field: str) -> None:
    with pytest.raises(TrainConfigError, match=rf"^bad TrainConfig: {field}: .*\(got "):
        TrainConfig(**change)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"val_fraction": 0.5, "test_fraction": 0.5}, "val_fraction \\+ test_fraction"),
     ({"batch_size": 64, "m_per_class": 5}, "m_per_class must divide batch_size")],
)
def test_fields_that_must_agree(change: dict, message: str) -> None:
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig(**change)


def test_config_errors_are_imgret_errors_and_value_errors() -> None:
    assert issubclass(TrainConfigError, ImgretError) and issubclass(TrainConfigError, ValueError)
    with pytest.raises(TrainConfigError, match="bad LossConfig: miner"):
        LossConfig(name="triplet", miner=3)


def test_replace_checks_the_new_values() -> None:
    config = TrainConfig(data="d", batch_size=64)
    assert dataclasses.replace(config, m_per_class=8).m_per_class == 8
    with pytest.raises(TrainConfigError, match="m_per_class must divide"):
        dataclasses.replace(config, m_per_class=6)


def test_saved_dict_keeps_its_keys_and_rebuilds_the_config() -> None:
    config = TrainConfig(data="d", dim=32, loss=LossConfig("triplet", "hard", {"margin": 0.1}))
    saved = json.loads(json.dumps(config.to_dict()))
    assert list(saved) == SAVED_KEYS
    assert saved["loss"] == {"name": "triplet", "miner": "hard", "options": {"margin": 0.1}}
    assert TrainConfig(**saved) == config  # the nested loss dict becomes a LossConfig again
    assert "loss" not in base_config(config) and "seed" not in base_config(config)


def test_a_config_saved_before_the_recipes_is_the_shared_recipe() -> None:
    """Runs made before the recipes saved no "recipe": the shared recipe is the one value
    left unsaved, so such a run resumes only with --recipe shared, and a new default run
    differs from it by name."""
    shared = TrainConfig(data="d", recipe="shared").to_dict()
    assert "recipe" not in shared
    new = TrainConfig(data="d").to_dict()
    assert new["recipe"] == "family"
    assert config_diff(shared, new) == {"recipe": (None, "family")}


def test_every_option_field_has_help_text_or_is_self_explaining() -> None:
    fields = TrainConfig.__pydantic_fields__
    undocumented = sorted(n for n, f in fields.items() if not f.description)
    assert undocumented == ["batch_size", "epochs", "loss", "weight_decay"]
