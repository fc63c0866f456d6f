"""Re-ranking through the API: /search by id and by uploaded image, /evaluate (upload, named
set, plain against re-ranked), and the 422s of bad options."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from imgret.embedder import Embedder
from imgret.gallery.search.rerank import KReciprocal, QueryExpansion
from imgret.gallery.storage import vector_store
from imgret.gallery.versions import version_store
from imgret.images import decode_image
from imgret.metrics import ranking_metrics
from tests.api.conftest import add_gallery, png, search
from tests.support.images import write_image_folder
from tests.unit.gallery.test_rerank import reference_one_query


def _vectors(client, ids: list[int]) -> np.ndarray:
    resources = client.app.state.resources
    with resources.sessions() as session:
        version = version_store.get_model_version(session=session)
        page = vector_store.fetch_vectors(ids, session=session, model_version=version)
    assert page.ids.tolist() == ids
    return page.vectors


def test_search_by_id_with_k_reciprocal_equals_the_full_matrix_reference(client) -> None:
    gallery = add_gallery(client, classes=3, per_class=5)
    ids = sorted(gallery)
    query_id, others = ids[0], ids[1:]
    response = client.post("/search", data={"id": str(query_id), "k": "14",
                                            "rerank": "k_reciprocal", "rerank_k1": "6",
                                            "rerank_k2": "3"})
    assert response.status_code == 200, response.text
    hits = response.json()["results"]

    vectors = _vectors(client, ids)
    want = reference_one_query(vectors[0], vectors[1:], k1=6, k2=3, lambda_value=0.3)
    order = np.argsort(want, kind="stable")
    assert [hit["id"] for hit in hits] == [others[i] for i in order]
    np.testing.assert_allclose([1 - hit["score"] for hit in hits], want[order], atol=1e-6)
    assert all(hit["label"] == str(gallery[hit["id"]]) for hit in hits)


def test_search_by_id_with_query_expansion(client) -> None:
    gallery = add_gallery(client, classes=3, per_class=4)
    ids = sorted(gallery)
    response = client.post("/search", data={"id": str(ids[0]), "k": "5",
                                            "rerank": "query_expansion", "rerank_top_m": "2"})
    assert response.status_code == 200, response.text
    hits = response.json()["results"]
    vectors = _vectors(client, ids)
    query, rest = vectors[0].astype(np.float64), vectors[1:].astype(np.float64)
    top = np.argsort(-(rest @ query), kind="stable")[:2]
    expanded = query + rest[top].sum(axis=0)
    expanded /= np.linalg.norm(expanded)
    order = np.argsort(-(rest @ expanded), kind="stable")[:5]
    assert [hit["id"] for hit in hits] == [ids[1:][i] for i in order]


def test_search_by_uploaded_image_with_rerank(client) -> None:
    add_gallery(client, classes=3, per_class=4)
    response = search(client, png(1, 50), k=5, rerank="k_reciprocal")
    assert response.status_code == 200, response.text
    hits = response.json()["results"]
    resources = client.app.state.resources
    query = resources.embedder.embed([decode_image(png(1, 50))])
    want = resources.searcher.search(query, 5, rerank=KReciprocal())[0]
    assert [hit["id"] for hit in hits] == [h.id for h in want]
    np.testing.assert_allclose([hit["score"] for hit in hits], [h.score for h in want],
                               atol=1e-6)
    # Re-ranked, not plain: k-reciprocal scores are 1 - its final distance, not cosines.
    plain = resources.searcher.search(query, 5)[0]
    assert not np.allclose([h.score for h in want], [h.score for h in plain], atol=1e-3)


def test_evaluate_upload_ranks_with_the_reranked_search(client, tiny_checkpoint: Path) -> None:
    add_gallery(client, classes=4, per_class=5)
    pairs = [(c, 100 + i) for c in range(4) for i in range(3)]
    images, labels = [png(c, i) for c, i in pairs], [str(c) for c, _ in pairs]
    files = [("images", (f"q{i}.png", image, "image/png")) for i, image in enumerate(images)]
    response = client.post("/evaluate", files=files, data={
        "labels": labels, "k": "1,5", "rerank": "query_expansion", "rerank_top_m": "3"})
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["rerank"] == {"method": "query_expansion", "top_m": 3, "alpha": 0.0}
    assert "re-ranked by query_expansion" in report["protocol"]

    # The same queries through the Searcher's re-ranked search, scored independently.
    embedder = Embedder.from_checkpoint(tiny_checkpoint, device="cpu")
    searcher = client.app.state.resources.searcher
    rows = searcher.search(embedder.embed([decode_image(i) for i in images]), report["depth"],
                           rerank=QueryExpansion(top_m=3))
    relevance = np.array([[searcher.info(h.id).label == label for h in row]
                          for row, label in zip(rows, labels, strict=True)])
    expected = ranking_metrics(relevance, [5] * len(labels), k=(1, 5))
    for name in ("map_at_r", "mean_average_precision", "precision_at_1"):
        assert report[name] == pytest.approx(expected[name], abs=1e-9)


def test_named_set_plain_against_reranked_is_paired_and_not_recorded(client,
                                                                      tmp_path: Path) -> None:
    from imgret.gallery.ingest import ingest_source

    resources = client.app.state.resources
    common = dict(session_factory=resources.sessions, media=resources.media,
                  embedder=resources.embedder, progress=False)
    ingest_source(write_image_folder(tmp_path / "g", classes=4, per_class=6), **common)
    resources.searcher.refresh_from_changes()
    ingest_source(write_image_folder(tmp_path / "q", classes=4, per_class=3, seed=5),
                  query_set="held", **common)

    response = client.post("/evaluate", json={"query_set": "held", "rerank": "k_reciprocal",
                                              "rerank_k1": 5, "rerank_compare": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["a"]["rerank"] is None
    assert body["b"]["rerank"] == {"method": "k_reciprocal", "k1": 5, "k2": 6,
                                   "lambda_value": 0.3, "candidates": 100}
    diff = body["difference"]["map_at_r"]
    assert diff["difference"] == pytest.approx(body["b"]["map_at_r"] - body["a"]["map_at_r"])
    assert diff["num_paired"] == 12

    alone = client.post("/evaluate", json={"query_set": "held", "rerank": "k_reciprocal",
                                           "rerank_k1": 5}).json()
    assert alone["map_at_r"] == body["b"]["map_at_r"]
    # Only the plain evaluation is the version's last evaluation.
    version = body["a"]["model_version"]
    last = client.get(f"/models/{version}").json()["last_evaluation"]
    assert last["map_at_r"] == body["a"]["map_at_r"]


@pytest.mark.parametrize(("data", "message"), [
    ({"rerank": "bogus"}, "rerank: Input should be 'k_reciprocal' or 'query_expansion'"),
    ({"rerank": "k_reciprocal", "rerank_k1": "0"}, "rerank_k1: Input should be greater"),
    ({"rerank": "k_reciprocal", "rerank_lambda": "1.5"}, "rerank_lambda: Input should be less"),
    ({"rerank": "k_reciprocal", "rerank_lambda": "nan"}, "rerank_lambda"),
    ({"rerank": "k_reciprocal", "rerank_candidates": "1001"}, "rerank_candidates"),
    ({"rerank": "k_reciprocal", "rerank_top_m": "3"},
     "rerank_top_m: a parameter of rerank=query_expansion"),
    ({"rerank": "query_expansion", "rerank_alpha": "11"}, "rerank_alpha"),
    ({"rerank_k1": "5"}, "re-ranking parameters need rerank="),
    ({"rerank": "k_reciprocal", "rerank_k1": "abc"}, "rerank_k1"),
])
def test_bad_rerank_options_are_422_with_a_message(local_client, data, message) -> None:
    for response in (
        search(local_client, png(0, 0), **data),
        local_client.post("/search", data={"id": "1", **data}),
        local_client.post("/evaluate", files=[("images", ("q.png", png(0, 0), "image/png"))],
                          data={"labels": ["0"], **data}),
    ):
        assert response.status_code == 422, response.text
        assert message in str(response.json()["detail"]), response.text


@pytest.mark.parametrize(("body", "message"), [
    ({"rerank": "bogus"}, "Input should be 'k_reciprocal' or 'query_expansion'"),
    ({"rerank": "k_reciprocal", "rerank_k2": 0}, "greater than or equal to 1"),
    ({"rerank_alpha": 1.0}, "re-ranking parameters need rerank="),
    ({"rerank_compare": True}, "rerank_compare needs rerank"),
    ({"rerank": "k_reciprocal", "rerank_compare": True, "compare_to": "v"},
     "send it without compare and compare_to"),
])
def test_bad_rerank_json_is_422(local_client, body, message) -> None:
    response = local_client.post("/evaluate", json={"query_set": "q", **body})
    assert response.status_code == 422, response.text
    assert message in response.text


def test_repeated_rerank_field_is_422(local_client) -> None:
    response = search(local_client, png(0, 0), rerank=["k_reciprocal", "query_expansion"])
    assert response.status_code == 422
    assert "rerank was sent more than once" in response.json()["detail"]
