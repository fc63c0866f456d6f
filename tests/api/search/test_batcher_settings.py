"""The batcher built from the settings (IMGRET_BATCH_QUEUE_MAX, IMGRET_BATCH_MAX_PIXELS,
IMGRET_DECODE_MEMORY_MB) and what they do over HTTP: a full queue answers 503 with Retry-After,
a batch over its pixel budget is split across batches, with batching on or off.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from imgret.images import DecodeLimits
from imgret.service.pipeline import SearchPipeline
from tests.api.conftest import add_gallery, png, search
from tests.api.search.test_batch_isolation import _files, _in_thread
from tests.support.hostile_images import ratio_bomb


def _batches(client) -> float:
    """Batches run so far, from /metrics."""
    text = client.get("/metrics").text
    return float(re.search(r"^imgret_batch_size_count (\S+)$", text, re.M).group(1))


class BlockingPipeline(SearchPipeline):
    """The app's real pipeline, holding each batch until ``release`` is set."""

    def __init__(self, pipeline: SearchPipeline):
        super().__init__(pipeline.serving, max_pixels=pipeline.max_pixels,
                         metrics=pipeline.metrics, batch_max_pixels=pipeline.batch_max_pixels,
                         gate=pipeline.gate)
        self.started = threading.Event()
        self.release = threading.Event()

    def prepare_batch(self, queries, into=None):
        # The batcher's first stage (decoding): while it blocks, nothing else is collected.
        self.started.set()
        if not self.release.wait(timeout=60):
            raise RuntimeError("test never released the batch")
        return super().prepare_batch(queries, into)


@pytest.mark.timeout(120)
def test_a_full_queue_answers_503_with_retry_after(make_local_client) -> None:
    with make_local_client(batch_queue_max=1, search_batch_max_files=1) as client:
        add_gallery(client, classes=2, per_class=2)
        resources = client.app.state.resources
        blocking = BlockingPipeline(resources.batcher.process)
        resources.batcher.process = blocking
        try:
            running, running_out = _in_thread(lambda: search(client, png(0, 70)))
            assert blocking.started.wait(30)  # its batch is in the pipeline, the queue empty
            queued, queued_out = _in_thread(lambda: search(client, png(1, 71)))
            deadline = time.monotonic() + 30
            while resources.batcher.waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert resources.batcher.waiting == 1
            refused = search(client, png(0, 72))
            assert refused.status_code == 503
            assert refused.headers["Retry-After"] == "1"
            assert "IMGRET_BATCH_QUEUE_MAX" in refused.json()["detail"]
        finally:
            blocking.release.set()
        running.join(60)
        queued.join(60)
        assert [r.status_code for r in running_out + queued_out] == [200, 200]


# --------------------------------------------------------------------------- settings wiring


def test_the_settings_reach_the_search_batcher(make_local_client) -> None:
    settings = dict(batch_queue_max=40, search_batch_max_files=40, batch_max_pixels=5_000_000,
                    decode_memory_mb=123, max_image_pixels=9_000_000)
    with make_local_client(**settings) as client:
        batcher = client.app.state.resources.batcher
        pipeline = batcher.process
        assert batcher.max_queue == 40
        assert pipeline.batch_max_pixels == 5_000_000
        assert pipeline.max_pixels == 9_000_000
        assert pipeline.gate is DecodeLimits(decode_memory=123 * 1024 * 1024).gate


@pytest.mark.parametrize("batch_max_size", [32, 1])
def test_a_batch_over_its_pixel_budget_is_split_not_refused(make_local_client,
                                                            batch_max_size: int) -> None:
    # 4 M-pixel bombs against a 5 M-pixel batch budget: one per batch, all answered, with
    # batching off too (IMGRET_BATCH_MAX_SIZE=1: a request's images still share a budget).
    with make_local_client(batch_max_pixels=5_000_000, batch_max_size=batch_max_size) as client:
        add_gallery(client, classes=2, per_class=2)
        before = _batches(client)
        response = client.post("/search/batch", files=_files([ratio_bomb(2000, 1999)] * 3),
                               data={"k": "1"})
        assert response.status_code == 200, response.text
        assert [len(hits) for hits in response.json()["results"]] == [1, 1, 1]
        assert _batches(client) - before == 3
