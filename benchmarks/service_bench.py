"""Service throughput with and without dynamic batching, against a real uvicorn server.

    python benchmarks/service_bench.py [--seconds 10] [--clients 16] [--client auto|wrk|httpx]

What it does, in one run:

1. builds an untrained resnet18 checkpoint at 64 px (128-d) in a temporary folder;
2. starts ``imgret serve`` on 127.0.0.1 (SQLite, fresh data dir) and adds a gallery of
   generated images (10 classes x 30) through ``POST /gallery``;
3. starts two servers on the same data, dynamic batching on (the default
   IMGRET_BATCH_MAX_SIZE=32) and off (IMGRET_BATCH_MAX_SIZE=1), warms both up, then drives
   ``POST /search`` (k=10) from ``--clients`` concurrent connections for ``--seconds`` against
   one, then the other, for ``--rounds`` alternating rounds (the idle server waits; on a
   shared machine alternating keeps a burst of outside load from landing on one mode only);
4. prints a markdown table: requests/s over all rounds, p50 (mean of rounds) and p99 (worst
   round) latency, mean batch size (from /metrics).

Load generator: ``wrk`` (C, one thread, a Lua script cycling through pre-built multipart
bodies) when installed, else an httpx asyncio client. Both run on the same machine as the
server, so on a small box they take CPU from it: with httpx on 2 cores the client itself is a
bottleneck, which is why wrk is preferred. Numbers are for this machine only.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from harness import BOUNDARY, class_png, run_wrk, running_server, running_servers, search_bodies

logger = logging.getLogger("service_bench")

CLASSES, PER_CLASS, SIZE = 10, 30, 64
QUERY_BODIES = 32
WARMUP_S = 3.0


@dataclass
class Result:
    mode: str
    batch_max_size: int
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    mean_batch: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--client", choices=("auto", "wrk", "httpx"), default="auto")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    client = args.client
    if client == "auto":
        client = "wrk" if shutil.which("wrk") else "httpx"

    with tempfile.TemporaryDirectory(prefix="imgret-bench-") as tmp:
        work = Path(tmp)
        checkpoint, version = _checkpoint(work / "run")
        bodies = search_bodies(
            [class_png(i % CLASSES, 1000 + i, size=SIZE) for i in range(QUERY_BODIES)],
            work / "bodies")
        env = {
            "IMGRET_DATA_DIR": str(work / "data"),
            "IMGRET_MODEL": str(checkpoint),
            "IMGRET_DEVICE": "cpu",
        }
        with running_server(env, log_path=work / "fill.log") as server:
            _fill_gallery(server.url)
        modes = (("batching on", 32), ("batching off", 1))
        specs = [({**env, "IMGRET_BATCH_MAX_SIZE": str(size)}, work / f"serve-{size}.log")
                 for _, size in modes]
        runs: dict[str, list[tuple[int, int, float, float, float]]] = {m: [] for m, _ in modes}
        batches: dict[str, list[float]] = {m: [0.0, 0.0] for m, _ in modes}
        with running_servers(specs) as servers:
            for (mode, _), server in zip(modes, servers, strict=True):
                logger.info("%s: warming up for %.0f s", mode, WARMUP_S)
                _load(client, server.url, bodies, args.clients, WARMUP_S)
            for round_ in range(args.rounds):
                for (mode, _), server in zip(modes, servers, strict=True):
                    before = _batch_counts(server.url)
                    logger.info("round %d, %s: %d clients for %.0f s (%s)", round_ + 1, mode,
                                args.clients, args.seconds, client)
                    runs[mode].append(
                        _load(client, server.url, bodies, args.clients, args.seconds)
                    )
                    after = _batch_counts(server.url)
                    batches[mode][0] += after[0] - before[0]
                    batches[mode][1] += after[1] - before[1]
        results = []
        for mode, size in modes:
            rounds = runs[mode]
            total, count = batches[mode]
            results.append(Result(
                mode, size,
                requests=sum(r[0] for r in rounds), errors=sum(r[1] for r in rounds),
                seconds=sum(r[2] for r in rounds),
                p50_ms=statistics.fmean(r[3] for r in rounds),
                p99_ms=max(r[4] for r in rounds),
                mean_batch=total / count if count else 0.0,
            ))
    _print_table(results, client, args, version)


def _checkpoint(run: Path) -> tuple[Path, str]:
    import torch

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    torch.manual_seed(0)
    model = EmbeddingNet(ModelSpec(backbone="resnet18", dim=128, image_size=64))
    version = save_checkpoint(run, model)
    return run, version


def _fill_gallery(base: str) -> None:
    pairs = [(c, i) for c in range(CLASSES) for i in range(PER_CLASS)]
    for start in range(0, len(pairs), 50):
        chunk = pairs[start : start + 50]
        files = [("images", (f"{c}_{i}.png", class_png(c, i, size=SIZE), "image/png"))
                 for c, i in chunk]
        response = httpx.post(f"{base}/gallery", files=files,
                              data={"labels": [f"class-{c}" for c, _ in chunk]}, timeout=120)
        response.raise_for_status()
    logger.info("gallery: %d images", len(pairs))


def _load(client: str, base: str, bodies: list[Path], clients: int,
          seconds: float) -> tuple[int, int, float, float, float]:
    if client == "wrk":
        return _load_wrk(base, bodies, clients, seconds)
    return asyncio.run(_load_httpx(base, bodies, clients, seconds))


def _load_wrk(base: str, bodies: list[Path], clients: int,
              seconds: float) -> tuple[int, int, float, float, float]:
    level = run_wrk(base, bodies, clients, seconds, request_timeout_s=30)
    return (level.requests, level.non_2xx + level.socket_errors, level.seconds, level.p50_ms,
            level.p99_ms)


async def _load_httpx(base: str, bodies: list[Path], clients: int,
                      seconds: float) -> tuple[int, int, float, float, float]:
    payloads = [path.read_bytes() for path in bodies]
    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds

    async def one_client(index: int, http: httpx.AsyncClient) -> None:
        nonlocal errors
        i = index
        while time.perf_counter() < stop_at:
            i += 1
            start = time.perf_counter()
            response = await http.post("/search", content=payloads[i % len(payloads)],
                                       headers=headers)
            latencies.append(time.perf_counter() - start)
            errors += response.status_code != 200

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as http:
        await asyncio.gather(*(one_client(i, http) for i in range(clients)))
    elapsed = time.perf_counter() - started
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return len(latencies), errors, elapsed, cuts[49] * 1000, cuts[98] * 1000


def _batch_counts(base: str) -> tuple[float, float]:
    text = httpx.get(f"{base}/metrics").text
    total = float(re.search(r"^imgret_batch_size_sum ([\d.e+]+)$", text, re.M).group(1))
    count = float(re.search(r"^imgret_batch_size_count ([\d.e+]+)$", text, re.M).group(1))
    return total, count


def _print_table(results: list[Result], client: str, args: argparse.Namespace,
                 version: str) -> None:
    load = (
        "wrk -t1 (C, Lua multipart bodies)" if client == "wrk"
        else "httpx asyncio (Python; CPU-bound on a small machine, takes cores from the server)"
    )
    out = io.StringIO()
    out.write(
        f"\nPOST /search (k=10), {args.clients} concurrent clients, {args.rounds} alternating "
        f"rounds of {args.seconds:.0f} s per mode after a {WARMUP_S:.0f} s warm-up; "
        f"load generator: {load}.\n"
        f"Model {version} (untrained resnet18, 64 px, CPU, {os.cpu_count()} cores), gallery "
        f"{CLASSES * PER_CLASS} images, exact Flat index, one uvicorn worker, client and "
        "server on the same machine.\n\n"
        "| mode | IMGRET_BATCH_MAX_SIZE | requests/s | p50 ms | p99 ms (worst round) "
        "| mean batch | errors |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n"
    )
    for r in results:
        out.write(
            f"| {r.mode} | {r.batch_max_size} | {r.rps:.1f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} "
            f"| {r.mean_batch:.1f} | {r.errors} |\n"
        )
    if len(results) == 2 and results[1].rps > 0:
        on, off = results
        out.write(
            f"\nbatching on / off: {on.rps / off.rps:.2f}x requests/s, "
            f"p99 {on.p99_ms:.0f} ms vs {off.p99_ms:.0f} ms\n"
        )
    sys.stdout.write(out.getvalue())


if __name__ == "__main__":
    main()
