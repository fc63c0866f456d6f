"""IMGRET_MEDIA_BACKEND=database through the API (SQLite and PostgreSQL): images are stored
in the database, served, removed by a delete, 404 (never 500) when missing, and carried by a
backup."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select

from imgret.gallery.backup import create_backup, restore_backup
from imgret.gallery.evaluation.retrieval import EvaluationError, load_query_batch
from imgret.gallery.ingest import ingest_source
from imgret.gallery.storage.tables import MediaBlob, QueryEmbedding, QueryItem
from imgret.service.app import create_app
from imgret.settings import Settings
from tests.api.conftest import png
from tests.conftest import TEST_DEVICE


def _blobs(client: TestClient) -> int:
    with client.app.state.resources.sessions() as session:
        return session.scalar(select(func.count()).select_from(MediaBlob))


def _add(client: TestClient, images: list[bytes]) -> list[int]:
    response = client.post("/gallery", data={"labels": ["a"] * len(images)},
                           files=[("images", (f"{i}.png", data, "image/png"))
                                  for i, data in enumerate(images)])
    assert response.status_code == 201, response.text
    return response.json()["ids"]


def _stored_files(data_dir: Path) -> list[Path]:
    return [p for p in (data_dir / "media").rglob("*") if p.is_file()]


def test_images_live_in_the_database_and_a_delete_removes_them(make_client) -> None:
    with make_client(media_backend="database") as client:
        images = [png(1, 0), png(2, 0)]
        first, second = _add(client, images)
        assert _blobs(client) == 2
        assert not _stored_files(client.app.state.settings.data_dir)
        image = client.get(f"/gallery/{first}/image")
        assert image.status_code == 200 and image.content == images[0]
        assert image.headers["content-type"] == "image/png"
        assert image.headers["cache-control"] == "private, no-store"

        assert client.delete(f"/gallery/{first}").status_code == 204
        assert _blobs(client) == 1  # gone when the 204 is sent
        assert client.get(f"/gallery/{first}/image").status_code == 404

        # Bytes lost outside imgret: a 404 that says so, not a 500.
        with client.app.state.resources.sessions.begin() as session:
            session.execute(delete(MediaBlob))
        missing = client.get(f"/gallery/{second}/image")
        assert missing.status_code == 404, missing.text
        assert missing.json()["detail"] == (
            f"the image of gallery item {second} is missing from the database media store")


def test_a_backup_of_a_database_backend_gallery_restores_its_images(
    make_client, tmp_path: Path, tiny_checkpoint: Path,
) -> None:
    images = [png(3, 0), png(4, 0)]
    with make_client(media_backend="database") as client:
        ids = _add(client, images)
        source = client.app.state.settings
        report = create_backup(source, tmp_path / "backup")
    assert report.media_files == 0  # the bytes travel inside the database snapshot
    target = Settings(data_dir=tmp_path / "restored", model=tiny_checkpoint,
                      device=TEST_DEVICE, media_backend="database")
    restore_backup(target, tmp_path / "backup")
    with TestClient(create_app(target)) as restored:
        for item_id, data in zip(ids, images, strict=True):
            image = restored.get(f"/gallery/{item_id}/image")
            assert image.status_code == 200 and image.content == data


def test_a_query_set_ingested_into_the_database_is_served_and_re_embedded(
    make_client, image_folder: Path,
) -> None:
    """The bulk path (ingest workers, no staged files) writes blobs; the query-set image
    route and evaluation's re-embedding of stored queries read them back."""
    with make_client(media_backend="database") as client:
        resources = client.app.state.resources
        report = ingest_source(image_folder, session_factory=resources.sessions,
                               media=resources.media, embedder=resources.embedder,
                               query_set="q", workers=1, progress=False)
        assert report.added == 20 and _blobs(client) == 20
        assert not _stored_files(resources.settings.data_dir)
        with resources.sessions() as session:
            first = session.scalar(select(func.min(QueryItem.id)))
        image = client.get(f"/query-sets/q/items/{first}/image")
        assert image.status_code == 200 and image.headers["content-type"] == "image/png"

        version = resources.embedder.model_version
        with resources.sessions.begin() as session:  # no stored vectors: embed the images
            session.execute(delete(QueryEmbedding))
        with resources.sessions() as session:
            batch = load_query_batch("q", session=session, model_version=version,
                                     embedder=resources.embedder, media=resources.media)
        assert batch.vectors.shape == (20, resources.embedder.dim)

        with resources.sessions.begin() as session:
            session.execute(delete(MediaBlob))
        assert client.get(f"/query-sets/q/items/{first}/image").status_code == 404
        with resources.sessions() as session, pytest.raises(EvaluationError, match="missing"):
            load_query_batch("q", session=session, model_version=version,
                             embedder=resources.embedder, media=resources.media)
