"""Dynamic batching: concurrent requests are queued and processed together, off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio.to_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# ``process`` maps a batch of items to one result per item, in order; an item that failed on
# its own (a corrupt image) gets its exception in its slot instead of failing the batch.
BatchFn = Callable[[Sequence[T]], Sequence["R | BaseException"]]


@dataclass
class _Pending(Generic[T, R]):
    item: T
    future: asyncio.Future[R]


class DynamicBatcher(Generic[T, R]):
    """Collect items from concurrent callers and hand them to ``process`` in batches.

    A worker task waits for the first item, then up to ``max_wait_s`` for more, and stops early
    at ``max_size`` items. The batch runs in a worker thread, so the event loop keeps accepting
    requests meanwhile, and those requests form the next batch: under load the batches grow by
    themselves and the per-call cost of the model (Python overhead, kernel launches, thread
    start-up of the CPU backend) is paid once per batch instead of once per request.

    ``max_size == 1`` turns batching off: every call runs ``process`` on its own in the thread
    pool, concurrently, which is what a plain FastAPI sync endpoint would do (the baseline of
    ``benchmarks/service_bench.py``).

    Args:
        process: the synchronous batch function (decode + embed + search).
        max_size: the most items in one batch (``IMGRET_BATCH_MAX_SIZE``).
        max_wait_s: how long the first item of a batch waits for company
            (``IMGRET_BATCH_MAX_WAIT_MS`` / 1000).
        on_batch: called with each batch's size (a metrics hook).
    """

    def __init__(
        self,
        process: BatchFn[T, R],
        *,
        max_size: int,
        max_wait_s: float,
        on_batch: Callable[[int], None] | None = None,
    ):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, not {max_size}")
        self.process = process
        self.max_size = max_size
        self.max_wait_s = max(0.0, max_wait_s)
        self.on_batch = on_batch
        self._queue: asyncio.Queue[_Pending[T, R]] | None = None
        self._worker: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.max_size > 1

    async def start(self) -> None:
        """Start the worker task (inside the running loop: the app's lifespan)."""
        if self.enabled and self._worker is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._run(), name="dynamic-batcher")

    async def stop(self) -> None:
        """Stop the worker; callers still waiting get a ``RuntimeError``."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        if self._queue is not None:
            while not self._queue.empty():
                pending = self._queue.get_nowait()
                if not pending.future.done():
                    pending.future.set_exception(RuntimeError("the server is shutting down"))
            self._queue = None

    async def submit(self, item: T) -> R:
        """Process one item, batched with whatever else arrives meanwhile."""
        return (await self.submit_many([item]))[0]

    async def submit_many(
        self, items: Sequence[T], *, return_exceptions: bool = False
    ) -> list[R | BaseException]:
        """Process several items (one request's), each queued like a single one.

        Args:
            items: the items, in order.
            return_exceptions: put each failed item's exception in its slot instead of
                raising.

        Raises:
            BaseException: without ``return_exceptions``, the first failed item's error.
        """
        if not items:
            return []
        if not self.enabled:
            results = list(await anyio.to_thread.run_sync(self._process_checked, list(items)))
            self._report(len(items))
            return results if return_exceptions else [_unwrap(result) for result in results]
        if self._queue is None:
            raise RuntimeError("DynamicBatcher.start() was not awaited (app lifespan not run)")
        loop = asyncio.get_running_loop()
        futures = []
        for item in items:
            future: asyncio.Future[R] = loop.create_future()
            self._queue.put_nowait(_Pending(item, future))
            futures.append(future)
        # Wait for all, so one bad item does not leave the others' futures unobserved.
        results = await asyncio.gather(*futures, return_exceptions=True)
        return results if return_exceptions else [_unwrap(result) for result in results]

    async def _run(self) -> None:
        assert self._queue is not None
        queue = self._queue
        loop = asyncio.get_running_loop()
        while True:
            batch = [await queue.get()]
            deadline = loop.time() + self.max_wait_s
            while len(batch) < self.max_size:
                # Whatever is already queued joins without waiting.
                if not queue.empty():
                    batch.append(queue.get_nowait())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), remaining))
                except TimeoutError:
                    break
            # A caller that went away (client disconnect) no longer needs its slot.
            live = [pending for pending in batch if not pending.future.done()]
            if not live:
                continue
            try:
                results = await anyio.to_thread.run_sync(
                    self._process_checked, [pending.item for pending in live]
                )
            except BaseException as exc:  # noqa: BLE001 - every waiter must hear about it
                if isinstance(exc, asyncio.CancelledError):
                    for pending in live:
                        if not pending.future.done():
                            pending.future.set_exception(RuntimeError("batch cancelled"))
                    raise
                logger.exception("batch of %d failed", len(live))
                results = [exc] * len(live)
            self._report(len(live))
            for pending, result in zip(live, results, strict=True):
                if pending.future.done():
                    continue
                if isinstance(result, BaseException):
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)

    def _process_checked(self, items: list[T]) -> Sequence[R | BaseException]:
        results = self.process(items)
        if len(results) != len(items):
            raise RuntimeError(f"batch function returned {len(results)} results for {len(items)}")
        return results

    def _report(self, size: int) -> None:
        if self.on_batch is not None:
            self.on_batch(size)


def _unwrap(result: R | BaseException) -> R:
    if isinstance(result, BaseException):
        raise result
    return result
