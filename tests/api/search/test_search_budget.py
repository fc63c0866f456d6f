"""The search budget: requests over the k / re-ranking maxima are refused with 422 before any
work; re-ranking runs on its own bounded pool (never the model thread) and answers 503 with
Retry-After when full; a search by ``id`` is queued like an image, under the same limit.

The app, its batcher, pipeline and database are real. Where a test must hold re-ranking it
replaces ``imgret.service.pipeline.rerank_answer`` (the pool's job) with one that waits for a
signal, then calls the real one; where it must hold a batch it wraps the real pipeline.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

import imgret.service.pipeline
from imgret.service.limits import (
    REQUEST_HITS_MAX,
    REQUEST_RERANK_SEARCHES_MAX,
    SEARCH_CANDIDATES_MAX,
)
from tests.api.conftest import add_gallery, png, search
from tests.api.search.test_batch_isolation import _files, _in_thread
from tests.api.search.test_batcher_settings import BlockingPipeline


def _batches(client) -> float:
    """Batches run so far, from /metrics."""
    text = client.get("/metrics").text
    return float(re.search(r"^imgret_batch_size_count (\S+)$", text, re.M).group(1))


class HeldRerank:
    """Replaces the re-ranking pool's job: records its thread, waits for ``release``."""

    def __init__(self) -> None:
        self.real = imgret.service.pipeline.rerank_answer
        self.started = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def __call__(self, serving, vector, query, busy):
        self.threads.append(threading.current_thread().name)
        self.started.set()
        if not self.release.wait(timeout=60):
            raise RuntimeError("test never released the re-ranking")
        return self.real(serving, vector, query, busy)


def _wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


# --------------------------------------------------------------------------- 422: the maxima


OVER = SEARCH_CANDIDATES_MAX + 1
# Images per batch request that put SEARCH_CANDIDATES_MAX-candidate re-ranking over budget.
TOO_MANY = REQUEST_RERANK_SEARCHES_MAX // (2 * SEARCH_CANDIDATES_MAX + 2) + 1


@pytest.mark.parametrize(("route", "images", "data", "message"), [
    ("/search", 1, {"rerank": "k_reciprocal", "rerank_candidates": str(OVER)},
     f"rerank_candidates: Input should be less than or equal to {SEARCH_CANDIDATES_MAX}"),
    ("/search", 0, {"rerank": "k_reciprocal", "rerank_candidates": str(OVER)},
     f"rerank_candidates: Input should be less than or equal to {SEARCH_CANDIDATES_MAX}"),
    ("/search/batch", 1, {"rerank": "k_reciprocal", "rerank_candidates": "1000",
                          "rerank_k1": "100", "k": "1000"}, "rerank_candidates"),
    ("/search/batch", TOO_MANY, {"rerank": "k_reciprocal",
                                 "rerank_candidates": str(SEARCH_CANDIDATES_MAX)},
     f"at most {REQUEST_RERANK_SEARCHES_MAX} per request"),
    ("/search/batch", REQUEST_HITS_MAX // 1000 + 1, {"k": "1000"},
     f"at most {REQUEST_HITS_MAX} per request"),
    ("/search", 1, {"k": "1001"}, "k"),
])
def test_requests_over_the_budget_are_422_before_any_work(local_client, route, images, data,
                                                          message) -> None:
    ids = sorted(add_gallery(local_client, classes=2, per_class=2))
    batches = _batches(local_client)
    if route == "/search" and images == 0:
        response = local_client.post(route, data={"id": str(ids[0]), **data})
    else:
        field = "image" if route == "/search" else "images"
        response = local_client.post(
            route, files=_files([png(0, 40 + i) for i in range(images)], field), data=data)
    assert response.status_code == 422, response.text
    assert message in str(response.json()["detail"]), response.text
    # Nothing ran and nothing was reserved.
    assert _batches(local_client) == batches
    assert local_client.app.state.resources.batcher.followups.reserved == 0


def test_a_request_at_the_budget_is_answered(local_client) -> None:
    add_gallery(local_client, classes=2, per_class=3)
    fits = TOO_MANY - 1
    response = local_client.post(
        "/search/batch", files=_files([png(i % 2, 50 + i) for i in range(fits)]),
        data={"rerank": "k_reciprocal", "rerank_candidates": str(SEARCH_CANDIDATES_MAX),
              "k": "3"})
    assert response.status_code == 200, response.text
    assert [len(hits) for hits in response.json()["results"]] == [3] * fits


# --------------------------------------------------------------------------- the pool


@pytest.mark.timeout(180)
def test_rerank_runs_on_its_pool_while_plain_searches_are_answered(client,
                                                                   monkeypatch) -> None:
    ids = sorted(add_gallery(client, classes=2, per_class=3))
    held = HeldRerank()
    monkeypatch.setattr(imgret.service.pipeline, "rerank_answer", held)
    try:
        reranked, reranked_out = _in_thread(lambda: search(
            client, png(0, 60), k="3", rerank="k_reciprocal", rerank_k1="2"))
        assert held.started.wait(60)
        # The re-ranking job is held on its pool: plain searches (image and id) still pass
        # through the model thread and are answered.
        plain = search(client, png(1, 61), k="2")
        assert plain.status_code == 200, plain.text
        by_id = client.post("/search", data={"id": str(ids[0]), "k": "2"})
        assert by_id.status_code == 200, by_id.text
        assert not reranked_out  # still held
    finally:
        held.release.set()
    reranked.join(60)
    assert [r.status_code for r in reranked_out] == [200]
    assert len(reranked_out[0].json()["results"]) == 3
    assert held.threads == ["imgret-rerank_0"]  # the pool's thread, not imgret-model
    assert _wait_until(lambda: client.app.state.resources.batcher.followups.reserved == 0)


@pytest.mark.timeout(180)
def test_a_full_rerank_pool_answers_503_with_retry_after(make_local_client,
                                                         monkeypatch) -> None:
    full = REQUEST_RERANK_SEARCHES_MAX // (2 * SEARCH_CANDIDATES_MAX + 2)
    with make_local_client(rerank_queue_max=REQUEST_RERANK_SEARCHES_MAX) as client:
        ids = sorted(add_gallery(client, classes=2, per_class=3))
        pool = client.app.state.resources.batcher.followups
        held = HeldRerank()
        monkeypatch.setattr(imgret.service.pipeline, "rerank_answer", held)
        rerank = {"rerank": "k_reciprocal", "rerank_candidates": str(SEARCH_CANDIDATES_MAX)}
        try:
            filling, filling_out = _in_thread(lambda: client.post(
                "/search/batch", files=_files([png(0, 70 + i) for i in range(full)]),
                data={"k": "2", **rerank}))
            assert held.started.wait(60)
            assert pool.reserved == REQUEST_RERANK_SEARCHES_MAX
            for refused in (search(client, png(1, 80), **rerank),
                            client.post("/search", data={"id": str(ids[0]), **rerank})):
                assert refused.status_code == 503, refused.text
                assert refused.headers["Retry-After"] == "1"
                assert "IMGRET_RERANK_QUEUE_MAX" in refused.json()["detail"]
            # Plain searches need no room there.
            assert search(client, png(1, 81), k="2").status_code == 200
        finally:
            held.release.set()
        filling.join(60)
        assert [r.status_code for r in filling_out] == [200]
        assert _wait_until(lambda: pool.reserved == 0)
        # Room again.
        assert search(client, png(1, 82), k="2", **rerank).status_code == 200


# --------------------------------------------------------------------------- by id: queued


@pytest.mark.timeout(120)
def test_search_by_id_counts_against_the_queue_limit(make_client) -> None:
    with make_client(batch_queue_max=1, search_batch_max_files=1) as client:
        ids = sorted(add_gallery(client, classes=2, per_class=2))
        resources = client.app.state.resources
        blocking = BlockingPipeline(resources.batcher.process)
        resources.batcher.process = blocking
        try:
            running, running_out = _in_thread(lambda: search(client, png(0, 90)))
            assert blocking.started.wait(30)  # its batch is in the pipeline, the queue empty
            # Before: a search by id ran beside the batcher, answered at once, never queued.
            queued, queued_out = _in_thread(
                lambda: client.post("/search", data={"id": str(ids[0]), "k": "2"}))
            assert _wait_until(lambda: resources.batcher.waiting == 1)
            assert not queued_out
            refused = client.post("/search", data={"id": str(ids[1]), "k": "2"})
            assert refused.status_code == 503, refused.text
            assert refused.headers["Retry-After"] == "1"
            assert "IMGRET_BATCH_QUEUE_MAX" in refused.json()["detail"]
        finally:
            blocking.release.set()
        running.join(60)
        queued.join(60)
        assert [r.status_code for r in running_out + queued_out] == [200, 200]
        assert ids[0] not in [hit["id"] for hit in queued_out[0].json()["results"]]
        # Its own errors still reach it from the queue.
        missing = client.post("/search", data={"id": str(max(ids) + 100)})
        assert missing.status_code == 404
        assert "does not exist" in missing.json()["detail"]


def test_a_rerank_queue_smaller_than_one_request_refuses_to_start(make_local_client) -> None:
    # Every maximal request would be refused forever: the server says so at start-up.
    too_small = REQUEST_RERANK_SEARCHES_MAX - 1
    message = (rf"IMGRET_RERANK_QUEUE_MAX \({too_small}\) must be at least .* "
               rf"\({REQUEST_RERANK_SEARCHES_MAX}\)")
    with pytest.raises(ValueError, match=message), make_local_client(rerank_queue_max=too_small):
        pass
