"""/evaluate: the report equals metrics recomputed from /search rankings and from an exact
brute-force reference; named query sets, the re-ID rule, worst queries, version comparison."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint
from imgret.embedder import Embedder
from imgret.images import decode_image
from imgret.metrics import ranking_metrics, retrieval_metrics
from tests.api.conftest import add_gallery, png, search
from tests.support.images import write_image_folder, write_market_folder

SCALARS = ("map_at_r", "r_precision", "precision_at_1", "mean_average_precision", "mrr")
PER_K = ("recall_at_k", "map_at_k", "ndcg_at_k", "recall_fraction_at_k")


def _queries(classes: int, per_class: int, start: int = 100) -> tuple[list[bytes], list[str]]:
    pairs = [(c, start + i) for c in range(classes) for i in range(per_class)]
    return [png(c, i) for c, i in pairs], [str(c) for c, _ in pairs]


def _post_upload(client, images, labels, **data):
    files = [("images", (f"q{i}.png", image, "image/png")) for i, image in enumerate(images)]
    return client.post("/evaluate", files=files, data={"labels": labels, **data})


def _assert_same_metrics(report: dict, expected: dict) -> None:
    for name in SCALARS:
        assert report[name] == pytest.approx(expected[name], abs=1e-9), name
    for name in PER_K:
        got = {int(k): v for k, v in report[name].items()}
        assert got == pytest.approx(expected[name], abs=1e-9), name
    assert report["num_queries"] == expected["num_queries"]
    assert report["num_skipped"] == expected["num_skipped"]


def test_evaluate_equals_metrics_recomputed_from_search_rankings(client) -> None:
    add_gallery(client, classes=4, per_class=5)
    images, labels = _queries(classes=5, per_class=2)  # class 4 has no gallery item: skipped

    response = _post_upload(client, images, labels, k=["1", "3,5"])

    assert response.status_code == 200, response.text
    report = response.json()
    assert report["num_queries"] == 10 and report["num_skipped"] == 2
    assert report["k"] == [1, 3, 5]
    assert report["query_set"] is None
    assert report["model_version"] == client.get("/health").json()["model_version"]
    assert "closed-set" in report["protocol"]

    # The same queries through /search at the report's depth, scored independently.
    depth = report["depth"]
    counts = {c: client.get("/gallery", params={"label": c, "limit": 1}).json()["count"]
              for c in set(labels)}
    relevance = np.zeros((len(images), depth), dtype=bool)
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        hits = search(client, image, k=depth).json()["results"]
        relevance[i, : len(hits)] = [hit["label"] == label for hit in hits]
    expected = ranking_metrics(relevance, [counts[label] for label in labels], k=(1, 3, 5))

    _assert_same_metrics(report, expected)
    assert report["ci95"] == _json_keys(expected["ci95"])


def test_evaluate_matches_an_exact_brute_force_reference(client, tiny_checkpoint: Path) -> None:
    gallery = add_gallery(client, classes=4, per_class=5)
    images, labels = _queries(classes=4, per_class=3)
    report = _post_upload(client, images, labels, k="1,5,10").json()

    embedder = Embedder.from_checkpoint(tiny_checkpoint, device="cpu")
    ids = sorted(gallery)
    gallery_emb = embedder.embed([decode_image(client.get(f"/gallery/{i}/image").content)
                                  for i in ids])
    query_emb = embedder.embed([decode_image(image) for image in images])
    expected = retrieval_metrics(query_emb, np.array(labels),
                                 gallery_emb, np.array([str(gallery[i]) for i in ids]),
                                 k=(1, 5, 10))
    _assert_same_metrics(report, expected)
    assert report["num_truncated"] == 0


def test_named_query_set_and_worst_queries(client, tmp_path: Path) -> None:
    resources = client.app.state.resources
    _ingest_gallery(resources, write_image_folder(tmp_path / "g", classes=3, per_class=4))
    _ingest_query_set(resources, write_image_folder(tmp_path / "q", classes=3, per_class=2,
                                                    seed=7), "holdout")

    response = client.post("/evaluate", json={"query_set": "holdout", "k": [1, 2], "worst": 2})

    assert response.status_code == 200, response.text
    report = response.json()
    assert report["query_set"] == "holdout" and report["num_queries"] == 6
    worst = report["worst"]
    assert len(worst) == 2
    assert worst[0]["average_precision_at_r"] <= worst[1]["average_precision_at_r"]
    assert all(q["query_id"] is not None and q["neighbours"] for q in worst)
    for neighbour in worst[0]["neighbours"]:
        assert neighbour["relevant"] == (neighbour["label"] == worst[0]["label"])

    # One entry per query label, worst first, consistent with the overall numbers.
    per_label = report["per_label"]
    assert sorted(e["label"] for e in per_label) == ["class_0", "class_1", "class_2"]
    assert [e["map_at_r"] for e in per_label] == sorted(e["map_at_r"] for e in per_label)
    assert sum(e["count"] for e in per_label) == 6
    assert sum(e["count"] * e["map_at_r"] for e in per_label) / 6 == pytest.approx(
        report["map_at_r"])
    for entry in per_label:
        assert all(c["label"] != entry["label"] and c["count"] > 0
                   for c in entry["confusions"])

    # `imgret evaluate` runs the same code on the same database: the same report.
    from typer.testing import CliRunner

    from imgret.cli.main import app

    settings = resources.settings
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        app, ["evaluate", "--query-set", "holdout", "--k", "1,2", "--worst", "2",
              "--json", str(out)],
        env={"IMGRET_DATA_DIR": str(settings.data_dir), "IMGRET_DATABASE_URL": settings.db_url,
             "IMGRET_MODEL": str(settings.model), "IMGRET_DEVICE": "cpu"},
    )
    assert result.exit_code == 0, result.output
    assert "| map_at_r |" in result.output and "closed-set" in result.output
    assert "| label | queries | MAP@R | P@1 | top confusion |" in result.output
    assert json.loads(out.read_text()) == report


def test_exclude_same_camera_applies_the_reid_rule(client, tmp_path: Path,
                                                   tiny_checkpoint: Path) -> None:
    market = write_market_folder(tmp_path / "market", identities=6, cameras=3, per_camera=2)
    resources = client.app.state.resources
    _ingest_gallery(resources, market / "bounding_box_test")
    _ingest_query_set(resources, market / "query", "market-query")

    plain = client.post("/evaluate", json={"query_set": "market-query", "k": [1, 5]}).json()
    reid = client.post("/evaluate", json={"query_set": "market-query", "k": [1, 5],
                                          "exclude_same_camera": True}).json()
    assert "re-id" in reid["protocol"] and "closed-set" in plain["protocol"]

    # The reference: exact ranking with the Market-1501 camera rule.
    with resources.sessions() as session:
        from imgret.gallery.storage import query_set_store, vector_store
        from imgret.gallery.versions import version_store

        version = version_store.get_model_version(session=session)
        items, query_emb = query_set_store.load_query_set("market-query", session=session,
                                                          model_version=version)
        page = vector_store.fetch_vectors(resources.searcher.ids(), session=session,
                                          model_version=version)
    expected = retrieval_metrics(
        query_emb, np.array([q.label for q in items]), page.vectors,
        np.array([info.label for info in page.infos]), k=(1, 5),
        query_cameras=np.array([q.camera for q in items]),
        gallery_cameras=np.array([info.camera for info in page.infos]),
    )
    _assert_same_metrics(reid, expected)


def test_compare_two_model_versions_on_one_query_set(client, tmp_path: Path) -> None:
    folder = write_image_folder(tmp_path / "gallery", classes=3, per_class=4)
    queries = write_image_folder(tmp_path / "q", classes=3, per_class=3, seed=5)
    resources = client.app.state.resources
    from imgret.gallery.ingest import ingest_source

    _ingest_gallery(resources, folder)
    _ingest_query_set(resources, queries, "q")
    other = _other_embedder(tmp_path)
    ingest_source(folder, session_factory=resources.sessions, media=resources.media,
                  embedder=other, progress=False)
    _ingest_query_set(resources, queries, "q", embedder=other)

    only_b = client.post("/evaluate", json={"query_set": "q", "model_version": other.model_version})
    assert only_b.status_code == 200, only_b.text
    assert only_b.json()["model_version"] == other.model_version

    response = client.post("/evaluate", json={"query_set": "q", "compare_to": other.model_version})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["a"]["model_version"] == resources.embedder.model_version
    assert body["b"]["model_version"] == other.model_version
    diff = body["difference"]["map_at_r"]
    assert diff["difference"] == pytest.approx(body["b"]["map_at_r"] - body["a"]["map_at_r"])
    assert diff["ci95"][0] <= diff["difference"] <= diff["ci95"][1]
    assert diff["num_paired"] == 9
    # A verdict per metric (B relative to A), from its interval, also gathered at the top.
    for metric, entry in body["difference"].items():
        low, high = entry["ci95"]
        expected = "better" if low > 0 else "worse" if high < 0 else "no detectable difference"
        assert entry["verdict"] == body["verdict"][metric] == expected, metric
    assert set(body["verdict"]) == set(body["difference"]) >= {"map_at_r", "precision_at_1"}
    assert body["b_better"] == [m for m, v in body["verdict"].items() if v == "better"]
    assert body["a_better"] == [m for m, v in body["verdict"].items() if v == "worse"]
    assert body["a"]["per_label"] and body["b"]["per_label"]


@pytest.mark.parametrize(
    ("request_kwargs", "status", "message"),
    [
        ({"json": {"query_set": "nope"}}, 404, "unknown query set"),
        ({"json": {"query_set": "q", "model_version": "v-missing"}}, 404, "unknown model"),
        ({"json": {"query_set": "q", "k": [0]}}, 422, "k"),
        ({"json": {"query_set": "q", "surprise": 1}}, 422, "surprise"),
        ({"json": {"query_set": "q", "worst": 101}}, 422, "worst"),
        ({"json": {"query_set": "q", "compare": ["v1"]}}, 422, "at least 2"),
        ({"json": {"query_set": "q", "compare": ["v1", "v2", "v3"]}}, 422, "at most 2"),
        ({"json": {"query_set": "q", "compare": ["v1", "v1"]}}, 422, "two different"),
        ({"json": {"query_set": "q", "compare": ["v1", "v2"], "model_version": "v1"}}, 422,
         "without model_version"),
        ({"json": {"query_set": "q", "compare": ["v1", "v2"], "compare_to": "v2"}}, 422,
         "without model_version and compare_to"),
        ({"content": b"{oops", "headers": {"content-type": "application/json"}}, 422, "JSON"),
        ({"content": b"query_set=q",
          "headers": {"content-type": "application/x-www-form-urlencoded"}}, 415, "multipart"),
    ],
    ids=["unknown-set", "unknown-version", "k-zero", "extra-field", "worst-too-big",
         "compare-one", "compare-three", "compare-same", "compare-and-model-version",
         "compare-and-compare-to", "bad-json", "wrong-type"],
)
def test_bad_json_requests_are_4xx(local_client, request_kwargs, status, message) -> None:
    response = local_client.post("/evaluate", **request_kwargs)
    assert response.status_code == status, response.text
    assert message in str(response.json()["detail"])


def test_bad_uploads_are_422(local_client) -> None:
    add_gallery(local_client, classes=2, per_class=2)
    images, labels = _queries(classes=2, per_class=1)
    cases = [
        (dict(labels=labels[:1]), "1 labels for 2 images"),
        (dict(labels=labels, cameras=["1"]), "1 cameras for 2 images"),
        (dict(labels=labels, k="1,9"), "gallery size (4)"),
        (dict(labels=labels, k="x"), "not an integer"),
        (dict(labels=labels, exclude_same_camera="true"), "needs a camera"),
        (dict(labels=labels, compare="v2"), "two different model versions"),
        (dict(labels=labels, unknown="1"), "unknown fields"),
        (dict(labels=["9", "8"]), "no query has a relevant"),
    ]
    for data, message in cases:
        response = _post_upload(local_client, images, **data)
        assert response.status_code == 422, (data, response.text)
        assert message in response.json()["detail"], data
    unknown_version = _post_upload(local_client, images, labels, model_version="v2")
    assert unknown_version.status_code == 404, unknown_version.text
    bad_image = _post_upload(local_client, [images[0], b"junk"], labels)
    assert bad_image.status_code == 422
    assert bad_image.json()["detail"].startswith("images[1]: ")


def test_empty_gallery_is_422(local_client) -> None:
    images, labels = _queries(classes=1, per_class=1)
    response = _post_upload(local_client, images, labels)
    assert response.status_code == 422
    assert "gallery is empty" in response.json()["detail"]


# --------------------------------------------------------------------------- helpers


def _ingest_gallery(resources, folder: Path) -> None:
    """Bulk ingest into the app's database, then let its index catch up (as replicas do)."""
    from imgret.gallery.ingest import ingest_source

    ingest_source(folder, session_factory=resources.sessions, media=resources.media,
                  embedder=resources.embedder, progress=False)
    resources.searcher.refresh_from_changes()


def _ingest_query_set(resources, folder: Path, name: str, embedder=None) -> None:
    from imgret.gallery.ingest import ingest_source

    ingest_source(folder, session_factory=resources.sessions, media=resources.media,
                  embedder=embedder or resources.embedder, query_set=name, progress=False)


def _other_embedder(tmp_path: Path) -> Embedder:
    import torch

    torch.manual_seed(1)
    run = tmp_path / "other_run"
    save_checkpoint(run, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)))
    return Embedder.from_checkpoint(run, device="cpu")


def _json_keys(value):
    """What JSON does to a report: int dict keys become strings."""
    if isinstance(value, dict):
        return {str(k): _json_keys(v) for k, v in value.items()}
    return value


def test_small_evaluations_rank_the_whole_gallery_so_map_is_exact(client) -> None:
    gallery = add_gallery(client, classes=3, per_class=6)
    images, labels = _queries(classes=3, per_class=2)

    report = _post_upload(client, images, labels, k="1").json()

    assert report["depth"] == len(gallery)
    assert report["num_truncated"] == 0
    assert 0.0 < report["mean_average_precision"] <= 1.0


def test_request_versions_compare_or_compare_to() -> None:
    from imgret.service.schemas.evaluation import EvaluateRequest

    def versions(**body):
        return EvaluateRequest.model_validate({"query_set": "q", **body}).versions("served")

    assert versions() == ("served", None)
    assert versions(model_version="a") == ("a", None)
    assert versions(compare_to="b") == ("served", "b")
    assert versions(model_version="a", compare_to="b") == ("a", "b")
    assert versions(compare=["a", "b"]) == ("a", "b")
