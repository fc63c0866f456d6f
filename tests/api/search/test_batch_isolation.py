"""Hostile uploads against the real app: ratio bombs priced before decoding, file caps, one bad
image failing only its own request, and the batch queue's 503s.

The batcher and pipeline are the app's own (``app.state.resources``); where a test needs a batch
to stay busy it wraps the real pipeline in a subclass that waits for a signal. Nothing is
mocked, the database least of all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import threading
from collections.abc import Sequence

import pytest

from imgret.errors import ImageDecodeError
from imgret.service.pipeline import ImageQuery, SearchPipeline
from tests.api.conftest import add_gallery, png, search
from tests.support.hostile_images import crafted_exif_jpeg, png_header_only, ratio_bomb


def _files(blobs: Sequence[bytes], field: str = "images") -> list:
    return [(field, (f"f{i}.png", data, "image/png")) for i, data in enumerate(blobs)]


# --------------------------------------------------------------------------- ratio bombs


def test_ratio_bombs_are_priced_from_their_headers_and_refused_with_413(
    make_local_client,
) -> None:
    limits = dict(max_image_pixels=4_000_000, max_request_pixels=10_000_000)
    with make_local_client(**limits) as client:
        add_gallery(client, classes=2, per_class=2)
        # Each declares just under the per-image limit; three are over the request's budget.
        # They hold no pixel data: a 413 (not a 422 "truncated") proves nothing was decoded.
        bombs = [png_header_only(2000, 1999)] * 3
        batch = client.post("/search/batch", files=_files(bombs))
        assert batch.status_code == 413, batch.text
        assert re.search(r"images\[2\]: .*IMGRET_MAX_REQUEST_PIXELS", batch.json()["detail"])
        evaluate = client.post("/evaluate", files=_files(bombs),
                               data={"labels": ["0", "1", "0"]})
        assert evaluate.status_code == 413, evaluate.text
        assert "IMGRET_MAX_REQUEST_PIXELS" in evaluate.json()["detail"]
        single = search(client, png_header_only(3000, 3000))
        assert single.status_code == 413
        assert "IMGRET_MAX_IMAGE_PIXELS" in single.json()["detail"]

        # Real bombs within the budget are decoded (and shrunk at once): answered normally.
        ok = client.post("/search/batch", files=_files([ratio_bomb(2000, 1999)] * 2),
                         data={"k": "2"})
        assert ok.status_code == 200, ok.text
        assert [len(hits) for hits in ok.json()["results"]] == [2, 2]
        # And the server still answers everyone.
        assert client.get("/health").status_code == 200
        assert search(client, png(0, 9), k="1").status_code == 200


@pytest.mark.parametrize(
    ("setting", "path", "data"),
    [
        ("search_batch_max_files", "/search/batch", {}),
        ("evaluate_max_files", "/evaluate", {"labels": ["0", "1", "0"]}),
        ("gallery_max_files", "/gallery", {"labels": ["0", "1", "0"]}),
    ],
)
def test_file_caps_refuse_with_413_naming_the_setting(
    make_local_client, setting: str, path: str, data: dict
) -> None:
    with make_local_client(**{setting: 2}) as client:
        add_gallery(client, classes=2, per_class=1)  # within every cap of 2
        images = [png(5, 100 + i) for i in range(3)]
        response = client.post(path, files=_files(images), data=data)
        assert response.status_code == 413, response.text
        assert f"IMGRET_{setting.upper()}" in response.json()["detail"]
        assert client.get("/gallery").json()["count"] == 2  # nothing written
        # Two files are fine.
        two = client.post(path, files=_files(images[:2]),
                          data={k: v[:2] for k, v in data.items()})
        assert two.status_code in (200, 201), two.text


# --------------------------------------------------------------------------- isolation


def test_a_crafted_image_fails_only_its_own_query_in_a_shared_batch(make_client) -> None:
    with make_client() as client:
        add_gallery(client)
        resources = client.app.state.resources
        good = [png(0, 50), png(1, 51)]
        expected = [[hit["id"] for hit in search(client, image, k="5").json()["results"]]
                    for image in good]
        # Four users' queries in one batch (queued together): two with EXIF that makes
        # Pillow raise TypeError / struct.error. Before, the batch function raised and all
        # four requests failed with a 500.
        queries = [ImageQuery(good[0], 5), ImageQuery(crafted_exif_jpeg("TypeError"), 5),
                   ImageQuery(good[1], 5), ImageQuery(crafted_exif_jpeg("struct.error"), 5)]
        results = client.portal.call(functools.partial(
            resources.batcher.submit_many, queries, return_exceptions=True
        ))
        assert [[hit.id for hit in results[i].hits] for i in (0, 2)] == expected
        for bad in (results[1], results[3]):
            assert isinstance(bad, ImageDecodeError) and "cannot decode" in str(bad)

        # Over HTTP: a 422 with a message, never a 500.
        response = search(client, crafted_exif_jpeg("TypeError"))
        assert response.status_code == 422
        assert "cannot decode the image" in response.json()["detail"]
        batch = client.post("/search/batch",
                            files=_files([good[0], crafted_exif_jpeg("struct.error")]))
        assert batch.status_code == 422
        assert batch.json()["detail"].startswith("images[1]: ")


class FailingPipeline(SearchPipeline):
    """The app's real pipeline, except that one marked upload hits an unexpected error while
    being prepared (what a MemoryError or a bug in a decoder looks like from here)."""

    MARK = b"\x89PNG-but-this-one-explodes"

    def __init__(self, pipeline: SearchPipeline):
        super().__init__(pipeline.serving, max_pixels=pipeline.max_pixels,
                         metrics=pipeline.metrics, batch_max_pixels=pipeline.batch_max_pixels,
                         gate=pipeline.gate)

    def prepare(self, query, budget, embedder):
        if query.data == self.MARK:
            raise MemoryError("cannot allocate the decoded image")
        return super().prepare(query, budget, embedder)


def test_any_exception_while_preparing_one_query_fails_only_that_query(make_local_client) -> None:
    with make_local_client() as client:
        add_gallery(client, classes=2, per_class=3)
        resources = client.app.state.resources
        resources.batcher.process = FailingPipeline(resources.batcher.process)
        queries = [ImageQuery(png(0, 60), 3), ImageQuery(FailingPipeline.MARK, 3),
                   ImageQuery(png(1, 61), 3)]
        results = client.portal.call(functools.partial(
            resources.batcher.submit_many, queries, return_exceptions=True
        ))
        assert len(results[0].hits) == 3 and len(results[2].hits) == 3
        assert isinstance(results[1], ImageDecodeError)
        assert "MemoryError" in str(results[1])
        response = search(client, FailingPipeline.MARK)
        assert response.status_code == 422


# --------------------------------------------------------------------------- the queue


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


async def _kill_worker() -> None:
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == "dynamic-batcher"]
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.timeout(120)
def test_a_dead_worker_does_not_hang_later_searches(make_local_client) -> None:
    with make_local_client() as client:
        add_gallery(client, classes=2, per_class=2)
        client.portal.call(_kill_worker)
        # Before: the queue had no reader left and this request never returned.
        thread, out = _in_thread(lambda: search(client, png(1, 80), k="2"))
        thread.join(60)
        assert out and out[0].status_code == 200
        assert len(out[0].json()["results"]) == 2


def test_searches_during_and_after_shutdown_get_503(make_local_client) -> None:
    with make_local_client() as client:
        add_gallery(client, classes=2, per_class=2)
        client.portal.call(client.app.state.resources.batcher.stop)
        for response in (search(client, png(0, 90)),
                         client.post("/search/batch", files=_files([png(0, 91)]))):
            assert response.status_code == 503, response.text  # was a 500 (RuntimeError)
            assert response.headers["Retry-After"] == "1"
            assert "shutting down" in response.json()["detail"]
