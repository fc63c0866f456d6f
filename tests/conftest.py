"""Shared fixtures: a tiny checkpoint, generated images, and a database per test on each backend."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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


# Dropping a PostgreSQL database waits on the server's disk (about a second here): a test's
# databases are dropped on this thread while the next tests run, and every drop has finished
# when the session ends (pytest_sessionfinish).
_DROPS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-dropdb")


def _drop_database(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(_libpq(admin_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _DROPS.shutdown(wait=True)


def _new_database(admin_url: str, template: str | None = None) -> str:
    import psycopg

    name = f"imgret_test_{uuid.uuid4().hex[:12]}"
    clone = f' TEMPLATE "{template}"' if template else ""
    with psycopg.connect(_libpq(admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{clone}')
    return name


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    name = _new_database(postgres_admin_url)
    yield f"{postgres_admin_url.rsplit('/', 1)[0]}/{name}"
    _DROPS.submit(_drop_database, postgres_admin_url, name)


@pytest.fixture(scope="session")
def _postgres_template(postgres_admin_url: str) -> Iterator[str]:
    """A PostgreSQL database migrated to head once per test process: the template that
    :func:`migrated_db_url` clones (a clone is a file copy; migrating takes longer)."""
    from imgret.gallery.storage.db import upgrade_to_head

    name = _new_database(postgres_admin_url)
    upgrade_to_head(f"{postgres_admin_url.rsplit('/', 1)[0]}/{name}")
    yield name
    _drop_database(postgres_admin_url, name)


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head once per test process, in one self-contained file
    (rollback journal: the WAL mode the gallery sets comes back when a copy is opened)."""
    import sqlite3

    from imgret.gallery.storage.db import upgrade_to_head

    path = tmp_path_factory.mktemp("template") / "imgret.db"
    upgrade_to_head(f"sqlite:///{path}")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode=DELETE")
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    """Each database backend in turn: SQLite, then PostgreSQL."""
    return request.param


@pytest.fixture
def db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh empty database on each backend: a SQLite file, then a real PostgreSQL one."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'imgret.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def migrated_db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path
                    ) -> Iterator[str]:
    """A fresh database at the schema's head on each backend, cloned from a migrated
    template (what a service's first start would have made)."""
    if backend == "sqlite":
        path = tmp_path / "imgret.db"
        shutil.copyfile(request.getfixturevalue("_sqlite_template"), path)
        yield f"sqlite:///{path}"
        return
    admin = request.getfixturevalue("postgres_admin_url")
    name = _new_database(admin, template=request.getfixturevalue("_postgres_template"))
    yield f"{admin.rsplit('/', 1)[0]}/{name}"
    _DROPS.submit(_drop_database, admin, name)


@pytest.fixture
def sessions(db_url: str):
    """A sessionmaker on a fresh database (each backend) with the schema at head."""
    from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head

    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()
