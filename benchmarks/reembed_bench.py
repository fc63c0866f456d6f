"""Re-embedding the demo gallery while a search load runs: its throughput, and /search p99
before and during.

    python benchmarks/reembed_bench.py [--items 8000] [--seconds 10] [--connections 4]
                                       [--duty 0.5]

What it does, in one run (loopback only; each wrk run is bounded in time and connections;
the default run takes about 2 minutes on 2 cores):

1. three *untrained* networks with the demo model's architecture (small_cnn, 64-d, 28 px;
   seeds 0, 1, 2: versions A, B, C): the same work per image as the demo's trained model,
   rankings meaningless (throughput and latency are what is measured here);
2. ``--items`` Fashion-MNIST train images (Debian's ``dataset-fashion-mnist``; generated
   images when it is not installed) written as an ImageFolder and ingested with A the way
   ``imgret demo`` does (``imgret.cli.jobs.gallery.ingest``, SQLite in a temporary data dir);
3. starts ``imgret serve`` (A) with ``IMGRET_EMBED_DUTY=--duty`` and registers B and C
   (``POST /models``);
4. phases, each measured by ``wrk -t1 -c<connections>`` on ``POST /search`` (k=10, cycling
   through 64 Fashion-MNIST test images) for ``--seconds`` after one warm-up:

   a. the search load alone: req/s, p50, p99;
   b. ``POST /models/B/embed`` and at once the same load: req/s, p50, p99, and the job's
      throughput over the load's window, from ``coverage.embedded`` of ``GET /models/B``
      (polled every 0.25 s, interpolated at the window's ends); then the rest of B's job
      runs with no load (its rate is shown too);
   c. ``POST /models/C/embed`` with no load: the job alone (the peer of b's job rate);
   d. the load alone again (how much p99 moves between two quiet runs).

It prints a markdown table with the ratios: p99 during / before, req/s during / before,
job items/s under load / alone. wrk, the server and its background job share this
machine's cores. Numbers are for this machine only.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import httpx
import numpy as np
from harness import (
    Level,
    fashion_mnist_pngs,
    run_wrk,
    running_server,
    search_bodies,
    write_image_folder,
)

logger = logging.getLogger("reembed_bench")

QUERY_BODIES = 64
WARMUP_S = 5.0
POLL_S = 0.25
JOB_TIMEOUT_S = 240.0
# The demo's model (imgret/cli/demo.py): what the untrained networks imitate.
DEMO_SPEC = {"backbone": "small_cnn", "dim": 64, "image_size": 28}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=8000,
                        help="gallery images to re-embed (<= 20000)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="each wrk phase (at most 60)")
    parser.add_argument("--connections", type=int, default=4, help="wrk connections")
    parser.add_argument("--duty", type=float,
                        default=float(os.environ.get("IMGRET_EMBED_DUTY", "0.5")),
                        help="IMGRET_EMBED_DUTY for the server (default: the environment's, "
                             "else 0.5)")
    args = parser.parse_args()
    if not 1 <= args.items <= 20000:
        parser.error("--items: 1 to 20000")
    if not 0 < args.seconds <= 60:
        parser.error("--seconds: at most 60")
    if not 1 <= args.connections <= 64:
        parser.error("--connections: 1 to 64")
    if not 0 < args.duty <= 1:
        parser.error("--duty: in (0, 1]")
    if shutil.which("wrk") is None:
        sys.exit("reembed_bench: `wrk` is not installed; install the Debian package "
                 "(apt-get install wrk) and run again")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="imgret-reembed-") as tmp:
        work = Path(tmp)
        runs = _models(work)
        images = fashion_mnist_pngs(args.items, QUERY_BODIES)
        write_image_folder(work / "gallery", images.gallery)
        queries, data_note = images.queries, images.note
        bodies = search_bodies(queries, work / "bodies")
        data_dir = work / "data"
        db_url = f"sqlite:///{data_dir / 'imgret.db'}"
        ingest_rate = _ingest(work / "gallery", data_dir, db_url, runs[0][1])
        env = {
            "IMGRET_DATA_DIR": str(data_dir),
            # Never the caller's database: a fresh SQLite file in the temporary data dir.
            "IMGRET_DATABASE_URL": db_url,
            "IMGRET_MODEL": str(runs[0][1]),
            "IMGRET_DEVICE": "cpu",
            "IMGRET_API_KEY": secrets.token_hex(16),
            "IMGRET_EMBED_DUTY": str(args.duty),
        }
        headers = {"X-API-Key": env["IMGRET_API_KEY"]}
        with (running_server(env, log_path=work / "serve.log") as server,
              httpx.Client(base_url=server.url, headers=headers, timeout=120) as http):
            live = http.get("/health").json()
            assert live["model_version"] == runs[0][0], live
            logger.info("serving %s with %d vectors", live["model_version"],
                        live["index_size"])
            for _, run_dir in runs[1:]:
                http.post("/models", json={"path": str(run_dir)}).raise_for_status()
            (_, _), (version_b, _), (version_c, _) = runs

            logger.info("warming up for %.0f s", WARMUP_S)
            run_wrk(server.url, bodies, args.connections, WARMUP_S)
            before = run_wrk(server.url, bodies, args.connections, args.seconds)
            logger.info("(a) load alone: %.1f req/s, p99 %.1f ms", before.rps, before.p99_ms)

            # (b) the job of B and the same load, started together.
            job_b = Progress(http, version_b)
            job_b.start()
            started = time.monotonic()
            during = run_wrk(server.url, bodies, args.connections, args.seconds)
            load_end = time.monotonic()
            job_b.wait_done(JOB_TIMEOUT_S)
            if job_b.done_at < load_end:
                logger.warning("B's job finished %.1f s before the load ended: its rate is "
                               "over its own run; raise --items to cover the whole load",
                               load_end - job_b.done_at)
            under_load = job_b.rate(started, min(load_end, job_b.done_at))
            rest = job_b.rate(load_end, job_b.done_at)
            logger.info("(b) load + job: %.1f req/s, p99 %.1f ms; job %.1f items/s under "
                        "load, %.1f items/s after it", during.rps, during.p99_ms,
                        under_load, rest)

            # (c) the job of C alone.
            job_c = Progress(http, version_c)
            job_c.start()
            job_c.wait_done(JOB_TIMEOUT_S)
            alone = job_c.rate(job_c.started_at, job_c.done_at)
            logger.info("(c) job alone: %.1f items/s", alone)
            # The load alone once more: how much p99 moves between two quiet runs.
            after = run_wrk(server.url, bodies, args.connections, args.seconds)
            logger.info("(d) load alone again: %.1f req/s, p99 %.1f ms", after.rps,
                        after.p99_ms)
    overlap = (min(load_end, job_b.done_at) - started, load_end - started)
    _print_table(args, before, during, after, under_load, rest, alone, ingest_rate, data_note,
                 job_b.live, overlap)


# --------------------------------------------------------------------------- inputs


def _models(work: Path) -> list[tuple[str, Path]]:
    """``[(version, run_dir)]`` of A, B, C: untrained networks of the demo's architecture."""
    import torch

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    runs = []
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        run_dir = work / f"run{seed}"
        runs.append((save_checkpoint(run_dir, EmbeddingNet(ModelSpec(**DEMO_SPEC))), run_dir))
    return runs


def _ingest(folder: Path, data_dir: Path, db_url: str, model: Path) -> float:
    """Ingest the gallery with A the way ``imgret demo`` does; returns its items/s."""
    from imgret.cli.jobs import gallery as commands
    from imgret.settings import Settings

    settings = Settings(data_dir=data_dir, model=model, database_url=db_url, device="cpu")
    report = commands.ingest(settings, folder, progress=False)
    for line in report.summary():
        logger.info("ingest: %s", line)
    return report.added / report.wall_seconds


# --------------------------------------------------------------------------- the job


@dataclass
class Progress:
    """A re-embedding job started through the API, and its coverage sampled over time."""

    http: httpx.Client
    version: str
    samples: list[tuple[float, int]] = field(default_factory=list)
    live: int = 0
    started_at: float = 0.0
    done_at: float = 0.0
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _error: BaseException | None = None

    def start(self) -> None:
        """``POST /models/{v}/embed``, then sample ``GET /models/{v}`` every POLL_S."""
        self.started_at = time.monotonic()
        self.http.post(f"/models/{self.version}/embed").raise_for_status()
        self.samples.append((self.started_at, 0))
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        try:
            while True:
                info = self.http.get(f"/models/{self.version}").json()
                now = time.monotonic()
                self.samples.append((now, info["coverage"]["embedded"]))
                self.live = info["coverage"]["live"]
                state = info["embedding"]["state"]
                if state not in ("running", "done"):
                    raise RuntimeError(f"the job of {self.version} is {state}: {info}")
                if info["coverage"]["complete"] and state == "done":
                    self.done_at = now
                    return
                time.sleep(POLL_S)
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait_done
            self._error = exc
        finally:
            self._done.set()

    def wait_done(self, timeout: float) -> None:
        if not self._done.wait(timeout):
            raise RuntimeError(f"the job of {self.version} did not finish in {timeout:.0f} s")
        if self._error is not None:
            raise self._error

    def rate(self, t0: float, t1: float) -> float:
        """Items embedded per second between ``t0`` and ``t1`` (coverage interpolated)."""
        times, counts = zip(*self.samples, strict=True)
        done = np.interp([t0, t1], times, counts)
        return float(done[1] - done[0]) / (t1 - t0) if t1 > t0 else float("nan")


# --------------------------------------------------------------------------- report


def _print_table(args: argparse.Namespace, before: Level, during: Level, after: Level,
                 under_load: float,
                 rest: float, alone: float, ingest_rate: float, data_note: str,
                 items: int, overlap: tuple[float, float]) -> None:
    out = io.StringIO()
    out.write(
        f"\nRe-embedding {items} gallery items while POST /search runs (k=10, one image; "
        f"wrk -t1 -c{args.connections}, {args.seconds:.0f} s per phase after a "
        f"{WARMUP_S:.0f} s warm-up); IMGRET_EMBED_DUTY={args.duty:g}; UNTRAINED networks "
        f"with the demo model's architecture ({DEMO_SPEC['backbone']}, {DEMO_SPEC['dim']}-d, "
        f"{DEMO_SPEC['image_size']} px; seeds 0/1/2 = versions A/B/C); {data_note}; exact "
        f"Flat index, SQLite, 1 uvicorn worker, CPU, {os.cpu_count()} cores shared by wrk, "
        f"the server and its job; loopback; {date.today().isoformat()}.\n\n"
        "| phase | /search req/s | p50 ms | p99 ms | non-2xx | socket errors "
        "| re-embedding items/s |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n"
        f"| (a) search load alone (A) | {before.rps:.1f} | {before.p50_ms:.1f} "
        f"| {before.p99_ms:.1f} | {before.non_2xx} | {before.socket_errors} | - |\n"
        f"| (b) search load + re-embedding B | {during.rps:.1f} | {during.p50_ms:.1f} "
        f"| {during.p99_ms:.1f} | {during.non_2xx} | {during.socket_errors} "
        f"| {under_load:.1f} |\n"
        f"| (b') rest of B's job, load stopped | - | - | - | - | - | {_num(rest)} |\n"
        f"| (c) re-embedding C alone | - | - | - | - | - | {alone:.1f} |\n"
        f"| (d) search load alone again (A) | {after.rps:.1f} | {after.p50_ms:.1f} "
        f"| {after.p99_ms:.1f} | {after.non_2xx} | {after.socket_errors} | - |\n"
        "\n"
        f"- /search p99 during / before: **{during.p99_ms / before.p99_ms:.2f}** "
        f"(p50 {during.p50_ms / before.p50_ms:.2f}); req/s during / before: "
        f"**{during.rps / before.rps:.2f}**; against the second quiet run (d): p99 "
        f"{during.p99_ms / after.p99_ms:.2f}, req/s {during.rps / after.rps:.2f}\n"
        f"- job throughput under load / alone: **{under_load / alone:.2f}** (B's job ran "
        f"during {overlap[0]:.1f} s of the {overlap[1]:.1f} s load"
        f"{'' if overlap[0] >= 0.98 * overlap[1] else ': raise --items to cover all of it'})\n"
        f"- peer: the foreground ingest of the same images with A before the server started "
        f"(files -> media store, rows and vectors; no throttle, no load): "
        f"{ingest_rate:.1f} items/s\n"
    )
    sys.stdout.write(out.getvalue())


def _num(value: float) -> str:
    return "-" if np.isnan(value) else f"{value:.1f}"


if __name__ == "__main__":
    main()
