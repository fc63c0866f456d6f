"""Crash safety: SIGKILL mid-write, restart, and check what was acknowledged (both databases).

1. A real `imgret serve` is killed with SIGKILL while several clients stream gallery adds and
   deletes at it, at three kill points: after a few acknowledged writes of the round, after
   more, and at the first moment the database holds a write whose answer has not reached its
   client (committed, not acknowledged). After each restart on the same data dir and database:

   - every acknowledged add is there: ``GET /gallery/{id}`` is 200, its stored bytes are the
     uploaded ones, and a search with its own image ranks it first;
   - every acknowledged delete is gone: 404, never returned by a search with its own image,
     and its media file (``media/ab/cd/<sha256>``) is gone from disk;
   - what was in flight at the kill (no answer) is all there or not at all: an add is either a
     live row with its image, searchable, or no row and no bytes on disk; a delete is either
     undone completely or done completely (bytes gone);
   - the server's index equals the database's live items, the saved index and its manifest
     describe the database (after the change-log replay a starting server does), and no
     temporary file is left in the media store or the index folder.

2. `imgret ingest` is killed mid-run and `imgret index build` is killed twice: with the new
   index file written but not yet renamed, and with it renamed but the manifest not yet.
   After resuming the ingest, a server started on what is left serves every item, and its
   saved index matches the database. (tests/integration/test_ingest_kill.py checks the
   killed ingest's own chunk arithmetic; this reuses its slowed-down CLI.)
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from imgret.gallery.ingest import ingest_source
from imgret.gallery.media.files import MediaStore, sha256_hex
from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head
from tests.conftest import TEST_DEVICE
from tests.integration.test_ingest_kill import SCRIPT as HELD_CLI
from tests.integration.test_ingest_kill import _counts
from tests.support.gallery_state import (
    KEY_HEADERS,
    index_ids,
    live_items,
    manifest_problems,
    media_file,
    png,
    server_env,
    temp_files,
)
from tests.support.images import write_image_folder
from tests.support.live_server import LiveServer, running_server

pytestmark = pytest.mark.slow

# The kill points: a round's SIGKILL comes once this many writes of the round have been
# acknowledged, and, where the flag is set, only then at the first moment the database holds
# a write that no client has heard about (committed, answer not yet sent). For that one the
# server runs with POST_COMMIT_DELAY, so the kill reliably lands in that window.
KILL_POINTS = ((3, False), (10, False), (5, True))

# Loaded at start-up by the server of the at-commit round only (a ``sitecustomize`` on its
# PYTHONPATH): the index update that follows each committed add or delete waits a moment, which
# keeps the committed write unacknowledged long enough for the kill.
POST_COMMIT_DELAY = '''
import time
from imgret.gallery.search import Searcher
def _slowed(method):
    def slowed(self, *args, **kwargs):
        time.sleep(0.5)
        return method(self, *args, **kwargs)
    return slowed
Searcher.add, Searcher.remove = _slowed(Searcher.add), _slowed(Searcher.remove)
'''
WRITERS = 3
CLASSES = 4
BATCH_MAX = 16  # images per POST /search/batch (well under any configured cap)

_unique = itertools.count()


@dataclass
class Writes:
    """What the writers were told (acknowledged) and what got no answer (in flight)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    present: dict[int, str] = field(default_factory=dict)  # acknowledged add: id -> sha256
    deleted: dict[int, str] = field(default_factory=dict)  # acknowledged delete: id -> sha256
    unanswered_adds: list[str] = field(default_factory=list)  # sha256 of in-flight uploads
    unanswered_deletes: dict[int, str] = field(default_factory=dict)
    data: dict[str, bytes] = field(default_factory=dict)  # sha256 -> uploaded bytes
    acks: int = 0
    max_acked_id: int = 0
    failures: list[str] = field(default_factory=list)
    settled: str = ""  # how the in-flight requests of the last kill turned out

    def take(self, keep: int = 3) -> tuple[int, str] | None:
        with self.lock:
            if len(self.present) <= keep:
                return None
            item_id = random.choice(list(self.present))
            return item_id, self.present.pop(item_id)


def _writer(base: str, writes: Writes, stop: threading.Event, seed: int) -> None:
    """Adds (1-3 new images) and deletes (of acknowledged items) until stopped or cut off."""
    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=60, headers=KEY_HEADERS) as http:
        while not stop.is_set():
            taken = writes.take() if rng.random() < 0.4 else None
            if taken is not None:
                item_id, sha = taken
                try:
                    response = http.delete(f"/gallery/{item_id}")
                except httpx.TransportError:
                    with writes.lock:
                        writes.unanswered_deletes[item_id] = sha
                    return
                if response.status_code != 204:
                    writes.failures.append(f"DELETE {item_id}: {response.status_code} "
                                           f"{response.text[:200]}")
                    return
                with writes.lock:
                    writes.deleted[item_id] = sha
                    writes.acks += 1
                continue
            images = [png(rng.randrange(CLASSES), 1000 + next(_unique))
                      for _ in range(rng.randint(1, 3))]
            shas = [sha256_hex(image) for image in images]
            with writes.lock:
                writes.data.update(zip(shas, images, strict=True))
            files = [("images", (f"{s[:8]}.png", image, "image/png"))
                     for s, image in zip(shas, images, strict=True)]
            labels = [f"c{rng.randrange(CLASSES)}" for _ in images]
            try:
                response = http.post("/gallery", files=files, data={"labels": labels})
            except httpx.TransportError:
                with writes.lock:
                    writes.unanswered_adds.extend(shas)
                return
            if response.status_code != 201:
                writes.failures.append(f"POST /gallery: {response.status_code} "
                                       f"{response.text[:200]}")
                return
            ids = response.json()["ids"]
            with writes.lock:
                writes.present.update(zip(ids, shas, strict=True))
                writes.max_acked_id = max(writes.max_acked_id, *ids)
                writes.acks += 1


def _stream_then_kill(server: LiveServer, writes: Writes, kill_after: int, at_commit: bool,
                      db_url: str, seed: int) -> None:
    """Writers stream at the server; SIGKILL it once ``kill_after`` writes were acknowledged
    (and, with ``at_commit``, as soon as the database holds a write not yet acknowledged)."""
    stop = threading.Event()
    target = writes.acks + kill_after
    threads = [threading.Thread(target=_writer, args=(server.url, writes, stop, seed * 10 + n),
                                daemon=True) for n in range(WRITERS)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 90
    while writes.acks < target and not writes.failures:
        assert time.monotonic() < deadline, f"only {writes.acks} writes acknowledged"
        assert server.process.poll() is None, "the server died by itself"
        time.sleep(0.005)
    if at_commit:
        _wait_for_unanswered_commit(db_url, writes, deadline)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(30)
    stop.set()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a writer hung after the kill"
    assert not writes.failures, writes.failures


def _wait_for_unanswered_commit(db_url: str, writes: Writes, deadline: float) -> None:
    """Return at the first moment the database has an item or a delete the writers were not
    told about yet (or at ``deadline``: the kill then lands wherever it lands)."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            while time.monotonic() < deadline and not writes.failures:
                newest, deleted = conn.execute(text(
                    "SELECT max(id), count(deleted_at) FROM gallery_items")).one()
                conn.rollback()  # a fresh snapshot each time
                with writes.lock:
                    if (newest or 0) > writes.max_acked_id or deleted > len(writes.deleted):
                        return
    finally:
        engine.dispose()


def _search_batch(base: str, images: list[bytes], k: int) -> list[list[dict]]:
    results: list[list[dict]] = []
    for start in range(0, len(images), BATCH_MAX):
        chunk = images[start : start + BATCH_MAX]
        response = httpx.post(
            f"{base}/search/batch", data={"k": str(k)}, timeout=120,
            files=[("images", (f"{i}.png", data, "image/png")) for i, data in enumerate(chunk)],
        )
        assert response.status_code == 200, response.text
        results.extend(response.json()["results"])
    return results


def _settle_unanswered(writes: Writes, live: dict[int, str]) -> None:
    """Requests that got no answer count as done where the database says they were."""
    by_sha = {sha: item_id for item_id, sha in live.items()}
    for sha in writes.unanswered_adds:
        if sha in by_sha:
            writes.present[by_sha[sha]] = sha  # committed: it must be whole (checked next)
    for item_id, sha in writes.unanswered_deletes.items():
        (writes.present if item_id in live else writes.deleted)[item_id] = sha


def _problems_after_restart(base: str, writes: Writes, data_dir: Path, db_url: str) -> list[str]:
    """Everything that breaks the crash-safety promises (see the module docstring)."""
    problems: list[str] = []
    live = live_items(db_url)
    live_shas = set(live.values())
    lost_adds = [sha for sha in writes.unanswered_adds if sha not in live_shas]
    undone = [i for i in writes.unanswered_deletes if i in live]
    writes.settled = (
        f"in flight: {len(writes.unanswered_adds)} uploaded images "
        f"({len(writes.unanswered_adds) - len(lost_adds)} committed), "
        f"{len(writes.unanswered_deletes)} deletes ({len(undone)} not committed)"
    )
    _settle_unanswered(writes, live)
    writes.unanswered_adds.clear()
    writes.unanswered_deletes.clear()

    for sha in lost_adds:  # in flight, not committed: not at all, bytes included
        if media_file(data_dir, sha).exists():
            problems.append(f"an unacknowledged upload left its bytes on disk without a row: "
                            f"{sha[:12]}")

    present = sorted(writes.present.items())
    for item_id, sha in present:
        if item_id not in live:
            problems.append(f"acknowledged add {item_id} is not in the database")
            continue
        item = httpx.get(f"{base}/gallery/{item_id}", timeout=30)
        image = httpx.get(f"{base}/gallery/{item_id}/image", timeout=30)
        if item.status_code != 200 or image.status_code != 200:
            problems.append(f"acknowledged add {item_id}: GET {item.status_code}, image "
                            f"{image.status_code}")
        elif sha256_hex(image.content) != sha:
            problems.append(f"acknowledged add {item_id}: stored bytes differ from the upload")
    hits = _search_batch(base, [writes.data[sha] for _, sha in present], k=5)
    for (item_id, _), row in zip(present, hits, strict=True):
        ids = [hit["id"] for hit in row]
        own = next((hit["score"] for hit in row if hit["id"] == item_id), None)
        # First, or tied with the first (an untrained model may give two images one vector).
        if own is None or row[0]["score"] - own > 1e-6:
            problems.append(f"acknowledged add {item_id}: not first in a search with its own "
                            f"image (got {ids})")

    gone = sorted(writes.deleted.items())
    for item_id, sha in gone:
        if item_id in live:
            problems.append(f"acknowledged delete {item_id} is live in the database")
        status = httpx.get(f"{base}/gallery/{item_id}", timeout=30).status_code
        if status != 404:
            problems.append(f"acknowledged delete {item_id}: GET /gallery/{item_id} is {status}")
        if sha not in live_shas and media_file(data_dir, sha).exists():
            problems.append(f"acknowledged delete {item_id}: its media file is still on disk")
    hits = _search_batch(base, [writes.data[sha] for _, sha in gone], k=10)
    for (item_id, _), row in zip(gone, hits, strict=True):
        if item_id in {hit["id"] for hit in row}:
            problems.append(f"acknowledged delete {item_id}: returned by a search")

    served = index_ids(base, png(0, 0))
    if served != set(live):
        problems.append(f"index != database: missing {sorted(set(live) - served)[:20]}, "
                        f"extra {sorted(served - set(live))[:20]}")
    version = httpx.get(f"{base}/health", timeout=30).json()["model_version"]
    problems.extend(manifest_problems(data_dir, db_url, version))
    problems.extend(f"temporary file left: {path}" for path in temp_files(data_dir))
    return problems


def test_server_killed_mid_writes_keeps_every_acknowledged_write(
    tmp_path: Path, db_url: str, tiny_checkpoint: Path
) -> None:
    data_dir = tmp_path / "data"
    env = server_env(data_dir=data_dir, db_url=db_url, checkpoint=tiny_checkpoint,
                     device=TEST_DEVICE)
    upgrade_to_head(db_url)
    writes = Writes()
    summary = []
    delayed = tmp_path / "post-commit-delay"
    delayed.mkdir()
    (delayed / "sitecustomize.py").write_text(POST_COMMIT_DELAY)
    path = os.pathsep.join(p for p in (str(delayed), os.environ.get("PYTHONPATH")) if p)
    for round_, point in enumerate([*KILL_POINTS, None]):
        at_commit = point is not None and point[1]
        with running_server({**env, "PYTHONPATH": path} if at_commit else env,
                            log_path=tmp_path / f"serve-{round_}.log") as server:
            if round_ > 0:
                problems = _problems_after_restart(server.url, writes, data_dir, db_url)
                assert not problems, (
                    f"after SIGKILL #{round_} (kill point {KILL_POINTS[round_ - 1]}):\n"
                    + "\n".join(problems[:40])
                )
                summary.append(f"kill #{round_}: {len(writes.present)} present, "
                               f"{len(writes.deleted)} deleted, all as acknowledged "
                               f"({writes.settled})")
            if point is not None:
                _stream_then_kill(server, writes, *point, db_url=db_url, seed=round_)
    print(f"\ncrash safety ({db_url.split(':')[0]}): " + "; ".join(summary))


# --------------------------------------------------------------------------- ingest + build

# `imgret ...` with the rename of one file intercepted: the process says where it stopped (a
# marker file) and sleeps until it is killed. `index-file`: the new index.faiss is written
# under its temporary name, not yet renamed; `manifest`: index.faiss is renamed, the new
# manifest.json is written under its temporary name, not yet renamed.
STOPPED_CLI = """
import os, sys, time
from pathlib import Path
marker, point = Path(sys.argv[1]), sys.argv[2]
target = {"index-file": "index.faiss", "manifest": "manifest.json"}[point]
real_replace = os.replace
def stop_before(real):
    def rename(src, dst, *args, **kwargs):
        if Path(dst).name == target:
            # The marker appears whole (the test reads it as soon as it exists).
            Path(f"{marker}.tmp").write_text(str(src))
            real_replace(f"{marker}.tmp", marker)
            time.sleep(600)
        return real(src, dst, *args, **kwargs)
    return rename
os.replace, os.rename = stop_before(os.replace), stop_before(os.rename)
sys.argv = ["imgret", *sys.argv[3:]]
from imgret.cli.main import main
main()
"""
TOTAL, CHUNK = 32, 8


def _run_until(args: list[str], env: dict[str, str], log: Path, ready, what: str) -> None:
    """Run ``python -c ...`` with ``args``; SIGKILL it as soon as ``ready()`` holds."""
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-c", *args], env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert process.poll() is None, f"{what} ended by itself:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"{what} never got there:\n{log.read_text()}"
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    assert process.returncode == -signal.SIGKILL


def test_killed_ingest_and_index_builds_then_serve(
    tmp_path: Path, db_url: str, tiny_checkpoint: Path
) -> None:
    from imgret.embedder import Embedder

    folder = write_image_folder(tmp_path / "images", classes=4, per_class=TOTAL // 4)
    data_dir = tmp_path / "data"
    env = server_env(data_dir=data_dir, db_url=db_url, checkpoint=tiny_checkpoint,
                     device=TEST_DEVICE)
    cli_env = {**os.environ, **env}
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    try:
        # 1. ingest, killed once its first chunk is committed.
        _run_until([HELD_CLI, "1", "ingest", str(folder), "--batch-size", "4",
                    "--chunk-size", str(CHUNK), "--no-progress"], cli_env,
                   tmp_path / "ingest.log", lambda: _counts(sessions)[0] >= CHUNK, "ingest")
        items, embeddings, changes, _ = _counts(sessions)
        assert 0 < items < TOTAL and items == embeddings == changes

        # 2. a complete index build of what is there, then the ingest resumed (in-process).
        _imgret(["index", "build", "--no-progress"], cli_env, tmp_path / "build-0.log")
        embedder = Embedder.from_checkpoint(tiny_checkpoint, device=TEST_DEVICE)
        report = ingest_source(folder, session_factory=sessions,
                               media=MediaStore.in_data_dir(data_dir), embedder=embedder,
                               chunk_size=CHUNK, progress=False)
        assert report.added == TOTAL - items

        # 3. two index builds of the grown gallery, killed at two points of saving.
        for point in ("index-file", "manifest"):
            marker = tmp_path / f"stopped-{point}"
            _run_until([STOPPED_CLI, str(marker), point, "index", "build", "--no-progress"],
                       cli_env, tmp_path / f"build-{point}.log", marker.exists,
                       f"index build ({point})")
            assert Path(marker.read_text()).is_file(), "killed with its temporary file written"
        # The saved index is now torn: a new index file beside the previous build's manifest.
        assert manifest_problems(data_dir, db_url, embedder.model_version)
    finally:
        engine.dispose()

    # 4. a server on what is left serves every item and saves an index that matches.
    with running_server(env, log_path=tmp_path / "serve.log") as server:
        writes = Writes(present=live_items(db_url))
        assert len(writes.present) == TOTAL
        for path in folder.rglob("*.png"):
            data = path.read_bytes()
            writes.data[sha256_hex(data)] = data
        problems = _problems_after_restart(server.url, writes, data_dir, db_url)
    assert not problems, "\n".join(problems[:40])


def _imgret(args: list[str], env: dict[str, str], log: Path) -> None:
    with log.open("wb") as out:
        done = subprocess.run([sys.executable, "-c", "from imgret.cli.main import main; main()",
                               *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=300)
    assert done.returncode == 0, log.read_text()
