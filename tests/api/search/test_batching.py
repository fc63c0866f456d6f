"""The dynamic batcher: concurrent calls share batches, errors stay with their own item.

Most of these drive the batcher with :class:`OneStage`, stages that only collect the items and
run a plain batch function on them in the model stage; ``test_batching_staged.py`` covers what
is particular to two real stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from imgret.service.batching import BatchStages, Deferred, DynamicBatcher
from imgret.service.errors import install_error_handlers
from imgret.service.followups import FollowUp, FollowUpPool
from imgret.service.unavailable import (
    PoolFull,
    QueueFull,
    ServiceUnavailable,
    ShuttingDown,
    WorkerFailed,
)


@dataclass
class Batch:
    items: list[int] = field(default_factory=list)
    results: list[object] = field(default_factory=list)
    full: bool = False


class OneStage:
    """Trivial stages around a plain batch function: ``prepare_batch`` only collects the
    items, ``finish_batch`` runs the function on all of them."""

    def __init__(self, function: Callable[[Sequence[int]], Sequence[object]]):
        self.function = function

    def prepare_batch(self, items: Sequence[int], into: Batch | None = None) -> Batch:
        batch = into or Batch()
        batch.items.extend(items)
        batch.results.extend([None] * len(items))
        return batch

    def finish_batch(self, batch: Batch) -> Sequence[object]:
        return self.function(batch.items)

    def discard_batch(self, batch: Batch) -> None:
        pass


def batcher_of(function: Callable[[Sequence[int]], Sequence[object]], **options: object,
               ) -> DynamicBatcher:
    return DynamicBatcher(OneStage(function), **options)  # type: ignore[arg-type]


class Recorder:
    """A batch function that doubles numbers, fails on negatives and records batch sizes."""

    def __init__(self, delay_s: float = 0.0):
        self.sizes: list[int] = []
        self.threads: set[int] = set()
        self.delay_s = delay_s

    def __call__(self, items: Sequence[int]) -> list[int | BaseException]:
        self.sizes.append(len(items))
        self.threads.add(threading.get_ident())
        time.sleep(self.delay_s)
        return [ValueError(f"bad {x}") if x < 0 else 2 * x for x in items]


async def _run_concurrently(batcher: DynamicBatcher, items: list[int]) -> list:
    await batcher.start()
    try:
        return await asyncio.gather(*(batcher.submit(x) for x in items), return_exceptions=True)
    finally:
        await batcher.stop()


def test_concurrent_calls_are_batched_up_to_max_size() -> None:
    recorder = Recorder(delay_s=0.01)
    seen: list[int] = []
    batcher = batcher_of(recorder, max_size=8, max_wait_s=0.05, on_batch=seen.append)

    results = asyncio.run(_run_concurrently(batcher, list(range(20))))

    assert results == [2 * x for x in range(20)]
    assert max(recorder.sizes) == 8
    assert sum(recorder.sizes) == 20
    assert len(recorder.sizes) <= 4  # 20 items -> 8 + 8 + 4 when they arrive together
    assert seen == recorder.sizes
    assert threading.get_ident() not in recorder.threads  # never on the event loop's thread


def test_an_item_error_fails_only_its_caller() -> None:
    batcher = batcher_of(Recorder(), max_size=16, max_wait_s=0.02)

    results = asyncio.run(_run_concurrently(batcher, [1, -1, 3]))

    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], ValueError)


def test_submit_many_keeps_order_and_raises_the_first_error() -> None:
    async def run() -> tuple[list[int], BaseException | None]:
        batcher = batcher_of(Recorder(), max_size=4, max_wait_s=0.01)
        await batcher.start()
        try:
            ok = await batcher.submit_many([5, 4, 3, 2, 1, 0])
            try:
                await batcher.submit_many([1, -2, -3])
            except ValueError as exc:
                return ok, exc
            return ok, None
        finally:
            await batcher.stop()

    ok, error = asyncio.run(run())
    assert ok == [10, 8, 6, 4, 2, 0]
    assert str(error) == "bad -2"


def test_size_one_turns_batching_off() -> None:
    recorder = Recorder(delay_s=0.01)
    batcher = batcher_of(recorder, max_size=1, max_wait_s=0.05)

    results = asyncio.run(_run_concurrently(batcher, list(range(6))))

    assert results == [2 * x for x in range(6)]
    assert recorder.sizes == [1] * 6


def test_a_failing_batch_function_reaches_every_waiter() -> None:
    def broken(items: Sequence[int]) -> list[int]:
        raise RuntimeError("model exploded")

    batcher = batcher_of(broken, max_size=8, max_wait_s=0.01)
    results = asyncio.run(_run_concurrently(batcher, [1, 2, 3]))
    assert all(isinstance(r, RuntimeError) for r in results)


def test_max_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_size"):
        batcher_of(Recorder(), max_size=0, max_wait_s=0.0)


def test_the_stages_must_be_stages() -> None:
    with pytest.raises(TypeError, match="prepare_batch"):
        DynamicBatcher(Recorder(), max_size=2, max_wait_s=0.0)  # type: ignore[arg-type]
    assert isinstance(OneStage(Recorder()), BatchStages)


# --------------------------------------------------------------------------- refusals


class Gate:
    """A batch function that blocks until released and records its batches (thread-safe)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.batches: list[list[int]] = []

    def __call__(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        self.started.set()
        if not self.release.wait(timeout=30):
            raise RuntimeError("test gate never released")
        return [2 * x for x in items]


async def _in_flight(batcher: DynamicBatcher, gate: Gate, item: int) -> asyncio.Task:
    """Submit ``item`` and wait until its batch is running (blocked in ``gate``)."""
    task = asyncio.create_task(batcher.submit(item))
    await asyncio.to_thread(gate.started.wait, 10)
    assert gate.started.is_set()
    return task


def test_a_full_queue_answers_503_with_retry_after() -> None:
    async def run() -> tuple[BaseException, list[int]]:
        gate = Gate()
        batcher = batcher_of(gate, max_size=4, max_wait_s=0.0, max_queue=3)
        await batcher.start()
        try:
            first = await _in_flight(batcher, gate, 1)
            queued = [asyncio.create_task(batcher.submit(x)) for x in (2, 3, 4)]
            await asyncio.sleep(0)
            assert batcher.waiting == 3
            with pytest.raises(QueueFull) as refused:
                await batcher.submit(5)
            with pytest.raises(QueueFull):
                await batcher.submit_many([5, 6])  # all or nothing: none of them queued
            assert batcher.waiting == 3
            gate.release.set()
            results = await asyncio.wait_for(asyncio.gather(first, *queued), 10)
            return refused.value, results
        finally:
            gate.release.set()
            await batcher.stop()

    refused, results = asyncio.run(run())
    assert isinstance(refused, QueueFull)
    assert refused.retry_after_s == 1
    assert "IMGRET_BATCH_QUEUE_MAX" in str(refused)
    assert results == [2, 4, 6, 8]  # the admitted ones are served


def test_without_batching_the_bound_is_on_running_calls() -> None:
    async def run() -> None:
        gate = Gate()
        batcher = batcher_of(gate, max_size=1, max_wait_s=0.0, max_queue=1)
        await batcher.start()
        try:
            running = await _in_flight(batcher, gate, 1)
            with pytest.raises(QueueFull):
                await batcher.submit(2)
            gate.release.set()
            assert await asyncio.wait_for(running, 10) == 2
            assert await asyncio.wait_for(batcher.submit(3), 10) == 6
        finally:
            gate.release.set()
            await batcher.stop()

    asyncio.run(run())


def _worker_task() -> asyncio.Task:
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == "dynamic-batcher"]
    return task


def test_a_dead_worker_is_replaced_instead_of_hanging_every_caller() -> None:
    async def run() -> list[int]:
        batcher = batcher_of(Recorder(), max_size=8, max_wait_s=0.0)
        await batcher.start()
        try:
            dead = _worker_task()
            dead.cancel()  # e.g. a stray cancellation, or a bug that escaped the loop
            with contextlib.suppress(asyncio.CancelledError):
                await dead
            # Without a new worker nobody reads the queue and this waits forever.
            return await asyncio.wait_for(batcher.submit_many([1, 2, 3]), 10)
        finally:
            await batcher.stop()

    assert asyncio.run(run()) == [2, 4, 6]


def test_a_worker_killed_mid_batch_still_answers_that_batch() -> None:
    async def run() -> tuple[object, int]:
        gate = Gate()
        batcher = batcher_of(gate, max_size=8, max_wait_s=0.0)
        await batcher.start()
        try:
            in_flight = await _in_flight(batcher, gate, 5)
            _worker_task().cancel()
            gate.release.set()
            outcome = (await asyncio.wait_for(asyncio.gather(in_flight, return_exceptions=True),
                                              10))[0]
            return outcome, await asyncio.wait_for(batcher.submit(7), 10)
        finally:
            gate.release.set()
            await batcher.stop()

    outcome, later = asyncio.run(run())
    # Its batch finished in its thread: the caller gets the result (or a 503), never a hang.
    assert outcome == 10 or isinstance(outcome, WorkerFailed)
    assert later == 14


def test_a_failing_metrics_hook_does_not_stop_the_batcher() -> None:
    calls: list[int] = []

    def broken_hook(size: int) -> None:
        calls.append(size)
        raise ValueError("metrics backend down")

    async def run() -> list[int]:
        batcher = batcher_of(Recorder(), max_size=8, max_wait_s=0.0, on_batch=broken_hook)
        await batcher.start()
        try:
            first = await asyncio.wait_for(batcher.submit(1), 10)
            second = await asyncio.wait_for(batcher.submit(2), 10)
            return [first, second]
        finally:
            await batcher.stop()

    assert asyncio.run(run()) == [2, 4]
    assert calls == [1, 1]


def test_shutdown_answers_503_to_queued_and_later_callers() -> None:
    async def run() -> tuple[object, list[object], BaseException]:
        gate = Gate()
        batcher = batcher_of(gate, max_size=2, max_wait_s=0.0)
        await batcher.start()
        in_flight = await _in_flight(batcher, gate, 1)
        queued = [asyncio.create_task(batcher.submit(x)) for x in (2, 3, 4)]
        await asyncio.sleep(0)
        stopping = asyncio.create_task(batcher.stop())
        await asyncio.sleep(0)
        gate.release.set()  # the running batch finishes; stop() waits for it
        await asyncio.wait_for(stopping, 10)
        results = await asyncio.gather(in_flight, *queued, return_exceptions=True)
        with pytest.raises(ShuttingDown) as later:
            await batcher.submit(5)
        return results[0], results[1:], later.value

    finished, queued, later = asyncio.run(run())
    assert finished == 2  # graceful: the batch already running is answered
    assert all(isinstance(r, ShuttingDown) for r in queued)
    assert isinstance(later, ShuttingDown) and later.retry_after_s == 1
    assert "shutting down" in str(later)


class Budgeted(OneStage):
    """Doubles numbers; takes items while their sum fits 10 (the first always) and defers the
    rest while preparing, as the search pipeline does with its pixel budget."""

    def __init__(self) -> None:
        super().__init__(lambda items: [2 * x for x in items])
        self.batches: list[list[int]] = []

    def prepare_batch(self, items: Sequence[int], into: Batch | None = None) -> Batch:
        batch = into or Batch()
        for x in items:
            used = sum(y for y, r in zip(batch.items, batch.results, strict=True) if r is None)
            batch.items.append(x)
            if used and used + x > 10:
                batch.results.append(Deferred())
                batch.full = True
            else:
                batch.results.append(None)
        return batch

    def finish_batch(self, batch: Batch) -> list[object]:
        pairs = list(zip(batch.items, batch.results, strict=True))
        self.batches.append([x for x, r in pairs if r is None])
        return [2 * x if r is None else r for x, r in pairs]


@pytest.mark.parametrize("max_size", [8, 1])
def test_deferred_items_run_in_the_next_batches_in_order(max_size: int) -> None:
    # max_size 1: batching off; a request's items still run together, and those deferred
    # run again in the same call instead of failing it.
    budgeted = Budgeted()
    sizes: list[int] = []

    async def run() -> list[int]:
        batcher = DynamicBatcher(budgeted, max_size=max_size, max_wait_s=0.0,
                                 on_batch=sizes.append)
        await batcher.start()
        try:
            return await asyncio.wait_for(batcher.submit_many([6, 6, 3, 9, 1, 12]), 10)
        finally:
            await batcher.stop()

    assert asyncio.run(run()) == [12, 12, 6, 18, 2, 24]
    assert budgeted.batches == [[6, 3, 1], [6], [9], [12]]
    assert all(sum(b) <= 10 or len(b) == 1 for b in budgeted.batches)
    assert len(sizes) == 4


class DefersAll(OneStage):
    def __init__(self) -> None:
        super().__init__(lambda items: [2 * x for x in items])

    def prepare_batch(self, items: Sequence[int], into: Batch | None = None) -> Batch:
        batch = into or Batch()
        batch.items.extend(items)
        batch.results.extend(Deferred() for _ in items)
        return batch


@pytest.mark.parametrize("max_size", [4, 1])
def test_a_batch_function_that_defers_everything_fails_instead_of_looping(
        max_size: int) -> None:
    async def run() -> list:
        batcher = DynamicBatcher(DefersAll(), max_size=max_size, max_wait_s=0.0)
        await batcher.start()
        try:
            return await asyncio.wait_for(
                batcher.submit_many([1, 2], return_exceptions=True), 10
            )
        finally:
            await batcher.stop()

    assert all(isinstance(r, RuntimeError) for r in asyncio.run(run()))


def test_max_queue_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_queue"):
        batcher_of(Recorder(), max_size=2, max_wait_s=0.0, max_queue=0)


def test_stop_in_the_same_loop_pass_as_an_arriving_item_still_ends_the_worker() -> None:
    # The worker holds one item and waits for company. An item arrives and stop() cancels the
    # worker in the same pass of the event loop: on Python 3.11, asyncio.wait_for would return
    # the item and swallow the cancellation, so the worker would run on and stop() never
    # return.
    batcher = batcher_of(Recorder(), max_size=8, max_wait_s=30.0)

    async def run() -> list:
        await batcher.start()
        first = asyncio.create_task(batcher.submit(1))
        await asyncio.sleep(0.05)  # the worker has item 1 and waits up to 30 s for more
        second = asyncio.create_task(batcher.submit(2))
        stopping = asyncio.create_task(batcher.stop())
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert stopping in done, "stop() did not return: the worker lost its cancellation"
        return await asyncio.gather(first, second, return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(r, ShuttingDown) for r in results), results


@pytest.mark.parametrize("refusal", [
    QueueFull("the search queue is full"), PoolFull("the re-ranking queue is full"),
    ShuttingDown(), WorkerFailed("the search worker failed"),
])
def test_every_refusal_is_a_503_with_retry_after(refusal: ServiceUnavailable) -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/busy")
    async def busy() -> None:
        raise refusal

    response = TestClient(app).get("/busy")
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert response.json() == {"detail": str(refusal)}


# --------------------------------------------------------------------------- follow-ups


class Halver:
    """A batch function whose negative items need follow-up work: ``-x`` -> ``FollowUp``
    answering ``x / 2`` on the pool after ``release`` (it records the threads involved)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.batch_threads: set[str] = set()
        self.followup_threads: list[str] = []
        self.batched: list[int] = []

    def finish(self, x: int) -> float:
        self.followup_threads.append(threading.current_thread().name)
        self.started.set()
        if not self.release.wait(timeout=30):
            raise RuntimeError("test never released the follow-up")
        return x / 2

    def __call__(self, items: Sequence[int]) -> list:
        self.batch_threads.add(threading.current_thread().name)
        self.batched.extend(items)
        return [FollowUp(functools.partial(self.finish, -x)) if x < 0 else 2 * x
                for x in items]


async def _eventually(condition, tries: int = 100) -> None:
    """Wait up to a second for ``condition()`` (the caller asserts it afterwards)."""
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0.01)


def _followup_batcher(halver: Halver, capacity: int) -> DynamicBatcher:
    return DynamicBatcher(OneStage(halver), max_size=4, max_wait_s=0.0,
                          followups=FollowUpPool(workers=1, capacity=capacity, what="halving"),
                          followup_cost=lambda x: 10 if x < 0 else 0)


def test_follow_ups_run_on_their_pool_while_batches_go_on() -> None:
    async def run() -> tuple:
        halver = Halver()
        batcher = _followup_batcher(halver, capacity=20)
        await batcher.start()
        try:
            held = asyncio.create_task(batcher.submit(-8))
            await asyncio.to_thread(halver.started.wait, 10)
            assert halver.started.is_set()
            # The follow-up is held on its pool: plain items still get through the batcher.
            plain = await asyncio.wait_for(batcher.submit_many([1, 2, 3]), 10)
            assert not held.done()
            assert batcher.followups.reserved == 10
            halver.release.set()
            return plain, await asyncio.wait_for(held, 10), batcher.followups.reserved
        finally:
            halver.release.set()
            await batcher.stop()

    plain, held, reserved = asyncio.run(run())
    assert plain == [2, 4, 6]
    assert held == 4.0
    assert reserved == 0


def test_a_full_follow_up_pool_refuses_the_whole_request_and_frees_only_when_work_ends(
) -> None:
    async def run() -> None:
        halver = Halver()
        batcher = _followup_batcher(halver, capacity=20)
        await batcher.start()
        pool = batcher.followups
        try:
            first = asyncio.create_task(batcher.submit(-2))
            await asyncio.to_thread(halver.started.wait, 10)
            second = asyncio.create_task(batcher.submit(-4))  # queued behind it on the pool
            await _eventually(lambda: pool.reserved == 20)
            assert pool.reserved == 20
            with pytest.raises(PoolFull) as refused:
                await batcher.submit_many([-6, 1])  # all or nothing
            assert refused.value.retry_after_s == 1
            assert "halving queue is full" in str(refused.value)
            assert pool.reserved == 20
            # A caller that goes away frees its units only once its work has ended.
            first.cancel()
            await asyncio.sleep(0.05)
            assert pool.reserved == 20
            halver.release.set()
            assert await asyncio.wait_for(second, 10) == 2.0
            await _eventually(lambda: pool.reserved == 0)
            assert pool.reserved == 0
            assert set(halver.followup_threads) == {"imgret-followup_0"}
            assert not halver.batch_threads & set(halver.followup_threads)
        finally:
            halver.release.set()
            await batcher.stop()

    asyncio.run(run())


def test_stop_answers_queued_follow_ups_503_and_lets_the_running_one_finish() -> None:
    async def run() -> list:
        halver = Halver()
        batcher = _followup_batcher(halver, capacity=20)
        await batcher.start()
        try:
            first = asyncio.create_task(batcher.submit(-2))
            await asyncio.to_thread(halver.started.wait, 10)
            second = asyncio.create_task(batcher.submit(-4))
            await _eventually(lambda: batcher.followups.reserved == 20)
            stopping = asyncio.create_task(batcher.stop())
            await asyncio.sleep(0.05)
            halver.release.set()
            await asyncio.wait_for(stopping, 10)
            return [*await asyncio.gather(first, second, return_exceptions=True),
                    batcher.followups.reserved]
        finally:
            halver.release.set()

    first, second, reserved = asyncio.run(run())
    assert first == 1.0
    assert isinstance(second, ShuttingDown)
    assert "shutting down" in str(second)
    assert reserved == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("imgret-")]


def test_a_cancelled_caller_of_a_queued_follow_up_frees_its_units_and_it_never_runs() -> None:
    async def run() -> tuple[int, int, int]:
        halver = Halver()
        batcher = _followup_batcher(halver, capacity=20)
        await batcher.start()
        pool = batcher.followups
        try:
            first = asyncio.create_task(batcher.submit(-2))
            await asyncio.to_thread(halver.started.wait, 10)
            second = asyncio.create_task(batcher.submit(-4))
            await _eventually(lambda: -4 in halver.batched)
            await asyncio.sleep(0.05)  # its caller hands the follow-up to the pool
            assert pool.reserved == 20
            second.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await second
            queued_freed = pool.reserved
            halver.release.set()
            assert await asyncio.wait_for(first, 10) == 1.0
            await _eventually(lambda: pool.reserved == 0)
            return queued_freed, pool.reserved, len(halver.followup_threads)
        finally:
            halver.release.set()
            await batcher.stop()

    queued_freed, reserved, ran = asyncio.run(run())
    assert queued_freed == 10  # the running one still holds its 10
    assert reserved == 0
    assert ran == 1  # the cancelled one never started
