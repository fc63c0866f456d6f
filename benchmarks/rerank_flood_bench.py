"""Re-ranking flood: the p99 of plain ``POST /search`` at a fixed client count while a flood of
maximal re-ranked requests runs, beside its p99 without the flood, in one run.

    python benchmarks/rerank_flood_bench.py [--gallery 50000] [--clients 4] [--flood 8]
                                            [--seconds 20] [--work DIR]
                                            [--ignore-retry-after]

What it does (loopback only; every phase is bounded in time and in connections; about
``40 + 3 x (seconds + 2)`` s plus the gallery fill, under three minutes at the defaults):

1. the model: an untrained tiny_cnn (the demo model's architecture, 64-d at 28 px, as
   ``load_bench.py --untrained tiny_cnn``): the work per image of the demo's model;
2. a gallery of ``--gallery`` synthetic clustered 64-d unit vectors (200 clusters), written
   straight into a fresh SQLite database through ``imgret.gallery.storage.item_store.insert_items``
   after a first server start created the schema and registered the model; then the server is
   started again and builds its index (exact ``Flat``, the default) from them;
3. three phases of ``--seconds`` each, after a 2 s warm-up: **plain** (``--clients``
   closed-loop connections sending ``POST /search``, one generated PNG, k = 10), **flood**
   (the same, while ``--flood`` other connections, from another process, send the largest
   request the search budget allows, back to back: ``POST /search/batch`` with as many images
   as ``REQUEST_RERANK_SEARCHES_MAX`` admits at ``rerank_candidates`` = 100, k1 = 100 and the
   largest ``k``; after a 503 a flood connection waits its ``Retry-After``, unless
   ``--ignore-retry-after``: then the flood is one of request rate, which no per-request
   budget bounds), and **plain** again (how much the figure moves without a flood);
4. prints, per phase, the plain searches' count, rate, p50 and p99 beside the quiet p99: the
   mean of the two plain phases', which bracket the flood (the peer: target flood p99 <= 2x;
   the quiet p99 alone moves by a third within a minute here, so one side would decide the
   verdict by chance; the ratio to each side is printed too), and the flood's answers (200, 503 with
   Retry-After, other); and the flood's re-ranked queries per second beside the floor: one
   maximal re-ranked query searched back to back in this process on the same vectors.

The load generator (Python, asyncio + httpx) shares the machine's cores with the server, as
real clients on one host would. Numbers are for this machine only.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from harness import class_png, running_server

KEY = "flood-bench"
WARMUP_S = 2.0
CLUSTERS = 200


@dataclass(frozen=True)
class Phase:
    name: str
    latencies_ms: list[float]
    seconds: float
    errors: int
    flood: dict[str, int]

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")

    @property
    def p99(self) -> float:
        return (float(np.percentile(self.latencies_ms, 99)) if self.latencies_ms
                else float("nan"))


# --------------------------------------------------------------------------- load


async def _closed_loop(url: str, make_request, seconds: float, warmup: float,
                       clients: int, *, retry_after: bool = False,
                       ) -> tuple[list[float], dict[str, int]]:
    """``clients`` connections, each sending ``make_request(client, i)`` back to back for
    ``warmup + seconds`` (with ``retry_after``, waiting as a 503's ``Retry-After`` says);
    latencies and status counts of the last ``seconds`` only."""
    latencies: list[float] = []
    counts: dict[str, int] = {}
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + seconds

    async def one(index: int) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            i = index
            while (now := time.perf_counter()) < end:
                try:
                    response = await make_request(client, i)
                    status = str(response.status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                done = time.perf_counter()
                if now >= measure_from:
                    counts[status] = counts.get(status, 0) + 1
                    if status == "200":
                        latencies.append((done - now) * 1000)
                i += clients
                if retry_after and status == "503":
                    wait = float(response.headers.get("Retry-After", "1"))
                    await asyncio.sleep(max(0.0, min(wait, end - time.perf_counter())))

    await asyncio.gather(*(one(c) for c in range(clients)))
    return latencies, counts


def _plain_request(images: list[bytes]):
    async def send(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post("/search", data={"k": "10"}, files={
            "image": ("q.png", images[i % len(images)], "image/png")})
    return send


def _flood_request(images: list[bytes], per_request: int, k: int):
    async def send(client: httpx.AsyncClient, i: int) -> httpx.Response:
        files = [("images", (f"f{j}.png", images[(i + j) % len(images)], "image/png"))
                 for j in range(per_request)]
        return await client.post("/search/batch", files=files, data={
            "k": str(k), "rerank": "k_reciprocal", "rerank_candidates": "100",
            "rerank_k1": "100"})
    return send


def _flood_process(url: str, seconds: float, warmup: float, clients: int, per_request: int,
                   k: int, retry_after: bool, out) -> None:
    images = [class_png(i % 10, 1000 + i) for i in range(32)]
    _, counts = asyncio.run(_closed_loop(url, _flood_request(images, per_request, k), seconds,
                                         warmup, clients, retry_after=retry_after))
    out.put(counts)


def run_phase(name: str, url: str, args: argparse.Namespace, images: list[bytes], *,
              flood: bool, per_request: int, k: int) -> Phase:
    process = None
    queue: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    if flood:
        process = multiprocessing.get_context("spawn").Process(
            target=_flood_process,
            args=(url, args.seconds, WARMUP_S, args.flood, per_request, k,
                  not args.ignore_retry_after, queue))
        process.start()
        time.sleep(1.0)  # the child's imports: its connections start with the warm-up
    latencies, counts = asyncio.run(_closed_loop(url, _plain_request(images), args.seconds,
                                                 WARMUP_S, args.clients))
    flood_counts: dict[str, int] = {}
    if process is not None:
        flood_counts = queue.get(timeout=args.seconds + 120)
        process.join(60)
    errors = sum(n for status, n in counts.items() if status != "200")
    return Phase(name, latencies, args.seconds, errors, flood_counts)


# --------------------------------------------------------------------------- gallery


def synthetic_vectors(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(CLUSTERS, dim))
    points = centres[rng.integers(0, CLUSTERS, n)] + 0.5 * rng.normal(size=(n, dim))
    return (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)


def fill_gallery(db_url: str, version: str, vectors: np.ndarray, chunk: int = 5000) -> None:
    from imgret.gallery.storage import item_store
    from imgret.gallery.storage.db import make_engine, make_sessionmaker
    from imgret.gallery.versions import version_store

    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    try:
        for start in range(0, len(vectors), chunk):
            part = vectors[start : start + chunk]
            rows = [item_store.NewRow(f"{start + i:064x}", f"synthetic/{start + i}", "image/png",
                                      f"c{(start + i) % CLUSTERS}") for i in range(len(part))]
            with sessions.begin() as session:
                model = version_store.get_model_version(session=session, version=version)
                item_store.insert_items(rows, part, session=session, model_version=model)
            print(f"  gallery: {start + len(part):,} / {len(vectors):,} vectors", flush=True)
    finally:
        engine.dispose()


def floor_rerank_ms(vectors: np.ndarray, queries: int = 10) -> float:
    """Median ms of one maximal re-ranked query, back to back in this process (one thread),
    on an exact index of the same vectors."""
    from imgret.gallery.search import Searcher
    from imgret.gallery.search.faiss_index import check_factory, create_index
    from imgret.gallery.search.rerank import KReciprocal
    from imgret.gallery.storage.vector_store import ItemInfo
    from imgret.service.limits import SEARCH_CANDIDATES_MAX
    from imgret.service.pipeline import configure_threads

    configure_threads()
    dim = vectors.shape[1]
    index = create_index(check_factory("Flat", dim), dim)
    ids = np.arange(1, len(vectors) + 1, dtype=np.int64)
    index.add_with_ids(vectors, ids)
    searcher = Searcher(index, model_version="floor", factory="Flat",
                        infos={int(i): ItemInfo("x", None) for i in ids}, use_gpu=False)
    option = KReciprocal(candidates=SEARCH_CANDIDATES_MAX, k1=100)
    searcher.search(vectors[:1], 10, rerank=option)
    times = []
    for row in range(1, queries + 1):
        start = time.perf_counter()
        searcher.search(vectors[row : row + 1], 10, rerank=option)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gallery", type=int, default=50_000, help="synthetic vectors")
    parser.add_argument("--clients", type=int, default=4, help="plain /search connections")
    parser.add_argument("--flood", type=int, default=8, help="flood connections")
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase (<= 60)")
    parser.add_argument("--work", type=Path, default=None, help="work dir (default: a temp)")
    parser.add_argument("--ignore-retry-after", action="store_true",
                        help="flood clients resend at once after a 503 (a request-rate flood)")
    args = parser.parse_args()
    args.seconds = min(args.seconds, 60.0)

    from load_bench import _untrained

    from imgret.service.limits import (
        REQUEST_HITS_MAX,
        REQUEST_RERANK_SEARCHES_MAX,
        SEARCH_CANDIDATES_MAX,
    )
    from imgret.service.schemas.common import K_MAX

    per_request = REQUEST_RERANK_SEARCHES_MAX // (2 * SEARCH_CANDIDATES_MAX + 2)
    k = min(K_MAX, REQUEST_HITS_MAX // per_request)

    with tempfile.TemporaryDirectory(prefix="imgret-flood-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        checkpoint = _untrained(work / "model", "tiny_cnn")
        db_url = f"sqlite:///{work / 'imgret.db'}"
        env = {"IMGRET_DATA_DIR": str(work / "data"), "IMGRET_DATABASE_URL": db_url,
               "IMGRET_MODEL": str(checkpoint), "IMGRET_API_KEY": KEY,
               "IMGRET_DEVICE": "cpu"}
        print("schema and model version (first start) ...", flush=True)
        with running_server(env, log_path=work / "server-setup.log") as server:
            version = httpx.get(f"{server.url}/health", timeout=30).json()["model_version"]
        from imgret.embedder import Embedder

        dim = Embedder.from_checkpoint(checkpoint, device="cpu").dim
        vectors = synthetic_vectors(args.gallery, dim)
        fill_gallery(db_url, version, vectors)
        print("floor: one maximal re-ranked query in process ...", flush=True)
        floor_ms = floor_rerank_ms(vectors)
        images = [class_png(i % 10, i, size=64) for i in range(16)]

        with running_server(env, log_path=work / "server.log") as server:
            health = httpx.get(f"{server.url}/health", timeout=30).json()
            print(f"server: index of {health['index_size']:,} vectors, model {version}",
                  flush=True)
            phases = []
            for name, flood in (("plain", False), ("flood", True), ("plain again", False)):
                print(f"phase {name} ({args.seconds:.0f} s) ...", flush=True)
                phases.append(run_phase(name, server.url, args, images, flood=flood,
                                        per_request=per_request, k=k))
            assert server.process.poll() is None, "the server died"

    quiet = [phases[0].p99, phases[2].p99]
    peer_p99 = sum(quiet) / 2
    print()
    print(f"Gallery {args.gallery:,} synthetic {dim}-d vectors (exact Flat); untrained "
          f"tiny_cnn; plain: {args.clients} connections, POST /search k = 10; flood: "
          f"{args.flood} connections, POST /search/batch of {per_request} images, "
          f"k_reciprocal candidates = {SEARCH_CANDIDATES_MAX}, k1 = 100, k = {k}, "
          f"{'resent at once after' if args.ignore_retry_after else 'waiting out'} each "
          "503's Retry-After; "
          f"{args.seconds:.0f} s per phase after {WARMUP_S:.0f} s of warm-up; one run.")
    print()
    print("| phase | plain requests | plain req/s | p50 ms | p99 ms | p99 / quiet p99 "
          "| plain errors | flood 200 | flood 503 | flood other |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for phase in phases:
        flood = phase.flood
        other = sum(n for s, n in flood.items() if s not in ("200", "503"))
        print(f"| {phase.name} | {len(phase.latencies_ms):,} | "
              f"{len(phase.latencies_ms) / phase.seconds:.1f} | {phase.p50:.1f} | "
              f"{phase.p99:.1f} | {phase.p99 / peer_p99:.2f}x (peer {peer_p99:.1f}) | "
              f"{phase.errors} | {flood.get('200', '-')} | {flood.get('503', '-')} | "
              f"{other if flood else '-'} |")
    flooded = phases[1]
    accepted = flooded.flood.get("200", 0) * per_request / flooded.seconds
    print()
    print(f"Re-ranked queries answered during the flood: {accepted:.1f}/s, beside the floor "
          f"of one thread re-ranking back to back in process: {1000 / floor_ms:.1f}/s "
          f"({floor_ms:.0f} ms per query).")
    ratio = flooded.p99 / peer_p99
    print(f"Plain /search p99: {flooded.p99:.1f} ms with the flood, {peer_p99:.1f} ms without "
          f"(mean of {quiet[0]:.1f} before and {quiet[1]:.1f} after, same run): {ratio:.2f}x "
          f"({flooded.p99 / quiet[0]:.2f}x / {flooded.p99 / quiet[1]:.2f}x against each), "
          f"target <= 2x: {'met' if ratio <= 2 else 'NOT met'}.")


if __name__ == "__main__":
    main()
