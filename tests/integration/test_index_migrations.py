"""Alembic migrations up and down on SQLite and the real PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from imgret.gallery.storage.db import (
    current_revision,
    downgrade,
    make_engine,
    migrations_dir,
    upgrade_to_head,
)
from imgret.gallery.storage.tables import Base

TABLES = {"model_versions", "model_activations", "gallery_items", "embeddings",
          "gallery_changes", "query_sets", "query_items", "query_embeddings"}
REPO = Path(__file__).resolve().parents[2]


def test_upgrade_matches_the_models_and_downgrade_removes_everything(db_url):
    assert current_revision(db_url) is None
    head = upgrade_to_head(db_url)
    assert head and upgrade_to_head(db_url) == head  # a second upgrade is a no-op
    engine = make_engine(db_url)
    try:
        assert set(inspect(engine).get_table_names()) >= TABLES
        with engine.connect() as connection:
            # The migration creates exactly what the models declare (no drift).
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        downgrade(db_url, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        assert current_revision(db_url) is None
        assert upgrade_to_head(db_url) == head  # and back up again
    finally:
        engine.dispose()


def test_migrations_are_found_in_the_package():
    assert migrations_dir() == REPO / "imgret" / "migrations"
    assert (migrations_dir() / "versions").is_dir()


def test_alembic_command_line_uses_the_ini_at_the_repo_root(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    subprocess.run(
        [sys.executable, "-m", "alembic", "-x", f"url={url}", "upgrade", "head"],
        cwd=REPO, check=True, capture_output=True, timeout=120,
    )
    assert current_revision(url) == upgrade_to_head(url)


def test_a_fresh_clone_uses_its_own_migrations(tmp_path):
    import shutil

    clone = tmp_path / "clone"
    shutil.copytree(REPO / "imgret", clone / "imgret",
                    ignore=shutil.ignore_patterns("__pycache__"))
    url = f"sqlite:///{tmp_path / 'clone.db'}"
    script = ("import sys; from imgret.gallery.storage.db import migrations_dir, upgrade_to_head; "
              "print(migrations_dir()); upgrade_to_head(sys.argv[1])")
    out = subprocess.run([sys.executable, "-c", script, url], cwd=clone, check=True,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(clone / "imgret" / "migrations")
    assert current_revision(url) is not None


def _upgrade_in_child(args: tuple[str, float]) -> str:
    import time

    from imgret.gallery.storage.db import upgrade_to_head as upgrade

    url, start_at = args
    time.sleep(max(0.0, start_at - time.time()))  # start together, imports done
    return upgrade(url)


def test_concurrent_upgrades_of_a_fresh_sqlite_file_do_not_race(tmp_path) -> None:
    import multiprocessing
    import time

    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        heads = pool.map(_upgrade_in_child, [(url, time.time() + 5.0)] * 3)
    assert len(set(heads)) == 1 and heads[0]


def test_migration_0006_adds_the_calibrations_and_removes_them(db_url: str) -> None:
    """0005 -> 0006 on a gallery with a version: the table appears empty (the version serves
    no decisions), takes a calibration (on PostgreSQL its insert notifies the replicas'
    channel), cascades with its version, and a downgrade removes it keeping the version."""
    from alembic import command
    from sqlalchemy import select, text

    from imgret.gallery.storage.db import alembic_config, make_sessionmaker
    from imgret.gallery.storage.notify import CHANNEL
    from imgret.gallery.storage.tables import ModelCalibration, ModelVersion

    command.upgrade(alembic_config(db_url), "0005")
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO model_versions (version, dim, config, is_active, created_at) "
                "VALUES ('old-d16-000000000000', 16, '{}', true, CURRENT_TIMESTAMP)"))
        assert "model_calibrations" not in inspect(engine).get_table_names()
        assert upgrade_to_head(db_url) == current_revision(db_url)
        assert "model_calibrations" in inspect(engine).get_table_names()
        sessions = make_sessionmaker(engine)
        listener = None
        if engine.dialect.name == "postgresql":
            import psycopg

            listener = psycopg.connect(
                engine.url.set(drivername="postgresql").render_as_string(hide_password=False),
                autocommit=True)
            listener.execute(f"LISTEN {CHANNEL}")
        with sessions.begin() as session:
            row = session.scalar(select(ModelVersion))
            session.add(ModelCalibration(
                model_version_id=row.id, query_set="q", query_set_sha256="0" * 64,
                target_fpir=0.01, threshold=float.fromhex("0x1.6a09e667f3bcdp-1"),
                fpir=0.009, fnir=0.2, details={}))
        with sessions() as session:
            # A double survives the round trip exactly: a search compares against it.
            assert session.scalar(select(ModelCalibration.threshold)) == \
                float.fromhex("0x1.6a09e667f3bcdp-1")
        if listener is not None:
            with listener:
                notes = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
            assert notes == ["model_calibrations"]
        downgrade(db_url, "0005")
        engine.dispose()
        assert "model_calibrations" not in inspect(engine).get_table_names()
        with engine.connect() as connection:
            kept = connection.execute(text("SELECT version FROM model_versions")).scalars().all()
        assert kept == ["old-d16-000000000000"]
        upgrade_to_head(db_url)
        engine.dispose()
        with sessions() as session:
            assert session.scalar(select(ModelCalibration.id)) is None
    finally:
        engine.dispose()
