"""Many rows at once: bulk inserts (COPY on PostgreSQL, executemany elsewhere) and ``IN`` lists cut
into chunks a database accepts."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import JSON, select, text
from sqlalchemy.orm import Session

# Bind-parameter lists are chunked: SQLite allows 32,766 variables per statement.
_IN_CHUNK = 2_000


def insert_rows(session: Session, table, params: Sequence[Mapping[str, Any]], *,
                return_ids: bool = False) -> list[int]:
    """Insert rows into ``table`` in the session's transaction with one bulk statement.

    PostgreSQL: one ``COPY ... FROM STDIN`` (statement-level triggers fire as for an INSERT).
    SQLite: one DBAPI ``executemany`` of a plain ``INSERT``, each value converted by its
    column type's bind processor, so rows are stored exactly as SQLAlchemy stores them (a
    timestamp shared by every row is converted once). Both skip SQLAlchemy's per-row
    parameter handling, the larger part of an ingest chunk's insert cost.

    Every row has the same keys; JSON columns are given as dicts.

    Args:
        return_ids: also return the new rows' primary keys, in the order of ``params``.
            PostgreSQL draws them from the column's sequence first. SQLite reads them back:
            with ``AUTOINCREMENT`` every new id is larger than any the table ever had, and
            the transaction holds the database's write lock from its first write, so the
            rows just inserted are the table's ``len(params)`` largest ids.

    Returns:
        The new ids with ``return_ids``, else an empty list.
    """
    if return_ids and not table.kwargs.get("sqlite_autoincrement"):
        raise ValueError(f"{table.name}: new ids come back only from a table whose ids are "
                         "never reused (sqlite_autoincrement)")
    if not params:
        return []
    if session.get_bind().dialect.name == "postgresql":
        return _copy_rows(session, table, params, return_ids)
    _executemany_rows(session, table, params)
    if not return_ids:
        return []
    key = next(iter(table.primary_key.columns))
    newest = session.scalars(select(key).order_by(key.desc()).limit(len(params)))
    return [int(i) for i in reversed(newest.all())]


def _copy_rows(session: Session, table, params: Sequence[Mapping[str, Any]],
               return_ids: bool) -> list[int]:
    """:func:`insert_rows` on PostgreSQL: the ids from the sequence, then one ``COPY``."""
    from psycopg.types.json import Jsonb

    columns = list(params[0])
    ids: list[int] = []
    if return_ids:
        key = next(iter(table.primary_key.columns)).name
        ids = sorted(int(i) for i in session.scalars(
            text("SELECT nextval(pg_get_serial_sequence(:t, :c)) FROM generate_series(1, :n)"),
            {"t": table.name, "c": key, "n": len(params)}))
        params = [{**row, key: i} for row, i in zip(params, ids, strict=True)]
        columns.append(key)
    json_columns = {c for c in columns if isinstance(table.c[c].type, JSON)}
    names = ", ".join(f'"{c}"' for c in columns)
    raw = session.connection().connection.driver_connection
    with raw.cursor() as cursor, cursor.copy(
        f'COPY "{table.name}" ({names}) FROM STDIN'
    ) as copy:
        for row in params:
            copy.write_row([Jsonb(row[c]) if c in json_columns else row[c] for c in columns])
    return ids


def _executemany_rows(session: Session, table, params: Sequence[Mapping[str, Any]]) -> None:
    """:func:`insert_rows` on SQLite: one DBAPI ``executemany`` of the converted values."""
    connection = session.connection()
    columns = list(params[0])
    values = [_bound(table.c[c].type, connection.dialect, [row[c] for row in params])
              for c in columns]
    names = ", ".join(f'"{c}"' for c in columns)
    cursor = connection.connection.driver_connection.cursor()
    try:
        cursor.executemany(
            f'INSERT INTO "{table.name}" ({names}) VALUES ({", ".join("?" * len(columns))})',
            zip(*values, strict=True))
    finally:
        cursor.close()


def _bound(column_type, dialect, values: list) -> list:
    """A column's values as SQLAlchemy hands them to the driver (its type's bind processor);
    a value repeated in a row (the rows' shared timestamp) is converted once."""
    process = column_type.dialect_impl(dialect).bind_processor(dialect)
    if process is None:
        return values
    out, last, converted = [], object(), None
    for value in values:
        if value is not last:
            last, converted = value, (None if value is None else process(value))
        out.append(converted)
    return out


def chunks(values: Sequence) -> Iterator[Sequence]:
    """Slices of ``values`` short enough for one ``IN (...)`` list on every database."""
    for start in range(0, len(values), _IN_CHUNK):
        yield values[start : start + _IN_CHUNK]
