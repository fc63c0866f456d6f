"""Adds and searches racing a collection's delete, through two real `imgret serve`
processes on one PostgreSQL database (one shared data dir).

Each round creates a collection, posts large images to it through both processes, and
deletes it while those adds are being decoded and embedded (the delete is sent once both
uploads have started, after a delay swept across rounds so it lands at different points),
with searches going on in both processes. Every add answers 201 (it committed first; the
delete then took it) or 404 naming the gone collection; every search 200 or 404; never a
5xx, never a 409 or 422 about a version the client never named. Afterwards no image byte,
row or index entry of the round is left: the adds' files are gone from the media store,
their hashes from SQL.
"""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from sqlalchemy import text

from imgret.gallery.media.files import MediaStore, sha256_hex
from imgret.gallery.storage.db import make_engine, upgrade_to_head
from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import KEY_HEADERS, png, server_env
from tests.support.live_server import running_servers

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

# Delays (s) between the adds starting and the delete: the race lands at other stages.
DELAYS = (0.0, 0.05, 0.15, 0.3, 0.5, 0.8)
IMAGES_PER_ADD = 5
SIDE = 768  # noise PNGs of about 1.7 MB: decoding them takes long enough to race


def _noise_png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=1)
    return out.getvalue()


class _Race:
    """The adds and searches of one round, recording every answer."""

    def __init__(self, name: str, statuses: dict[str, list[int]], problems: list[str]):
        self.name, self.statuses, self.problems = name, statuses, problems
        self.lock = threading.Lock()

    def add(self, url: str, blobs: list[bytes], started: threading.Barrier) -> None:
        files = [("images", (f"{i}.png", blob, "image/png")) for i, blob in enumerate(blobs)]
        with httpx.Client(timeout=120, headers=KEY_HEADERS) as http:
            started.wait()
            response = http.post(f"{url}/collections/{self.name}/gallery", files=files,
                                 data={"labels": ["x"] * len(blobs)})
        self.record("add", response, {201, 404})

    def search(self, url: str, image: bytes, deleted: threading.Event) -> None:
        with httpx.Client(timeout=120, headers=KEY_HEADERS) as http:
            while True:
                done = deleted.is_set()  # one more search after the delete answered
                response = http.post(f"{url}/collections/{self.name}/search",
                                     files={"image": ("q.png", image, "image/png")})
                self.record("search", response, {200, 404})
                if done:
                    return

    def record(self, kind: str, response: httpx.Response, allowed: set[int]) -> None:
        with self.lock:
            self.statuses[kind].append(response.status_code)
            if response.status_code not in allowed:
                self.problems.append(f"{kind}: {response.status_code} {response.text[:200]}")
            elif response.status_code == 404 and "no collection named" not in response.text:
                self.problems.append(f"{kind}: 404 without naming the collection: "
                                     f"{response.text[:200]}")


@pytest.mark.timeout(600)
def test_adds_and_searches_racing_a_collection_delete_end_cleanly(
        tmp_path: Path, postgres_url: str, tiny_checkpoint: Path) -> None:
    env = server_env(data_dir=tmp_path / "data", db_url=postgres_url,
                     checkpoint=tiny_checkpoint, device=TEST_DEVICE)
    upgrade_to_head(postgres_url)
    media = MediaStore.in_data_dir(tmp_path / "data")
    statuses: dict[str, list[int]] = {"add": [], "search": [], "delete": []}
    problems: list[str] = []
    round_shas: list[str] = []
    with running_servers([(env, tmp_path / "a.log"), (env, tmp_path / "b.log")]) as servers:
        urls = [server.url for server in servers]
        http = httpx.Client(timeout=120, headers=KEY_HEADERS)
        for number, delay in enumerate(DELAYS):
            name = f"race-{number}"
            created = http.post(f"{urls[0]}/collections", json={"name": name})
            assert created.status_code == 201, created.text
            # Open the collection in both processes, as a running service would have it.
            for url in urls:
                assert http.post(f"{url}/collections/{name}/gallery", files={"images": (
                    "seed.png", png(number, 0), "image/png")}, data={"labels": ["s"]}
                ).status_code == 201
            uploads = [[_noise_png(1000 * number + 10 * side + i) for i in range(IMAGES_PER_ADD)]
                       for side in range(2)]
            round_shas += [sha256_hex(blob) for blobs in uploads for blob in blobs]
            started = threading.Barrier(3)
            deleted = threading.Event()
            race = _Race(name, statuses, problems)
            threads = [threading.Thread(target=race.add, args=(urls[side], uploads[side],
                                                                started))
                       for side in range(2)]
            threads += [threading.Thread(target=race.search, args=(url, png(number, 1),
                                                                   deleted))
                        for url in urls]
            for thread in threads:
                thread.start()
            started.wait()
            time.sleep(delay)
            gone = http.delete(f"{urls[number % 2]}/collections/{name}")
            statuses["delete"].append(gone.status_code)
            assert gone.status_code == 204, gone.text
            deleted.set()
            for thread in threads:
                thread.join(300)
            assert not any(thread.is_alive() for thread in threads), "a request hung"
            # Both processes answer 404 for the collection from now on.
            for url in urls:
                assert http.get(f"{url}/collections/{name}/gallery").status_code == 404
    print(f"\ncollection delete races: {len(DELAYS)} rounds; "
          + "; ".join(f"{kind} {sorted(set(codes))} x{len(codes)}"
                      for kind, codes in statuses.items()))
    assert not problems, "\n".join(problems[:20])
    left = [sha for sha in round_shas if media.exists(sha)]
    assert not left, f"{len(left)} images of deleted collections are still stored"
    engine = make_engine(postgres_url)
    with engine.connect() as connection:
        rows = connection.execute(text(
            "SELECT count(*) FROM gallery_items WHERE sha256 = ANY(:shas)"),
            {"shas": round_shas}).scalar_one()
    engine.dispose()
    assert rows == 0
