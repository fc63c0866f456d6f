"""Writes are closed by default and decided before the body is read.

The key, the exposure rule and the ``Origin`` check run in a pure ASGI middleware
(``imgret.service.auth.WriteGuardMiddleware``): FastAPI parses a multipart form *before* it solves a
route's dependencies, so the old ``require_api_key`` dependency let an unauthenticated client
make the server read and spool a whole upload first.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from fastapi.routing import APIRoute

from imgret.errors import ImgretError
from imgret.service.app import create_app
from imgret.service.auth import (
    WriteGuardMiddleware,
    check_write_exposure,
    is_loopback,
    is_write,
    normalize_origin,
)
from imgret.service.deps import require_api_key
from imgret.settings import Settings
from tests.api.conftest import API_KEY, png

KEY = {"X-API-Key": API_KEY}


def _upload(client, headers=None, label="a"):
    return client.post("/gallery", files={"images": ("a.png", png(0, 0), "image/png")},
                       data={"labels": label}, headers=headers or {})


def _run_guard(settings: Settings, *, method="POST", path="/gallery", headers=(),
               server=("127.0.0.1", 8000), client=("127.0.0.1", 50000),
               host: str | None = "127.0.0.1:8000") -> tuple[int | None, int, bool]:
    """Drive the middleware alone: (status sent, receive() calls, whether the app ran)."""
    reads = 0
    sent: list[dict] = []
    app_ran = False

    async def receive() -> dict:
        nonlocal reads
        reads += 1
        # A body that would be expensive to parse: an endless stream of garbage.
        return {"type": "http.request", "body": b"\x00garbage" * 10_000, "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive_, send_) -> None:
        nonlocal app_ran
        app_ran = True
        await send_({"type": "http.response.start", "status": 201, "headers": []})
        await send_({"type": "http.response.body", "body": b"{}"})

    scope = {
        "type": "http", "method": method, "path": path, "root_path": "", "scheme": "http",
        "server": server, "client": client,
        "headers": [(k.lower().encode(), v.encode())
                    for k, v in ([("Host", host)] if host else []) + list(headers)],
    }
    asyncio.run(WriteGuardMiddleware(app, settings=settings)(scope, receive, send))
    return (sent[0]["status"] if sent else None), reads, app_ran


def test_wrong_key_is_refused_before_one_byte_of_the_body_is_read() -> None:
    settings = Settings(api_key=API_KEY)
    status, reads, app_ran = _run_guard(settings, headers=[("X-API-Key", "wrong"),
                                                          ("Content-Length", "80000000")])
    assert (status, reads, app_ran) == (401, 0, False)
    status, reads, app_ran = _run_guard(settings, headers=[])
    assert (status, reads, app_ran) == (401, 0, False)
    # The right key goes through to the app (which would read the body).
    assert _run_guard(settings, headers=[("X-API-Key", API_KEY)])[0] == 201
    # Reads are never guarded.
    assert _run_guard(settings, path="/search")[0] == 201
    assert _run_guard(settings, method="GET", path="/gallery")[0] == 201


def test_wrong_key_with_a_malformed_body_is_401_not_400(make_local_client) -> None:
    with make_local_client(api_key=API_KEY) as client:
        response = client.post(
            "/gallery", content=b"--x\r\nnot a multipart body at all" * 1000,
            headers={"content-type": "multipart/form-data; boundary=x", "X-API-Key": "nope"},
        )
        assert response.status_code == 401
        assert response.json()["detail"] == "missing or wrong X-API-Key header"
        assert response.headers["www-authenticate"] == "X-API-Key"
        # DELETE and /evaluate are writes too; /search is not.
        assert client.delete("/gallery/1").status_code == 401
        assert client.post("/evaluate", json={"query_set": "q"}).status_code == 401
        assert client.post(
            "/search", files={"image": ("q.png", png(0, 0), "image/png")}
        ).status_code == 200
        assert _upload(client, KEY).status_code == 201
        assert client.get("/gallery").json()["count"] == 1


def test_cross_origin_browser_write_is_403(make_local_client) -> None:
    with make_local_client() as client:  # no key: loopback/in-process, so writes are open
        response = _upload(client, {"Origin": "https://evil.example"})
        assert response.status_code == 403
        assert "cross-origin write" in response.json()["detail"]
        assert _upload(client, {"Origin": "null"}).status_code == 403
        assert client.delete("/gallery/1", headers={"Origin": "http://evil:80"}).status_code == 403
        # Same origin (the API's own page) and non-browser clients (no Origin) may write.
        assert _upload(client, {"Origin": "http://testserver"}).status_code == 201
        assert _upload(client).status_code == 201
        assert client.get("/gallery").json()["count"] == 1
        # A cross-origin *search* is a read: allowed.
        assert client.post(
            "/search", files={"image": ("q.png", png(0, 0), "image/png")},
            headers={"Origin": "https://evil.example"},
        ).status_code == 200


def test_allowed_origins_may_write_and_get_cors_headers(make_local_client) -> None:
    with make_local_client(allowed_origins="https://ui.example.com") as client:
        response = _upload(client, {"Origin": "https://ui.example.com"})
        assert response.status_code == 201
        assert response.headers["access-control-allow-origin"] == "https://ui.example.com"
        # Compared normalised (case, default port).
        assert _upload(client, {"Origin": "https://UI.example.com:443"}).status_code == 201
        assert _upload(client, {"Origin": "https://other.example.com"}).status_code == 403


def test_keyless_server_reached_beyond_loopback_refuses_writes() -> None:
    exposed = ("10.1.2.3", 50000)
    status, reads, app_ran = _run_guard(Settings(), client=exposed, server=("10.1.2.4", 80),
                                        host="10.1.2.4")
    assert (status, reads, app_ran) == (403, 0, False)
    assert _run_guard(Settings(), client=("127.0.0.1", 1))[0] == 201
    assert _run_guard(Settings(), client=("::1", 1), host="[::1]:8000")[0] == 201
    assert _run_guard(Settings(allow_anonymous_writes=True), client=exposed)[0] == 201
    assert _run_guard(Settings(api_key=API_KEY), client=exposed,
                      headers=[("X-API-Key", API_KEY)])[0] == 201


@pytest.mark.parametrize(
    ("host", "client", "extra", "allowed"),
    [("127.0.0.1:8000", "127.0.0.1", [], True),
     ("localhost:8000", "127.0.0.1", [], True),
     ("app.localhost", "127.0.0.1", [], True),
     ("[::1]:8000", "::1", [], True),
     ("127.5.6.7", "127.0.0.1", [], True),
     # DNS rebinding: a loopback peer, but the page's own name in Host.
     ("rebind.example:8000", "127.0.0.1", [], False),
     ("127.0.0.1.nip.io:8000", "127.0.0.1", [], False),
     ("localhost.", "127.0.0.1", [], False),
     (None, "127.0.0.1", [], False),
     ("user@localhost", "127.0.0.1", [], False),
     # A reverse proxy on this host: a loopback peer and Host, but proxy headers.
     ("127.0.0.1:8000", "127.0.0.1", [("X-Forwarded-For", "203.0.113.9")], False),
     ("127.0.0.1:8000", "127.0.0.1", [("Forwarded", "for=203.0.113.9")], False),
     ("127.0.0.1:8000", "127.0.0.1", [("X-Real-IP", "203.0.113.9")], False),
     ("127.0.0.1:8000", "127.0.0.1", [("X-Forwarded-Host", "api.example")], False),
     # A remote peer that claims a loopback Host.
     ("127.0.0.1:8000", "192.0.2.7", [], False),
     ("localhost", "::ffff:192.0.2.7", [], False)],
)
def test_keyless_writes_need_a_loopback_peer_host_and_no_proxy(
    host: str | None, client: str, extra: list[tuple[str, str]], allowed: bool
) -> None:
    status, reads, app_ran = _run_guard(Settings(), host=host, client=(client, 50000),
                                        headers=extra)
    assert (status, app_ran) == ((201, True) if allowed else (403, False))
    assert reads == 0 or allowed
    # IMGRET_ALLOW_ANONYMOUS_WRITES lifts the rule; a key replaces it.
    assert _run_guard(Settings(allow_anonymous_writes=True), host=host,
                      client=(client, 50000), headers=extra)[0] == 201
    assert _run_guard(Settings(api_key=API_KEY), host=host, client=(client, 50000),
                      headers=[*extra, ("X-API-Key", API_KEY)])[0] == 201


def test_a_unix_socket_peer_is_not_local_and_an_in_process_one_is() -> None:
    assert _run_guard(Settings(), client=None, server=None, host="localhost")[0] == 403
    assert _run_guard(Settings(), client=("testclient", 50000), server=("testserver", 80),
                      host="testserver")[0] == 201


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
     ("127.8.9.10", True), ("0.0.0.0", False), ("::", False), ("", False),
     ("192.168.1.4", False), ("api.example.com", False)],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_start_up_check_names_the_fix() -> None:
    with pytest.raises(ImgretError, match="IMGRET_API_KEY.*IMGRET_ALLOW_ANONYMOUS_WRITES=true"):
        check_write_exposure(Settings(), "0.0.0.0")
    with pytest.raises(ImgretError):
        check_write_exposure(Settings(api_key=""), "::")
    check_write_exposure(Settings(), "127.0.0.1")
    check_write_exposure(Settings(api_key="k"), "0.0.0.0")
    check_write_exposure(Settings(allow_anonymous_writes=True), "0.0.0.0")


def test_imgret_serve_refuses_a_public_host_without_a_key_or_bad_origins(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("IMGRET_API_KEY", "IMGRET_ALLOW_ANONYMOUS_WRITES")}
    env["IMGRET_DATA_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", "from imgret.cli.main import main; main()", "serve", "--host",
         "0.0.0.0", "--port", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "refusing to serve on '0.0.0.0' without an API key" in result.stderr
    assert "IMGRET_ALLOW_ANONYMOUS_WRITES=true" in result.stderr
    assert "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())  # refused before touching the data dir

    env["IMGRET_ALLOWED_ORIGINS"] = "https://ok.example, not-an-origin"
    result = subprocess.run(
        [sys.executable, "-c", "from imgret.cli.main import main; main()", "serve", "--port", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "IMGRET_ALLOWED_ORIGINS: 'not-an-origin'" in result.stderr
    assert "Traceback" not in result.stderr


def test_every_keyed_route_is_a_write_and_the_schema_documents_401_and_403() -> None:
    app = create_app(Settings(model="unused"))
    schema = app.openapi()
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        keyed = any(dep.call is require_api_key for dep in route.dependant.dependencies)
        for method in route.methods:
            if keyed:
                assert is_write(method, route.path), (method, route.path)
            if is_write(method, route.path):
                responses = schema["paths"][route.path][method.lower()]["responses"]
                assert {"401", "403"} <= set(responses), (method, route.path)
    assert schema["components"]["securitySchemes"]["APIKeyHeader"]["name"] == "X-API-Key"


@pytest.mark.parametrize(
    ("origin", "normalized"),
    [("https://A.example", "https://a.example"), ("http://h:80", "http://h"),
     ("http://h:8080/", "http://h:8080"), ("null", None), ("https://h/path", None),
     ("ftp://h", None), ("http://[::1]:99", "http://[::1]:99"), ("http://h:99999", None)],
)
def test_normalize_origin(origin: str, normalized: str | None) -> None:
    assert normalize_origin(origin) == normalized


def test_a_bad_allowed_origin_is_refused_at_start() -> None:
    with pytest.raises(ImgretError, match="IMGRET_ALLOWED_ORIGINS"):
        WriteGuardMiddleware(lambda *a: None, settings=Settings(allowed_origins="not an origin"))
