"""What backup and restore refuse, and that a refusal writes nothing: partial and damaged
backups, non-empty targets, an existing destination; an interrupted backup leaves no folder
that looks complete; a backed-up index that does not match its database is rebuilt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from imgret.gallery.backup import (
    BACKUP_FILE,
    BackupError,
    BackupExists,
    create_backup,
    restore_backup,
    verify_backup,
)
from imgret.gallery.backup.layout import files_checksum
from imgret.gallery.search.manifest import Manifest
from imgret.service.app import create_app
from imgret.settings import Settings, get_settings
from tests.conftest import TEST_DEVICE
from tests.support.images import class_image, image_bytes


def _settings(data_dir: Path, url: str, checkpoint: Path) -> Settings:
    return Settings(data_dir=data_dir, database_url=url, model=checkpoint, device=TEST_DEVICE)


@pytest.fixture
def backup(tmp_path: Path, tiny_checkpoint: Path) -> Path:
    """A complete backup of a small SQLite gallery (12 items, one deleted)."""
    source = _settings(tmp_path / "source", f"sqlite:///{tmp_path / 'source.db'}",
                       tiny_checkpoint)
    with TestClient(create_app(source)) as client:
        files = [("images", (f"{i}.png", image_bytes(class_image(i % 3, i)), "image/png"))
                 for i in range(12)]
        response = client.post("/gallery", files=files,
                               data={"labels": [str(i % 3) for i in range(12)]})
        assert response.status_code == 201
        assert client.delete(f"/gallery/{response.json()['ids'][0]}").status_code == 204
    dest = tmp_path / "backups" / "b"
    create_backup(source, dest)
    return dest


@pytest.fixture
def target(tmp_path: Path, tiny_checkpoint: Path) -> Settings:
    return _settings(tmp_path / "target", f"sqlite:///{tmp_path / 'target.db'}",
                     tiny_checkpoint)


def _refused(settings: Settings, src: Path, *words: str) -> None:
    with pytest.raises(BackupError) as caught:
        restore_backup(settings, src)
    message = str(caught.value)
    for word in words:
        assert word in message, message
    assert not Path(settings.db_url.removeprefix("sqlite:///")).exists()


def _resign(src: Path) -> None:
    """Recompute backup.json's checksums after a test changed a file on purpose."""
    from imgret.files import file_sha256

    document = json.loads((src / BACKUP_FILE).read_text())
    for rel, entry in document["files"].items():
        entry["sha256"], entry["size"] = file_sha256(src / rel), (src / rel).stat().st_size
    document["files_sha256"] = files_checksum(document["files"])
    (src / BACKUP_FILE).write_text(json.dumps(document))


def test_a_backup_without_its_manifest_is_partial(backup: Path, target: Settings) -> None:
    (backup / BACKUP_FILE).unlink()
    _refused(target, backup, str(backup), "partial")
    assert not target.data_dir.exists()


def test_a_changed_media_file_is_refused_by_its_checksum(backup: Path,
                                                         target: Settings) -> None:
    media = next(p for p in (backup / "media").rglob("*") if p.is_file())
    media.write_bytes(media.read_bytes()[:-1] + b"\0")
    _refused(target, backup, str(media), "checksum")
    assert not target.data_dir.exists()


def test_a_missing_or_extra_file_is_refused(backup: Path, target: Settings) -> None:
    index = next((backup / "indexes").rglob("index.faiss"))
    extra = backup / "media" / "stray.jpg"
    extra.write_bytes(b"x")
    _refused(target, backup, str(extra), "not listed")
    extra.unlink()
    index.unlink()
    _refused(target, backup, str(index), "missing")


def test_an_edited_file_list_is_refused(backup: Path, target: Settings) -> None:
    document = json.loads((backup / BACKUP_FILE).read_text())
    rel = next(r for r in document["files"] if r.startswith("media/"))
    del document["files"][rel]
    (backup / BACKUP_FILE).write_text(json.dumps(document))
    _refused(target, backup, "checksum")


def test_a_snapshot_image_missing_from_the_backup_is_refused(backup: Path,
                                                             target: Settings) -> None:
    document = json.loads((backup / BACKUP_FILE).read_text())
    rel = next(r for r in document["files"] if r.startswith("media/"))
    (backup / rel).unlink()
    del document["files"][rel]
    document["files_sha256"] = files_checksum(document["files"])
    (backup / BACKUP_FILE).write_text(json.dumps(document))
    _refused(target, backup, "snapshot refers to")


def test_restore_needs_an_empty_data_dir_and_database(backup: Path, target: Settings,
                                                      tmp_path: Path) -> None:
    target.data_dir.mkdir()
    (target.data_dir / "keep.txt").write_text("mine")
    with pytest.raises(BackupError, match="not empty"):
        restore_backup(target, backup)
    assert sorted(p.name for p in target.data_dir.iterdir()) == ["keep.txt"]
    other = target.model_copy(update={"data_dir": tmp_path / "fresh"})
    restore_backup(other, backup)  # restores into target.db
    again = other.model_copy(update={"data_dir": tmp_path / "fresh2"})
    with pytest.raises(BackupError, match="new database"):
        restore_backup(again, backup)
    assert not again.data_dir.exists()


@pytest.mark.postgres
def test_restore_refuses_a_postgresql_database_with_tables(backup: Path, tmp_path: Path,
                                                          postgres_url: str,
                                                          tiny_checkpoint: Path) -> None:
    first = _settings(tmp_path / "pg1", postgres_url, tiny_checkpoint)
    report = restore_backup(first, backup)
    assert report.database == "postgresql" and report.gallery_items == 11
    second = _settings(tmp_path / "pg2", postgres_url, tiny_checkpoint)
    with pytest.raises(BackupError, match="has tables"):
        restore_backup(second, backup)
    assert not second.data_dir.exists()


def test_backup_refuses_an_existing_destination(backup: Path, tmp_path: Path,
                                                tiny_checkpoint: Path) -> None:
    source = _settings(tmp_path / "source", f"sqlite:///{tmp_path / 'source.db'}",
                       tiny_checkpoint)
    with pytest.raises(BackupExists, match=str(backup)):
        create_backup(source, backup)


def test_an_interrupted_backup_leaves_nothing_that_looks_complete(
        backup: Path, tmp_path: Path, tiny_checkpoint: Path) -> None:
    source = _settings(tmp_path / "source", f"sqlite:///{tmp_path / 'source.db'}",
                       tiny_checkpoint)

    def crash(phase: str) -> None:
        if phase == "media":
            raise KeyboardInterrupt

    dest = tmp_path / "backups" / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        create_backup(source, dest, on_phase=crash)
    assert not dest.exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["b"]  # no temporary folder left
    assert not (source.data_dir / ".backup-pins").exists()


def test_an_index_that_does_not_match_the_database_is_rebuilt(backup: Path,
                                                              target: Settings) -> None:
    folder = next((backup / "indexes").iterdir())
    manifest = Manifest.read(folder)
    manifest.model_copy(update={"change_seq": manifest.change_seq + 1000}).write(folder)
    _resign(backup)
    report = restore_backup(target, backup)
    assert set(report.indexes.values()) == {"rebuilt"}
    assert report.gallery_items == 11


def test_cli_errors_name_the_folder_without_a_traceback(backup: Path, target: Settings,
                                                        tmp_path: Path) -> None:
    from imgret.cli.main import app

    (backup / BACKUP_FILE).unlink()
    env = {"IMGRET_DATA_DIR": str(target.data_dir), "IMGRET_DATABASE_URL": target.db_url}
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["restore", str(backup)], env=env)
    finally:
        get_settings.cache_clear()
    assert isinstance(result.exception, BackupError) and str(backup) in str(result.exception)
    # The console script prints one line, no traceback, exit status 2.
    script = Path(sys.executable).with_name("imgret")
    done = subprocess.run([str(script), "restore", str(backup)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and f"error: {backup}" in done.stderr


def test_restore_check_verifies_without_writing(backup: Path, target: Settings) -> None:
    from imgret.cli.main import app

    env = {"IMGRET_DATA_DIR": str(target.data_dir), "IMGRET_DATABASE_URL": target.db_url}
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["restore", "--check", str(backup)], env=env)
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.exception
    assert "every checksum holds" in result.output and "11 gallery items" in result.output
    assert not target.data_dir.exists()
    assert verify_backup(backup).snapshot["gallery_items"] == 11
