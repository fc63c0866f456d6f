"""Load: the highest POST /search rate a real server holds with p99 under a target.

    python benchmarks/load_bench.py [--model RUN_DIR] [--levels 1,2,4,8,16,32,64]
                                    [--seconds 5] [--p99-ms 250] [--gallery 300]

What it does, in one run (loopback only; every load level is bounded in time and in
connections; the default run takes about 80 s):

1. the model: ``--model``, else the demo's run (``<IMGRET_DATA_DIR or imgret-data>/demo-run``,
   left there by ``make demo``), else an *untrained* tiny_cnn with the demo model's
   architecture (64-d, 28 px) built in a temporary folder: the same work per image, so the
   same throughput, but meaningless rankings (the output says which one ran);
2. starts ``imgret serve`` on 127.0.0.1 with a fresh data dir (SQLite) and adds ``--gallery``
   Fashion-MNIST train images through ``POST /gallery`` (generated images when Debian's
   ``dataset-fashion-mnist`` is not installed);
3. drives ``POST /search`` (k=10, one of 64 distinct Fashion-MNIST test images per request)
   with ``wrk`` (C, one thread, Lua multipart bodies) at each connection count for
   ``--seconds`` after a warm-up, and reads wrk's own counters from a Lua ``done()``: requests,
   p50, p99, non-2xx responses, socket errors (connect, read, write, timeout);
4. stops the server and measures the same search engine in this process, without HTTP: the
   dynamic batcher in front of the search pipeline (decode, embed, search), built from the
   same settings, with as many queries in flight as wrk had connections;
5. prints a markdown table (server beside engine) and the highest rate held: p99 under the
   target with no error at all.

wrk and the server share this machine's cores, as the engine measurement shares them with
nothing: the gap between the two columns is HTTP + multipart parsing + the load generator.
Numbers are for this machine only.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness import Level, fashion_mnist_pngs, run_wrk, running_server, search_bodies

logger = logging.getLogger("load_bench")

QUERY_BODIES = 64
WARMUP_S = 3.0
GALLERY_CHUNK = 16  # images per POST /gallery
# The demo's model (cli/demo.py): what the untrained fallback imitates.
DEMO_SPEC = {"backbone": "tiny_cnn", "dim": 64, "image_size": 28}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="run dir or model.pt (default: the demo's)")
    parser.add_argument("--levels", default="1,2,4,8,16,32,64",
                        help="wrk connection counts, comma-separated (at most 256)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per level (at most 60)")
    parser.add_argument("--engine-seconds", type=float, default=3.0,
                        help="per level, in-process engine (at most 30)")
    parser.add_argument("--p99-ms", type=float, default=250.0, help="the p99 latency target")
    parser.add_argument("--gallery", type=int, default=300, help="gallery images (<= 5000)")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn workers")
    args = parser.parse_args()
    levels = sorted({int(v) for v in args.levels.split(",") if v.strip()})
    if not levels or levels[0] < 1 or levels[-1] > 256:
        parser.error("--levels: connection counts between 1 and 256")
    if not 0 < args.seconds <= 60 or not 0 < args.engine_seconds <= 30:
        parser.error("--seconds is at most 60 and --engine-seconds at most 30")
    if not 1 <= args.gallery <= 5000:
        parser.error("--gallery: 1 to 5000 images")
    if shutil.which("wrk") is None:
        sys.exit("load_bench: `wrk` is not installed; install the Debian package "
                 "(apt-get install wrk) and run again")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="imgret-load-") as tmp:
        work = Path(tmp)
        model, model_note = _model(args.model, work / "run")
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
        }
        with running_server(env, log_path=work / "serve.log", workers=args.workers) as server:
            base = server.url
            _fill_gallery(base, gallery, env["IMGRET_API_KEY"])
            logger.info("warming up for %.0f s", WARMUP_S)
            run_wrk(base, bodies, levels[len(levels) // 2], WARMUP_S)
            server = []
            for connections in levels:
                server.append(run_wrk(base, bodies, connections, args.seconds))
                logger.info("%d connections: %.1f req/s, p99 %.1f ms, %d non-2xx, "
                            "%d socket errors", connections, server[-1].rps,
                            server[-1].p99_ms, server[-1].non_2xx, server[-1].socket_errors)
        engine = engine_levels(env, queries, levels, args.engine_seconds)
    _print_table(server, engine, args, model_note, data_note, len(gallery))


# --------------------------------------------------------------------------- inputs


def _model(given: Path | None, run_dir: Path) -> tuple[Path, str]:
    """The checkpoint to serve and a sentence saying what it is."""
    if given is not None:
        return given, f"model {given}"
    data_dir = Path(os.environ.get("IMGRET_DATA_DIR", "imgret-data"))
    for candidate in (data_dir / "demo-run", Path(__file__).resolve().parents[1]
                      / "imgret-data" / "demo-run"):
        if (candidate / "model.pt").is_file():
            return candidate, f"the demo's trained model ({candidate})"
    import torch

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    torch.manual_seed(0)
    save_checkpoint(run_dir, EmbeddingNet(ModelSpec(**DEMO_SPEC)))
    return run_dir, (
        "an UNTRAINED tiny_cnn with the demo model's architecture (64-d, 28 px; no demo run "
        "found): same work per image as the demo's model, rankings meaningless"
    )


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


# --------------------------------------------------------------------------- the engine


def engine_levels(env: dict[str, str], queries: list[bytes], levels: list[int],
                  seconds: float) -> list[Level]:
    """The server's search engine in this process (no HTTP), at the same concurrencies."""
    from imgret.embedder import Embedder
    from imgret.settings import Settings
    from index.db import make_engine, make_sessionmaker
    from index.search import Searcher
    from service.telemetry import ServiceMetrics

    settings = Settings(data_dir=Path(env["IMGRET_DATA_DIR"]), model=Path(env["IMGRET_MODEL"]),
                        database_url=env["IMGRET_DATABASE_URL"], device="cpu")
    embedder = Embedder.from_checkpoint(settings.model, device="cpu")
    # One forward pass on this (main) thread first. Measured here: when the main thread has
    # never run the model, the batcher's worker threads embed about 4x slower (torch's OpenMP
    # set-up per thread); a server does not show this, so without it the engine would look
    # slower than the server it is the floor of.
    from PIL import Image

    embedder.embed([Image.open(io.BytesIO(queries[0])).convert("RGB")])
    engine = make_engine(settings.db_url)
    try:
        searcher = Searcher.from_settings(make_sessionmaker(engine), settings,
                                          embedder.model_version)
        batcher = _batcher(settings, embedder, searcher, ServiceMetrics())
        return asyncio.run(_drive_levels(batcher, queries, levels, seconds))
    finally:
        engine.dispose()


def _batcher(settings, embedder, searcher, metrics):
    """The batcher + pipeline the service builds (by hand before ``build_search_batcher``
    existed, so the same script measures commits from before issue 10)."""
    try:
        from service.pipeline import build_search_batcher
    except ImportError:
        from service.batching import DynamicBatcher
        from service.pipeline import SearchPipeline

        pipeline = SearchPipeline(embedder, searcher, max_pixels=settings.max_image_pixels,
                                  metrics=metrics)
        return DynamicBatcher(pipeline, max_size=settings.batch_max_size,
                              max_wait_s=settings.batch_max_wait_ms / 1000.0)
    return build_search_batcher(settings, embedder=embedder, searcher=searcher,
                                metrics=metrics)


async def _drive_levels(batcher, queries: list[bytes], levels: list[int],
                        seconds: float) -> list[Level]:
    from service.pipeline import ImageQuery

    await batcher.start()
    try:
        # Warmed up like the server: at the middle level, then the levels in order.
        await _drive(batcher, ImageQuery, queries, levels[len(levels) // 2], WARMUP_S)
        return [await _drive(batcher, ImageQuery, queries, n, seconds) for n in levels]
    finally:
        await batcher.stop()


async def _drive(batcher, query_type, queries: list[bytes], in_flight: int,
                 seconds: float) -> Level:
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def one(index: int) -> None:
        i = index
        while time.perf_counter() < stop_at:
            i += 1
            start = time.perf_counter()
            await batcher.submit(query_type(queries[i % len(queries)], 10))
            latencies.append(time.perf_counter() - start)

    started = time.perf_counter()
    await asyncio.gather(*(one(n) for n in range(in_flight)))
    elapsed = time.perf_counter() - started
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return Level(in_flight, len(latencies), elapsed, cuts[49] * 1000, cuts[98] * 1000)


# --------------------------------------------------------------------------- report


def _print_table(server: list[Level], engine: list[Level], args: argparse.Namespace,
                 model_note: str, data_note: str, gallery: int) -> None:
    out = io.StringIO()
    out.write(
        f"\nPOST /search (k=10, one image), wrk -t1 for {args.seconds:.0f} s per level after a "
        f"{WARMUP_S:.0f} s warm-up; {model_note}; {data_note}; gallery {gallery} images, exact "
        f"Flat index, SQLite, {args.workers} uvicorn worker(s), dynamic batching on (defaults); "
        f"CPU, {os.cpu_count()} cores shared by wrk and the server; loopback.\n"
        f"Engine = the same batcher + pipeline (decode, embed, search) in-process without "
        f"HTTP, {args.engine_seconds:.0f} s per level, the same queries in flight.\n\n"
        "| connections | req/s | p50 ms | p99 ms | non-2xx | socket errors "
        "| engine q/s | engine p99 ms | server/engine |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    for s, e in zip(server, engine, strict=True):
        out.write(
            f"| {s.connections} | {s.rps:.1f} | {s.p50_ms:.1f} | {s.p99_ms:.1f} | {s.non_2xx} "
            f"| {s.socket_errors} | {e.rps:.1f} | {e.p99_ms:.1f} | {s.rps / e.rps:.2f} |\n"
        )
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
