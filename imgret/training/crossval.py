"""Cross-validated runs: the k fold models of one run, tested alone and concatenated.

A *run* of the Reality-Check protocol (``cv_folds`` = k > 0) is k fold runs, one per
validation fold, each a normal :func:`imgret.training.loop.train` run directory
(``<run>/fold<j>/``). At test time (powerful-benchmarker's evaluation) each fold model is
tested alone on the test split, and the k models' embeddings of the test split, each
L2-normalised, are concatenated (k x d dimensions) and tested as one model
(:func:`imgret.training.scoring.concatenate`). :func:`test_run` does both from the fold
models' ``model.pt`` with the run's own evaluator, and keeps the result in
``<run>/test.json`` (tied to the models' versions, so it is recomputed only when a model
changes).

With ``cv_folds`` = 0 a run is one model (its own directory), and :func:`test_run` tests it
alone (``concatenated`` is the same model).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from imgret.checkpoint import load_checkpoint
from imgret.files import write_atomic
from imgret.training.config import TrainConfig, TrainConfigError
from imgret.training.data import make_split, open_source
from imgret.training.run_dir import METRICS_FILE, learned, read_record
from imgret.training.scoring import Evaluator, to_jsonable

logger = logging.getLogger(__name__)

RUN_TEST_FILE = "test.json"
# The status of a tuning trial's fold run whose loss became NaN: its best epoch stands.
DIVERGED = "diverged"


def fold_ids(config: TrainConfig) -> list[int | None]:
    """The folds a run of ``config`` trains: ``0..k-1``, or ``[None]`` (one model) without
    cross-validation and for the oracle control (trained on the test classes: no folds)."""
    if not config.cv_folds or config.control == "oracle":
        return [None]
    return list(range(config.cv_folds))


def fold_dir(run: Path, fold: int | None) -> Path:
    """Where the fold run of ``run`` lives (``run`` itself for a one-model run)."""
    return run if fold is None else run / f"fold{fold}"


def is_finished(out: Path) -> bool:
    """``out`` holds a finished training run (or one whose loss diverged: it is over)."""
    path = out / METRICS_FILE
    return path.exists() and json.loads(path.read_text()).get("status") in ("finished",
                                                                            DIVERGED)


def test_run(run: Path, folds: Sequence[int | None], *, device: str = "auto") -> dict[str, Any]:
    """Test the fold models of ``run`` alone and concatenated (cached in ``run/test.json``).

    Args:
        run: the run directory (its fold runs are :func:`fold_dir` of it).
        folds: :func:`fold_ids` of the run's config.
        device: where to embed and search (``auto``: CUDA when there is one).

    Returns:
        ``{"folds", "model_versions", "separate": [metrics per fold model],
        "separate_mean": {metric: mean over the fold models}, "concatenated": metrics,
        "dim": k x d, "learned": True}``; when a fold run did not learn (it has no model),
        only ``{"folds", "learned": False, "not_learned": [those folds]}``: a run with an
        untrained fold has no number to report.

    Raises:
        TrainConfigError: a fold run is missing or unfinished, or the data no longer gives
            the split the models were validated on.
    """
    dirs = [fold_dir(run, fold) for fold in folds]
    for path in dirs:
        if not is_finished(path):
            raise TrainConfigError(f"{path}: no finished run to test")
    records = [read_record(path) for path in dirs]
    unlearned = [fold for fold, r in zip(folds, records, strict=True) if not learned(r)]
    if unlearned:
        logger.warning("%s: fold run(s) %s did not learn; the run is not tested", run,
                       ", ".join(map(str, unlearned)))
        return {"folds": list(folds), "learned": False, "not_learned": unlearned}
    # A finished run names its model's version; a diverged one only in its checkpoint.
    versions = [r.get("model_version") or load_checkpoint(path).model_version
                for r, path in zip(records, dirs, strict=True)]
    cached = run / RUN_TEST_FILE
    if cached.exists():
        previous = json.loads(cached.read_text())
        if previous.get("model_versions") == versions:
            return previous
    checkpoints = [load_checkpoint(path) for path in dirs]
    config = TrainConfig(**records[0]["config"])
    source = open_source(config.data)
    split = make_split(source, config)
    if split.summary(source)["digest"] != records[0]["split"]["digest"]:
        raise TrainConfigError(f"{dirs[0]}: the data no longer gives the split of this run")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    evaluator = Evaluator(config, source, split, device)
    models = [c.model.to(device) for c in checkpoints]
    scored = evaluator.test_models(models)
    keys = [k for k, v in scored["separate"][0].items() if isinstance(v, int | float)]
    result = to_jsonable({
        "folds": list(folds), "model_versions": versions,
        "dim": sum(m.spec.dim for m in models), **scored, "learned": True,
        "separate_mean": {k: sum(float(s[k]) for s in scored["separate"]) / len(models)
                          for k in keys},
    })
    write_atomic(cached, json.dumps(result, indent=1).encode())
    logger.info("%s: test MAP@R of %d fold model(s): alone %.4f (mean), concatenated %.4f",
                run, len(models), result["separate_mean"]["map_at_r"],
                result["concatenated"]["map_at_r"])
    return result
