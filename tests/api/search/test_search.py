"""/search and /search/batch through TestClient, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from tests.api.conftest import add_gallery, png, search


def test_search_returns_k_neighbours_best_first_with_their_rows(client) -> None:
    classes = add_gallery(client, classes=3, per_class=4)

    response = search(client, png(1, 99), k=5)

    assert response.status_code == 200, response.text
    body = response.json()
    results = body["results"]
    assert len(results) == 5
    scores = [hit["score"] for hit in results]
    assert scores == sorted(scores, reverse=True)
    # Same-class images are the nearest (generated classes are easy even untrained).
    assert [hit["label"] for hit in results[:4]] == ["1"] * 4
    for hit in results:
        assert hit["label"] == str(classes[hit["id"]])
        assert hit["uri"] == f"/gallery/{hit['id']}/image"
    assert body["model_version"] == client.get("/health").json()["model_version"]
    assert body["took_ms"] > 0


def test_k_defaults_to_10_and_is_accepted_in_the_query_string(local_client) -> None:
    add_gallery(local_client, classes=3, per_class=4)
    assert len(search(local_client, png(0, 50)).json()["results"]) == 10
    response = local_client.post(
        "/search?k=3", files={"image": ("q.png", png(0, 50), "image/png")}
    )
    assert len(response.json()["results"]) == 3


def test_label_camera_and_metadata_filters_return_exactly_k_matches(client) -> None:
    add_gallery(client, classes=3, per_class=6, cameras=True, metadata=True)

    by_label = search(client, png(0, 70), k=4, label="2").json()["results"]
    assert len(by_label) == 4 and {h["label"] for h in by_label} == {"2"}

    by_camera = search(client, png(0, 70), k=5, camera=2).json()["results"]
    assert len(by_camera) == 5 and {h["camera"] for h in by_camera} == {2}

    by_meta = search(client, png(0, 70), k=7, metadata='{"parity": "odd"}').json()["results"]
    assert len(by_meta) == 7 and {h["metadata"]["parity"] for h in by_meta} == {"odd"}

    nothing = search(client, png(0, 70), k=5, label="no-such-label").json()["results"]
    assert nothing == []


def test_batch_search_answers_in_request_order(client) -> None:
    add_gallery(client, classes=3, per_class=4)
    files = [("images", (f"q{c}.png", png(c, 80), "image/png")) for c in (2, 0, 1)]

    response = client.post("/search/batch", files=files, data={"k": 2})

    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [[hit["label"] for hit in row] for row in results] == [["2"] * 2, ["0"] * 2, ["1"] * 2]


def test_batch_search_names_the_bad_image(local_client) -> None:
    add_gallery(local_client, classes=2, per_class=2)
    files = [("images", ("ok.png", png(0, 1), "image/png")),
             ("images", ("bad.png", b"not an image", "image/png"))]
    response = local_client.post("/search/batch", files=files)
    assert response.status_code == 422
    assert response.json()["detail"].startswith("images[1]: ")


def test_an_added_item_is_searchable_at_once_and_a_deleted_one_never_returns(client) -> None:
    add_gallery(client, classes=2, per_class=3)
    query = png(7, 1)
    added = client.post(
        "/gallery", files={"images": ("new.png", query, "image/png")}, data={"labels": "seven"}
    ).json()["ids"][0]

    first = search(client, query, k=1).json()["results"][0]
    assert first["id"] == added and first["label"] == "seven"
    assert first["score"] == pytest.approx(1.0, abs=1e-4)  # the same image

    assert client.delete(f"/gallery/{added}").status_code == 204
    ids = [hit["id"] for hit in search(client, query, k=100).json()["results"]]
    assert added not in ids and len(ids) == 6


def test_empty_gallery_gives_empty_results(local_client) -> None:
    response = search(local_client, png(0, 0), k=5)
    assert response.status_code == 200
    assert response.json()["results"] == []


@pytest.mark.parametrize("k", [0, -1, 1001, "ten"])
def test_k_out_of_range_is_422(local_client, k) -> None:
    response = search(local_client, png(0, 0), k=k)
    assert response.status_code == 422
    assert "k" in str(response.json()["detail"])


def test_conflicting_k_in_form_and_query_is_422(local_client) -> None:
    response = local_client.post(
        "/search?k=3", files={"image": ("q.png", png(0, 0), "image/png")}, data={"k": 4}
    )
    assert response.status_code == 422


def test_repeated_or_missing_image_is_422(local_client) -> None:
    two = [("image", (f"{i}.png", png(0, i), "image/png")) for i in range(2)]
    response = local_client.post("/search", files=two)
    assert response.status_code == 422
    assert "exactly one" in response.json()["detail"]

    missing = local_client.post("/search", data={"k": 3})
    assert missing.status_code == 422


def test_bad_metadata_filter_is_422(local_client) -> None:
    assert search(local_client, png(0, 0), metadata="{not json").status_code == 422
    assert search(local_client, png(0, 0), metadata="[1, 2]").status_code == 422
