"""`imgret tune` under the Reality Check's protocol (cross-validation) on tiny generated
glyphs: one learning rate for every loss, trials tested only after tuning for the Spearman
correlation, both evaluations in the report, and the per-loss learning rate as a separate
ablation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from imgret.training.config import TrainConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    from tests.support.images import write_glyph_folder

    data = write_glyph_folder(tmp_path_factory.mktemp("glyphs") / "g", classes=20,
                              per_class=6, size=16)
    return TrainConfig(data=str(data), backbone="tiny_cnn", dim=8, image_size=16, epochs=1,
                       batch_size=8, lr=1e-2, device="cpu", cv_folds=2, patience=2,
                       augmentation="none")


@pytest.fixture(scope="module")
def tuned(base: TrainConfig, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """1 loss x 3 trials x 2 folds, then 1 run of 2 folds."""
    from imgret.training.benchmark import parse_losses
    from imgret.training.tune import run_tuned_benchmark

    out = tmp_path_factory.mktemp("bench")
    results = run_tuned_benchmark(base, parse_losses("proxy_anchor"), 3, [0], out,
                                  progress=False)
    return out, results


def test_one_learning_rate_and_the_mean_over_folds(base: TrainConfig, tuned) -> None:
    out, results = tuned
    tuning = results["tuning"]
    assert tuning["lr_tuned"] is False and "lr" not in tuning["spaces"]["proxy_anchor"]
    assert "mean over the 2 folds" in tuning["objective"]
    cell = json.loads((out / "runs" / "proxy_anchor" / "seed0" / "fold1" / "metrics.json")
                      .read_text())
    assert "lr" not in cell["config"]["loss"] and cell["config"]["lr"] == base.lr
    assert results["cross_validation"]["folds"] == 2


def test_trials_are_tested_after_tuning_for_the_correlation(tuned) -> None:
    from scipy.stats import spearmanr

    from imgret.training.run_dir import learned

    out, results = tuned
    records = json.loads((out / "tune" / "trials.json").read_text())
    # A trial with a fold run that did not learn has no model to test: it is left out.
    trials = sorted((out / "tune" / "proxy_anchor").glob("trial*"))
    assert len(trials) == 3
    with_models = [t for t in trials if all(
        learned(json.loads((t / f"fold{fold}" / "metrics.json").read_text())) for fold in (0, 1))]
    assert sorted(f"trial{r['trial']}" for r in records) == [t.name for t in with_models]
    for record in records:  # each trial's fold runs never saw the test while tuning
        for fold in (0, 1):
            run = json.loads((out / "tune" / "proxy_anchor" / f"trial{record['trial']}" /
                              f"fold{fold}" / "metrics.json").read_text())
            assert run["test"] is None
        saved = json.loads((out / "tune" / "proxy_anchor" / f"trial{record['trial']}" /
                            "test.json").read_text())
        assert record["test"] == saved["concatenated"]["map_at_r"]
    stat = results["tuning"]["correlation"]["all"]["test"]
    values = ([r["val"] for r in records], [r["test"] for r in records])
    if stat["rho"] is None:  # too few trials or constant values: no rank correlation
        assert len(records) < 3 or len(set(values[0])) < 2 or len(set(values[1])) < 2
    else:
        assert stat["rho"] == pytest.approx(spearmanr(*values).statistic)
    markdown = (out / "results.md").read_text()
    assert "Does validation predict test?" in markdown
    assert "one for every loss, the base config's `lr`" in markdown


def test_the_learning_rate_ablation_is_reported_on_its_own(base: TrainConfig, tuned) -> None:
    from imgret.training.benchmark import parse_losses
    from imgret.training.tune import run_tuned_benchmark

    out, main = tuned
    results = run_tuned_benchmark(base, parse_losses("proxy_anchor"), 1, [0], out,
                                  progress=False, tune_lr=True, trial_tests=False)
    assert results["tuning"]["lr_ablation"] is True
    assert "lr" in results["tuning"]["spaces"]["proxy_anchor"]
    markdown = (out / "lr-ablation" / "results.md").read_text()
    assert markdown.startswith("# Ablation: the trunk learning rate tuned per loss")
    # The protocol's own table is untouched.
    assert json.loads((out / "results.json").read_text())["tuning"]["lr_tuned"] is False


def test_the_reality_check_budget_sets_the_protocol(monkeypatch) -> None:
    from typer.testing import CliRunner

    import imgret.training.tune
    from imgret.cli.main import app
    from imgret.training.tune import BUDGETS

    seen: dict[str, Any] = {}

    def fake(base, losses, trials, seeds, out, **kwargs):  # noqa: ANN001, ANN202
        seen.update(base=base, trials=trials, seeds=seeds, **kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(imgret.training.tune, "run_tuned_benchmark", fake)
    result = CliRunner().invoke(app, ["tune", "--data", "glyphs", "--out", "x", "--budget",
                                      "reality-check", "--controls", "shuffled_labels,oracle"])
    assert result.exit_code == 0, result.output
    budget = BUDGETS["reality-check"]
    assert seen["base"].cv_folds == 4 and seen["base"].patience == budget.options["patience"]
    assert (seen["base"].batch_size, seen["base"].m_per_class) == (32, 4)
    assert seen["trials"] >= 20 and len(seen["seeds"]) == 10
    assert seen["tune_lr"] is None and seen["controls"] == ["shuffled_labels", "oracle"]
