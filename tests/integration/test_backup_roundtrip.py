"""Backup while serving, restore into a fresh data dir and database, on SQLite and PostgreSQL
(and across them): the restored service answers every search identically for every item the
snapshot holds, although adds and deletes ran during the backup.

The backup is held open right after its snapshot is pinned (``on_phase("pinned")``) until the
writers have added and deleted items, so deletes whose bytes leave the source's media store
before the backup copies them are part of every run (the case the pins exist for).

Oracle: the source's index is exact (Flat) over the stored vectors, so "what the source
answered at snapshot time" is the inner product of the query's vector with the stored vectors
of the snapshot's live items, best first; the stored vectors come from the snapshot itself and
every item's image bytes are kept by the test.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from imgret.gallery.backup import DATABASE_FILE, create_backup
from imgret.gallery.media.files import MediaStore
from imgret.service.app import create_app
from imgret.settings import Settings, get_settings
from tests.conftest import TEST_DEVICE, _libpq
from tests.support.images import class_image, image_bytes

KEY = "backup-key"
HEADERS = {"X-API-Key": KEY}
SEED_CLASSES, SEED_PER_CLASS = 6, 10
WRITES_DURING = 4  # adds and deletes each, completed while the backup is held open


@pytest.fixture
def new_database(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    """Make fresh empty databases by kind (``sqlite`` files or real PostgreSQL databases)."""
    made: list[str] = []
    admin = None

    def make(kind: str, name: str) -> str:
        nonlocal admin
        if kind == "sqlite":
            return f"sqlite:///{tmp_path / f'{name}.db'}"
        import psycopg

        admin = admin or request.getfixturevalue("postgres_admin_url")
        db = f"imgret_test_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(_libpq(admin), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{db}"')
        made.append(db)
        return f"{admin.rsplit('/', 1)[0]}/{db}"

    yield make
    if made:
        import psycopg

        with psycopg.connect(_libpq(admin), autocommit=True) as conn:
            for db in made:
                conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


@dataclass
class Writes:
    """What the writer threads did, with wall-clock times (for snapshot membership)."""

    images: dict[int, bytes] = field(default_factory=dict)
    adds: list[tuple[float, float, list[int]]] = field(default_factory=list)
    deletes: list[tuple[float, float, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


def _png(label: int, index: int) -> bytes:
    return image_bytes(class_image(label, index))


def _add(client: TestClient, images: list[tuple[int, bytes]]) -> list[int]:
    files = [("images", (f"{i}.png", data, "image/png")) for i, (_, data) in enumerate(images)]
    response = client.post("/gallery", files=files, headers=HEADERS,
                           data={"labels": [str(label) for label, _ in images]})
    assert response.status_code == 201, response.text
    return response.json()["ids"]


def _adder(client: TestClient, writes: Writes) -> None:
    n = 0
    while not writes.stop.is_set():
        images = [(100 + n % 7, _png(100 + n % 7, 1000 + n)), (200, _png(200, 5000 + n))]
        n += 1
        t0 = time.time()
        try:
            ids = _add(client, images)
        except AssertionError as exc:
            writes.errors.append(f"add: {exc}")
            return
        writes.images.update(zip(ids, (data for _, data in images), strict=True))
        writes.adds.append((t0, time.time(), ids))


def _deleter(client: TestClient, writes: Writes, victims: list[int]) -> None:
    for item_id in victims:
        if writes.stop.is_set():
            return
        t0 = time.time()
        response = client.delete(f"/gallery/{item_id}", headers=HEADERS)
        if response.status_code != 204:
            writes.errors.append(f"delete {item_id}: {response.status_code} {response.text}")
            return
        writes.deletes.append((t0, time.time(), item_id))
        time.sleep(0.01)


def _snapshot_items(backup: Path) -> tuple[dict[int, np.ndarray], set[int], int]:
    """live id -> stored vector (active version), deleted ids, and the largest id used."""
    with sqlite3.connect(backup / DATABASE_FILE) as db:
        active, dim = db.execute(
            "SELECT id, dim FROM model_versions WHERE is_active").fetchone()
        vectors = {
            item_id: np.frombuffer(blob, np.float32, dim)
            for item_id, blob in db.execute(
                "SELECT e.item_id, e.vector FROM embeddings e JOIN gallery_items g "
                "ON g.id = e.item_id WHERE g.deleted_at IS NULL AND e.model_version_id = ?",
                (active,))
        }
        deleted = {r[0] for r in db.execute(
            "SELECT id FROM gallery_items WHERE deleted_at IS NOT NULL")}
        sequence = db.execute(
            "SELECT seq FROM sqlite_sequence WHERE name = 'gallery_items'").fetchone()
    return vectors, deleted, int(sequence[0])


def _settings(data_dir: Path, url: str, checkpoint: Path) -> Settings:
    return Settings(data_dir=data_dir, database_url=url, model=checkpoint, device=TEST_DEVICE,
                    api_key=KEY, batch_max_wait_ms=2.0, follow_interval_s=0.2)


@pytest.mark.parametrize(
    ("source_kind", "target_kind"),
    [
        ("sqlite", "sqlite"),
        pytest.param("postgresql", "postgresql", marks=pytest.mark.postgres),
        pytest.param("sqlite", "postgresql", marks=pytest.mark.postgres),
        pytest.param("postgresql", "sqlite", marks=pytest.mark.postgres),
    ],
)
def test_backup_round_trip_under_writes(
    source_kind: str, target_kind: str, tmp_path: Path, tiny_checkpoint: Path, new_database,
) -> None:
    source = _settings(tmp_path / "source", new_database(source_kind, "source"), tiny_checkpoint)
    dest = tmp_path / "backups" / "b1"
    writes = Writes()
    window: dict[str, float] = {}

    with TestClient(create_app(source)) as client:
        seed = [(c, _png(c, i)) for c in range(SEED_CLASSES) for i in range(SEED_PER_CLASS)]
        seed_ids = _add(client, seed)
        writes.images.update(zip(seed_ids, (d for _, d in seed), strict=True))
        for item_id in seed_ids[:3]:  # deleted before the backup: not in the snapshot
            assert client.delete(f"/gallery/{item_id}", headers=HEADERS).status_code == 204
        victims = seed_ids[3:][::2]
        threads = [threading.Thread(target=_adder, args=(client, writes)),
                   threading.Thread(target=_deleter, args=(client, writes, victims))]
        for thread in threads:
            thread.start()

        def hold_open(phase: str) -> None:
            # Snapshot pinned and writers released: keep the backup here until adds and
            # deletes (whose bytes leave the store) have completed after the snapshot.
            if phase != "pinned":
                return
            window["pinned"] = time.time()
            adds, deletes = len(writes.adds), len(writes.deletes)
            deadline = time.time() + 60
            while (len(writes.adds) < adds + WRITES_DURING
                   or len(writes.deletes) < deletes + WRITES_DURING):
                assert time.time() < deadline, f"writers stalled: {writes.errors}"
                time.sleep(0.02)

        while len(writes.adds) < 2 or len(writes.deletes) < 2:
            time.sleep(0.02)
        window["start"] = time.time()
        report = create_backup(source, dest, on_phase=hold_open)
        window["end"] = time.time()
        time.sleep(0.2)
        writes.stop.set()
        for thread in threads:
            thread.join(30)
        assert not writes.errors, writes.errors

    vectors, deleted, last_id = _snapshot_items(dest)
    live = set(vectors)
    assert report.gallery_items == len(live)
    # Snapshot membership follows the writers' timeline.
    for t0, t1, ids in writes.adds:
        if t1 < window["start"]:
            assert set(ids) <= live
        if t0 > window["end"]:
            assert not set(ids) & live
    for _t0, t1, item_id in writes.deletes:
        if t1 < window["start"]:
            assert item_id not in live and item_id in deleted
    during_adds = [a for a in writes.adds if a[0] < window["end"] and a[1] > window["start"]]
    during_deletes = [d for d in writes.deletes
                      if d[0] < window["end"] and d[1] > window["start"]]
    assert len(during_adds) >= WRITES_DURING and len(during_deletes) >= WRITES_DURING
    # Items of the snapshot deleted after it: their bytes left the source store, yet they are
    # in the backup (the pins).
    gone = [i for t0, _, i in writes.deletes if t0 > window["pinned"] and i in live]
    assert gone, "no snapshotted item was deleted after the snapshot"
    source_media = MediaStore.in_data_dir(source.data_dir)
    for item_id in gone:
        assert not source_media.exists(_sha(writes.images[item_id]))

    target = _settings(tmp_path / "target", new_database(target_kind, "target"), tiny_checkpoint)
    restore_output = _cli(["restore", str(dest)], target)
    assert "loaded" in restore_output  # the backed-up index matched the restored database

    ids = sorted(live)
    matrix = np.stack([vectors[i] for i in ids])
    worst, swapped = 0.0, 0
    with TestClient(create_app(target)) as restored:
        health = restored.get("/health").json()
        assert health["index_size"] == len(live)
        for item_id in ids:
            got = restored.post(
                "/search", files={"image": ("q.png", writes.images[item_id], "image/png")},
                data={"k": str(len(ids))},
            )
            assert got.status_code == 200, got.text
            hits = got.json()["results"]
            scores = matrix @ vectors[item_id]
            order = np.argsort(-scores, kind="stable")
            expected = [(ids[j], float(scores[j])) for j in order]
            worst = max(worst, _assert_same_ranking(
                [(h["id"], h["score"]) for h in hits], expected))
            swapped += sum(h["id"] != e[0] for h, e in zip(hits, expected, strict=True))
            image = restored.get(f"/gallery/{item_id}/image")
            assert image.status_code == 200 and image.content == writes.images[item_id]
        for item_id in deleted:
            assert restored.get(f"/gallery/{item_id}").status_code == 404
        # Ids handed out before the snapshot are never handed out again.
        new_id = _add(restored, [(7, _png(7, 9999))])[0]
        assert new_id > last_id >= max(live | deleted)
    print(f"\n{source_kind}->{target_kind}: snapshot {len(live)} live items "
          f"({len(deleted)} deleted rows), writes during the backup: {len(during_adds)} adds "
          f"({2 * len(during_adds)} images), {len(during_deletes)} deletes, {len(gone)} "
          f"snapshotted items deleted after the snapshot; {len(ids)} searches identical "
          f"(max |score diff| {worst:.1e}, {swapped} tie swaps); "
          f"writes paused {report.write_pause_ms:.1f} ms; backup {report.seconds:.2f}s")


def _assert_same_ranking(got: list[tuple[int, float]], expected: list[tuple[int, float]],
                         tol: float = 1e-5) -> float:
    """Same ids in the same order and the same scores (to float32 rounding); where two
    expected scores tie within ``tol`` their order may differ."""
    assert len(got) == len(expected)
    by_id = dict(expected)
    worst = 0.0
    for (gid, gscore), (eid, escore) in zip(got, expected, strict=True):
        assert gid in by_id
        worst = max(worst, abs(gscore - by_id[gid]))
        assert abs(gscore - by_id[gid]) < tol, (gid, gscore, by_id[gid])
        if gid != eid:
            assert abs(by_id[gid] - escore) < tol, (got[:5], expected[:5])
    return worst


def _sha(data: bytes) -> str:
    from imgret.gallery.media.files import sha256_hex

    return sha256_hex(data)


def _cli(args: list[str], settings: Settings) -> str:
    from imgret.cli.main import app

    env = {"IMGRET_DATA_DIR": str(settings.data_dir),
           "IMGRET_DATABASE_URL": settings.database_url or "", "IMGRET_DEVICE": TEST_DEVICE}
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, args, env=env)
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output
