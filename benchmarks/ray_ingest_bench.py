"""Ingest on Ray Data beside the plain ingest of the same folder, in one run.

    python benchmarks/ray_ingest_bench.py [--images 2000] [--batch-size 64] [--chunk-size 256]
                                          [--repeat 1] [--postgres URL] [--ray ADDRESS]
                                          [--num-cpus 2] [--object-store-mb 400] [--out FILE.md]

What it does (CPU; every database and data dir is fresh and temporary):

1. writes ``--images`` Fashion-MNIST train images as PNG files in an ImageFolder
   (``harness.fashion_mnist_pngs``; seeded 28 px images when Debian's
   ``dataset-fashion-mnist`` is not installed), and saves an *untrained* network with the
   demo model's architecture (as ``ingest_bench.py`` does: the demo's work per image);
2. starts a local Ray instance (``--num-cpus``, ``--object-store-mb``, no dashboard), or
   joins ``--ray ADDRESS``, and times that apart: a cluster is started once, not per ingest;
3. ``--repeat`` times, interleaved: ``imgret.cli.jobs.gallery.ingest`` of the folder (the plain
ingest,
   decode worker processes) and ``imgret.cli.jobs.gallery.ingest(..., ray=...)`` (the Ray Data
   path), each into a fresh SQLite database and data dir, and into a fresh PostgreSQL database with
   ``--postgres``. Images/s are over each report's wall time (listing, hashing, dedup,
   decoding, embedding, media writes, SQL commits; for Ray also its actors' start-up and
   model loads; not the schema migration).

It prints a markdown table: images/s of each path (median of the runs), the runs, the ratio
Ray / plain, and for Ray the seconds before its first chunk reached the writer (actors
starting, each loading torch and the model) and the rate after it. Numbers are for this
machine only, and noisy on a shared one.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from harness import fashion_mnist_pngs, write_image_folder  # noqa: E402
from ingest_bench import (  # noqa: E402
    check_arguments,
    demo_checkpoint,
    ingest_arguments,
    ingest_fresh,
)

logger = logging.getLogger("ray_ingest_bench")

def main() -> None:
    parser = ingest_arguments(__doc__.split("\n\n")[0], images=2000, repeat=1)
    parser.add_argument("--ray", metavar="ADDRESS",
                        help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--num-cpus", type=int, default=2, help="the local Ray's CPUs")
    parser.add_argument("--object-store-mb", type=int, default=400,
                        help="the local Ray's object store")
    args = check_arguments(parser)

    import ray

    started = time.perf_counter()
    if args.ray:
        ray.init(address=args.ray, log_to_driver=False, configure_logging=False)
    else:
        ray.init(num_cpus=args.num_cpus, object_store_memory=args.object_store_mb * 2**20,
                 include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray_start = time.perf_counter() - started
    resources = ray.cluster_resources()
    backends = ["sqlite", "postgresql"] if args.postgres else ["sqlite"]
    runs: dict[tuple[str, str], list[float]] = {}
    reports = {}
    try:
        with tempfile.TemporaryDirectory(prefix="ray-ingest-bench-") as tmp:
            work = Path(tmp)
            folder = work / "images"
            images = fashion_mnist_pngs(args.images, 0)
            write_image_folder(folder, images.gallery)
            checkpoint = demo_checkpoint(work / "run")
            for round_ in range(args.repeat):
                for backend in backends:
                    for path in ("plain", "ray"):
                        # ``ray="local"`` with Ray initialised here: the Ray path uses this
                        # process's instance (or cluster connection), not one per run.
                        rate, report = ingest_fresh(
                            folder, work / f"{backend}-{path}-{round_}", checkpoint,
                            args.postgres if backend == "postgresql" else None, args,
                            ray="local" if path == "ray" else None,
                        )
                        runs.setdefault((backend, path), []).append(rate)
                        reports[backend, path] = report
                        logger.info("round %d, %s, %s: %.0f img/s", round_ + 1, backend, path,
                                    rate)
    finally:
        ray.shutdown()

    import torch

    lines = [
        f"Ingest of {args.images} PNG files ({images.note}) with an UNTRAINED network of the "
        f"demo model's architecture (small_cnn, 64-d, 28 px, greyscale); batch "
        f"{args.batch_size}, chunk {args.chunk_size}; CPU, {os.cpu_count()} cores, torch "
        f"threads {torch.get_num_threads()}; Ray {ray.__version__} "
        f"{'cluster at ' + args.ray if args.ray else 'local instance'} with "
        f"{resources.get('CPU', 0):.0f} CPUs, {resources.get('GPU', 0):.0f} GPUs "
        f"(started in {ray_start:.1f}s, not counted); medians of {args.repeat} run(s); "
        f"{date.today().isoformat()}.",
        "",
        "| database | plain ingest, images/s | Ray ingest, images/s | Ray / plain | Ray "
        "after its first chunk, images/s | Ray start-up (s) | runs (plain; Ray) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for backend in backends:
        plain = statistics.median(runs[backend, "plain"])
        on_ray = statistics.median(runs[backend, "ray"])
        report = reports[backend, "ray"]
        steady = report.total / max(1e-9, report.wall_seconds - report.startup_seconds)
        lines.append(f"| {backend} | {plain:.0f} | {on_ray:.0f} | {on_ray / plain:.2f} | "
                     f"{steady:.0f} (last run) | {report.startup_seconds:.1f} (last run) | "
                     f"{_list(runs[backend, 'plain'])}; {_list(runs[backend, 'ray'])} |")
    lines += ["", "Per-stage seconds of the last Ray run on SQLite (read, dedup, decode and "
              "embed summed over the Ray workers; write in this process):", "", "```"]
    lines += reports["sqlite", "ray"].summary()[1:]
    lines += ["```"]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        args.out.write_text(text + "\n")


def _list(rates: list[float]) -> str:
    return ", ".join(f"{rate:.0f}" for rate in rates)


if __name__ == "__main__":
    main()
