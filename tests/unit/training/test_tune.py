"""Equal-budget tuning: every declared search space builds its loss, budgets are valid base
configs, explicit options override a budget, and the tuning block renders."""

from __future__ import annotations

import dataclasses
from typing import Any

import optuna
import pytest
import torch

from imgret.training.config import DEFAULT_LOSSES, LossConfig, TrainConfig
from imgret.training.registry import LOSSES, LR, PARAM_LR_MULT, build_loss
from imgret.training.report_output import tuning_markdown
from imgret.training.tune import (
    BUDGETS,
    apply_params,
    default_params,
    describe_space,
    search_space,
    tuned_space,
)

CLASSES, DIM = 4, 8


def _points(space: dict) -> list[dict[str, float]]:
    """The corners of the space and a few random points of it (Optuna's own sampling)."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    random = []
    for _ in range(4):
        trial = study.ask()
        random.append({k: trial.suggest_float(k, p.low, p.high, log=p.log)
                       for k, p in space.items()})
    return [{k: p.low for k, p in space.items()}, {k: p.high for k, p in space.items()},
            *random]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_search_space_samples_losses_that_build_and_step(name: str) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    loss = LossConfig(name)
    space = search_space(loss)
    assert LR in space
    assert (PARAM_LR_MULT in space) == LOSSES[name].has_params
    for params in _points(space):
        block = apply_params(loss, space, params)
        config = TrainConfig(data="d", loss=block)  # pydantic checks the tuned fields
        assert config.network_lr == params[LR]
        bundle = build_loss(name, num_classes=CLASSES, embedding_size=DIM, miner=block.miner,
                            options=block.options, miner_options=block.miner_options,
                            param_lr_mult=block.param_lr_mult)
        embeddings = torch.nn.functional.normalize(torch.randn(16, DIM, requires_grad=True))
        labels = torch.arange(CLASSES).repeat_interleave(4)
        value = bundle(embeddings, labels)
        assert torch.isfinite(value), (name, params)
        if PARAM_LR_MULT in params:
            assert bundle.param_lr_mult == params[PARAM_LR_MULT]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_documented_defaults_lie_inside_the_space(name: str) -> None:
    loss = LossConfig(name)
    space = search_space(loss)
    defaults = default_params(loss, space, base_lr=1e-3)
    for key, param in space.items():
        assert param.low <= defaults[key] <= param.high
    block = apply_params(loss, space, defaults)
    # Nothing clipped away; cross_entropy's scale is the recipe's (by class count), not tuned.
    tuned = {k: v for k, v in LOSSES[name].defaults.items() if k in space}
    assert block.options == tuned
    assert set(LOSSES[name].defaults) - set(tuned) <= {"scale"}


@pytest.mark.parametrize("name", ["arcface", "cosface"])
def test_the_family_recipe_tunes_no_scale_it_sets_from_the_class_count(name: str) -> None:
    loss = LossConfig(name)
    assert "scale" in tuned_space(loss, tune_lr=False, recipe="shared")
    family = tuned_space(loss, tune_lr=False, recipe="family")
    assert "scale" not in family and "margin" in family
    # Trial 0 under the family recipe leaves the scale to AdaCos, not the registry's 64.
    block = apply_params(loss, family, default_params(loss, family, 1e-3, "family"))
    assert "scale" not in block.options
    # A scale the loss block sets by hand is the user's: tuning searches it as before.
    assert "scale" in tuned_space(LossConfig(name, options={"scale": 30.0}), tune_lr=False,
                                  recipe="family")


def test_the_semihard_miner_margin_follows_the_triplet_margin() -> None:
    loss = LossConfig("triplet")
    space = search_space(loss)
    block = apply_params(loss, space, {LR: 1e-3, "margin": 0.05})
    assert block.options == {"margin": 0.05} and block.miner_options == {"margin": 0.05}
    bundle = build_loss("triplet", num_classes=CLASSES, embedding_size=DIM,
                        options=block.options, miner_options=block.miner_options)
    assert bundle.miner.margin == 0.05


def test_a_loss_run_without_its_miner_tunes_no_miner_setting() -> None:
    assert "miner.epsilon" in search_space(LossConfig("multi_similarity"))
    assert "miner.epsilon" not in search_space(LossConfig("multi_similarity", miner="none"))
    assert search_space(LossConfig("triplet", miner="none"))["margin"].also == ()


def test_default_losses_are_at_least_eight_registry_losses() -> None:
    assert len(DEFAULT_LOSSES) >= 8 and set(DEFAULT_LOSSES) <= set(LOSSES)


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_every_budget_is_a_valid_base_config(name: str) -> None:
    budget = BUDGETS[name]
    TrainConfig(data="fashion-mnist", **budget.options)
    assert budget.trials >= 2 and budget.seeds >= 5 and budget.note


def test_tuning_fields_are_saved_only_when_set() -> None:
    plain = TrainConfig(data="d", loss=LossConfig("arcface"))
    assert plain.to_dict()["loss"] == {"name": "arcface", "miner": None, "options": {}}
    tuned = dataclasses.replace(plain, loss=LossConfig("arcface", lr=3e-3, param_lr_mult=10.0))
    assert TrainConfig(**tuned.to_dict()) == tuned
    assert tuned.network_lr == 3e-3 and plain.network_lr == plain.lr


def test_tuning_markdown_names_the_budget_spaces_and_best() -> None:
    loss = LossConfig("proxy_anchor")
    space = describe_space(search_space(loss))
    tuning = {
        "trials": 8, "startup_trials": 2, "sampler": "TPE", "pruning": "none",
        "objective": "validation MAP@R", "spaces": {"proxy_anchor": space},
        "per_trial": {"epochs": 2, "time_budget_s": None},
        "best": {"proxy_anchor": {"trial": 3, "val_map_at_r": 0.61,
                                  "params": {"lr": 2e-3, "margin": 0.12}}},
        "diverged": {"proxy_anchor": 1},
    }
    text = "\n".join(tuning_markdown(tuning))
    assert "**8 trials** of 2 epochs" in text
    assert "param_lr_mult ∈ [1, 1000] log" in text
    assert "lr=0.002, margin=0.12 (0.610, #3) | 1 |" in text


def test_tune_command_takes_a_budget_and_explicit_options_win(monkeypatch) -> None:
    from typer.testing import CliRunner

    import imgret.training.tune
    from imgret.cli.main import app

    seen: dict[str, Any] = {}

    def fake(base, losses, trials, seeds, out, **kwargs):  # noqa: ANN001, ANN202
        seen.update(base=base, losses=losses, trials=trials, seeds=seeds)
        raise SystemExit(0)

    monkeypatch.setattr(imgret.training.tune, "run_tuned_benchmark", fake)
    result = CliRunner().invoke(app, ["tune", "--data", "fashion-mnist", "--out", "x",
                                      "--budget", "quick", "--epochs", "7"])
    assert result.exit_code == 0, result.output
    quick = BUDGETS["quick"]
    assert seen["base"].epochs == 7  # explicit
    assert seen["base"].backbone == quick.options["backbone"]  # from the budget
    assert seen["base"].max_train_images == quick.options["max_train_images"]
    assert seen["trials"] == quick.trials and seen["seeds"] == list(range(quick.seeds))
    assert [loss.name for loss in seen["losses"]] == list(DEFAULT_LOSSES)
