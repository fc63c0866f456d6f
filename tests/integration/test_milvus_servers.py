"""Two ``imgret serve`` processes on one database and one Milvus server (``milvus-lite
server``, a real engine on loopback): adds reach both, and a delete acknowledged by one is
never returned by the other's next search (the stale-delete check, on both databases).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from imgret.gallery.storage.db import upgrade_to_head
from tests.conftest import TEST_DEVICE, require
from tests.integration.test_index_backends import _milvus_available
from tests.support.images import class_image, image_bytes
from tests.support.live_server import free_port, running_servers

pytestmark = pytest.mark.slow

DELETES = 12


@pytest.fixture(scope="module")
def milvus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``milvus-lite server`` on a free loopback port for the module; its URI."""
    require(_milvus_available(), "pymilvus and milvus-lite (the `milvus` extra)")
    from pymilvus import MilvusClient

    port = free_port()
    folder = tmp_path_factory.mktemp("milvus")
    log = open(folder / "server.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(folder / "data"),
         "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (folder / "server.log").read_text()[-3000:]
            try:
                MilvusClient(uri, timeout=2).close()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        yield uri
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _png(label: int, index: int) -> bytes:
    return image_bytes(class_image(label, index))


def _search_ids(base: str, image: bytes, k: int = 50) -> list[int]:
    response = httpx.post(f"{base}/search", files={"image": ("q.png", image, "image/png")},
                          data={"k": str(k)}, timeout=60)
    assert response.status_code == 200, response.text
    return [hit["id"] for hit in response.json()["results"]]


def test_two_servers_on_milvus_share_adds_and_never_return_a_delete(
    tmp_path: Path, db_url: str, tiny_checkpoint: Path, milvus_server: str,
) -> None:
    env = {
        "IMGRET_DATA_DIR": str(tmp_path / "data"),
        "IMGRET_DATABASE_URL": db_url,
        "IMGRET_MODEL": str(tiny_checkpoint),
        "IMGRET_DEVICE": TEST_DEVICE,
        "IMGRET_INDEX_BACKEND": "milvus",
        "IMGRET_MILVUS_URI": milvus_server,
        "IMGRET_FOLLOW_INTERVAL_S": "0.2",
    }
    upgrade_to_head(db_url)
    with running_servers([(env, tmp_path / "a.log"), (env, tmp_path / "b.log")]) as servers:
        a, b = (server.url for server in servers)
        health = httpx.get(f"{a}/health").json()
        assert health["index_backend"] == "milvus"

        pairs = [(c, i) for c in range(4) for i in range(6)]
        files = [("images", (f"{c}_{i}.png", _png(c, i), "image/png")) for c, i in pairs]
        added = httpx.post(f"{a}/gallery", files=files,
                           data={"labels": [str(c) for c, _ in pairs]}, timeout=60)
        assert added.status_code == 201, added.text
        ids = added.json()["ids"]
        # Searchable through A as soon as the POST returns; through B once it followed.
        assert _search_ids(a, _png(1, 2), k=1) == [ids[8]]
        deadline = time.monotonic() + 60
        while httpx.get(f"{b}/health").json()["index_size"] < len(ids):
            assert time.monotonic() < deadline, "B never saw A's additions"
            time.sleep(0.2)
        assert _search_ids(b, _png(1, 2), k=1) == [ids[8]]

        # Stale-delete check: each delete through one server, then at once a search through
        # the other (no waiting), which must not return it.
        stale = 0
        for n, item_id in enumerate(ids[:DELETES]):
            deleter, searcher = (a, b) if n % 2 else (b, a)
            assert httpx.delete(f"{deleter}/gallery/{item_id}").status_code == 204
            label, index = pairs[n]
            stale += item_id in _search_ids(searcher, _png(label, index), k=len(ids))
        assert stale == 0
        for base in (a, b):
            assert httpx.get(f"{base}/health").json()["index_size"] == len(ids) - DELETES
            returned = set(_search_ids(base, _png(0, 0), k=len(ids)))
            assert returned == set(ids[DELETES:])
