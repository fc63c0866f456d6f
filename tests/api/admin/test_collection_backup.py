"""A backup of one collection, on both databases: it holds that collection's rows and images
alone (the other collections, their images, keys and index files stay out), verifies, and
restores into an empty data dir and database where the collection answers searches."""

from __future__ import annotations

import sqlite3

from fastapi.testclient import TestClient

from imgret.gallery.backup import DATABASE_FILE, restore_backup, verify_backup
from imgret.gallery.media.files import sha256_hex
from imgret.settings import Settings
from tests.api.conftest import API_KEY, png
from tests.conftest import TEST_DEVICE

ADMIN = {"X-API-Key": API_KEY}


def _add(client: TestClient, prefix: str, pairs, label: str) -> list[int]:
    files = [("images", (f"{c}_{i}.png", png(c, i), "image/png")) for c, i in pairs]
    response = client.post(f"{prefix}/gallery", files=files, headers=ADMIN,
                           data={"labels": [label] * len(pairs)})
    assert response.status_code == 201, response.text
    return response.json()["ids"]


def test_a_collection_backup_holds_it_alone_and_restores(make_client, tmp_path,
                                                          tiny_checkpoint) -> None:
    with make_client(api_key=API_KEY) as client:
        for name in ("shop", "cams"):
            assert client.post("/collections", json={"name": name},
                               headers=ADMIN).status_code == 201
        secret_key = client.post("/keys", json={"name": "cams-reader", "roles": {"cams": "read"}},
                                 headers=ADMIN).json()["key"]
        _add(client, "", [(0, 0), (1, 1)], "default")
        shop = _add(client, "/collections/shop", [(0, 0), (2, 2), (3, 3)], "shop")
        _add(client, "/collections/cams", [(1, 5)], "cams")
        shop_key = client.post("/keys", json={"name": "shop-writer", "roles": {"shop": "write"}},
                               headers=ADMIN).json()
        made = client.post("/admin/backup", json={"name": "shop-only", "collection": "shop"},
                           headers=ADMIN)
        assert made.status_code == 201, made.text
        missing = client.post("/admin/backup", json={"collection": "nowhere"}, headers=ADMIN)
        assert missing.status_code == 404
        data_dir = client.app.state.settings.data_dir
    report = made.json()
    assert report["gallery_items"] == 3 and report["media_files"] == 3
    assert report["indexes"] == []
    backup = verify_backup(data_dir / "backups" / "shop-only")
    with sqlite3.connect(backup.path / DATABASE_FILE) as db:
        assert [r[0] for r in db.execute("SELECT name FROM collections ORDER BY id")] == [
            "default", "shop"]
        assert {r[0] for r in db.execute("SELECT label FROM gallery_items")} == {"shop"}
        assert [r[0] for r in db.execute("SELECT name FROM api_keys")] == ["shop-writer"]
    raw = (backup.path / DATABASE_FILE).read_bytes()
    assert b"cams-reader" not in raw and b"cams" not in raw
    shipped = {p.name for p in (backup.path / "media").rglob("*") if p.is_file()}
    assert shipped == {sha256_hex(png(c, i)) for c, i in [(0, 0), (2, 2), (3, 3)]}

    target = Settings(data_dir=tmp_path / "restored", device=TEST_DEVICE,
                      database_url=f"sqlite:///{tmp_path / 'restored.db'}",
                      model=tiny_checkpoint, api_key=API_KEY)
    restore_backup(target, backup.path)
    from imgret.service.app import create_app

    with TestClient(create_app(target)) as restored:
        found = restored.post("/collections/shop/search", headers=ADMIN,
                              files={"image": ("q.png", png(2, 2), "image/png")}).json()
        assert sorted(h["id"] for h in found["results"]) == sorted(shop)
        assert restored.get("/gallery").json()["count"] == 0
        assert restored.get("/collections/cams", headers=ADMIN).status_code == 404
        assert restored.post("/collections/shop/gallery", headers={"X-API-Key": shop_key["key"]},
                             files={"images": ("n.png", png(5, 5), "image/png")},
                             data={"labels": ["new"]}).status_code == 201
        assert restored.get("/collections/shop/gallery",
                            headers={"X-API-Key": secret_key}).status_code == 401
