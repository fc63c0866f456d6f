"""Images every replica can serve: with ``IMGRET_MEDIA_BACKEND=database`` two
server processes with *separate* data dirs on one PostgreSQL database serve each other's
images, and a hard delete through one removes the bytes for both.

The control: with the default files backend and separate data dirs, the other server cannot
serve the image (404 with a message), which is what the database backend is for.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from imgret.gallery.storage.db import make_engine, upgrade_to_head
from imgret.gallery.storage.tables import MediaBlob
from tests.conftest import TEST_DEVICE
from tests.support.gallery_state import KEY_HEADERS, png, server_env
from tests.support.live_server import running_servers

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _blobs(url: str) -> int:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return connection.scalar(select(func.count()).select_from(MediaBlob))
    finally:
        engine.dispose()


def _stored_files(data_dir: Path) -> int:
    media = data_dir / "media"
    return sum(p.is_file() for p in media.rglob("*")) if media.exists() else 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["database", "files"])
def test_replicas_with_separate_data_dirs_serve_each_others_images(
    tmp_path: Path, postgres_url: str, tiny_checkpoint: Path, backend: str
) -> None:
    upgrade_to_head(postgres_url)

    def env(name: str) -> dict[str, str]:
        return {
            **server_env(data_dir=tmp_path / name, db_url=postgres_url,
                         checkpoint=tiny_checkpoint, device=TEST_DEVICE),
            "IMGRET_MEDIA_BACKEND": backend,
        }

    with contextlib.ExitStack() as stack:
        one, two = stack.enter_context(running_servers(
            [(env("data-one"), tmp_path / "one.log"), (env("data-two"), tmp_path / "two.log")]
        ))
        http = stack.enter_context(httpx.Client(timeout=60))
        images = [png(1, 1), png(2, 2)]
        added = http.post(f"{one.url}/gallery", headers=KEY_HEADERS,
                          data={"labels": ["a", "b"]},
                          files=[("images", (f"{i}.png", data, "image/png"))
                                 for i, data in enumerate(images)])
        assert added.status_code == 201, added.text
        first, second = added.json()["ids"]
        # The writer serves its own image with either backend.
        own = http.get(f"{one.url}/gallery/{first}/image")
        assert own.status_code == 200 and own.content == images[0]
        other = http.get(f"{two.url}/gallery/{first}/image")
        if backend == "files":
            assert other.status_code == 404, other.text
            assert "missing from the files media store" in other.json()["detail"]
            assert _stored_files(tmp_path / "data-one") == 2
            assert _stored_files(tmp_path / "data-two") == 0
            return
        assert other.status_code == 200, other.text
        assert other.content == images[0]
        assert other.headers["content-type"] == "image/png"
        assert _blobs(postgres_url) == 2
        # No image bytes under either data dir: they live in the database.
        assert _stored_files(tmp_path / "data-one") == _stored_files(tmp_path / "data-two") == 0

        # A hard delete through server two: the bytes are gone for both.
        deleted = http.delete(f"{two.url}/gallery/{first}", headers=KEY_HEADERS)
        assert deleted.status_code == 204, deleted.text
        for server in (one, two):
            gone = http.get(f"{server.url}/gallery/{first}/image")
            assert gone.status_code == 404, gone.text
        assert _blobs(postgres_url) == 1
        kept = http.get(f"{one.url}/gallery/{second}/image")
        assert kept.status_code == 200 and kept.content == images[1]
