"""CLI commands: train (one run) and benchmark (losses x seeds on one base config).

torch and the training package are imported inside the commands so `imgret --help` stays fast.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

_BASE = "Base config (shared by every loss in a benchmark)"

DataOpt = Annotated[str, typer.Option(
    "--data", help="fashion-mnist[:FOLDER], an ImageFolder / Market-1501 folder, or a CSV "
    "manifest (path,label[,camera])", rich_help_panel=_BASE)]
OutOpt = Annotated[Path, typer.Option("--out", help="run (or benchmark) directory")]
ProtocolOpt = Annotated[str, typer.Option(
    "--protocol", help="class-disjoint (train/val/test classes disjoint; Reality Check) or "
    "closed-set (same classes, held-out images; product search)", rich_help_panel=_BASE)]
SplitSeedOpt = Annotated[int, typer.Option("--split-seed", help="seeds the class shuffle / "
                                           "hold-out (not the training)", rich_help_panel=_BASE)]
ValFracOpt = Annotated[float, typer.Option("--val-fraction", rich_help_panel=_BASE,
                                           help="share of classes (or images) for validation")]
TestFracOpt = Annotated[float, typer.Option("--test-fraction", rich_help_panel=_BASE,
                                            help="share of classes (or images) for test")]
BackboneOpt = Annotated[str, typer.Option(
    "--backbone", help="tiny_cnn, resnet18, resnet50, efficientnet_b0, convnext_tiny, vit_b_16",
    rich_help_panel=_BASE)]
WeightsOpt = Annotated[Path | None, typer.Option(
    "--backbone-weights", help="local torchvision state dict for the trunk (nothing is "
    "downloaded); default: random init", rich_help_panel=_BASE)]
DimOpt = Annotated[int, typer.Option("--dim", help="embedding size", rich_help_panel=_BASE)]
SizeOpt = Annotated[int | None, typer.Option(
    "--image-size", help="input side in px; default 32 for fashion-mnist, else 224",
    rich_help_panel=_BASE)]
EpochsOpt = Annotated[int, typer.Option("--epochs", rich_help_panel=_BASE)]
BudgetOpt = Annotated[float | None, typer.Option(
    "--time-budget", help="training wall-clock budget in seconds (validation excluded)",
    rich_help_panel=_BASE)]
MaxTrainOpt = Annotated[int | None, typer.Option(
    "--max-train-images", help="seeded stratified subset of the training split",
    rich_help_panel=_BASE)]
MaxEvalOpt = Annotated[int | None, typer.Option(
    "--max-eval-images", help="seeded stratified subset of validation and test (each)",
    rich_help_panel=_BASE)]
BatchOpt = Annotated[int, typer.Option("--batch-size", rich_help_panel=_BASE)]
MOpt = Annotated[int | None, typer.Option(
    "--m-per-class", help="images per class in a batch (default: smallest divisor of the "
    "batch size >= 4 that the classes allow)", rich_help_panel=_BASE)]
LrOpt = Annotated[float, typer.Option("--lr", help="AdamW learning rate of the network",
                                      rich_help_panel=_BASE)]
WdOpt = Annotated[float, typer.Option("--weight-decay", rich_help_panel=_BASE)]
WarmupOpt = Annotated[float, typer.Option("--warmup-epochs", help="linear warm-up, then cosine",
                                          rich_help_panel=_BASE)]
AugOpt = Annotated[str, typer.Option("--augmentation", help="standard or none",
                                     rich_help_panel=_BASE)]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu or cuda",
                                        rich_help_panel=_BASE)]
WorkersOpt = Annotated[int, typer.Option("--num-workers", help="DataLoader workers",
                                         rich_help_panel=_BASE)]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="tqdm bars")]


def register(app: typer.Typer, *, db_app: typer.Typer, index_app: typer.Typer) -> None:
    """Add this area's commands to the CLI."""
    app.command("train")(train_command)
    app.command("benchmark")(benchmark_command)


def train_command(
    data: DataOpt,
    out: OutOpt,
    loss: Annotated[str, typer.Option(
        "--loss", help="contrastive, triplet, multi_similarity, proxy_anchor, proxy_nca, "
        "normalized_softmax, cross_entropy, cosface, arcface, ntxent, supcon, circle")],
    miner: Annotated[str | None, typer.Option(
        "--miner", help="none, semihard, hard, all, multi_similarity, batch_hard; default: "
        "the loss's own (triplet: semihard, multi_similarity: multi_similarity)")] = None,
    loss_option: Annotated[list[str] | None, typer.Option(
        "--loss-option", help="KEY=VALUE override of a loss default, repeatable")] = None,
    backbone: BackboneOpt = "resnet18",
    dim: DimOpt = 128,
    epochs: EpochsOpt = 10,
    seed: Annotated[int, typer.Option("--seed", help="init, sampling, augmentation")] = 0,
    image_size: SizeOpt = None,
    batch_size: BatchOpt = 64,
    m_per_class: MOpt = None,
    lr: LrOpt = 1e-3,
    weight_decay: WdOpt = 1e-4,
    warmup_epochs: WarmupOpt = 0.5,
    protocol: ProtocolOpt = "class-disjoint",
    split_seed: SplitSeedOpt = 0,
    val_fraction: ValFracOpt = 0.25,
    test_fraction: TestFracOpt = 0.25,
    backbone_weights: WeightsOpt = None,
    max_train_images: MaxTrainOpt = None,
    max_eval_images: MaxEvalOpt = None,
    time_budget: BudgetOpt = None,
    augmentation: AugOpt = "standard",
    device: DeviceOpt = "auto",
    num_workers: WorkersOpt = 0,
    resume: Annotated[bool, typer.Option(
        "--resume", help="continue the run in --out from its last.pt (same options)")] = False,
    progress: ProgressOpt = True,
) -> None:
    """Train an embedding with a metric-learning loss; validate every epoch, test once.

    Writes OUT/model.pt (best by validation MAP@R), metrics.json, split.json, curves.png and
    last.pt (for --resume). Prints test MAP@R of the model, the untrained network and raw
    pixels, each with its 95% interval and the split it comes from.
    """
    from training.config import LossConfig
    from training.loop import train

    config = _config(
        data=data, protocol=protocol, split_seed=split_seed, val_fraction=val_fraction,
        test_fraction=test_fraction, backbone=backbone, backbone_weights=backbone_weights,
        dim=dim, image_size=image_size, epochs=epochs, time_budget=time_budget,
        max_train_images=max_train_images, max_eval_images=max_eval_images,
        batch_size=batch_size, m_per_class=m_per_class, lr=lr, weight_decay=weight_decay,
        warmup_epochs=warmup_epochs, augmentation=augmentation, device=device,
        num_workers=num_workers, seed=seed,
        loss=LossConfig(name=loss, miner=miner, options=_parse_options(loss_option, loss)),
    )
    result = train(config, out, resume=resume, progress=progress)
    if int(os.environ.get("RANK", "0")) != 0:
        return  # under torchrun, rank 0 reports the run
    echo_run(result)


def echo_run(result: Any) -> None:
    """Print a finished run (a ``training.loop.RunResult``): where, split, val and test."""
    from training.data import describe_split
    from training.evaluation import format_metric

    typer.echo(f"run: {result.out} (model version {result.model_version})")
    typer.echo(f"split: {describe_split(result.split)}")
    typer.echo(f"best epoch {result.best_epoch}: validation MAP@R {format_metric(result.val)}")
    typer.echo(f"test MAP@R (95% CI)   trained:     {format_metric(result.test)}")
    for name, label in (("untrained", "untrained:  "), ("raw_pixels", "raw pixels: ")):
        typer.echo(f"                      {label} {format_metric(result.baselines[name])}")
    typer.echo(f"test R-Precision {format_metric(result.test, 'r_precision')}, "
               f"P@1 {format_metric(result.test, 'precision_at_1')}")


def benchmark_command(
    data: DataOpt,
    out: OutOpt,
    losses: Annotated[str, typer.Option(
        "--losses", help="comma-separated loss[:miner], e.g. triplet,triplet:hard,arcface")],
    seeds: Annotated[int, typer.Option("--seeds", help="seeds 0..N-1 per loss", min=1)] = 3,
    backbone: BackboneOpt = "resnet18",
    dim: DimOpt = 128,
    epochs: EpochsOpt = 10,
    image_size: SizeOpt = None,
    batch_size: BatchOpt = 64,
    m_per_class: MOpt = None,
    lr: LrOpt = 1e-3,
    weight_decay: WdOpt = 1e-4,
    warmup_epochs: WarmupOpt = 0.5,
    protocol: ProtocolOpt = "class-disjoint",
    split_seed: SplitSeedOpt = 0,
    val_fraction: ValFracOpt = 0.25,
    test_fraction: TestFracOpt = 0.25,
    backbone_weights: WeightsOpt = None,
    max_train_images: MaxTrainOpt = None,
    max_eval_images: MaxEvalOpt = None,
    time_budget: BudgetOpt = None,
    augmentation: AugOpt = "standard",
    device: DeviceOpt = "auto",
    num_workers: WorkersOpt = 0,
    progress: ProgressOpt = True,
) -> None:
    """Compare losses fairly: one base config, several seeds, mean ± 95% CI on the test split.

    Resumable (finished runs are kept); refuses an OUT holding a different base config.
    Writes OUT/results.md, results.json, bars.png, curves.png and OUT/runs/<loss>/seed<k>/.
    """
    from training.benchmark import parse_losses, run_benchmark

    blocks = parse_losses(losses)
    base = _config(
        data=data, protocol=protocol, split_seed=split_seed, val_fraction=val_fraction,
        test_fraction=test_fraction, backbone=backbone, backbone_weights=backbone_weights,
        dim=dim, image_size=image_size, epochs=epochs, time_budget=time_budget,
        max_train_images=max_train_images, max_eval_images=max_eval_images,
        batch_size=batch_size, m_per_class=m_per_class, lr=lr, weight_decay=weight_decay,
        warmup_epochs=warmup_epochs, augmentation=augmentation, device=device,
        num_workers=num_workers, seed=0, loss=blocks[0],
    )
    command = "imgret " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = run_benchmark(base, blocks, list(range(seeds)), out, command=command,
                            progress=progress)
    split = results["split"]
    typer.echo(f"test split: {split['protocol']} {split['digest']} of {split['source']}")
    typer.echo(f"{'method':<24} {'MAP@R':>15} {'R-Precision':>15} {'P@1':>15}")
    for row in results["rows"]:
        stats = [row["metrics"][m] for m in ("map_at_r", "r_precision", "precision_at_1")]
        cells = [f"{s['mean']:.3f} ± {(s['ci'][1] - s['ci'][0]) / 2:.3f}" for s in stats]
        typer.echo(f"{row['name']:<24} " + " ".join(f"{c:>15}" for c in cells))
    typer.echo(f"report: {Path(out) / 'results.md'}")


def _config(*, data: str, image_size: int | None, backbone_weights: Path | None,
            time_budget: float | None, **fields: Any) -> Any:
    from training.config import TrainConfig, default_image_size

    return TrainConfig(
        data=data, image_size=image_size or default_image_size(data),
        backbone_weights=str(backbone_weights) if backbone_weights else None,
        time_budget_s=time_budget, **fields,
    )


def _parse_options(items: list[str] | None, loss: str) -> dict[str, Any]:
    from training.registry import resolve_options

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
