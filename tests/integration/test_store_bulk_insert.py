"""``imgret.gallery.storage.bulk.insert_rows``, the one bulk insert (COPY on PostgreSQL, a
DBAPI executemany on
SQLite), on both databases: rows stored exactly as SQLAlchemy stores them, and the ids handed
back in the order of the rows."""

from __future__ import annotations

import pytest
from sqlalchemy import delete, insert, select, text

from imgret.gallery.storage import bulk
from imgret.gallery.storage.tables import GalleryItem, MediaBlob, utcnow


def _row(n: int, now, camera: int | None = 3) -> dict:
    """A gallery item row; rows differ only in their key (sha256, media path, source)."""
    return {"sha256": f"{n:064x}", "media_path": f"00/00/{n:064x}", "content_type": "image/png",
            "label": "shirt", "camera": camera, "metadata": {"k": "v", "é": [1.5, None]},
            "source": f"s/{n}.png", "created_at": now, "collection_id": 1}


def test_rows_are_stored_as_sqlalchemy_stores_them(sessions) -> None:
    """Every column of a row put in by insert_rows reads back, raw, the same as the same row
    put in by SQLAlchemy's own executemany: timestamps, JSON, NULLs and bytes alike."""
    table = GalleryItem.__table__
    now = utcnow()
    with sessions.begin() as session:
        ours = bulk.insert_rows(session, table, [_row(1, now), _row(3, now, None)],
                                return_ids=True)
        theirs = [session.scalar(insert(table).returning(table.c.id), row)
                  for row in (_row(2, now), _row(4, now, None))]
        bulk.insert_rows(session, MediaBlob.__table__,
                          [{"sha256": "a" * 64, "data": b"\x00\xffbytes", "created_at": now}])
        session.execute(insert(MediaBlob.__table__),
                        [{"sha256": "b" * 64, "data": b"\x00\xffbytes", "created_at": now}])
    columns = [c.name for c in table.columns if c.name not in ("id", "sha256", "media_path",
                                                               "source")]
    with sessions() as session:
        raw = {row[0]: row[1:] for row in session.execute(text(
            f"SELECT id, {', '.join(columns)} FROM gallery_items"))}
        blobs = dict(session.execute(text("SELECT sha256, data FROM media_blobs")).all())
        times = dict(session.execute(text("SELECT sha256, created_at FROM media_blobs")).all())
        items = {i.id: i for i in session.scalars(select(GalleryItem))}
    assert len(ours) == 2 and len(theirs) == 2
    # The same raw representation, column by column (camera set, then NULL).
    assert raw[ours[0]] == raw[theirs[0]]
    assert raw[ours[1]] == raw[theirs[1]]
    assert bytes(blobs["a" * 64]) == bytes(blobs["b" * 64]) == b"\x00\xffbytes"
    assert times["a" * 64] == times["b" * 64]
    # And through the ORM: every value as given.
    for item_id, n, camera in zip(ours, (1, 3), (3, None), strict=True):
        item = items[item_id]
        assert (item.sha256, item.label, item.camera, item.meta, item.source) == (
            f"{n:064x}", "shirt", camera, {"k": "v", "é": [1.5, None]}, f"s/{n}.png")
        assert item.created_at.replace(tzinfo=None) == now.replace(tzinfo=None)


def test_ids_come_back_in_row_order_after_deletes(sessions) -> None:
    """The ids returned map each row to its own id, also once the newest rows were deleted
    (ids are never reused: the next ones are larger than any the table had)."""
    table = GalleryItem.__table__
    now = utcnow()
    with sessions.begin() as session:
        first = bulk.insert_rows(session, table, [_row(n, now) for n in range(10)],
                                 return_ids=True)
        session.execute(delete(table).where(table.c.id >= first[7]))
    with sessions.begin() as session:
        second = bulk.insert_rows(session, table, [_row(n, now) for n in range(20, 25)],
                                  return_ids=True)
        assert bulk.insert_rows(session, table, []) == []
        with pytest.raises(ValueError, match="sqlite_autoincrement"):
            bulk.insert_rows(session, MediaBlob.__table__, [], return_ids=True)
    assert min(second) > max(first)
    with sessions() as session:
        by_id = dict(session.execute(select(table.c.id, table.c.sha256)).all())
    assert [by_id[i] for i in first[:7]] == [f"{n:064x}" for n in range(7)]
    assert [by_id[i] for i in second] == [f"{n:064x}" for n in range(20, 25)]


def test_concurrent_writers_each_get_their_own_ids(sessions) -> None:
    """Four threads, each on its own connection, insert batches at the same time: every id
    handed back names the row its caller inserted (SQLite's write lock, held from a
    transaction's first write, keeps another writer's rows out of the newest ids read back)."""
    import threading

    table = GalleryItem.__table__
    start = threading.Barrier(4)
    got: dict[int, list[tuple[list[int], list[str]]]] = {}
    errors: list[BaseException] = []

    def write(worker: int) -> None:
        try:
            start.wait()
            for batch in range(15):
                keys = [worker * 10_000 + batch * 100 + i for i in range(1 + batch % 7)]
                with sessions.begin() as session:
                    ids = bulk.insert_rows(session, table, [_row(k, utcnow()) for k in keys],
                                           return_ids=True)
                got.setdefault(worker, []).append((ids, [f"{k:064x}" for k in keys]))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    with sessions() as session:
        by_id = dict(session.execute(select(table.c.id, table.c.sha256)).all())
    pairs = [(i, sha) for batches in got.values() for ids, shas in batches
             for i, sha in zip(ids, shas, strict=True)]
    assert len(pairs) == len(by_id) == 4 * sum(1 + b % 7 for b in range(15))
    assert all(by_id[i] == sha for i, sha in pairs)
