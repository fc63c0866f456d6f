"""POST /models/{v}/calibrate and `imgret models calibrate`: the threshold is /evaluate's at the
target FPIR, kept with the version (GET /models/{v}), served by /search and /identify; every
refusal is a 4xx with a message, on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from imgret.gallery.storage import query_set_store
from imgret.gallery.storage.tables import QuerySet
from tests.api.conftest import search
from tests.support.images import class_image, image_bytes, write_image_folder

TARGET = 0.25


def _ingest(resources, folder: Path, query_set: str | None = None) -> None:
    from imgret.gallery.ingest import ingest_source

    ingest_source(folder, session_factory=resources.sessions, media=resources.media,
                  embedder=resources.embedder, query_set=query_set, progress=False)
    resources.searcher.refresh_from_changes()


def _gallery_and_calibration_set(client, tmp_path: Path) -> str:
    """Gallery: classes 0-3; query set "cal": classes 0-7 (4-7: 12 non-mated queries)."""
    resources = client.app.state.resources
    _ingest(resources, write_image_folder(tmp_path / "g", classes=4, per_class=5))
    _ingest(resources, write_image_folder(tmp_path / "q", classes=8, per_class=3, seed=7), "cal")
    return client.get("/health").json()["model_version"]


def _png(label: int, index: int, seed: int = 0) -> bytes:
    return image_bytes(class_image(label, index, seed=seed))


def _identify(client, image: bytes):
    return client.post("/identify", files={"image": ("q.png", image, "image/png")})


def test_calibrate_keeps_the_threshold_with_the_version_and_serves_it(client, tmp_path) -> None:
    version = _gallery_and_calibration_set(client, tmp_path)
    resources = client.app.state.resources

    # Before: no calibration, no decisions, and each answer says so.
    info = client.get(f"/models/{version}").json()
    assert info["calibration"] is None and info["decisions"].startswith("none:")
    plain = search(client, _png(1, 300), k="3").json()
    assert plain["decision"] is None and "no calibration" in plain["decision_note"]
    refused = _identify(client, _png(1, 300))
    assert refused.status_code == 409 and "calibrate" in refused.json()["detail"]

    response = client.post(f"/models/{version}/calibrate",
                           json={"query_set": "cal", "target_fpir": TARGET})

    assert response.status_code == 200, response.text
    calibration = response.json()
    # The threshold is /evaluate's at the same target on the same set (the same path).
    point = client.post("/evaluate", json={"query_set": "cal", "fpirs": [TARGET]}).json()[
        "open_set"]["operating_points"][0]
    assert calibration["threshold"] == point["threshold"]["value"]
    assert calibration["threshold_ci95"] == point["threshold"]["ci95"]
    assert calibration["fpir"] == point["fpir_measured"]["value"] <= TARGET
    assert calibration["fnir"] == point["fnir"]["value"]
    assert calibration["details"]["non_mated"] == 12 and calibration["rerank"] is None
    with resources.sessions() as session:
        items, _ = query_set_store.load_query_set("cal", session=session)
    digest = hashlib.sha256(b"".join(json.dumps([i.id, i.sha256, i.label]).encode() + b"\n"
                                     for i in sorted(items, key=lambda i: i.id)))
    assert calibration["query_set_sha256"] == digest.hexdigest()
    shown = client.get(f"/models/{version}").json()
    assert shown["calibration"] == calibration
    assert f"{calibration['threshold']:.6g}" in shown["decisions"]

    # Served at once: the top result decides, at this threshold.
    assert calibration["details"]["score"] == "template"
    threshold = calibration["threshold"]
    for image in (_png(1, 300), _png(6, 300), _png(2, 5)):
        answer = search(client, image, k="3").json()
        # Decided on the top identity's template score (docs/identities.md), as grouped
        # search scores it.
        top = search(client, image, k="1", group_by="label").json()["identities"][0]
        assert answer["decision"] == {
            "label": top["label"] if top["score"] >= threshold else None,
            "score": top["score"], "threshold": threshold, "known": top["score"] >= threshold}
        identified = _identify(client, image).json()
        assert identified["threshold"] == threshold
        assert identified["score"] == pytest.approx(top["score"], abs=1e-6)
        assert identified["label"] == (top["label"] if identified["known"] else "unknown")
        assert identified["margin"] == pytest.approx(identified["score"] - threshold)
    # A gallery image is its own best match: known, by its own label.
    assert _identify(client, _png(2, 0, seed=0)).json()["known"] is True
    # Re-ranked scores are on another scale: no decision, and why.
    reranked = search(client, _png(1, 300), k="3", rerank="query_expansion").json()
    assert reranked["decision"] is None and "plain search" in reranked["decision_note"]
    batch = client.post("/search/batch", data={"k": "2"}, files=[
        ("images", ("a.png", _png(1, 300), "image/png")),
        ("images", ("b.png", _png(6, 300), "image/png"))]).json()
    assert [d["threshold"] for d in batch["decisions"]] == [threshold, threshold]

    # Again at another target: a newer calibration, served from now on; the CLI is the same
    # function (same set, same target: the same threshold).
    newer = client.post(f"/models/{version}/calibrate",
                        json={"query_set": "cal", "target_fpir": 0.5}).json()
    assert newer["id"] > calibration["id"] and newer["threshold"] <= threshold
    assert search(client, _png(1, 300)).json()["decision"]["threshold"] == newer["threshold"]
    from typer.testing import CliRunner

    from imgret.cli.main import app

    settings = resources.settings
    result = CliRunner().invoke(
        app, ["models", "calibrate", version, "--query-set", "cal", "--fpir", str(TARGET),
              "--json"],
        env={"IMGRET_DATA_DIR": str(settings.data_dir), "IMGRET_DATABASE_URL": settings.db_url,
             "IMGRET_DEVICE": "cpu"})
    assert result.exit_code == 0, result.output
    by_cli = json.loads(result.output)
    assert by_cli["id"] > newer["id"] and by_cli["threshold"] == threshold
    resources.follow_active()  # as the follower does within its interval
    assert search(client, _png(1, 300)).json()["decision"]["threshold"] == threshold


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"query_set": "cal", "target_fpir": 0}, 422, "greater than 0"),
    ({"query_set": "cal", "target_fpir": 1}, 422, "less than 1"),
    ({"query_set": "cal", "target_fpir": 1.5}, 422, "less than 1"),
    ({"query_set": "cal"}, 422, "target_fpir"),
    ({"query_set": "nope", "target_fpir": 0.1}, 404, "unknown query set 'nope'"),
    ({"query_set": "empty", "target_fpir": 0.1}, 422, "is empty"),
    ({"query_set": "closed", "target_fpir": 0.1}, 422, "0 non-mated"),
    ({"query_set": "cal", "target_fpir": 0.01}, 422, "needs >= 100 non-mated searches, has 12"),
])
def test_bad_calibrations_are_refused_with_a_message(client, tmp_path, body, status,
                                                     message) -> None:
    version = _gallery_and_calibration_set(client, tmp_path)
    resources = client.app.state.resources
    _ingest(resources, write_image_folder(tmp_path / "c", classes=4, per_class=2, seed=3),
            "closed")
    with resources.sessions.begin() as session:
        session.add(QuerySet(name="empty"))

    response = client.post(f"/models/{version}/calibrate", json=body)

    assert response.status_code == status, response.text
    assert message in json.dumps(response.json()["detail"])
    assert client.get(f"/models/{version}").json()["calibration"] is None


def test_an_unknown_version_is_404(local_client) -> None:
    response = local_client.post("/models/nope-d16-000000000000/calibrate",
                                 json={"query_set": "cal", "target_fpir": 0.1})
    assert response.status_code == 404 and "unknown model version" in response.json()["detail"]
