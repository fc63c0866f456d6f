"""Ingest throughput against its floor: bare read + decode + embed of the same files.

    python benchmarks/ingest_bench.py [--images 3000] [--batch-size 64] [--chunk-size 256]
                                      [--repeat 3] [--postgres URL]
                                      [--media-backend files,database] [--out FILE.md]

What it does, in one run (CPU; every database and data dir is fresh and temporary):

1. writes ``--images`` Fashion-MNIST train images as PNG files in an ImageFolder
   (``harness.fashion_mnist_pngs``, the demo's images; seeded 28 px images when Debian's
   ``dataset-fashion-mnist`` is not installed);
2. saves an *untrained* network with the demo model's architecture and preprocessing
   (small_cnn, 64-d, 28 px, greyscale, Fashion-MNIST statistics) with
   ``imgret.checkpoint.save_checkpoint``: the demo's work per image (nothing is trained);
   ``--backbone resnet18`` takes the heavier model of ``load_bench.py`` instead (128-d,
   64 px, same statistics);
3. measures, ``--repeat`` times each, interleaved:

   a. **the floor**: the same files read, decoded (``imgret.images.decode_for_embedding``,
      the ingest's decoder) and embedded with the same ``Embedder`` at the same batch size,
      in-process, one batch after the other (the bare embedding throughput);
   b. **the pooled floor**: the same, in the ingest's own worker processes
      (``imgret.gallery.ingest.workers.EmbedWorkers``, same worker count: each decodes, preprocesses
      and
      embeds whole slices with one torch thread, only vectors come back): what the
      ingest's pipeline does minus every storage step;
   c. **ingest**: ``imgret.cli.jobs.gallery.ingest`` of the folder into a fresh SQLite database and
   data
      dir (and into a fresh PostgreSQL database with ``--postgres``), once per media backend
      of ``--media-backend`` (``IMGRET_MEDIA_BACKEND``: ``files``, the bytes as files in
      the data dir; ``database``, the bytes as ``media_blobs`` rows in the chunk's
      transaction): images/s over the report's wall time (listing, reading, hashing, dedup,
      decoding, embedding, media writes with their syncs, SQL commits; not the model load
      or the schema migration);

   and, for reference, the forward pass alone on already preprocessed tensors.

It prints a markdown table with the medians and the ratios ingest / floor (the target is
>= 0.80) and ingest / pooled floor: the higher of the two floors is the bar (both
are bare decode + embed of the same files; which is faster depends on the machine), and the
ingest's per-stage seconds of the median run (with workers, ``decode`` and ``embed`` are
the seconds the workers spent on them, summed over the workers). Beside each rate it
prints the CPU seconds of the run (this process and the workers it waited for) and the
pooled floor's CPU over them: with every core busy, what ingest adds to decoding and
embedding needs CPU of its own, so that quotient bounds ingest / pooled floor. Numbers are
for this machine only, and noisy on a shared one: compare ratios from one run, not absolute
rates.

Each round also times what a new media file costs in the work dir (``MediaStore.stage`` of
256 new keys into a fresh store: a fan-out folder and a file each, as in a fresh ingest) and
prints it under the table: the media-files backend's ratio follows it. On an ext4 file system
without a journal (as on the machines in docs/ingest_bench.md) creating a file in a block group
where many files were deleted in the last 5-300 s costs 10-30 times more (the kernel skips each
recently deleted inode when it allocates one: ``recently_deleted`` in a profile), so the work
dir matters: everything goes under ``TMPDIR`` (default ``/tmp``), and a folder where nothing was
deleted in the last minutes (not one a test suite or an earlier run just cleaned up) measures
the backend rather than that leftover.
Run it against an older tree by copying this file into that tree's ``benchmarks/`` (it
imports the tree it sits in); there the pooled floor is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from harness import fashion_mnist_pngs, write_image_folder  # noqa: E402

from imgret.settings import MEDIA_BACKENDS  # noqa: E402

logger = logging.getLogger("ingest_bench")

# The demo's model (imgret/cli/demo.py, imgret/training/data/sources.py's model_spec_for on
# Fashion-MNIST).
DEMO_SPEC = {"backbone": "small_cnn", "dim": 64, "image_size": 28, "grayscale": True,
             "mean": (0.2860,) * 3, "std": (0.3530,) * 3}
SPECS = {"small_cnn": DEMO_SPEC,
         "resnet18": {**DEMO_SPEC, "backbone": "resnet18", "dim": 128, "image_size": 64}}


def ingest_arguments(description: str, *, images: int, repeat: int) -> argparse.ArgumentParser:
    """The options this benchmark shares with ``ray_ingest_bench.py`` (checked by
    :func:`check_arguments`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--images", type=int, default=images, help="PNG files (<= 60000)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per forward pass")
    parser.add_argument("--chunk-size", type=int, default=256, help="images per transaction")
    parser.add_argument("--repeat", type=int, default=repeat, help="runs of each measurement")
    parser.add_argument("--postgres", metavar="URL",
                        help="also ingest into PostgreSQL: an admin URL "
                             "(postgresql+psycopg://postgres@127.0.0.1:5432/postgres); a "
                             "database is created for each run and dropped after it")
    parser.add_argument("--progress", action="store_true", help="show the ingest's tqdm bar")
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    return parser


def check_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse and check the shared options; set up logging."""
    args = parser.parse_args()
    if not 10 <= args.images <= 60000:
        parser.error("--images: 10 to 60000")
    if args.repeat < 1:
        parser.error("--repeat: at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return args



def main() -> None:
    parser = ingest_arguments(__doc__.split("\n\n")[0], images=3000, repeat=3)
    parser.add_argument("--media-backend", default=",".join(MEDIA_BACKENDS),
                        help="comma-separated media backends to ingest with (default: both)")
    parser.add_argument("--backbone", choices=sorted(SPECS), default="small_cnn",
                        help="the untrained model: the demo's (default) or resnet18 at 64 px")
    parser.add_argument("--runtime", choices=("auto", "torch", "onnxruntime"), default="auto",
                        help="IMGRET_RUNTIME of the ingest and of the floors (default: the "
                        "product's default)")
    args = check_arguments(parser)
    spec = SPECS[args.backbone]
    backends = [b.strip() for b in args.media_backend.split(",") if b.strip()]
    if not backends or set(backends) - set(MEDIA_BACKENDS):
        parser.error(f"--media-backend: one or more of {', '.join(MEDIA_BACKENDS)}")
    databases = ["sqlite", "postgresql"] if args.postgres else ["sqlite"]
    targets = [(db, backend) for db in databases for backend in backends]

    import torch

    from imgret.embedder import Embedder

    with tempfile.TemporaryDirectory(prefix="ingest-bench-") as tmp:
        work = Path(tmp)
        folder = work / "images"
        images = fashion_mnist_pngs(args.images, 0)
        write_image_folder(folder, images.gallery)
        note = images.note
        checkpoint = demo_checkpoint(work / "run", spec)
        embedder = Embedder.from_checkpoint(checkpoint, device="cpu", batch_size=args.batch_size,
                                            runtime=args.runtime)
        paths = sorted(p for p in folder.rglob("*.png"))
        _floor(paths, embedder)  # warm-up: first calls allocate, Pillow loads its plugins

        floors, pooled, forwards, pooled_cpu, file_us = [], [], [], [], []
        runs: dict[tuple[str, str], list] = {target: [] for target in targets}
        cpu: dict[tuple[str, str], list[float]] = {target: [] for target in targets}
        # Every path runs with this process's start-up objects frozen out of garbage
        # collection, as the ingest freezes them itself: a full collection scanning them
        # stopped this process for 200-300 ms, landing in whichever run was going on.
        with _frozen_long_lived():
            for round_ in range(args.repeat):
                floors.append(_floor(paths, embedder))
                before = cpu_seconds()
                rate = _pooled_floor(paths, embedder)
                if rate is not None:
                    pooled.append(rate)
                    pooled_cpu.append(cpu_seconds() - before)
                forwards.append(_forward(paths, embedder))
                file_us.append(_media_file_cost(work / f"probe-{round_}"))
                for db, backend in targets:
                    before = cpu_seconds()
                    runs[db, backend].append(ingest_fresh(
                        folder, work / f"{db}-{backend}-{round_}", checkpoint,
                        args.postgres if db == "postgresql" else None, args,
                        media_backend=backend))
                    cpu[db, backend].append(cpu_seconds() - before)
                logger.info("round %d: floor %.0f img/s, pooled %s, ingest %s", round_ + 1,
                            floors[-1], f"{pooled[-1]:.0f}" if pooled else "-",
                            ", ".join(f"{db}/{backend} {runs[db, backend][-1][0]:.0f} img/s"
                                      for db, backend in targets))

    floor = statistics.median(floors)
    pooled_floor = statistics.median(pooled) if pooled else None
    # The bar is the faster of the two bare floors: the ratio against it is the bold one.
    pooled_is_bar = bool(pooled_floor) and pooled_floor > floor
    lines = [
        f"Ingest of {args.images} PNG files ({note}) with an UNTRAINED network "
        f"({spec['backbone']}, {spec['dim']}-d, {spec['image_size']} px, greyscale); batch "
        f"{args.batch_size}, "
        f"chunk {args.chunk_size}; runtime {embedder.runtime} (IMGRET_RUNTIME={args.runtime}); "
        f"CPU, {os.cpu_count()} cores, torch threads "
        f"{torch.get_num_threads()}; medians of {args.repeat} interleaved runs; "
        f"{date.today().isoformat()}.",
        "",
        "| path | images/s (median) | runs | ratio to the floor (a) | to the pooled "
        "floor (b) | CPU s per run (median) | (b)'s CPU / this CPU |",
        "|---|---:|---|---:|---:|---:|---:|",
        f"| (a) floor: read + decode + embed, in-process | {floor:.0f} | "
        f"{_list(floors)} | 1.00 | {_ratio(floor, pooled_floor)} | – | – |",
    ]
    pooled_cpu_s = statistics.median(pooled_cpu) if pooled_cpu else None
    if pooled_floor:
        lines.append(f"| (b) pooled floor: the same in the ingest's worker processes "
                     f"(decode + embed) | {pooled_floor:.0f} | {_list(pooled)} | "
                     f"{pooled_floor / floor:.2f} | 1.00 | {pooled_cpu_s:.2f} | 1.00 |")
    for (db, backend), results in runs.items():
        rates = [rate for rate, _ in results]
        rate = statistics.median(rates)
        used = statistics.median(cpu[db, backend])
        lines.append(f"| (c) `imgret.cli.jobs.gallery.ingest`, {db}, media {backend} | "
                     f"{rate:.0f} | "
                     f"{_list(rates)} | {_ratio(rate, floor, bold=not pooled_is_bar)} | "
                     f"{_ratio(rate, pooled_floor, bold=pooled_is_bar)} | {used:.2f} | "
                     f"{_ratio(pooled_cpu_s, used) if pooled_cpu_s else '–'} |")
    lines.append(f"| forward pass alone (preprocessed tensors) | "
                 f"{statistics.median(forwards):.0f} | {_list(forwards)} | "
                 f"{statistics.median(forwards) / floor:.2f} | "
                 f"{_ratio(statistics.median(forwards), pooled_floor)} | – | – |")
    lines += ["", "CPU s: user + system time of this process and of the worker processes it "
              "waited for, over the run (a PostgreSQL server's own work is not in it). With "
              "every core busy in both, a path cannot beat the pooled floor's rate by more "
              "than the last column: the work it adds to decoding and embedding (hashing, "
              "media files, SQL) needs CPU of its own."]
    lines += ["", f"A new media file in the work dir ({work.parent}), per round: "
              f"{' / '.join(f'{us:.0f}' for us in file_us)} us (a fan-out folder and a file, "
              "`MediaStore.stage` into a fresh store)."]
    for (db, backend), results in runs.items():
        rate, report = sorted(results, key=lambda r: r[0])[len(results) // 2]
        stages = ", ".join(f"{stage} {report.seconds[stage]:.2f}" for stage in report.seconds)
        lines += ["", f"{db}, media {backend}, median run ({rate:.0f} img/s, "
                      f"{report.wall_seconds:.2f} s wall): stage seconds {stages}"]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        args.out.write_text(text + "\n")


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that were waited for."""
    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _ratio(rate: float, floor: float | None, *, bold: bool = False) -> str:
    if not floor:
        return "-"
    return f"**{rate / floor:.2f}**" if bold else f"{rate / floor:.2f}"


def _list(rates: list[float]) -> str:
    return " / ".join(f"{rate:.0f}" for rate in rates)


# --------------------------------------------------------------------------- inputs


def demo_checkpoint(run_dir: Path, spec: dict | None = None) -> Path:
    """An untrained checkpoint of ``spec`` (default: the demo model's)."""
    import torch

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    torch.manual_seed(0)
    save_checkpoint(run_dir, EmbeddingNet(ModelSpec(**(spec or DEMO_SPEC))))
    return run_dir


# --------------------------------------------------------------------------- measurements


def _frozen_long_lived():
    """``imgret.process.frozen_long_lived`` (nothing on a tree without it)."""
    try:
        from imgret.process import frozen_long_lived
    except ImportError:
        return contextlib.nullcontext()
    return frozen_long_lived()


def _floor(paths: list[Path], embedder) -> float:
    """Read, decode and embed the files, one batch after the other: images/s."""
    from imgret.images import DEFAULT_MAX_PIXELS, decode_for_embedding

    size = embedder.spec.image_size
    start = time.perf_counter()
    n = 0
    for at in range(0, len(paths), embedder.batch_size):
        images = [decode_for_embedding(path.read_bytes(), size=size,
                                       max_pixels=DEFAULT_MAX_PIXELS)
                  for path in paths[at : at + embedder.batch_size]]
        n += len(embedder.embed(images))
    return n / (time.perf_counter() - start)


def _media_file_cost(store_dir: Path, files: int = 256) -> float:
    """Microseconds per new media file in a fresh store under ``store_dir``."""
    from imgret.gallery.media.files import MediaStore, sha256_hex

    store = MediaStore(store_dir)
    blobs = [i.to_bytes(4, "little") * 100 for i in range(files)]
    keys = [sha256_hex(blob) for blob in blobs]
    start = time.perf_counter()
    for blob, key in zip(blobs, keys, strict=True):
        store.stage(blob, key)
    return (time.perf_counter() - start) / files * 1e6


def _pooled_floor(paths: list[Path], embedder) -> float | None:
    """Read, decode, preprocess and embed in the ingest's worker processes: images/s
    (``None`` on a tree without them)."""
    from types import SimpleNamespace

    try:
        from imgret.gallery.ingest.workers import EmbedWorkers, default_workers
    except ImportError:
        return None
    from imgret.gallery.media.files import sha256_hex
    from imgret.images import DEFAULT_MAX_PIXELS

    workers = default_workers(embedder)
    start = time.perf_counter()
    n = 0
    with EmbedWorkers(embedder, DEFAULT_MAX_PIXELS, workers) as pool:
        tickets = []
        for at in range(0, len(paths), embedder.batch_size):
            work = []
            for path in paths[at : at + embedder.batch_size]:
                data = path.read_bytes()
                work.append(SimpleNamespace(origin=str(path), sha256=sha256_hex(data),
                                            data=data))
            tickets.append(pool.submit(work))
        for ticket in tickets:
            n += len(pool.result(ticket).vectors)
            pool.release(ticket)
    return n / (time.perf_counter() - start)


def _forward(paths: list[Path], embedder) -> float:
    """The forward pass alone on preprocessed inputs of the same files: images/s."""
    from imgret.images import decode_for_embedding

    size = embedder.spec.image_size
    tensors = embedder.preprocess([decode_for_embedding(p.read_bytes(), size=size)
                                   for p in paths])
    start = time.perf_counter()
    n = len(embedder.embed_tensors(tensors))
    return n / (time.perf_counter() - start)


def ingest_fresh(folder: Path, data_dir: Path, checkpoint: Path, postgres: str | None, args,
                 *, ray: str | None = None, media_backend: str = "files"):
    """``imgret.cli.jobs.gallery.ingest`` into a fresh database: (images/s over its wall time,
    report);
    with ``ray``, on Ray Data (``benchmarks/ray_ingest_bench.py``); the image bytes go to
    ``media_backend`` (``IMGRET_MEDIA_BACKEND``)."""
    from imgret.cli.jobs import gallery as commands
    from imgret.settings import Settings

    db_url, drop = f"sqlite:///{data_dir}/gallery.db", None
    if postgres:
        db_url, drop = _create_pg_database(postgres)
    data_dir.mkdir(parents=True)
    try:
        settings = Settings(data_dir=data_dir, model=checkpoint, database_url=db_url,
                            device="cpu", media_backend=media_backend,
                            runtime=getattr(args, "runtime", "auto"))
        report = commands.ingest(settings, folder, batch_size=args.batch_size,
                             chunk_size=args.chunk_size, progress=args.progress, ray=ray)
    finally:
        if drop:
            drop()
    if report.added != report.total or report.failed:
        raise SystemExit(f"ingest did not add every image: {report.summary()}")
    return report.total / report.wall_seconds, report


def _create_pg_database(admin_url: str):
    import psycopg

    name = f"ingest_bench_{uuid.uuid4().hex[:10]}"
    libpq = admin_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"{admin_url.rsplit('/', 1)[0]}/{name}", drop


if __name__ == "__main__":
    main()
