"""API keys with roles per collection, on both databases: stored hashed, checked against the
role each route needs (the generated role × route table, walked here), revoked at once in
this process; bad key-management input is refused and changes nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from imgret.gallery.storage.db import make_engine
from imgret.service.access import markdown_table, route_table
from tests.api.conftest import API_KEY, png

ADMIN = {"X-API-Key": API_KEY}
DOC = Path(__file__).resolve().parents[3] / "docs" / "api.md"
TABLE_START, TABLE_END = "<!-- roles:start -->", "<!-- roles:end -->"


def _key(client: TestClient, name: str, roles: dict, admin: bool = False) -> dict:
    response = client.post("/keys", json={"name": name, "roles": roles, "admin": admin},
                           headers=ADMIN)
    assert response.status_code == 201, response.text
    return response.json()


def _search(client: TestClient, prefix: str, key: str | None = None):
    return client.post(f"{prefix}/search", files={"image": ("q.png", png(0, 0), "image/png")},
                       headers={"X-API-Key": key} if key else {})


def _add(client: TestClient, prefix: str, key: str | None, n: int = 0):
    return client.post(f"{prefix}/gallery", files={"images": ("a.png", png(1, n), "image/png")},
                       data={"labels": ["x"]}, headers={"X-API-Key": key} if key else {})


@pytest.fixture
def keyed(make_client, db_url):
    with make_client(api_key=API_KEY) as client:
        assert client.post("/collections", json={"name": "shop", "public": False},
                           headers=ADMIN).status_code == 201
        yield client, db_url


def test_roles_decide_per_collection_and_revocation_is_immediate(keyed) -> None:
    client, db_url = keyed
    reader = _key(client, "reader", {"shop": "read"})
    writer = _key(client, "writer", {"shop": "write", "default": "read"})
    assert reader["key"].startswith(f"imgret_{reader['id']}_")
    shop = "/collections/shop"
    # Anonymous: the public default collection answers reads, the private shop none.
    assert _search(client, "").status_code == 200
    assert _search(client, shop).status_code == 401
    assert client.get(f"{shop}/gallery").status_code == 401
    assert [c["name"] for c in client.get("/collections").json()["collections"]] == ["default"]
    # The writer writes the shop, not the default collection; the reader only reads.
    added = _add(client, shop, writer["key"])
    assert added.status_code == 201, added.text
    item = added.json()["ids"][0]
    assert _add(client, "", writer["key"]).status_code == 403
    assert _add(client, shop, reader["key"], 1).status_code == 403
    assert _search(client, shop, reader["key"]).status_code == 200
    assert client.get(f"{shop}/gallery/{item}/image",
                      headers={"X-API-Key": reader["key"]}).status_code == 200
    assert client.get(f"{shop}/gallery/{item}/image").status_code == 401
    listed = client.get("/collections", headers={"X-API-Key": reader["key"]}).json()
    assert [c["name"] for c in listed["collections"]] == ["default", "shop"]
    # Model writes need admin; key management needs a global admin.
    assert client.post(f"{shop}/models/rollback",
                       headers={"X-API-Key": writer["key"]}).status_code == 403
    assert client.get("/keys", headers={"X-API-Key": writer["key"]}).status_code == 403
    # A wrong or malformed key is 401 even where no key is needed.
    forged = reader["key"][:-4] + "AAAA"
    for bad in (forged, "imgret_999_" + "A" * 43, "nope", "imgret_1_short"):
        assert _search(client, "", bad).status_code == 401, bad
    # Revoked: refused at once, in this process.
    assert client.delete(f"/keys/{reader['id']}", headers=ADMIN).status_code == 204
    assert _search(client, shop, reader["key"]).status_code == 401
    listed = client.get("/keys", headers=ADMIN).json()["keys"]
    assert [k["revoked_at"] is not None for k in listed] == [True, False]
    # Only a salted hash is stored: the secret is nowhere in the database.
    engine = make_engine(db_url)
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT salt, digest, kdf FROM api_keys")).all()
    engine.dispose()
    secret = writer["key"].rsplit("_", 1)[1].encode()
    assert all(secret not in bytes(salt) + bytes(digest) and kdf.startswith("scrypt")
               for salt, digest, kdf in rows)


def test_every_route_asks_what_the_generated_table_says(keyed) -> None:
    """Walk the role × route table: a key holding the stated role gets past the guard (any
    answer but 401/403), a key with less gets 403, no key gets 401 (or an answer where
    anonymous reads of a public collection are allowed, and there a good key without any
    role on that collection is let in too: a key never takes away what anonymity gives)."""
    client, _ = keyed
    table = route_table(client.app.openapi())
    assert len(table) > 40
    reader = _key(client, "reader", {"shop": "read", "default": "read"})["key"]
    writer = _key(client, "writer", {"shop": "write", "default": "write"})["key"]
    admin = _key(client, "shop-admin", {"shop": "admin", "default": "admin"})["key"]
    # Holds nothing on the public default collection: it must read there as anonymity does.
    elsewhere = _key(client, "shop-reader", {"shop": "read"})["key"]
    strength = {"read": reader, "write": writer, "admin": admin}
    order = ["read", "write", "admin"]
    for method, path, who in table:
        url = re.sub(r"\{collection\}", "shop", path)
        url = re.sub(r"\{[a-z_]+\}", "1", url)
        if path in ("/collections/{collection}",) and method == "DELETE":
            url = "/collections/nothing-here"
        checks: list[tuple[str | None, set[int] | None]] = []
        if who == "anyone" or who.startswith("anyone ("):
            checks.append((None, None))
        elif who == "global admin":
            checks += [(None, {401}), (admin, {403})]
        else:
            role = re.search(r"(read|write|admin) on", who).group(1)
            public = who.startswith("anyone if public") and "{collection}" not in path
            checks.append((None, None if public else {401}))
            if public:
                checks.append((elsewhere, None))
            checks.append((strength[role], None))
            if order.index(role) > 0:
                checks.append((strength[order[order.index(role) - 1]], {403}))
        for key, expected in checks:
            response = client.request(method, url, headers={"X-API-Key": key} if key else {})
            if expected is None:
                assert response.status_code not in (401, 403), (method, url, key, response.text)
            else:
                assert response.status_code in expected, (method, url, key, response.text)


def test_the_docs_show_the_table_the_app_generates(local_client: TestClient) -> None:
    text_ = DOC.read_text()
    shown = text_.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert shown == markdown_table(local_client.app.openapi()).strip(), (
        "docs/api.md is out of date: regenerate it with python tools/role_table.py")


@pytest.mark.parametrize("body", [
    {"name": ""}, {"name": "x" * 65}, {"name": "a\nb"}, {"name": "ok", "roles": {"shop": "owner"}},
    {"name": "ok", "roles": {"Shop": "read"}}, {"name": "ok", "roles": {"nowhere": "read"}},
    {"name": "ok", "roles": {"../x": "read"}}, {"name": "ok", "admin": "yes"},
    {"name": "ok", "extra": True}, {"name": "ok", "roles": ["shop"]}, [],
])
def test_bad_key_requests_are_refused_and_change_nothing(keyed, body) -> None:
    client, _ = keyed
    before = client.get("/keys", headers=ADMIN).json()
    response = client.post("/keys", json=body, headers=ADMIN)
    assert response.status_code == 422, response.text
    assert client.get("/keys", headers=ADMIN).json() == before
    assert client.delete("/keys/424242", headers=ADMIN).status_code == 404
    assert client.delete("/keys/0", headers=ADMIN).status_code == 422
    assert client.delete("/keys/x", headers=ADMIN).status_code == 422
