"""The Searcher on SQL (SQLite and PostgreSQL): load or rebuild, replicas, live updates."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from sqlalchemy import update

from imgret.gallery.search import Searcher, SearchFilter
from imgret.gallery.search.manifest import INDEX_FILE, MANIFEST_FILE, index_dir
from imgret.gallery.storage import item_store, vector_store
from imgret.gallery.storage.item_store import NewRow
from imgret.gallery.storage.tables import GalleryItem
from imgret.gallery.versions import version_store
from tests.unit.gallery.vectors import clustered_vectors

VERSION = "synthetic-v1"


@pytest.fixture(autouse=True)
def _one_faiss_thread():
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # tiny data; OpenMP threads only spin on a busy machine
    yield
    faiss.omp_set_num_threads(before)


_counter = iter(range(10**9))


def seed(sessions, vectors: np.ndarray, labels: int = 5) -> list[int]:
    """Insert gallery items with the given vectors straight through the store."""
    with sessions.begin() as session:
        version = version_store.register_model_version(session=session, version=VERSION,
                                                       dim=vectors.shape[1])
        rows = []
        for _ in range(len(vectors)):
            n = next(_counter)
            rows.append(NewRow(sha256=f"{n:064x}", media_path=f"00/00/{n}", content_type="x",
                               label=f"l{n % labels}", camera=n % 3, metadata={"n": n % 2}))
        return item_store.insert_items(rows, vectors, session=session, model_version=version)


def delete(sessions, ids) -> list[int]:
    with sessions.begin() as session:
        return [item.id for item in item_store.delete_items(ids, session=session)]


def db_vectors(sessions) -> tuple[np.ndarray, np.ndarray]:
    with sessions() as session:
        version = version_store.get_model_version(session=session, version=VERSION)
        pages = list(vector_store.iter_vector_pages(session=session, model_version=version,
                                                    page_size=7))  # several pages
    return np.concatenate([p.ids for p in pages]), np.concatenate([p.vectors for p in pages])


def test_open_rebuilds_saves_then_loads_and_is_exact(sessions, tmp_path, caplog):
    seed(sessions, clustered_vectors(300))
    delete(sessions, [5, 6])
    caplog.set_level(logging.INFO, logger="imgret.gallery.search")
    first = Searcher.open(sessions, tmp_path, model_version=VERSION, use_gpu=False)
    assert "rebuilding" in caplog.text and "no manifest" in caplog.text
    folder = index_dir(tmp_path, VERSION)
    assert (folder / INDEX_FILE).is_file() and (folder / MANIFEST_FILE).is_file()
    caplog.clear()
    second = Searcher.open(sessions, tmp_path, model_version=VERSION, use_gpu=False)
    assert "rebuilding" not in caplog.text and "loaded" in caplog.text
    ids, vectors = db_vectors(sessions)
    assert first.size == second.size == len(ids) == 298
    queries = clustered_vectors(20, seed=5)
    scores = queries @ vectors.T
    want = ids[np.argsort(-scores, axis=1, kind="stable")[:, :10]]
    got = np.array([[h.id for h in row] for row in second.search(queries, 10)])
    assert (got == want).mean() > 0.99  # exact search = brute force (up to float ties)
    np.testing.assert_allclose([h.score for h in second.search(queries, 10)[0]],
                               np.sort(scores[0])[::-1][:10], atol=1e-5)


def _tamper_factory(folder, sessions):
    return "HNSW16", "factory"


def _tamper_ids(folder, sessions):
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    manifest["ids_sha256"] = "0" * 64
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    return "Flat", "ids differ from its manifest"


def _tamper_file(folder, sessions):
    data = bytearray((folder / INDEX_FILE).read_bytes())
    data[-5] ^= 0xFF
    (folder / INDEX_FILE).write_bytes(bytes(data))
    return "Flat", "checksum"


def _tamper_database(folder, sessions):
    # A delete that bypassed the change log (e.g. a manual UPDATE): only the id sets show it.
    with sessions.begin() as session:
        session.execute(update(GalleryItem).where(GalleryItem.id == 3)
                        .values(deleted_at=GalleryItem.created_at))
    return "Flat", "after replaying 0 changes"


def _tamper_sequence(folder, sessions):
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    manifest["change_seq"] = 10**9
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    return "Flat", "different or restored database"


@pytest.mark.parametrize("tamper", [_tamper_factory, _tamper_ids, _tamper_file,
                                    _tamper_database, _tamper_sequence])
def test_manifest_mismatch_rebuilds_from_sql_and_says_why(sessions, tmp_path, caplog, tamper):
    seed(sessions, clustered_vectors(120))
    Searcher.open(sessions, tmp_path, model_version=VERSION, use_gpu=False)
    factory, reason = tamper(index_dir(tmp_path, VERSION), sessions)
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="imgret.gallery.search")
    searcher = Searcher.open(sessions, tmp_path, factory, model_version=VERSION, use_gpu=False)
    assert "rebuilding" in caplog.text and reason in caplog.text
    ids, _ = db_vectors(sessions)
    assert searcher.ids().tolist() == ids.tolist()
    assert searcher.factory == factory
    caplog.clear()
    Searcher.open(sessions, tmp_path, factory, model_version=VERSION, use_gpu=False)
    assert "rebuilding" not in caplog.text  # the rebuilt index was saved and now loads


def test_load_replays_changes_made_since_the_save(sessions, tmp_path, caplog):
    seed(sessions, clustered_vectors(100))
    Searcher.open(sessions, tmp_path, model_version=VERSION, use_gpu=False)
    new = seed(sessions, clustered_vectors(5, seed=7))
    delete(sessions, [1, 2, new[0]])
    caplog.clear()
    caplog.set_level(logging.INFO, logger="imgret.gallery.search")
    searcher = Searcher.open(sessions, tmp_path, model_version=VERSION, use_gpu=False)
    assert "rebuilding" not in caplog.text and "8 changes replayed" in caplog.text
    assert searcher.size == 102 and not {1, 2, new[0]} & set(searcher.ids().tolist())


@pytest.mark.parametrize("factory", ["Flat", "HNSW16"])
def test_a_replica_follows_the_change_log(sessions, tmp_path, factory):
    vectors = clustered_vectors(200)
    seed(sessions, vectors)
    writer = Searcher.open(sessions, tmp_path, factory, model_version=VERSION, use_gpu=False)
    replica = Searcher.open(sessions, tmp_path, factory, model_version=VERSION, use_gpu=False)
    fresh = clustered_vectors(3, seed=11)
    new_ids = seed(sessions, fresh)
    writer.add(new_ids, fresh)  # the writing process applies its own commit at once
    assert replica.refresh_from_changes() == 3
    for new_id, row in zip(new_ids, replica.search(fresh, 1), strict=True):
        assert row[0].id == new_id
    assert replica.info(new_ids[0]).label.startswith("l")  # filter info came from SQL
    gone = delete(sessions, [new_ids[0], 10])
    writer.remove(gone)
    assert replica.refresh_from_changes() == 2 and replica.refresh_from_changes() == 0
    for searcher in (writer, replica):
        hits = searcher.search(np.concatenate([fresh, vectors[9:10]]), 20)
        assert all(len(row) == 20 and not {new_ids[0], 10} & {h.id for h in row}
                   for row in hits)
    assert writer.size == replica.size == 201


def test_many_deletes_on_hnsw_trigger_a_background_rebuild(sessions, tmp_path):
    vectors = clustered_vectors(200)
    ids = seed(sessions, vectors)
    searcher = Searcher.open(sessions, tmp_path, "HNSW16", model_version=VERSION,
                             use_gpu=False, rebuild_threshold=0.1)
    gone = delete(sessions, ids[:15])
    searcher.remove(gone)
    assert searcher.stats["tombstones"] == 15  # HNSW has no remove_ids: filtered out
    assert all(h.id not in gone for row in searcher.search(vectors[:15], 10) for h in row)
    gone += delete(sessions, ids[15:25])
    searcher.remove(ids[15:25])  # 25 > 10% of 200: rebuild in the background
    searcher.wait_for_rebuild(60)
    stats = searcher.stats
    assert stats["tombstones"] == 0 and stats["stored"] == stats["size"] == 175
    assert all(len(row) == 10 and not set(gone) & {h.id for h in row}
               for row in searcher.search(vectors[:30], 10))


def test_ivf_from_sql_keeps_filters_exact_in_count(sessions, tmp_path):
    seed(sessions, clustered_vectors(800), labels=40)
    searcher = Searcher.open(sessions, tmp_path, "IVF16,Flat", model_version=VERSION,
                             use_gpu=False)
    assert searcher.factory == "IVF16,Flat"
    queries = clustered_vectors(10, seed=3)
    matching = [i for i in searcher.ids().tolist()
                if searcher.info(i).label == "l7" and searcher.info(i).camera == 1]
    assert 0 < len(matching) < 20
    for row in searcher.search(queries, 20, SearchFilter(label="l7", camera=1)):
        # Every match, though the default nprobe visits only a few of the 16 lists.
        assert sorted(h.id for h in row) == sorted(matching)
    for row in searcher.search(queries, 15, SearchFilter(metadata={"n": 1}, camera=2)):
        assert len(row) == 15


def test_trainable_factory_starts_exact_on_a_small_gallery(sessions, tmp_path, caplog):
    seed(sessions, clustered_vectors(30))
    caplog.set_level(logging.WARNING, logger="imgret.gallery.search")
    searcher = Searcher.open(sessions, tmp_path, "IVF64,Flat", model_version=VERSION,
                             use_gpu=False)
    assert searcher.factory == "Flat" and searcher.requested_factory == "IVF64,Flat"
    assert "needs at least 64 vectors" in caplog.text and searcher.size == 30


def test_a_service_starts_on_an_empty_database(sessions, tmp_path):
    searcher = Searcher.open(sessions, tmp_path, model_version="served-v1", dim=16,
                             use_gpu=False)
    assert searcher.size == 0
    assert searcher.search(clustered_vectors(2), 5) == [[], []]
    with sessions() as session:
        version = version_store.get_model_version(session=session)
    assert version.version == "served-v1" and version.is_active
    with sessions.begin() as session:
        ids = item_store.insert_items(
            [NewRow(sha256="f" * 64, media_path="ff/ff/x", content_type="x", label="a")],
            clustered_vectors(1, seed=4), session=session, model_version=version,
        )
    assert searcher.refresh_from_changes() == 1
    assert [h.id for h in searcher.search(clustered_vectors(1, seed=4), 5)[0]] == ids
