"""Backups take bounded disk: retention by count and by bytes after each successful backup
(never the new one, never anything but complete imgret backups), and a free-space check that
refuses a backup that would not fit (507, nothing written): POST /admin/backup on SQLite and
PostgreSQL, and `imgret backup`."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from imgret.gallery.backup import BACKUP_FILE, estimate_backup_bytes
from imgret.gallery.backup.files import tree_bytes
from imgret.gallery.storage.db import make_engine
from imgret.settings import get_settings
from tests.api.conftest import API_KEY, add_gallery

KEYED = {"X-API-Key": API_KEY}
HUGE = 1 << 60  # more free space than any volume has


def _backup(client, name: str):
    return client.post("/admin/backup", json={"name": name}, headers=KEYED)


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def test_the_oldest_backups_go_past_the_count(make_client) -> None:
    with make_client(api_key=API_KEY, backup_keep=2) as client:
        add_gallery(client, classes=2, per_class=2, headers=KEYED)
        folder = client.app.state.settings.data_dir / "backups"
        folder.mkdir(parents=True)
        (folder / "notes").mkdir()  # not a backup: never counted, never removed
        (folder / "notes" / "readme.txt").write_text("keep me")
        (folder / ".old.partial-1-x").mkdir()  # an unfinished backup: left alone
        for name in ("b1", "b2"):
            assert _backup(client, name).status_code == 201
        assert _names(folder) == {"notes", ".old.partial-1-x", "b1", "b2"}
        assert _backup(client, "b3").status_code == 201
        assert _names(folder) == {"notes", ".old.partial-1-x", "b2", "b3"}
        assert (folder / "notes" / "readme.txt").read_text() == "keep me"
        assert (folder / "b3" / BACKUP_FILE).is_file()


def test_the_oldest_backups_go_past_the_bytes_but_never_the_new_one(make_client) -> None:
    with make_client(api_key=API_KEY) as client:
        add_gallery(client, classes=2, per_class=2, headers=KEYED)
        assert _backup(client, "b1").status_code == 201
        folder = client.app.state.settings.data_dir / "backups"
    one = tree_bytes(folder / "b1")
    with make_client(api_key=API_KEY, backup_max_bytes=one + one // 2) as client:
        assert _backup(client, "b2").status_code == 201  # two would be ~2x: b1 goes
    assert _names(folder) == {"b2"}
    with make_client(api_key=API_KEY, backup_max_bytes=1) as client:
        assert _backup(client, "b3").status_code == 201  # over the limit alone: kept
    assert _names(folder) == {"b3"}


def test_a_backup_that_would_not_fit_is_507_and_writes_nothing(make_client) -> None:
    with make_client(api_key=API_KEY, backup_free_margin_bytes=HUGE) as client:
        add_gallery(client, classes=2, per_class=2, headers=KEYED)
        response = _backup(client, "too-big")
        data_dir = client.app.state.settings.data_dir
        assert client.get("/gallery").json()["count"] == 4  # still serving
    assert response.status_code == 507, response.text
    detail = response.json()["detail"]
    assert "not enough free space for a backup" in detail
    assert "IMGRET_BACKUP_FREE_MARGIN_BYTES" in detail and str(data_dir) not in detail
    assert _names(data_dir / "backups") == set()


def test_the_estimate_covers_what_a_backup_writes(make_client) -> None:
    with make_client(api_key=API_KEY) as client:
        add_gallery(client, classes=3, per_class=4, headers=KEYED)
        settings = client.app.state.settings
        engine = make_engine(settings.db_url)
        try:
            estimate = estimate_backup_bytes(engine, settings.db_url,
                                             settings.data_dir.absolute())
        finally:
            engine.dispose()
        body = _backup(client, "measured").json()
    assert estimate >= body["bytes"] > 0


def test_imgret_backup_applies_the_same_rules(make_local_client, tmp_path: Path) -> None:
    from imgret.cli.main import app

    with make_local_client() as client:
        add_gallery(client, classes=2, per_class=2)
        settings = client.app.state.settings
    folder = tmp_path / "nightly"
    env = {"IMGRET_DATA_DIR": str(settings.data_dir), "IMGRET_DATABASE_URL": settings.db_url,
           "IMGRET_DEVICE": "cpu", "IMGRET_BACKUP_KEEP": "1"}

    def backup(name: str, **extra: str):
        get_settings.cache_clear()
        try:
            return CliRunner().invoke(app, ["backup", str(folder / name)], env={**env, **extra})
        finally:
            get_settings.cache_clear()

    assert backup("first").exit_code == 0
    second = backup("second")
    assert second.exit_code == 0, second.output
    assert _names(folder) == {"second"}
    refused = backup("third", IMGRET_BACKUP_FREE_MARGIN_BYTES=str(HUGE))
    assert refused.exit_code != 0
    assert "not enough free space for a backup" in str(refused.exception)
    assert _names(folder) == {"second"}
