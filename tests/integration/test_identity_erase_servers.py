"""An erase answered by one server, confirmed by every server: two real ``imgret serve``
processes on one PostgreSQL database. The receipt names both processes with the time each had
applied the deletes, and neither returns the erased items afterwards (search, image bytes)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from imgret.gallery.media.files import sha256_hex
from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head
from imgret.gallery.storage.tables import ServingPosition
from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import KEY_HEADERS, png, server_env
from tests.support.live_server import running_servers

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _hits(http: httpx.Client, url: str) -> set[int]:
    response = http.post(f"{url}/search", data={"k": "50"},
                         files={"image": ("q.png", png(3, 0), "image/png")})
    assert response.status_code == 200, response.text
    return {hit["id"] for hit in response.json()["results"]}


def _until(check, what: str, seconds: float = 120.0) -> None:
    """Wait for ``check()`` (the event); the bound only turns a hang into a failure."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.05)


@pytest.mark.timeout(400)
def test_an_erase_is_confirmed_by_both_servers_and_neither_returns_it(
        tmp_path: Path, postgres_url: str, tiny_checkpoint: Path) -> None:
    upgrade_to_head(postgres_url)
    env = server_env(data_dir=tmp_path / "data", db_url=postgres_url,
                     checkpoint=tiny_checkpoint, device=TEST_DEVICE)
    engine = make_engine(postgres_url)
    sessions = make_sessionmaker(engine)

    def serving() -> int:
        with sessions() as session:
            return int(session.scalar(select(func.count()).select_from(ServingPosition)))

    images = [png(3, i) for i in range(3)]
    with contextlib.ExitStack() as stack:
        one, two = stack.enter_context(running_servers(
            [(env, tmp_path / "one.log"), (env, tmp_path / "two.log")]))
        http = stack.enter_context(httpx.Client(timeout=60))
        added = http.post(f"{one.url}/gallery", headers=KEY_HEADERS,
                          data={"labels": ["person", "person", "kept"]},
                          files=[("images", (f"{i}.png", image, "image/png"))
                                 for i, image in enumerate(images)])
        assert added.status_code == 201, added.text
        ids = added.json()["ids"]
        _until(lambda: set(ids) <= _hits(http, two.url), "server two holds the adds")
        _until(lambda: serving() == 2, "both servers report their position")

        receipt = http.post(f"{one.url}/identities/erase", json={"label": "person"},
                            headers=KEY_HEADERS)

        assert receipt.status_code == 200, receipt.text
        body = receipt.json()
        assert body["unconfirmed"] == []
        assert len({c["process"] for c in body["confirmed"]}) == 2
        assert sorted(body["gallery_item_ids"]) == sorted(ids[:2])
        assert body["gallery_items"]["sha256"] == sorted(sha256_hex(i) for i in images[:2])
        for url in (one.url, two.url):
            assert _hits(http, url) == {ids[2]}
            for item_id in ids[:2]:
                assert http.get(f"{url}/gallery/{item_id}/image").status_code == 404
            assert {r["label"] for r in http.get(f"{url}/identities").json()["data"]} == {"kept"}
    engine.dispose()
