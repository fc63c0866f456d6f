"""The training loop: ``train(config, out) -> RunResult`` (what ``imgret train`` runs).

It reads top to bottom in named stages, like nanoGPT's ``train.py``:

1. :func:`prepare_data`: the source, its split and the training set;
2. :func:`build_parts`: the model, the loss (+ its own optimiser when it has parameters),
   learning-rate schedules, the seeded batches, all as the loss's recipe says
   (:mod:`imgret.training.recipe`: m-per-class or random batches, the BatchNorm neck, the
   loss parameters' rate, scales for the number of classes, a head warm-up);
3. :func:`start_run` (validates the untrained network as epoch 0: the bar every trained
   epoch must clear) or :func:`resume_run` (from ``last.pt``);
4. per epoch, :func:`train_one_epoch` (forward / backward / step) then
   :func:`validate_and_checkpoint` (validation MAP@R through ``Embedder.from_model``, the
   validation embeddings' geometry and the collapse rule of :mod:`imgret.training.geometry`,
   the best checkpoint by validation only, the resume state);
5. :func:`final_evaluation`: the best checkpoint evaluated once on the test split, beside two
   baselines measured by the same function on the same images: raw pixels and the untrained
   network (same architecture, same seed initialisation). A run whose best epoch is still
   epoch 0 did not learn: it is recorded so (``"learned": false``), logged as an error, and
   no model is saved.

Every stage calls a :class:`~imgret.training.distributed.Distributed` unconditionally: for one
process
its collectives do nothing; under ``torchrun`` it is DDP. What the run writes is described in
:mod:`imgret.training.run_dir`.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from imgret.checkpoint import (
    CHECKPOINT_FILE,
    EmbeddingNet,
    ModelSpec,
    load_checkpoint,
    save_checkpoint,
)
from imgret.training.config import TrainConfig, TrainConfigError
from imgret.training.data import (
    DataSplit,
    ImageSource,
    MPerClassSampler,
    RandomBatchSampler,
    TrainDataset,
    describe_split,
    image_sizes,
    make_split,
    model_spec_for,
    open_source,
    plan_batches,
    plan_random_batches,
    train_transform,
)
from imgret.training.defaults import (
    SAMPLE_IMAGES,
    SIDE_STEP,
    auto_image_size,
    image_size_range,
)
from imgret.training.distributed import Distributed, ShardedBatchSampler, connect
from imgret.training.geometry import collapse
from imgret.training.plots import plot_run_curves
from imgret.training.recipe import RANDOM, class_count_options, loss_param_lr, recipe_for
from imgret.training.registry import (
    LossBundle,
    build_loss,
    resolve_miner,
    resolve_miner_options,
    resolve_options,
)
from imgret.training.run_dir import (
    CURVES_FILE,
    LAST_FILE,
    RunResult,
    checkpoint_extra,
    epoch_row,
    finished_run,
    keep_if_best,
    load_state,
    not_learned_message,
    read_record,
    save_state,
    write_record,
    write_split,
)
from imgret.training.scoring import (
    VERDICT_BOOTSTRAP,
    Evaluator,
    baseline_verdicts,
    format_metric,
    small_split_warning,
    to_jsonable,
    verdict_lines,
)

logger = logging.getLogger(__name__)

PLOT_EVERY_S = 60.0  # curves.png is redrawn during a run at most this often (and at the end)


class LossDiverged(TrainConfigError):
    """The training loss became NaN or infinite (usually: the learning rate is too high)."""


def train(
    config: TrainConfig, out: str | Path, *, resume: bool = False, progress: bool = True,
    test: bool = True,
) -> RunResult:
    """Train one model and evaluate it (the Reality-Check protocol).

    Args:
        config: the run's hyper-parameters.
        out: the run directory (created).
        resume: continue from ``out/last.pt``; the config must be the same. A finished run is
            not trained again (its result is returned).
        progress: show tqdm bars.
        test: evaluate the test split and the baselines at the end. A tuning trial passes
            ``False``: it is judged on validation only and never sees the test split (its
            result's ``test`` and ``baselines`` are ``None``).

    Returns:
        The :class:`RunResult` (also written to ``out/metrics.json``).

    Raises:
        TrainConfigError: bad options, a config that differs from the run being resumed, or an
            existing run directory without ``--resume``.
        DatasetError, UnknownName: bad data or registry names (messages name the culprit).

    Under ``torchrun`` (``WORLD_SIZE`` > 1) the run is data-parallel (see
    :mod:`imgret.training.distributed`): every rank trains on its share of the batches, rank 0 alone
    validates and writes the run directory, and every rank returns the same result.
    """
    out = Path(out)
    # Registry names and options are checked before any data is read.
    resolve_miner(config.loss.name, config.loss.miner)
    resolve_options(config.loss.name, config.loss.options)
    resolve_miner_options(resolve_miner(config.loss.name, config.loss.miner),
                          config.loss.miner_options)
    finished = finished_run(config, out, resume=resume)
    if finished is not None:
        logger.info("%s: run already finished; nothing to do", out)
        return finished
    dist = connect(config.device)
    try:
        started = time.perf_counter()
        dist.barrier()  # every rank has checked the run directory before rank 0 writes to it
        data = prepare_data(config, out, dist)
        parts = build_parts(data, dist)
        if resume and (out / LAST_FILE).exists():
            run = resume_run(data, parts, out, dist)
        else:
            run = start_run(data, parts, out, dist)
        dist.barrier()  # rank 0 has validated the untrained network
        net = dist.wrap(parts.model, parts.bundle.loss if parts.bundle.has_params else None)
        for epoch in range(run.next_epoch, data.config.epochs + 1):
            if run.budget_hit or over_budget(data.config, dist, run.train_time):
                break
            if dist.any(dist.is_main and out_of_patience(run.record, data.config.patience)):
                if dist.is_main:
                    logger.info("early stop after epoch %d: no better validation MAP@R "
                                "since epoch %d (patience %d)", run.record["epochs"][-1]["epoch"],
                                run.record["best"]["epoch"], data.config.patience)
                break
            if dist.any(dist.is_main and run.record.get("collapse") is not None):
                break  # validate_and_checkpoint logged it
            train_loss, steps = train_one_epoch(epoch, net, data, parts, run, dist, progress)
            if dist.is_main:  # rank 0 validates and saves; the others wait
                validate_and_checkpoint(epoch, train_loss, steps, data, parts, run, out, started)
            dist.barrier()
        dist.report_checksums(parts.model, parts.bundle.loss)
        if dist.is_main:  # rank 0 evaluates the test split and writes the final record
            final_evaluation(data, parts, run, out, dist, started, test=test)
        dist.barrier()
        return RunResult.from_metrics(out, read_record(out))
    finally:
        dist.close()


# ----------------------------------------------------------------------------- stages


@dataclass
class Data:
    """The run's data.

    Attributes:
        config: the run's config, ``m_per_class`` resolved from the data.
        source: the images.
        split: its train / val / test split.
        summary: the split's summary (protocol, classes, counts, digest).
        spec: the model spec the source implies (greyscale normalisation).
        train_set: the training split as a Dataset.
        requested_batch: ``batch_size`` and ``m_per_class`` as asked, before they were fitted
            to the data (a finished run is compared on these).
    """

    config: TrainConfig
    source: ImageSource
    split: DataSplit
    summary: dict[str, Any]
    spec: ModelSpec
    train_set: TrainDataset
    requested_batch: dict[str, int | None]


@dataclass
class Parts:
    """What trains, and how it is judged.

    Attributes:
        model: the bare network (validation and checkpoints see this, never a DDP wrapper).
        bundle: the loss (+ miner).
        loss_params: the loss's own parameters (empty when it has none).
        optimizers: the network's AdamW, then the loss's when it has parameters.
        schedulers: one warmup + cosine schedule per optimiser.
        sampler: the seeded sampler (m-per-class or random batches, by the recipe).
        loader: this process's batches of it.
        evaluator: the validation / test sets of the protocol.
    """

    model: EmbeddingNet
    bundle: LossBundle
    loss_params: list[torch.nn.Parameter]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LambdaLR]
    sampler: MPerClassSampler | RandomBatchSampler
    loader: DataLoader
    evaluator: Evaluator

    def state_dict(self) -> dict[str, Any]:
        """Weights, loss parameters, optimisers and schedulers (CPU tensors), for ``last.pt``."""
        return {
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "loss": {k: v.detach().cpu() for k, v in self.bundle.loss.state_dict().items()},
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "schedulers": [sched.state_dict() for sched in self.schedulers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.model.load_state_dict(state["model"])
        self.bundle.loss.load_state_dict(state["loss"])
        for opt, opt_state in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        for sched, sched_state in zip(self.schedulers, state["schedulers"], strict=True):
            sched.load_state_dict(sched_state)


@dataclass
class Run:
    """Where the run stands.

    Attributes:
        record: what ``metrics.json`` holds so far.
        next_epoch: the first epoch still to train.
        train_time: seconds spent training so far (the time budget counts these).
        prior_elapsed: wall seconds of the run before this process (resumed runs).
        budget_hit: the time budget ran out.
        last_plot: when ``curves.png`` was last drawn (``time.perf_counter``).
    """

    record: dict[str, Any]
    next_epoch: int
    train_time: float = 0.0
    prior_elapsed: float = 0.0
    budget_hit: bool = False
    last_plot: float = dataclasses.field(default_factory=time.perf_counter)


def prepare_data(config: TrainConfig, out: Path, dist: Distributed) -> Data:
    """Open the source, split it, build the training set; create the run directory."""
    source = open_source(config.data)
    split = make_split(source, config)
    summary = split.summary(source)
    if config.image_size is None:
        config = dataclasses.replace(config, image_size=measure_image_size(
            config, source, split.indices["train"], log=dist.is_main))
    spec = model_spec_for(config, source)
    train_set = TrainDataset(source, split.indices["train"],
                             train_transform(spec, config.augmentation))
    if config.control == "shuffled_labels":
        # Seeded by the split and the run, so every loss of a benchmark sees the same labels.
        train_set.shuffle_labels(np.random.default_rng([config.split_seed, config.seed, 7]))
    requested_batch = {"batch_size": config.batch_size, "m_per_class": config.m_per_class}
    config = resolve_config(config, np.bincount(train_set.targets), dist.world_size,
                            log=dist.is_main)
    if dist.is_main:
        recipe = recipe_for(config)
        logger.info("recipe %s (%s family): %s batches, %s neck%s", recipe.name,
                    recipe.family, recipe.sampler, recipe.neck,
                    f", head warm-up {recipe.head_warmup_epochs} epoch(s)"
                    if recipe.head_warmup_epochs else "")
    if dist.is_main:
        logger.info("run %s: %s", out, config.short())
        logger.info("split: %s (%s)", describe_split(summary), split.rule)
    out.mkdir(parents=True, exist_ok=True)
    return Data(config, source, split, summary, spec, train_set, requested_batch)


def measure_image_size(config: TrainConfig, source: ImageSource, train: np.ndarray, *,
                       log: bool = True) -> int:
    """The input side of a run that did not set one: from a seeded sample of its training
    images (:func:`imgret.training.defaults.auto_image_size`)."""
    rng = np.random.default_rng([config.split_seed, 11])
    sample = np.sort(rng.permutation(np.asarray(train))[:SAMPLE_IMAGES])
    sizes = image_sizes(source, sample)
    pretrained = config.backbone_weights is not None
    side = auto_image_size(sizes, config.backbone, pretrained)
    if log:
        low, high = image_size_range(config.backbone, pretrained)
        logger.info("image size %d px: the median side of %d training images, rounded to %d "
                    "and kept within %d-%d px for %s%s (--image-size sets it)", side,
                    len(sizes), SIDE_STEP, low, high, config.backbone,
                    " from pretrained weights" if pretrained else "")
    return side


def resolve_config(
    config: TrainConfig, class_sizes: np.ndarray, world_size: int = 1, *, log: bool = True
) -> TrainConfig:
    """Fill in what depends on the data (the batch composition, lowered to fit a small split
    with a warning saying why) so the saved config is complete. Random batches (the recipe of
    proxy and classifier losses) only need to fit the split; ``m_per_class`` is kept as asked
    (it does not apply to them) unless the batch had to shrink below it."""
    if recipe_for(config).sampler == RANDOM:
        batch, changes = plan_random_batches(config.batch_size, int(np.sum(class_sizes)),
                                             world_size=world_size)
        if log:
            for change in changes:
                logger.warning("%s", change)
            logger.info("batches of %d: random, any classes", batch)
        m = config.m_per_class
        return dataclasses.replace(config, batch_size=batch,
                                   m_per_class=m if m is not None and batch % m == 0 else None)
    plan = plan_batches(config.batch_size, config.m_per_class, class_sizes,
                        world_size=world_size)
    if log:
        for change in plan.changes:
            logger.warning("%s", change)
        logger.info("%s", plan.describe())
    return dataclasses.replace(config, batch_size=plan.batch_size, m_per_class=plan.m_per_class)


def build_parts(data: Data, dist: Distributed) -> Parts:
    """The seeded model, the loss, optimisers, schedules and this process's batches."""
    config, train_set = data.config, data.train_set
    torch.manual_seed(config.seed)
    model = EmbeddingNet(data.spec, backbone_weights=config.backbone_weights).to(dist.device)
    num_classes = len(train_set.class_names)
    bundle = build_loss(
        config.loss.name, num_classes=num_classes, embedding_size=config.dim,
        miner=config.loss.miner, options=class_count_options(config, num_classes),
        miner_options=config.loss.miner_options, param_lr_mult=config.loss.param_lr_mult,
    )
    bundle.loss.to(dist.device)
    loss_params = list(bundle.loss.parameters()) if bundle.has_params else []
    optimizers = [torch.optim.AdamW(model.parameters(), lr=config.network_lr,
                                    weight_decay=config.weight_decay)]
    if loss_params:
        # Proxies / class weights get their own optimiser and learning rate; no weight decay,
        # which would only shrink the scale a cosine classifier normalises away anyway.
        optimizers.append(torch.optim.AdamW(loss_params, lr=loss_param_lr(config),
                                            weight_decay=0.0))
    sampler: MPerClassSampler | RandomBatchSampler
    if recipe_for(config).sampler == RANDOM:
        sampler = RandomBatchSampler(len(train_set), config.batch_size, config.seed)
    else:
        sampler = MPerClassSampler(
            train_set.targets, config.m_per_class, config.batch_size, len(train_set),
            config.seed
        )
    # Every process draws the same seeded batches and keeps its share (all of them alone).
    on_cuda = dist.device.startswith("cuda")
    loader = DataLoader(
        train_set,
        batch_sampler=ShardedBatchSampler(sampler, config.batch_size, dist.rank,
                                          dist.world_size),
        num_workers=config.num_workers, pin_memory=on_cuda,
        persistent_workers=config.num_workers > 0,
    )
    total_steps = len(loader) * config.epochs
    warmup_steps = int(round(config.warmup_epochs * len(loader)))
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(warmup_steps, total_steps))
        for opt in optimizers
    ]
    evaluator = Evaluator(config, data.source, data.split, "cuda" if on_cuda else "cpu")
    return Parts(model, bundle, loss_params, optimizers, schedulers, sampler, loader, evaluator)


def start_run(data: Data, parts: Parts, out: Path, dist: Distributed) -> Run:
    """A new record; rank 0 writes ``split.json`` and validates the untrained network as
    epoch 0, so every curve starts from the same point and a run that never beats its
    initialisation keeps the initialisation, honestly."""
    record = _new_record(data, parts, dist)
    if dist.is_main:
        write_split(out, data.split, data.source)
        val, geometry = parts.evaluator.validate(parts.model, epoch=0)
        _checkpoint(epoch_row(0, None, None, 0.0, 0.0, 0, val, geometry), data, parts, record,
                    out)
    return Run(record, next_epoch=1)


def resume_run(data: Data, parts: Parts, out: Path, dist: Distributed) -> Run:
    """Every process restores ``last.pt``: weights, optimisers, schedules, RNG and record."""
    state = load_state(out, data.config, data.summary["digest"])
    parts.load_state_dict(state)
    torch.set_rng_state(state["rng"])
    record = state["record"]
    last = record["epochs"][-1]
    if record.get("world_size", 1) != dist.world_size:
        logger.warning("%s: resuming with %d processes, the run had %d (steps per epoch "
                       "and the learning-rate schedule change)", out, dist.world_size,
                       record.get("world_size", 1))
    record["world_size"] = dist.world_size
    if dist.is_main:
        logger.info("resuming %s after epoch %d", out, state["epoch"])
    return Run(record, state["epoch"] + 1, last["train_time_s"], last["elapsed_s"])


def over_budget(config: TrainConfig, dist: Distributed, train_time: float) -> bool:
    """The time budget is spent (on any process)."""
    return config.time_budget_s is not None and dist.any(train_time >= config.time_budget_s)


def out_of_patience(record: dict[str, Any], patience: int | None) -> bool:
    """Early stopping: ``patience`` validated epochs have passed since the best one (read
    from the record, so a resumed run stops where an unbroken one would)."""
    if patience is None or not record["epochs"] or record["best"] is None:
        return False
    return record["epochs"][-1]["epoch"] - record["best"]["epoch"] >= patience


def train_one_epoch(
    epoch: int, net: torch.nn.Module, data: Data, parts: Parts, run: Run, dist: Distributed,
    progress: bool,
) -> tuple[float | None, int]:
    """One pass over this process's batches (cut short by the time budget).

    Returns:
        The mean training loss over every process's batches (``None`` without a step), and
        the number of steps.
    """
    config = data.config
    parts.sampler.set_epoch(epoch)
    dist.seed_epoch(config.seed, epoch)
    net.train()
    parts.bundle.loss.train()
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dist.device.startswith("cuda")
                else contextlib.nullcontext())
    # The recipe's head warm-up: the trunk's gradients are dropped (after DDP has averaged
    # them, so every rank does the same) and AdamW skips parameters without one.
    frozen = (list(parts.model.trunk.parameters())
              if epoch <= recipe_for(config).head_warmup_epochs else [])
    epoch_start = time.perf_counter()
    losses = []
    bar = tqdm(parts.loader, desc=f"epoch {epoch}/{config.epochs}", leave=False,
               disable=not (progress and dist.is_main), unit="batch")
    for images, labels in bar:
        images = images.to(dist.device, non_blocking=True)
        labels = labels.to(dist.device, non_blocking=True)
        with autocast:
            embeddings = net(images)
        loss = parts.bundle(embeddings.float(), labels)
        for opt in parts.optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        dist.average_grads(parts.loss_params)
        for param in frozen:
            param.grad = None
        for opt in parts.optimizers:
            opt.step()
        for sched in parts.schedulers:
            sched.step()
        value = dist.mean(float(loss.detach()))  # the loss over all processes' batches
        if not math.isfinite(value):
            raise LossDiverged(
                f"loss {config.loss.name} became {value} at epoch {epoch}; lower --lr"
            )
        losses.append(value)
        bar.set_postfix(loss=f"{value:.4f}")
        if over_budget(config, dist, run.train_time + time.perf_counter() - epoch_start):
            run.budget_hit = True
            if dist.is_main:
                logger.info("time budget of %.0f s reached in epoch %d",
                            config.time_budget_s, epoch)
            break
    run.train_time += time.perf_counter() - epoch_start
    return (float(np.mean(losses)) if losses else None), len(losses)


def validate_and_checkpoint(
    epoch: int, train_loss: float | None, steps: int, data: Data, parts: Parts, run: Run,
    out: Path, started: float,
) -> None:
    """Validate the bare network, record the epoch and its embeddings' geometry, keep the best
    checkpoint, record a collapse (which stops the run), save the resume state; redraw the
    curves now and then."""
    val, geometry = parts.evaluator.validate(parts.model, epoch=epoch)
    elapsed = run.prior_elapsed + time.perf_counter() - started
    lr = parts.schedulers[0].get_last_lr()[0]
    row = epoch_row(epoch, train_loss, lr, run.train_time, elapsed, steps, val, geometry)
    collapsed = collapse([*run.record["epochs"], row])
    if collapsed is not None:
        logger.error("%s", collapsed["message"])
        run.record["collapse"] = collapsed
    _checkpoint(row, data, parts, run.record, out)
    if time.perf_counter() - run.last_plot > PLOT_EVERY_S:
        # Redrawing costs about a second: worth it for long epochs, not for short ones.
        plot_run_curves(run.record, out / CURVES_FILE)
        run.last_plot = time.perf_counter()


def final_evaluation(
    data: Data, parts: Parts, run: Run, out: Path, dist: Distributed, started: float,
    *, test: bool = True,
) -> None:
    """The test split, once, with the best checkpoint; the baselines on the same images.
    Writes the final record, ``model.pt`` with the test numbers, and the curves. Without
    ``test`` (a tuning trial) the record ends at validation and the test split stays unseen."""
    record = run.record
    record["learned"] = learned = record["best"]["epoch"] > 0
    record.setdefault("collapse", None)
    record["test"] = record["baselines"] = record["verdict"] = None
    # Where training ended: the last validated epoch, and whether patience ended it.
    record["stopped_epoch"] = record["epochs"][-1]["epoch"]
    record["early_stopped"] = out_of_patience(record, data.config.patience)
    record["status"] = "finished"
    if not learned:
        _finish_unlearned(data, parts, record, out, dist, started, run, test=test)
        return
    best = load_checkpoint(out)
    if test:
        untrained = _untrained_model(data.config, data.spec, dist.device)
        scored = parts.evaluator.test(best.model.to(dist.device), per_query=True)
        baselines = _baselines(parts, untrained)
        record["verdict"] = {
            "baselines": baseline_verdicts(scored, baselines),
            "interval": f"paired percentile bootstrap 95%, {VERDICT_BOOTSTRAP} resamples of "
                        "the test queries",
            "small_split_warning": small_split_warning(data.summary),
        }
        # The per-query values served the verdict; the record keeps the summaries only.
        record["test"] = _without_per_query(scored)
        record["baselines"] = {k: _without_per_query(v) for k, v in baselines.items()}
    record["model_version"] = best.model_version
    record["total_time_s"] = run.prior_elapsed + time.perf_counter() - started
    # Re-save the best weights with the test numbers in `extra` (same weights, same version).
    save_checkpoint(out, best.model.cpu(), extra=checkpoint_extra(record))
    write_record(out, record)
    plot_run_curves(record, out / CURVES_FILE)
    if test:
        logger.info(
            "test MAP@R (%s): trained %s | untrained %s | raw pixels %s",
            describe_split(data.summary), format_metric(record["test"]),
            format_metric(record["baselines"]["untrained"]),
            format_metric(record["baselines"]["raw_pixels"]),
        )
        for line in verdict_lines(record["verdict"]):
            logger.info("%s", line)


def _finish_unlearned(
    data: Data, parts: Parts, record: dict[str, Any], out: Path, dist: Distributed,
    started: float, run: Run, *, test: bool,
) -> None:
    """The end of a run whose best epoch is the untrained network: no model, no test of one;
    the baselines are still measured (a benchmark's baseline rows read them), and the
    failure is logged as an error."""
    # A model.pt here could only be the untrained network (from a run written before epoch 0
    # stopped being saved): it must not pass for a trained model.
    (out / CHECKPOINT_FILE).unlink(missing_ok=True)
    if test:
        untrained = _untrained_model(data.config, data.spec, dist.device)
        record["baselines"] = {k: _without_per_query(v)
                               for k, v in _baselines(parts, untrained).items()}
    record["model_version"] = None
    record["total_time_s"] = run.prior_elapsed + time.perf_counter() - started
    write_record(out, record)
    plot_run_curves(record, out / CURVES_FILE)
    logger.error("%s: %s", out, not_learned_message(record["best"]["val"], record["collapse"]))


def _baselines(parts: Parts, untrained: EmbeddingNet) -> dict[str, dict[str, Any]]:
    return {"raw_pixels": parts.evaluator.test_pixels(per_query=True),
            "untrained": parts.evaluator.test(untrained, per_query=True)}


# ----------------------------------------------------------------------------- helpers


def _new_record(data: Data, parts: Parts, dist: Distributed) -> dict[str, Any]:
    bundle = parts.bundle
    return {
        "status": "running", "config": data.config.to_dict(),
        "requested_batch": data.requested_batch, "split": data.summary,
        "split_rule": data.split.rule, "model": data.spec.to_dict(),
        "loss": {"name": bundle.name, "miner": bundle.miner_name, "options": bundle.options,
                 "param_lr_mult": bundle.param_lr_mult if bundle.has_params else None,
                 "param_lr": loss_param_lr(data.config) if bundle.has_params else None,
                 "lr": data.config.network_lr,
                 "miner_options": resolve_miner_options(bundle.miner_name,
                                                        data.config.loss.miner_options)},
        "recipe": dataclasses.asdict(recipe_for(data.config)),
        "steps_per_epoch": len(parts.loader), "world_size": dist.world_size,
        "epochs": [], "best": None,
    }


def _checkpoint(
    row: dict[str, Any], data: Data, parts: Parts, record: dict[str, Any], out: Path
) -> None:
    """Log and record an epoch, keep its network if it is the best, save the resume state."""
    epoch = row["epoch"]
    loss_text = "-" if row["train_loss"] is None else f"{row['train_loss']:.4f}"
    logger.info("epoch %d: train loss %s, validation MAP@R %s (%s split %s)", epoch, loss_text,
                format_metric(row["val"]), data.summary["protocol"], data.summary["digest"])
    record["epochs"].append(row)
    keep_if_best(record, parts.model, out, epoch, row["val"])
    _save_state(out, data, parts, record, epoch=epoch)
    write_record(out, record)


def _save_state(
    out: Path, data: Data, parts: Parts, record: dict[str, Any], *, epoch: int
) -> None:
    # The record travels with the weights so that the two can never disagree on resume.
    save_state(out, {
        "epoch": epoch, "config": data.config.to_dict(), "split_digest": data.summary["digest"],
        **parts.state_dict(), "rng": torch.get_rng_state(), "record": to_jsonable(record),
    })


def _without_per_query(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k != "per_query"}


def _untrained_model(config: TrainConfig, spec: ModelSpec, device: str) -> EmbeddingNet:
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
