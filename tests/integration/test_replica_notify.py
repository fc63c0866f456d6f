"""Replicas that follow at once: on PostgreSQL, a write committed through one
server process wakes the other through LISTEN/NOTIFY, long before its next poll.

Two real ``imgret serve`` processes share one PostgreSQL database and one data dir; both poll
the change log only every :data:`POLL_S` (far longer than the test waits), so an add that
server two finds within :data:`WAKE_S` reached it by notification. The control run turns the
notifications off (``IMGRET_CHANGE_NOTIFY=false``): the same add is then not found within
that time, which shows the first run measured the wake-up and not a poll.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
import pytest

from imgret.gallery.storage.db import upgrade_to_head
from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import KEY_HEADERS, png, server_env
from tests.support.live_server import running_servers

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

POLL_S = 300  # IMGRET_FOLLOW_INTERVAL_S: no poll happens during the test
WAKE_S = 5.0  # an add reaches the other server within this when it is woken


def _found(http: httpx.Client, url: str, image: bytes, item_id: int) -> bool:
    response = http.post(f"{url}/search", data={"k": "1"},
                         files={"image": ("q.png", image, "image/png")})
    assert response.status_code == 200, response.text
    return [hit["id"] for hit in response.json()["results"]] == [item_id]


def _seen_within(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def _add(http: httpx.Client, url: str, image: bytes) -> int:
    response = http.post(f"{url}/gallery", headers=KEY_HEADERS, data={"labels": ["x"]},
                         files=[("images", ("a.png", image, "image/png"))])
    assert response.status_code == 201, response.text
    return response.json()["ids"][0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("notify", [True, False], ids=["notify", "poll-only"])
def test_an_add_wakes_the_other_replica(tmp_path: Path, postgres_url: str,
                                        tiny_checkpoint: Path, notify: bool) -> None:
    upgrade_to_head(postgres_url)
    env = {
        **server_env(data_dir=tmp_path / "data", db_url=postgres_url,
                     checkpoint=tiny_checkpoint, device=TEST_DEVICE),
        "IMGRET_FOLLOW_INTERVAL_S": str(POLL_S),
        "IMGRET_CHANGE_NOTIFY": str(notify).lower(),
    }
    with contextlib.ExitStack() as stack:
        one, two = stack.enter_context(running_servers(
            [(env, tmp_path / "one.log"), (env, tmp_path / "two.log")]
        ))
        http = stack.enter_context(httpx.Client(timeout=60))
        # Let the listener connect (it starts with the app; an add before it listens would
        # be missed until the poll, which is not what is being tested).
        time.sleep(1.0)
        image = png(3, 1)
        item = _add(http, one.url, image)
        assert _found(http, one.url, image, item)  # the writer's own index: at once
        seen = _seen_within(lambda: _found(http, two.url, image, item), WAKE_S)
        assert seen is notify, (
            f"server two {'did not find' if notify else 'found'} the add within {WAKE_S} s "
            f"with notifications {'on' if notify else 'off'}"
        )
        if notify:
            # A delete through server two: server one never returns it again.
            deleted = http.delete(f"{two.url}/gallery/{item}", headers=KEY_HEADERS)
            assert deleted.status_code == 204, deleted.text
            assert not _found(http, one.url, image, item)
            # ... and a second add, after that round trip, wakes it again.
            other = png(4, 2)
            second = _add(http, two.url, other)
            assert _seen_within(lambda: _found(http, one.url, other, second), WAKE_S)
