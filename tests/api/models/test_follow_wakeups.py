"""The change follower's wait: a shutdown that coincides with a wake-up still ends it."""

from __future__ import annotations

import asyncio

from imgret.service.resources.follower import sleep_until_woken


def test_a_follower_cancelled_in_the_pass_that_wakes_it_ends() -> None:
    # The follower loop sleeps until a change notification or its poll interval. A shutdown
    # cancels it; here the notification lands in the same pass of the event loop. Built on
    # asyncio.wait_for (Python 3.11) the cancellation was swallowed, the loop went back to
    # sleep, and the app's shutdown waited for it forever.
    async def run() -> None:
        wake = asyncio.Event()

        async def follower() -> None:
            while True:
                await sleep_until_woken(wake, 30.0)
                wake.clear()

        task = asyncio.create_task(follower())
        await asyncio.sleep(0.01)  # asleep, 30 s to go
        wake.set()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert task in done, "the follower ran on after its cancellation"
        assert task.cancelled()

    asyncio.run(run())


def test_the_wait_ends_at_a_wake_up_or_at_its_timeout() -> None:
    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        loop.call_later(0.05, wake.set)
        start = loop.time()
        await sleep_until_woken(wake, 30.0)
        woken = loop.time() - start
        start = loop.time()
        await sleep_until_woken(asyncio.Event(), 0.05)
        return woken, loop.time() - start

    woken, timed_out = asyncio.run(run())
    assert woken < 5 and 0.04 <= timed_out < 5
