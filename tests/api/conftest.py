"""API test fixtures: an app per test (own data dir, own database) inside ``with TestClient``."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from imgret.service.app import create_app
from imgret.settings import Settings
from tests.conftest import TEST_DEVICE
from tests.support.images import class_image, image_bytes

API_KEY = "test-secret"

ClientFactory = Callable[..., contextlib.AbstractContextManager[TestClient]]


def _client_factory(data_dir: Path, db_url: str, checkpoint: Path) -> ClientFactory:
    @contextlib.contextmanager
    def factory(**overrides: Any) -> Iterator[TestClient]:
        values: dict[str, Any] = dict(
            data_dir=data_dir, database_url=db_url, model=checkpoint, device=TEST_DEVICE,
            batch_max_wait_ms=2.0,
        )
        values.update(overrides)
        with TestClient(create_app(Settings(**values))) as client:
            yield client

    return factory


@pytest.fixture
def db_url(migrated_db_url: str) -> str:
    """API tests start from a database at the schema's head, cloned from a template (the
    app's own start-up migration is then a check); a test that asks for ``db_url`` gets
    the same database as its app."""
    return migrated_db_url


@pytest.fixture
def make_client(tmp_path: Path, db_url: str, tiny_checkpoint: Path) -> ClientFactory:
    """Build ``with make_client(**settings) as client``: the app with the test's data dir and
    database (SQLite, then PostgreSQL), the tiny model, and any setting overridden."""
    return _client_factory(tmp_path / "data", db_url, tiny_checkpoint)


@pytest.fixture
def client(make_client: ClientFactory) -> Iterator[TestClient]:
    """A client of a fresh app with an empty gallery and no API key (on both backends)."""
    with make_client() as client:
        yield client


@pytest.fixture
def make_local_client(tmp_path: Path, tiny_checkpoint: Path,
                      _sqlite_template: Path) -> ClientFactory:
    """Like ``make_client`` on SQLite only: for request validation, which no query reaches."""
    shutil.copyfile(_sqlite_template, tmp_path / "local.db")
    return _client_factory(tmp_path / "data", f"sqlite:///{tmp_path / 'local.db'}",
                           tiny_checkpoint)


@pytest.fixture
def local_client(make_local_client: ClientFactory) -> Iterator[TestClient]:
    """A fresh app on SQLite only (see ``make_local_client``)."""
    with make_local_client() as client:
        yield client


def png(label: int, index: int, size: int = 32) -> bytes:
    """A generated PNG of class ``label``."""
    return image_bytes(class_image(label, index, size=size))


def add_gallery(
    client: TestClient, *, classes: int = 3, per_class: int = 4, headers: dict | None = None,
    cameras: bool = False, metadata: bool = False,
) -> dict[int, int]:
    """Upload ``classes x per_class`` generated images (labels "0", "1", ...) in one POST.

    Returns:
        id -> class of every item added.
    """
    pairs = [(c, i) for c in range(classes) for i in range(per_class)]
    files = [("images", (f"{c}_{i}.png", png(c, i), "image/png")) for c, i in pairs]
    data: dict[str, list[str]] = {"labels": [str(c) for c, _ in pairs]}
    if cameras:
        data["cameras"] = [str(1 + i % 2) for _, i in pairs]
    if metadata:
        data["metadata"] = [f'{{"parity": "{"even" if i % 2 == 0 else "odd"}"}}' for _, i in pairs]
    response = client.post("/gallery", files=files, data=data, headers=headers or {})
    assert response.status_code == 201, response.text
    ids = response.json()["ids"]
    return {item_id: c for item_id, (c, _) in zip(ids, pairs, strict=True)}


def search(client: TestClient, image: bytes, **data: Any) -> Any:
    """POST /search with one image; returns the response."""
    return client.post("/search", files={"image": ("q.png", image, "image/png")}, data=data)
