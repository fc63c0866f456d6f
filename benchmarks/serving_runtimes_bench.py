"""Torch eager, ONNX Runtime and int8 serving the same trained model: ingest images/s,
``POST /search`` requests/s at 16 clients, each beside its in-process floor, and the int8
version's paired MAP@R verdict against its float parent.

    python benchmarks/serving_runtimes_bench.py [--work DIR] [--seconds 10] [--rounds 2]

One run, in order (each stage is kept in ``--work`` and skipped when it is there, so an
interrupted run resumes where it stopped; ``--fresh`` starts again):

1. trains resnet18 at 64 px (128-d, multi-similarity loss) on Fashion-MNIST, closed-set,
   briefly (``--epochs``, ``--train-images``): a model whose neighbours mean something, so
   that the int8 verdict is about retrieval and not about noise;
2. writes ``--gallery`` train-split and ``--queries`` test-split images as PNG folders;
3. ``torch``: ingests the gallery (``imgret ingest``, IMGRET_RUNTIME=torch) into a fresh
   gallery and the queries as a query set; then ``imgret export VERSION --quantize int8``'s
   steps there: the int8 version, calibrated on stored gallery images, re-embedded and
   compared with its parent on the query set (the paired bootstrap verdict);
4. ``onnxruntime`` (the same checkpoint, IMGRET_RUNTIME=onnxruntime) and ``int8`` (the int8
   version's checkpoint) each ingest the same gallery into a fresh gallery of their own;
5. starts one server per gallery, warms each up, and drives ``POST /search`` (k=10) with
   ``wrk`` from ``--clients`` connections, the servers taking turns round by round;
6. measures each runtime's in-process floor: the search path without HTTP, in this
   process, on the same query images, batches of 32 (decode, preprocess, embed:
   ``imgret.images.embed_encoded``), the runtimes alternating round by round;
7. prints both tables: ratios to torch eager, and each service figure over its floor.

Numbers are for the machine that runs it; the load generator shares its cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import run_wrk, running_servers, search_bodies, write_image_folder  # noqa: E402

logger = logging.getLogger("serving_runtimes_bench")

RUNTIMES = ("torch", "onnxruntime", "int8")
QUERY_SET = "test"
FLOOR_BATCH = 32
WARMUP_S = 3.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path,
                        default=Path.home() / ".cache" / "imgret-bench" / "serving-runtimes")
    parser.add_argument("--fresh", action="store_true", help="discard what --work holds")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-images", type=int, default=6000)
    parser.add_argument("--gallery", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--floor-seconds", type=float, default=10.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not shutil.which("wrk"):
        sys.exit("wrk is not installed (make bench installs it)")
    if args.fresh:
        shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    stages = Stages(args.work, total=7)

    run_dir = stages.once("train", lambda: _train(args.work / "run", args))
    stages.once("images", lambda: _images(args.work, args))
    torch_side = stages.once("torch", lambda: _torch_side(args.work, run_dir))
    int8_run = Path(torch_side["int8_checkpoint"])
    ingests = {"torch": torch_side["ingest"]}
    ingests["onnxruntime"] = stages.once(
        "onnxruntime", lambda: _ingest(args.work, "onnxruntime", run_dir, "onnxruntime"))
    ingests["int8"] = stages.once("int8", lambda: _ingest(args.work, "int8", int8_run, "torch"))
    models = {"torch": (run_dir, "torch"), "onnxruntime": (run_dir, "onnxruntime"),
              "int8": (int8_run, "torch")}
    stages.step("service")
    service = _service(args.work, models, args)
    stages.step("floors")
    floors = _floors(args.work, models, args)
    _print(args, torch_side, ingests, service, floors, time.perf_counter() - started,
           _default_choice(run_dir))


class Stages:
    """Each stage's result kept as JSON in the work folder; progress with an ETA."""

    def __init__(self, work: Path, total: int):
        self.work, self.total, self.done, self.started = work, total, 0, time.perf_counter()

    def step(self, name: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(1, self.done - 1) * (self.total - self.done + 1) if self.done > 1 \
            else float("nan")
        logger.info("[%d/%d] %s (%.0f s so far; about %.0f s left)", self.done, self.total,
                    name, elapsed, eta)

    def once(self, name: str, work: Any) -> Any:
        record = self.work / f"{name}.json"
        if record.is_file():
            logger.info("%s: done in an earlier run, reusing it", name)
            return json.loads(record.read_text())
        self.step(name)
        result = work()
        record.write_text(json.dumps(result, default=str, indent=2))
        return result


def _train(run_dir: Path, args: argparse.Namespace) -> str:
    from imgret.training.config import FASHION_MNIST, LossConfig, TrainConfig
    from imgret.training.loop import train

    shutil.rmtree(run_dir, ignore_errors=True)
    config = TrainConfig(
        data=FASHION_MNIST, protocol="closed-set", loss=LossConfig(name="multi_similarity"),
        backbone="resnet18", dim=128, image_size=64, epochs=args.epochs, augmentation="none",
        max_train_images=args.train_images, max_eval_images=1000,
    )
    train(config, run_dir, progress=True)
    return str(run_dir)


def _images(work: Path, args: argparse.Namespace) -> dict[str, int]:
    import io

    from PIL import Image

    from imgret.datasets import FASHION_MNIST_CLASSES, load_fashion_mnist

    def pngs(split: str, n: int) -> list[tuple[bytes, str]]:
        images, labels = load_fashion_mnist(split=split)
        out = []
        for i in range(n):
            buffer = io.BytesIO()
            Image.fromarray(images[i]).save(buffer, format="PNG")
            out.append((buffer.getvalue(), FASHION_MNIST_CLASSES[int(labels[i])]))
        return out

    for name, split, n in (("gallery", "train", args.gallery), ("queries", "test", args.queries)):
        shutil.rmtree(work / name, ignore_errors=True)
        write_image_folder(work / name, pngs(split, n))
    return {"gallery": args.gallery, "queries": args.queries}


def _settings(work: Path, name: str, model: str | Path, runtime: str):
    from imgret.settings import Settings

    data = work / f"data-{name}"
    return Settings(data_dir=data, model=Path(model), runtime=runtime, device="cpu",
                    database_url=f"sqlite:///{data}/gallery.db")


def _ingest(work: Path, name: str, model: str | Path, runtime: str) -> dict[str, Any]:
    from imgret.cli.jobs import gallery as commands

    settings = _settings(work, name, model, runtime)
    shutil.rmtree(settings.data_dir, ignore_errors=True)
    settings.data_dir.mkdir(parents=True)
    report = commands.ingest(settings, work / "gallery", progress=False)
    commands.build(settings)
    return {"images": report.total, "added": report.added, "seconds": report.wall_seconds,
            "images_per_s": report.total / report.wall_seconds, "version": report.model_version}


def _torch_side(work: Path, run_dir: str) -> dict[str, Any]:
    from imgret.cli.jobs import gallery as commands
    from imgret.cli.jobs import models as model_commands

    ingest = _ingest(work, "torch", run_dir, "torch")
    settings = _settings(work, "torch", run_dir, "torch")
    commands.ingest(settings, work / "queries", query_set=QUERY_SET, progress=False)
    parent = ingest["version"]
    made = model_commands.quantize(settings, parent, speed_seconds=5.0)
    model_commands.embed(settings, made.version)
    comparison = model_commands.compare(settings, parent, made.version, QUERY_SET)
    # The int8 version's checkpoint, as registered (the local copy of its stored bytes).
    checkpoint = settings.data_dir / "models" / made.version / "model.pt"
    int8_run = work / "int8-run"
    int8_run.mkdir(exist_ok=True)
    shutil.copyfile(checkpoint, int8_run / "model.pt")
    return {"ingest": ingest, "quantized": made.to_dict() | {"registered": None},
            "comparison": comparison, "int8_checkpoint": str(int8_run)}


def _service(work: Path, models: dict[str, tuple[Any, str]],
             args: argparse.Namespace) -> dict[str, dict[str, float]]:
    shutil.rmtree(work / "bodies", ignore_errors=True)  # an interrupted run's (measured again)
    bodies = search_bodies([p.read_bytes() for p in _query_files(work)[:64]],
                           work / "bodies")
    specs = [({"IMGRET_DATA_DIR": str(work / f"data-{name}"),
               "IMGRET_DATABASE_URL": f"sqlite:///{work / f'data-{name}'}/gallery.db",
               "IMGRET_MODEL": str(model), "IMGRET_RUNTIME": runtime, "IMGRET_DEVICE": "cpu"},
              work / f"serve-{name}.log") for name, (model, runtime) in models.items()]
    levels: dict[str, list[Any]] = {name: [] for name in models}
    with running_servers(specs) as servers:
        for name, server in zip(models, servers, strict=True):
            logger.info("%s: warming up for %.0f s", name, WARMUP_S)
            run_wrk(server.url, bodies, args.clients, WARMUP_S, request_timeout_s=30)
        for round_ in range(args.rounds):
            for name, server in zip(models, servers, strict=True):
                logger.info("round %d of %d, %s: %d clients for %.0f s", round_ + 1,
                            args.rounds, name, args.clients, args.seconds)
                levels[name].append(run_wrk(server.url, bodies, args.clients, args.seconds,
                                            request_timeout_s=30))
    return {name: {
        "rps": sum(lv.requests - lv.non_2xx for lv in runs) / sum(lv.seconds for lv in runs),
        "p50_ms": statistics.fmean(lv.p50_ms for lv in runs),
        "p99_ms": max(lv.p99_ms for lv in runs),
        "errors": sum(lv.non_2xx + lv.socket_errors for lv in runs),
    } for name, runs in levels.items()}


def _query_files(work: Path) -> list[Path]:
    return sorted((work / "queries").rglob("*.png"))


def _floors(work: Path, models: dict[str, tuple[Any, str]],
            args: argparse.Namespace) -> dict[str, float]:
    """Images/s of decode + preprocess + embed of one batch of query uploads, in process."""
    from imgret.embedder import Embedder
    from imgret.images import DecodeLimits, embed_encoded
    from imgret.quantize import throughput

    blobs = [p.read_bytes() for p in _query_files(work)[:FLOOR_BATCH]]
    limits = DecodeLimits()
    embedders = {name: Embedder.from_checkpoint(model, device="cpu", runtime=runtime)
                 for name, (model, runtime) in models.items()}
    speed = throughput({name: functools.partial(embed_encoded, blobs, embedder=embedder,
                                                limits=limits)
                        for name, embedder in embedders.items()},
                       len(blobs), seconds=args.floor_seconds)
    return {name: row["images_per_s"] for name, row in speed.items()}


def _default_choice(run_dir: str | Path) -> dict[str, Any]:
    """What a server with IMGRET_RUNTIME unset runs the float version with, and its check."""
    from imgret.embedder import Embedder
    from imgret.settings import Settings

    asked = Settings.model_fields["runtime"].default
    return Embedder.from_checkpoint(run_dir, device="cpu", runtime=asked).runtime_choice.to_dict()


def _print(args: argparse.Namespace, torch_side: dict[str, Any], ingests: dict[str, Any],
           service: dict[str, Any], floors: dict[str, float], seconds: float,
           default: dict[str, Any]) -> None:
    made, comparison = torch_side["quantized"], torch_side["comparison"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nresnet18, 128-d, 64 px, trained on Fashion-MNIST ({args.epochs} epochs, "
          f"{args.train_images} images); gallery {ingests['torch']['images']} train-split "
          f"images, {args.queries} test-split queries; {os.cpu_count()} cores, 1-min load "
          f"{load:.2f} at the end; run took {seconds:.0f} s.")
    diff = ("" if default["max_abs_diff"] is None else
            f", max abs difference from torch {default['max_abs_diff']:.1e} on the version's "
            f"sample (bound {default['bound']:g})")
    print(f"Default runtime (IMGRET_RUNTIME={default['asked']}): {default['runtime']} "
          f"({default['reason']}{diff}); marked * below.")
    print(f"int8 version {made['version']} of {made['parent']}: calibrated on "
          f"{made['calibration_images']} stored gallery images; cosine with the float "
          f"vectors mean {made['cosine_mean']:.5f}, min {made['cosine_min']:.5f}.\n")
    base_in, base_rps, base_floor = (ingests["torch"]["images_per_s"], service["torch"]["rps"],
                                     floors["torch"])
    print(f"| runtime | ingest img/s | × torch | /search req/s ({args.clients} clients) | "
          "× torch | p50 ms | p99 ms | errors | floor img/s (in process, batch 32) | "
          "× torch | service / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in RUNTIMES:
        ingest, serve, floor = ingests[name]["images_per_s"], service[name], floors[name]
        shown = f"{name} *" if name == default["runtime"] else name
        print(f"| {shown} | {ingest:.1f} | {ingest / base_in:.2f} | {serve['rps']:.1f} | "
              f"{serve['rps'] / base_rps:.2f} | {serve['p50_ms']:.0f} | {serve['p99_ms']:.0f} | "
              f"{serve['errors']} | {floor:.1f} | {floor / base_floor:.2f} | "
              f"{serve['rps'] / floor:.2f} |")
    print(f"\nint8 ({comparison['b']['model_version']}) against float "
          f"({comparison['a']['model_version']}) on {args.queries} queries, paired bootstrap:\n")
    print("| metric | float | int8 | int8 − float | 95% CI | verdict |")
    print("|---|---:|---:|---:|---|---|")
    for metric, row in comparison["difference"].items():
        low, high = row["ci95"]
        print(f"| {metric} | {row['a']:.4f} | {row['b']:.4f} | {row['difference']:+.4f} | "
              f"[{low:+.4f}, {high:+.4f}] | {comparison['verdict'].get(metric, '')} |")


if __name__ == "__main__":
    main()
