"""Fixtures shared by the integration tests that drive the index layer directly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from imgret.embedder import Embedder
from imgret.gallery.media.files import MediaStore
from tests.conftest import TEST_DEVICE


@pytest.fixture(scope="module")
def embedder(tiny_checkpoint) -> Embedder:
    """The tiny untrained checkpoint's Embedder (16-d, 32 px)."""
    return Embedder.from_checkpoint(tiny_checkpoint, device=TEST_DEVICE, batch_size=8)


@pytest.fixture
def media(tmp_path) -> MediaStore:
    """An empty media store in the test's data dir."""
    return MediaStore.in_data_dir(tmp_path / "data")


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, db_url: str,
            tiny_checkpoint: Path) -> Iterator[Path]:
    """The environment the CLI reads: the test's database, a data dir under ``tmp_path``
    (yielded), the tiny checkpoint as IMGRET_MODEL, the CPU; settings re-read around it."""
    from imgret.settings import get_settings

    monkeypatch.setenv("IMGRET_DATABASE_URL", db_url)
    monkeypatch.setenv("IMGRET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("IMGRET_MODEL", str(tiny_checkpoint))
    monkeypatch.setenv("IMGRET_DEVICE", "cpu")
    get_settings.cache_clear()  # the CLI reads its settings once per process
    yield tmp_path
    get_settings.cache_clear()

