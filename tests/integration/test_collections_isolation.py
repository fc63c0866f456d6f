"""Collections stay apart under load: client threads add, search, list, read images of,
evaluate and delete in four collections through two real `imgret serve` processes on one
PostgreSQL database (one shared data dir), for a bounded time. The same image bytes are
added to several collections on purpose.

Afterwards: 0 results, listings or evaluation neighbours of one collection name another's
item; 0 failed requests; every collection's listing equals what its clients were told; and
every live item's image still reads back whole, in every collection, although the same bytes
were deleted from others (the media store is shared and counts references across
collections). A summary line is printed (``pytest -s``).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from imgret.gallery.storage.db import upgrade_to_head
from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import KEY_HEADERS, png, server_env
from tests.support.live_server import running_servers

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

RUN_SECONDS = 15.0
CLIENTS = 4
COLLECTIONS = ("default", "shop-a", "shop-b", "cams")
# Images are drawn from one small pool, so the same bytes live in several collections.
POOL = [(c, i) for c in range(4) for i in range(6)]
CATCH_UP_S = 20.0


def _prefix(name: str) -> str:
    return "" if name == "default" else f"/collections/{name}"


@dataclass
class Ledger:
    lock: threading.Lock = field(default_factory=threading.Lock)
    owner: dict[int, str] = field(default_factory=dict)  # every acknowledged id -> collection
    live: dict[str, dict[int, tuple[int, int]]] = field(
        default_factory=lambda: {name: {} for name in COLLECTIONS})
    cross: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)

    def check(self, collection: str, ids: list[int], what: str) -> None:
        with self.lock:
            for item_id in ids:
                other = self.owner.get(item_id)
                if other is not None and other != collection:
                    self.cross.append(f"{what} in {collection} returned {item_id} of {other}")


class Client:
    def __init__(self, urls: list[str], ledger: Ledger, seed: int):
        self.urls, self.ledger = urls, ledger
        self.rng = random.Random(seed)
        self.http = httpx.Client(timeout=60, headers=KEY_HEADERS)

    def run(self, stop_at: float) -> None:
        ops = [self.add, self.search, self.search, self.search, self.listing, self.delete,
               self.evaluate, self.image]
        while time.monotonic() < stop_at:
            collection = self.rng.choice(COLLECTIONS)
            op = self.rng.choice(ops)
            try:
                op(self.rng.choice(self.urls), collection)
            except httpx.HTTPError as exc:
                self.fail(f"{op.__name__} {collection}: {type(exc).__name__}")
            self.ledger.counts[op.__name__] += 1

    def fail(self, what: str) -> None:
        with self.ledger.lock:
            self.ledger.failures.append(what)

    def _ok(self, response: httpx.Response, what: str, expected=(200,)) -> bool:
        if response.status_code in expected:
            return True
        self.fail(f"{what}: {response.status_code} {response.text[:200]}")
        return False

    def add(self, url: str, collection: str) -> None:
        picks = self.rng.sample(POOL, 3)
        files = [("images", (f"{c}_{i}.png", png(c, i), "image/png")) for c, i in picks]
        response = self.http.post(f"{url}{_prefix(collection)}/gallery", files=files,
                                  data={"labels": [f"{collection}:{c}" for c, _ in picks]})
        if response.status_code == 409:
            return  # a concurrent upload of the same bytes: the API asks for a retry
        if self._ok(response, f"add {collection}", (201,)):
            body = response.json()
            with self.ledger.lock:
                for item_id, created, pick in zip(body["ids"], body["created"], picks,
                                                  strict=True):
                    self.ledger.owner[item_id] = collection
                    # An "existing" answer names a live item another client owns (and may
                    # be deleting): only the creator tracks it.
                    if created:
                        self.ledger.live[collection][item_id] = pick

    def search(self, url: str, collection: str) -> None:
        c, i = self.rng.choice(POOL)
        response = self.http.post(f"{url}{_prefix(collection)}/search", data={"k": 50},
                                  files={"image": ("q.png", png(c, i), "image/png")})
        if self._ok(response, f"search {collection}"):
            hits = response.json()["results"]
            self.ledger.check(collection, [h["id"] for h in hits], "search")
            wrong = [h for h in hits if not h["label"].startswith(f"{collection}:")
                     or not h["uri"].startswith(f"{_prefix(collection)}/gallery/")]
            if wrong:
                with self.ledger.lock:
                    self.ledger.cross.append(f"search in {collection} returned {wrong[0]}")

    def listing(self, url: str, collection: str) -> None:
        response = self.http.get(f"{url}{_prefix(collection)}/gallery", params={"limit": 1000})
        if self._ok(response, f"list {collection}"):
            self.ledger.check(collection, [i["id"] for i in response.json()["data"]], "list")

    def image(self, url: str, collection: str) -> None:
        with self.ledger.lock:
            others = [(i, name) for i, name in self.ledger.owner.items() if name != collection]
        if others:
            item_id, _ = self.rng.choice(others)
            response = self.http.get(f"{url}{_prefix(collection)}/gallery/{item_id}/image")
            if response.status_code != 404:
                with self.ledger.lock:
                    self.ledger.cross.append(f"image of {item_id} read through {collection}: "
                                             f"{response.status_code}")

    def delete(self, url: str, collection: str) -> None:
        with self.ledger.lock:
            live = list(self.ledger.live[collection])
            if not live:
                return
            item_id = self.rng.choice(live)
            del self.ledger.live[collection][item_id]  # one deleter per id
        response = self.http.delete(f"{url}{_prefix(collection)}/gallery/{item_id}")
        self._ok(response, f"delete {collection}", (204,))

    def evaluate(self, url: str, collection: str) -> None:
        picks = self.rng.sample(POOL, 4)
        files = [("images", (f"{c}_{i}.png", png(c, i), "image/png")) for c, i in picks]
        response = self.http.post(f"{url}{_prefix(collection)}/evaluate", files=files,
                                  data={"labels": [f"{collection}:{c}" for c, _ in picks],
                                        "worst": 4, "k": [1, 5]})
        if response.status_code == 422:
            return  # an empty collection, or no query with a relevant item yet
        if self._ok(response, f"evaluate {collection}"):
            worst = response.json().get("worst") or []
            ids = [n["id"] for q in worst for n in q.get("neighbours", [])]
            self.ledger.check(collection, ids, "evaluate")
            self.ledger.counts["evaluated neighbours"] += len(ids)


@pytest.mark.timeout(RUN_SECONDS + 300)
def test_collections_never_see_each_other_under_load(tmp_path: Path, postgres_url: str,
                                                      tiny_checkpoint: Path) -> None:
    env = server_env(data_dir=tmp_path / "data", db_url=postgres_url,
                     checkpoint=tiny_checkpoint, device=TEST_DEVICE)
    upgrade_to_head(postgres_url)
    with running_servers([(env, tmp_path / "a.log"), (env, tmp_path / "b.log")]) as servers:
        urls = [server.url for server in servers]
        for name in COLLECTIONS[1:]:
            created = httpx.post(f"{urls[0]}/collections", json={"name": name},
                                 headers=KEY_HEADERS, timeout=60)
            assert created.status_code == 201, created.text
        ledger = Ledger()
        clients = [Client(urls, ledger, seed) for seed in range(CLIENTS)]
        started = time.monotonic()
        threads = [threading.Thread(target=c.run, args=(started + RUN_SECONDS,), daemon=True)
                   for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(RUN_SECONDS + 120)
        assert not any(t.is_alive() for t in threads), "a client hung"

        # Every collection's listing, in both processes, is what its clients were told; every
        # live item's bytes read back whole.
        problems: list[str] = []
        http = httpx.Client(timeout=60, headers=KEY_HEADERS)
        deadline = time.monotonic() + CATCH_UP_S
        for url in urls:
            for name in COLLECTIONS:
                expected = set(ledger.live[name])
                while True:
                    listed = {i["id"] for i in http.get(
                        f"{url}{_prefix(name)}/gallery", params={"limit": 1000}).json()["data"]}
                    if listed == expected or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                if listed != expected:
                    problems.append(f"{url} {name}: listed {sorted(listed ^ expected)[:10]} "
                                    "differently from the acknowledged writes")
                for item_id, (c, i) in ledger.live[name].items():
                    image = http.get(f"{url}{_prefix(name)}/gallery/{item_id}/image")
                    if image.status_code != 200 or image.content != png(c, i):
                        problems.append(f"{name} item {item_id}: image {image.status_code}")
        shared = sum(1 for pick in POOL
                     if sum(pick in ledger.live[n].values() for n in COLLECTIONS) > 1)
    print(f"\ncollections isolation: {CLIENTS} clients x 2 servers x {len(COLLECTIONS)} "
          f"collections for {RUN_SECONDS:.0f} s: "
          + ", ".join(f"{op} {n}" for op, n in sorted(ledger.counts.items()))
          + f"; cross-collection results {len(ledger.cross)}; failed requests "
          f"{len(ledger.failures)}; images live in several collections at the end {shared}")
    assert not ledger.failures, "\n".join(ledger.failures[:20])
    assert not ledger.cross, "\n".join(ledger.cross[:20])
    assert not problems, "\n".join(problems[:20])
    assert ledger.counts["search"] > 50 and ledger.counts["delete"] > 10
    assert ledger.counts["evaluated neighbours"] > 0
