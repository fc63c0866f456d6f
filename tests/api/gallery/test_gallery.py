"""/gallery: add, list, read, image bytes, delete, API key."""

from __future__ import annotations

import pytest

from tests.api.conftest import API_KEY, add_gallery, png, search


def test_add_list_read_and_fetch_image(client) -> None:
    classes = add_gallery(client, classes=3, per_class=4, cameras=True, metadata=True)
    ids = sorted(classes)

    page = client.get("/gallery", params={"offset": 2, "limit": 5}).json()
    assert page["count"] == 12 and page["offset"] == 2 and page["limit"] == 5
    assert [item["id"] for item in page["data"]] == ids[2:7]

    only_one = client.get("/gallery", params={"label": "1", "limit": 2}).json()
    assert only_one["count"] == 4 and len(only_one["data"]) == 2
    assert {item["label"] for item in only_one["data"]} == {"1"}

    item = client.get(f"/gallery/{ids[1]}").json()
    assert item["label"] == "0" and item["camera"] == 2
    assert item["metadata"] == {"parity": "odd"}
    assert item["content_type"] == "image/png"

    image = client.get(item["uri"])
    assert image.status_code == 200
    assert image.headers["content-type"] == "image/png"
    assert image.headers["x-content-type-options"] == "nosniff"
    assert image.content == png(0, 1)


def test_jpeg_is_served_as_jpeg(local_client) -> None:
    from tests.support.images import class_image, image_bytes

    jpeg = image_bytes(class_image(3, 3), "JPEG")
    item_id = local_client.post(
        "/gallery", files={"images": ("x.jpg", jpeg, "image/jpeg")}, data={"labels": "3"}
    ).json()["ids"][0]
    response = local_client.get(f"/gallery/{item_id}/image")
    assert response.headers["content-type"] == "image/jpeg"
    assert response.content == jpeg


def test_one_metadata_object_applies_to_every_image(local_client) -> None:
    files = [("images", (f"{i}.png", png(0, i), "image/png")) for i in range(2)]
    response = local_client.post(
        "/gallery", files=files, data={"labels": ["a", "b"], "metadata": '{"shop": "north"}'}
    )
    ids = response.json()["ids"]
    metadata = [local_client.get(f"/gallery/{i}").json()["metadata"] for i in ids]
    assert metadata == [{"shop": "north"}] * 2


def test_duplicate_bytes_return_the_existing_id(client) -> None:
    first = client.post("/gallery", files={"images": ("a.png", png(0, 0), "image/png")},
                        data={"labels": "0"}).json()
    again = client.post("/gallery", files={"images": ("b.png", png(0, 0), "image/png")},
                        data={"labels": "0"}).json()
    assert again["ids"] == first["ids"] and again["created"] == [False]
    assert client.get("/gallery").json()["count"] == 1


def test_delete_is_204_then_404_everywhere(client) -> None:
    ids = sorted(add_gallery(client, classes=1, per_class=2))
    assert client.delete(f"/gallery/{ids[0]}").status_code == 204
    assert client.get(f"/gallery/{ids[0]}").status_code == 404
    assert client.get(f"/gallery/{ids[0]}/image").status_code == 404
    assert client.delete(f"/gallery/{ids[0]}").status_code == 404
    assert client.get("/gallery").json()["count"] == 1


@pytest.mark.parametrize("path", ["/gallery/999", "/gallery/999/image"])
def test_unknown_ids_are_404_with_a_message(local_client, path) -> None:
    response = local_client.get(path)
    assert response.status_code == 404
    assert "999" in response.json()["detail"]


@pytest.mark.parametrize("item_id", ["0", "-3", "abc", str(2**70)])
def test_malformed_ids_are_422(local_client, item_id) -> None:
    assert local_client.get(f"/gallery/{item_id}").status_code == 422
    assert local_client.delete(f"/gallery/{item_id}").status_code == 422


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"labels": ["a"]}, "1 labels for 2 images"),
        ({"labels": ["a", "b", "c"]}, "3 labels for 2 images"),
        ({"labels": ["a", "b"], "cameras": ["1"]}, "1 cameras for 2 images"),
        ({"labels": ["a", ""]}, "labels[1]"),
        ({"labels": ["a", "b"], "metadata": ["{}", "{}", "{}"]}, "3 metadata fields"),
        ({"labels": ["a", "b"], "metadata": ["{]", "{}"]}, "metadata[0]: not valid JSON"),
        ({"labels": ["a", "b"], "metadata": ['"text"']}, "metadata[0]: expected a JSON object"),
    ],
)
def test_fields_that_do_not_line_up_are_422(local_client, data, message) -> None:
    files = [("images", (f"{i}.png", png(0, i), "image/png")) for i in range(2)]
    response = local_client.post("/gallery", files=files, data=data)
    assert response.status_code == 422
    assert message in response.json()["detail"]
    assert local_client.get("/gallery").json()["count"] == 0


def test_missing_fields_are_422(local_client) -> None:
    assert local_client.post("/gallery", data={"labels": "a"}).status_code == 422
    no_labels = local_client.post("/gallery", files={"images": ("a.png", png(0, 0), "image/png")})
    assert no_labels.status_code == 422


def test_one_bad_image_rejects_the_whole_upload(client) -> None:
    files = [("images", ("ok.png", png(0, 0), "image/png")),
             ("images", ("bad.png", png(0, 1)[:40], "image/png"))]
    response = client.post("/gallery", files=files, data={"labels": ["a", "b"]})
    assert response.status_code == 422
    assert response.json()["detail"].startswith("images[1]: ")
    assert client.get("/gallery").json()["count"] == 0
    assert client.get("/health").json()["index_size"] == 0


def test_api_key_guards_writes_and_evaluate_only(make_local_client) -> None:
    with make_local_client(api_key=API_KEY) as local_client:
        files = {"images": ("a.png", png(0, 0), "image/png")}
        assert local_client.post("/gallery", files=files, data={"labels": "a"}).status_code == 401
        wrong = local_client.post("/gallery", files=files, data={"labels": "a"},
                            headers={"X-API-Key": "nope"})
        assert wrong.status_code == 401
        assert wrong.json()["detail"] == "missing or wrong X-API-Key header"
        ok = local_client.post("/gallery", files=files, data={"labels": "a"},
                         headers={"X-API-Key": API_KEY})
        assert ok.status_code == 201
        item_id = ok.json()["ids"][0]

        assert local_client.delete(f"/gallery/{item_id}").status_code == 401
        assert local_client.post("/evaluate", json={"query_set": "x"}).status_code == 401
        # Reads and searches stay open.
        assert local_client.get(f"/gallery/{item_id}").status_code == 200
        assert search(local_client, png(0, 0)).status_code == 200
        assert local_client.delete(f"/gallery/{item_id}",
                             headers={"X-API-Key": API_KEY}).status_code == 204


def test_acknowledged_items_survive_a_restart(make_client) -> None:
    """The index is only in memory between saves: a new process replays SQL's change log."""
    with make_client() as client:
        ids = sorted(add_gallery(client, classes=2, per_class=2))
        assert client.delete(f"/gallery/{ids[0]}").status_code == 204
    # No index save happened after these writes (as after a crash): SQL has them.
    with make_client() as client:
        assert client.get("/health").json()["index_size"] == 3
        found = [hit["id"] for hit in search(client, png(0, 1), k=10).json()["results"]]
        assert sorted(found) == ids[1:]
