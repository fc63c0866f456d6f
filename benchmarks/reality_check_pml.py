"""An independent check of a Reality-Check table: retrain two of its losses with
pytorch-metric-learning's own trainer and score them with PML's ``AccuracyCalculator``.

For each chosen loss of a finished ``imgret tune --cv-folds K`` output, every final run
(``runs/<loss>/seed<s>/fold<j>/``) is trained again outside imgret's loop, from the same
inputs: the same split (imgret's ``make_split`` of the run's config: the same training,
validation and test images), the same trunk and head (``EmbeddingNet`` of the same spec,
seeded the same way, with the recipe's neck), the loss and miner built directly from PML with
the run's tuned parameters, the run's recipe's batches (PML's ``MPerClassSampler``, 8
classes x 4, for pair losses; PML's shuffled batches for proxy losses; epochs as long as the
training split), the loss parameters at the recipe's rate, AdamW at the run's learning
rate with the same cosine schedule over the epoch cap, and
early stopping on validation MAP@R with the run's patience (PML's ``end_of_epoch_hook``).
The test split is embedded here (eval transform, forward pass, no imgret ``Embedder``) and
scored by PML's ``AccuracyCalculator`` (``k="max_bin_count"``): each fold model alone and the
K models concatenated, as the table reports them. A fold whose best validation epoch is
still the untrained network (epoch 0) did not learn: its run, and a loss with such a run,
say "did not learn" instead of numbers, as imgret's table does.

What agrees by construction: data, split, architecture, hyper-parameters. What is
independent: the training loop (batches, steps, early stopping), the embedding of the test
images and the metric code. The check passes when PML's mean MAP@R over runs lies inside
imgret's 95% interval for that loss, alone and concatenated.

Run: ``python benchmarks/reality_check_pml.py runs/reality-check --losses
contrastive,multi_similarity`` (writes ``pml_check.json`` into the run directory).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import tqdm
from pytorch_metric_learning import losses, miners, samplers, trainers
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from scipy import stats

from imgret.checkpoint import EmbeddingNet, ModelSpec
from imgret.training.config import TrainConfig
from imgret.training.data import make_split, open_source
from imgret.training.data.datasets import TrainDataset
from imgret.training.data.sources import model_spec_for
from imgret.training.recipe import M_PER_CLASS, loss_param_lr, recipe_for
from imgret.transforms import eval_transform

METRICS = ("mean_average_precision_at_r", "precision_at_1", "r_precision")


def pml_loss(config: TrainConfig,
             num_classes: int) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The loss and miner, built from PML's classes with the run's tuned options."""
    options = dict(config.loss.options)
    miner_options = dict(config.loss.miner_options)
    name = config.loss.name
    if name == "contrastive":
        loss = losses.ContrastiveLoss(pos_margin=options.get("pos_margin", 0.0),
                                      neg_margin=options.get("neg_margin", 1.0))
        miner = None if config.loss.miner in (None, "none") else _unsupported(config)
    elif name == "multi_similarity":
        loss = losses.MultiSimilarityLoss(alpha=options.get("alpha", 2.0),
                                          beta=options.get("beta", 50.0),
                                          base=options.get("base", 0.5))
        miner = (miners.MultiSimilarityMiner(epsilon=miner_options.get("epsilon", 0.1))
                 if config.loss.miner in (None, "multi_similarity") else _unsupported(config))
    elif name == "proxy_anchor":
        loss = losses.ProxyAnchorLoss(num_classes=num_classes, embedding_size=config.dim,
                                      margin=options.get("margin", 0.1),
                                      alpha=options.get("alpha", 32.0))
        miner = None if config.loss.miner in (None, "none") else _unsupported(config)
    elif name == "triplet":
        loss = losses.TripletMarginLoss(margin=options.get("margin", 0.2))
        miner = (miners.TripletMarginMiner(margin=miner_options.get("margin", 0.2),
                                           type_of_triplets="semihard")
                 if config.loss.miner in (None, "semihard") else _unsupported(config))
    else:
        raise SystemExit(f"this check builds contrastive, multi_similarity, proxy_anchor and "
                         f"triplet, not {name!r}")
    return loss, miner


def _unsupported(config: TrainConfig) -> None:
    raise SystemExit(f"miner {config.loss.miner!r} of {config.loss.name!r} is not built here")


def embed(model: EmbeddingNet, dataset: TrainDataset, batch: int = 256) -> np.ndarray:
    """L2-normalised embeddings of every item of ``dataset``, in order."""
    model.eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(dataset), batch):
            images = torch.stack([dataset[i][0] for i in range(start,
                                                              min(start + batch, len(dataset)))])
            out.append(F.normalize(model(images), dim=1).numpy())
    model.train()
    return np.concatenate(out)


def map_at_r(calculator: AccuracyCalculator, vectors: np.ndarray,
             labels: np.ndarray) -> dict[str, float]:
    """PML's metrics with the query set as its own reference (the query itself excluded)."""
    result = calculator.get_accuracy(torch.from_numpy(vectors), torch.from_numpy(labels),
                                     ref_includes_query=True)
    return {k: float(v) for k, v in result.items()}


def fold_splits(config: TrainConfig
                ) -> tuple[ModelSpec, TrainDataset, TrainDataset, TrainDataset]:
    """The run's model spec and its training, validation and test splits (imgret's
    ``make_split``), each a data set of the eval transform."""
    source = open_source(config.data)
    split = make_split(source, config)
    spec = model_spec_for(config, source)
    transform = eval_transform(spec)
    train, val, test = (TrainDataset(source, split.indices[name], transform)
                        for name in ("train", "val", "test"))
    return spec, train, val, test


def cosine_decay(total: int) -> Callable[[int], float]:
    """The loop's schedule without warm-up: cosine from 1 to 0 over ``total`` steps."""
    return lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total) / total))


class EarlyStopping:
    """PML's ``end_of_epoch_hook``: validation MAP@R after every epoch, the best weights kept,
    training stopped after ``patience`` epochs without a gain. Epoch 0 is the untrained
    network, so a run that never beats it did not learn."""

    def __init__(self, model: EmbeddingNet, val_set: TrainDataset,
                 calculator: AccuracyCalculator, patience: int):
        self.model, self.val_set, self.calculator = model, val_set, calculator
        self.patience, self.since, self.best_epoch = patience, 0, 0
        self.curve: list[float] = []
        self.epoch0 = self.best = self.validate()
        self.weights = copy.deepcopy(model.state_dict())

    def validate(self) -> float:
        return map_at_r(self.calculator, embed(self.model, self.val_set),
                        self.val_set.targets)["mean_average_precision_at_r"]

    def __call__(self, trainer: Any) -> bool:
        score = self.validate()
        self.curve.append(score)
        if score > self.best:
            self.best, self.best_epoch, self.since = score, trainer.epoch, 0
            self.weights = copy.deepcopy(self.model.state_dict())
        else:
            self.since += 1
        return self.since < self.patience  # False stops PML's trainer

    def restore(self) -> dict[str, Any]:
        """Load the best weights; what the fold's record keeps of its training."""
        self.model.load_state_dict(self.weights)
        return {"best_epoch": self.best_epoch, "val_map_at_r": self.best,
                "val_epoch0": self.epoch0, "val_curve": self.curve,
                "learned": self.best_epoch > 0}


def train_fold(config: TrainConfig, calculator: AccuracyCalculator
               ) -> tuple[EmbeddingNet, dict, TrainDataset]:
    """One fold model, trained by PML's ``MetricLossOnly`` and stopped on validation MAP@R;
    also the run's test split, as a data set of the same transform."""
    spec, train_set, val_set, test = fold_splits(config)
    torch.manual_seed(config.seed)
    model = EmbeddingNet(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.network_lr,
                                  weight_decay=config.weight_decay)
    steps_per_epoch = len(train_set) // config.batch_size
    cosine = cosine_decay(steps_per_epoch * config.epochs)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
    loss, miner = pml_loss(config, len(train_set.class_names))
    optimizers = {"trunk_optimizer": optimizer}
    schedules = {"trunk_scheduler_by_iteration": schedule}
    loss_params = list(loss.parameters())
    if loss_params:  # proxies: their own AdamW at the run's recipe's rate, no decay
        proxy_optimizer = torch.optim.AdamW(loss_params, lr=loss_param_lr(config),
                                            weight_decay=0.0)
        optimizers["metric_loss_optimizer"] = proxy_optimizer
        schedules["metric_loss_scheduler_by_iteration"] = torch.optim.lr_scheduler.LambdaLR(
            proxy_optimizer, cosine)
    # The run's recipe: m per class for pair losses; PML's trainer shuffles when it has no
    # sampler, the random batches of proxy losses.
    sampler = (samplers.MPerClassSampler(train_set.targets, m=config.m_per_class,
                                         batch_size=config.batch_size,
                                         length_before_new_iter=len(train_set))
               if recipe_for(config).sampler == M_PER_CLASS else None)
    stopping = EarlyStopping(model, val_set, calculator, config.patience)
    trainer = trainers.MetricLossOnly(
        models={"trunk": model}, optimizers=optimizers,
        batch_size=config.batch_size, loss_funcs={"metric_loss": loss},
        mining_funcs={"tuple_miner": miner} if miner is not None else {},
        dataset=train_set, sampler=sampler, dataloader_num_workers=0,
        iterations_per_epoch=steps_per_epoch,
        lr_schedulers=schedules,
        end_of_epoch_hook=stopping)
    trainer.train(num_epochs=config.epochs)
    return model, stopping.restore(), test


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval over runs (imgret's table uses the same)."""
    a = np.asarray(values, float)
    if len(a) < 2:
        return float(a.mean()), float("nan"), float("nan")
    half = stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a))
    return float(a.mean()), float(a.mean() - half), float(a.mean() + half)


def check_loss(run_dir: Path, loss: str, calculator: AccuracyCalculator) -> dict[str, Any]:
    seeds = sorted((run_dir / "runs" / loss).glob("seed*"), key=lambda p: int(p.name[4:]))
    if not seeds:
        raise SystemExit(f"{run_dir}/runs/{loss}: no final runs")
    rows = []
    for seed_dir in seeds:
        folds = sorted(seed_dir.glob("fold*"), key=lambda p: int(p.name[4:]))
        vectors, alone, info = [], [], []
        labels = None
        for fold_dir in folds:
            record = json.loads((fold_dir / "metrics.json").read_text())
            # A config saved without "recipe" is from before the recipes: the shared one.
            config = TrainConfig(**{"recipe": "shared", **record["config"]})
            start = time.perf_counter()
            model, fold_info, test = train_fold(config, calculator)
            labels = test.targets
            v = embed(model, test)
            vectors.append(v)
            alone.append(map_at_r(calculator, v, labels)["mean_average_precision_at_r"])
            fold_info["seconds"] = round(time.perf_counter() - start, 1)
            info.append(fold_info)
            print(f"{loss} {seed_dir.name} {fold_dir.name}: PML MAP@R {alone[-1]:.4f} "
                  f"(best epoch {fold_info['best_epoch']}, {fold_info['seconds']} s)",
                  flush=True)
        concatenated = np.concatenate(vectors, axis=1) / math.sqrt(len(vectors))
        rows.append({"seed": seed_dir.name, "folds": info, "alone": alone,
                     "concatenated": map_at_r(calculator, concatenated, labels),
                     "learned": all(f["learned"] for f in info)})
    imgret = json.loads((run_dir / "results.json").read_text())
    row = next(r for r in imgret["rows"] if r["kind"] == "loss" and r["name"] == loss)
    # A run with a fold that kept its untrained weights has no trained model to score.
    pml_learned = all(r["learned"] for r in rows)
    pml = ({"alone": interval([float(np.mean(r["alone"])) for r in rows]),
            "concatenated": interval([r["concatenated"]["mean_average_precision_at_r"]
                                      for r in rows])} if pml_learned else None)
    theirs = None
    if row.get("metrics") is not None:
        theirs = {kind: {"mean": m["mean"], "low": m["ci"][0], "high": m["ci"][1]}
                  for kind, m in (("concatenated", row["metrics"]["map_at_r"]),
                                  ("alone", row["separate"]["map_at_r"]))}
    within = None
    if pml is not None and theirs is not None:
        within = {kind: theirs[kind]["low"] <= pml[kind][0] <= theirs[kind]["high"]
                  for kind in ("alone", "concatenated")}
    return {"loss": loss, "runs": rows, "pml": pml, "imgret": theirs, "within": within,
            "did_not_learn": {"pml": sum(not r["learned"] for r in rows),
                              "imgret": (row.get("did_not_learn") or {}).get("runs", 0),
                              "of": len(rows)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a finished imgret tune --cv-folds output")
    parser.add_argument("--losses", default="contrastive,multi_similarity")
    args = parser.parse_args()
    # PML's trainer draws a progress bar per epoch; this script prints one line per fold.
    tqdm.tqdm = functools.partial(tqdm.tqdm, disable=True)
    calculator = AccuracyCalculator(include=METRICS, k="max_bin_count", device=torch.device("cpu"))
    start = time.perf_counter()
    checks = [check_loss(args.run_dir, loss, calculator) for loss in args.losses.split(",")]
    out = {"checks": checks, "seconds": round(time.perf_counter() - start, 1)}
    (args.run_dir / "pml_check.json").write_text(json.dumps(out, indent=2))
    print("\nTest MAP@R, mean and 95% t-interval over runs; PML trainer + AccuracyCalculator "
          "against imgret's table")
    print("| loss | model | PML | imgret | PML mean inside imgret's interval |")
    print("|---|---|---|---|---|")
    for c in checks:
        missing = c["did_not_learn"]
        for kind in ("concatenated", "alone"):
            if c["pml"] is None:
                theirs = f"did not learn ({missing['pml']} of {missing['of']} runs)"
            else:
                mean, low, high = c["pml"][kind]
                theirs = f"{mean:.3f} [{low:.3f}, {high:.3f}]"
            if c["imgret"] is None:
                ours = f"did not learn ({missing['imgret']} of {missing['of']} runs)"
            else:
                o = c["imgret"][kind]
                ours = f"{o['mean']:.3f} [{o['low']:.3f}, {o['high']:.3f}]"
            agree = ("-" if c["within"] is None else "yes" if c["within"][kind] else "no")
            print(f"| {c['loss']} | {kind} | {theirs} | {ours} | {agree} |")
    print(f"\n{out['seconds']} s")


if __name__ == "__main__":
    main()
