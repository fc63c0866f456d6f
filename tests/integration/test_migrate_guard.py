"""`imgret media migrate` refuses, changing nothing, while a real `imgret serve` holds the
gallery's database, and works once it has stopped; a server does not start while maintenance
holds the database; servers share it (SQLite and PostgreSQL)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from imgret.gallery.ingest import NewItem, add_items
from imgret.gallery.media.blobs import DatabaseMediaStore
from imgret.gallery.media.files import MediaStore
from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head
from imgret.gallery.storage.holders import GalleryInUse, hold_for_maintenance, hold_for_serving
from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import server_env
from tests.support.images import class_image, image_bytes
from tests.support.live_server import running_server

pytestmark = pytest.mark.slow

_SCRIPT = ("import sys; sys.argv = ['imgret', *sys.argv[1:]]; "
           "from imgret.cli.main import main; main()")


def _migrate(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, "media", "migrate", "--to", "database", "--no-progress"],
        env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True, text=True, timeout=300)


def _stores(db_url: str, data_dir: Path) -> tuple[set[str], set[str]]:
    """The keys in the files store and in media_blobs."""
    engine = make_engine(db_url)
    try:
        blobs = set(DatabaseMediaStore(make_sessionmaker(engine)).stored_keys())
    finally:
        engine.dispose()
    return set(MediaStore.in_data_dir(data_dir).stored_keys()), blobs


def test_migrate_refuses_while_a_server_runs_and_works_after(
        tmp_path: Path, db_url: str, tiny_checkpoint: Path, embedder) -> None:
    data_dir = tmp_path / "data"
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    try:
        add_items([NewItem(image_bytes(class_image(4, i)), "x") for i in range(3)],
                  session_factory=make_sessionmaker(engine),
                  media=MediaStore.in_data_dir(data_dir), embedder=embedder)
    finally:
        engine.dispose()
    before = _stores(db_url, data_dir)
    assert len(before[0]) == 3 and before[1] == set()
    env = server_env(data_dir=data_dir, db_url=db_url, checkpoint=tiny_checkpoint,
                     device=TEST_DEVICE)
    with running_server(env, log_path=tmp_path / "server.log") as server:
        refused = _migrate(env)
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert refused.returncode != 0
    assert "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "error: imgret media migrate needs every server of this gallery stopped, but a server "
        "(or another maintenance command) is using its database; stop every imgret server on "
        "it and run the command again"]
    assert _stores(db_url, data_dir) == before  # nothing moved
    done = _migrate(env)  # the server has stopped
    assert done.returncode == 0, done.stderr
    assert "moved 3 images from the files backend to the database backend" in done.stdout
    assert _stores(db_url, data_dir) == (set(), before[0])


def test_servers_share_the_gallery_and_maintenance_excludes_them(db_url: str) -> None:
    upgrade_to_head(db_url)
    with (hold_for_serving(db_url), hold_for_serving(db_url),  # two servers: fine
          pytest.raises(GalleryInUse, match="needs every server")):
        hold_for_maintenance(db_url, "imgret media migrate")
    with hold_for_maintenance(db_url, "imgret media migrate"):
        with pytest.raises(GalleryInUse, match="a media migration"):
            hold_for_serving(db_url)
        with pytest.raises(GalleryInUse):
            hold_for_maintenance(db_url, "imgret media migrate")
    hold_for_maintenance(db_url, "imgret media migrate").release()  # all released
