"""Replicas share every model version through the database, and a start-up never changes the
active one: real ``imgret serve`` processes on SQLite and PostgreSQL.

Server 1 starts with A on a fresh database, gets a gallery, registers B (by a path under
``IMGRET_MODEL_ROOTS``), re-embeds for it, activates B, and adds an item. Server 2 starts on
the same database and media (``IMGRET_MEDIA_BACKEND=database``) with its own, empty data dir
and ``IMGRET_MODEL`` still naming A. Then B stays active, both processes serve B and find
every acknowledged item top-1, server 2 follows a switch to a third version C that it never
saw a file of, and a process that cannot load the active version (its bytes removed from
the database) refuses to start, with one line, and changes nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from sqlalchemy import delete, select

from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint
from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head
from imgret.gallery.storage.tables import ModelCheckpoint, ModelVersion
from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import KEY_HEADERS, png, server_env
from tests.support.live_server import running_server

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A root folder holding three tiny CNN run directories (seeds 0, 1, 2: A, B, C)."""
    root = tmp_path_factory.mktemp("replica_runs")
    folders = []
    for seed in range(3):
        torch.manual_seed(seed)
        save_checkpoint(root / f"run{seed}",
                        EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)))
        folders.append(root / f"run{seed}")
    return root, folders


def _wait(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not check():
        assert time.monotonic() < deadline, f"not within {TIMEOUT_S:.0f} s: {what}"
        time.sleep(0.1)


def _served(http: httpx.Client, url: str) -> str:
    return http.get(f"{url}/health").json()["model_version"]


def _top1(http: httpx.Client, url: str, image: bytes) -> tuple[str, int]:
    response = http.post(f"{url}/search", data={"k": "1"},
                         files={"image": ("q.png", image, "image/png")})
    assert response.status_code == 200, response.text
    body = response.json()
    return body["model_version"], body["results"][0]["id"]


def _switch(http: httpx.Client, url: str, run: Path) -> str:
    registered = http.post(f"{url}/models", json={"path": str(run)}, headers=KEY_HEADERS)
    assert registered.status_code == 201, registered.text
    version = registered.json()["version"]
    assert http.post(f"{url}/models/{version}/embed", headers=KEY_HEADERS).status_code == 202

    def embedded() -> bool:
        info = http.get(f"{url}/models/{version}").json()
        return info["coverage"]["complete"] and info["embedding"]["state"] == "done"

    _wait(embedded, f"the re-embedding of {version}")
    switched = http.post(f"{url}/models/{version}/activate", headers=KEY_HEADERS)
    assert switched.status_code == 200, switched.text
    return version


def test_a_replica_without_checkpoint_files_serves_and_follows_the_active_version(
        tmp_path: Path, db_url: str, runs: tuple[Path, list[Path]]) -> None:
    root, (run_a, run_b, run_c) = runs
    upgrade_to_head(db_url)

    def env(data_dir: Path) -> dict[str, str]:
        values = server_env(data_dir=data_dir, db_url=db_url, checkpoint=run_a,
                            device=TEST_DEVICE)
        values.update(IMGRET_MODEL_ROOTS=str(root), IMGRET_MEDIA_BACKEND="database",
                      IMGRET_EMBED_DUTY="1.0")
        return values

    images: dict[int, bytes] = {}
    with contextlib.ExitStack() as stack:
        http = stack.enter_context(httpx.Client(timeout=120))
        one = stack.enter_context(running_server(env(tmp_path / "one"),
                                                 log_path=tmp_path / "one.log")).url
        version_a = _served(http, one)
        gallery = [png(i % 4, i) for i in range(12)]
        added = http.post(f"{one}/gallery", headers=KEY_HEADERS,
                          files=[("images", (f"{i}.png", g, "image/png"))
                                 for i, g in enumerate(gallery)],
                          data={"labels": [str(i % 4) for i in range(12)]})
        assert added.status_code == 201, added.text
        images.update(zip(added.json()["ids"], gallery, strict=True))

        version_b = _switch(http, one, run_b)
        late = png(7, 77)
        added = http.post(f"{one}/gallery", headers=KEY_HEADERS,
                          files=[("images", ("late.png", late, "image/png"))],
                          data={"labels": ["7"]})
        assert added.status_code == 201, added.text
        images[added.json()["ids"][0]] = late

        # Server 2: its own empty data dir, IMGRET_MODEL still A.
        assert not (tmp_path / "two").exists()
        two = stack.enter_context(running_server(env(tmp_path / "two"),
                                                 log_path=tmp_path / "two.log")).url
        assert http.get(f"{two}/models").json()["active"] == version_b
        time.sleep(1.5)  # server 1's follower has had time to see any switch
        for url in (one, two):
            assert _served(http, url) == version_b
            for item_id, image in images.items():
                assert _top1(http, url, image) == (version_b, item_id), (url, item_id)

        # A switch to a version server 2 has no file of: it loads it from the database.
        version_c = _switch(http, one, run_c)
        _wait(lambda: _served(http, two) == version_c, f"server 2 serving {version_c}")
        for item_id, image in images.items():
            assert _top1(http, two, image) == (version_c, item_id), item_id
        assert {version_a, version_b, version_c} == {
            m["version"] for m in http.get(f"{two}/models").json()["models"]}

    # The active version's bytes gone: a starting process refuses, and changes nothing.
    engine = make_engine(db_url)
    try:
        sessions = make_sessionmaker(engine)
        with sessions.begin() as session:
            active_id = session.scalar(select(ModelVersion.id).where(ModelVersion.is_active))
            session.execute(delete(ModelCheckpoint)
                            .where(ModelCheckpoint.model_version_id == active_id))
        with (pytest.raises(RuntimeError, match="exited") as refused,
              running_server(env(tmp_path / "three"), log_path=tmp_path / "three.log")):
            pass
        log = (tmp_path / "three.log").read_text()
        lines = [line for line in log.splitlines()
                 if "cannot serve the active model version" in line]
        assert len(lines) == 1 and lines[0].startswith("error: "), log[-2000:]
        assert version_c in lines[0] and "not stored" in lines[0]
        assert "Traceback" not in log and "exited with 2" in str(refused.value)
        with sessions() as session:
            assert session.scalar(select(ModelVersion.version)
                                  .where(ModelVersion.is_active)) == version_c
    finally:
        engine.dispose()
