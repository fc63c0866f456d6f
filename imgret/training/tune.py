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
   (:func:`imgret.training.report.tuning_markdown` renders it).

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

from imgret.training.benchmark import cell_name, run_benchmark
from imgret.training.config import LossConfig, TrainConfig, base_config, config_diff
from imgret.training.loop import LossDiverged, train
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
from imgret.training.run_dir import SELECTION_METRIC, read_record

logger = logging.getLogger(__name__)

TUNE_DIR = "tune"
STUDY_DB = "study.db"
TUNING_JSON = "tuning.json"


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
    loss: LossConfig, space: Mapping[str, Param], base_lr: float
) -> dict[str, float]:
    """The documented defaults as a point of ``space`` (clipped into it): every study's
    trial 0, so tuning can only find something at least as good on validation."""
    spec = loss_spec(loss.name)
    miner = MINERS[resolve_miner(loss.name, loss.miner)]
    point = {}
    for key, param in space.items():
        if key == LR:
            value = base_lr
        elif key == PARAM_LR_MULT:
            value = spec.param_lr_mult
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
) -> dict[str, Any]:
    """Tune every loss with the same budget, then retrain each best configuration per seed
    and test it (the benchmark). Resumable at every level: finished trials and finished
    cells are not run again.

    Args:
        base: the shared config (its ``loss`` and ``seed`` are ignored); its epochs / time
            budget are every trial's budget.
        losses: the loss blocks to tune and compare.
        trials: finished trials per loss (the same for every loss).
        seeds: the retraining seeds.
        out: the benchmark directory (``tune/`` holds the studies and the trial runs).
        seed: seeds the TPE sampler and the trials' training.
        command: the command line, recorded in the report.

    Returns:
        The benchmark's results, with ``"tuning"`` (also in ``results.json``).

    Raises:
        BenchmarkMismatch: ``out`` holds studies or a benchmark of another base config or
            search space.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our log names each trial
    out = Path(out)
    tune_dir = out / TUNE_DIR
    tune_dir.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{(tune_dir / STUDY_DB).resolve()}"
    tuned, best, spaces, diverged, durations = [], {}, {}, {}, []
    for done, loss in enumerate(losses, start=1):
        space = search_space(loss)
        name = cell_name(loss)
        spaces[name] = describe_space(space)
        study_trials = tune_loss(base, loss, space, trials, storage, tune_dir / name,
                                 seed=seed, progress=progress)
        durations += [t.duration.total_seconds() for t in study_trials if t.duration]
        _log_expected_time(durations, trials * (len(losses) - done), len(losses) * len(seeds))
        winner = max(study_trials, key=lambda t: (t.value, -t.number))
        tuned.append(apply_params(loss, space, winner.params))
        best[name] = {"trial": winner.number, f"val_{SELECTION_METRIC}": winner.value,
                      "params": winner.params}
        diverged[name] = sum(bool(t.user_attrs.get("diverged")) for t in study_trials)
    tuning = {
        "trials": trials, "startup_trials": startup_trials(trials),
        "sampler": f"TPE (optuna {optuna.__version__}), seed {seed}; trial 0 = the "
        "documented defaults", "pruning": "none: every trial runs its whole budget",
        "objective": "validation MAP@R of the trial's best epoch",
        "per_trial": per_trial_budget(base, seed), "spaces": spaces, "best": best,
        "diverged": diverged,
    }
    (tune_dir / TUNING_JSON).write_text(json.dumps(tuning, indent=1))
    return run_benchmark(base, tuned, seeds, out, command=command, progress=progress,
                         tuning=tuning)


def _log_expected_time(durations: Sequence[float], trials_left: int, cells: int) -> None:
    """Log the expected remaining wall time from the trials timed so far (a retrained cell
    costs about a trial plus its test evaluation: ~1.3 trials, timed on tiny_cnn)."""
    if durations:
        per_trial = sum(durations) / len(durations)
        logger.info("tuning: %.1f s per trial so far; expected remaining wall time about "
                    "%.0f min (%d trials, then at most %d cells)", per_trial,
                    per_trial * (trials_left + 1.3 * cells) / 60, trials_left, cells)


def per_trial_budget(base: TrainConfig, seed: int) -> dict[str, Any]:
    """What every trial of every loss trains with, beyond the loss block."""
    return {"epochs": base.epochs, "time_budget_s": base.time_budget_s,
            "max_train_images": base.max_train_images, "training_seed": seed}


def startup_trials(trials: int) -> int:
    """Trials TPE draws at random before it models the results: a third of them (at least
    one, at most Optuna's default of 10), so a short study still does Bayesian optimisation."""
    return min(10, max(1, trials // 3))


def tune_loss(
    base: TrainConfig, loss: LossConfig, space: Mapping[str, Param], trials: int, storage: str,
    runs: Path, *, seed: int, progress: bool,
) -> list[optuna.trial.FrozenTrial]:
    """Run (or resume) one loss's study until it has ``trials`` finished trials.

    Each trial draws from a sampler seeded by ``seed`` and the trial's number, so a study
    interrupted and resumed proposes what an unbroken one would. A trial left running by an
    interruption is marked failed and its parameters are proposed again.

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
        study.enqueue_trial(default_params(loss, space, base.lr))

    def objective(trial: optuna.Trial) -> float:
        params = {key: trial.suggest_float(key, p.low, p.high, log=p.log)
                  for key, p in space.items()}
        config = dataclasses.replace(base, loss=apply_params(loss, space, params), seed=seed)
        run = runs / f"trial{trial.number}"
        logger.info("tuning %s, trial %d/%d: %s", name, trial.number + 1, trials, params)
        try:
            score = train(config, run, resume=True, progress=progress, test=False).val
        except LossDiverged as error:
            logger.warning("%s trial %d diverged (%s); it scores its best epoch", name,
                           trial.number, error)
            trial.set_user_attr("diverged", True)
            score = read_record(run)["best"]["val"]
        logger.info("%s trial %d: validation MAP@R %.4f", name, trial.number,
                    score[SELECTION_METRIC])
        return float(score[SELECTION_METRIC])

    while len(finished := _finished(study)) < trials:
        study.sampler = optuna.samplers.TPESampler(
            seed=seed * 100_003 + len(study.trials), n_startup_trials=startup_trials(trials))
        study.optimize(objective, n_trials=1)
    return finished[:trials]


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
    for trial in study.trials:
        if trial.state == optuna.trial.TrialState.RUNNING:
            logger.info("%s trial %d was interrupted: proposing its parameters again",
                        study.study_name, trial.number)
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            study.enqueue_trial(trial.params)
