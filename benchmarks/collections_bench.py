"""Many collections in one process: resident memory, the first search after an unload, and
the steady search latency.

    python benchmarks/collections_bench.py [--collections 100] [--items 2000]
                                           [--searches 2000]

What it does (loopback only; about 3 minutes on 2 cores with the defaults):

1. an *untrained* network of the demo model's architecture (small_cnn, 64-d, 28 px) serves
   every collection (rankings are meaningless; memory and latency are what is measured);
2. ``--collections`` collections of ``--items`` items each are written straight into SQL with
   random unit vectors (``imgret.gallery.storage.item_store.insert_items``: the rows, vectors and
   change log an upload writes; no image files, which searches never read), in a temporary SQLite
   data dir;
3. ``imgret serve`` with every collection allowed open: its RSS with only ``default`` open;
   then one search per collection (each opens it: index rebuilt from SQL, then saved) and
   the RSS with all open; then ``--searches`` searches spread over the open collections
   (steady p50 / p99);
4. ``imgret serve`` again with ``IMGRET_MAX_OPEN_COLLECTIONS=10``: searches cycling through
   all collections, so each one lands on a collection that was unloaded (its saved index
   file is read and caught up with the change log): the first-search latency after an
   unload, and the RSS with the bound.

It prints a markdown table with the floor beside each figure: the vectors' own bytes
(items x 64 x 4) beside the RSS each open collection adds, and the steady p50 beside the
first-search latency after an unload. Numbers are for this machine only.
"""

from __future__ import annotations

import argparse
import io
import logging
import secrets
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx
import numpy as np
from harness import running_server

logger = logging.getLogger("collections_bench")

DEMO_SPEC = {"backbone": "small_cnn", "dim": 64, "image_size": 28}
BOUND = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collections", type=int, default=100, help="collections (<= 500)")
    parser.add_argument("--items", type=int, default=2000, help="items per collection")
    parser.add_argument("--searches", type=int, default=2000, help="steady searches")
    args = parser.parse_args()
    if not BOUND < args.collections <= 500:
        parser.error(f"--collections: {BOUND + 1} to 500")
    if not 1 <= args.items <= 20000:
        parser.error("--items: 1 to 20000")
    if not 100 <= args.searches <= 20000:
        parser.error("--searches: 100 to 20000")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="imgret-collections-") as tmp:
        work = Path(tmp)
        run_dir = _model(work)
        data_dir = work / "data"
        db_url = f"sqlite:///{data_dir / 'imgret.db'}"
        names = _fill(data_dir, db_url, run_dir, args.collections, args.items)
        env = {"IMGRET_DATA_DIR": str(data_dir), "IMGRET_DATABASE_URL": db_url,
               "IMGRET_MODEL": str(run_dir), "IMGRET_DEVICE": "cpu",
               "IMGRET_API_KEY": secrets.token_hex(16), "IMGRET_BATCH_MAX_WAIT_MS": "1",
               "IMGRET_COLLECTION_IDLE_S": "3600"}
        query = _query_png()
        rng = np.random.default_rng(0)
        with running_server({**env, "IMGRET_MAX_OPEN_COLLECTIONS": str(args.collections)},
                            log_path=work / "serve-all.log") as server, \
                httpx.Client(base_url=server.url, timeout=120) as http:
            _search(http, "default", query)
            rss_idle = _rss(server.process.pid)
            first_open = [_search(http, name, query) for name in names]
            rss_all = _rss(server.process.pid)
            reported = sum(c["index"]["bytes"] for c in http.get("/collections").json()
                           ["collections"] if c["index"] and c["name"] != "default")
            steady = [_search(http, names[i], query)
                      for i in rng.integers(0, len(names), args.searches)]
        with running_server({**env, "IMGRET_MAX_OPEN_COLLECTIONS": str(BOUND)},
                            log_path=work / "serve-bound.log") as server, \
                httpx.Client(base_url=server.url, timeout=120) as http:
            _search(http, "default", query)
            for name in names[:BOUND]:
                _search(http, name, query)
            # Cycling through all of them with room for BOUND: every search reopens one.
            reopen = [_search(http, names[i % len(names)], query)
                      for i in range(BOUND, BOUND + 2 * len(names))]
            rss_bound = _rss(server.process.pid)
    _report(args, rss_idle, rss_all, rss_bound, reported, first_open, steady, reopen)


def _model(work: Path) -> Path:
    import torch

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    torch.manual_seed(0)
    run_dir = work / "run"
    save_checkpoint(run_dir, EmbeddingNet(ModelSpec(**DEMO_SPEC)))
    return run_dir


def _fill(data_dir: Path, db_url: str, run_dir: Path, n: int, items: int) -> list[str]:
    """Create the collections and their rows; returns their names."""
    from imgret.gallery.media.files import MediaStore
    from imgret.gallery.storage import item_store
    from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head
    from imgret.gallery.tenancy import collections
    from imgret.gallery.versions import intake, version_store

    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    default = make_sessionmaker(engine)
    intake.register_checkpoint(run_dir, session_factory=default, data_dir=data_dir)
    rng = np.random.default_rng(1)
    names, started = [], time.perf_counter()
    for c in range(n):
        info = collections.create(f"c{c:03d}", session_factory=default)
        sessions = make_sessionmaker(engine, info.id)
        shas = [secrets.token_hex(32) for _ in range(items)]
        rows = [item_store.NewRow(sha, MediaStore.relative_path(sha), "image/png", f"l{i % 50}")
                for i, sha in enumerate(shas)]
        vectors = rng.normal(size=(items, DEMO_SPEC["dim"])).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        with sessions.begin() as session:
            version = version_store.active_model_version(session=session)
            item_store.insert_items(rows, vectors, session=session, model_version=version)
        names.append(info.name)
        if (c + 1) % 10 == 0:
            elapsed = time.perf_counter() - started
            logger.info("%d/%d collections written (ETA %.0f s)", c + 1, n,
                        elapsed / (c + 1) * (n - c - 1))
    engine.dispose()
    return names


def _query_png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (28, 28), 128).save(buffer, format="PNG")
    return buffer.getvalue()


def _search(http: httpx.Client, name: str, image: bytes) -> float:
    """One search of ``name``; returns its latency in ms."""
    path = "/search" if name == "default" else f"/collections/{name}/search"
    started = time.perf_counter()
    response = http.post(path, files={"image": ("q.png", image, "image/png")},
                         data={"k": 10})
    elapsed = (time.perf_counter() - started) * 1000
    response.raise_for_status()
    return elapsed


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _report(args, rss_idle: int, rss_all: int, rss_bound: int, reported: int,
            first_open: list[float], steady: list[float], reopen: list[float]) -> None:
    mib = 1024 * 1024
    floor = args.items * DEMO_SPEC["dim"] * 4
    per = (rss_all - rss_idle) / args.collections

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q))

    print(f"\n## {args.collections} collections x {args.items} items, one process "
          f"({date.today()})\n")
    print("| figure | value | beside it |")
    print("|---|---:|---|")
    print(f"| RSS, only default open | {rss_idle / mib:.0f} MiB | |")
    print(f"| RSS, all {args.collections} open | {rss_all / mib:.0f} MiB | reported index "
          f"memory {reported / mib:.1f} MiB |")
    print(f"| RSS added per open collection | {per / 1024:.0f} KiB | vectors alone "
          f"{floor / 1024:.0f} KiB ({per / floor:.1f}x) |")
    print(f"| RSS, at most {BOUND} open | {rss_bound / mib:.0f} MiB | all open "
          f"{rss_all / mib:.0f} MiB |")
    print(f"| first search of a never-opened collection, p50 / p99 | "
          f"{pct(first_open, 50):.1f} / {pct(first_open, 99):.1f} ms | rebuilt from SQL |")
    print(f"| first search after an unload, p50 / p99 | {pct(reopen, 50):.1f} / "
          f"{pct(reopen, 99):.1f} ms | {pct(reopen, 50) / pct(steady, 50):.1f}x / "
          f"{pct(reopen, 99) / pct(steady, 99):.1f}x the steady ones |")
    print(f"| steady search, all open, p50 / p99 ({len(steady)} searches) | "
          f"{pct(steady, 50):.1f} / {pct(steady, 99):.1f} ms | |")


if __name__ == "__main__":
    main()
