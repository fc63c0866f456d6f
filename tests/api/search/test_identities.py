"""/search with group_by=label: the top k identities, on SQLite and PostgreSQL."""

from __future__ import annotations

import numpy as np
import pytest

from tests.api.conftest import add_gallery, png, search


def _stored_vectors(client, ids: list[int]) -> np.ndarray:
    searcher = client.app.state.resources.searcher
    return searcher._live.vectors(np.asarray(ids, dtype=np.int64))


def test_grouped_search_returns_k_distinct_identities_scored_by_their_templates(
        client) -> None:
    classes = add_gallery(client, classes=4, per_class=5)

    response = search(client, png(2, 99), k=3, group_by="label", per_identity=2)

    assert response.status_code == 200, response.text
    body = response.json()
    identities = body["identities"]
    assert len(identities) == 3
    labels = [identity["label"] for identity in identities]
    assert len(set(labels)) == 3 and labels[0] == "2"
    scores = [identity["score"] for identity in identities]
    assert scores == sorted(scores, reverse=True)
    for identity in identities:
        items = identity["items"]
        assert 1 <= len(items) <= 2
        assert {item["label"] for item in items} == {identity["label"]}
        assert [i["score"] for i in items] == sorted((i["score"] for i in items), reverse=True)
        assert -1 - 1e-6 <= identity["score"] <= 1 + 1e-6  # a cosine with a unit template
        assert all(classes[item["id"]] == int(identity["label"]) for item in items)
    # results: the identities' items, in identity order.
    assert [hit["id"] for hit in body["results"]] == [
        item["id"] for identity in identities for item in identity["items"]]


def test_each_aggregation_agrees_with_the_items_it_lists(client) -> None:
    add_gallery(client, classes=3, per_class=4)
    best = search(client, png(1, 50), k=3, group_by="label", aggregation="best",
                  per_identity=4).json()["identities"]
    for identity in best:
        assert identity["score"] == pytest.approx(identity["items"][0]["score"], abs=1e-6)
    mean = search(client, png(1, 50), k=3, group_by="label", aggregation="mean_top2",
                  per_identity=4).json()["identities"]
    for identity in mean:
        top2 = [item["score"] for item in identity["items"][:2]]
        assert identity["score"] == pytest.approx(sum(top2) / len(top2), abs=1e-6)
    # Per-item search ranks the same best identity first.
    items = search(client, png(1, 50), k=1).json()["results"]
    assert best[0]["label"] == items[0]["label"]


def test_template_scores_match_the_stored_vectors(local_client) -> None:
    classes = add_gallery(local_client, classes=3, per_class=3)
    query_id = next(iter(classes))
    body = local_client.post("/search", data={"id": query_id, "group_by": "label",
                                              "k": 3}).json()
    query = _stored_vectors(local_client, [query_id])[0]
    for identity in body["identities"]:
        # The query item itself is left out of its identity's template, as of the results.
        members = [i for i, c in classes.items()
                   if str(c) == identity["label"] and i != query_id]
        template = _stored_vectors(local_client, members).astype(np.float64).mean(axis=0)
        expected = float(query @ template / np.linalg.norm(template))
        assert identity["score"] == pytest.approx(expected, abs=1e-5)
        assert query_id not in {item["id"] for item in identity["items"]}


def test_a_label_filter_and_a_collection_keep_grouping_inside_them(client) -> None:
    add_gallery(client, classes=3, per_class=3)
    only = search(client, png(0, 9), k=3, group_by="label", label="1").json()["identities"]
    assert [identity["label"] for identity in only] == ["1"]

    assert client.post("/collections", json={"name": "other"}).status_code == 201
    files = [("images", (f"o{i}.png", png(0, 200 + i), "image/png")) for i in range(3)]
    assert client.post("/collections/other/gallery", files=files,
                       data={"labels": ["elsewhere"] * 3}).status_code == 201
    default = search(client, png(0, 9), k=10, group_by="label").json()["identities"]
    assert {identity["label"] for identity in default} == {"0", "1", "2"}
    other = client.post("/collections/other/search", data={"group_by": "label", "k": 5},
                        files={"image": ("q.png", png(0, 9), "image/png")}).json()
    assert [identity["label"] for identity in other["identities"]] == ["elsewhere"]
    assert all(item["uri"].startswith("/collections/other/")
               for item in other["identities"][0]["items"])


def test_batch_search_groups_each_query(local_client) -> None:
    add_gallery(local_client, classes=3, per_class=3)
    files = [("images", (f"q{c}.png", png(c, 80), "image/png")) for c in (2, 0)]
    body = local_client.post("/search/batch", files=files,
                             data={"k": 2, "group_by": "label"}).json()
    assert [row[0]["label"] for row in body["identities"]] == ["2", "0"]
    assert all(len(row) == 2 for row in body["identities"])


@pytest.mark.parametrize("data", [
    {"group_by": "person"},
    {"group_by": "label", "aggregation": "median"},
    {"group_by": "label", "aggregation": "mean_top0"},
    {"group_by": "label", "per_identity": 0},
    {"group_by": "label", "per_identity": 21},
    {"per_identity": 2},
    {"aggregation": "best"},
    {"group_by": "label", "rerank": "k_reciprocal"},
])
def test_bad_grouping_options_get_422_with_a_message(local_client, data) -> None:
    add_gallery(local_client, classes=2, per_class=2)
    response = search(local_client, png(0, 1), **data)
    assert response.status_code == 422, response.text
    assert response.json()["detail"]
