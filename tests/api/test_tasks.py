"""imgret.service.tasks: cancel_and_wait and finished absorb the task's own ending (its
cancellation,
and for finished its error too), never the caller's cancellation."""

from __future__ import annotations

import asyncio

import pytest

from imgret.service.tasks import cancel_and_wait, finished


async def _slow_to_end() -> None:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        await asyncio.sleep(0.2)  # cleans up for a moment, then ends cancelled
        raise


def test_the_tasks_own_cancellation_is_absorbed() -> None:
    async def run() -> bool:
        task = asyncio.create_task(_slow_to_end())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        return task.cancelled()

    assert asyncio.run(run())


def test_a_cancellation_of_the_caller_while_it_waits_propagates() -> None:
    async def run() -> None:
        task = asyncio.create_task(_slow_to_end())
        await asyncio.sleep(0)
        caller = asyncio.create_task(cancel_and_wait(task))
        await asyncio.sleep(0.05)  # the caller waits for the task's clean-up
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert task.cancelled()

    asyncio.run(run())


def test_an_error_the_task_ends_with_is_raised() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RuntimeError("clean-up failed") from None

    async def run() -> None:
        task = asyncio.create_task(fails_on_cancel())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="clean-up failed"):
            await cancel_and_wait(task)

    asyncio.run(run())


def test_finished_waits_without_cancelling_and_absorbs_the_tasks_error() -> None:
    async def fails_later() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("the batch failed")

    async def run() -> bool:
        task = asyncio.create_task(fails_later())
        await finished(task)
        return task.done() and not task.cancelled() and isinstance(task.exception(),
                                                                    RuntimeError)

    assert asyncio.run(run())


def test_a_cancellation_of_the_caller_of_finished_propagates_and_the_task_goes_on() -> None:
    async def run() -> None:
        task = asyncio.create_task(asyncio.sleep(0.2, result="done"))
        caller = asyncio.create_task(finished(task))
        await asyncio.sleep(0.05)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert await task == "done"  # shielded: the caller's cancellation did not reach it

    asyncio.run(run())
