"""/identities on SQLite and PostgreSQL: labels and counts, merge, move (split), the audit log,
undo, erase with its receipt, and the refusals that change nothing."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import select

from imgret.gallery.media.files import sha256_hex
from imgret.gallery.storage.tables import GalleryItem, LabelChange
from tests.api.conftest import API_KEY, add_gallery, png, search
from tests.api.gallery.test_delete_personal_data import _backup, _found_in

KEYED = {"X-API-Key": API_KEY}


def _labels(client, prefix: str = "") -> dict[str, int]:
    body = client.get(f"{prefix}/identities").json()
    return {row["label"]: row["items"] for row in body["data"]}


def _ids_of(classes: dict[int, int], label: int) -> list[int]:
    return sorted(i for i, c in classes.items() if c == label)


def _every_hit(client, prefix: str = "") -> dict[int, str]:
    response = client.post(f"{prefix}/search", data={"k": 100},
                           files={"image": ("q.png", png(0, 1), "image/png")})
    assert response.status_code == 200, response.text
    return {hit["id"]: hit["label"] for hit in response.json()["results"]}


def test_merge_moves_every_item_and_undo_brings_them_back(client) -> None:
    classes = add_gallery(client, classes=3, per_class=3)
    zeros = _ids_of(classes, 0)

    merged = client.post("/identities/merge", json={"source": "0", "target": "1"})

    assert merged.status_code == 200, merged.text
    change = merged.json()
    assert change["action"] == "merge" and change["actor"] == "local"
    assert (change["from_label"], change["to_label"]) == ("0", "1")
    assert sorted(m["old_id"] for m in change["moves"]) == zeros
    new_ids = [m["new_id"] for m in change["moves"]]
    assert not set(new_ids) & set(classes)
    assert _labels(client) == {"1": 6, "2": 3}
    hits = _every_hit(client)
    assert not set(zeros) & set(hits)
    assert all(hits[i] == "1" for i in new_ids)
    for old, new in zip(zeros, new_ids, strict=True):
        assert client.get(f"/gallery/{old}").status_code == 404
        assert client.get(f"/gallery/{new}").json()["label"] == "1"
        assert client.get(f"/gallery/{new}/image").content == png(0, zeros.index(old))

    undone = client.post(f"/identities/changes/{change['id']}/undo")

    assert undone.status_code == 200, undone.text
    assert undone.json()["undo_of"] == change["id"]
    assert {m["old_id"] for m in undone.json()["moves"]} == set(new_ids)
    assert _labels(client) == {"0": 3, "1": 3, "2": 3}
    log = client.get("/identities/changes").json()
    assert [entry["action"] for entry in log["data"]] == ["undo", "merge"]
    assert log["data"][1]["undone_by"] == undone.json()["id"]
    again = client.post(f"/identities/changes/{change['id']}/undo")
    assert again.status_code == 409 and "undone" in again.json()["detail"]
    assert _labels(client) == {"0": 3, "1": 3, "2": 3}


def test_move_splits_items_off_and_an_unknown_id_changes_nothing(client) -> None:
    classes = add_gallery(client, classes=2, per_class=4)
    ones = _ids_of(classes, 1)

    bad = client.post("/identities/move", json={"ids": [ones[0], 10**9], "label": "1b"})
    assert bad.status_code == 404 and str(10**9) in bad.json()["detail"]
    assert _labels(client) == {"0": 4, "1": 4}

    moved = client.post("/identities/move", json={"ids": ones[:2], "label": "1b"})

    assert moved.status_code == 200, moved.text
    assert _labels(client) == {"0": 4, "1": 2, "1b": 2}
    assert {m["old_label"] for m in moved.json()["moves"]} == {"1"}
    one = client.get(f"/identities/changes/{moved.json()['id']}").json()
    assert one == moved.json()
    # Split items are found under their new label (a label filter sees them at once).
    found = search(client, png(1, 0), k=5, label="1b").json()["results"]
    assert {hit["id"] for hit in found} == {m["new_id"] for m in moved.json()["moves"]}


def test_another_collections_items_and_changes_are_out_of_reach(client) -> None:
    classes = add_gallery(client, classes=2, per_class=2)
    assert client.post("/collections", json={"name": "shop"}).status_code == 201
    other = client.post("/collections/shop/gallery", data={"labels": ["x", "x"]},
                        files=[("images", (f"{i}.png", png(3, i), "image/png"))
                               for i in range(2)]).json()["ids"]
    # The default collection's ids are not the shop's, and its labels are not either.
    assert client.post("/collections/shop/identities/move",
                       json={"ids": list(classes)[:1], "label": "y"}).status_code == 404
    assert client.post("/collections/shop/identities/merge",
                       json={"source": "0", "target": "y"}).status_code == 404
    change = client.post("/identities/merge", json={"source": "0", "target": "1"}).json()
    assert client.get(f"/collections/shop/identities/changes/{change['id']}").status_code == 404
    assert client.post(f"/collections/shop/identities/changes/{change['id']}/undo"
                       ).status_code == 404
    assert client.post("/collections/shop/identities/erase",
                       json={"label": "1"}).status_code == 404
    assert _labels(client, "/collections/shop") == {"x": 2}
    assert set(_every_hit(client, "/collections/shop")) == set(other)
    assert _labels(client) == {"1": 4}


@pytest.mark.parametrize(("path", "body"), [
    ("/identities/merge", {"source": "0", "target": "0"}),
    ("/identities/merge", {"source": "0", "target": "bad\x00label"}),
    ("/identities/merge", {"source": "0", "target": ""}),
    ("/identities/merge", {"source": "0", "target": "x" * 256}),
    ("/identities/merge", {"source": "0", "target": "1", "extra": True}),
    ("/identities/merge", {"source": 5, "target": "1"}),
    ("/identities/move", {"ids": [], "label": "x"}),
    ("/identities/move", {"ids": [1.5], "label": "x"}),
    ("/identities/move", {"ids": ["1e3"], "label": "x"}),
    ("/identities/move", {"ids": list(range(1, 10_002)), "label": "x"}),
    ("/identities/erase", {"label": "  "}),
    ("/identities/erase", {}),
])
def test_bad_requests_get_422_and_change_nothing(local_client, path, body) -> None:
    add_gallery(local_client, classes=2, per_class=2)
    response = local_client.post(path, json=body)
    assert response.status_code == 422, response.text
    assert response.json()["detail"]
    assert "\x00" not in response.text
    assert _labels(local_client) == {"0": 2, "1": 2}
    assert local_client.get("/identities/changes").json()["count"] == 0


def test_unknown_entries_and_labels_are_404(local_client) -> None:
    add_gallery(local_client, classes=1, per_class=1)
    assert local_client.post("/identities/changes/99/undo").status_code == 404
    assert local_client.get("/identities/changes/99").status_code == 404
    assert local_client.post("/identities/merge",
                             json={"source": "nobody", "target": "0"}).status_code == 404
    assert local_client.post("/identities/erase", json={"label": "nobody"}).status_code == 404


def test_writes_need_a_key_with_write_and_the_log_names_it(make_local_client) -> None:
    with make_local_client(api_key=API_KEY) as client:
        add_gallery(client, classes=2, per_class=1, headers=KEYED)
        assert client.post("/identities/merge",
                           json={"source": "0", "target": "1"}).status_code == 401
        made = client.post("/keys", json={"name": "ops", "roles": {"default": "write"}},
                           headers=KEYED).json()
        reader = client.post("/keys", json={"name": "viewer", "roles": {"default": "read"}},
                             headers=KEYED).json()
        assert client.post("/identities/merge", json={"source": "0", "target": "1"},
                           headers={"X-API-Key": reader["key"]}).status_code == 403
        change = client.post("/identities/merge", json={"source": "0", "target": "1"},
                             headers={"X-API-Key": made["key"]})
        assert change.status_code == 200, change.text
        assert change.json()["actor"] == f"key {made['id']}"
        bootstrap = client.post(f"/identities/changes/{change.json()['id']}/undo",
                                headers=KEYED)
        assert bootstrap.json()["actor"] == "IMGRET_API_KEY"


@pytest.mark.parametrize("media_backend", ["files", "database"])
def test_erase_removes_everything_of_a_label_and_answers_with_a_receipt(
        make_client, media_backend: str) -> None:
    token = uuid.uuid4().hex
    label, secret = f"person-{token}", f"secret-{token}"
    images = [png(5, i, size=40) for i in range(3)]
    with make_client(api_key=API_KEY, media_backend=media_backend) as client:
        created = client.post("/gallery", headers=KEYED, data={
            "labels": [label, label, "kept"],
            "metadata": [json.dumps({"tag": secret})] * 2 + ["{}"]},
            files=[("images", (f"{i}.png", image, "image/png"))
                   for i, image in enumerate(images)])
        assert created.status_code == 201, created.text
        gone, kept = created.json()["ids"][:2], created.json()["ids"][2]
        # An earlier split names the label in the audit log.
        split = f"split-{uuid.uuid4().hex}"
        moved = client.post("/identities/move", json={"ids": gone, "label": split},
                            headers=KEYED).json()
        assert client.post("/identities/merge", headers=KEYED,
                           json={"source": split, "target": label}).status_code == 200
        live = [i for i in _every_hit(client) if i != kept]
        assert len(live) == 2
        # Another version's saved index (a cache that may hold the vectors): removed.
        indexes = client.app.state.settings.data_dir / "indexes"
        other = indexes / "another-version"
        other.mkdir(parents=True)
        (other / "index.faiss").write_bytes(b"stale vectors")

        receipt = client.post("/identities/erase", json={"label": label}, headers=KEYED)

        assert receipt.status_code == 200, receipt.text
        body = receipt.json()
        assert body["label"] == label
        assert body["gallery_items"] == {
            "count": 2, "sha256": sorted(sha256_hex(i) for i in images[:2])}
        assert sorted(body["gallery_item_ids"]) == sorted(live)
        assert body["vectors"] == 2 and body["media_removed"] == 2
        assert body["audit_entries_cleared"] == 2
        assert body["unconfirmed"] == []
        assert len(body["confirmed"]) >= 1
        assert all(c["confirmed_at"] >= body["committed_at"][:19] for c in body["confirmed"])
        assert set(_every_hit(client)) == {kept}
        assert not other.exists()
        served = client.app.state.resources.searcher.model_version
        assert [p.name for p in indexes.iterdir()] == [served]
        for item_id in live + gone:
            assert client.get(f"/gallery/{item_id}/image").status_code == 404
        assert _labels(client) == {"kept": 1}
        media = client.app.state.resources.media
        stored = set(media.stored_keys())
        assert not {sha256_hex(i) for i in images[:2]} & stored
        with client.app.state.resources.sessions() as session:
            assert not session.scalars(select(GalleryItem).where(
                GalleryItem.label == label)).all()
            entries = session.scalars(select(LabelChange)).all()
            assert all(label not in json.dumps([e.from_label, e.to_label, e.moves])
                       for e in entries)
        log = client.get("/identities/changes").json()["data"]
        assert log[0]["action"] == "erase" and log[0]["from_label"] == "(erased)"
        assert client.post(f"/identities/changes/{log[0]['id']}/undo",
                           headers=KEYED).status_code == 409
        assert client.post(f"/identities/changes/{moved['id']}/undo",
                           headers=KEYED).json()["moves"] == []
        folder = _backup(client, "after-erase")
    for needle in (label.encode(), secret.encode(), sha256_hex(images[0]).encode(),
                   images[0][len(images[0]) // 2:][:48]):
        assert _found_in(folder, needle) == [], (needle, label, secret)
