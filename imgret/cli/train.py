"""CLI commands: train (one run), benchmark (losses x seeds on one base config) and tune
(equal-budget tuning of every loss, then the benchmark of the best configurations).

The commands take the same base-config options: one per TrainConfig field, its type, default
and help read from the field (:func:`with_config_options`), so no option is written twice.
torch and the rest of the training package are imported inside the commands so that
`imgret --help` stays fast.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import sys
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Annotated, Any, Literal, get_origin

import typer

from imgret.training.config import (
    DEFAULT_LOSSES,
    OPTIONAL_FIELDS,
    LossConfig,
    TrainConfig,
    default_image_size,
)
from imgret.training.defaults import (
    DEFAULT_BACKBONE,
    DEFAULT_LOSS,
    FALLBACK_BACKBONE,
    IMAGE_SIZE_RANGE,
    IMAGE_SIZE_RANGES,
    SAMPLE_IMAGES,
    SIDE_STEP,
    TRAIN_DEFAULTS,
    default_trunk,
)

_BASE = "Base config (shared by every loss in a benchmark)"
# `imgret train`'s exit status for a run that finished without learning (2: bad options or
# data, as every imgret command), so a script can tell the two apart.
NOT_LEARNED_EXIT = 3
# The base-config options of both commands, in the order --help lists them.
BASE_OPTIONS = (
    "data", "backbone", "dim", "epochs", "image_size", "batch_size", "m_per_class", "lr",
    "weight_decay", "warmup_epochs", "protocol", "split_seed", "val_fraction", "test_fraction",
    "backbone_weights", "max_train_images", "train_cap", "max_eval_images", "time_budget_s",
    "augmentation", "device", "num_workers", "cv_folds", "patience", "recipe",
)
# Where an option differs from its field: a run must name its data, the input side defaults by
# data set (resolved in _config), the trunk weights are a path, and the budget flag is shorter.
_OPTION_CHANGES: dict[str, dict[str, Any]] = {
    "data": {"default": inspect.Parameter.empty},
    "image_size": {"type": int | None, "default": None,
                   "help": "input side in px; default 32 for fashion-mnist and glyphs, else 224"},
    "backbone_weights": {"type": Path | None},
    "time_budget_s": {"flag": "--time-budget"},
}


def _small_ranges() -> str:
    ranges: dict[tuple[int, int], list[str]] = {}
    for backbone, bounds in sorted(IMAGE_SIZE_RANGES.items()):
        ranges.setdefault(bounds, []).append(backbone)
    return "; ".join(f"{low}-{high} for {' and '.join(names)}"
                     for (low, high), names in ranges.items())


# `imgret train`'s own defaults (imgret.training.defaults), over _OPTION_CHANGES: the data may
# come as the DATA argument, the trunk and its weights are chosen together, the input side is
# measured on the training images (by the training loop), and nothing changes an image's
# identity unless asked.
TRAIN_OPTION_CHANGES: dict[str, dict[str, Any]] = {
    "data": {"type": str | None, "default": None,
             "help": "the DATA argument, given as an option"},
    "backbone": {"type": str | None, "default": None, "help": (
        "tiny_cnn, small_cnn, resnet18, resnet50, efficientnet_b0, mobilenet_v2, "
        f"convnext_tiny, vit_b_16; default: {DEFAULT_BACKBONE} from its ImageNet weights "
        f"(the pretrained extra), or {FALLBACK_BACKBONE} from random init, with a warning, "
        "where that is not installed")},
    "backbone_weights": {"help": (
        "local torchvision state dict for the trunk, or imagenet: the ImageNet weights an "
        "installed package ships (mobilenet_v2; the pretrained extra); nothing is "
        "downloaded; default: imagenet for the default trunk, random init for a --backbone")},
    "image_size": {"help": (
        f"input side in px; default: the median side (sqrt(width x height)) of "
        f"{SAMPLE_IMAGES} training images, rounded to {SIDE_STEP} and kept within "
        f"{IMAGE_SIZE_RANGE[0]}-{IMAGE_SIZE_RANGE[1]} px ({_small_ranges()})")},
    "epochs": {"default": TRAIN_DEFAULTS["epochs"]},
    "time_budget_s": {"default": TRAIN_DEFAULTS["time_budget_s"]},
    "augmentation": {"default": TRAIN_DEFAULTS["augmentation"], "help": (
        "none (the images as they come) or standard (random resized crop + horizontal flip "
        "+ colour jitter: can change what a character or a glyph is)")},
}
# The default of a command parameter that is the option of the TrainConfig field of its name.
FROM_CONFIG: Any = object()

OutOpt = Annotated[Path, typer.Option("--out", help="run (or benchmark) directory")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="tqdm bars")]
LossesOpt = Annotated[str, typer.Option(
    "--losses", help="comma-separated loss[:miner], e.g. triplet,triplet:hard,arcface")]
ControlsOpt = Annotated[str, typer.Option(
    "--controls", help="comma-separated control rows trained with the first loss: "
    "shuffled_labels (labels permuted), oracle (trained on the test classes)")]


def config_option(name: str, panel: str | None = None,
                  command_changes: dict[str, dict[str, Any]] | None = None) -> inspect.Parameter:
    """The Typer option of TrainConfig field ``name``: flag, type, default and help (a
    command's own changes over :data:`_OPTION_CHANGES`)."""
    field = TrainConfig.__pydantic_fields__[name]
    changes = {**_OPTION_CHANGES.get(name, {}), **(command_changes or {}).get(name, {})}
    kind = changes.get("type", field.annotation)
    if get_origin(kind) is Literal:  # shown and parsed as text; TrainConfig names the choices
        kind = str
    option = typer.Option(
        changes.get("flag", "--" + name.replace("_", "-")),
        help=changes.get("help", field.description), rich_help_panel=panel,
    )
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[kind, option],
        default=changes.get("default", field.default),
    )


def with_config_options(
    command: Callable[..., None] | None = None, *,
    changes: dict[str, dict[str, Any]] | None = None,
) -> Any:
    """Give a command its TrainConfig options: its ``**base`` becomes the :data:`BASE_OPTIONS`
    (in the base-config panel), and a parameter whose default is :data:`FROM_CONFIG` becomes
    the option of the field of that name. ``@with_config_options(changes=...)`` gives the
    command its own defaults and help for some of them."""
    if command is None:
        return lambda function: with_config_options(function, changes=changes)
    parameters = []
    for parameter in inspect.signature(command, eval_str=True).parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            parameters += [config_option(name, _BASE, changes) for name in BASE_OPTIONS]
        elif parameter.default is FROM_CONFIG:
            parameters.append(config_option(parameter.name, None, changes))
        else:
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    return command


def register(app: typer.Typer, *, db_app: typer.Typer, index_app: typer.Typer) -> None:
    """Add this area's commands to the CLI."""
    app.command("train")(train_command)
    app.command("benchmark")(benchmark_command)
    app.command("tune")(tune_command)


@with_config_options(changes=TRAIN_OPTION_CHANGES)
def train_command(
    ctx: typer.Context,
    data_argument: Annotated[str | None, typer.Argument(
        metavar="DATA", show_default=False,
        help="an ImageFolder tree (DATA/<class>/<image>), a Market-1501 folder, a CSV "
        "manifest (path,label[,camera]), fashion-mnist[:FOLDER] or glyphs[:classes=N,...]",
    )] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="run directory; default: runs/<DATA's name>, or runs/<name>-2, -3, ... "
        "when that holds a run (with --resume: the last of them)")] = None,
    loss: Annotated[str, typer.Option(
        "--loss", help="contrastive, triplet, multi_similarity, proxy_anchor, proxy_nca, "
        "normalized_softmax, cross_entropy, cosface, arcface, ntxent, supcon, circle")
    ] = DEFAULT_LOSS,
    miner: Annotated[str | None, typer.Option(
        "--miner", help="none, semihard, hard, all, multi_similarity, batch_hard; default: "
        "the loss's own (triplet: semihard, multi_similarity: multi_similarity)")] = None,
    loss_option: Annotated[list[str] | None, typer.Option(
        "--loss-option", help="KEY=VALUE override of a loss default, repeatable")] = None,
    seed: int = FROM_CONFIG,
    fold: int | None = FROM_CONFIG,
    resume: Annotated[bool, typer.Option(
        "--resume", help="continue the run in --out from its last.pt; an option not given "
        "takes the run's own value")] = False,
    progress: ProgressOpt = True,
    **base: Any,
) -> None:
    """Train an embedding with a metric-learning loss; validate every epoch, test once.

    With no options, fits a folder as it comes on a CPU: a pretrained mobilenet_v2, the
    input side measured on the training images, no augmentation, multi_similarity, 8 epochs
    or 10 minutes of training, half of the classes held out for the test (docs/training.md).

    Writes OUT/model.pt (best by validation MAP@R), metrics.json, split.json, curves.png and
    last.pt (for --resume). Prints test MAP@R of the model, the untrained network and raw
    pixels, each with its 95% interval and the split it comes from, then the verdict: does
    the model beat each baseline on the same test queries (paired 95% interval)? A
    class-disjoint test split of few classes or images is flagged as too small to mean much.
    """
    # The options are checked before torch and the training stack are imported (seconds).
    given = {name for name in ctx.params if _given(ctx, name)}
    if data_argument is not None and base["data"] is not None \
            and data_argument != base["data"]:
        raise typer.BadParameter("DATA and --data name different data; give one",
                                 param_hint="DATA")
    base["data"] = data_argument or base["data"]
    if data_argument is not None:
        given.add("data")
    if out is None:
        if base["data"] is None:
            raise typer.BadParameter("name the data to train on", param_hint="DATA")
        out = default_out(base["data"], resume=resume)
        typer.echo(f"run directory: {out}")
    options = {**base, "seed": seed, "fold": fold}
    block: dict[str, Any] = {"name": loss, "miner": miner}
    saved = saved_request(out) if resume else None
    if saved is not None:  # the run's own values for what is not given
        options.update({k: saved[k] for k in options if k not in given and k in saved})
        block = {**saved["loss"], **{k: v for k, v in block.items()
                                     if {"name": "loss"}.get(k, k) in given}}
        if given & {"loss", "loss_option"}:
            block["options"] = _parse_options(loss_option, block["name"])
    else:
        if options["data"] is None:
            raise typer.BadParameter("name the data to train on", param_hint="DATA")
        if "backbone" not in given and "backbone_weights" in given:
            options["backbone"] = DEFAULT_BACKBONE  # the weights are for the default trunk
        elif "backbone" not in given:
            options["backbone"], options["backbone_weights"] = default_trunk()
        block["options"] = _parse_options(loss_option, block["name"])
    seed, fold = options.pop("seed"), options.pop("fold")
    config = _config(options, seed=seed, loss=LossConfig(**block), fold=fold, measure=True)

    from imgret.training.loop import train

    result = train(config, out, resume=resume, progress=progress)
    if int(os.environ.get("RANK", "0")) != 0:
        return  # under torchrun, rank 0 reports the run (and its exit status)
    echo_run(result)
    if not result.learned:
        typer.secho(f"error: {result.not_learned_message()}", fg=typer.colors.RED, err=True)
        raise typer.Exit(NOT_LEARNED_EXIT)


def echo_run(result: Any) -> None:
    """Print a finished run (a ``imgret.training.loop.RunResult``): where, split, val, test and
    the verdict against the baselines; for a run that did not learn, what it has (the
    baselines) and no model."""
    from imgret.training.data import describe_split
    from imgret.training.scoring import format_metric, verdict_lines

    if not result.learned:
        typer.echo(f"run: {result.out} (did not learn: no model saved)")
        typer.echo(f"split: {describe_split(result.split)}")
        typer.echo(f"best epoch 0 (the untrained network): validation MAP@R "
                   f"{format_metric(result.val)}")
        if result.baselines:
            typer.echo(f"test MAP@R (95% CI) of the baselines: untrained "
                       f"{format_metric(result.baselines['untrained'])}, raw pixels "
                       f"{format_metric(result.baselines['raw_pixels'])}")
        return
    typer.echo(f"run: {result.out} (model version {result.model_version})")
    typer.echo(f"split: {describe_split(result.split)}")
    typer.echo(f"best epoch {result.best_epoch}: validation MAP@R {format_metric(result.val)}")
    typer.echo(f"test MAP@R (95% CI)   trained:     {format_metric(result.test)}")
    for name, label in (("untrained", "untrained:  "), ("raw_pixels", "raw pixels: ")):
        typer.echo(f"                      {label} {format_metric(result.baselines[name])}")
    typer.echo(f"test R-Precision {format_metric(result.test, 'r_precision')}, "
               f"P@1 {format_metric(result.test, 'precision_at_1')}")
    if result.verdict:
        if result.verdict.get("small_split_warning"):
            typer.echo(result.verdict["small_split_warning"])
        for line in verdict_lines(result.verdict):
            typer.echo(line)


@with_config_options
def benchmark_command(
    out: OutOpt,
    losses: LossesOpt = ",".join(DEFAULT_LOSSES),
    seeds: Annotated[int, typer.Option("--seeds", help="seeds 0..N-1 per loss", min=1)] = 3,
    controls: ControlsOpt = "",
    progress: ProgressOpt = True,
    **base: Any,
) -> None:
    """Compare losses fairly: one base config, several seeds, mean ± 95% CI on the test split.

    Resumable (finished runs are kept); refuses an OUT holding a different base config.
    Writes OUT/results.md, results.json, bars.png, curves.png and OUT/runs/<loss>/seed<k>/.
    """
    from imgret.training.benchmark import parse_losses, run_benchmark

    blocks = parse_losses(losses)
    config = _config(base, seed=0, loss=blocks[0])
    command = "imgret " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = run_benchmark(config, blocks, list(range(seeds)), out, command=command,
                            progress=progress, controls=_names(controls))
    echo_results(results, out)


@with_config_options
def tune_command(
    ctx: typer.Context,
    out: OutOpt,
    losses: LossesOpt = ",".join(DEFAULT_LOSSES),
    budget: Annotated[str | None, typer.Option(
        "--budget", help="quick (2 CPU cores, about 30 min), full (a GPU), reality-check "
        "(4-fold cross-validation on a CPU) or reality-check-full: preset base options, "
        "trials and seeds; options given explicitly override it")] = None,
    trials: Annotated[int | None, typer.Option(
        "--trials", help="finished trials per loss, the same for every loss (default: the "
        "budget's, else 10)", min=1)] = None,
    seeds: Annotated[int | None, typer.Option(
        "--seeds", help="retraining seeds 0..N-1 per loss (default: the budget's, else 5)",
        min=1)] = None,
    seed: Annotated[int, typer.Option(
        "--seed", help="seeds the TPE sampler and the trials' training")] = 0,
    tune_lr: Annotated[bool | None, typer.Option(
        "--tune-lr/--no-tune-lr", help="tune the network's learning rate per loss (default: "
        "only without --cv-folds; with them it is the ablation, written to OUT/lr-ablation/)",
    )] = None,
    controls: ControlsOpt = "",
    trial_tests: Annotated[bool | None, typer.Option(
        "--trial-tests/--no-trial-tests", help="after tuning, test every trial's models for "
        "the validation / test Spearman correlation (default: with --cv-folds)")] = None,
    progress: ProgressOpt = True,
    **base: Any,
) -> None:
    """Tune every loss with the same budget on validation MAP@R (Optuna TPE, seeded), then
    retrain each best configuration with several seeds and test it once per seed.

    Every loss gets the same number of trials, each trial the base config's epochs (or
    time budget); no pruning. Resumable: finished trials and runs are kept (studies in
    OUT/tune/study.db, trial runs in OUT/tune/, retrained cells in OUT/runs/). Writes
    OUT/results.md and results.json with the search spaces and the trial budget.
    """
    from imgret.training.benchmark import parse_losses
    from imgret.training.tune import BUDGETS, run_tuned_benchmark

    preset = None
    if budget is not None:
        if budget not in BUDGETS:
            raise typer.BadParameter(f"choose from {', '.join(BUDGETS)}", param_hint="--budget")
        preset = BUDGETS[budget]
        for name, value in preset.options.items():  # an option given on the command line wins
            if ctx.get_parameter_source(name).name == "DEFAULT":  # (Typer vendors click)
                base[name] = value
    blocks = parse_losses(losses)
    config = _config(base, seed=0, loss=blocks[0])
    command = "imgret " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = run_tuned_benchmark(
        config, blocks, trials or (preset.trials if preset else 10),
        list(range(seeds or (preset.seeds if preset else 5))), out, seed=seed,
        command=command, progress=progress, tune_lr=tune_lr, controls=_names(controls),
        trial_tests=trial_tests,
    )
    tuning = results["tuning"]
    typer.echo(f"tuned {len(tuning['best'])} losses with {tuning['trials']} trials each "
               f"({tuning['per_trial']['epochs']} epochs per trial); best on validation:")
    for name, best in tuning["best"].items():
        typer.echo(f"  {name:<22} MAP@R {best['val_map_at_r']:.3f} (trial {best['trial']})")
    if tuning.get("correlation"):
        every = tuning["correlation"]["all"]["test"]
        if every["rho"] is not None:
            typer.echo(f"validation vs test MAP@R over {every['n']} trials: Spearman rho "
                       f"{every['rho']:.3f} (p = {every['p']:.2g})")
    if tuning.get("lr_ablation"):
        out = Path(out) / "lr-ablation"
    echo_results(results, out)


def echo_results(results: dict[str, Any], out: Path) -> None:
    """Print a benchmark's table: test MAP@R, R-Precision and P@1, mean ± 95% CI."""
    split = results["split"]
    typer.echo(f"test split: {split['protocol']} {split['digest']} of {split['source']}")
    cv = "cross_validation" in results
    typer.echo(f"{'method':<24} {'MAP@R':>15} {'R-Precision':>15} {'P@1':>15}"
               + (f" {'MAP@R alone':>15}" if cv else ""))
    if cv:
        typer.echo(f"(the {results['cross_validation']['folds']} fold models concatenated; "
                   "alone: the mean of the fold models tested by themselves)")
    from imgret.training.report_output import did_not_learn

    for row in results["rows"]:
        if row["metrics"] is None:
            typer.echo(f"{row['name']:<24} {did_not_learn(row)}")
            continue
        stats = [row["metrics"][m] for m in ("map_at_r", "r_precision", "precision_at_1")]
        if cv:
            stats.append((row.get("separate") or row["metrics"])["map_at_r"])
        cells = [f"{s['mean']:.3f} ± {(s['ci'][1] - s['ci'][0]) / 2:.3f}" for s in stats]
        typer.echo(f"{row['name']:<24} " + " ".join(f"{c:>15}" for c in cells))
    typer.echo(f"report: {Path(out) / 'results.md'}")


def _names(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _config(options: dict[str, Any], *, measure: bool = False, **per_run: Any) -> TrainConfig:
    """The TrainConfig of the base-config options and the per-run fields (loss, seed).
    ``measure``: an input side not given is left to the run to measure on its images
    (``imgret train``); else it is the data set's (:func:`default_image_size`)."""
    weights = options["backbone_weights"]
    size = options["image_size"]
    return TrainConfig(**{
        **options,
        "image_size": size if size or measure else default_image_size(options["data"]),
        "backbone_weights": str(weights) if weights else None,
    }, **per_run)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether a parameter was given (command line or environment), not left at its default."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def default_out(data: str, *, resume: bool) -> Path:
    """``runs/<name of data>``; when that holds a run, the first of ``runs/<name>-2``,
    ``-3``, ... that does not (with ``resume``: the last that does)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(data.rstrip("/\\")).name or data)
    name = name.strip("-.") or "run"
    candidates = (Path("runs") / (name if n == 1 else f"{name}-{n}") for n in count(1))
    previous = None
    for candidate in candidates:
        if not _holds_run(candidate):
            return previous if resume and previous is not None else candidate
        previous = candidate
    raise AssertionError("unreachable")


def _holds_run(out: Path) -> bool:
    from imgret.training.run_dir import LAST_FILE, METRICS_FILE

    return (out / LAST_FILE).exists() or (out / METRICS_FILE).exists()


def saved_request(out: Path) -> dict[str, Any] | None:
    """What the run in ``out`` was asked for (its ``metrics.json`` config, with the batch
    composition as asked and the unsaved defaults filled in), or ``None`` without one."""
    from imgret.training.run_dir import METRICS_FILE

    try:
        record = json.loads((out / METRICS_FILE).read_text())
        config = record["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {**OPTIONAL_FIELDS, **config, **record.get("requested_batch", {})}


def _parse_options(items: list[str] | None, loss: str) -> dict[str, Any]:
    from imgret.training.registry import resolve_options

    options = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(
                f"expected KEY=VALUE, got {item!r}", param_hint="--loss-option"
            )
        options[key.strip()] = value.strip()
    # Unknown loss / option or a bad value is refused now; values are cast to the defaults' types.
    resolved = resolve_options(loss, options)
    return {key: resolved[key] for key in options}
