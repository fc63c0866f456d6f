"""An independent check of the Reality-Check preset with the peer's own settings: every loss
trained by pytorch-metric-learning's own trainer at PML's recommended settings, not imgret's.

What comes from the peer (PML and powerful-benchmarker, the Reality Check's own code):

- **the loss, its miner and their parameters**: PML's classes at their default arguments,
  which PML documents as the values of each loss's paper (contrastive: positive margin 0,
  negative margin 1; multi-similarity: alpha 2, beta 50, base 0.5 with PML's
  ``MultiSimilarityMiner`` at epsilon 0.1, as the paper pairs them; triplet: margin 0.05 over
  every triplet of the batch; SupCon: temperature 0.1; Proxy Anchor: margin 0.1, alpha 32;
  ProxyNCA: softmax scale 1; normalized softmax: temperature 0.05; CosFace: margin 0.35,
  scale 64; ArcFace: margin 28.6 degrees, scale 64). ``cross_entropy`` is PML's
  ``TrainWithClassifier`` with a linear classifier on the embedding and torch's cross entropy
  as its only loss;
- **the loss parameters' optimiser**: SGD at 0.01, PML's documented example for every loss
  with parameters (``optimizer = torch.optim.SGD(loss_func.parameters(), lr=0.01)``);
- **the batches**: powerful-benchmarker's default sampler for every loss, PML's
  ``MPerClassSampler`` with m = 4 in batches of 32;
- **the embedding**: PML's trunk + embedder split (the trunk, then one linear layer, no
  normalisation layer); the losses normalise through their own distances;
- **the training loop**: PML's ``MetricLossOnly`` / ``TrainWithClassifier``; embedding of the
  test images and PML's ``AccuracyCalculator`` (``k="max_bin_count"``) for the metrics.

What stays the preset's, equal for every loss in both benchmarks (the base config, not a
loss's recipe): the glyph set and its split (imgret's ``make_split``: the same test half,
folds and 1,600-image class cap), the ``small_cnn`` trunk at 32 px and 128-d, seeded the same
way, the network's AdamW rate with its cosine schedule (powerful-benchmarker's RMSprop at
1e-6 is a fine-tuning rate for a pretrained trunk; a trunk trained from scratch needs the
preset's), at most 4 epochs with validation MAP@R each epoch and patience 2. A fold whose best
validation epoch is still the untrained network did not learn; a loss with such a fold says
so instead of reporting numbers.

PML's ``MPerClassSampler`` draws from numpy's global generator, which PML leaves unseeded
and so does this check: the network's initialisation is seeded per run, the batches are not,
and a rerun gives other numbers within the intervals (contrastive, seed 0, fold 0: validation
MAP@R 0.276 in one run, 0.297 in another).

Each run trains 4 fold models per loss and scores them on the test half, alone (mean of the
4) and concatenated (512-d), as the preset's table does; the untrained networks of the same
seeds are scored beside them. Resumable (one JSON file per fold model in OUT), with progress
and an ETA.

Run: ``python benchmarks/reality_check_peer.py --runs 5 --out runs/reality-check-peer``
(writes OUT/results.json and OUT/results.md).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tqdm
from pytorch_metric_learning import losses, miners, samplers, trainers
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.reality_check_pml import (  # noqa: E402
    METRICS,
    EarlyStopping,
    cosine_decay,
    embed,
    fold_splits,
    interval,
    map_at_r,
)
from imgret.checkpoint import EmbeddingNet  # noqa: E402
from imgret.training.config import LossConfig, TrainConfig  # noqa: E402
from imgret.training.data.datasets import TrainDataset  # noqa: E402
from imgret.training.tune import BUDGETS  # noqa: E402

PRESET = "reality-check"
M_PER_CLASS = 4  # powerful-benchmarker's default sampler
LOSS_PARAM_LR = 0.01  # PML's documented SGD for a loss's own parameters

# name -> (num_classes, dim) -> (loss, miner); PML's default arguments throughout.
PeerLoss = Callable[[int, int], tuple[torch.nn.Module, torch.nn.Module | None]]
PEER: dict[str, PeerLoss] = {
    "contrastive": lambda n, d: (losses.ContrastiveLoss(), None),
    "multi_similarity": lambda n, d: (losses.MultiSimilarityLoss(),
                                      miners.MultiSimilarityMiner()),
    "triplet": lambda n, d: (losses.TripletMarginLoss(), None),
    "supcon": lambda n, d: (losses.SupConLoss(), None),
    "proxy_anchor": lambda n, d: (losses.ProxyAnchorLoss(num_classes=n, embedding_size=d),
                                  None),
    "proxy_nca": lambda n, d: (losses.ProxyNCALoss(num_classes=n, embedding_size=d), None),
    "normalized_softmax": lambda n, d: (
        losses.NormalizedSoftmaxLoss(num_classes=n, embedding_size=d), None),
    "cosface": lambda n, d: (losses.CosFaceLoss(num_classes=n, embedding_size=d), None),
    "arcface": lambda n, d: (losses.ArcFaceLoss(num_classes=n, embedding_size=d), None),
    "cross_entropy": lambda n, d: (torch.nn.CrossEntropyLoss(), None),
}


def fold_config(loss: str, seed: int, fold: int) -> TrainConfig:
    """The preset's base config for one fold model (the shared recipe's bare linear head)."""
    options = dict(BUDGETS[PRESET].options)
    return TrainConfig(data="glyphs", loss=LossConfig(name=loss), seed=seed, fold=fold,
                       recipe="shared", **options)


def train_fold(loss_name: str, config: TrainConfig, calculator: AccuracyCalculator
               ) -> tuple[EmbeddingNet, EmbeddingNet, dict[str, Any], TrainDataset]:
    """One fold model trained by PML at the peer's settings; also the same seed's untrained
    network and the test split."""
    spec, train_set, val_set, test = fold_splits(config)
    torch.manual_seed(config.seed)
    model = EmbeddingNet(spec)
    untrained = copy.deepcopy(model)
    num_classes = len(train_set.class_names)
    loss, miner = PEER[loss_name](num_classes, config.dim)
    models: dict[str, torch.nn.Module] = {"trunk": model.trunk, "embedder": model.head}
    network = [p for m in models.values() for p in m.parameters()]
    steps_per_epoch = len(train_set) // config.batch_size
    cosine = cosine_decay(steps_per_epoch * config.epochs)
    optimizers: dict[str, torch.optim.Optimizer] = {
        "trunk_optimizer": torch.optim.AdamW(network, lr=config.network_lr,
                                             weight_decay=config.weight_decay)}
    schedules = {"trunk_scheduler_by_iteration": torch.optim.lr_scheduler.LambdaLR(
        optimizers["trunk_optimizer"], cosine)}
    loss_funcs = {"metric_loss": loss}
    extra: dict[str, Any] = {}
    if loss_name == "cross_entropy":
        classifier = torch.nn.Linear(config.dim, num_classes)
        models["classifier"] = classifier
        optimizers["classifier_optimizer"] = torch.optim.SGD(classifier.parameters(),
                                                             lr=LOSS_PARAM_LR)
        # TrainWithClassifier adds the classifier's loss to the metric loss; weight 0 leaves
        # cross entropy alone.
        loss_funcs = {"metric_loss": losses.ContrastiveLoss(), "classifier_loss": loss}
        extra["loss_weights"] = {"metric_loss": 0.0, "classifier_loss": 1.0}
    elif list(loss.parameters()):
        optimizers["metric_loss_optimizer"] = torch.optim.SGD(loss.parameters(),
                                                              lr=LOSS_PARAM_LR)
    sampler = samplers.MPerClassSampler(train_set.targets, m=M_PER_CLASS,
                                        batch_size=config.batch_size,
                                        length_before_new_iter=len(train_set))
    stopping = EarlyStopping(model, val_set, calculator, config.patience)
    trainer_class = (trainers.TrainWithClassifier if loss_name == "cross_entropy"
                     else trainers.MetricLossOnly)
    trainer = trainer_class(
        models=models, optimizers=optimizers, batch_size=config.batch_size,
        loss_funcs=loss_funcs, mining_funcs={"tuple_miner": miner} if miner else {},
        dataset=train_set, sampler=sampler, dataloader_num_workers=0,
        iterations_per_epoch=steps_per_epoch, lr_schedulers=schedules,
        end_of_epoch_hook=stopping, **extra)
    trainer.train(num_epochs=config.epochs)
    return model, untrained, stopping.restore(), test


def run_folds(loss: str, seed: int, folds: int, out: Path, calculator: AccuracyCalculator,
              tick: Callable[[], None]) -> dict[str, Any]:
    """The run's fold models (each resumed from its file if done) scored on the test half."""
    trained, untrained, info, labels = [], [], [], None
    for fold in range(folds):
        path = out / loss / f"seed{seed}" / f"fold{fold}"
        if not (path / "fold.json").exists():
            start = time.perf_counter()
            model, blank, fold_info, test = train_fold(loss, fold_config(loss, seed, fold),
                                                       calculator)
            path.mkdir(parents=True, exist_ok=True)
            np.save(path / "test.npy", embed(model, test))
            np.save(path / "untrained.npy", embed(blank, test))
            np.save(path / "labels.npy", np.asarray(test.targets))
            fold_info["seconds"] = round(time.perf_counter() - start, 1)
            (path / "fold.json").write_text(json.dumps(fold_info))
        tick()
        info.append(json.loads((path / "fold.json").read_text()))
        trained.append(np.load(path / "test.npy"))
        untrained.append(np.load(path / "untrained.npy"))
        labels = np.load(path / "labels.npy")

    def score(vectors: list[np.ndarray]) -> tuple[float, float]:
        alone = float(np.mean([map_at_r(calculator, v, labels)["mean_average_precision_at_r"]
                               for v in vectors]))
        joined = np.concatenate(vectors, axis=1) / math.sqrt(len(vectors))
        return alone, map_at_r(calculator, joined, labels)["mean_average_precision_at_r"]

    alone, concatenated = score(trained)
    blank_alone, blank_concatenated = score(untrained)
    return {"seed": seed, "folds": info, "learned": all(f["learned"] for f in info),
            "alone": alone, "concatenated": concatenated,
            "untrained": {"alone": blank_alone, "concatenated": blank_concatenated}}


def summarise(loss: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and 95% t-interval over runs; none when a fold kept its untrained weights."""
    missing = sum(not r["learned"] for r in runs)
    row: dict[str, Any] = {"loss": loss, "runs": len(runs), "did_not_learn": missing,
                           "seconds_per_fold": float(np.mean(
                               [f["seconds"] for r in runs for f in r["folds"]]))}
    for kind in ("concatenated", "alone"):
        row[kind] = None if missing else interval([r[kind] for r in runs])
        row[f"untrained_{kind}"] = interval([r["untrained"][kind] for r in runs])
    return row


def table(rows: list[dict[str, Any]], seconds: float) -> str:
    def cell(value: tuple[float, float, float] | None, missing: int, of: int) -> str:
        if value is None:
            return f"did not learn ({missing} of {of} runs)"
        mean, low, high = value
        return f"{mean:.3f} ± {(high - low) / 2:.3f}"

    lines = [f"Test MAP@R on the preset's test half, PML's trainer at PML's settings "
             f"(mean ± 95% half-width over runs; {seconds / 60:.0f} min)", "",
             "| loss | concatenated (512-d) | alone (128-d) | untrained, concatenated | "
             "over untrained | s per fold model |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -(r["concatenated"] or (-1,))[0]):
        over = ("-" if r["concatenated"] is None else
                f"{r['concatenated'][0] - r['untrained_concatenated'][0]:+.3f}")
        lines.append(f"| {r['loss']} | {cell(r['concatenated'], r['did_not_learn'], r['runs'])}"
                     f" | {cell(r['alone'], r['did_not_learn'], r['runs'])} | "
                     f"{cell(r['untrained_concatenated'], 0, r['runs'])} | {over} | "
                     f"{r['seconds_per_fold']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--losses", default=",".join(PEER))
    parser.add_argument("--runs", type=int, default=5, help="seeds 0..N-1 per loss")
    parser.add_argument("--out", type=Path, default=Path("runs/reality-check-peer"))
    args = parser.parse_args()
    names = args.losses.split(",")
    unknown = sorted(set(names) - set(PEER))
    if unknown:
        raise SystemExit(f"unknown losses {unknown}; choose from {', '.join(PEER)}")
    tqdm.tqdm = functools.partial(tqdm.tqdm, disable=True)  # PML's per-epoch bars
    calculator = AccuracyCalculator(include=METRICS, k="max_bin_count",
                                    device=torch.device("cpu"))
    folds = BUDGETS[PRESET].options["cv_folds"]
    total, done, start = len(names) * args.runs * folds, 0, time.perf_counter()

    def tick() -> None:
        nonlocal done
        done += 1
        spent = time.perf_counter() - start
        eta = spent / done * (total - done)
        print(f"\r{done}/{total} fold models, {spent / 60:.1f} min, ETA {eta / 60:.1f} min",
              end="", flush=True)

    rows = [summarise(loss, [run_folds(loss, seed, folds, args.out, calculator, tick)
                             for seed in range(args.runs)]) for loss in names]
    seconds = time.perf_counter() - start
    print()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "seconds": seconds},
                                                      indent=2))
    text = table(rows, seconds)
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
