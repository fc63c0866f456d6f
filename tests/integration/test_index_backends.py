"""One contract, two engines: the Searcher on FAISS (in process) and on Milvus (milvus-lite,
a real engine), each on SQLite and PostgreSQL.

Exact ``min(k, matching)`` hits under label, camera and metadata filters against brute force
over the stored vectors; a delete never returned again by the process that made it or by
another Searcher on the same database; an add visible to the other after it follows the
change log; a reopen that reconciles the engine with SQL (what it lacks inserted, what SQL
deleted meanwhile deleted).
"""

from __future__ import annotations

import numpy as np
import pytest

from imgret.gallery.search import Searcher, SearchFilter
from imgret.settings import Settings
from tests.conftest import require
from tests.integration.test_index_searcher_sql import VERSION, db_vectors, delete, seed
from tests.unit.gallery.vectors import clustered_vectors


def _milvus_available() -> bool:
    try:
        import milvus_lite  # noqa: F401
        import pymilvus  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(params=["faiss", "milvus"])
def engine(request, tmp_path):
    """Opens Searchers of the backend (the Milvus ones on one milvus-lite file)."""
    if request.param == "milvus":
        require(_milvus_available(), "pymilvus and milvus-lite (the `milvus` extra)")
    settings = Settings(data_dir=tmp_path / "data", index_backend=request.param,
                        milvus_uri=str(tmp_path / "milvus.db"))

    def open_searcher(sessions, **kwargs):
        if request.param == "milvus":
            searcher = Searcher.open_milvus(sessions, settings, VERSION, **kwargs)
            assert searcher.stats["device"] == "milvus"
            return searcher
        return Searcher.open(sessions, tmp_path / "data", model_version=VERSION,
                             use_gpu=False, save=False)

    open_searcher.backend = request.param
    yield open_searcher
    if request.param == "milvus":
        from imgret.gallery.search.milvus_index import close_clients

        close_clients()


def _brute(sessions, queries, k, allowed=lambda i: True):
    ids, vectors = db_vectors(sessions)
    keep = np.array([allowed(int(i)) for i in ids], dtype=bool)
    ids, vectors = ids[keep], vectors[keep]
    scores = queries @ vectors.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return ids[order], np.take_along_axis(scores, order, axis=1)


def _infos(sessions):
    from sqlalchemy import select

    from imgret.gallery.storage.tables import GalleryItem

    with sessions() as session:
        return {i.id: (i.label, i.camera, i.meta) for i in session.scalars(select(GalleryItem))}


@pytest.mark.parametrize("flt", [
    None,
    SearchFilter(label="l2"),
    SearchFilter(camera=1),
    SearchFilter(metadata={"n": 1}),
    SearchFilter(label="l3", camera=0, metadata={"n": 0}),
    SearchFilter(label="l1", exclude_ids=frozenset({1, 6, 11})),
    SearchFilter(label="nobody"),
], ids=["none", "label", "camera", "metadata", "all-three", "exclusions", "no-match"])
def test_filtered_search_is_exact_in_ids_count_and_scores(sessions, engine, flt):
    seed(sessions, clustered_vectors(240))
    delete(sessions, [3, 4])
    searcher = engine(sessions)
    infos = _infos(sessions)

    def allowed(item_id: int) -> bool:
        if flt is None:
            return True
        label, camera, meta = infos[item_id]
        return ((flt.label is None or label == flt.label)
                and (flt.camera is None or camera == flt.camera)
                and all(meta.get(k) == v for k, v in (flt.metadata or {}).items())
                and item_id not in flt.exclude_ids)

    queries = clustered_vectors(12, seed=9)
    want_ids, want_scores = _brute(sessions, queries, 30, allowed)
    got = searcher.search(queries, 30, flt)
    expected = min(30, sum(allowed(i) for i in db_vectors(sessions)[0].tolist()))
    assert [len(row) for row in got] == [expected] * len(queries)
    for row, ids, scores in zip(got, want_ids, want_scores, strict=True):
        assert {h.id for h in row} == set(ids.tolist()) or np.isclose(
            row[-1].score, scores[-1], atol=1e-5)  # a tie at the cut may swap the last id
        np.testing.assert_allclose([h.score for h in row], scores, atol=1e-5)


def test_a_delete_is_never_returned_again_by_either_searcher(sessions, engine):
    ids = seed(sessions, clustered_vectors(120))
    first, second = engine(sessions), engine(sessions)
    queries = clustered_vectors(8, seed=3)
    gone = [h.id for h in first.search(queries, 5)[0][:3]]
    delete(sessions, gone)
    first.remove(gone)
    for searcher in (first, second):  # the second learns it from the change log at once
        for row in searcher.search(queries, 120):
            assert not {h.id for h in row} & set(gone)
        assert searcher.size == len(ids) - 3
    # A late add of a deleted id (an upload racing its delete) does not bring it back.
    _, vectors = db_vectors(sessions)
    second.add(gone, clustered_vectors(3, seed=4))
    for searcher in (first, second):
        assert not {h.id for row in searcher.search(queries, 120) for h in row} & set(gone)
    assert len(vectors) == len(ids) - 3


def test_an_add_reaches_the_other_searcher_through_the_change_log(sessions, engine):
    seed(sessions, clustered_vectors(60))
    first, second = engine(sessions), engine(sessions)
    new_vectors = clustered_vectors(5, seed=11)
    new_ids = seed(sessions, new_vectors)
    assert first.add(new_ids, new_vectors) == 5
    hits = first.search(new_vectors, 1)
    assert [row[0].id for row in hits] == new_ids
    assert second.refresh_from_changes() >= 1
    assert [row[0].id for row in second.search(new_vectors, 1)] == new_ids
    assert first.size == second.size == 65


def test_a_reopen_reconciles_the_engine_with_sql(sessions, engine):
    ids = seed(sessions, clustered_vectors(80))
    searcher = engine(sessions)
    # Meanwhile, without this Searcher: 10 deleted, 7 added.
    delete(sessions, ids[:10])
    added = seed(sessions, clustered_vectors(7, seed=21))
    reopened = engine(sessions)
    got = {h.id for row in reopened.search(clustered_vectors(20, seed=2), 200) for h in row}
    assert got == set(ids[10:]) | set(added)
    assert reopened.size == 77
    del searcher


def test_vectors_and_neighbours_match_the_stored_embeddings(sessions, engine):
    seed(sessions, clustered_vectors(50))
    searcher = engine(sessions)
    ids, vectors = db_vectors(sessions)
    got = searcher._live.vectors(ids[::7])
    np.testing.assert_allclose(got, vectors[::7], atol=1e-6)
    scores, neighbour_ids = searcher._live.neighbours(vectors[:4], 5)
    assert neighbour_ids[:, 0].tolist() == ids[:4].tolist()
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["template", "best", "mean_top3"])
def test_identities_match_brute_force_over_the_stored_vectors(sessions, engine, aggregation):
    from imgret.gallery.search.identities import IdentityGroup

    seed(sessions, clustered_vectors(120))
    delete(sessions, [5, 6])
    searcher = engine(sessions)
    infos = _infos(sessions)
    ids, vectors = db_vectors(sessions)
    labels = np.array([infos[int(i)][0] for i in ids])
    group = IdentityGroup(3, 2, aggregation)
    for query in clustered_vectors(5, seed=17):
        hits = searcher.search(query, group.fetch_size(1000))[0]
        got = searcher.identities(query, hits, group)
        scores = vectors @ query
        expected = {}
        for label in set(labels):
            mine = np.sort(scores[labels == label])[::-1]
            if aggregation == "template":
                template = vectors[labels == label].astype(np.float64).mean(axis=0)
                expected[label] = float(query @ template / np.linalg.norm(template))
            else:
                expected[label] = float(mine[:1 if aggregation == "best" else 3].mean())
        top = sorted(expected, key=lambda name: -expected[name])[:3]
        assert [identity.label for identity in got] == top
        for identity in got:
            assert identity.score == pytest.approx(expected[identity.label], abs=1e-5)
            assert len(identity.hits) == 2
            assert {infos[h.id][0] for h in identity.hits} == {identity.label}


def test_reranked_search_is_the_same_on_both_engines(sessions, tmp_path):
    """k-reciprocal re-ranking reads vectors and neighbour lists from the live index: the
    Milvus one must feed it what FAISS does."""
    require(_milvus_available(), "pymilvus and milvus-lite (the `milvus` extra)")
    from imgret.gallery.search.milvus_index import close_clients

    seed(sessions, clustered_vectors(150))
    faiss_searcher = Searcher.open(sessions, tmp_path / "data", model_version=VERSION,
                                   use_gpu=False, save=False)
    settings = Settings(data_dir=tmp_path / "data", index_backend="milvus",
                        milvus_uri=str(tmp_path / "milvus.db"))
    try:
        milvus_searcher = Searcher.open_milvus(sessions, settings, VERSION)
        queries = clustered_vectors(10, seed=8)
        for rerank in ("k_reciprocal", "query_expansion"):
            want = faiss_searcher.search(queries, 10, rerank=rerank)
            got = milvus_searcher.search(queries, 10, rerank=rerank)
            for a, b in zip(want, got, strict=True):
                assert [h.id for h in a] == [h.id for h in b], rerank
                np.testing.assert_allclose([h.score for h in a], [h.score for h in b],
                                           atol=1e-4)
    finally:
        close_clients()
