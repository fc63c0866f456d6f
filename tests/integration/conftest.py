"""Fixtures shared by the integration tests that drive the index layer directly."""

from __future__ import annotations

import pytest

from imgret.embedder import Embedder
from imgret.index.media import MediaStore
from tests.conftest import TEST_DEVICE


@pytest.fixture(scope="module")
def embedder(tiny_checkpoint) -> Embedder:
    """The tiny untrained checkpoint's Embedder (16-d, 32 px)."""
    return Embedder.from_checkpoint(tiny_checkpoint, device=TEST_DEVICE, batch_size=8)


@pytest.fixture
def media(tmp_path) -> MediaStore:
    """An empty media store in the test's data dir."""
    return MediaStore.in_data_dir(tmp_path / "data")
