"""The portable database copy: the imgret schema at a given Alembic revision on an empty
database, every table copied across engines, and the id sequences carried over.

**One portable database format.** The snapshot is always a SQLite file at the source's Alembic
revision. From PostgreSQL it is made by copying every table inside one ``REPEATABLE READ READ
ONLY`` transaction (one MVCC snapshot) into a SQLite file created by the same migrations, with
the id sequences carried over (``sqlite_sequence``), so ids are never reused after a restore.
``pg_dump`` is not used: it must match the server's major version, is often absent beside the
service, and its output restores into PostgreSQL only. With one format, a backup restores into
either engine (SQLite -> PostgreSQL and back), and restoring brings the schema to head
afterwards.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, DateTime, MetaData, inspect, select, text

from imgret.gallery.backup.errors import BackupError
from imgret.gallery.storage.db import alembic_config

_COPY_PAGE = 2_000


def migrate_to(connection: Connection, url: str, revision: str) -> None:
    """Create the imgret schema at ``revision`` (not head) on an empty database."""
    from alembic import command

    config = alembic_config(url)
    check_revision_known(config, revision)
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


def check_revision_known(config: Any, revision: str) -> None:
    """Refuse a schema revision that this imgret's migrations do not know.

    Raises:
        BackupError: ``revision`` was made by a newer imgret.
    """
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        known = ScriptDirectory.from_config(config).get_revision(revision)
    except CommandError:
        known = None
    if known is None:
        raise BackupError(
            f"the backup's schema revision {revision!r} is unknown to this imgret (made by a "
            "newer version): restore it with that version or a newer one"
        )


def copy_tables(source: Connection, target: Connection) -> dict[str, int]:
    """Copy every table (but ``alembic_version``) from ``source`` into the same tables of
    ``target``, in foreign-key order, page by page; timestamps are carried in UTC. ``target``
    is freshly migrated: the rows its migrations put there (the ``default`` collection) are
    replaced by the snapshot's.

    Returns:
        table -> rows copied.
    """
    src_meta, dst_meta = MetaData(), MetaData()
    src_meta.reflect(bind=source)
    dst_meta.reflect(bind=target)
    counts: dict[str, int] = {}
    to_sqlite = target.dialect.name == "sqlite"
    for table in dst_meta.sorted_tables:
        if table.name == "alembic_version":
            continue
        src = src_meta.tables.get(table.name)
        if src is None or set(src.columns.keys()) != set(table.columns.keys()):
            raise BackupError(
                f"table {table.name} differs between the snapshot and the schema at its "
                "revision; was the database changed by hand?"
            )
        stamps = [c.name for c in table.columns if isinstance(c.type, DateTime)]
        order = [src.columns[c.name] for c in table.primary_key.columns] or list(src.columns)
        result = source.execution_options(yield_per=_COPY_PAGE).execute(
            select(src).order_by(*order))
        total = 0
        # Nothing refers to a seeded row yet: the tables that would come later in this order.
        target.execute(table.delete())
        for page in result.mappings().partitions(_COPY_PAGE):
            rows = [dict(row) for row in page]
            for row in rows:
                for name in stamps:
                    row[name] = _utc(row[name], naive=to_sqlite)
            target.execute(table.insert(), rows)
            total += len(rows)
        counts[table.name] = total
    return counts


def _utc(value: datetime | None, *, naive: bool) -> datetime | None:
    """A stored time in UTC: SQLite keeps naive UTC, PostgreSQL ``timestamptz`` aware."""
    if value is None:
        return None
    value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return value.replace(tzinfo=None) if naive else value


def _serial_columns(connection: Connection) -> list[tuple[str, str]]:
    """``(table, column)`` of every single-column integer primary key (the id sequences)."""
    inspector = inspect(connection)
    found = []
    for table in inspector.get_table_names():
        pk = inspector.get_pk_constraint(table).get("constrained_columns") or []
        if table != "alembic_version" and len(pk) == 1:
            found.append((table, pk[0]))
    return found


def carry_pg_sequences(source: Connection, target: Connection) -> None:
    """Set the SQLite snapshot's ``sqlite_sequence`` to PostgreSQL's sequence positions: ids
    handed out (and maybe rolled back or deleted) are never handed out again after restore."""
    for table, column in _serial_columns(source):
        name = source.execute(text("SELECT pg_get_serial_sequence(:t, :c)"),
                              {"t": table, "c": column}).scalar()
        if not name:
            continue
        last, called = source.execute(text(f"SELECT last_value, is_called FROM {name}")).one()
        used = int(last) if called else int(last) - 1
        current = target.execute(text("SELECT seq FROM sqlite_sequence WHERE name = :t"),
                                 {"t": table}).scalar()
        if current is None:
            target.execute(text("INSERT INTO sqlite_sequence (name, seq) VALUES (:t, :s)"),
                           {"t": table, "s": used})
        elif used > int(current):
            target.execute(text("UPDATE sqlite_sequence SET seq = :s WHERE name = :t"),
                           {"t": table, "s": used})


def set_pg_sequences(source: Connection, target: Connection) -> None:
    """Move each PostgreSQL id sequence past the snapshot's (``sqlite_sequence`` and the
    largest id), so restored ids are never handed out again."""
    carried = dict(source.execute(text("SELECT name, seq FROM sqlite_sequence")).all())
    for table, column in _serial_columns(target):
        name = target.execute(text("SELECT pg_get_serial_sequence(:t, :c)"),
                              {"t": table, "c": column}).scalar()
        if not name:
            continue
        largest = target.execute(text(f'SELECT COALESCE(MAX("{column}"), 0) FROM "{table}"')
                                 ).scalar_one()
        used = max(int(largest), int(carried.get(table) or 0))
        if used > 0:
            target.execute(text("SELECT setval(:s, :v, true)"), {"s": name, "v": used})
