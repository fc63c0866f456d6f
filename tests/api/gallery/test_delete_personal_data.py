"""A delete removes the item's personal data in its own transaction, and no later backup holds
any of it: not the row's label, camera, metadata, source or content hash, not the image bytes,
not even in the free pages of the database snapshot (SQLite and PostgreSQL; both media
backends). Rows deleted before deletes cleared them are cleared by the start-up sweep and are
left out of backups meanwhile."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select, update

from imgret.gallery.media.files import sha256_hex
from imgret.gallery.storage import item_store
from imgret.gallery.storage.tables import GalleryItem
from tests.api.conftest import API_KEY, png

KEYED = {"X-API-Key": API_KEY}


def _planted() -> dict:
    token = uuid.uuid4().hex
    return {"label": f"erase-me-{token}", "secret": f"secret-{token}",
            "image": png(5, 3, size=48)}


def _add(client, planted: dict) -> tuple[int, int]:
    """The planted item (camera 7, metadata with the secret) and a live one kept as a control."""
    files = [("images", ("a.png", planted["image"], "image/png")),
             ("images", ("b.png", png(1, 0), "image/png"))]
    data = {"labels": [planted["label"], f"kept-{planted['secret']}"[::-1]],
            "cameras": ["7", "2"],
            "metadata": [json.dumps({"tag": planted["secret"]}), "{}"]}
    response = client.post("/gallery", files=files, data=data, headers=KEYED)
    assert response.status_code == 201, response.text
    gone, kept = response.json()["ids"]
    return gone, kept


def _row(client, item_id: int) -> GalleryItem:
    with client.app.state.resources.sessions() as session:
        return item_store.get_item(item_id, session=session, include_deleted=True)


def _needles(planted: dict) -> dict[str, bytes]:
    image = planted["image"]
    middle = len(image) // 2
    return {"label": planted["label"].encode(), "metadata": planted["secret"].encode(),
            "sha256": sha256_hex(image).encode(), "image": image[middle:middle + 48]}


def _found_in(folder: Path, needle: bytes) -> list[str]:
    return [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*"))
            if p.is_file() and needle in p.read_bytes()]


def _backup(client, name: str) -> Path:
    response = client.post("/admin/backup", json={"name": name}, headers=KEYED)
    assert response.status_code == 201, response.text
    return client.app.state.settings.data_dir / "backups" / name


@pytest.mark.parametrize("media_backend", ["files", "database"])
def test_a_delete_clears_the_row_and_a_later_backup_holds_none_of_it(
        make_client, media_backend: str) -> None:
    planted = _planted()
    with make_client(api_key=API_KEY, media_backend=media_backend) as client:
        gone, kept = _add(client, planted)
        before = _row(client, gone)
        assert before.label == planted["label"] and before.camera == 7
        assert client.delete(f"/gallery/{gone}", headers=KEYED).status_code == 204
        row = _row(client, gone)
        assert row.deleted_at is not None
        assert (row.label, row.camera, row.meta, row.source) == (item_store.DELETED_LABEL, None, {},
                                                                 None)
        assert (row.sha256, row.media_path) == ("", "")
        assert client.get(f"/gallery/{gone}").status_code == 404
        folder = _backup(client, "after-delete")
    for what, needle in _needles(planted).items():
        assert _found_in(folder, needle) == [], what
    # The search works: the live item's label is in the snapshot as plain text.
    assert _found_in(folder, f"kept-{planted['secret']}"[::-1].encode()) == ["database.sqlite"]
    assert _row_count(folder) == 1


def test_rows_deleted_before_deletes_cleared_them_stay_out_of_backups_and_are_swept(
        make_client) -> None:
    """A row deleted by an older imgret keeps its label and metadata, and the delete's purge
    of its bytes never ran (a crash): the backup leaves both out, and the next start-up
    clears the row."""
    planted = _planted()
    with make_client(api_key=API_KEY, media_backend="database") as client:
        gone, _ = _add(client, planted)
        sessions = client.app.state.resources.sessions
        with sessions.begin() as session:  # the delete commits, the purge does not run
            item_store.delete_items([gone], session=session)
        with sessions.begin() as session:  # what an older imgret's delete left in the row
            session.execute(update(GalleryItem).where(GalleryItem.id == gone).values(
                label=planted["label"], camera=7, meta={"tag": planted["secret"]},
                sha256=sha256_hex(planted["image"]), media_path="old/path"))
        folder = _backup(client, "with-leftovers")
        assert _row(client, gone).label == planted["label"]  # the backup wrote nothing back
    for what, needle in _needles(planted).items():
        assert _found_in(folder, needle) == [], what
    with make_client(api_key=API_KEY, media_backend="database") as client:  # a restart
        row = _row(client, gone)
        assert (row.label, row.camera, row.meta, row.sha256) == (item_store.DELETED_LABEL, None, {},
                                                                 "")
        with client.app.state.resources.sessions() as session:
            assert item_store.clear_deleted_items(connection=session) == 0  # nothing left to do
            stored = set(client.app.state.resources.media.stored_keys())
        assert sha256_hex(planted["image"]) not in stored


def _row_count(folder: Path) -> int:
    import sqlite3

    with sqlite3.connect(folder / "database.sqlite") as connection:
        return connection.execute(
            "SELECT COUNT(*) FROM gallery_items WHERE deleted_at IS NULL").fetchone()[0]


def test_the_sweep_clears_only_deleted_rows(sessions) -> None:
    """clear_deleted_items never touches a live row."""
    from imgret.gallery.storage.tables import ModelVersion

    with sessions.begin() as session:
        version = ModelVersion(version="v-test", dim=4, config={})
        session.add(version)
        session.flush()
        rows = [item_store.NewRow(sha256=f"{i:064x}", media_path=f"p{i}", content_type="image/png",
                                  label=f"l{i}", camera=i, metadata={"k": i}) for i in range(2)]
        import numpy as np

        ids = item_store.insert_items(rows, np.eye(2, 4, dtype=np.float32), session=session,
                                      model_version=version)
        item_store.delete_items(ids[:1], session=session)
    with sessions.begin() as session:
        assert item_store.clear_deleted_items(connection=session) == 0
        live = session.scalars(select(GalleryItem).where(GalleryItem.id == ids[1])).one()
        assert (live.label, live.camera, live.meta) == ("l1", 1, {"k": 1})
