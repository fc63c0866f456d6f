"""The Reality Check's protocol: class-disjoint folds, early stopping, the mean-over-folds
objective, fold models tested alone and concatenated, controls, the validation / test
correlation, and resumption."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import optuna
import pytest
import torch

import imgret.training.loop as loop
from imgret.checkpoint import EmbeddingNet
from imgret.metrics import retrieval_metrics
from imgret.training.benchmark import parse_losses, run_benchmark
from imgret.training.config import LossConfig, TrainConfig, TrainConfigError
from imgret.training.data import TrainDataset, make_split, model_spec_for, open_source
from imgret.training.loop import out_of_patience, train
from imgret.training.progress import Progress, format_eta
from imgret.training.scoring import Evaluator, embed_split
from imgret.training.tune import correlation, search_space, tune_loss, tuned_space
from tests.unit.training.test_data import _classes, _fake_fashion, _Labels

SPLITS = ("train", "val", "test")


def _folds(source, k: int, split_seed: int = 0) -> list:
    return [make_split(source, TrainConfig(data="x", cv_folds=k, fold=j, split_seed=split_seed))
            for j in range(k)]


@pytest.mark.parametrize(("classes", "k"), [(16, 4), (21, 4), (12, 2), (40, 4)])
def test_folds_are_class_disjoint_and_cover_the_first_half_exactly(classes: int, k: int) -> None:
    source = _Labels({f"c{i:02d}": 4 for i in range(classes)})
    splits = _folds(source, k)
    test = _classes(splits[0], source, "test")
    first_half = set(source.labels.tolist()) - test
    assert len(test) == round(classes / 2)
    vals = [_classes(s, source, "val") for s in splits]
    for split, val in zip(splits, vals, strict=True):
        train = _classes(split, source, "train")
        assert _classes(split, source, "test") == test  # one test split for every fold
        assert not (train & val) and not (train & test) and not (val & test)
        assert train | val == first_half  # a fold run trains on the other k - 1 folds
    assert set().union(*vals) == first_half  # every first-half class validates once
    assert sum(len(v) for v in vals) == len(first_half)  # ... and only once
    assert max(map(len, vals)) - min(map(len, vals)) <= 1
    # The test classes are the single-split protocol's, for the same split seed.
    single = make_split(source, TrainConfig(data="x"))
    assert _classes(single, source, "test") == test


def test_folds_are_deterministic_from_the_split_seed() -> None:
    source = _Labels({f"c{i:02d}": 4 for i in range(24)})
    again = _folds(source, 4)
    for a, b in zip(_folds(source, 4), again, strict=True):
        for name in SPLITS:
            np.testing.assert_array_equal(a.indices[name], b.indices[name])
    other = _folds(source, 4, split_seed=5)
    assert [_classes(s, source, "val") for s in other] != [
        _classes(s, source, "val") for s in again]
    # The training seed does not move the split.
    seeded = make_split(source, TrainConfig(data="x", cv_folds=4, fold=1, seed=9))
    np.testing.assert_array_equal(seeded.indices["val"], again[1].indices["val"])


def test_too_few_classes_for_the_folds_and_fashion_mnist_halves() -> None:
    with pytest.raises(TrainConfigError, match="at least 8 non-test classes"):
        _folds(_Labels({f"c{i:02d}": 4 for i in range(12)}), 4)
    with pytest.raises(TrainConfigError, match="names the fold"):
        make_split(_Labels({f"c{i:02d}": 4 for i in range(12)}),
                   TrainConfig(data="x", cv_folds=2))
    fashion = _fake_fashion()
    folds = [make_split(fashion, TrainConfig(data="fashion-mnist", cv_folds=2, fold=j))
             for j in range(2)]
    assert {len(_classes(s, fashion, "val")) for s in folds} == {2, 3}
    for split in folds:  # the fixed halves: classes 5-9 are the test
        assert _classes(split, fashion, "test") == {"Sandal", "Shirt", "Sneaker", "Bag",
                                                    "Ankle boot"}
    with pytest.raises(TrainConfigError, match="2 per fold"):
        make_split(fashion, TrainConfig(data="fashion-mnist", cv_folds=4, fold=0))


def test_cv_options_are_checked() -> None:
    with pytest.raises(TrainConfigError, match="cv_folds"):
        TrainConfig(data="x", cv_folds=1)
    with pytest.raises(TrainConfigError, match="fold 2 needs"):
        TrainConfig(data="x", cv_folds=2, fold=2)
    with pytest.raises(TrainConfigError, match="class-disjoint"):
        TrainConfig(data="x", cv_folds=4, protocol="closed-set")
    # Unset, the new fields are not saved: older runs resume and compare as before.
    saved = TrainConfig(data="x").to_dict()
    assert not {"cv_folds", "fold", "patience", "control"} & set(saved)
    assert TrainConfig(data="x", cv_folds=4, fold=3).to_dict()["fold"] == 3


@pytest.fixture(scope="module")
def glyphs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 glyph classes x 6 images, 16 px: 10 test classes, 2 folds of 5."""
    from tests.support.images import write_glyph_folder

    return write_glyph_folder(tmp_path_factory.mktemp("glyphs") / "g", classes=20,
                              per_class=6, size=16)


@pytest.fixture
def cv_config(glyphs: Path) -> TrainConfig:
    return TrainConfig(data=str(glyphs), backbone="tiny_cnn", dim=8, image_size=16, epochs=2,
                       batch_size=8, lr=1e-2, device="cpu", cv_folds=2,
                       loss=LossConfig("multi_similarity"), augmentation="none")


@pytest.mark.slow
def test_early_stopping_stops_after_patience_and_keeps_the_best(
    cv_config: TrainConfig, tmp_path: Path
) -> None:
    # A learning rate that only wrecks the network: validation never beats epoch 0.
    config = dataclasses.replace(cv_config, fold=0, epochs=4, patience=2, lr=5.0,
                                 warmup_epochs=0)
    result = train(config, tmp_path / "run", progress=False, test=False)
    record = json.loads((tmp_path / "run" / "metrics.json").read_text())
    best = record["best"]["epoch"]
    assert result.best_epoch == best
    assert record["early_stopped"] is True
    assert record["stopped_epoch"] == best + 2 < config.epochs
    assert [r["epoch"] for r in record["epochs"]][-1] == record["stopped_epoch"]
    # Without patience the same run trains every epoch.
    full = train(dataclasses.replace(config, patience=None), tmp_path / "full",
                 progress=False, test=False)
    record = json.loads((full.out / "metrics.json").read_text())
    assert record["stopped_epoch"] == config.epochs and record["early_stopped"] is False


def test_out_of_patience_reads_the_record() -> None:
    record = {"epochs": [{"epoch": e} for e in range(5)], "best": {"epoch": 2}}
    assert out_of_patience(record, 2) and not out_of_patience(record, 3)
    assert not out_of_patience(record, None)


def _study(tmp_path: Path, base: TrainConfig, trials: int = 1) -> list:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tmp_path.mkdir(parents=True, exist_ok=True)
    loss = base.loss
    return tune_loss(base, loss, tuned_space(loss, tune_lr=False), trials,
                     f"sqlite:///{tmp_path / 'study.db'}", tmp_path / "runs", seed=0,
                     progress=False)


@pytest.mark.slow
def test_the_objective_is_the_mean_over_folds_and_never_tests(
    cv_config: TrainConfig, tmp_path: Path
) -> None:
    (trial,) = _study(tmp_path, cv_config)
    records = [json.loads((tmp_path / "runs" / "trial0" / f"fold{j}" / "metrics.json")
                          .read_text()) for j in range(2)]
    fold_best = [r["best"]["val"]["map_at_r"] for r in records]
    assert trial.value == pytest.approx(sum(fold_best) / 2)
    assert trial.user_attrs["fold_val"] == pytest.approx(fold_best)
    assert all(r["test"] is None and r["baselines"] is None for r in records)
    assert records[0]["split"]["digest"] != records[1]["split"]["digest"]  # other folds
    assert [r["config"]["fold"] for r in records] == [0, 1]


def test_the_protocol_tunes_no_learning_rate_unless_asked() -> None:
    loss = LossConfig("proxy_anchor")
    assert "lr" not in tuned_space(loss, tune_lr=False)
    assert tuned_space(loss, tune_lr=True) == search_space(loss)
    assert "param_lr_mult" in tuned_space(loss, tune_lr=False)  # the proxies' rate is tuned


def test_concatenated_evaluation_equals_a_hand_computation(
    cv_config: TrainConfig, tmp_path: Path
) -> None:
    config = dataclasses.replace(cv_config, fold=0)
    source = open_source(config.data)
    split = make_split(source, config)
    spec = model_spec_for(config, source)
    models = []
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        models.append(EmbeddingNet(spec))
    evaluator = Evaluator(config, source, split, "cpu")
    scored = evaluator.test_models(models)

    embedded = [embed_split(m, source, split.indices["test"]) for m in models]
    parts = [e.embeddings / np.linalg.norm(e.embeddings, axis=1, keepdims=True)
             for e in embedded]
    joined = np.hstack(parts)  # no rescaling: the ranking is the same
    labels = embedded[0].labels.astype(str)
    hand = retrieval_metrics(joined, labels, joined, labels, k=(1, 5, 10),
                             query_in_gallery=True)
    for metric in ("map_at_r", "r_precision", "precision_at_1"):
        assert scored["concatenated"][metric] == pytest.approx(hand[metric], abs=1e-6)
    for model, alone in zip(models, scored["separate"], strict=True):
        assert alone["map_at_r"] == pytest.approx(evaluator.test(model)["map_at_r"])
    assert len(scored["separate"]) == 3


def test_shuffled_labels_keep_class_sizes_and_move_labels(cv_config: TrainConfig) -> None:
    config = dataclasses.replace(cv_config, fold=0)
    source = open_source(config.data)
    split = make_split(source, config)
    dataset = TrainDataset(source, split.indices["train"], lambda image: image)
    before = dataset.targets.copy()
    dataset.shuffle_labels(np.random.default_rng(0))
    assert np.array_equal(np.bincount(before), np.bincount(dataset.targets))
    assert (before != dataset.targets).mean() > 0.5


def test_correlation_is_scipy_spearman_over_the_trial_records() -> None:
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    records = [{"loss": loss, "trial": t, "val": float(v), "test": float(v + rng.normal(0, .1)),
                "test_alone": float(rng.random())}
               for loss in ("a", "b") for t, v in enumerate(rng.random(5))]
    result = correlation(records)
    expected = spearmanr([r["val"] for r in records], [r["test"] for r in records])
    assert result["all"]["test"]["rho"] == pytest.approx(expected.statistic)
    assert result["all"]["test"]["p"] == pytest.approx(expected.pvalue)
    assert result["all"]["test"]["n"] == 10
    only_a = [r for r in records if r["loss"] == "a"]
    assert result["per_loss"]["a"]["test_alone"]["rho"] == pytest.approx(
        spearmanr([r["val"] for r in only_a], [r["test_alone"] for r in only_a]).statistic)
    assert correlation(records[:2])["all"]["test"]["rho"] is None  # too few trials


def test_progress_eta_counts_only_timed_work() -> None:
    progress = Progress({"trial": 10, "final": 4})
    progress.skip("trial", 6)  # finished by an earlier process: no time measured
    assert progress.remaining_s() is None
    progress.timings["trial"] = [10.0, 30.0]
    progress.done["trial"] = 8
    # 2 trials left at 20 s, 4 final runs at 1.3 x 20 s.
    assert progress.remaining_s() == pytest.approx(2 * 20 + 4 * 26)
    assert "8/14 done; ETA 2 min" in progress.describe()
    assert format_eta(3725) == "1 h 02 min" and format_eta(42) == "42 s"


class _Crash(Exception):
    """Stands for a killed process."""


@pytest.mark.slow
def test_an_interrupted_trial_resumes_to_the_same_value(
    cv_config: TrainConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (unbroken,) = _study(tmp_path / "a", cv_config)
    # The same study, killed inside the trial's second fold, after its first epoch.
    real_save = loop._save_state
    seen = []

    def save_then_crash(out, *args, epoch: int):
        real_save(out, *args, epoch=epoch)
        seen.append(out.name)
        if out.name == "fold1" and epoch == 1:
            raise _Crash

    monkeypatch.setattr(loop, "_save_state", save_then_crash)
    with pytest.raises(_Crash):
        _study(tmp_path / "b", cv_config)
    monkeypatch.setattr(loop, "_save_state", real_save)
    trained = []
    real_train = loop.train

    def counting_train(config, out, **kwargs):
        trained.append(Path(out).name)
        return real_train(config, out, **kwargs)

    monkeypatch.setattr("imgret.training.tune.train", counting_train)
    (resumed,) = _study(tmp_path / "b", cv_config)
    assert resumed.number == 1  # the interrupted trial 0 was proposed again ...
    assert resumed.user_attrs["run"] == "trial0"  # ... in its own directory
    assert trained == ["fold0", "fold1"]  # fold 0 finished: train() returns it untouched
    assert resumed.value == pytest.approx(unbroken.value)
    assert resumed.user_attrs["fold_val"] == pytest.approx(unbroken.user_attrs["fold_val"])


@pytest.mark.slow
@pytest.mark.usefixtures("untrained_scores_zero")
def test_cv_benchmark_with_controls_reports_both_evaluations(
    cv_config: TrainConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = dataclasses.replace(cv_config, epochs=1, patience=1)
    results = run_benchmark(base, parse_losses("multi_similarity"), [1], tmp_path,
                            controls=["shuffled_labels", "oracle"])
    rows = {row["name"]: row for row in results["rows"]}
    assert list(rows) == ["multi_similarity", "shuffled_labels", "oracle",
                          "untrained network", "raw pixels"]
    run = tmp_path / "runs" / "multi_similarity" / "seed1"
    saved = json.loads((run / "test.json").read_text())
    folds = [json.loads((run / f"fold{j}" / "metrics.json").read_text()) for j in range(2)]
    # Alone: each fold model's own test; concatenated: the run's test.json.
    assert rows["multi_similarity"]["separate"]["map_at_r"]["values"][0] == pytest.approx(
        sum(f["test"]["map_at_r"] for f in folds) / 2)
    assert saved["separate_mean"]["map_at_r"] == pytest.approx(
        sum(f["test"]["map_at_r"] for f in folds) / 2)
    assert rows["multi_similarity"]["metrics"]["map_at_r"]["values"][0] == pytest.approx(
        saved["concatenated"]["map_at_r"])
    assert saved["dim"] == 2 * base.dim
    assert results["cross_validation"]["concatenated_dim"] == 2 * base.dim
    # The controls: shuffled labels over folds like a loss; the oracle trained on test classes.
    assert rows["shuffled_labels"]["kind"] == "control" and "separate" in rows["shuffled_labels"]
    oracle = json.loads((tmp_path / "runs" / "oracle" / "seed1" / "split.json").read_text())
    assert set(oracle["splits"]["train"]["classes"]) == set(
        folds[0]["split"]["splits"]["test"]["classes"])
    assert "baselines_on_its_test" in rows["oracle"]
    paired = {p["a"] for p in results["verdicts"]["map_at_r"]["pairs"]} | {
        p["b"] for p in results["verdicts"]["map_at_r"]["pairs"]}
    assert "shuffled_labels" in paired and "oracle" not in paired  # other test images
    markdown = (tmp_path / "results.md").read_text()
    assert "2-fold cross-validation" in markdown and f"MAP@R ({2 * base.dim}-d)" in markdown
    assert "shuffled_labels (control, multi_similarity)" in markdown
    assert set(results["convergence"]) == {"multi_similarity", "shuffled_labels", "oracle"}

    # A second call trains nothing and tests nothing again.
    monkeypatch.setattr(loop.EmbeddingNet, "__init__", _fail)
    again = run_benchmark(base, parse_losses("multi_similarity"), [1], tmp_path,
                          controls=["shuffled_labels", "oracle"])
    assert again["rows"][0]["metrics"] == results["rows"][0]["metrics"]


def _fail(*args, **kwargs):
    raise AssertionError("a finished run was trained or tested again")
