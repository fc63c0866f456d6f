"""Nasty-but-plausible values get a 4xx with a message, never a 500.

PostgreSQL refuses NUL in ``text`` and ``jsonb``, ``Infinity``/``NaN`` in ``jsonb`` and
integers beyond a column's range; Python's ``json`` recurses per nesting level and refuses
integers of over 4300 digits. Each case runs on SQLite and PostgreSQL (``client``), and the
gallery must be unchanged afterwards. Database errors that still get through are mapped in one
place (``imgret.service.errors``): checked here with a tiny app that raises each kind.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import exc as sa_exc

from imgret.service.errors import install_error_handlers
from imgret.service.request_rules import JSON_MAX_DEPTH, parse_json_object
from tests.api.conftest import png

# Within the size limit, and far past Python's recursion limit (about 1000).
DEEP = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
HUGE_INT = '{"a": ' + "9" * 5000 + "}"


def _gallery(labels: Any = "a", *, filename: str = "a.png", **data: Any) -> dict:
    return {"files": {"images": (filename, png(0, 0), "image/png")},
            "data": {"labels": labels, **data}}


def _raw_multipart(filename: bytes, label: bytes = b"a") -> dict:
    """A multipart body written by hand: httpx would escape a NUL in a file name."""
    body = (b"--b\r\nContent-Disposition: form-data; name=\"images\"; filename=\"" + filename
            + b"\"\r\nContent-Type: image/png\r\n\r\n" + png(0, 0)
            + b"\r\n--b\r\nContent-Disposition: form-data; name=\"labels\"\r\n\r\n" + label
            + b"\r\n--b--\r\n")
    return {"content": body, "headers": {"content-type": "multipart/form-data; boundary=b"}}


def _search(**data: Any) -> dict:
    return {"files": {"image": ("q.png", png(1, 1), "image/png")}, "data": data}


# (name, method, url, request kwargs, expected status, a phrase the message contains)
CASES: list[tuple[str, str, str, dict, int, str]] = [
    ("label-nul", "POST", "/gallery", _gallery("a\x00b"), 422, "U+0000"),
    ("label-escape", "POST", "/gallery", _gallery("\x1b[31mred"), 422, "control character"),
    ("label-del", "POST", "/gallery", _gallery("a\x7f"), 422, "U+007F"),
    ("filename-nul", "POST", "/gallery", _raw_multipart(b"a\x00.png"), 422, "file name"),
    ("filename-newline", "POST", "/gallery", _raw_multipart(b"a\n.png"), 422, "file name"),
    ("label-utf7-surrogate", "POST", "/gallery",
     {**_raw_multipart(b"a.png", b"+2AA-"),
      "headers": {"content-type": "multipart/form-data; boundary=b; charset=utf-7"}}, 422,
     "surrogate"),
    ("camera-2^31", "POST", "/gallery", _gallery(cameras=str(2**31)), 422, ""),
    ("camera-negative", "POST", "/gallery", _gallery(cameras="-1"), 422, ""),
    ("camera-2^70", "POST", "/gallery", _gallery(cameras=str(2**70)), 422, ""),
    ("meta-nan", "POST", "/gallery", _gallery(metadata='{"a": NaN}'), 422, "NaN"),
    ("meta-infinity", "POST", "/gallery", _gallery(metadata='{"a": -Infinity}'), 422,
     "Infinity"),
    ("meta-float-overflow", "POST", "/gallery", _gallery(metadata='{"a": 1e400}'), 422,
     "overflows"),
    ("meta-int-65-bit", "POST", "/gallery", _gallery(metadata='{"a": 36893488147419103232}'),
     422, "64 bits"),
    ("meta-int-5000-digits", "POST", "/gallery", _gallery(metadata=HUGE_INT), 422, "64 bits"),
    ("meta-deep", "POST", "/gallery", _gallery(metadata=DEEP), 422, "nested"),
    ("meta-nul-value", "POST", "/gallery", _gallery(metadata='{"a": "x\\u0000y"}'), 422,
     "U+0000"),
    ("meta-nul-key", "POST", "/gallery", _gallery(metadata='{"a\\u0000": 1}'), 422, "U+0000"),
    ("meta-surrogate", "POST", "/gallery", _gallery(metadata='{"a": "\\ud800"}'), 422,
     "surrogate"),
    ("meta-huge", "POST", "/gallery", _gallery(metadata='{"a": "' + "x" * 20_000 + '"}'), 422,
     "characters of JSON"),
    ("meta-array", "POST", "/gallery", _gallery(metadata="[1, 2]"), 422, "JSON object"),
    ("list-label-nul", "GET", "/gallery?label=a%00b", {}, 422, "U+0000"),
    ("list-offset-huge", "GET", f"/gallery?offset={2**63}", {}, 422, ""),
    ("list-limit-zero", "GET", "/gallery?limit=0", {}, 422, ""),
    ("item-id-huge", "GET", f"/gallery/{2**64}", {}, 422, ""),
    ("delete-id-huge", "DELETE", f"/gallery/{2**63}", {}, 422, ""),
    ("search-label-nul", "POST", "/search", _search(label="a\x00"), 422, "U+0000"),
    ("search-k-twice", "POST", "/search", _search(k=["3", "5"]), 422, "more than once"),
    ("gallery-misspelt-field", "POST", "/gallery", _gallery(camera="1"), 422, "unknown form"),
    ("search-camera-2^40", "POST", "/search", _search(camera=str(2**40)), 422, ""),
    ("search-meta-nan", "POST", "/search", _search(metadata='{"a": NaN}'), 422, "NaN"),
    ("search-meta-deep", "POST", "/search", _search(metadata=DEEP), 422, "nested"),
    # /search and /search/batch read their form themselves: the same rules as declared fields.
    ("search-misspelt-field", "POST", "/search", _search(lable="x"), 422, "unknown form"),
    ("search-image-as-text", "POST", "/search", {"data": {"image": "not a file"}}, 422,
     "send a file"),
    ("search-k-as-file", "POST", "/search",
     {"files": [("image", ("q.png", png(1, 1), "image/png")), ("k", ("k.txt", b"3"))]}, 422,
     "send a text field"),
    ("search-k-not-a-number", "POST", "/search", _search(k="ten"), 422, "k"),
    ("search-query-k-zero", "POST", "/search?k=0", _search(), 422, "k"),
    ("search-id-2^63", "POST", "/search", {"data": {"id": str(2**63)}}, 422, "id"),
    ("search-rerank-unknown", "POST", "/search", _search(rerank="magic"), 422, "rerank"),
    ("search-malformed-multipart", "POST", "/search",
     {"content": b"--b\r\nContent-Disposition: form-data\r\n\r\n3\r\n--b--\r\n",
      "headers": {"content-type": "multipart/form-data; boundary=b"}}, 400, "multipart"),
    ("batch-no-images", "POST", "/search/batch", {"data": {"k": "3"}}, 422, "images"),
    ("batch-misspelt-field", "POST", "/search/batch",
     {"files": [("images", ("q.png", png(1, 1), "image/png"))], "data": {"image": "x"}}, 422,
     "unknown form"),
    ("evaluate-set-nul", "POST", "/evaluate", {"json": {"query_set": "q\x00"}}, 422,
     "U+0000"),
    ("evaluate-version-nul", "POST", "/evaluate",
     {"json": {"query_set": "q", "model_version": "\x00"}}, 422, "U+0000"),
    ("evaluate-version-long", "POST", "/evaluate",
     {"json": {"query_set": "q", "model_version": "v" * 1000}}, 422, ""),
    ("evaluate-set-surrogate", "POST", "/evaluate",
     {"content": b'{"query_set": "\\ud800"}', "headers": {"content-type": "application/json"}},
     422, ""),
]


def test_hostile_values_are_4xx_with_a_message_and_change_nothing(client) -> None:
    before = client.get("/gallery").json()
    failures = []
    for name, method, url, kwargs, expected, phrase in CASES:
        response = client.request(method, url, **kwargs)
        detail = response.json().get("detail") if response.headers.get(
            "content-type", "").startswith("application/json") else None
        if response.status_code != expected or not detail or phrase not in str(detail):
            failures.append(f"{name}: {response.status_code} {response.text[:200]}")
    assert not failures, "\n".join(failures)
    assert client.get("/health").status_code == 200
    assert client.get("/gallery").json() == before


def test_odd_but_valid_values_are_accepted(client) -> None:
    response = client.post("/gallery", **_gallery(
        "étiquette 名前 🙂", filename="naïve file.png", cameras=str(2**31 - 1),
        metadata='{"note": "line 1\\nline 2\\ttab", "n": -9223372036854775808, "x": 1.5e300,'
                 ' "nested": {"a": [1, [2, [3]]]}}',
    ))
    assert response.status_code == 201, response.text
    item = client.get(f"/gallery/{response.json()['ids'][0]}").json()
    assert item["label"] == "étiquette 名前 🙂" and item["camera"] == 2**31 - 1
    assert item["metadata"]["n"] == -(2**63) and item["metadata"]["note"] == "line 1\nline 2\ttab"
    found = client.post("/search", **_search(label="étiquette 名前 🙂", camera=str(2**31 - 1)))
    assert found.status_code == 200 and len(found.json()["results"]) == 1


def test_json_depth_limit_is_exact() -> None:
    nested = "[" * (JSON_MAX_DEPTH - 1) + "]" * (JSON_MAX_DEPTH - 1)
    assert parse_json_object('{"a": ' + nested + "}", "m") == {
        "a": eval(nested)  # noqa: S307 - a literal of brackets
    }
    with pytest.raises(Exception, match="nested"):
        parse_json_object('{"a": [' + nested + "]}", "m")
    # Brackets inside strings do not count.
    assert parse_json_object('{"a": "' + "[" * 50 + '"}', "m") == {"a": "[" * 50}


def _orig(message: str) -> Exception:
    return Exception(message)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (sa_exc.DataError("INSERT INTO gallery_items (label) VALUES (%(label)s)",
                          {"label": "secret\x00"},
                          _orig("value too long for type character varying(255)")), 422),
        (sa_exc.IntegrityError("INSERT INTO gallery_items ...", {}, _orig(
            'duplicate key value violates unique constraint "uq_gallery_items_live_sha256"')),
         409),
        (sa_exc.OperationalError("SELECT 1", {}, _orig("connection refused")), 503),
        (sa_exc.InterfaceError("SELECT 1", {}, _orig("connection already closed")), 503),
    ],
    ids=["data", "integrity", "operational", "interface"],
)
def test_database_errors_are_mapped_in_one_place_without_sql(error, status) -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    def boom() -> None:
        raise error

    with TestClient(app) as client:
        response = client.get("/boom")
    assert response.status_code == status
    detail = response.json()["detail"]
    assert detail and "INSERT" not in detail and "SELECT" not in detail
    assert "secret" not in detail and "uq_gallery" not in detail and "varying" not in detail
    if status in (409, 503):
        assert response.headers["retry-after"] == "1"


def test_programming_errors_are_not_disguised_as_client_errors() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/bug")
    def bug() -> None:
        raise sa_exc.ProgrammingError("SELECT nope", {}, _orig("column nope does not exist"))

    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/bug").status_code == 500


def test_validation_errors_do_not_echo_huge_inputs(local_client) -> None:
    response = local_client.post("/search", **_search(label="x" * 100_000))
    assert response.status_code == 422
    assert len(response.text) < 2000
    assert "100000 characters" in response.text


@pytest.mark.postgres
def test_database_down_is_503_with_retry_after(
    tmp_path, postgres_url: str, postgres_admin_url: str, tiny_checkpoint
) -> None:
    """A real outage: the database refuses connections; reads and writes answer 503."""
    import psycopg

    from tests.api.conftest import _client_factory
    from tests.conftest import _libpq

    name = postgres_url.rsplit("/", 1)[1]
    with _client_factory(tmp_path / "data", postgres_url, tiny_checkpoint)() as client, \
            psycopg.connect(_libpq(postgres_admin_url), autocommit=True) as admin:
        assert client.post("/gallery", **_gallery()).status_code == 201
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        try:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = %s", (name,))
            for method, url, kwargs in [("GET", "/gallery", {}), ("GET", "/gallery/1", {}),
                                        ("POST", "/gallery", _gallery(filename="b.png")),
                                        ("DELETE", "/gallery/1", {})]:
                response = client.request(method, url, **kwargs)
                assert response.status_code == 503, (method, url, response.text)
                assert response.headers["retry-after"] == "1"
                detail = response.json()["detail"]
                assert "database" in detail and "SELECT" not in detail and name not in detail
        finally:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        assert client.get("/gallery").json()["count"] == 1  # back once the database is
