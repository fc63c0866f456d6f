"""Concurrency: client threads interleave search, add, delete and evaluate against two real
`imgret serve` processes on one PostgreSQL database (and one shared data dir, the media volume
of replicas), for a bounded time.

Every DELETE records when its 204 arrived and every search when it started; afterwards:

- no response is a 5xx (nor a dropped connection);
- no search that *started* after an id's DELETE was acknowledged (by either process)
  returned that id (a delete holds in every process for the next search);
- both processes' indexes, their ``GET /gallery`` listings and ``/health`` agree with the
  database's live items once the followers have caught up on adds, and no deleted item's
  bytes are left in the shared media store (unless a live item has the same bytes).

Some operations are aimed at known races: a delete through one process followed at once by
a search through the other; an add through one process deleted at once through the other
(the other's change-log follower may be replaying the add meanwhile); the same new bytes
uploaded through both processes at the same moment.

Run longer with ``IMGRET_CONCURRENCY_SECONDS=300`` (default 20) and more clients with
``IMGRET_CONCURRENCY_CLIENTS`` (default 4). A summary line is printed (``pytest -s``).
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from imgret.gallery.media.files import sha256_hex
from imgret.gallery.storage.db import upgrade_to_head
from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import (
    KEY_HEADERS,
    index_ids,
    listed_ids,
    live_items,
    media_file,
    png,
    server_env,
)
from tests.support.live_server import running_servers

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

RUN_SECONDS = float(os.environ.get("IMGRET_CONCURRENCY_SECONDS", "20"))
CLIENTS = int(os.environ.get("IMGRET_CONCURRENCY_CLIENTS", "4"))
CLASSES = 5
SEED_PER_CLASS = 8
SEARCH_K = 20
# Adds may reach the other process one change-log poll later (the stated follower bound);
# deletes may not lag at all.
ADD_CATCH_UP_S = 20.0
GALLERY_CAP = 400  # live items; well under the largest k (one search lists the index)

# Operation mix: weights of the client's choices.
OPS = {
    "search": 45,
    "add": 18,
    "delete": 10,
    "delete_then_search_other": 10,
    "add_then_delete_other": 7,
    "evaluate": 5,
    "twin_add": 5,
}


@dataclass
class SearchRecord:
    started: float  # time.monotonic() just before the request was sent
    server: str
    ids: list[int]


@dataclass
class Ledger:
    """What the clients were told, with the times they were told it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    live: dict[int, bytes] = field(default_factory=dict)  # acknowledged, not being deleted
    deleted: dict[int, float] = field(default_factory=dict)  # id -> when its 204 arrived
    deleted_bytes: list[bytes] = field(default_factory=list)
    deleted_shas: dict[int, str] = field(default_factory=dict)
    searches: list[SearchRecord] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    failure_kinds: Counter = field(default_factory=Counter)

    def fail(self, kind: str, what: str) -> None:
        with self.lock:
            self.failures.append(f"[{kind}] {what}")
            self.failure_kinds[kind] += 1

    def take_live(self, keep: int = 8) -> tuple[int, bytes] | None:
        """An acknowledged id for one client to delete (nobody else will pick it)."""
        with self.lock:
            if len(self.live) <= keep:
                return None
            item_id = random.choice(list(self.live))
            return item_id, self.live.pop(item_id)

    def some_live(self, n: int) -> list[tuple[int, bytes]]:
        with self.lock:
            items = list(self.live.items())
        return random.sample(items, min(n, len(items)))


_unique = itertools.count(10_000)  # image indexes never used by the seed gallery


class Client:
    """One client thread: a keep-alive connection to each server, and random operations."""

    def __init__(self, servers: list[str], ledger: Ledger, seed: int):
        self.servers = servers
        self.ledger = ledger
        self.rng = random.Random(seed)
        self.http = {url: httpx.Client(base_url=url, timeout=60) for url in servers}

    def close(self) -> None:
        for client in self.http.values():
            client.close()

    def run(self, stop_at: float) -> None:
        names, weights = zip(*OPS.items(), strict=True)
        while time.monotonic() < stop_at:
            op = self.rng.choices(names, weights)[0]
            if op in ("add", "twin_add") and len(self.ledger.live) > GALLERY_CAP:
                op = "delete"  # long runs: the gallery stays listable with one search
            try:
                getattr(self, op)()
            except httpx.TransportError as exc:
                self.ledger.fail("dropped connection", f"{op}: {exc!r}")
            with self.ledger.lock:
                self.ledger.counts[op] += 1

    # ---------------------------------------------------------------- requests

    def _request(self, server: str, method: str, path: str, **kwargs) -> httpx.Response:
        response = self.http[server].request(method, path, **kwargs)
        if response.status_code >= 500:
            self.ledger.fail("5xx", f"{method} {path} on {server}: {response.status_code} "
                             f"{response.text[:300]}")
        return response

    def _unexpected(self, what: str, server: str, response: httpx.Response) -> None:
        if response.status_code < 500:  # 5xx are already counted by _request
            self.ledger.fail(f"{response.status_code}", f"{what} on {server}: "
                             f"{response.text[:200]}")

    def _pick(self) -> str:
        return self.rng.choice(self.servers)

    def _other(self, server: str) -> str:
        return next(s for s in self.servers if s != server)

    def _search(self, server: str, image: bytes) -> None:
        started = time.monotonic()
        response = self._request(server, "POST", "/search", data={"k": str(SEARCH_K)},
                                 files={"image": ("q.png", image, "image/png")})
        if response.status_code != 200:
            self._unexpected("search", server, response)
            return
        ids = [hit["id"] for hit in response.json()["results"]]
        with self.ledger.lock:
            self.ledger.searches.append(SearchRecord(started, server, ids))

    def _add(self, server: str, images: list[bytes]) -> list[int]:
        files = [("images", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)]
        labels = [f"c{self.rng.randrange(CLASSES)}" for _ in images]
        response = self._request(server, "POST", "/gallery", files=files,
                                 data={"labels": labels}, headers=KEY_HEADERS)
        if response.status_code != 201:
            self._unexpected("add", server, response)
            return []
        return response.json()["ids"]

    def _delete(self, server: str, item_id: int, image: bytes) -> bool:
        response = self._request(server, "DELETE", f"/gallery/{item_id}", headers=KEY_HEADERS)
        if response.status_code != 204:
            self._unexpected(f"delete {item_id}", server, response)
            return False
        acknowledged = time.monotonic()
        with self.ledger.lock:
            self.ledger.deleted[item_id] = acknowledged
            self.ledger.deleted_bytes.append(image)
            self.ledger.deleted_shas[item_id] = sha256_hex(image)
        return True

    def _new_image(self) -> bytes:
        return png(self.rng.randrange(CLASSES), next(_unique))

    # ---------------------------------------------------------------- operations

    def search(self) -> None:
        """Search with a live item's image, or (half the time) a recently deleted one's."""
        with self.ledger.lock:
            recent = self.ledger.deleted_bytes[-10:]
        if recent and self.rng.random() < 0.5:
            image = self.rng.choice(recent)
        else:
            live = self.ledger.some_live(1)
            image = live[0][1] if live else self._new_image()
        self._search(self._pick(), image)

    def add(self) -> None:
        images = [self._new_image() for _ in range(self.rng.randint(1, 3))]
        ids = self._add(self._pick(), images)
        with self.ledger.lock:
            self.ledger.live.update(zip(ids, images, strict=True))

    def delete(self) -> None:
        taken = self.ledger.take_live()
        if taken is not None:
            self._delete(self._pick(), *taken)

    def delete_then_search_other(self) -> None:
        """Delete through one process, then search for it at once through the other."""
        taken = self.ledger.take_live()
        if taken is None:
            return
        server = self._pick()
        if self._delete(server, *taken):
            self._search(self._other(server), taken[1])

    def add_then_delete_other(self) -> None:
        """Add through one process and delete it at once through the other, then search
        both: the other's follower may be replaying the add while the delete commits."""
        server = self._pick()
        image = self._new_image()
        ids = self._add(server, [image])
        if ids and self._delete(self._other(server), ids[0], image):
            self._search(self._other(server), image)
            self._search(server, image)

    def evaluate(self) -> None:
        items = self.ledger.some_live(4)
        if not items:
            return
        server = self._pick()
        # The queries are new images of the items' classes (labels c0..c4).
        files = [("images", (f"{i}.png", self._new_image(), "image/png"))
                 for i in range(len(items))]
        labels = [f"c{self.rng.randrange(CLASSES)}" for _ in items]
        response = self._request(server, "POST", "/evaluate", files=files,
                                 data={"labels": labels, "k": "1,5"}, headers=KEY_HEADERS)
        if response.status_code != 200:
            self._unexpected("evaluate", server, response)

    def twin_add(self) -> None:
        """The same new bytes uploaded through both processes at the same moment: both get
        a 201 naming the same single item."""
        image = self._new_image()
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda s: self._add(s, [image]), self.servers))
        ids = {i for result in results for i in result}
        if len(ids) > 1:
            self.ledger.fail("duplicate item", f"the same bytes became items {sorted(ids)}")
        with self.ledger.lock:
            self.ledger.live.update(dict.fromkeys(ids, image))


def _stale_results(ledger: Ledger) -> list[tuple[SearchRecord, int, float]]:
    """``(search, id, seconds after the ack)`` for every id a search returned although its
    DELETE had been acknowledged before that search started."""
    stale = []
    for record in ledger.searches:
        for item_id in record.ids:
            acknowledged = ledger.deleted.get(item_id)
            if acknowledged is not None and acknowledged < record.started:
                stale.append((record, item_id, record.started - acknowledged))
    return stale


def _agreement(servers: list[str], db_url: str, probe: bytes) -> list[str]:
    """How each process's index, listing and /health differ from the database's live items."""
    truth = set(live_items(db_url))
    problems = []
    for base in servers:
        ids = index_ids(base, probe)
        if ids != truth:
            problems.append(f"{base} index: missing {sorted(truth - ids)[:20]}, "
                            f"extra {sorted(ids - truth)[:20]}")
        listed = listed_ids(base)
        if listed != truth:
            problems.append(f"{base} GET /gallery: missing {sorted(truth - listed)[:20]}, "
                            f"extra {sorted(listed - truth)[:20]}")
        size = httpx.get(f"{base}/health", timeout=30).json()["index_size"]
        if size != len(truth):
            problems.append(f"{base} /health index_size {size}, database {len(truth)} live")
    return problems


@pytest.mark.timeout(RUN_SECONDS + 240)  # long runs outlast the suite's 300 s default
def test_two_servers_stay_consistent_under_concurrent_clients(
    tmp_path: Path, postgres_url: str, tiny_checkpoint: Path
) -> None:
    env = server_env(data_dir=tmp_path / "data", db_url=postgres_url,
                     checkpoint=tiny_checkpoint, device=TEST_DEVICE)
    upgrade_to_head(postgres_url)
    specs = [(env, tmp_path / "a.log"), (env, tmp_path / "b.log")]
    with running_servers(specs) as servers:
        urls = [server.url for server in servers]
        ledger = Ledger()
        seed = [png(c, i) for c in range(CLASSES) for i in range(SEED_PER_CLASS)]
        files = [("images", (f"{i}.png", data, "image/png")) for i, data in enumerate(seed)]
        added = httpx.post(f"{urls[0]}/gallery", files=files, headers=KEY_HEADERS, timeout=120,
                           data={"labels": [f"c{i // SEED_PER_CLASS}" for i in range(len(seed))]})
        assert added.status_code == 201, added.text
        ledger.live.update(zip(added.json()["ids"], seed, strict=True))
        _wait_for(lambda: not _agreement(urls, postgres_url, seed[0]), "B follows the seed")

        clients = [Client(urls, ledger, seed=n) for n in range(CLIENTS)]
        started = time.monotonic()
        threads = [threading.Thread(target=c.run, args=(started + RUN_SECONDS,), daemon=True)
                   for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(RUN_SECONDS + 120)
        elapsed = time.monotonic() - started
        for client in clients:
            client.close()
        assert not any(t.is_alive() for t in threads), "a client hung"

        stale = _stale_results(ledger)
        # Adds may lag by the follower bound; after it, everything must agree.
        deadline = time.monotonic() + ADD_CATCH_UP_S
        disagreement = _agreement(urls, postgres_url, seed[0])
        while disagreement and time.monotonic() < deadline:
            time.sleep(0.5)
            disagreement = _agreement(urls, postgres_url, seed[0])
        # The shared media store: a delete removed the bytes unless a live item has them.
        live_shas = set(live_items(postgres_url).values())
        kept = sorted(i for i, sha in ledger.deleted_shas.items()
                      if sha not in live_shas and media_file(tmp_path / "data", sha).exists())
        if kept:
            disagreement.append(f"media files of deleted items still on disk: {kept[:20]}")

    ops = ", ".join(f"{name} {ledger.counts[name]}" for name in OPS)
    stale_searches = {id(record) for record, _, _ in stale}
    worst_lag = max((lag for _, _, lag in stale), default=0.0)
    failures = ", ".join(f"{kind}: {n}" for kind, n in ledger.failure_kinds.most_common())
    print(
        f"\nconcurrency: {CLIENTS} clients x 2 servers (PostgreSQL) for {elapsed:.1f} s: {ops}; "
        f"{len(ledger.searches)} searches, {len(ledger.deleted)} deletes acknowledged; "
        f"stale: {len(stale)} results in {len(stale_searches)} searches (latest "
        f"{worst_lag:.2f} s after the ack); failed requests: {failures or 0}; "
        f"final disagreement: {len(disagreement)}"
    )
    assert not ledger.failures, "\n".join(ledger.failures[:30])
    assert not stale, f"{len(stale)} stale results:\n" + "\n".join(
        f"{record.server} returned {item_id} in a search that started {lag:.3f} s after its "
        "DELETE was acknowledged" for record, item_id, lag in stale[:30]
    )
    assert not disagreement, "\n".join(disagreement)
    assert len(ledger.searches) > 50 and len(ledger.deleted) > 10, "too little traffic to judge"


def _wait_for(check, what: str, timeout: float = ADD_CATCH_UP_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.3)
