"""``/health`` gives the follower's database error text only to whoever may read it: the
right ``X-API-Key`` on a server with a key, a local request on one without (SQLite and
PostgreSQL; the app in-process, the failure set as the follower records it)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from imgret.service.routers.health import FOLLOWER_ERROR_HIDDEN
from tests.api.conftest import API_KEY

SECRET_TEXT = "OperationalError: connection to server at \"db.internal\" (10.0.0.5) failed"


def _error(client: TestClient, headers: dict[str, str] | None = None) -> str | None:
    response = client.get("/health", headers=headers or {})
    assert response.status_code == 200
    return response.json()["follower_error"]


def test_with_a_key_only_the_key_reveals_the_error_text(make_client) -> None:
    with make_client(api_key=API_KEY, follow_interval_s=3600, change_notify=False) as client:
        assert _error(client) is None
        client.app.state.resources.follower.last_error = SECRET_TEXT
        assert _error(client, {"X-API-Key": API_KEY}) == SECRET_TEXT
        for headers in ({}, {"X-API-Key": "wrong"}, {"X-API-Key": API_KEY[:-1]}):
            assert _error(client, headers) == FOLLOWER_ERROR_HIDDEN
        # Not even to this machine: with a key, the key decides.
        assert _error(client, {"Host": "127.0.0.1"}) == FOLLOWER_ERROR_HIDDEN


def test_without_a_key_only_local_requests_read_the_error_text(make_client) -> None:
    with make_client(follow_interval_s=3600, change_notify=False,
                     allow_anonymous_writes=True) as client:
        client.app.state.resources.follower.last_error = SECRET_TEXT
        app = client.app
        local = TestClient(app, base_url="http://127.0.0.1:8000", client=("127.0.0.1", 5000))
        assert _error(local) == SECRET_TEXT
        remote = TestClient(app, base_url="http://api.example", client=("192.0.2.7", 5000))
        rebound = TestClient(app, base_url="http://rebind.example:8000",
                             client=("127.0.0.1", 5000))
        # IMGRET_ALLOW_ANONYMOUS_WRITES opens writes, not the error text.
        assert _error(remote) == FOLLOWER_ERROR_HIDDEN
        assert _error(rebound) == FOLLOWER_ERROR_HIDDEN
        assert _error(local, {"X-Forwarded-For": "203.0.113.9"}) == FOLLOWER_ERROR_HIDDEN
