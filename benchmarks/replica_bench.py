"""Replicas: how long an add or a delete made through one server takes to show in another
server's searches, woken by PostgreSQL's LISTEN/NOTIFY or by the poll.

    python benchmarks/replica_bench.py [--adds 40] [--poll-s 1.0] [--skip-sqlite]

What it does, in one run (loopback only; about 2 minutes on 2 cores):

1. an *untrained* network with the demo model's architecture (small_cnn, 64-d, 28 px): the
   same work per image as the demo's model; what is measured is propagation, not rankings;
2. per mode, two ``imgret serve`` processes on one database and one data dir:

   - ``postgresql notify``: IMGRET_CHANGE_NOTIFY=true (the default), poll every ``--poll-s``;
   - ``postgresql poll``: notifications off, poll every ``--poll-s`` (the fallback);
   - ``sqlite poll``: SQLite has no notifications (poll every ``--poll-s``);

3. ``--adds`` times: a distinct generated image is added through server one (``POST
   /gallery``); from its 201, server two is searched with that image (k=1) back to back until
   the new id comes back first: the **add delay**. Then it is deleted through server two;
   from the 204, server one is searched once: a delete is honoured by the next search that
   starts in every process (each search reads the deletes first), so **delete returned**
   counts the searches that still returned it (0 expected), and the **delete delay** is how
   long until that first search answered. Adds are spaced by a random pause (0-0.3 s) so they
   do not line up with the poll;
4. the **floor**: the same add through server two and the same search loop on server two
   itself (its own write, no propagation): the time a search takes to answer, which every
   delay above includes.

It prints a markdown table: add delay p50 / p99 per mode with the floor's p50 beside it and
the ratio, delete delay p50 / p99, and deletes returned. Numbers are for this machine only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from harness import class_png, running_servers

ADMIN_URL = os.environ.get("IMGRET_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
DEMO_SPEC = {"backbone": "small_cnn", "dim": 64, "image_size": 28}
API_KEY = "bench-" + secrets.token_hex(8)
HEADERS = {"X-API-Key": API_KEY}
SEARCH_TIMEOUT_S = 30.0


@dataclass
class ModeResult:
    mode: str
    add_delays: list[float]
    floor: list[float]
    delete_delays: list[float]
    deletes_returned: int


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adds", type=int, default=40, help="adds per mode (1 to 500)")
    parser.add_argument("--poll-s", type=float, default=1.0,
                        help="IMGRET_FOLLOW_INTERVAL_S of both servers")
    parser.add_argument("--skip-sqlite", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.adds <= 500:
        parser.error("--adds: 1 to 500")
    if not 0 < args.poll_s <= 60:
        parser.error("--poll-s: in (0, 60]")
    with tempfile.TemporaryDirectory(prefix="imgret-replica-bench-") as tmp:
        work = Path(tmp)
        run = _model(work)
        modes = [("postgresql notify", "postgresql", True),
                 ("postgresql poll", "postgresql", False)]
        if not args.skip_sqlite:
            modes.append(("sqlite poll", "sqlite", False))
        results = []
        for number, (mode, backend, notify) in enumerate(modes):
            print(f"[{mode}] {args.adds} adds ...", file=sys.stderr, flush=True)
            with _database(backend, work / f"db{number}") as url:
                results.append(_measure(mode, url, notify, run, work / f"mode{number}",
                                        args.adds, args.poll_s, seed=number))
    _print_table(results, args.poll_s)


def _model(work: Path) -> Path:
    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    run = work / "model"
    save_checkpoint(run, EmbeddingNet(ModelSpec(**DEMO_SPEC)))
    return run


@contextlib.contextmanager
def _database(backend: str, folder: Path):
    """A fresh migrated database of ``backend``, dropped afterwards."""
    from sqlalchemy import text

    from imgret.gallery.storage.db import make_engine, upgrade_to_head

    if backend == "sqlite":
        folder.mkdir(parents=True)
        url = f"sqlite:///{folder / 'gallery.db'}"
        upgrade_to_head(url)
        yield url
        return
    name = "imgret_replica_bench_" + secrets.token_hex(4)
    admin = make_engine(f"{ADMIN_URL}/postgres", isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        url = f"{ADMIN_URL}/{name}"
        upgrade_to_head(url)
        yield url
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _measure(mode: str, url: str, notify: bool, run: Path, folder: Path, adds: int,
             poll_s: float, seed: int) -> ModeResult:
    env = {
        "IMGRET_DATA_DIR": str(folder / "data"),
        "IMGRET_DATABASE_URL": url,
        "IMGRET_MODEL": str(run),
        "IMGRET_DEVICE": "cpu",
        "IMGRET_API_KEY": API_KEY,
        "IMGRET_FOLLOW_INTERVAL_S": str(poll_s),
        "IMGRET_CHANGE_NOTIFY": str(notify).lower(),
    }
    folder.mkdir(parents=True)
    rng = random.Random(seed)
    result = ModeResult(mode, [], [], [], 0)
    with running_servers([(env, folder / "one.log"), (env, folder / "two.log")]) as servers, \
            httpx.Client(timeout=SEARCH_TIMEOUT_S) as http:
        one, two = (server.url for server in servers)
        time.sleep(1.0)  # both followers started (and, with notify, listening)
        for n in range(adds):
            image = class_png(n % 10, 10_000 * seed + n)
            item, added_at = _add(http, one, image)
            result.add_delays.append(_until_found(http, two, image, item) - added_at)
            gone = http.delete(f"{two}/gallery/{item}", headers=HEADERS)
            gone.raise_for_status()
            deleted_at = time.perf_counter()
            if _top_id(http, one, image) == item:
                result.deletes_returned += 1
            result.delete_delays.append(time.perf_counter() - deleted_at)
            # The floor: server two's own write, found by server two.
            floor_image = class_png(n % 10, 10_000 * seed + 5_000 + n)
            own, own_at = _add(http, two, floor_image)
            result.floor.append(_until_found(http, two, floor_image, own) - own_at)
            time.sleep(rng.uniform(0.0, 0.3))
    return result


def _add(http: httpx.Client, url: str, image: bytes) -> tuple[int, float]:
    response = http.post(f"{url}/gallery", headers=HEADERS, data={"labels": ["x"]},
                         files=[("images", ("a.png", image, "image/png"))])
    response.raise_for_status()
    return response.json()["ids"][0], time.perf_counter()


def _top_id(http: httpx.Client, url: str, image: bytes) -> int | None:
    response = http.post(f"{url}/search", data={"k": "1"},
                         files={"image": ("q.png", image, "image/png")})
    response.raise_for_status()
    results = response.json()["results"]
    return results[0]["id"] if results else None


def _until_found(http: httpx.Client, url: str, image: bytes, item: int) -> float:
    """``time.perf_counter()`` when a search on ``url`` first answered with ``item`` first."""
    deadline = time.perf_counter() + SEARCH_TIMEOUT_S
    while time.perf_counter() < deadline:
        if _top_id(http, url, image) == item:
            return time.perf_counter()
    raise RuntimeError(f"{url} did not find item {item} within {SEARCH_TIMEOUT_S} s")


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _print_table(results: list[ModeResult], poll_s: float) -> None:
    print(f"\nPropagation between two `imgret serve` processes (poll every {poll_s:g} s), "
          f"{len(results[0].add_delays)} adds per mode; times in ms\n")
    print("| mode | add p50 | add p99 | floor p50 (own write) | add p50 / floor | "
          "delete p50 | delete p99 | deletes returned |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        floor = statistics.median(r.floor)
        print(f"| {r.mode} | {_ms(r.add_delays, 0.5):.1f} | {_ms(r.add_delays, 0.99):.1f} | "
              f"{1000 * floor:.1f} | {statistics.median(r.add_delays) / floor:.1f}x | "
              f"{_ms(r.delete_delays, 0.5):.1f} | {_ms(r.delete_delays, 0.99):.1f} | "
              f"{r.deletes_returned} / {len(r.delete_delays)} |")
    print("\nfloor: a write found by the server that took it (one search, no propagation); "
          "delete: from the 204 on server two until server one's next search answered "
          "(a deleted item returned there would be counted).")


if __name__ == "__main__":
    main()
