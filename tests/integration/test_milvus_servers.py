"""Two ``imgret serve`` processes on one database and one Milvus server (``milvus-lite
server``, a real engine on loopback): adds reach both, and a delete acknowledged by one is
never returned by the other's next search (the stale-delete check, on both databases).
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def milvus_lite_server(folder: Path, port: int) -> Iterator[str]:
    """``milvus-lite server`` on ``127.0.0.1:port`` with its data in ``folder``; its URI once
    a client connects. Stopped (SIGTERM) on exit."""
    from pymilvus import MilvusClient

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "server.log", "ab") as log:
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
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def milvus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``milvus-lite server`` on a free loopback port for the module; its URI."""
    require(_milvus_available(), "pymilvus and milvus-lite (the `milvus` extra)")
    with milvus_lite_server(tmp_path_factory.mktemp("milvus"), free_port()) as uri:
        yield uri


def _env(tmp_path: Path, db_url: str, checkpoint: Path, milvus_uri: str) -> dict[str, str]:
    """An ``imgret serve`` environment on the Milvus backend, following changes every 0.2 s."""
    return {
        "IMGRET_DATA_DIR": str(tmp_path / "data"),
        "IMGRET_DATABASE_URL": db_url,
        "IMGRET_MODEL": str(checkpoint),
        "IMGRET_DEVICE": TEST_DEVICE,
        "IMGRET_INDEX_BACKEND": "milvus",
        "IMGRET_MILVUS_URI": milvus_uri,
        "IMGRET_FOLLOW_INTERVAL_S": "0.2",
    }


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
    env = _env(tmp_path, db_url, tiny_checkpoint, milvus_server)
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


def test_an_add_while_milvus_is_down_is_acknowledged_and_searchable_once_it_is_back(
    tmp_path: Path, tiny_checkpoint: Path,
) -> None:
    """SQL is the record and its change log the outbox: with Milvus stopped, an upload is
    still acknowledged and searches answer 503 (never a partial index); once Milvus is back
    the follower applies the add, and nothing acknowledged is lost."""
    require(_milvus_available(), "pymilvus and milvus-lite (the `milvus` extra)")
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 'imgret.db'}"
    upgrade_to_head(db_url)
    milvus = milvus_lite_server(tmp_path / "milvus", port)
    uri = milvus.__enter__()
    env = _env(tmp_path, db_url, tiny_checkpoint, uri)
    try:
        with running_servers([(env, tmp_path / "a.log")]) as (server,):
            base = server.url
            files = [("images", (f"{i}.png", _png(i % 3, i), "image/png")) for i in range(6)]
            first = httpx.post(f"{base}/gallery", files=files,
                               data={"labels": [str(i % 3) for i in range(6)]}, timeout=60)
            assert first.status_code == 201, first.text
            milvus.__exit__(None, None, None)  # Milvus stops

            late = httpx.post(f"{base}/gallery", timeout=60, data={"labels": ["late"]},
                              files=[("images", ("late.png", _png(7, 7), "image/png"))])
            assert late.status_code == 201, late.text  # acknowledged: SQL holds it
            late_id = late.json()["ids"][0]
            down = httpx.post(f"{base}/search", data={"k": "3"}, timeout=60,
                              files={"image": ("q.png", _png(7, 7), "image/png")})
            assert down.status_code == 503, down.text
            assert "Retry-After" in down.headers and "127.0.0.1" not in down.text, down.text

            milvus = milvus_lite_server(tmp_path / "milvus", port)  # back, same data
            milvus.__enter__()
            deadline = time.monotonic() + 90
            while True:
                answer = httpx.post(f"{base}/search", data={"k": "1"}, timeout=60,
                                    files={"image": ("q.png", _png(7, 7), "image/png")})
                if answer.status_code == 200 and [
                        h["id"] for h in answer.json()["results"]] == [late_id]:
                    break
                assert time.monotonic() < deadline, answer.text
                time.sleep(0.3)
            health = httpx.get(f"{base}/health").json()
            assert health["index_size"] == 7 and health["index_backend"] == "milvus"
    finally:
        milvus.__exit__(None, None, None)


def test_several_workers_on_a_milvus_lite_file_are_refused_in_one_line(tmp_path: Path) -> None:
    """One process opens a milvus-lite file: `imgret serve --workers 2` on one is refused
    before anything starts, naming the fix; a server URI is accepted."""
    from imgret.errors import ImgretError
    from imgret.service.run import check_milvus_workers, serve
    from imgret.settings import Settings

    lite = Settings(data_dir=tmp_path, index_backend="milvus")
    with pytest.raises(ImgretError, match="milvus-lite file.*--workers is 2.*http://host:port"):
        serve(lite, workers=2)
    assert not any(tmp_path.iterdir())  # refused before touching the data dir
    check_milvus_workers(lite, 1)
    check_milvus_workers(Settings(data_dir=tmp_path, index_backend="milvus",
                                  milvus_uri="http://127.0.0.1:19530"), 4)
    check_milvus_workers(Settings(data_dir=tmp_path), 4)  # the FAISS backend: no such rule
