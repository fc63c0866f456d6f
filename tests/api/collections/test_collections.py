"""Collections through the API, on both databases: create, list, describe, delete; each
collection's routes see only its own items; the default collection's routes are today's."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.api.conftest import png


def _add(client: TestClient, prefix: str, pairs: list[tuple[int, int]]) -> list[int]:
    files = [("images", (f"{c}_{i}.png", png(c, i), "image/png")) for c, i in pairs]
    response = client.post(f"{prefix}/gallery", files=files,
                           data={"labels": [f"{prefix or 'default'}-{c}" for c, _ in pairs]})
    assert response.status_code == 201, response.text
    return response.json()["ids"]


def test_a_collection_holds_its_own_items_and_serves_them_alone(client: TestClient) -> None:
    created = client.post("/collections", json={"name": "shop-a"})
    assert created.status_code == 201, created.text
    info = created.json()
    assert (info["name"], info["items"], info["public"]) == ("shop-a", 0, True)
    assert info["active_version"] == client.get("/health").json()["model_version"]
    shop = "/collections/shop-a"
    # The same images in both: identical bytes, separate items.
    pairs = [(c, i) for c in range(2) for i in range(3)]
    ours, theirs = _add(client, "", pairs), _add(client, shop, pairs)
    assert not set(ours) & set(theirs)
    for prefix, own in (("", ours), (shop, theirs)):
        listed = client.get(f"{prefix}/gallery", params={"limit": 100}).json()
        assert [item["id"] for item in listed["data"]] == own
        assert all(item["uri"].startswith(f"{prefix}/gallery/") for item in listed["data"])
        found = client.post(f"{prefix}/search", data={"k": 50},
                            files={"image": ("q.png", png(0, 0), "image/png")}).json()
        assert {hit["id"] for hit in found["results"]} == set(own)
        image = client.get(found["results"][0]["uri"])
        assert image.status_code == 200 and image.content == png(0, 0)
    # Another collection's item is not there, by id, through any route.
    assert client.get(f"/gallery/{theirs[0]}").status_code == 404
    assert client.get(f"{shop}/gallery/{ours[0]}/image").status_code == 404
    assert client.delete(f"{shop}/gallery/{ours[0]}").status_code == 404
    assert client.get(f"/gallery/{ours[0]}").status_code == 200
    assert client.post(f"{shop}/search", data={"id": ours[0]}).status_code == 404
    listed = {c["name"]: c["items"] for c in client.get("/collections").json()["collections"]}
    assert listed == {"default": len(ours), "shop-a": len(theirs)}
    assert [m["version"] for m in client.get(f"{shop}/models").json()["models"]] == \
        [info["active_version"]]


def test_deleting_a_collection_leaves_the_others_and_answers_404(client: TestClient) -> None:
    assert client.post("/collections", json={"name": "cams"}).status_code == 201
    pairs = [(0, 0), (1, 1)]
    kept = _add(client, "", pairs)
    gone = _add(client, "/collections/cams", pairs)
    assert client.delete("/collections/cams").status_code == 204
    for path in ("/collections/cams", "/collections/cams/gallery",
                 f"/collections/cams/gallery/{gone[0]}/image"):
        assert client.get(path).status_code == 404, path
    assert client.post("/collections/cams/search",
                       files={"image": ("q.png", png(0, 0), "image/png")}).status_code == 404
    assert client.delete("/collections/cams").status_code == 404
    # The default collection's items, and their identical bytes, are untouched.
    for item_id in kept:
        assert client.get(f"/gallery/{item_id}/image").status_code == 200
    # The name can be used again: a new, empty collection.
    assert client.post("/collections", json={"name": "cams"}).status_code == 201
    assert client.get("/collections/cams/gallery").json()["count"] == 0


def test_bad_collection_requests_are_refused_and_change_nothing(client: TestClient) -> None:
    before = client.get("/collections").json()
    for body in ({"name": "Shop"}, {"name": ""}, {"name": "a" * 65}, {"name": "-a"},
                 {"name": "a/b"}, {"name": "a\u0000"}, {"name": "default"}, {"name": "all"},
                 {"name": "ok", "extra": 1}, {"name": "ok", "model_version": "../etc"},
                 {"name": 5}, [], {"name": "ok", "public": "maybe"}):
        response = client.post("/collections", json=body)
        assert response.status_code == 422, (body, response.text)
    assert client.post("/collections", json={"name": "ok", "model_version": "nope"}
                       ).status_code == 422
    assert client.get("/collections").json() == before
    assert client.post("/collections", json={"name": "ok"}).status_code == 201
    assert client.post("/collections", json={"name": "ok"}).status_code == 409
    assert client.delete("/collections/default").status_code == 422
    assert client.get("/collections/UPPER/gallery").status_code == 422
    assert client.get("/collections/nope/gallery").status_code == 404
    assert client.get("/collections/nope").status_code == 404


def test_idle_and_least_used_collections_unload_and_reopen_from_sql(make_client) -> None:
    import time

    with make_client(max_open_collections=2, collection_idle_s=1.0) as client:
        ids = {}
        for name in ("a", "b", "c"):
            assert client.post("/collections", json={"name": name}).status_code == 201
            ids[name] = _add(client, f"/collections/{name}", [(ord(name) % 3, 0)])
        opened = {c["name"]: c["index"] for c in client.get("/collections").json()["collections"]}
        # At most two besides default: "a", used least recently, was closed to open "c".
        assert opened["a"] is None and opened["b"]["vectors"] == 1
        assert opened["c"]["bytes"] == 16 * 4 and opened["default"]["idle_s"] is None
        # Reopened from SQL on its next request, with its own item.
        found = client.post("/collections/a/search", files={"image": ("q.png", png(0, 0),
                                                                     "image/png")}).json()
        assert [h["id"] for h in found["results"]] == ids["a"]
        assert client.get("/collections/b").json()["index"] is None  # now the least used
        time.sleep(1.5)  # idle: every collection but default is closed
        listed = {c["name"]: c["index"] for c in client.get("/collections").json()["collections"]}
        assert [n for n, index in listed.items() if index is not None] == ["default"]
        assert client.get("/collections/c/gallery").json()["count"] == 1
