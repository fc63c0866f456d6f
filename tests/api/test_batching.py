"""The dynamic batcher: concurrent calls share batches, errors stay with their own item."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from service.batching import DynamicBatcher


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
    batcher = DynamicBatcher(recorder, max_size=8, max_wait_s=0.05, on_batch=seen.append)

    results = asyncio.run(_run_concurrently(batcher, list(range(20))))

    assert results == [2 * x for x in range(20)]
    assert max(recorder.sizes) == 8
    assert sum(recorder.sizes) == 20
    assert len(recorder.sizes) <= 4  # 20 items -> 8 + 8 + 4 when they arrive together
    assert seen == recorder.sizes
    assert threading.get_ident() not in recorder.threads  # never on the event loop's thread


def test_an_item_error_fails_only_its_caller() -> None:
    batcher = DynamicBatcher(Recorder(), max_size=16, max_wait_s=0.02)

    results = asyncio.run(_run_concurrently(batcher, [1, -1, 3]))

    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], ValueError)


def test_submit_many_keeps_order_and_raises_the_first_error() -> None:
    async def run() -> tuple[list[int], BaseException | None]:
        batcher = DynamicBatcher(Recorder(), max_size=4, max_wait_s=0.01)
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
    batcher = DynamicBatcher(recorder, max_size=1, max_wait_s=0.05)

    results = asyncio.run(_run_concurrently(batcher, list(range(6))))

    assert results == [2 * x for x in range(6)]
    assert recorder.sizes == [1] * 6


def test_a_failing_batch_function_reaches_every_waiter() -> None:
    def broken(items: Sequence[int]) -> list[int]:
        raise RuntimeError("model exploded")

    batcher = DynamicBatcher(broken, max_size=8, max_wait_s=0.01)
    results = asyncio.run(_run_concurrently(batcher, [1, 2, 3]))
    assert all(isinstance(r, RuntimeError) for r in results)


def test_max_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_size"):
        DynamicBatcher(Recorder(), max_size=0, max_wait_s=0.0)
