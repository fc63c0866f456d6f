"""A pretrained trunk against scratch: MobileNetV2 from the packaged ImageNet weights
(``--backbone-weights imagenet``, :mod:`imgret.pretrained`) or from random init, retrieving
classes it never trained on.

Per ``--data`` set, one class-disjoint split (split seed 0) and every number from the training
loop's evaluator (:class:`imgret.training.scoring.Evaluator`: the test split, each image a
query against all the others; MAP@R, P@1 and R-Precision, with 95% bootstrap intervals):

- **no training**: raw pixels (the loop's baseline) and the trunk's pooled features (1280-d,
  L2-normalised, no head) from random init and from the ImageNet weights;
- **fine-tuned**: two ``imgret train`` runs (:func:`imgret.training.loop.train`,
  multi_similarity) whose configs differ only in ``backbone_weights``; the epoch with the best
  validation MAP@R is tested. Beside each, its untrained network (the same trunk with a random
  128-d head), the loop's own baseline.

Resumable: a finished row is kept in ``OUT/results.json`` and not measured again, and a
fine-tune resumes from its last finished epoch (``OUT/<set>/<run>/last.pt``). Each row logs
when it starts and ends; training shows tqdm bars (``--no-progress`` hides them).

Run: ``python benchmarks/pretrained_bench.py [--out runs/pretrained-bench]
[--data glyphs:classes=254 fashion-mnist] [--image-size 96] [--epochs 2] [--no-fine-tune]``;
the table of every row measured in ``OUT`` is printed at the end and written to
``OUT/results.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from imgret.checkpoint import EmbeddingNet, ModelSpec
from imgret.files import write_atomic
from imgret.pretrained import IMAGENET
from imgret.training.config import LossConfig, TrainConfig
from imgret.training.data import make_split, model_spec_for, open_source
from imgret.training.loop import train
from imgret.training.scoring import Evaluator, format_metric

logger = logging.getLogger("pretrained_bench")

BACKBONE = "mobilenet_v2"
FEATURES = 1280  # the trunk's pooled features
TRUNKS = {"random init": None, "ImageNet": IMAGENET}
METRICS = ("map_at_r", "precision_at_1", "r_precision")


def base_config(data: str, args: argparse.Namespace, weights: str | None) -> TrainConfig:
    """One run's config: the two runs of a set differ only in ``backbone_weights``."""
    # No augmentation: the glyphs carry their own distortions, and a random crop or flip
    # cuts off or mirrors strokes (docs/training.md, the glyph set).
    return TrainConfig(
        data=data, backbone=BACKBONE, image_size=args.image_size, epochs=args.epochs,
        backbone_weights=weights, augmentation="none", device="cpu",
        max_train_images=args.max_train_images, max_eval_images=args.max_eval_images,
        loss=LossConfig("multi_similarity"),
    )


def pooled_trunk(config: TrainConfig, spec: ModelSpec) -> EmbeddingNet:
    """The trunk alone: its pooled features, L2-normalised by the network's forward."""
    torch.manual_seed(config.seed)  # the trunk the run starts from (it is built first)
    model = EmbeddingNet(ModelSpec(**{**spec.to_dict(), "dim": FEATURES}),
                         backbone_weights=config.backbone_weights)
    model.head = nn.Identity()
    return model.eval()


def measure_set(data: str, args: argparse.Namespace, rows: dict[str, Any],
                save: Any) -> None:
    """Every row of one set that ``rows`` does not hold yet, each saved when it is done."""
    scratch = base_config(data, args, None)
    evaluator = None
    for name, weights in [("raw pixels", None), *TRUNKS.items()]:
        key = f"{data} | {name} | no training"
        if key in rows:
            continue
        if evaluator is None:
            source = open_source(data)
            split = make_split(source, scratch)
            evaluator = Evaluator(scratch, source, split, "cpu")
            spec = model_spec_for(scratch, source)
            digest = split.summary(source)["digest"]
        logger.info("%s ...", key)
        start = time.perf_counter()
        if name == "raw pixels":
            metrics = evaluator.test_pixels()
        else:
            config = base_config(data, args, weights)
            metrics = evaluator.test(pooled_trunk(config, spec))
        rows[key] = row(metrics, time.perf_counter() - start, split=digest)
        save()
    for name, weights in TRUNKS.items() if args.fine_tune else ():
        key = f"{data} | {name} | fine-tuned"
        if key in rows:
            continue
        logger.info("%s: %d epochs ...", key, args.epochs)
        start = time.perf_counter()
        run = Path(args.out) / data.replace(":", "_").replace("=", "-") / (
            "imagenet" if weights else "scratch")
        result = train(base_config(data, args, weights), run, resume=True,
                       progress=args.progress)
        rows[f"{data} | {name} | untrained network (+ random head)"] = row(
            result.baselines["untrained"], None, split=result.split["digest"])
        rows[key] = row(result.test, time.perf_counter() - start,
                        split=result.split["digest"], best_epoch=result.best_epoch,
                        best_val_map_at_r=result.val["map_at_r"], run=str(run))
        save()


def row(metrics: dict[str, Any], wall_s: float | None, **extra: Any) -> dict[str, Any]:
    kept = {name: metrics[name] for name in METRICS}
    kept["ci95"] = {name: (metrics.get("ci95") or {}).get(name) for name in METRICS}
    return {**kept, "wall_s": wall_s, **extra}


def table(rows: dict[str, Any]) -> str:
    lines = ["| set | trunk | training | MAP@R [95% CI] | P@1 [95% CI] | R-Precision | wall |",
             "|---|---|---|---|---|---|---|"]
    for key, r in rows.items():
        data, trunk, training = key.split(" | ")
        wall = f"{r['wall_s']:.0f} s" if r["wall_s"] is not None else ""
        if "best_epoch" in r:
            training += f" (best epoch {r['best_epoch']})"
        lines.append(f"| {data} | {trunk} | {training} | {format_metric(r, 'map_at_r')} | "
                     f"{format_metric(r, 'precision_at_1')} | {r['r_precision']:.4f} | {wall} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/pretrained-bench"))
    parser.add_argument("--data", nargs="+", default=["glyphs:classes=254"])
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=2)
    # Caps of every set: Fashion-MNIST's 21,000 training and 35,000 test images would take
    # the CPU hours at 96 px; the default glyph set's splits are under both.
    parser.add_argument("--max-train-images", type=int, default=4000)
    parser.add_argument("--max-eval-images", type=int, default=3500)
    parser.add_argument("--fine-tune", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-fine-tune measures the untrained rows only")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    # What the numbers depend on: a rerun with other values would mix two measurements.
    options = {k: v for k, v in vars(args).items()
               if k not in ("out", "data", "fine_tune", "progress")}
    path = args.out / "results.json"
    state = json.loads(path.read_text()) if path.is_file() else {"options": options, "rows": {}}
    if state["options"] != options:
        raise SystemExit(f"{path} holds rows measured with {state['options']}; use another "
                         "--out for these options")
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        write_atomic(path, json.dumps(state, indent=2).encode())

    started = time.perf_counter()
    for data in args.data:
        measure_set(data, args, state["rows"], save)
    report = table(state["rows"])
    (args.out / "results.md").write_text(report + "\n")
    print(report)
    print(f"this invocation: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
