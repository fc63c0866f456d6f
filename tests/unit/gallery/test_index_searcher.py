"""The Searcher without a database: exactness, filters, live updates, thread safety."""

from __future__ import annotations

import threading

import faiss
import numpy as np
import pytest

from imgret.gallery.search import Hit, ReadWriteLock, Searcher, SearchFilter
from imgret.gallery.search.faiss_index import check_factory, create_index, set_search_defaults
from imgret.gallery.storage.vector_store import ItemInfo
from tests.support.threads import Overlap, run_in_threads
from tests.unit.gallery.vectors import clustered_vectors

FACTORIES = ["Flat", "IVF8,Flat", "HNSW16", "PQ4x4"]  # exact, IVF, graph, no-selector codes


_TRAINED: dict[str, faiss.Index] = {}


def trained_index(factory: str, dim: int = 16) -> faiss.Index:
    """An empty index trained once per test session on the fixture data (training is slow)."""
    if factory not in _TRAINED:
        index = create_index(check_factory(factory, dim), dim)
        if not index.is_trained:
            index.train(clustered_vectors(600, dim))
        _TRAINED[factory] = index
    return faiss.clone_index(_TRAINED[factory])


def make_searcher(factory: str, vectors: np.ndarray, ids: np.ndarray | None = None,
                  labels: int = 6, cls: type[Searcher] = Searcher) -> Searcher:
    ids = np.arange(1, len(vectors) + 1, dtype=np.int64) if ids is None else ids
    index = trained_index(factory, vectors.shape[1])
    index.add_with_ids(vectors, ids)
    set_search_defaults(index)
    infos = {int(i): ItemInfo(f"l{int(i) % labels}", int(i) % 3, {"shop": "a" if i % 2 else "b"})
             for i in ids}
    return cls(index, model_version="m", factory=factory, infos=infos, use_gpu=False)


def brute_force(queries: np.ndarray, vectors: np.ndarray, ids: np.ndarray, k: int):
    scores = queries @ vectors.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return ids[order], np.take_along_axis(scores, order, axis=1)


def test_exact_index_agrees_with_numpy_brute_force(vectors):
    ids = np.arange(10, 10 + len(vectors), dtype=np.int64) * 3  # sparse, non-contiguous ids
    searcher = make_searcher("Flat", vectors, ids)
    queries = clustered_vectors(50, seed=1)
    results = searcher.search(queries, 10)
    want_ids, want_scores = brute_force(queries, vectors, ids, 10)
    got_scores = np.array([[h.score for h in row] for row in results])
    np.testing.assert_allclose(got_scores, want_scores, rtol=1e-5, atol=1e-5)
    # Ids agree except where two scores tie to float precision.
    got_ids = np.array([[h.id for h in row] for row in results])
    assert (got_ids == want_ids).mean() > 0.99
    assert all(row[0].score >= row[-1].score for row in results)


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize(
    "flt",
    [
        SearchFilter(label="l3"),
        SearchFilter(camera=1),
        SearchFilter(label="l2", camera=2),
        SearchFilter(metadata={"shop": "a"}),
        SearchFilter(label="l2", metadata={"shop": "b"}, exclude_ids={8, 14}),
        SearchFilter(exclude_ids=set(range(1, 400))),
    ],
    ids=["label", "camera", "label+camera", "metadata", "label+metadata+exclude", "exclude"],
)
def test_filters_return_exactly_k_matching_items(factory, flt, vectors):
    searcher = make_searcher(factory, vectors)
    queries = clustered_vectors(20, seed=2)
    k = 25

    def matches(item_id: int) -> bool:
        info = searcher.info(item_id)
        return (
            (flt.label is None or info.label == flt.label)
            and (flt.camera is None or info.camera == flt.camera)
            and all(info.metadata[key] == v for key, v in (flt.metadata or {}).items())
            and item_id not in flt.exclude_ids
        )

    assert sum(matches(i) for i in range(1, 601)) >= k
    for row in searcher.search(queries, k, flt):
        assert len(row) == k
        assert len({h.id for h in row}) == k
        assert all(matches(hit.id) for hit in row)


@pytest.mark.parametrize("factory", FACTORIES)
def test_a_tiny_filter_returns_all_matches_and_no_more(factory, vectors):
    """Two matching items among 600: an approximate index alone would often miss them."""
    ids = np.arange(1, len(vectors) + 1, dtype=np.int64)
    searcher = make_searcher(factory, vectors, ids)
    searcher.add([5000, 5001], clustered_vectors(2, seed=9),
                 [ItemInfo("rare"), ItemInfo("rare")])
    for row in searcher.search(clustered_vectors(10, seed=3), 10, SearchFilter(label="rare")):
        assert sorted(h.id for h in row) == [5000, 5001]
    assert searcher.search(clustered_vectors(1, seed=3), 10, SearchFilter(label="none")) == [[]]


def test_exact_filtered_search_agrees_with_brute_force_over_the_subset(vectors):
    searcher = make_searcher("Flat", vectors)
    ids = np.arange(1, len(vectors) + 1)
    keep = np.array([searcher.info(i).label == "l4" for i in ids])
    queries = clustered_vectors(5, seed=4)
    want_ids, _ = brute_force(queries, vectors[keep], ids[keep], 7)
    got = searcher.search(queries, 7, SearchFilter(label="l4"))
    assert [[h.id for h in row] for row in got] == want_ids.tolist()


def test_per_query_filters_leave_one_out(vectors):
    searcher = make_searcher("Flat", vectors)
    queries = vectors[:5]
    flts = [SearchFilter(exclude_ids={i + 1}) for i in range(5)]
    plain = searcher.search(queries, 3)
    held_out = searcher.search(queries, 3, flts)
    for i in range(5):
        assert plain[i][0].id == i + 1  # each vector finds itself first
        assert all(h.id != i + 1 for h in held_out[i]) and len(held_out[i]) == 3
    with pytest.raises(ValueError, match="2 filters for 5 queries"):
        searcher.search(queries, 3, flts[:2])


@pytest.mark.parametrize("factory", FACTORIES)
def test_add_is_searchable_at_once_and_remove_never_returned_again(factory, vectors):
    searcher = make_searcher(factory, vectors[:500])
    new = vectors[500:510]
    new_ids = np.arange(9000, 9010)
    assert searcher.add(new_ids, new, [ItemInfo("new")] * 10) == 10
    assert searcher.add(new_ids, new) == 0  # replaying an add is harmless
    assert searcher.size == 510
    for row in searcher.search(new, 10, SearchFilter(label="new")):
        assert sorted(h.id for h in row) == new_ids.tolist()
    if not factory.startswith("PQ"):  # 16-bit PQ codes are too lossy to find themselves
        for new_id, row in zip(new_ids, searcher.search(new, 3), strict=True):
            assert new_id in {h.id for h in row}
    removed = [9000, 9001, 3, 4]
    assert searcher.remove(removed + [123456]) == 4
    assert searcher.remove(removed) == 0
    assert searcher.size == 506
    for row in searcher.search(np.concatenate([new, vectors[2:4]]), 50):
        assert len(row) == 50 and not set(removed) & {h.id for h in row}
    assert len(searcher.search(new, 30, SearchFilter(label="new"))[0]) == 8


def test_indexes_without_remove_ids_use_tombstones(vectors, caplog):
    searcher = make_searcher("HNSW16", vectors)
    searcher.rebuild_threshold = 0.05
    caplog.set_level("WARNING", logger="imgret.gallery.search")
    searcher.remove(range(1, 11))
    assert searcher.stats["tombstones"] == 10 and searcher.stats["stored"] == 600
    hits = searcher.search(vectors[:10], 5)
    assert all(h.id > 10 for row in hits for h in row)
    searcher.remove(range(11, 60))  # past the threshold, no database: stays filtered, said so
    assert "no database to rebuild from" in caplog.text
    assert all(len(row) == 5 and min(h.id for h in row) >= 60
               for row in searcher.search(vectors[:60], 5))


def test_shapes_and_k_are_checked(vectors):
    searcher = make_searcher("Flat", vectors)
    assert len(searcher.search(vectors[0], 3)) == 1  # one (d,) vector is one query
    with pytest.raises(ValueError, match=r"\(n, 16\)"):
        searcher.search(np.zeros((2, 8), np.float32), 3)
    with pytest.raises(ValueError, match="k must be"):
        searcher.search(vectors[:1], 0)
    everything = searcher.search(vectors[:1], 10_000)[0]  # k above the gallery size
    assert len(everything) == 600 and isinstance(everything[0], Hit)


def test_concurrent_searches_and_updates_stay_consistent(vectors):
    searcher = make_searcher("Flat", vectors[:300])
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader():
        try:
            while not stop.is_set():
                for row in searcher.search(vectors[:8], 10, SearchFilter(label="l1")):
                    assert len(row) == 10 and all(h.id >= 0 for h in row)
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    for start in range(300, 600, 30):
        ids = np.arange(start + 1, start + 31)
        searcher.add(ids, vectors[start : start + 30], [ItemInfo("l1")] * 30)
        searcher.remove(ids[:10])
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors
    assert searcher.size == 300 + 10 * 20


def test_rw_lock_lets_readers_share_and_writers_exclude():
    lock = ReadWriteLock()
    inside = []
    with lock.read(), lock.read():
        inside.append("two readers")
    order = []
    with lock.write():
        thread = threading.Thread(target=lambda: (lock.read().__enter__(), order.append("r")))
        thread.start()
        thread.join(0.1)
        order.append("w")
    thread.join(1)
    assert inside == ["two readers"] and order == ["w", "r"]


class _FakeGpuIndex:
    """Stands in for a sharded GPU index: searches a CPU copy, cannot remove (like GPU)."""

    def __init__(self, index):
        self.index = faiss.clone_index(index)
        self.searches = 0

    @property
    def ntotal(self) -> int:
        return self.index.ntotal

    def search(self, queries, k):
        self.searches += 1
        return self.index.search(queries, k)

    def add_with_ids(self, vectors, ids):
        self.index.add_with_ids(vectors, ids)

    def remove_ids(self, ids):
        raise RuntimeError("remove_ids not implemented for this type of index")


def test_gpu_branch_serves_unfiltered_searches_and_never_returns_removed_ids(
    fake_gpus, vectors
):
    mirrors = []

    def to_gpus(index, options, ngpu):
        mirrors.append(_FakeGpuIndex(index))
        return mirrors[-1]

    fake_gpus(2, to_gpus)
    index = trained_index("Flat")
    index.add_with_ids(vectors[:500], np.arange(1, 501))
    searcher = Searcher(index, model_version="m", factory="Flat",
                        infos={i: ItemInfo(f"l{i % 6}") for i in range(1, 501)})
    assert searcher.device == "cuda x2 (sharded)"
    gpu = mirrors[0]
    plain = searcher.search(vectors[:5], 10)
    assert gpu.searches == 1 and [row[0].id for row in plain] == [1, 2, 3, 4, 5]
    searcher.add([600], vectors[599:600], [ItemInfo("new")])
    assert gpu.ntotal == 501  # the mirror follows additions
    assert searcher.remove([1, 2]) == 2  # the mirror cannot remove: results are filtered
    after = searcher.search(vectors[:5], 10)
    assert gpu.searches == 2
    assert all(len(row) == 10 and not {1, 2} & {h.id for h in row} for row in after)
    filtered = searcher.search(vectors[:5], 10, SearchFilter(label="l1"))
    assert gpu.searches == 2  # filtered searches use the CPU copy's id selector
    assert all(len(row) == 10 for row in filtered)


def test_concurrent_searches_use_the_gpu_mirror_one_at_a_time(fake_gpus, vectors):
    """FAISS GPU resources are not thread-safe: readers that share the searcher's read lock
    must still enter the mirror one at a time, and every result stays exact."""
    overlap = Overlap()

    class SlowMirror(_FakeGpuIndex):
        def search(self, queries, k):
            with overlap.section(linger_s=0.005):  # overlapping readers would be caught here
                return super().search(queries, k)

    fake_gpus(1, lambda index, options, ngpu: SlowMirror(index))
    ids = np.arange(1, 301, dtype=np.int64)
    index = trained_index("Flat")
    index.add_with_ids(vectors[:300], ids)
    searcher = Searcher(index, model_version="m", factory="Flat",
                        infos={int(i): ItemInfo("l") for i in ids})
    assert searcher.device == "cuda x1 (sharded)"
    want = brute_force(vectors[:8], vectors[:300], ids, 5)[0].tolist()
    results, errors = run_in_threads(
        lambda: [[hit.id for hit in row] for row in searcher.search(vectors[:8], 5)], 8)
    assert not errors and overlap.most == 1 and len(results) == 8
    assert all(result == want for result in results)


def test_query_time_knobs_are_applied(vectors):
    from imgret.gallery.search.faiss_index import unwrap

    index = trained_index("IVF8,Flat")
    index.add_with_ids(vectors, np.arange(1, len(vectors) + 1))
    Searcher(index, model_version="m", factory="IVF8,Flat", use_gpu=False,
             infos={i: ItemInfo("") for i in range(1, len(vectors) + 1)}, nprobe=3)
    assert unwrap(index).nprobe == 3
    hnsw = trained_index("HNSW16")
    Searcher(hnsw, model_version="m", factory="HNSW16", use_gpu=False, ef_search=200)
    assert unwrap(hnsw).hnsw.efSearch == 200


def test_an_evaluation_ranks_the_gallery_it_counted_while_items_are_added(vectors):
    """/evaluate counts R on the index's ids, then searches; an add in between (the gallery
    stays writable) must not make a ranking list more relevant items than R (a 422)."""
    from imgret.gallery.evaluation.retrieval import QueryBatch, evaluate

    class AddsDuringEvaluation(Searcher):
        def ids(self) -> np.ndarray:
            snapshot = super().ids()
            # Concurrent POST /gallery requests: copies of the first query, with its label.
            self.add(np.arange(10_000, 10_050), np.repeat(vectors[:1], 50, axis=0),
                     [ItemInfo("l1")] * 50)
            return snapshot

    base = make_searcher("Flat", vectors)
    searcher = make_searcher("Flat", vectors, cls=AddsDuringEvaluation)
    queries = QueryBatch(vectors[:4], [base.info(i).label for i in base.ids()[:4]], None)
    report = evaluate(searcher, queries).report
    assert report["num_queries"] == 4
    assert report["precision_at_1"] == 1.0  # the query's own copy (id 1), not an added one
