"""Keys across processes, on both databases: a key created with `imgret keys create` works
on two running servers at once, and once revoked (by the CLI, a third process) both refuse
it within the follower interval."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from imgret.cli.main import app
from imgret.gallery.storage.db import upgrade_to_head
from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import KEY_HEADERS, png, server_env
from tests.support.live_server import running_servers

pytestmark = [pytest.mark.slow]

FOLLOW_INTERVAL_S = 1.0


def _cli(monkeypatch, env: dict[str, str], *args: str) -> str:
    from imgret.settings import get_settings

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    result = CliRunner().invoke(app, list(args))
    get_settings.cache_clear()
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def _search(url: str, key: str) -> int:
    return httpx.post(f"{url}/collections/faces/search", headers={"X-API-Key": key},
                      files={"image": ("q.png", png(0, 0), "image/png")}, timeout=30).status_code


@pytest.mark.timeout(300)
def test_a_revoked_key_is_refused_by_every_process_within_the_interval(
    tmp_path: Path, db_url: str, tiny_checkpoint: Path, monkeypatch
) -> None:
    env = server_env(data_dir=tmp_path / "data", db_url=db_url, checkpoint=tiny_checkpoint,
                     device=TEST_DEVICE)
    env["IMGRET_FOLLOW_INTERVAL_S"] = str(FOLLOW_INTERVAL_S)
    upgrade_to_head(db_url)
    with running_servers([(env, tmp_path / "a.log"), (env, tmp_path / "b.log")]) as servers:
        a, b = (server.url for server in servers)
        created = httpx.post(f"{a}/collections", json={"name": "faces", "public": False},
                             headers=KEY_HEADERS, timeout=30)
        assert created.status_code == 201, created.text
        out = _cli(monkeypatch, env, "keys", "create", "camera-7", "--role", "faces=read")
        key = out.strip().splitlines()[-1]
        # Known to both servers at once (an unknown key id makes a server look again).
        assert [_search(a, key), _search(b, key)] == [200, 200]
        assert httpx.post(f"{b}/collections/faces/search", timeout=30,
                          files={"image": ("q.png", png(0, 0), "image/png")}
                          ).status_code == 401  # private: no key, no answer
        key_id = out.split("created key ", 1)[1].split()[0]
        _cli(monkeypatch, env, "keys", "revoke", key_id)
        revoked_at = time.monotonic()
        refused: dict[str, float] = {}
        while len(refused) < 2 and time.monotonic() - revoked_at < 10 * FOLLOW_INTERVAL_S:
            for url in (a, b):
                if url not in refused and _search(url, key) == 401:
                    refused[url] = time.monotonic() - revoked_at
            time.sleep(0.05)
        print(f"\nrevoked key refused after {', '.join(f'{s:.2f} s' for s in refused.values())}"
              f" (follower interval {FOLLOW_INTERVAL_S} s)")
        assert set(refused) == {a, b}
        # Within the interval, plus one refresh's and one request's time.
        assert max(refused.values()) < FOLLOW_INTERVAL_S + 1.0
        # And for good: never accepted again.
        assert [_search(a, key), _search(b, key)] == [401, 401]
