"""asyncio helpers for the service's own background tasks."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and return once it has ended.

    The task's own ``CancelledError`` is absorbed. A cancellation of the caller that arrives
    while it waits is not: Python 3.11 tells the two apart by ``Task.cancelling()``.
    ``contextlib.suppress(CancelledError)`` around the wait swallowed both. The batcher's
    worker, stopped while it waited for a queue getter it had just cancelled, then ran on,
    and the app's shutdown waited for it forever (a CI hang, reproduced in ~1 in 50
    start/stop cycles).
    """
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if _caller_cancelled():
            raise


async def finished(task: asyncio.Future[Any]) -> None:
    """Wait for ``task`` to end without cancelling it (it is shielded).

    Whatever the task ends with (a result, an error, its own cancellation) is absorbed: the
    caller only waits. A cancellation of the caller is raised, the task going on. A
    ``contextlib.suppress(BaseException)`` around the wait, which the batcher's ``stop()``
    had, swallowed the caller's cancellation too, and the cancelled shutdown ran on.
    """
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if _caller_cancelled():
            raise
    except Exception:  # the task's callers see its error; this caller only waits
        pass


def _caller_cancelled() -> bool:
    """Whether the running task has been asked to cancel (not: a task it awaited ended
    cancelled)."""
    current = asyncio.current_task()
    return current is not None and current.cancelling() > 0
