"""Work that finishes an item's answer after its batch, off the batch's threads.

A batch's stages may put a :class:`FollowUp` in an item's result slot ("not answered yet,
``finish()`` answers it"); the batcher runs it on a :class:`FollowUpPool`. The search
pipeline does this for each re-ranked query, so the model thread is free for the next batch
while re-ranking works.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from imgret.service.os_threads import background_thread
from imgret.service.unavailable import PoolFull, ShuttingDown

R = TypeVar("R")


class FollowUp(Generic[R]):
    """An item's answer still to be computed by ``finish()``, on the batcher's
    :class:`FollowUpPool`."""

    def __init__(self, finish: Callable[[], R]):
        self.finish = finish


class FollowUpPool:
    """Worker threads with a bounded queue, for the :class:`FollowUp` work of a batcher.

    The bound is in cost units (the search's are index searches): a request reserves the cost
    of all its items before any of them is queued (:meth:`reserve`, all or nothing: else
    :class:`~imgret.service.unavailable.PoolFull`), and each unit comes back when its work has ended
    in its thread (or when its item ended without follow-up work), never earlier, even if the
    caller went away. So at most ``capacity`` units of work are queued or running at any time.

    Args:
        workers: threads, each ``nice`` steps below the process's CPU priority where the OS
            allows (Linux: per thread), so the model thread's OpenMP team keeps the cores it
            needs and a flood of follow-up work slows itself first.
        capacity: the most cost units reserved at once.
        what: the name of the work and its setting, for the refusal's message.
        name: the threads' name (``NAME_0``, ...; the OS sees it too).
    """

    def __init__(self, *, workers: int, capacity: int, what: str, nice: int = 10,
                 name: str = "imgret-followup"):
        if workers < 1 or capacity < 1:
            raise ValueError(f"workers and capacity must be >= 1, not {workers}, {capacity}")
        self.workers = workers
        self.capacity = capacity
        self.what = what
        self.nice = nice
        self.name = name
        self._reserved = 0
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._stopping = False

    @property
    def reserved(self) -> int:
        """Cost units queued, running, or reserved by requests in the batcher."""
        return self._reserved

    def start(self) -> None:
        self._stopping = False
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.workers, thread_name_prefix=self.name,
                initializer=background_thread, initargs=(self.name, self.nice))

    async def stop(self) -> None:
        """Refuse new work, cancel what has not started (its callers get
        :class:`~imgret.service.unavailable.ShuttingDown`), and wait for what runs."""
        self._stopping = True
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: executor.shutdown(wait=True, cancel_futures=True))

    def reserve(self, cost: int) -> None:
        """Take ``cost`` units, or raise (nothing taken).

        Raises:
            PoolFull: fewer than ``cost`` units are free.
            ShuttingDown: the pool is stopped.
        """
        if cost <= 0:
            return
        with self._lock:
            if self._stopping or self._executor is None:
                raise ShuttingDown()
            if self._reserved + cost > self.capacity:
                raise PoolFull(
                    f"the {self.what} queue is full ({self._reserved} of {self.capacity} "
                    f"reserved, this request needs {cost}); retry shortly")
            self._reserved += cost

    def release(self, cost: int) -> None:
        if cost <= 0:
            return
        with self._lock:
            self._reserved -= cost

    def submit(self, finish: Callable[[], R], cost: int) -> asyncio.Future[R]:
        """Queue ``finish`` for a worker thread now; its ``cost`` (reserved) comes back when
        it ends in its thread, or when it is cancelled before it starts (cancelling the
        returned future does that; stopping the pool too, and then the future is cancelled).

        Raises:
            ShuttingDown: the pool is stopped (the cost is given back).
        """
        executor = self._executor
        try:
            if executor is None:
                raise RuntimeError("stopped")
            future = executor.submit(finish)
        except RuntimeError:  # stopped, or shut down meanwhile
            self.release(cost)
            raise ShuttingDown() from None
        future.add_done_callback(lambda _: self.release(cost))
        return asyncio.wrap_future(future)
