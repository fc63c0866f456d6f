"""Alembic environment for the imgret schema.

The database URL comes from the caller (``imgret.gallery.storage.db.upgrade_to_head`` passes a
connection or a URL in ``config.attributes``), else from ``alembic -x url=...``, else from
``imgret.settings.Settings`` (``IMGRET_DATABASE_URL`` or the SQLite file under the data dir),
so a plain ``alembic upgrade head`` in the repository root migrates the configured database.
SQLite gets ``render_as_batch=True``: it cannot ALTER most things in place, so Alembic copies
the table instead.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from imgret.gallery.storage.tables import Base

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and "connection" not in config.attributes:
    # Only for the `alembic` command line; imgret configures its own logging.
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _database_url() -> str:
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    if url:
        return url
    from imgret.settings import Settings

    return Settings().db_url


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations_offline() -> None:
    """Emit SQL to stdout (``alembic upgrade head --sql``) instead of running it."""
    url = _database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return

    from imgret.gallery.storage.db import make_engine

    engine = make_engine(_database_url())
    try:
        with engine.connect() as connection:
            _migrate(connection)
    finally:
        engine.dispose()


def _migrate(connection) -> None:
    """Run the migrations in one transaction.

    SQLite alters a table by copying it (batch mode) and dropping the original; with foreign
    keys enforced, that DROP would first run the ON DELETE CASCADE actions of every table
    referring to it (all the embeddings of a recreated ``gallery_items``). So enforcement is
    off while migrating (sqlite.org's procedure for schema changes; the pragma only takes
    effect outside a transaction) and the result is checked before the commit.
    """
    _configure(connection)
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    try:
        with context.begin_transaction():
            context.run_migrations()
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(f"migration left {len(broken)} rows whose foreign key "
                                       f"points nowhere (first: {tuple(broken[0])})")
    finally:
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=ON")


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
