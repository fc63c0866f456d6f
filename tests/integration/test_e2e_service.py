"""End to end: real `imgret serve` processes (uvicorn) on 127.0.0.1, on SQLite and PostgreSQL.

Two API processes share one database and one data dir (as replicas share PostgreSQL and a
media volume): a write through one is searchable through the other after its change poll.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from imgret.gallery.storage.db import upgrade_to_head
from tests.conftest import TEST_DEVICE
from tests.support.images import class_image, image_bytes
from tests.support.live_server import running_servers

pytestmark = pytest.mark.slow

# A replica polls the change log every second; allow for a loaded CI machine.
REPLICA_DEADLINE_S = 15.0


def _png(label: int, index: int) -> bytes:
    return image_bytes(class_image(label, index))


def _search_ids(base: str, image: bytes, k: int = 50) -> list[int]:
    response = httpx.post(f"{base}/search", files={"image": ("q.png", image, "image/png")},
                          data={"k": k}, timeout=30)
    response.raise_for_status()
    return [hit["id"] for hit in response.json()["results"]]


def _eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + REPLICA_DEADLINE_S
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {REPLICA_DEADLINE_S} s: {what}")


def test_two_servers_on_one_database(tmp_path: Path, db_url: str, tiny_checkpoint: Path) -> None:
    env = {
        "IMGRET_DATA_DIR": str(tmp_path / "data"),
        "IMGRET_DATABASE_URL": db_url,
        "IMGRET_MODEL": str(tiny_checkpoint),
        "IMGRET_DEVICE": TEST_DEVICE,
        "IMGRET_MAX_UPLOAD_BYTES": "200000",
    }
    # Replicas start after `imgret db upgrade` (on SQLite, two first-time migrations racing
    # each other are not serialised; PostgreSQL's advisory lock would serialise them).
    upgrade_to_head(db_url)
    with running_servers([(env, tmp_path / "a.log"), (env, tmp_path / "b.log")]) as servers:
        a, b = (server.url for server in servers)

        # Add through A: searchable through A as soon as the POST returns.
        pairs = [(c, i) for c in range(3) for i in range(4)]
        files = [("images", (f"{c}_{i}.png", _png(c, i), "image/png")) for c, i in pairs]
        added = httpx.post(f"{a}/gallery", files=files,
                           data={"labels": [str(c) for c, _ in pairs]}, timeout=60)
        assert added.status_code == 201, added.text
        ids = added.json()["ids"]
        query = _png(2, 0)  # the bytes of the 9th item
        assert _search_ids(a, query, k=1) == [ids[8]]

        # ... and through B once it has polled the change log.
        _eventually(lambda: _search_ids(b, query, k=1) == [ids[8]], "B sees A's additions")
        assert httpx.get(f"{b}/health").json()["index_size"] == 12
        image = httpx.get(f"{b}/gallery/{ids[8]}/image")
        assert image.headers["content-type"] == "image/png" and image.content == query

        # Delete through B: gone from B at once, from A after its poll.
        assert httpx.delete(f"{b}/gallery/{ids[8]}").status_code == 204
        assert ids[8] not in _search_ids(b, query)
        _eventually(lambda: ids[8] not in _search_ids(a, query), "A sees B's delete")
        assert httpx.get(f"{a}/gallery/{ids[8]}").status_code == 404

        # Bad input over a real socket: 4xx, and the server stays up.
        assert httpx.post(f"{a}/search", files={"image": ("x.png", b"junk", "image/png")}
                          ).status_code == 422
        assert _oversize_status(a, 300_000) == 413
        assert httpx.get(f"{a}/health").status_code == 200

        metrics = httpx.get(f"{a}/metrics").text
        assert 'route="/search",status="200"' in metrics
        assert "imgret_index_size 11.0" in metrics
    # Both processes stopped cleanly (running_server waits for them); the logs have one
    # JSON line per request.
    assert '"route":"/gallery"' in (tmp_path / "a.log").read_text()


def _oversize_status(base: str, size: int) -> int:
    """Send headers declaring a big body, then read the answer before sending any of it."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /search HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: multipart/form-data; boundary=abc\r\n"
            + f"Content-Length: {size}\r\n\r\n".encode()
        )
        status_line = sock.recv(4096).split(b"\r\n", 1)[0]
    return int(status_line.split()[1])
