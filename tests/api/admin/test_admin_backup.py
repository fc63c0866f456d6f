"""POST /admin/backup: the key, a name confined to <data_dir>/backups/, 4xx for bad input, and a
complete backup that `imgret restore --check` accepts (on SQLite and PostgreSQL)."""

from __future__ import annotations

import json

import pytest

from imgret.gallery.backup import BACKUP_FILE, verify_backup
from tests.api.conftest import API_KEY, add_gallery

KEYED = {"X-API-Key": API_KEY}


def test_backup_needs_the_key(make_client) -> None:
    with make_client(api_key=API_KEY) as client:
        assert client.post("/admin/backup").status_code == 401
        assert client.post("/admin/backup", headers={"X-API-Key": "wrong"}).status_code == 401
        data_dir = client.app.state.settings.data_dir
    assert not (data_dir / "backups").exists()


def test_backup_is_written_under_the_data_dir_and_verifies(make_client) -> None:
    with make_client(api_key=API_KEY) as client:
        added = add_gallery(client, headers=KEYED)
        first = client.delete(f"/gallery/{next(iter(added))}", headers=KEYED)
        assert first.status_code == 204
        response = client.post("/admin/backup", json={"name": "nightly-1"}, headers=KEYED)
        assert response.status_code == 201, response.text
        body = response.json()
        data_dir = client.app.state.settings.data_dir
        again = client.post("/admin/backup", json={"name": "nightly-1"}, headers=KEYED)
        default = client.post("/admin/backup", headers=KEYED)
    assert body["path"] == "backups/nightly-1" and body["name"] == "nightly-1"
    assert body["gallery_items"] == len(added) - 1
    assert body["media_files"] == len(added) - 1
    assert len(body["model_versions"]) == 1 and body["indexes"] == body["model_versions"]
    assert body["write_pause_ms"] >= 0
    backup = verify_backup(data_dir / "backups" / "nightly-1")
    assert backup.snapshot["gallery_items"] == len(added) - 1
    assert json.loads((backup.path / BACKUP_FILE).read_text())["source"]["database"] in (
        "sqlite", "postgresql")
    assert again.status_code == 409 and "exists" in again.json()["detail"]
    assert default.status_code == 201 and default.json()["name"].startswith("imgret-")


@pytest.mark.parametrize(
    "body",
    [
        {"name": "../outside"},
        {"name": "/tmp/abs"},
        {"name": "a/b"},
        {"name": ".hidden"},
        {"name": "-dash"},
        {"name": ""},
        {"name": "x" * 101},
        {"name": 5},
        {"name": "ok", "path": "/tmp/elsewhere"},
    ],
)
def test_backup_refuses_names_that_are_not_plain_folder_names(local_client, body) -> None:
    response = local_client.post("/admin/backup", json=body)
    assert response.status_code == 422, response.text
    data_dir = local_client.app.state.settings.data_dir
    assert not (data_dir / "backups").exists()
    assert not (data_dir.parent / "outside").exists()


def test_backup_refuses_a_body_that_is_not_json(local_client) -> None:
    response = local_client.post("/admin/backup", content=b"name=x",
                                 headers={"Content-Type": "application/json"})
    assert 400 <= response.status_code < 500
