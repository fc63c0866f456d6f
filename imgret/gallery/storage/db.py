"""Engines, sessions and schema migrations (Alembic) for SQLite and PostgreSQL."""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from imgret.errors import DatabaseError
from imgret.gallery.storage.scope import session_info
from imgret.gallery.storage.tables import DEFAULT_COLLECTION_ID

logger = logging.getLogger(__name__)

# Any constant works: it only has to be the same in every process that migrates.
_MIGRATION_LOCK_KEY = 0x696D6772  # "imgr"


def make_engine(url: str, **kwargs) -> Engine:
    """Create an engine with the settings imgret relies on.

    SQLite: the parent folder is created, foreign keys are enforced, WAL journaling lets
    readers (the service) run while an ingest writes, and a busy timeout makes a second writer
    wait instead of failing. PostgreSQL: connections are checked before use.

    Args:
        url: a SQLAlchemy URL (``sqlite:///...`` or ``postgresql+psycopg://...``).
        **kwargs: passed to :func:`sqlalchemy.create_engine`.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {"check_same_thread": False, "timeout": 30})
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    # FULL: every commit is fsync'd to the WAL before it returns, so an acknowledged write
    # survives a power cut too (NORMAL only survives a process crash).
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def make_sessionmaker(
    engine: Engine, collection_id: int | None = DEFAULT_COLLECTION_ID
) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit (``expire_on_commit=False``) and
    work in one collection (:mod:`imgret.gallery.storage.scope`; ``None``: every collection)."""
    return sessionmaker(engine, expire_on_commit=False, info=session_info(collection_id))


def migrations_dir() -> Path:
    """The Alembic script folder (``imgret/migrations/``, with ``env.py`` and ``versions/``),
    part of the package: a wheel, an editable install and a plain checkout all carry it."""
    folder = Path(__file__).resolve().parents[2] / "migrations"
    if not ((folder / "env.py").is_file() and (folder / "versions").is_dir()):
        raise DatabaseError(f"Alembic migrations not found in {folder}; reinstall imgret")
    return folder


def alembic_config(url: str):
    """An Alembic ``Config`` for ``url`` that does not need ``alembic.ini``."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # env.py reads the URL from here; "%" must be escaped for ConfigParser.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["url"] = url
    return config


def upgrade_to_head(url: str) -> str:
    """Bring the schema of ``url`` to the latest migration; a no-op when it is already there.

    Concurrent callers (several API processes starting together on one database) are
    serialised: by an advisory lock on PostgreSQL, by a lock file beside a SQLite file.

    Returns:
        The head revision id.

    Raises:
        DatabaseError: the database cannot be reached or a migration fails.
    """
    with _quiet_alembic():
        # Importing Alembic's command module logs its plugin set-up at INFO.
        from alembic import command
        from alembic.runtime.migration import MigrationContext

    config = alembic_config(url)
    with _quiet_alembic(), _migration_connection(url) as connection:
        before = MigrationContext.configure(connection).get_current_revision()
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
        head = MigrationContext.configure(connection).get_current_revision()
    if before != head:
        logger.info("database schema upgraded from %s to %s (%s)", before or "empty", head,
                    safe_url(url))
    else:
        logger.debug("database schema already at %s (%s)", head, safe_url(url))
    return head or ""


def downgrade(url: str, revision: str = "base") -> None:
    """Undo migrations down to ``revision`` (``base`` drops every imgret table)."""
    with _quiet_alembic():
        from alembic import command

    config = alembic_config(url)
    with _quiet_alembic(), _migration_connection(url) as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def current_revision(url: str) -> str | None:
    """The revision the database is at, ``None`` for an empty database."""
    with _quiet_alembic():
        from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    except OperationalError as exc:
        raise _unreachable(url, exc) from None
    finally:
        engine.dispose()


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic logs its plugin set-up at INFO on every call; we log what changed instead."""
    alembic_logger = logging.getLogger("alembic")
    previous = alembic_logger.level
    if previous == logging.NOTSET:
        alembic_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        alembic_logger.setLevel(previous)


@contextmanager
def _sqlite_file_lock(url: str) -> Iterator[None]:
    """Hold ``<database file>.migrate.lock`` (SQLite has no advisory locks of its own)."""
    parsed = make_url(url)
    database = parsed.database if parsed.get_backend_name() == "sqlite" else None
    if not database or database == ":memory:":
        yield
        return
    lock_path = Path(database).with_name(Path(database).name + ".migrate.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _migration_connection(url: str) -> Iterator:
    with _sqlite_file_lock(url), _migration_connection_unlocked(url) as connection:
        yield connection


@contextmanager
def _migration_connection_unlocked(url: str) -> Iterator:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            is_pg = engine.dialect.name == "postgresql"
            if is_pg:
                connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _MIGRATION_LOCK_KEY})
                connection.commit()
            try:
                yield connection
                connection.commit()
            finally:
                if is_pg:
                    connection.rollback()
                    connection.execute(
                        text("SELECT pg_advisory_unlock(:k)"), {"k": _MIGRATION_LOCK_KEY}
                    )
                    connection.commit()
    except OperationalError as exc:
        raise _unreachable(url, exc) from None
    finally:
        engine.dispose()


def _unreachable(url: str, exc: Exception) -> DatabaseError:
    first = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
    return DatabaseError(
        f"cannot use the database {safe_url(url)}: {first}; check IMGRET_DATABASE_URL "
        "(and that PostgreSQL is running) or unset it to use the SQLite file in the data dir"
    )


def safe_url(url: str) -> str:
    """A database URL fit for logs and messages (the password hidden)."""
    return make_url(url).render_as_string(hide_password=True)
