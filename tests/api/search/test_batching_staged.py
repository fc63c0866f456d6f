"""The dynamic batcher with a two-stage batch function (the search pipeline's shape): decode on
one dedicated thread, model on another, overlapped or not, and every caller answered."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from imgret.service.batching import BatchStages, Deferred, DynamicBatcher
from imgret.service.pipeline import ImageQuery, SearchPipeline, Serving
from imgret.service.telemetry import ServiceMetrics
from imgret.service.unavailable import ShuttingDown


@dataclass
class Prepared:
    items: list[int] = field(default_factory=list)
    results: list[object] = field(default_factory=list)
    full: bool = False


class Staged:
    """Doubles numbers; negatives fail while "decoding", items over 100 are deferred unless
    first. ``hold`` blocks the model stage until set. Records threads and calls."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.hold.set()
        self.in_model = threading.Event()
        self.prepare_calls: list[tuple[list[int], bool]] = []
        self.finished: list[list[int]] = []
        self.discarded = 0
        self.decode_threads: set[str] = set()
        self.model_threads: set[str] = set()

    def prepare_batch(self, items: Sequence[int], into: Prepared | None = None) -> Prepared:
        self.decode_threads.add(threading.current_thread().name)
        self.prepare_calls.append((list(items), into is not None))
        batch = into or Prepared()
        for x in items:
            batch.items.append(x)
            if x < 0:
                batch.results.append(ValueError(f"bad {x}"))
            elif x > 100 and batch.items[0] != x:
                batch.results.append(Deferred())
                batch.full = True
            else:
                batch.results.append(None)
        return batch

    def finish_batch(self, batch: Prepared) -> list[object]:
        self.model_threads.add(threading.current_thread().name)
        self.in_model.set()
        assert self.hold.wait(30)
        pairs = list(zip(batch.items, batch.results, strict=True))
        self.finished.append([x for x, r in pairs if r is None])
        return [2 * x if r is None else r for x, r in pairs]

    def discard_batch(self, batch: Prepared) -> None:
        self.discarded += 1


def test_a_staged_function_runs_on_two_dedicated_threads_and_fails_items_alone() -> None:
    staged = Staged()
    assert isinstance(staged, BatchStages)
    sizes: list[int] = []

    async def run() -> list:
        batcher = DynamicBatcher(staged, max_size=8, max_wait_s=0.02, on_batch=sizes.append)
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.submit(x) for x in [1, -2, 3, 150, 5]),
                                        return_exceptions=True)
        finally:
            await batcher.stop()

    results = asyncio.run(run())
    assert results[0] == 2 and results[2] == 6 and results[3] == 300 and results[4] == 10
    assert isinstance(results[1], ValueError)
    assert staged.finished == [[1, 3, 5], [150]]  # the deferred one led the next batch
    assert sizes == [3, 1]  # items that reached the model
    assert {n.split("_")[0] for n in staged.decode_threads} == {"imgret-decode"}
    assert {n.split("_")[0] for n in staged.model_threads} == {"imgret-model"}
    assert not [t for t in threading.enumerate() if t.name.startswith("imgret-")]


@contextlib.asynccontextmanager
async def one_in_the_model(staged: Staged, *, max_size: int = 8, overlap: bool = True,
                           ) -> AsyncIterator[tuple[DynamicBatcher, asyncio.Task]]:
    """A started batcher whose first batch, ``[1]``, is held in the model stage (until
    ``staged.hold`` is set): ``(batcher, the task of 1)``. Released and stopped on exit."""
    batcher = DynamicBatcher(staged, max_size=max_size, max_wait_s=0.0, overlap=overlap)
    await batcher.start()
    try:
        staged.hold.clear()
        first = asyncio.create_task(batcher.submit(1))
        await asyncio.to_thread(staged.in_model.wait, 10)
        yield batcher, first
    finally:
        staged.hold.set()
        await batcher.stop()


async def until(condition: Callable[[], bool]) -> None:
    """Wait (up to 1 s) for ``condition``, which the batcher's threads make true."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0.01)


def test_with_overlap_the_next_batch_is_decoded_and_grows_while_the_model_runs() -> None:
    staged = Staged()

    async def run() -> list[int]:
        async with one_in_the_model(staged, overlap=True) as (batcher, first):
            # The model is busy with [1]: these are decoded meanwhile, into one batch.
            second = asyncio.create_task(batcher.submit(2))
            await until(lambda: len(staged.prepare_calls) == 2)
            third = [asyncio.create_task(batcher.submit(x)) for x in (3, 4)]
            await until(lambda: len(staged.prepare_calls) == 3)
            assert staged.finished == []  # all that happened while [1] was in the model
            staged.hold.set()
            return await asyncio.wait_for(asyncio.gather(first, second, *third), 10)

    assert asyncio.run(run()) == [2, 4, 6, 8]
    assert staged.prepare_calls == [([1], False), ([2], False), ([3, 4], True)]
    assert staged.finished == [[1], [2, 3, 4]]


def test_without_overlap_the_next_batch_waits_for_the_model() -> None:
    staged = Staged()

    async def run() -> list[int]:
        async with one_in_the_model(staged, overlap=False) as (batcher, first):
            later = [asyncio.create_task(batcher.submit(x)) for x in (2, 3)]
            await asyncio.sleep(0.1)
            assert len(staged.prepare_calls) == 1  # nothing decoded while [1] is in the model
            staged.hold.set()
            return await asyncio.wait_for(asyncio.gather(first, *later), 10)

    assert asyncio.run(run()) == [2, 4, 6]
    assert staged.finished == [[1], [2, 3]]


def test_stop_answers_the_batch_in_the_model_and_503s_the_rest_then_ends_its_threads() -> None:
    staged = Staged()

    async def run() -> tuple[object, list[object]]:
        async with one_in_the_model(staged, max_size=2) as (batcher, in_model):
            queued = [asyncio.create_task(batcher.submit(x)) for x in (2, 3, 4)]
            await asyncio.sleep(0.05)
            stopping = asyncio.create_task(batcher.stop())
            await asyncio.sleep(0.05)
            staged.hold.set()
            await asyncio.wait_for(stopping, 10)
            results = await asyncio.gather(in_model, *queued, return_exceptions=True)
            return results[0], results[1:]

    finished, rest = asyncio.run(run())
    assert finished == 2
    # 2 (and 3) may have been decoded while 1 was in the model: never run, 503 like the rest.
    assert all(isinstance(r, ShuttingDown) for r in rest)
    assert staged.discarded <= 1
    assert not [t for t in threading.enumerate() if t.name.startswith("imgret-")]


def test_a_cancelled_stop_still_503s_everyone_then_raises() -> None:
    # stop() waits for the batch in the model; a cancellation of stop() itself must not be
    # swallowed there (as contextlib.suppress(BaseException) would), or the cancelled
    # shutdown runs on.
    staged = Staged()

    async def run() -> tuple[bool, list[object]]:
        async with one_in_the_model(staged, max_size=2) as (batcher, in_model):
            queued = [asyncio.create_task(batcher.submit(x)) for x in (2, 3, 4)]
            await asyncio.sleep(0.05)
            stopping = asyncio.create_task(batcher.stop())
            await asyncio.sleep(0.05)  # stop() now waits for the batch in the model
            stopping.cancel()
            raised = False
            try:
                await asyncio.wait_for(stopping, 5)
            except asyncio.CancelledError:
                raised = True
            results = await asyncio.wait_for(
                asyncio.gather(in_model, *queued, return_exceptions=True), 5)
            return raised, results

    raised, results = asyncio.run(run())
    assert raised, "stop() swallowed its own cancellation"
    assert all(isinstance(r, ShuttingDown) for r in results), results


class _SlowToCancelQueue(asyncio.Queue):
    """A queue whose ``get``, once cancelled, takes 0.2 s to end, and says when it starts to
    (``ending``): it holds the batcher's worker in the wait for a getter it has cancelled."""

    ending: asyncio.Event

    async def get(self):
        try:
            return await super().get()
        except asyncio.CancelledError:
            _SlowToCancelQueue.ending.set()
            await asyncio.sleep(0.2)
            raise


def test_stop_while_the_worker_waits_for_a_cancelled_getter_still_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A batch of one waits up to max_wait_s for company (_more), then cancels its queue getter
    # and waits for it to end. stop() landing in that wait must not be swallowed with the
    # getter's own CancelledError, or the worker goes on and stop() never returns (an
    # intermittent hang of the app's shutdown).
    monkeypatch.setattr(asyncio, "Queue", _SlowToCancelQueue)
    batcher = DynamicBatcher(Staged(), max_size=8, max_wait_s=0.1)

    async def run() -> object:
        _SlowToCancelQueue.ending = asyncio.Event()
        await batcher.start()
        first = asyncio.create_task(batcher.submit(1))
        await asyncio.wait_for(_SlowToCancelQueue.ending.wait(), 5)
        stopping = asyncio.create_task(batcher.stop())
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert stopping in done, "stop() did not return: the worker lost its cancellation"
        return (await asyncio.gather(first, return_exceptions=True))[0]

    result = asyncio.run(run())
    assert isinstance(result, ShuttingDown), result


# --------------------------------------------------------------------------- the pipeline


class _Embedder:
    class spec:  # noqa: N801 - stands in for ModelSpec
        image_size = 4

    def embed_tensors(self, batch: torch.Tensor):
        return batch.flatten(1)[:, :2].numpy()


class _Searcher:
    def search(self, vectors, k, filters, rerank=None):
        return [[] for _ in range(len(vectors))]


class CountingPipeline(SearchPipeline):
    def prepare(self, query, budget, embedder):
        return torch.full((1, 3, 4, 4), float(query.k))


def test_a_batch_keeps_its_version_and_defers_queries_that_arrive_after_a_switch() -> None:
    served = ["v1"]
    reads: list[str] = []

    def serving() -> Serving:
        reads.append(served[0])
        return Serving(served[0], _Embedder(), _Searcher())  # type: ignore[arg-type]

    pipeline = CountingPipeline(serving, max_pixels=10**6, metrics=ServiceMetrics())
    batch = pipeline.prepare_batch([ImageQuery(b"a", 1)])
    assert pipeline.running == 1
    pipeline.prepare_batch([ImageQuery(b"b", 2)], into=batch)  # same version: joins
    assert not batch.full
    served[0] = "v2"  # the process switches while the batch is being collected
    pipeline.prepare_batch([ImageQuery(b"c", 3), ImageQuery(b"d", 1)], into=batch)
    assert batch.full  # takes nothing more
    results = pipeline.finish_batch(batch)
    assert [r.serving.version for r in results[:2]] == ["v1", "v1"]  # what it began with
    assert all(isinstance(r, Deferred) for r in results[2:])  # never answered by v1
    assert pipeline.running == 0
    pipeline.discard_batch(batch)  # idempotent
    assert pipeline.running == 0
    assert [r.serving.version for r in pipeline([ImageQuery(b"c", 3)])] == ["v2"]
    assert reads == ["v1", "v1", "v2", "v2"]  # once per batch, and once per chunk added


def test_through_the_batcher_a_query_after_a_switch_is_answered_by_the_new_version() -> None:
    """A batch begun before a switch keeps collecting while the model is busy; a query that
    arrives after the switch must wait for the next batch rather than join it."""
    served = ["v1"]
    pipeline = CountingPipeline(lambda: Serving(served[0], _Embedder(), _Searcher()),  # type: ignore[arg-type]
                                max_pixels=10**6, metrics=ServiceMetrics())
    in_model = threading.Event()
    release = threading.Event()
    finish = pipeline.finish_batch

    def slow_finish(batch):
        in_model.set()
        assert release.wait(30)
        return finish(batch)

    pipeline.finish_batch = slow_finish  # type: ignore[method-assign]

    async def run() -> tuple[list, list]:
        batcher = DynamicBatcher(pipeline, max_size=8, max_wait_s=0.0, overlap=True)
        await batcher.start()
        try:
            first = asyncio.ensure_future(batcher.submit(ImageQuery(b"a", 1)))
            await asyncio.to_thread(in_model.wait, 30)  # batch 1 (v1) is in the model
            second = asyncio.ensure_future(batcher.submit(ImageQuery(b"b", 1)))
            for _ in range(3000):  # batch 2 begins (v1) and waits for the model
                if pipeline.running == 2:
                    break
                await asyncio.sleep(0.01)
            assert pipeline.running == 2
            served[0] = "v2"  # the switch is acknowledged here
            third = asyncio.ensure_future(batcher.submit(ImageQuery(b"c", 1)))
            await asyncio.sleep(0.05)
            release.set()
            return await asyncio.gather(first, second), [await third]
        finally:
            release.set()
            await batcher.stop()

    before, after = asyncio.run(run())
    assert [a.serving.version for a in before] == ["v1", "v1"]
    assert [a.serving.version for a in after] == ["v2"]


@pytest.mark.parametrize("overlap", [True, False])
def test_the_search_pipeline_through_the_staged_batcher(overlap: bool) -> None:
    pipeline = CountingPipeline(lambda: Serving("v", _Embedder(), _Searcher()),  # type: ignore[arg-type]
                                max_pixels=10**6, metrics=ServiceMetrics())

    async def run() -> list:
        batcher = DynamicBatcher(pipeline, max_size=4, max_wait_s=0.01, overlap=overlap)
        await batcher.start()
        try:
            return await batcher.submit_many([ImageQuery(b"x", k) for k in range(1, 10)])
        finally:
            await batcher.stop()

    answers = asyncio.run(run())
    assert len(answers) == 9 and all(a.serving.version == "v" for a in answers)
    assert pipeline.running == 0
