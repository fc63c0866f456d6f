"""Equal-budget tuning, then the benchmark (Musgrave et al. 2020, "A Metric Learning Reality
Check"): every loss gets the same hyper-parameter search on *validation*, then its best
configuration is retrained with several seeds and tested once per seed.

``run_tuned_benchmark(base, losses, trials, seeds, out)``:

1. per loss, an Optuna study (TPE, seeded; SQLite storage ``out/tune/study.db``, so an
   interrupted study resumes) of ``trials`` trials over the loss's search space, declared in
   :mod:`imgret.training.registry` beside its defaults. Trial 0 is the documented defaults; the
   objective is the validation MAP@R of the trial's best epoch. A trial trains the shared base
   config with only the loss block replaced, never evaluates the test split
   (``train(..., test=False)``), and lives in ``out/tune/<loss>/trial<k>/``. Every loss gets
   the same number of finished trials and the same per-trial budget (the base's epochs /
   time budget); there is no pruning, so every trial runs its whole budget. A trial whose loss
   diverges (NaN) scores the best validation MAP@R it reached (at worst the untrained
   network's), so it still counts as one of the loss's trials.
2. the best loss blocks go to :func:`imgret.training.benchmark.run_benchmark` (cells
   ``out/runs/<loss>/seed<k>/``, resumable, one shared base config), whose results carry
   ``"tuning"``: the trial budget, the search spaces and each loss's best configuration
   (:func:`imgret.training.report_output.tuning_markdown` renders it).

Cross-validation (``base.cv_folds`` = k > 0, the Reality Check's protocol as
powerful-benchmarker runs it): a trial trains k fold models (``trial<n>/fold<j>/``, each
resumable) and its objective is the *mean* of their best validation MAP@R; the test split is
never touched while tuning. The network's learning rate is then the base's for every loss
(only loss, miner and loss-parameter rates are tuned); ``tune_lr=True`` tunes it per loss as
an ablation, reported on its own (``out/lr-ablation/``). Once every study is finished, each
trial's models are tested (:func:`test_trials`, alone and concatenated) so that the Spearman
correlation between validation and test MAP@R over the trials can be reported: selection is
over by then, so the test cannot influence it. Progress and an ETA over the whole job are
logged at every trial fold and every final fold run (:mod:`imgret.training.progress`).

Budgets (:data:`BUDGETS`) are named presets of base options, trials and seeds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from imgret.training.benchmark import cell_name, plan_cells, run_benchmark
from imgret.training.config import LossConfig, TrainConfig, base_config, config_diff
from imgret.training.crossval import DIVERGED, fold_dir, fold_ids, is_finished, test_run
from imgret.training.loop import LossDiverged, train
from imgret.training.progress import Progress
from imgret.training.recipe import CLASS_COUNT_OPTIONS
from imgret.training.registry import (
    LR,
    MINER_PREFIX,
    MINERS,
    PARAM_LR_MULT,
    Param,
    loss_spec,
    resolve_miner,
)
from imgret.training.report import BenchmarkMismatch, describe_diff
from imgret.training.run_dir import SELECTION_METRIC, read_record, write_record

logger = logging.getLogger(__name__)

TUNE_DIR = "tune"
STUDY_DB = "study.db"
TUNING_JSON = "tuning.json"
TRIALS_JSON = "trials.json"
# Where a cross-validated benchmark with the learning rate tuned per loss (the ablation) goes,
# inside --out, so that it is never read as the protocol's own table.
LR_ABLATION_DIR = "lr-ablation"


@dataclass(frozen=True)
class Budget:
    """A named preset: base options (TrainConfig fields), trials per loss, retraining seeds.

    Explicit command-line options override ``options``.
    """

    options: Mapping[str, Any]
    trials: int
    seeds: int
    note: str


BUDGETS: dict[str, Budget] = {
    # Timed on this project's 2-core CPU (docs/training.md, "Budgets"): about 30 minutes for
    # the ten default losses x (8 trials + 5 seeds). Batch 48 = 3 classes x 16 images, every
    # training class of the Fashion-MNIST split in every batch.
    "quick": Budget(
        options={"backbone": "tiny_cnn", "image_size": 28, "dim": 64, "epochs": 3,
                 "batch_size": 48, "max_train_images": 2400, "max_eval_images": 1000,
                 "augmentation": "none", "num_workers": 0},
        trials=8, seeds=5,
        note="2 CPU cores, about 30 minutes: tiny_cnn at 28 px, 2,400 training images, "
        "3 epochs per run, 8 trials per loss, 5 seeds",
    ),
    # The Reality Check's protocol on a CPU (docs/training.md, "The Reality-Check protocol"):
    # 4-fold cross-validation, batches of 32 = 8 classes x 4, 128-d, early stopping;
    # small_cnn is the fastest backbone here that learns at 32 px. Meant for --data glyphs
    # (many classes). Sized from the published run's timings (docs/training.md, "Budgets"):
    # a tuning fold run (at most 4 epochs of 1,600 images) took 5.4 s on the 2 cores, a final
    # one with its tests 8.8 s, so 20 trials and 10 runs of ten losses are about 2.5 hours.
    "reality-check": Budget(
        options={"backbone": "small_cnn", "image_size": 32, "dim": 128, "epochs": 4,
                 "patience": 2, "batch_size": 32, "m_per_class": 4, "cv_folds": 4,
                 "max_train_images": 1600, "train_cap": "classes", "max_eval_images": 2000,
                 "augmentation": "none", "warmup_epochs": 0.0, "num_workers": 0},
        trials=20, seeds=10,
        note="2 CPU cores, about 2.5 hours for ten losses: 4-fold cross-validation, small_cnn "
        "at 32 px, 128-d, batches of 32, epochs of 1,600 training images of whole classes (50 "
        "batches), early stopping (patience 2, at most 4 epochs), 20 trials per loss, 10 runs",
    ),
    "reality-check-full": Budget(
        options={"backbone": "small_cnn", "image_size": 32, "dim": 128, "epochs": 50,
                 "patience": 5, "batch_size": 32, "m_per_class": 4, "cv_folds": 4,
                 "max_train_images": None, "max_eval_images": None, "augmentation": "none",
                 "warmup_epochs": 0.0, "num_workers": 4},
        trials=50, seeds=10,
        note="the paper's 50 trials per loss and 10 runs of 4 folds; a GPU or a long CPU "
        "job: at most 50 epochs, patience 5, every validation / test image",
    ),
    "full": Budget(
        options={"backbone": "resnet18", "image_size": 32, "dim": 128, "epochs": 15,
                 "batch_size": 120, "max_train_images": None, "max_eval_images": 5000,
                 "augmentation": "standard", "num_workers": 4},
        trials=30, seeds=5,
        note="one GPU: resnet18 at 32 px on every training image, 15 epochs per run, "
        "30 trials per loss, 5 seeds",
    ),
}


def search_space(loss: LossConfig) -> dict[str, Param]:
    """The registry's search space of ``loss``, less the miner settings its miner lacks (a
    loss run with ``:none`` tunes no miner)."""
    miner_defaults = MINERS[resolve_miner(loss.name, loss.miner)].defaults

    def usable(key: str) -> bool:
        return not key.startswith(MINER_PREFIX) or key[len(MINER_PREFIX):] in miner_defaults

    return {key: dataclasses.replace(param, also=tuple(k for k in param.also if usable(k)))
            for key, param in loss_spec(loss.name).space.items() if usable(key)}


def tuned_space(loss: LossConfig, *, tune_lr: bool, recipe: str = "shared"
                ) -> dict[str, Param]:
    """What tuning searches for ``loss``: :func:`search_space`, less the network's learning
    rate unless ``tune_lr`` (the protocol shares one rate between all losses), and under the
    ``family`` recipe less the options that recipe derives from the number of classes
    (ArcFace's and CosFace's scale: AdaCos's point is that a scale set from C needs no
    search, and a searched one would start trial 0 at the registry's 64, the value the recipe
    replaces)."""
    derived = (set(CLASS_COUNT_OPTIONS.get(loss.name, {})) - set(loss.options)
               if recipe == "family" else set())
    return {k: p for k, p in search_space(loss).items()
            if (tune_lr or k != LR) and k not in derived}


def apply_params(loss: LossConfig, space: Mapping[str, Param],
                 params: Mapping[str, float]) -> LossConfig:
    """The loss block with the sampled ``params`` (keys of ``space``) filled in."""
    options, miner_options = dict(loss.options), dict(loss.miner_options)
    lr, param_lr_mult = loss.lr, loss.param_lr_mult
    for key, value in params.items():
        for target in (key, *space[key].also):
            if target == LR:
                lr = value
            elif target == PARAM_LR_MULT:
                param_lr_mult = value
            elif target.startswith(MINER_PREFIX):
                miner_options[target[len(MINER_PREFIX):]] = value
            else:
                options[target] = value
    return dataclasses.replace(loss, options=options, miner_options=miner_options, lr=lr,
                               param_lr_mult=param_lr_mult)


def default_params(
    loss: LossConfig, space: Mapping[str, Param], base_lr: float, recipe: str = "shared"
) -> dict[str, float]:
    """The documented defaults as a point of ``space`` (clipped into it): every study's
    trial 0, so tuning can only find something at least as good on validation. Under the
    family recipe the loss parameters' default is its absolute rate, as a multiple of
    ``base_lr`` (the tuned key is a multiple)."""
    spec = loss_spec(loss.name)
    miner = MINERS[resolve_miner(loss.name, loss.miner)]
    point = {}
    for key, param in space.items():
        if key == LR:
            value = base_lr
        elif key == PARAM_LR_MULT:
            value = (spec.param_lr / base_lr if recipe == "family" and spec.param_lr
                     else spec.param_lr_mult)
        elif key.startswith(MINER_PREFIX):
            value = miner.defaults[key[len(MINER_PREFIX):]]
        else:
            value = spec.defaults[key]
        point[key] = min(max(float(value), param.low), param.high)
    return point


def describe_space(space: Mapping[str, Param]) -> dict[str, dict[str, Any]]:
    """A JSON-ready search space: ``{key: {"low", "high", "log"[, "also"]}}``."""
    return {key: {"low": p.low, "high": p.high, "log": p.log, **({"also": list(p.also)}
                                                                   if p.also else {})}
            for key, p in space.items()}


def run_tuned_benchmark(
    base: TrainConfig, losses: Sequence[LossConfig], trials: int, seeds: Sequence[int],
    out: str | Path, *, seed: int = 0, command: str = "", progress: bool = True,
    tune_lr: bool | None = None, controls: Sequence[str] = (), trial_tests: bool | None = None,
) -> dict[str, Any]:
    """Tune every loss with the same budget, then retrain each best configuration per seed
    and test it (the benchmark). Resumable at every level: finished trials, fold runs and
    cells are not run again.

    Args:
        base: the shared config (its ``loss`` and ``seed`` are ignored); its epochs / time
            budget / patience are every trial's budget, its ``cv_folds`` the protocol.
        losses: the loss blocks to tune and compare.
        trials: finished trials per loss (the same for every loss).
        seeds: the retraining seeds (runs).
        out: the benchmark directory (``tune/`` holds the studies and the trial runs).
        seed: seeds the TPE sampler and the trials' training.
        command: the command line, recorded in the report.
        tune_lr: tune the network's learning rate per loss; ``None`` = only without
            cross-validation (the single-split tuning always did; the protocol shares one).
            Tuned under cross-validation, it is the ablation, written to
            ``out/lr-ablation/``.
        controls: control rows of the benchmark (``shuffled_labels``, ``oracle``), trained
            with the first loss's tuned block.
        trial_tests: test every trial's models after tuning, for the validation / test
            correlation; ``None`` = under cross-validation only.

    Returns:
        The benchmark's results, with ``"tuning"`` (also in ``results.json``).

    Raises:
        BenchmarkMismatch: ``out`` holds studies or a benchmark of another base config or
            search space.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our log names each trial
    out = Path(out)
    tune_lr = not base.cv_folds if tune_lr is None else tune_lr
    ablation = bool(tune_lr and base.cv_folds)
    if ablation:
        out = out / LR_ABLATION_DIR
    trial_tests = bool(base.cv_folds) if trial_tests is None else trial_tests
    tune_dir = out / TUNE_DIR
    tune_dir.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{(tune_dir / STUDY_DB).resolve()}"
    folds = len(fold_ids(base))
    tracker = Progress({
        "trial": len(losses) * trials * folds,
        "trial test": len(losses) * trials if trial_tests else 0,
        "final": len(plan_cells(base, losses, seeds, out, controls)),
    })
    tuned, best, spaces, diverged, studies = [], {}, {}, {}, {}
    for loss in losses:
        space = tuned_space(loss, tune_lr=tune_lr, recipe=base.recipe)
        name = cell_name(loss)
        spaces[name] = describe_space(space)
        study_trials = tune_loss(base, loss, space, trials, storage, tune_dir / name,
                                 seed=seed, progress=progress, tracker=tracker)
        studies[name] = study_trials
        # The winner is chosen here, before any trial's model has seen the test split.
        winner = max(study_trials, key=lambda t: (t.value, -t.number))
        tuned.append(apply_params(loss, space, winner.params))
        best[name] = {"trial": winner.number, f"val_{SELECTION_METRIC}": winner.value,
                      "params": winner.params}
        diverged[name] = sum(bool(t.user_attrs.get("diverged")) for t in study_trials)
    objective = ("validation MAP@R of the trial's best epoch" if folds == 1 else
                 f"mean over the {folds} folds of each fold model's best validation MAP@R")
    tuning = {
        "trials": trials, "startup_trials": startup_trials(trials),
        "sampler": f"TPE (optuna {optuna.__version__}), seed {seed}; trial 0 = the "
        "documented defaults", "pruning": "none: every trial runs its whole budget",
        "objective": objective, "cv_folds": base.cv_folds, "lr_tuned": tune_lr,
        "lr_ablation": ablation,
        "per_trial": per_trial_budget(base, seed), "spaces": spaces, "best": best,
        "diverged": diverged,
    }
    if trial_tests:
        records = test_trials(studies, tune_dir, tracker=tracker)
        (tune_dir / TRIALS_JSON).write_text(json.dumps(records, indent=1))
        tuning["correlation"] = correlation(records)
    (tune_dir / TUNING_JSON).write_text(json.dumps(tuning, indent=1))
    return run_benchmark(base, tuned, seeds, out, command=command, progress=progress,
                         tuning=tuning, controls=controls, control_loss=tuned[0],
                         tracker=tracker)


def test_trials(
    studies: Mapping[str, Sequence[optuna.trial.FrozenTrial]], tune_dir: Path, *,
    tracker: Progress | None = None,
) -> list[dict[str, Any]]:
    """Test every finished trial's models on the test split, alone and concatenated
    (:func:`imgret.training.crossval.test_run`, cached in the trial's ``test.json``). Called
    only once every study is finished and every winner chosen.

    Returns:
        One record per trial whose runs learned (a trial with an untrained fold has no model
        to test): ``loss``, ``trial``, ``val`` (its objective), ``test`` (the
        concatenated models' test MAP@R; one model's without folds) and ``test_alone``
        (the fold models' mean).
    """
    records = []
    for name, trials in studies.items():
        for trial in trials:
            run = tune_dir / name / trial.user_attrs.get("run", f"trial{trial.number}")
            folds = trial.user_attrs.get("folds", [None])
            fresh = not (run / "test.json").exists()
            label = f"testing {name} trial {trial.number} ({len(folds)} model(s))"
            with (tracker or Progress({"trial test": 1})).piece("trial test", label,
                                                               fresh=fresh):
                result = test_run(run, folds)
            if not result.get("learned", True):
                continue  # no model: nothing to correlate with its validation score
            records.append({
                "loss": name, "trial": trial.number, "val": trial.value,
                "test": result["concatenated"][SELECTION_METRIC],
                "test_alone": result["separate_mean"][SELECTION_METRIC],
            })
    return records


def correlation(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Spearman's rank correlation (``scipy.stats.spearmanr``) between the trials' mean
    validation MAP@R and their test MAP@R (concatenated, and the fold models alone), over
    every trial of every loss and per loss.

    Returns:
        ``{"all": {"test": {"rho", "p", "n"}, "test_alone": {...}}, "per_loss": {name:
        {...}}}``; rho and p are ``None`` for fewer than 3 trials or constant values.
    """
    def spearman(rows: Sequence[Mapping[str, Any]], key: str) -> dict[str, Any]:
        from scipy.stats import spearmanr

        val = [float(r["val"]) for r in rows]
        test = [float(r[key]) for r in rows]
        if len(rows) < 3 or len(set(val)) < 2 or len(set(test)) < 2:
            return {"rho": None, "p": None, "n": len(rows)}
        result = spearmanr(val, test)
        return {"rho": float(result.statistic), "p": float(result.pvalue), "n": len(rows)}

    def both(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {key: spearman(rows, key) for key in ("test", "test_alone")}

    losses = list(dict.fromkeys(r["loss"] for r in records))
    return {"all": both(records),
            "per_loss": {name: both([r for r in records if r["loss"] == name])
                         for name in losses}}


def per_trial_budget(base: TrainConfig, seed: int) -> dict[str, Any]:
    """What every trial of every loss trains with, beyond the loss block."""
    budget = {"epochs": base.epochs, "time_budget_s": base.time_budget_s,
              "max_train_images": base.max_train_images, "training_seed": seed}
    if base.cv_folds:
        budget |= {"folds": base.cv_folds, "patience": base.patience, "lr": base.lr}
    return budget


def startup_trials(trials: int) -> int:
    """Trials TPE draws at random before it models the results: a third of them (at least
    one, at most Optuna's default of 10), so a short study still does Bayesian optimisation."""
    return min(10, max(1, trials // 3))


def tune_loss(
    base: TrainConfig, loss: LossConfig, space: Mapping[str, Param], trials: int, storage: str,
    runs: Path, *, seed: int, progress: bool, tracker: Progress | None = None,
) -> list[optuna.trial.FrozenTrial]:
    """Run (or resume) one loss's study until it has ``trials`` finished trials.

    Each trial draws from a sampler seeded by ``seed`` and the trial's number, so a study
    interrupted and resumed proposes what an unbroken one would. A trial left running by an
    interruption is marked failed and its parameters are proposed again, in the same run
    directory, so its finished fold runs are kept and an unfinished one resumes.

    Under cross-validation a trial trains ``base.cv_folds`` fold models and scores the mean
    of their best validation MAP@R (``fold_val`` in the trial's user attributes).

    Returns:
        The first ``trials`` finished trials (every loss is judged on the same number).
    """
    name = cell_name(loss)
    identity = {"base": base_config(base), "seed": seed, "space": describe_space(space),
                "loss": dataclasses.asdict(loss)}
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize",
                                load_if_exists=True)
    _check_identity(study, identity, runs)
    _requeue_interrupted(study)
    if not study.trials:
        study.enqueue_trial(default_params(loss, space, base.lr, base.recipe))
    folds = fold_ids(base)
    tracker = tracker or Progress({"trial": trials * len(folds)})
    tracker.skip("trial", len(folds) * min(trials, len(_finished(study))))

    def objective(trial: optuna.Trial) -> float:
        params = {key: trial.suggest_float(key, p.low, p.high, log=p.log)
                  for key, p in space.items()}
        config = dataclasses.replace(base, loss=apply_params(loss, space, params), seed=seed)
        # A re-proposed interrupted trial continues in the directory it started in.
        run_name = trial.user_attrs.get("run", f"trial{trial.number}")
        trial.set_user_attr("run", run_name)
        trial.set_user_attr("folds", folds)
        logger.info("tuning %s, trial %d/%d: %s", name, trial.number + 1, trials, params)
        scores = []
        for fold in folds:
            run = fold_dir(runs / run_name, fold)
            label = (f"tuning {name}, trial {trial.number + 1}/{trials}"
                     + (f", fold {fold + 1}/{len(folds)}" if fold is not None else ""))
            with tracker.piece("trial", label, fresh=not is_finished(run)):
                score = _train_fold(dataclasses.replace(config, fold=fold), run, trial,
                                    progress=progress)
            scores.append(float(score[SELECTION_METRIC]))
        value = sum(scores) / len(scores)
        if fold_count := len(scores) > 1:
            trial.set_user_attr("fold_val", scores)
        logger.info("%s trial %d: validation MAP@R %.4f%s", name, trial.number, value,
                    f" (mean of {len(scores)} folds)" if fold_count else "")
        return value

    while len(finished := _finished(study)) < trials:
        # Seeded by the trials that count (failed ones are re-proposed, and TPE ignores
        # them), so a resumed study proposes what an unbroken one would.
        counted = [t for t in study.trials if t.state != optuna.trial.TrialState.FAIL]
        study.sampler = optuna.samplers.TPESampler(
            seed=seed * 100_003 + len(counted), n_startup_trials=startup_trials(trials))
        study.optimize(objective, n_trials=1)
    return finished[:trials]


def _train_fold(
    config: TrainConfig, run: Path, trial: optuna.Trial, *, progress: bool
) -> dict[str, Any]:
    """Train (or resume) one fold run of a trial; its best validation metrics. A run whose
    loss diverges scores its best epoch and is marked, so a resumed trial does not train it
    into the same NaN again."""
    if is_finished(run) and read_record(run)["status"] == DIVERGED:
        trial.set_user_attr("diverged", True)
        return read_record(run)["best"]["val"]
    try:
        return train(config, run, resume=True, progress=progress, test=False).val
    except LossDiverged as error:
        logger.warning("%s trial %d diverged (%s); it scores its best epoch",
                       config.loss.name, trial.number, error)
        trial.set_user_attr("diverged", True)
        record = read_record(run)
        record["status"] = DIVERGED  # its best epoch stands
        write_record(run, record)
        return record["best"]["val"]


def _finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    return sorted(done, key=lambda t: t.number)


def _check_identity(study: optuna.Study, identity: dict[str, Any], runs: Path) -> None:
    """A study keeps the base config, space and loss block it was started with; trials of
    another base would not share this study's budget, so they are refused."""
    saved = study.user_attrs.get("identity")
    if saved is None:
        study.set_user_attr("identity", identity)
        return
    diff = config_diff(_flat(saved), _flat(identity))
    if diff:
        raise BenchmarkMismatch(
            f"{runs.parent}: the study of {study.study_name} was tuned with other settings "
            f"({describe_diff(diff)}). Use another --out or the same options."
        )


def _flat(identity: dict[str, Any]) -> dict[str, Any]:
    return {**identity["base"], "tuning seed": identity["seed"],
            "search space": identity["space"], "loss block": identity["loss"]}


def _requeue_interrupted(study: optuna.Study) -> None:
    """Propose again the parameters of every trial an interruption ended: one left running
    (the process was killed) or failed (Optuna marks a trial failed when an exception, Ctrl-C
    included, leaves its objective), once per failure, in the trial's own run directory."""
    requeued = set(study.user_attrs.get("requeued", []))
    for trial in study.trials:
        if trial.number in requeued or trial.state not in (
                optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL):
            continue
        logger.info("%s trial %d was interrupted: proposing its parameters again",
                    study.study_name, trial.number)
        if trial.state == optuna.trial.TrialState.RUNNING:
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={
            "run": trial.user_attrs.get("run", f"trial{trial.number}")})
        requeued.add(trial.number)
    if requeued:
        study.set_user_attr("requeued", sorted(requeued))
