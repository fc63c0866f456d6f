"""`imgret tune` end to end on a tiny generated folder: equal trials and budget per loss, the
test split unseen by trials, the tuning block in the results, and resumption."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from imgret.training.config import TrainConfig
from imgret.training.report import BenchmarkMismatch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, Path, dict]:
    """2 losses x 2 trials, then 2 seeds each: about 15 s on a CPU."""
    from imgret.training.benchmark import parse_losses
    from imgret.training.tune import run_tuned_benchmark
    from tests.support.images import write_image_folder

    root = tmp_path_factory.mktemp("tune")
    data = write_image_folder(root / "images", classes=8, per_class=6, size=16)
    base = TrainConfig(data=str(data), backbone="tiny_cnn", dim=8, image_size=16, epochs=1,
                       batch_size=8, lr=1e-2, device="cpu")
    results = run_tuned_benchmark(base, parse_losses("triplet,proxy_anchor"), 2, [0, 1],
                                  root / "bench", progress=False)
    return base, root / "bench", results


def _studies(out: Path) -> dict[str, optuna.Study]:
    storage = f"sqlite:///{out / 'tune' / 'study.db'}"
    return {s.study_name: optuna.load_study(study_name=s.study_name, storage=storage)
            for s in optuna.get_all_study_summaries(storage)}


def test_every_loss_gets_the_same_trials_and_budget(tuned) -> None:
    base, out, results = tuned
    tuning = results["tuning"]
    assert tuning["trials"] == 2 and tuning["per_trial"]["epochs"] == base.epochs
    assert set(tuning["spaces"]) == set(tuning["best"]) == {"triplet", "proxy_anchor"}
    studies = _studies(out)
    for name, study in studies.items():
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert len(done) == 2, name
        for trial in done:  # a trial is judged on validation only: the test split stays unseen
            record = json.loads((out / "tune" / name / f"trial{trial.number}" /
                                 "metrics.json").read_text())
            assert record["test"] is None and record["baselines"] is None
            assert record["config"]["epochs"] == base.epochs
    assert json.loads((out / "results.json").read_text())["tuning"] == tuning
    # The retrained cells carry each loss's best configuration in its loss block.
    best = tuning["best"]["proxy_anchor"]["params"]
    cell = json.loads((out / "runs" / "proxy_anchor" / "seed1" / "metrics.json").read_text())
    assert cell["config"]["loss"]["lr"] == best["lr"]
    assert cell["config"]["lr"] == base.lr  # the shared base is untouched
    assert {r["name"] for r in results["rows"]} >= {"triplet", "proxy_anchor", "raw pixels"}


def test_a_second_run_trains_nothing_and_requeues_an_interrupted_trial(tuned, monkeypatch):
    import imgret.training.tune
    from imgret.training.benchmark import parse_losses

    base, out, results = tuned
    interrupted = _studies(out)["triplet"].ask()  # as if a process died inside a trial

    def no_training(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a finished trial was trained again")

    monkeypatch.setattr(imgret.training.tune, "train", no_training)
    again = imgret.training.tune.run_tuned_benchmark(base, parse_losses("triplet,proxy_anchor"), 2,
                                              [0, 1], out, progress=False)
    assert again["tuning"]["best"] == results["tuning"]["best"]
    trials = _studies(out)["triplet"].trials
    assert trials[interrupted.number].state == optuna.trial.TrialState.FAIL
    assert trials[-1].state == optuna.trial.TrialState.WAITING  # its parameters, proposed again


def test_a_study_of_another_base_config_is_refused(tuned) -> None:
    import dataclasses

    from imgret.training.benchmark import parse_losses
    from imgret.training.tune import run_tuned_benchmark

    base, out, _ = tuned
    with pytest.raises(BenchmarkMismatch, match="epochs: 1 vs 2"):
        run_tuned_benchmark(dataclasses.replace(base, epochs=2), parse_losses("triplet"), 2,
                            [0], out, progress=False)
