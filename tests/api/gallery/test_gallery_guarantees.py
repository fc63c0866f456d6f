"""What a 201 and a 204 promise, through the API (SQLite and PostgreSQL)."""

from __future__ import annotations

import time

from imgret.gallery.media.files import sha256_hex
from tests.api.conftest import png, search


def _upload(client, *images: tuple[bytes, str], **data):
    files = [("images", (f"{i}.png", image, "image/png")) for i, (image, _) in enumerate(images)]
    response = client.post("/gallery", files=files,
                           data={"labels": [label for _, label in images], **data})
    assert response.status_code == 201, response.text
    return response.json()


def test_an_upload_says_which_images_were_already_stored_and_as_what(client) -> None:
    first = _upload(client, (png(0, 0), "shoe"), metadata='{"shop": "a"}')
    again = _upload(client, (png(1, 0), "bag"), (png(0, 0), "boot"), (png(1, 0), "bag"),
                    metadata='{"shop": "b"}')
    assert [item["status"] for item in again["items"]] == ["created", "existing", "duplicate"]
    existing = again["items"][1]
    # The label and metadata sent with the existing bytes were not applied: the answer says
    # what is stored instead of dropping them silently.
    assert existing["id"] == first["ids"][0]
    assert (existing["label"], existing["metadata"]) == ("shoe", {"shop": "a"})
    assert again["items"][2]["id"] == again["items"][0]["id"] == again["ids"][2]
    assert client.get(f"/gallery/{first['ids'][0]}").json()["label"] == "shoe"


def test_a_delete_removes_the_image_bytes_from_disk(client, tmp_path) -> None:
    image = png(2, 0)
    (item_id,) = _upload(client, (image, "x"))["ids"]
    stored = tmp_path / "data" / "media" / sha256_hex(image)[:2] / sha256_hex(image)[2:4] \
        / sha256_hex(image)
    assert stored.is_file()
    response = client.get(f"/gallery/{item_id}/image")
    assert response.status_code == 200
    assert response.headers["cache-control"] == "private, no-store"
    assert client.delete(f"/gallery/{item_id}").status_code == 204
    assert not stored.exists()
    assert client.get(f"/gallery/{item_id}/image").status_code == 404
    assert item_id not in [hit["id"] for hit in search(client, image, k=5).json()["results"]]
    # The same bytes uploaded again: a new item (ids are never reused), bytes stored again.
    (new_id,) = _upload(client, (image, "x"))["ids"]
    assert new_id > item_id and stored.is_file()


def test_health_reports_the_follower_and_turns_degraded_when_it_is_stale(make_client) -> None:
    # No poll and no notification of the app's own follower during the test: it would find
    # the database well and overwrite the stale state set below (a race seen on PostgreSQL,
    # where the upload's NOTIFY wakes it). The test refreshes by hand instead.
    with make_client(follow_interval_s=3600, change_notify=False) as client:
        _health_turns_degraded_when_stale(client)


def _health_turns_degraded_when_stale(client) -> None:
    health = client.get("/health").json()
    assert health["status"] == "ok"
    assert health["follower_lag_s"] < 10 and health["follower_error"] is None
    _upload(client, (png(3, 0), "y"))
    client.app.state.resources.searcher.refresh_from_changes()  # what the follower does
    assert client.get("/health").json()["change_seq"] >= 1
    state = client.app.state.resources.follower
    state.last_ok_at = time.time() - 3600  # as if every poll had failed for an hour
    state.last_error = "OperationalError: the database is down"
    health = client.get("/health").json()
    assert health["status"] == "degraded"
    assert health["follower_lag_s"] >= 3600
    assert "database is down" in health["follower_error"]
    metrics = client.get("/metrics").text
    lag = [line for line in metrics.splitlines()
           if line.startswith("imgret_follower_lag_seconds ")]
    assert lag and float(lag[0].split()[1]) >= 3600
    assert "imgret_follower_applied_seq" in metrics
