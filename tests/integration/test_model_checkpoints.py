"""Checkpoints in the database (``model_checkpoints``), on SQLite and PostgreSQL: the
migration up and down with data, loading a version without any local file, identity by the
full content digest, the start-up import of older releases' files, deleting a version
(also racing an activation), and the re-embedding heartbeat across slow chunks."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from alembic import command
from sqlalchemy import func, inspect, select, text, update

from imgret.checkpoint import EmbeddingNet, ModelSpec, save_checkpoint
from imgret.embedder import Embedder
from imgret.gallery.ingest import NewItem, add_items
from imgret.gallery.media.files import MediaStore
from imgret.gallery.storage.db import (
    alembic_config,
    downgrade,
    make_engine,
    make_sessionmaker,
    upgrade_to_head,
)
from imgret.gallery.storage.tables import (
    Embedding,
    ModelCheckpoint,
    ModelVersion,
    QueryEmbedding,
)
from imgret.gallery.versions import intake, lifecycle, reembed, version_store
from tests.conftest import TEST_DEVICE
from tests.support.images import class_image, image_bytes


def _run(folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    save_checkpoint(folder, EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=32)))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three tiny CNNs (seeds 0, 1, 2): versions A, B, C."""
    return [_run(tmp_path_factory.mktemp(f"ckpt_seed{seed}"), seed) for seed in range(3)]


def _counts(sessions, version_id: int) -> dict[str, int]:
    with sessions() as session:
        return {table.__tablename__: int(session.scalar(
            select(func.count()).select_from(table).where(key == version_id)) or 0)
            for table, key in ((Embedding, Embedding.model_version_id),
                               (QueryEmbedding, QueryEmbedding.model_version_id),
                               (ModelCheckpoint, ModelCheckpoint.model_version_id))}


# --------------------------------------------------------------------------- migration


def test_migration_0005_up_and_down_keeps_the_versions(db_url: str, runs: list[Path]) -> None:
    config = alembic_config(db_url)
    command.upgrade(config, "0004")
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO model_versions (version, dim, config, is_active, created_at, "
                "checkpoint_sha256) VALUES ('old-d16-000000000000', 16, '{}', true, "
                "CURRENT_TIMESTAMP, NULL)"))
        upgrade_to_head(db_url)
        assert "model_checkpoints" in inspect(engine).get_table_names()
        sessions = make_sessionmaker(engine)
        with sessions.begin() as session:
            row = session.scalar(select(ModelVersion))
            assert row.version == "old-d16-000000000000" and row.content_digest is None
            session.add(ModelCheckpoint(model_version_id=row.id, sha256="0" * 64, size=3,
                                        data=b"abc"))
        downgrade(db_url, "0004")
        engine.dispose()
        assert "model_checkpoints" not in inspect(engine).get_table_names()
        columns = {c["name"] for c in inspect(engine).get_columns("model_versions")}
        assert "content_digest" not in columns
        with engine.connect() as connection:
            kept = connection.execute(text("SELECT version, is_active FROM model_versions")).all()
        assert [(v, bool(a)) for v, a in kept] == [("old-d16-000000000000", True)]
        upgrade_to_head(db_url)
        engine.dispose()
        with sessions() as session:
            assert session.scalar(select(func.count()).select_from(ModelCheckpoint)) == 0
            assert session.scalar(select(ModelVersion.version)) == "old-d16-000000000000"
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- storing


def test_a_version_loads_from_the_database_without_any_file(sessions, tmp_path: Path,
                                                            runs: list[Path]) -> None:
    first = intake.register_checkpoint(runs[0], session_factory=sessions,
                                       data_dir=tmp_path / "one")
    assert first["active"] and first["checkpoint_stored"]
    # The first version of a fresh database is active through a recorded switch.
    assert lifecycle.history(session_factory=sessions)[0]["version"] == first["version"]
    # Another data dir, no models folder: the bytes come from SQL.
    other = tmp_path / "two"
    embedder = intake.load_embedder(first["version"], session_factory=sessions,
                                    data_dir=other, device=TEST_DEVICE)
    reference = Embedder.from_checkpoint(runs[0], device=TEST_DEVICE)
    image = class_image(1, 2)
    assert embedder.model_version == first["version"]
    assert (embedder.embed([image]) == reference.embed([image])).all()


def test_same_weights_are_idempotent_other_weights_never_rebind(sessions, tmp_path: Path,
                                                                runs: list[Path]) -> None:
    data_dir = tmp_path / "data"
    version = intake.register_checkpoint(runs[0], session_factory=sessions,
                                         data_dir=data_dir)["version"]
    with sessions() as session:
        stored = session.scalar(select(ModelCheckpoint.data))
        digest = session.scalar(select(ModelVersion.content_digest))
    assert len(digest) == 64 and version.endswith(digest[:12])
    # Same weights, other bytes (another `extra`): the same version, the first bytes kept.
    model = Embedder.from_checkpoint(runs[0], device="cpu").model.cpu()
    resaved = save_checkpoint(tmp_path / "resaved", model, extra={"note": "other bytes"})
    assert resaved == version
    again = intake.register_checkpoint(tmp_path / "resaved", session_factory=sessions,
                                       data_dir=data_dir)
    assert again["version"] == version
    with sessions() as session:
        assert session.scalar(select(ModelCheckpoint.data)) == stored
    # The name bound to other weights (a 48-bit prefix collision, forged here): refused.
    with sessions.begin() as session:
        session.execute(update(ModelVersion).values(content_digest="f" * 64))
    with pytest.raises(intake.VersionConflict, match="never re-bound"):
        intake.register_checkpoint(runs[0], session_factory=sessions, data_dir=data_dir)
    with sessions() as session:
        assert session.scalar(select(ModelVersion.content_digest)) == "f" * 64
        assert session.scalar(select(ModelCheckpoint.data)) == stored


def test_start_up_import_stores_older_releases_files(sessions, tmp_path: Path,
                                                     runs: list[Path]) -> None:
    """A gallery from before checkpoints moved to SQL: a row, and the file under the data
    dir."""
    data_dir = tmp_path / "data"
    embedder = Embedder.from_checkpoint(runs[1], device="cpu")
    with sessions.begin() as session:
        version_store.register_model_version(session=session, version=embedder.model_version,
                                             dim=16)
    old = intake.checkpoint_file(data_dir, embedder.model_version)
    old.parent.mkdir(parents=True)
    shutil.copyfile(runs[1] / "model.pt", old)
    with pytest.raises(Exception, match="no stored checkpoint"):
        intake.load_embedder(embedder.model_version, session_factory=sessions,
                             data_dir=tmp_path / "elsewhere")
    assert intake.import_checkpoint_files(session_factory=sessions, data_dir=data_dir) == [
        embedder.model_version]
    assert intake.load_embedder(embedder.model_version, session_factory=sessions,
                                data_dir=tmp_path / "elsewhere", device="cpu")
    assert intake.import_checkpoint_files(session_factory=sessions, data_dir=data_dir) == []


def test_stale_incoming_uploads_are_swept_fresh_ones_kept(tmp_path: Path) -> None:
    incoming = tmp_path / "models" / ".incoming"
    incoming.mkdir(parents=True)
    stale, fresh = incoming / "upload-1.pt", incoming / "upload-2.pt"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    hour_ago = time.time() - 3600
    import os

    os.utime(stale, (hour_ago, hour_ago))
    assert intake.sweep_incoming(tmp_path) == 1
    assert not stale.exists() and fresh.exists()


# --------------------------------------------------------------------------- deleting


def _gallery(sessions, media, embedder: Embedder, n: int = 6) -> list[int]:
    items = [NewItem(image_bytes(class_image(i % 3, i)), str(i % 3)) for i in range(n)]
    return add_items(items, session_factory=sessions, media=media, embedder=embedder).ids


def test_delete_removes_everything_but_never_the_active_or_rollback_target(
        sessions, tmp_path: Path, runs: list[Path]) -> None:
    data_dir = tmp_path / "data"
    media = MediaStore.in_data_dir(data_dir)
    names = [intake.register_checkpoint(r, session_factory=sessions,
                                        data_dir=data_dir)["version"] for r in runs]
    a, b, c = names
    embedders = {v: intake.load_embedder(v, session_factory=sessions, data_dir=data_dir,
                                         device=TEST_DEVICE) for v in names}
    _gallery(sessions, media, embedders[a])
    for v in (b, c):
        reembed.run_embed_job(v, session_factory=sessions, media=media, embedder=embedders[v])
    lifecycle.activate(b, session_factory=sessions, data_dir=data_dir, media=media,
                       embedder=embedders[b])
    with pytest.raises(lifecycle.VersionInUse, match="active"):
        lifecycle.delete_version(b, session_factory=sessions, data_dir=data_dir)
    with pytest.raises(lifecycle.VersionInUse, match="rollback target"):
        lifecycle.delete_version(a, session_factory=sessions, data_dir=data_dir)
    with pytest.raises(lifecycle.VersionNotFound):
        lifecycle.delete_version("nope", session_factory=sessions, data_dir=data_dir)
    with sessions() as session:
        c_id = session.scalar(select(ModelVersion.id).where(ModelVersion.version == c))
    assert _counts(sessions, c_id)["embeddings"] == 6
    lifecycle.delete_version(c, session_factory=sessions, data_dir=data_dir)
    assert _counts(sessions, c_id) == {"embeddings": 0, "query_embeddings": 0,
                                       "model_checkpoints": 0}
    assert not intake.checkpoint_file(data_dir, c).exists()
    assert lifecycle.active_version(session_factory=sessions) == b
    assert lifecycle.previous_version(session_factory=sessions) == a
    # Registering the same weights again starts afresh.
    again = intake.register_checkpoint(runs[2], session_factory=sessions, data_dir=data_dir)
    assert again["version"] == c and again["coverage"]["embedded"] == 0


def _race(sessions, data_dir: Path, media, version: str, embedder: Embedder) -> dict[str, str]:
    """An activation and a delete of ``version`` started together: what each ended with."""
    start = threading.Barrier(2)
    result: dict[str, str] = {}

    def activate() -> None:
        start.wait()
        try:
            lifecycle.activate(version, session_factory=sessions, data_dir=data_dir,
                               media=media, embedder=embedder)
            result["activate"] = "ok"
        except lifecycle.GalleryError as exc:
            result["activate"] = type(exc).__name__

    def remove() -> None:
        start.wait()
        try:
            lifecycle.delete_version(version, session_factory=sessions, data_dir=data_dir)
            result["delete"] = "ok"
        except lifecycle.GalleryError as exc:
            result["delete"] = type(exc).__name__

    threads = [threading.Thread(target=activate), threading.Thread(target=remove)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return result


def test_a_delete_racing_an_activation_never_leaves_the_active_version_without_its_checkpoint(
        sessions, tmp_path: Path, runs: list[Path]) -> None:
    data_dir = tmp_path / "data"
    media = MediaStore.in_data_dir(data_dir)
    a = intake.register_checkpoint(runs[0], session_factory=sessions,
                                   data_dir=data_dir)["version"]
    embedder_a = intake.load_embedder(a, session_factory=sessions, data_dir=data_dir,
                                      device=TEST_DEVICE)
    _gallery(sessions, media, embedder_a, n=4)
    for round_ in range(4):
        b = intake.register_checkpoint(runs[1 + round_ % 2], session_factory=sessions,
                                       data_dir=data_dir)["version"]
        embedder_b = intake.load_embedder(b, session_factory=sessions, data_dir=data_dir,
                                          device=TEST_DEVICE)
        reembed.run_embed_job(b, session_factory=sessions, media=media, embedder=embedder_b)
        result = _race(sessions, data_dir, media, b, embedder_b)
        # Exactly one of them won; the active version always has its checkpoint and vectors.
        assert sorted(result.values()).count("ok") == 1, result
        active = lifecycle.active_version(session_factory=sessions)
        with sessions() as session:
            row = session.scalar(select(ModelVersion).where(ModelVersion.is_active))
            assert _counts(sessions, row.id)["model_checkpoints"] == 1
            assert _counts(sessions, row.id)["embeddings"] == 4
        assert intake.load_embedder(active, session_factory=sessions, data_dir=data_dir,
                                    device=TEST_DEVICE)
        if active != a:  # back to A, and the other one deleted, for the next round
            lifecycle.activate(a, session_factory=sessions, data_dir=data_dir, media=media,
                               embedder=embedder_a)
            with sessions.begin() as session:
                session.execute(text("DELETE FROM model_activations"))
            lifecycle.delete_version(b, session_factory=sessions, data_dir=data_dir)


# --------------------------------------------------------------------------- heartbeat


def test_a_live_job_with_slow_chunks_is_never_claimed_twice(sessions, tmp_path: Path,
                                                            runs: list[Path],
                                                            monkeypatch) -> None:
    """A chunk's throttle pause lasts until the job's heartbeat has beaten in it (the pause
    waits on that beat, not on a clock): the heartbeat beats between chunks, and a
    second claimer, trying all along, never takes a live job over. A heartbeat tied to
    chunks (the failure this guards against) never beats in a pause: the test then fails
    on its bound instead of hanging."""
    # Beats every 3 s. The bound is the one clock here, and by design: a job whose heartbeat
    # is older than it may be taken over; 9 s leaves 6 s of scheduling lag.
    monkeypatch.setattr(version_store, "HEARTBEAT_STALE_S", 9.0)
    data_dir = tmp_path / "data"
    media = MediaStore.in_data_dir(data_dir)
    a = intake.register_checkpoint(runs[0], session_factory=sessions,
                                   data_dir=data_dir)["version"]
    b = intake.register_checkpoint(runs[1], session_factory=sessions,
                                   data_dir=data_dir)["version"]
    load = dict(session_factory=sessions, data_dir=data_dir, device=TEST_DEVICE)
    _gallery(sessions, media, intake.load_embedder(a, **load), n=3)
    embedder_b = intake.load_embedder(b, **load)

    def heartbeat() -> object:
        with sessions() as session:
            return session.scalar(select(ModelVersion.embed_heartbeat_at)
                                  .where(ModelVersion.version == b))

    beats_in_pauses: list[int] = []

    class Slow(reembed.Throttle):
        def pause(self, worked_s: float) -> None:
            seen, beats = heartbeat(), 0
            give_up = time.monotonic() + 20 * version_store.HEARTBEAT_STALE_S
            while not beats and time.monotonic() < give_up:
                time.sleep(0.05)
                now = heartbeat()
                beats, seen = beats + (now != seen), now
            beats_in_pauses.append(beats)

    assert reembed.claim_job(b, session_factory=sessions)
    report: list = []
    job = threading.Thread(target=lambda: report.append(reembed.run_embed_job(
        b, session_factory=sessions, media=media, embedder=embedder_b, chunk_size=1,
        throttle=Slow(), claimed=True)))
    job.start()
    def covered_through() -> int | None:
        with sessions() as session:
            return session.scalar(select(ModelVersion.covered_through)
                                  .where(ModelVersion.version == b))

    stolen, claimed_after_finish = [], False
    while job.is_alive():
        if reembed.claim_job(b, session_factory=sessions):
            # The job ends by marking itself done (with the scan's coverage) a moment before
            # its thread returns; a claim in that moment takes a finished job, which is
            # allowed. Only a claim while the job had not finished is a takeover.
            if covered_through() is not None:
                claimed_after_finish = True
                break
            stolen.append(time.monotonic())
        time.sleep(0.05)
    job.join()
    assert beats_in_pauses and all(beats_in_pauses), beats_in_pauses
    assert not stolen, f"the live job was claimed {len(stolen)} times by a second claimer"
    assert report and report[0].gallery_embedded == 3
    assert covered_through() is not None
    if not claimed_after_finish:
        with sessions() as session:
            assert session.scalar(select(ModelVersion.embed_state)
                                  .where(ModelVersion.version == b)) == version_store.STATE_DONE
