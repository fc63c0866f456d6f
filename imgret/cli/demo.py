"""CLI command: `imgret demo`, the whole pipeline on Fashion-MNIST, then the server.

Train (closed-set protocol) -> export a gallery and a held-out query set as PNG folders ->
ingest both -> build the index -> evaluate through the serving path, beside the untrained
network and raw pixels measured by the same metric function on the same images -> serve.
Every stage calls the same layer function as its own command (``imgret.training.loop.train``,
``imgret.cli.jobs.gallery.ingest`` / ``build`` / ``evaluate_named``, ``imgret.service.run.serve``)
with the demo's
settings, and a re-run reuses what is already there.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

QUERY_SET = "fashion-mnist-test"
# What the evaluate stage prints for each embedding, each with its 95% interval.
METRICS = {"map_at_r": "MAP@R", "r_precision": "R-Precision", "precision_at_1": "P@1"}


def register(app: typer.Typer, *, db_app: typer.Typer, index_app: typer.Typer) -> None:
    """Add this area's commands to the CLI."""

    @app.command("demo")
    def demo_command(
        data_dir: Path | None = typer.Option(
            None, "--data-dir", help="where the run, database and images go; default "
            "IMGRET_DATA_DIR (imgret-data)"
        ),
        gallery_per_class: int = typer.Option(300, min=2, help="Fashion-MNIST train images"),
        queries_per_class: int = typer.Option(100, min=1, help="held-out test images"),
        epochs: int = typer.Option(4, min=1, help="training epochs"),
        train_images: int = typer.Option(12000, min=100, help="training images (subset)"),
        host: str = typer.Option("127.0.0.1"),
        port: int = typer.Option(8000, min=1, max=65535),
        serve: bool = typer.Option(True, "--serve/--no-serve", help="start the API at the end"),
    ) -> None:
        """Train, ingest, index and evaluate on Fashion-MNIST, then serve the API and web page."""
        from imgret.cli.jobs import gallery as commands
        from imgret.settings import Settings
        from imgret.timing import timed

        base = Settings()
        data_dir = (data_dir or base.data_dir).resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        run_dir = data_dir / "demo-run"
        # Afterwards `IMGRET_DATA_DIR=<data dir> IMGRET_MODEL=<data dir>/demo-run imgret serve`
        # serves the same gallery.
        settings = base.model_copy(update={"data_dir": data_dir, "model": run_dir})
        timings: list[tuple[str, float]] = []

        def stage(name: str, work: Callable[[], None]) -> None:
            typer.secho(f"\n== {name}", bold=True)
            with timed(lambda seconds: timings.append((name, seconds))):
                work()

        def ingest(folder: Path, query_set: str | None = None) -> None:
            for line in commands.ingest(settings, folder, query_set=query_set).summary():
                typer.echo(line)

        def build() -> None:
            built = commands.build(settings)
            typer.echo(f"built {built.factory} index: {built.size} vectors -> {built.folder}")

        stage("train (closed-set protocol)", lambda: _train(run_dir, epochs, train_images))
        stage("export images", lambda: _export(data_dir, gallery_per_class, queries_per_class))
        stage("ingest gallery", lambda: ingest(data_dir / "demo-gallery"))
        stage("ingest query set", lambda: ingest(data_dir / "demo-queries", QUERY_SET))
        stage("build index", build)
        stage("evaluate", lambda: _evaluate(settings, run_dir))

        typer.secho("\n== stage times", bold=True)
        for name, seconds in timings:
            typer.echo(f"{name:<30} {seconds:7.1f} s")
        typer.echo(f"{'total':<30} {sum(s for _, s in timings):7.1f} s")
        if serve:
            from imgret.service.run import serve as run_server

            typer.secho(f"\nserving on http://{host}:{port}/  (Ctrl-C to stop)", bold=True)
            run_server(settings, host=host, port=port)


def _train(run_dir: Path, epochs: int, train_images: int) -> None:
    if (run_dir / "metrics.json").is_file() and (run_dir / "model.pt").is_file():
        typer.echo(f"{run_dir}: trained already, reusing it (delete the folder to retrain)")
        return
    from imgret.cli.train import NOT_LEARNED_EXIT, echo_run
    from imgret.training.config import FASHION_MNIST, LossConfig, TrainConfig
    from imgret.training.loop import train

    config = TrainConfig(
        data=FASHION_MNIST, protocol="closed-set", loss=LossConfig(name="multi_similarity"),
        # small_cnn, not tiny_cnn: averaging the feature map lost where the strokes are, and
        # raw pixels won P@1. No augmentation: a random resized crop of a 28 px garment is
        # another garment. The README's demo section has the measurements.
        backbone="small_cnn", dim=64, image_size=28, epochs=epochs, augmentation="none",
        max_train_images=train_images, max_eval_images=2000,
    )
    result = train(config, run_dir, resume=(run_dir / "metrics.json").is_file())
    echo_run(result)
    if not result.learned:  # nothing to serve: the run kept no model
        typer.secho(f"error: {result.not_learned_message()}", fg=typer.colors.RED, err=True)
        raise typer.Exit(NOT_LEARNED_EXIT)


def _export(data_dir: Path, gallery_per_class: int, queries_per_class: int) -> None:
    """PNG folders: gallery from the train split, queries from the test split (never trained)."""
    from PIL import Image

    from imgret.datasets import FASHION_MNIST_CLASSES, load_fashion_mnist

    for split, folder, per_class in (
        ("train", data_dir / "demo-gallery", gallery_per_class),
        ("test", data_dir / "demo-queries", queries_per_class),
    ):
        marker = folder / f".complete-{per_class}"
        if marker.is_file():
            typer.echo(f"{folder}: exported already")
            continue
        images, labels = load_fashion_mnist(split=split)
        for label, name in enumerate(FASHION_MNIST_CLASSES):
            target = folder / name.replace("/", "-").replace(" ", "_")
            target.mkdir(parents=True, exist_ok=True)
            for index in (labels == label).nonzero()[0][:per_class]:
                Image.fromarray(images[index], mode="L").save(target / f"{split}-{index:05d}.png")
        marker.touch()
        typer.echo(f"{folder}: {per_class} images per class from the {split} split")


def _evaluate(settings: Any, run_dir: Path) -> None:
    """The served model through the index, and two baselines by the same metric function."""
    import json

    from imgret.checkpoint import EmbeddingNet, load_checkpoint
    from imgret.cli.jobs.gallery import evaluate_named
    from imgret.cli.reports import format_report
    from imgret.datasets import list_records
    from imgret.embedder import Embedder
    from imgret.images import load_image_file
    from imgret.metrics import retrieval_metrics
    from imgret.training.scoring import pixel_embeddings

    data_dir = settings.data_dir
    report = evaluate_named(settings, QUERY_SET, ks=[1, 5, 10])
    for line in format_report(report):
        typer.echo(line)

    gallery = list_records(data_dir / "demo-gallery")
    queries = list_records(data_dir / "demo-queries")
    g_images = [load_image_file(r.path) for r in gallery]
    q_images = [load_image_file(r.path) for r in queries]
    g_labels = [r.label for r in gallery]
    q_labels = [r.label for r in queries]

    import torch

    spec = load_checkpoint(run_dir).spec
    torch.manual_seed(0)
    untrained = Embedder.from_model(EmbeddingNet(spec), device="cpu")
    rows = {"trained (served index)": report}
    rows["untrained network"] = retrieval_metrics(
        untrained.embed(q_images), q_labels, untrained.embed(g_images), g_labels)
    side = spec.image_size
    rows["raw pixels"] = retrieval_metrics(
        pixel_embeddings(q_images, side=side, grayscale=True), q_labels,
        pixel_embeddings(g_images, side=side, grayscale=True), g_labels)

    typer.secho(
        f"\nclosed-set retrieval, Fashion-MNIST: {len(queries)} test-split queries against "
        f"{len(gallery)} train-split gallery images (mean [95% bootstrap interval])", bold=True)
    typer.echo(f"{'embedding':<24}" + "".join(f"{title:>24}" for title in METRICS.values()))
    for name, row in rows.items():
        typer.echo(f"{name:<24}" + "".join(
            f"{row[m]:8.4f} [{row['ci95'][m][0]:.4f}, {row['ci95'][m][1]:.4f}]" for m in METRICS))
    for line in verdicts(rows):
        typer.echo(line)
    summary = {name: {k: row[k] for k in (*METRICS, "ci95")} for name, row in rows.items()}
    (data_dir / "demo_report.json").write_text(json.dumps(summary, indent=2, default=str))


def verdicts(rows: dict[str, dict[str, Any]]) -> list[str]:
    """One line per baseline: the metrics on which the trained model's 95% interval lies
    wholly above the baseline's, and those on which it does not."""
    trained, *baselines = rows
    lines = []
    for baseline in baselines:
        apart = [m for m in METRICS
                 if rows[trained]["ci95"][m][0] > rows[baseline]["ci95"][m][1]]
        rest = [METRICS[m] for m in METRICS if m not in apart]
        lines.append(
            f"trained vs {baseline}: better on every metric (95% intervals apart)" if not rest
            else f"trained vs {baseline}: NOT better with intervals apart on {', '.join(rest)}")
    return lines
