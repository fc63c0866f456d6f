"""Shared fixtures: a tiny checkpoint, generated images, and a database per test on each backend."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests run on the CPU unless told otherwise (IMGRET_TEST_DEVICE=cuda on a GPU machine).
TEST_DEVICE = os.environ.get("IMGRET_TEST_DEVICE", "cpu")
PG_ADMIN_URL = os.environ.get(
    "IMGRET_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture(autouse=True)
def _fresh_settings() -> Iterator[None]:
    """Each test reads the ``IMGRET_*`` environment it sets: ``get_settings`` is cached per
    process, and a CLI run inside a test would otherwise reuse an earlier test's database."""
    from imgret.settings import get_settings

    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding model.pt of an untrained tiny CNN (16-d, 32 px input)."""
    import torch

    from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint

    torch.manual_seed(0)
    model = EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32))
    run_dir = tmp_path_factory.mktemp("tiny_run")
    save_checkpoint(run_dir, model)
    return run_dir


@pytest.fixture
def untrained_scores_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation of the untrained network (epoch 0) scores MAP@R 0, so any trained epoch
    beats it. For tests of the run's plumbing (files, resume, reports) on data too small to
    show learning: a run whose best epoch is 0 saves no model, by design."""
    from imgret.training.scoring import Evaluator

    real = Evaluator.validate

    def validate(self: Evaluator, model, *, epoch: int):
        metrics, geometry = real(self, model, epoch=epoch)
        return ({**metrics, "map_at_r": 0.0} if epoch == 0 else metrics), geometry

    monkeypatch.setattr(Evaluator, "validate", validate)


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """An ImageFolder tree: 4 classes x 5 generated 32x32 PNGs."""
    from tests.support.images import write_image_folder

    return write_image_folder(tmp_path / "images")


def require(available: bool, what: str) -> None:
    """Skip a test whose real part (a browser, a data set) is missing; under ``CI=true``, fail
    instead: CI installs every part, so a missing one is a broken set-up, not a reason to pass.
    """
    if available:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing (CI must install it)")
    pytest.skip(f"{what} is missing")


def _postgres_available() -> bool:
    try:
        import psycopg

        with psycopg.connect(_libpq(PG_ADMIN_URL), connect_timeout=3):
            return True
    except Exception:
        return False


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    """The admin URL of the real PostgreSQL; CI fails (not skips) when it is down."""
    if not _postgres_available():
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}")
        pytest.skip(f"PostgreSQL is not reachable at {PG_ADMIN_URL}")
    return PG_ADMIN_URL


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    import psycopg

    name = f"imgret_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_libpq(postgres_admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = postgres_admin_url.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    with psycopg.connect(_libpq(postgres_admin_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh empty database on each backend: a SQLite file, then a real PostgreSQL one."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'imgret.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def sessions(db_url: str):
    """A sessionmaker on a fresh database (each backend) with the schema at head."""
    from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head

    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()
