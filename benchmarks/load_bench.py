"""Load: the highest POST /search rate a real server holds with p99 under a target, beside
the floor of the same work without HTTP.

    python benchmarks/load_bench.py [--model RUN_DIR | --untrained resnet18|tiny_cnn]
                                    [--levels 1,2,4,8,16,32,64] [--seconds 5]
                                    [--floor-seconds 5] [--p99-ms 250] [--gallery 300]
                                    [--workers 1] [--rounds 1]

What it does, in one run (loopback only; every load level is bounded in time and in
connections):

1. the model: ``--model``; or ``--untrained resnet18`` (an untrained resnet18, 128-d at 64 px,
   built in a temporary folder: a realistic amount of work per image) or
   ``--untrained tiny_cnn`` (the demo model's architecture, 64-d at 28 px); by default the
   demo's run (``<IMGRET_DATA_DIR or imgret-data>/demo-run``, left there by ``make demo``),
   else the untrained tiny_cnn. Untrained weights do the same work per image, so they give
   the same throughput, with meaningless rankings (the output says which one ran);
2. starts ``imgret serve`` on 127.0.0.1 with a fresh data dir (SQLite) and adds ``--gallery``
   Fashion-MNIST train images through ``POST /gallery`` (generated images when Debian's
   ``dataset-fashion-mnist`` is not installed);
3. drives ``POST /search`` (k=10, one of 64 distinct Fashion-MNIST test images per request)
   with ``wrk`` (C, one thread, Lua multipart bodies) at each connection count for
   ``--seconds`` after a warm-up, and reads wrk's own counters from a Lua ``done()``: requests,
   p50, p99, non-2xx responses, socket errors (connect, read, write, timeout); and the
   server's ``imgret_batch_size`` histogram before and after: the batches the server formed
   at that level (images per forward pass);
4. right after each level, with the server idle, measures the **floor** in this process: the
   service's own
   ``SearchPipeline`` (decode -> embed -> search, built by ``build_search_batcher`` from the
   same settings, the same checkpoint and the same gallery database) called back to back on
   batches of the size the server formed at that level (its mean, rounded), cycling through
   the same query images, in one thread: no HTTP, no event loop, no queueing. It runs once
   with the service's thread settings and once with torch on every core, and the better of
   the two is the floor (so no thread setting of the service can lower its own floor);
5. repeats 3-4 ``--rounds`` times (a ratio is two measurements seconds apart, and the median
   over rounds damps this shared machine's noise: the floor alone moved 860-1,700 img/s
   between runs of one day);
6. prints a markdown table (server beside floor, and their ratio, per round; the median
   ratio) and the highest rate held: p99 under the target with no error at all. Beside
   them, the floor's CPU per image over the server's CPU per request (with every core busy,
   server/floor cannot pass it: the request path's CPU is taken from the pipeline), and
   the mean forward pass per batch in the server (its ``imgret_embed_seconds``) and in
   the floor's pipeline: the same model should take the same time in both (a second
   thread's OpenMP team once made them differ: docs/service_bench.md, "One OpenMP team").

wrk and the server share this machine's cores, as the floor shares them with nothing: the gap
between the two columns is HTTP + multipart parsing + the load generator + the batcher.
Numbers are for this machine only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from harness import (
    Level,
    batch_histogram,
    fashion_mnist_pngs,
    histogram_sum_count,
    run_wrk,
    running_server,
    scrape,
    search_bodies,
    server_cpu_seconds,
)

logger = logging.getLogger("load_bench")

QUERY_BODIES = 64
WARMUP_S = 3.0
GALLERY_CHUNK = 16  # images per POST /gallery
# The demo's model (imgret/cli/demo.py): what the untrained fallback imitates; and a realistic
# one.
UNTRAINED = {
    "tiny_cnn": {"backbone": "tiny_cnn", "dim": 64, "image_size": 28},
    "resnet18": {"backbone": "resnet18", "dim": 128, "image_size": 64},
}
DEMO_SPEC = UNTRAINED["tiny_cnn"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="run dir or model.pt (default: the demo's)")
    parser.add_argument("--untrained", choices=sorted(UNTRAINED),
                        help="serve an untrained model of this architecture instead")
    parser.add_argument("--levels", default="1,2,4,8,16,32,64",
                        help="wrk connection counts, comma-separated (at most 256)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per level (at most 60)")
    parser.add_argument("--floor-seconds", type=float, default=5.0,
                        help="per level and thread setting, the in-process floor (at most 30)")
    parser.add_argument("--p99-ms", type=float, default=250.0, help="the p99 latency target")
    parser.add_argument("--gallery", type=int, default=300, help="gallery images (<= 5000)")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn workers")
    parser.add_argument("--runtime", choices=("auto", "torch", "onnxruntime"), default="auto",
                        help="IMGRET_RUNTIME of the server and of the in-process floor "
                        "(default: the product's default)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat every level and its floor (at most 10); the table gives "
                             "each round and the median ratio")
    args = parser.parse_args()
    levels = sorted({int(v) for v in args.levels.split(",") if v.strip()})
    if not levels or levels[0] < 1 or levels[-1] > 256:
        parser.error("--levels: connection counts between 1 and 256")
    if not 0 < args.seconds <= 60 or not 0 < args.floor_seconds <= 30:
        parser.error("--seconds is at most 60 and --floor-seconds at most 30")
    if not 1 <= args.rounds <= 10:
        parser.error("--rounds: 1 to 10")
    if args.model is not None and args.untrained is not None:
        parser.error("--model or --untrained, not both")
    if not 1 <= args.gallery <= 5000:
        parser.error("--gallery: 1 to 5000 images")
    if shutil.which("wrk") is None:
        sys.exit("load_bench: `wrk` is not installed; install the Debian package "
                 "(apt-get install wrk) and run again")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="imgret-load-") as tmp:
        work = Path(tmp)
        model, model_note = _model(args.model, work / "run", args.untrained)
        images = fashion_mnist_pngs(args.gallery, QUERY_BODIES)
        gallery, queries, data_note = images.gallery, images.queries, images.note
        bodies = search_bodies(queries, work / "bodies")
        data_dir = work / "data"
        env = {
            "IMGRET_DATA_DIR": str(data_dir),
            # Never the caller's database: a fresh SQLite file in the temporary data dir.
            "IMGRET_DATABASE_URL": f"sqlite:///{data_dir / 'imgret.db'}",
            "IMGRET_MODEL": str(model),
            "IMGRET_DEVICE": "cpu",
            "IMGRET_API_KEY": secrets.token_hex(16),
            "IMGRET_RUNTIME": args.runtime,
        }
        with running_server(env, log_path=work / "serve.log", workers=args.workers) as live:
            base = live.url
            _fill_gallery(base, gallery, env["IMGRET_API_KEY"])
            logger.info("warming up for %.0f s", WARMUP_S)
            run_wrk(base, bodies, levels[len(levels) // 2], WARMUP_S)
            # With one worker the served process is the one started; with more, uvicorn's
            # supervisor, whose CPU says nothing about the requests.
            pid = live.process.pid if args.workers == 1 else None
            rounds = []
            with FloorPipeline(env, queries) as floor:
                for number in range(1, args.rounds + 1):
                    logger.info("round %d of %d", number, args.rounds)
                    rounds.append(_round(base, bodies, levels, pid, floor, args))
    _print_table(rounds, args, model_note, data_note, len(gallery))


@dataclass(frozen=True)
class LevelResult:
    """One load level of one round: the server's numbers and the floor measured after it."""

    server: Level
    batch_mean: float
    cpu_us: tuple[float, float]  # per request: event-loop thread, whole process
    pass_ms: float  # the server's mean forward pass per batch (imgret_embed_seconds)
    floor: Floor

    @property
    def ratio(self) -> float:
        return self.server.rps / self.floor.best


def _round(base: str, bodies: list[Path], levels: list[int], pid: int | None,
           floor: FloorPipeline, args: argparse.Namespace) -> list[LevelResult]:
    """Every level against the server, each followed by the floor at the batch size it formed
    (the server idles meanwhile): a ratio is made of two measurements seconds apart, so a
    slow or busy stretch of this shared machine moves both."""
    results = []
    for connections in levels:
        before = scrape(base)
        cpu_before = server_cpu_seconds(pid) if pid else (float("nan"),) * 2
        level = run_wrk(base, bodies, connections, args.seconds)
        cpu_after = server_cpu_seconds(pid) if pid else (float("nan"),) * 2
        after = scrape(base)
        batches = batch_histogram(after) - batch_histogram(before)
        pass_ms = _mean_ms(histogram_sum_count(before, "imgret_embed_seconds"),
                           histogram_sum_count(after, "imgret_embed_seconds"))
        cpu = tuple((b - a) / max(1, level.requests) * 1e6
                    for a, b in zip(cpu_before, cpu_after, strict=True))
        logger.info("%d connections: %.1f req/s, p99 %.1f ms, %d non-2xx, %d socket errors, "
                    "mean batch %.1f", connections, level.rps, level.p99_ms, level.non_2xx,
                    level.socket_errors, batches.mean)
        results.append(LevelResult(level, batches.mean, cpu,  # type: ignore[arg-type]
                                   pass_ms, floor.measure(batches.mean, args.floor_seconds)))
    return results


# --------------------------------------------------------------------------- inputs


def _model(given: Path | None, run_dir: Path, untrained: str | None) -> tuple[Path, str]:
    """The checkpoint to serve and a sentence saying what it is."""
    if given is not None:
        return given, f"model {given}"
    if untrained is not None:
        return _untrained(run_dir, untrained), (
            f"an UNTRAINED {untrained} ({UNTRAINED[untrained]['dim']}-d, "
            f"{UNTRAINED[untrained]['image_size']} px; --untrained): the work per image of a "
            "trained one, rankings meaningless"
        )
    data_dir = Path(os.environ.get("IMGRET_DATA_DIR", "imgret-data"))
    for candidate in (data_dir / "demo-run", Path(__file__).resolve().parents[1]
                      / "imgret-data" / "demo-run"):
        if (candidate / "model.pt").is_file():
            return candidate, f"the demo's trained model ({candidate})"
    return _untrained(run_dir, "tiny_cnn"), (
        "an UNTRAINED tiny_cnn with the demo model's architecture (64-d, 28 px; no demo run "
        "found): same work per image as the demo's model, rankings meaningless"
    )


def _untrained(run_dir: Path, name: str) -> Path:
    import torch

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    torch.manual_seed(0)
    save_checkpoint(run_dir, EmbeddingNet(ModelSpec(**UNTRAINED[name])))
    return run_dir


def _fill_gallery(base: str, gallery: list[tuple[bytes, str]], api_key: str) -> None:
    for start in range(0, len(gallery), GALLERY_CHUNK):
        chunk = gallery[start : start + GALLERY_CHUNK]
        response = httpx.post(
            f"{base}/gallery", headers={"X-API-Key": api_key}, timeout=120,
            files=[("images", (f"{start + i}.png", data, "image/png"))
                   for i, (data, _) in enumerate(chunk)],
            data={"labels": [label for _, label in chunk]},
        )
        response.raise_for_status()
    size = httpx.get(f"{base}/health", timeout=30).json()["index_size"]
    logger.info("gallery: %d images added, index size %d", len(gallery), size)


# --------------------------------------------------------------------------- the floor


@dataclass(frozen=True)
class Floor:
    """The in-process pipeline at one batch size: images/s with the service's thread settings
    and with torch on every core (``best`` is the floor)."""

    batch: int
    service_threads: int
    service_ips: float
    all_threads: int
    all_ips: float
    pass_ms: float  # mean forward pass per batch, with the service's threads
    cpu_us: float  # this process's CPU per image, with the service's threads

    @property
    def best(self) -> float:
        return max(self.service_ips, self.all_ips)


class FloorPipeline:
    """The floor: the service's own pipeline in this process, built the way the server builds
    it from the same settings, checkpoint and gallery database (this also applies the
    service's process-wide thread settings)."""

    def __init__(self, env: dict[str, str], queries: list[bytes]):
        self.env = env
        self.queries = queries

    def __enter__(self) -> FloorPipeline:
        import torch

        from imgret.embedder import Embedder
        from imgret.gallery.search import Searcher
        from imgret.gallery.storage.db import make_engine, make_sessionmaker
        from imgret.process import frozen_long_lived
        from imgret.service.pipeline import ImageQuery, build_search_batcher
        from imgret.service.telemetry import ServiceMetrics
        from imgret.settings import Settings

        env = self.env
        settings = Settings(data_dir=Path(env["IMGRET_DATA_DIR"]),
                            model=Path(env["IMGRET_MODEL"]),
                            database_url=env["IMGRET_DATABASE_URL"], device="cpu",
                            runtime=env["IMGRET_RUNTIME"])
        embedder = Embedder.from_checkpoint(settings.model, device="cpu",
                                            runtime=settings.runtime)
        self.engine = make_engine(settings.db_url)
        searcher = Searcher.from_settings(make_sessionmaker(self.engine), settings,
                                          embedder.model_version)
        self.pipeline = build_search_batcher(settings, embedder=embedder, searcher=searcher,
                                             metrics=ServiceMetrics()).process
        self.service_threads = torch.get_num_threads()
        self.items = [ImageQuery(data, 10) for data in self.queries]
        # As the server does once started: no ~200 ms full collection of this process's
        # start-up objects in the middle of a measurement.
        self._frozen = contextlib.ExitStack()
        self._frozen.enter_context(frozen_long_lived())
        return self

    def __exit__(self, *exc: object) -> None:
        self._frozen.close()
        self.engine.dispose()

    def measure(self, mean_batch: float, seconds: float) -> Floor:
        """Images/s on batches of the server's mean size, with the service's torch threads and
        with torch on every core (the better one is the floor)."""
        import torch

        batch = max(1, round(mean_batch))
        every_core = os.cpu_count() or 1
        rates, cpu = {}, {}
        passes = self.pipeline.metrics.embed_seconds
        passes_before = _sum_count(passes)
        for threads in (self.service_threads, every_core):
            if threads in rates:
                continue
            torch.set_num_threads(threads)
            try:
                rates[threads], cpu[threads] = _pipeline_rate(self.pipeline, self.items,
                                                              batch, seconds)
            finally:
                torch.set_num_threads(self.service_threads)
            if threads == self.service_threads:
                pass_ms = _mean_ms(passes_before, _sum_count(passes))
        logger.info("floor at batch %d: %.1f img/s (%d torch threads), %.1f img/s (%d)",
                    batch, rates[self.service_threads], self.service_threads,
                    rates[every_core], every_core)
        return Floor(batch, self.service_threads, rates[self.service_threads], every_core,
                     rates[every_core], pass_ms, cpu[self.service_threads])


def _sum_count(histogram) -> tuple[float, float]:
    """(sum, count) of an unlabelled prometheus_client histogram in this process."""
    (metric,) = histogram.collect()
    samples = {sample.name: sample.value for sample in metric.samples}
    return samples[f"{metric.name}_sum"], samples[f"{metric.name}_count"]


def _mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Mean milliseconds per observation between two (sum, count) readings."""
    count = after[1] - before[1]
    return (after[0] - before[0]) / count * 1000 if count else float("nan")


def _pipeline_rate(pipeline, items: list, batch: int, seconds: float) -> tuple[float, float]:
    """Images/s of ``pipeline(batch of items)`` back to back, after a warm-up, and this
    process's CPU microseconds (every thread, user + system) per image meanwhile."""
    position = 0

    def next_batch() -> list:
        nonlocal position
        chosen = [items[(position + i) % len(items)] for i in range(batch)]
        position += batch
        return chosen

    warm_until = time.perf_counter() + min(2.0, seconds)
    while time.perf_counter() < warm_until:
        pipeline(next_batch())
    done = 0
    cpu_started = time.process_time()
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        results = pipeline(next_batch())
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"the floor's pipeline failed: {errors[0]!r}")
        done += len(results)
    elapsed = time.perf_counter() - started
    return done / elapsed, (time.process_time() - cpu_started) / max(1, done) * 1e6


# --------------------------------------------------------------------------- report


def _print_table(rounds: list[list[LevelResult]], args: argparse.Namespace, model_note: str,
                 data_note: str, gallery: int) -> None:
    out = io.StringIO()
    out.write(
        f"\nPOST /search (k=10, one image), wrk -t1 for {args.seconds:.0f} s per level after a "
        f"{WARMUP_S:.0f} s warm-up; {model_note} (IMGRET_RUNTIME={args.runtime}); {data_note}; "
        f"gallery {gallery} images, exact "
        f"Flat index, SQLite, {args.workers} uvicorn worker(s), dynamic batching on (defaults); "
        f"CPU, {os.cpu_count()} cores shared by wrk and the server; loopback.\n"
        f"Floor = the service's SearchPipeline (decode, embed, search) in this process, no "
        f"HTTP, on the same query images in batches of the size the server formed (mean of "
        f"its imgret_batch_size histogram at that level, rounded), back to back for "
        f"{args.floor_seconds:.0f} s right after the level (the server idle), the better of "
        f"the service's torch threads and every core. CPU per request: the server's "
        f"event-loop thread / the whole server process, from /proc, over the level's "
        f"requests. Forward pass: the mean time of one batch's embedding (the "
        f"imgret_embed_seconds histogram of the server over the level, and of the floor's own "
        f"pipeline with the service's threads): where they differ, the server's model runs "
        f"slower than the same model in-process. Floor CPU: this process's CPU per image "
        f"while the floor ran with the service's threads; floor CPU / server CPU bounds "
        f"server/floor when every core is busy (the request path's own CPU, and wrk's, "
        f"come on top). {len(rounds)} round(s) of every level and its floor; a row per "
        f"round.\n\n"
        "| round | connections | req/s | p50 ms | p99 ms | non-2xx | socket errors | server "
        "batch (mean) | CPU us/request (event loop / process) | floor batch "
        "| floor img/s (service threads / all cores) | forward pass ms per batch (server / "
        "floor) | floor CPU us/image | floor CPU / server CPU | server/floor |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    for number, results in enumerate(rounds, 1):
        for r in results:
            s, c, f = r.server, r.cpu_us, r.floor
            out.write(
                f"| {number} | {s.connections} | {s.rps:.1f} | {s.p50_ms:.1f} | {s.p99_ms:.1f} "
                f"| {s.non_2xx} | {s.socket_errors} | {r.batch_mean:.1f} "
                f"| {c[0]:.0f} / {c[1]:.0f} | {f.batch} | {f.best:.1f} "
                f"({f.service_ips:.1f} @{f.service_threads} / {f.all_ips:.1f} @{f.all_threads}) "
                f"| {r.pass_ms:.1f} / {f.pass_ms:.1f} | {f.cpu_us:.0f} "
                f"| {f.cpu_us / c[1]:.2f} | {r.ratio:.2f} |\n"
            )
    if len(rounds) > 1:
        out.write("\nserver/floor per level over the rounds: ")
        out.write("; ".join(
            f"{results[0].server.connections} connections: median "
            f"{statistics.median(r.ratio for r in results):.2f} (min "
            f"{min(r.ratio for r in results):.2f}, max {max(r.ratio for r in results):.2f})"
            for results in zip(*rounds, strict=True)
        ) + "\n")
    server = [r.server for results in rounds for r in results]
    held = [s for s in server if s.held(args.p99_ms)]
    errors = sum(s.non_2xx + s.socket_errors for s in server)
    if held:
        best = max(held, key=lambda s: s.rps)
        out.write(
            f"\nheld: {best.rps:.1f} req/s at {best.connections} connections with p99 "
            f"{best.p99_ms:.1f} ms < {args.p99_ms:.0f} ms and no errors; errors over all "
            f"levels: {errors}\n"
        )
    else:
        out.write(f"\nno level kept p99 under {args.p99_ms:.0f} ms without errors; errors over "
                  f"all levels: {errors}\n")
    sys.stdout.write(out.getvalue())


if __name__ == "__main__":
    main()
