"""The thread rule of CPU searches (imgret.gallery.search.threads): exact results on every path, and
OpenMP thread counts that stay each thread's own under concurrent searches."""

from __future__ import annotations

import threading

import faiss
import numpy as np
import pytest

from imgret.gallery.search import Searcher, SearchFilter
from imgret.gallery.search.faiss_index import check_factory, create_index
from imgret.gallery.search.threads import ExactFlat, faiss_threads, uses_blas_path, yielding_to
from imgret.gallery.storage.vector_store import ItemInfo
from tests.support.threads import omp_threads
from tests.unit.gallery.vectors import clustered_vectors

DIM = 128  # 1,000 queries of 128-d reach FAISS's BLAS path, 1 query does not
N = 5_000
K = 10


@pytest.fixture(scope="module")
def gallery() -> tuple[np.ndarray, np.ndarray]:
    vectors = clustered_vectors(N, DIM, clusters=50, seed=3)
    ids = np.arange(N, dtype=np.int64) * 7 + 11  # sparse, not positions
    return vectors, ids


def flat_searcher(vectors: np.ndarray, ids: np.ndarray) -> Searcher:
    index = create_index(check_factory("Flat", DIM), DIM)
    index.add_with_ids(vectors, ids)
    infos = {int(i): ItemInfo(f"l{int(i) % 5}") for i in ids}
    return Searcher(index, model_version="m", factory="Flat", infos=infos, use_gpu=False)


def numpy_exact(queries: np.ndarray, vectors: np.ndarray, ids: np.ndarray, k: int):
    """Exact top k by inner product: float32 scores, float64 order (ties are not an issue
    on continuous random data)."""
    scores = queries @ vectors.T
    order = np.argsort(-scores.astype(np.float64), axis=1, kind="stable")[:, :k]
    return ids[order], np.take_along_axis(scores, order, axis=1)


def as_arrays(results) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([[h.id for h in row] for row in results], dtype=np.int64),
            np.array([[h.score for h in row] for row in results], dtype=np.float32))


@pytest.mark.parametrize("batch", [1, 8, 1000])
def test_searcher_equals_numpy_exact_at_each_batch_size(gallery, batch):
    vectors, ids = gallery
    searcher = flat_searcher(vectors, ids)
    queries = clustered_vectors(batch, DIM, clusters=50, seed=4)
    # Batch 1 and 8 take the BLAS + heap path, 1,000 FAISS's own BLAS path.
    assert uses_blas_path(batch, DIM) == (batch == 1000)
    with omp_threads(2):
        got_ids, got_scores = as_arrays(searcher.search(queries, K))
        assert faiss.omp_get_max_threads() == 2  # restored after the search
    want_ids, want_scores = numpy_exact(queries, vectors, ids, K)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_scores, want_scores, rtol=0, atol=1e-6)


def test_exact_flat_matches_faiss_including_short_rows(gallery):
    vectors, ids = gallery
    index = create_index(check_factory("Flat", DIM), DIM)
    index.add_with_ids(vectors[:7], ids[:7])  # fewer vectors than k
    queries = clustered_vectors(3, DIM, seed=5)
    exact = ExactFlat.of(index)
    assert exact is not None
    scores, labels = exact.search(queries, K)
    want_scores, want_labels = index.search(queries, K)
    np.testing.assert_array_equal(labels, want_labels)
    assert (labels[:, 7:] == -1).all()
    np.testing.assert_allclose(scores[:, :7], want_scores[:, :7], rtol=0, atol=1e-6)


def test_exact_flat_reuses_its_score_buffer_across_searches_of_any_size(gallery):
    """One thread's searches share a score buffer: a larger search, then smaller ones on
    another gallery, each still exact (no score of an earlier search leaks into a later one)."""
    vectors, ids = gallery
    small = create_index(check_factory("Flat", DIM), DIM)
    small.add_with_ids(vectors[:300], ids[:300])
    large = create_index(check_factory("Flat", DIM), DIM)
    large.add_with_ids(vectors, ids)
    for index, n, batch, seed in [(large, N, 200, 6), (small, 300, 1, 7), (large, N, 1, 8),
                                  (small, 300, 37, 9)]:
        queries = clustered_vectors(batch, DIM, clusters=50, seed=seed)
        scores, labels = ExactFlat.of(index).search(queries, K)
        want_ids, want_scores = numpy_exact(queries, vectors[:n], ids[:n], K)
        np.testing.assert_array_equal(labels, want_ids)
        np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-6)


def test_exact_flat_only_for_exact_inner_product_indexes():
    assert ExactFlat.of(faiss.IndexIDMap2(faiss.IndexFlatIP(8))) is not None
    assert ExactFlat.of(faiss.IndexIDMap(faiss.IndexFlat(8, faiss.METRIC_INNER_PRODUCT)))
    assert ExactFlat.of(faiss.IndexFlatIP(8)) is None  # no gallery ids
    assert ExactFlat.of(faiss.IndexIDMap2(faiss.IndexFlatL2(8))) is None
    hnsw = create_index(check_factory("HNSW16", DIM), DIM)
    assert ExactFlat.of(hnsw) is None
    sq = create_index(check_factory("SQ8", DIM), DIM)
    assert ExactFlat.of(sq) is None


def test_faiss_threads_takes_at_most_the_batch_and_restores():
    with omp_threads(2):
        with faiss_threads(1) as n:
            assert n == 1 and faiss.omp_get_max_threads() == 1
            with faiss_threads(1000) as inner:  # never more than the thread has
                assert inner == 1
        assert faiss.omp_get_max_threads() == 2
        with faiss_threads(8) as n:
            assert n == 2
        with pytest.raises(RuntimeError), faiss_threads(1):
            raise RuntimeError("a failing search")
        assert faiss.omp_get_max_threads() == 2


def test_thread_count_is_per_thread():
    """The premise of setting the count per call: another thread's setting is not ours."""
    seen: dict[str, int] = {}
    set_in_other = threading.Event()
    checked = threading.Event()

    def other() -> None:
        faiss.omp_set_num_threads(1)
        set_in_other.set()
        checked.wait(10)

    with omp_threads(2):
        thread = threading.Thread(target=other)
        thread.start()
        assert set_in_other.wait(10)
        seen["main"] = faiss.omp_get_max_threads()
        checked.set()
        thread.join()
    assert seen["main"] == 2


def test_concurrent_searches_are_exact_and_leave_thread_counts_alone(gallery):
    vectors, ids = gallery
    searcher = flat_searcher(vectors, ids)
    labels = np.array([f"l{int(i) % 5}" for i in ids])
    queries = clustered_vectors(1000, DIM, clusters=50, seed=6)
    want_ids, _ = numpy_exact(queries, vectors, ids, K)
    allowed = labels == "l2"
    want_l2, _ = numpy_exact(queries[:8], vectors[allowed], ids[allowed], K)
    errors: list[str] = []
    start = threading.Barrier(6)

    def worker(number: int) -> None:
        threads = 1 + number % 2  # threads of their own count, 1 or 2
        faiss.omp_set_num_threads(threads)
        start.wait()
        for round_ in range(4):
            batch = (1, 8, 1000)[(number + round_) % 3]
            got, _ = as_arrays(searcher.search(queries[:batch], K))
            if not np.array_equal(got, want_ids[:batch]):
                errors.append(f"worker {number}: batch {batch} differs")
            got, _ = as_arrays(searcher.search(queries[:8], K, SearchFilter(label="l2")))
            if not np.array_equal(got, want_l2):
                errors.append(f"worker {number}: filtered search differs")
            if faiss.omp_get_max_threads() != threads:
                errors.append(f"worker {number}: {faiss.omp_get_max_threads()} OpenMP "
                              f"threads after a search, set {threads}")

    with omp_threads(2):
        workers = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert faiss.omp_get_max_threads() == 2
    assert not any(w.is_alive() for w in workers)
    assert errors == []


def test_a_background_search_pauses_while_busy_and_answers_the_same(gallery):
    vectors, ids = gallery
    searcher = flat_searcher(vectors, ids)
    queries = clustered_vectors(2, DIM, clusters=50, seed=5)
    expected = as_arrays(searcher.search(queries, K))
    asked = []
    busy = threading.Event()
    busy.set()

    def still_busy() -> bool:
        asked.append(threading.current_thread().name)
        return busy.is_set()

    # Busy throughout: every block waits its bound, then the search goes on (never starves).
    with yielding_to(still_busy, max_wait_s=0.01):
        got = as_arrays(searcher.search(queries, K))
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    assert asked and set(asked) == {threading.current_thread().name}

    # Another thread's search is not paced by this thread's test.
    asked.clear()
    with yielding_to(still_busy):
        worker = threading.Thread(target=searcher.search, args=(queries, K))
        worker.start()
        worker.join()
    assert asked == []

    # Not busy: no waiting, and outside the block nothing asks.
    busy.clear()
    with yielding_to(still_busy, max_wait_s=60.0):
        searcher.search(queries, K)
    asked.clear()
    searcher.search(queries, K)
    assert asked == []
