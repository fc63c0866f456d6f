"""The training loop: ``train(config, out) -> RunResult`` (what ``imgret train`` runs).

Reads top to bottom like nanoGPT's ``train.py``: data and split, model, loss (+ its own
optimiser when it has parameters), then per epoch: learning rate, forward/backward, step,
validation MAP@R through ``Embedder.from_model``, best checkpoint by validation only, resume
state. At the end the best checkpoint is evaluated once on the test split, beside two
baselines measured by the same function on the same images: raw pixels and the untrained
network (same architecture, same seed initialisation).

Run directory::

    model.pt      best checkpoint by validation MAP@R (imgret.checkpoint; `extra` holds the
                  config, split summary, per-epoch metrics, test metrics and baselines)
    last.pt       resume state (weights, loss parameters, optimisers, schedulers, RNG, history)
    metrics.json  config, split, per-epoch train loss / validation metrics / wall time,
                  best epoch, test metrics, baselines
    split.json    the exact split (members of train / val / test)
    curves.png    loss and validation MAP@R against epoch and wall time
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from imgret.checkpoint import EmbeddingNet, load_checkpoint, save_checkpoint
from imgret.files import write_atomic, write_atomic_with
from imgret.settings import resolve_device
from training.config import TrainConfig, TrainConfigError, config_diff
from training.data import (
    SeededMPerClassSampler,
    TrainDataset,
    describe_split,
    make_split,
    model_spec_for,
    open_source,
    resolve_m_per_class,
    stratified_subset,
    train_transform,
)
from training.distributed import Dist, ShardedBatchSampler, from_env, launched_by_torchrun
from training.evaluation import (
    EmbeddedSet,
    embed_split,
    format_metric,
    pixel_split,
    score_split,
    to_jsonable,
)
from training.plots import plot_run_curves
from training.registry import build_loss, resolve_miner, resolve_options

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
LAST_FILE = "last.pt"
SPLIT_FILE = "split.json"
CURVES_FILE = "curves.png"
SELECTION_METRIC = "map_at_r"
PLOT_EVERY_S = 60.0  # curves.png is redrawn during a run at most this often (and at the end)


@dataclass
class RunResult:
    """What a finished run reports (all of it is also in ``metrics.json``).

    Attributes:
        out: the run directory.
        best_epoch: the epoch whose checkpoint is ``model.pt`` (0 = untrained).
        val: validation metrics of the best epoch.
        test: test metrics of the best checkpoint (the test split is evaluated once).
        baselines: ``{"raw_pixels": metrics, "untrained": metrics}`` on the same test split.
        split: the split summary (protocol, classes, counts, digest).
        model_version: the version of ``model.pt``.
    """

    out: Path
    best_epoch: int
    val: dict[str, Any]
    test: dict[str, Any]
    baselines: dict[str, dict[str, Any]]
    split: dict[str, Any]
    model_version: str

    @classmethod
    def from_metrics(cls, out: Path, data: dict[str, Any]) -> RunResult:
        best = data["best"]
        return cls(out, best["epoch"], best["val"], data["test"], data["baselines"],
                   data["split"], data["model_version"])


def resolve_config(config: TrainConfig, num_train_classes: int) -> TrainConfig:
    """Fill in what depends on the data (``m_per_class``) so the saved config is complete."""
    m = resolve_m_per_class(config.batch_size, num_train_classes, config.m_per_class)
    return dataclasses.replace(config, m_per_class=m)


def train(
    config: TrainConfig, out: str | Path, *, resume: bool = False, progress: bool = True
) -> RunResult:
    """Train one model and evaluate it (the Reality-Check protocol).

    Args:
        config: the run's hyper-parameters.
        out: the run directory (created).
        resume: continue from ``out/last.pt``; the config must be the same. A finished run is
            not trained again (its result is returned).
        progress: show tqdm bars.

    Returns:
        The :class:`RunResult` (also written to ``out/metrics.json``).

    Raises:
        TrainConfigError: bad options, a config that differs from the run being resumed, or an
            existing run directory without ``--resume``.
        DatasetError, UnknownName: bad data or registry names (messages name the culprit).

    Under ``torchrun`` (``WORLD_SIZE`` > 1) the run is data-parallel (see
    :mod:`training.distributed`): every rank trains on its share of the batches, rank 0 alone
    validates and writes the run directory, and every rank returns the same result.
    """
    ddp = None
    if launched_by_torchrun():
        try:
            ddp = from_env(resolve_device(config.device))
        except (RuntimeError, ValueError) as exc:
            raise TrainConfigError(str(exc)) from None
    try:
        return _train(config, Path(out), resume=resume, progress=progress, ddp=ddp)
    finally:
        if ddp is not None:
            ddp.close()


def _train(
    config: TrainConfig, out: Path, *, resume: bool, progress: bool, ddp: Dist | None
) -> RunResult:
    is_main = ddp is None or ddp.is_main
    started = time.perf_counter()
    # Registry names and options are checked before any data is read.
    resolve_miner(config.loss.name, config.loss.miner)
    resolve_options(config.loss.name, config.loss.options)
    state_path = out / LAST_FILE
    if not resume and (state_path.exists() or (out / METRICS_FILE).exists()):
        raise TrainConfigError(
            f"{out}: already holds a run; pass --resume to continue it or choose another --out"
        )
    if resume and (out / METRICS_FILE).exists():
        previous = json.loads((out / METRICS_FILE).read_text())
        if previous.get("status") == "finished":
            _check_same_config(previous["config"], config, out)
            logger.info("%s: run already finished; nothing to do", out)
            return RunResult.from_metrics(out, previous)
    if ddp is not None:
        ddp.barrier()  # every rank has checked the run directory before rank 0 writes to it
        device = ddp.device
    else:
        try:
            device = resolve_device(config.device)
        except (RuntimeError, ValueError) as exc:
            raise TrainConfigError(str(exc)) from None
    device_type = "cuda" if device.startswith("cuda") else "cpu"

    # --- data and split
    source = open_source(config.data)
    split = make_split(source, config)
    summary = split.summary(source)
    spec = model_spec_for(config, source)
    train_set = TrainDataset(source, split.indices["train"],
                             train_transform(spec, config.augmentation))
    config = resolve_config(config, len(train_set.class_names))
    if is_main:
        logger.info("run %s: %s", out, config.short())
        logger.info("split: %s (%s)", describe_split(summary), split.rule)
    out.mkdir(parents=True, exist_ok=True)

    # --- model, loss, optimisers
    torch.manual_seed(config.seed)
    model = EmbeddingNet(spec, backbone_weights=config.backbone_weights).to(device)
    bundle = build_loss(
        config.loss.name, num_classes=len(train_set.class_names), embedding_size=config.dim,
        miner=config.loss.miner, options=config.loss.options,
    )
    bundle.loss.to(device)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=config.lr,
                                    weight_decay=config.weight_decay)]
    if bundle.has_params:
        # Proxies / class weights get their own optimiser and learning rate; no weight decay,
        # which would only shrink the scale a cosine classifier normalises away anyway.
        optimizers.append(torch.optim.AdamW(
            bundle.loss.parameters(), lr=config.lr * bundle.param_lr_mult, weight_decay=0.0
        ))
    sampler = SeededMPerClassSampler(
        train_set.targets, config.m_per_class, config.batch_size, len(train_set), config.seed
    )
    if ddp is None:
        loader = DataLoader(
            train_set, batch_size=config.batch_size, sampler=sampler, drop_last=True,
            num_workers=config.num_workers, pin_memory=device_type == "cuda",
            persistent_workers=config.num_workers > 0,
        )
    else:
        # Every rank draws the same seeded batches and keeps batches rank::world_size.
        loader = DataLoader(
            train_set,
            batch_sampler=ShardedBatchSampler(sampler, config.batch_size, ddp.rank,
                                              ddp.world_size),
            num_workers=config.num_workers, pin_memory=device_type == "cuda",
            persistent_workers=config.num_workers > 0,
        )
    steps_per_epoch = len(loader)
    total_steps = steps_per_epoch * config.epochs
    warmup_steps = int(round(config.warmup_epochs * steps_per_epoch))
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(warmup_steps, total_steps))
        for opt in optimizers
    ]
    evaluator = _Evaluator(config, source, split, device_type)

    # --- the run's record, or the state being resumed
    record: dict[str, Any] = {
        "status": "running", "config": config.to_dict(), "split": summary,
        "split_rule": split.rule, "model": spec.to_dict(),
        "loss": {"name": bundle.name, "miner": bundle.miner_name, "options": bundle.options,
                 "param_lr_mult": bundle.param_lr_mult if bundle.has_params else None},
        "steps_per_epoch": steps_per_epoch, "world_size": 1 if ddp is None else ddp.world_size,
        "epochs": [], "best": None,
    }
    start_epoch, train_time, prior_elapsed = 1, 0.0, 0.0
    if resume and state_path.exists():
        state = torch.load(state_path, map_location="cpu", weights_only=True)
        _check_same_config(state["config"], config, out)
        if state["split_digest"] != summary["digest"]:
            raise TrainConfigError(f"{out}: the data no longer gives the split of this run")
        model.load_state_dict(state["model"])
        bundle.loss.load_state_dict(state["loss"])
        for opt, opt_state in zip(optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        for sched, sched_state in zip(schedulers, state["schedulers"], strict=True):
            sched.load_state_dict(sched_state)
        torch.set_rng_state(state["rng"])
        record = state["record"]
        start_epoch = state["epoch"] + 1
        train_time = record["epochs"][-1]["train_time_s"]
        prior_elapsed = record["epochs"][-1]["elapsed_s"]
        world_size = 1 if ddp is None else ddp.world_size
        if record.get("world_size", 1) != world_size:
            logger.warning("%s: resuming with %d processes, the run had %d (steps per epoch "
                           "and the learning-rate schedule change)", out, world_size,
                           record.get("world_size", 1))
        record["world_size"] = world_size
        if is_main:
            logger.info("resuming %s after epoch %d", out, state["epoch"])
    elif is_main:
        (out / SPLIT_FILE).write_text(json.dumps(split.to_json(source), indent=1))
        # Epoch 0: the untrained network, so every curve starts from the same point and a
        # run that never beats its initialisation keeps the initialisation, honestly.
        val = evaluator.validate(model, epoch=0)
        _log_epoch(0, None, val, summary)
        record["epochs"].append(_epoch_row(0, None, None, 0.0, 0.0, 0, val))
        _keep_if_best(record, model, config, out, 0, val)
        _save_state(out, model, bundle, optimizers, schedulers, config, summary, 0, record)
        _write_record(out, record)
    net: torch.nn.Module = model
    if ddp is not None:
        ddp.barrier()  # rank 0 has validated the untrained network
        # DDP averages the network's gradients; the loss's own parameters (proxies, class
        # weights) are kept equal by broadcasting them now and averaging their gradients.
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[ddp.local_rank] if device_type == "cuda" else None
        )
        if bundle.has_params:
            ddp.broadcast_params(bundle.loss)

    # --- the loop
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device_type == "cuda"
                else contextlib.nullcontext())
    budget_hit = False
    last_plot = time.perf_counter()
    for epoch in range(start_epoch, config.epochs + 1):
        if budget_hit or (
            config.time_budget_s is not None
            and _any_rank(ddp, train_time >= config.time_budget_s)
        ):
            break
        sampler.set_epoch(epoch)
        if ddp is not None:
            # Each rank its own augmentation stream, reproducible on resume.
            torch.manual_seed(hash((config.seed, epoch, ddp.rank)) & 0xFFFF_FFFF)
        net.train()
        bundle.loss.train()
        epoch_start = time.perf_counter()
        losses, steps = [], 0
        bar = tqdm(loader, desc=f"epoch {epoch}/{config.epochs}", leave=False,
                   disable=not progress or not is_main, unit="batch")
        for images, labels in bar:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with autocast:
                embeddings = net(images)
            loss = bundle(embeddings.float(), labels)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            if ddp is not None and bundle.has_params:
                ddp.average_grads(bundle.loss.parameters())
            for opt in optimizers:
                opt.step()
            for sched in schedulers:
                sched.step()
            value = float(loss.detach())
            if ddp is not None:
                value = ddp.mean(value)  # the loss over all ranks' batches (same on each rank)
            if not math.isfinite(value):
                raise TrainConfigError(
                    f"loss {config.loss.name} became {value} at epoch {epoch}; lower --lr"
                )
            losses.append(value)
            steps += 1
            bar.set_postfix(loss=f"{value:.4f}")
            if config.time_budget_s is not None and _any_rank(ddp, (
                train_time + time.perf_counter() - epoch_start >= config.time_budget_s
            )):
                budget_hit = True
                if is_main:
                    logger.info("time budget of %.0f s reached in epoch %d",
                                config.time_budget_s, epoch)
                break
        train_time += time.perf_counter() - epoch_start
        train_loss = float(np.mean(losses)) if losses else None
        if not is_main:
            ddp.barrier()  # type: ignore[union-attr]  # rank 0 validates and saves
            continue
        # Validation sees the bare network (not the DDP wrapper) through Embedder.from_model.
        val = evaluator.validate(model, epoch=epoch)
        elapsed = prior_elapsed + time.perf_counter() - started
        _log_epoch(epoch, train_loss, val, summary)
        record["epochs"].append(_epoch_row(epoch, train_loss, schedulers[0].get_last_lr()[0],
                                           train_time, elapsed, steps, val))
        _keep_if_best(record, model, config, out, epoch, val)
        _save_state(out, model, bundle, optimizers, schedulers, config, summary, epoch, record)
        _write_record(out, record)
        if time.perf_counter() - last_plot > PLOT_EVERY_S:
            # Redrawing costs about a second: worth it for long epochs, not for short ones.
            plot_run_curves(record, out / CURVES_FILE)
            last_plot = time.perf_counter()
        if ddp is not None:
            ddp.barrier()

    if ddp is not None:
        # Equal on every rank when DDP kept the replicas in step (the DDP test compares them).
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        loss_checksum = sum(float(p.detach().double().sum()) for p in bundle.loss.parameters())
        logger.info("DDP rank %d final parameter checksum %.12e loss %.12e", ddp.rank, checksum,
                    loss_checksum)
        if not is_main:
            ddp.barrier()  # rank 0 evaluates the test split and writes the final record
            return RunResult.from_metrics(out, json.loads((out / METRICS_FILE).read_text()))

    # --- the test split, once, with the best checkpoint; the baselines on the same images
    best = load_checkpoint(out)
    test = evaluator.test(best.model.to(device))
    untrained = _untrained_model(config, spec, device)
    record["test"] = test
    record["baselines"] = {
        "raw_pixels": evaluator.test_pixels(),
        "untrained": evaluator.test(untrained),
    }
    record["model_version"] = best.model_version
    record["status"] = "finished"
    record["total_time_s"] = prior_elapsed + time.perf_counter() - started
    # Re-save the best weights with the test numbers in `extra` (same weights, same version).
    save_checkpoint(out, best.model.cpu(), extra=_checkpoint_extra(record))
    _write_record(out, record)
    plot_run_curves(record, out / CURVES_FILE)
    if ddp is not None:
        ddp.barrier()
    logger.info(
        "test MAP@R (%s): trained %s | untrained %s | raw pixels %s",
        describe_split(summary), format_metric(test),
        format_metric(record["baselines"]["untrained"]),
        format_metric(record["baselines"]["raw_pixels"]),
    )
    return RunResult.from_metrics(out, record)


class _Evaluator:
    """Builds the query / gallery sets of the protocol once and scores models on them."""

    def __init__(self, config: TrainConfig, source: Any, split: Any, device: str):
        # The exact search of the metrics runs where the model does (CUDA when training there).
        self.config, self.source, self.split, self.device = config, source, split, device
        self.gallery_indices: np.ndarray | None = None
        if config.protocol == "closed-set":
            # Queries are held-out images, the gallery the training images (capped, seeded).
            train_idx = split.indices["train"]
            cap = config.max_eval_images
            if cap is not None and len(train_idx) > cap:
                rng = np.random.default_rng([config.split_seed, 1])
                train_idx = stratified_subset(train_idx, source.labels, cap, rng)
            self.gallery_indices = train_idx

    def _score(self, embed: Any, split: str) -> dict[str, Any]:
        queries = embed(self.split.indices[split])
        gallery = embed(self.gallery_indices) if self.gallery_indices is not None else None
        return score_split(queries, gallery, device=self.device)

    def validate(self, model: EmbeddingNet, *, epoch: int) -> dict[str, Any]:
        return self._score(
            lambda idx: embed_split(model, self.source, idx, tag=f"epoch-{epoch}"), "val"
        )

    def test(self, model: EmbeddingNet) -> dict[str, Any]:
        return self._score(lambda idx: embed_split(model, self.source, idx, tag="test"), "test")

    def test_pixels(self) -> dict[str, Any]:
        def embed(idx: np.ndarray) -> EmbeddedSet:
            return pixel_split(self.source, idx, side=self.config.image_size)

        return self._score(embed, "test")


def _any_rank(ddp: Dist | None, flag: bool) -> bool:
    """``flag`` agreed by every rank (true when any rank says so); ``flag`` alone without DDP."""
    return flag if ddp is None else ddp.any(flag)


def _untrained_model(config: TrainConfig, spec: Any, device: str) -> EmbeddingNet:
    # Same seed, same construction order as the trained model: the same initial weights.
    rng = torch.get_rng_state()
    torch.manual_seed(config.seed)
    try:
        return EmbeddingNet(spec, backbone_weights=config.backbone_weights).to(device)
    finally:
        torch.set_rng_state(rng)


def _lr_lambda(warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _epoch_row(
    epoch: int, train_loss: float | None, lr: float | None, train_time: float, elapsed: float,
    steps: int, val: dict[str, Any],
) -> dict[str, Any]:
    return {"epoch": epoch, "train_loss": train_loss, "lr": lr, "steps": steps,
            "train_time_s": train_time, "elapsed_s": elapsed, "val": val}


def _log_epoch(epoch: int, loss: float | None, val: dict[str, Any], split: dict[str, Any]) -> None:
    loss_text = "-" if loss is None else f"{loss:.4f}"
    logger.info("epoch %d: train loss %s, validation MAP@R %s (%s split %s)", epoch, loss_text,
                format_metric(val), split["protocol"], split["digest"])


def _keep_if_best(
    record: dict[str, Any], model: EmbeddingNet, config: TrainConfig, out: Path, epoch: int,
    val: dict[str, Any],
) -> None:
    """Model selection on validation MAP@R only (ties keep the earlier epoch)."""
    best = record["best"]
    if best is None or val[SELECTION_METRIC] > best["val"][SELECTION_METRIC]:
        record["best"] = {"epoch": epoch, "metric": SELECTION_METRIC, "val": val}
        save_checkpoint(out, model, extra=_checkpoint_extra(record))


def _checkpoint_extra(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("config", "split", "split_rule", "loss", "best", "test", "baselines", "epochs")
    return to_jsonable({k: record[k] for k in keys if k in record})


def _save_state(
    out: Path, model: EmbeddingNet, bundle: Any, optimizers: list, schedulers: list,
    config: TrainConfig, summary: dict[str, Any], epoch: int, record: dict[str, Any],
) -> None:
    # The record travels with the weights so that the two can never disagree on resume.
    state = {
        "epoch": epoch, "config": config.to_dict(), "split_digest": summary["digest"],
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "loss": {k: v.detach().cpu() for k, v in bundle.loss.state_dict().items()},
        "optimizers": [opt.state_dict() for opt in optimizers],
        "schedulers": [sched.state_dict() for sched in schedulers],
        "rng": torch.get_rng_state(),
        "record": to_jsonable(record),
    }
    write_atomic_with(out / LAST_FILE, lambda handle: torch.save(state, handle))


def _write_record(out: Path, record: dict[str, Any]) -> None:
    write_atomic(out / METRICS_FILE, json.dumps(to_jsonable(record), indent=1).encode())


def _check_same_config(saved: dict[str, Any], config: TrainConfig, out: Path) -> None:
    current = config.to_dict()
    if saved.get("m_per_class") is not None and current.get("m_per_class") is None:
        current["m_per_class"] = saved["m_per_class"]  # resolved from the data at the start
    diff = config_diff(saved, current)
    if diff:
        details = "; ".join(f"{k}: run has {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise TrainConfigError(f"{out}: cannot resume with a different config ({details})")
