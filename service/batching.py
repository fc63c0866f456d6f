"""Dynamic batching: concurrent requests are queued and processed together, off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import anyio.to_thread
from fastapi import HTTPException

from service.tasks import cancel_and_wait, finished

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# ``process`` maps a batch of items to one result per item, in order; an item that failed on
# its own (a corrupt image) gets its exception in its slot instead of failing the batch, and
# an item the batch had no room for gets a ``Deferred`` (it runs in the next batch).
BatchFn = Callable[[Sequence[T]], Sequence["R | BaseException"]]

DEFAULT_MAX_QUEUE = 256  # IMGRET_BATCH_QUEUE_MAX
RETRY_AFTER_S = 1


class ServiceUnavailable(HTTPException):
    """503 with ``Retry-After``: the batcher cannot take or finish this item now.

    Raised when the queue is full, while and after the server shuts down, and for the items of
    a batch whose worker died. The client did nothing wrong and may simply retry (on this
    instance after ``Retry-After`` seconds, or on another one), which is what 503 says; a
    plain ``RuntimeError`` would have been a 500. An ``HTTPException`` so that FastAPI's own
    handler sends the ``Retry-After`` header.
    """

    def __init__(self, detail: str, *, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(503, detail, headers={"Retry-After": str(retry_after_s)})


@runtime_checkable
class StagedBatchFn(Protocol):
    """A batch function in two stages, which the batcher overlaps: while the model runs one
    batch (``finish_batch``, on the batcher's model thread), the next one is collected and
    decoded (``prepare_batch``, on its decode thread), and grows with what arrives until the
    model is free (``prepare_batch(more, into=batch)``).

    ``prepare_batch`` returns an object whose ``results`` list has one slot per item given so
    far: ``None`` (waiting for stage 2), an item's own exception, or :class:`Deferred`; and
    whose ``full`` says it takes no more items. ``finish_batch`` returns every item's result,
    in order. A prepared batch that will not be finished goes to ``discard_batch``.
    """

    def prepare_batch(self, items: Sequence[Any], into: Any = None) -> Any: ...

    def finish_batch(self, prepared: Any) -> Sequence[Any]: ...

    def discard_batch(self, prepared: Any) -> None: ...


class FollowUp(Generic[R]):
    """Put in an item's result slot by the batch function: "not answered yet, ``finish()``
    answers it", run by the batcher on its :class:`FollowUpPool`, off the batch's threads.
    The search pipeline returns one for each re-ranked query, so the model thread is free for
    the next batch while re-ranking works."""

    def __init__(self, finish: Callable[[], R]):
        self.finish = finish


class FollowUpPool:
    """Worker threads with a bounded queue, for the :class:`FollowUp` work of a batcher.

    The bound is in cost units (the search's are index searches): a request reserves the cost
    of all its items before any of them is queued (:meth:`reserve`, all or nothing: else
    :class:`ServiceUnavailable`), and each unit comes back when its work has ended in its
    thread (or when its item ended without follow-up work), never earlier, even if the caller
    went away. So at most ``capacity`` units of work are queued or running at any time.

    Args:
        workers: threads, each ``nice`` steps below the process's CPU priority where the OS
            allows (Linux: per thread), so the model thread's OpenMP team keeps the cores it
            needs and a flood of follow-up work slows itself first.
        capacity: the most cost units reserved at once.
        what: the name of the work and its setting, for the 503's message.
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
                initializer=_followup_thread, initargs=(self.name, self.nice))

    async def stop(self) -> None:
        """Refuse new work, cancel what has not started (its callers get a 503), and wait
        for what runs."""
        self._stopping = True
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: executor.shutdown(wait=True, cancel_futures=True))

    def reserve(self, cost: int) -> None:
        """Take ``cost`` units or raise :class:`ServiceUnavailable` (nothing taken)."""
        if cost <= 0:
            return
        with self._lock:
            if self._stopping or self._executor is None:
                raise ServiceUnavailable("the server is shutting down; retry in a moment")
            if self._reserved + cost > self.capacity:
                raise ServiceUnavailable(
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
            ServiceUnavailable: the pool is stopped (the cost is given back).
        """
        executor = self._executor
        try:
            if executor is None:
                raise RuntimeError("stopped")
            future = executor.submit(finish)
        except RuntimeError:  # stopped, or shut down meanwhile
            self.release(cost)
            raise ServiceUnavailable("the server is shutting down; retry in a moment") from None
        future.add_done_callback(lambda _: self.release(cost))
        return asyncio.wrap_future(future)


class Deferred(Exception):
    """Put in an item's result slot by the batch function: "no room in this batch, run it in
    the next one" (the batch's decoded-pixel budget is spent). The batcher queues the item
    again ahead of newer ones. The batch function must take at least one item per batch."""


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

    A :class:`StagedBatchFn` (the search pipeline) runs on two dedicated threads: with
    ``overlap``, a batch is decoded on the decode thread while the previous one is in the
    model on the model thread, and keeps taking the requests that arrive until the model is
    free (up to ``max_size``); without it, the next batch is collected when this one is
    answered. One thread always runs the model, so the CPU backend keeps one warm team of
    OpenMP workers instead of one per thread of a pool. A plain function runs whole, in a
    worker thread, one batch at a time.

    ``max_size == 1`` turns batching off: every call runs ``process`` on its own in the thread
    pool, concurrently, which is what a plain FastAPI sync endpoint would do (the baseline of
    ``benchmarks/service_bench.py``).

    Failure handling (every caller gets an answer, never a hang):

    * at most ``max_queue`` items wait; past that, callers get :class:`ServiceUnavailable`
      (503 + ``Retry-After``) at once instead of an unbounded queue and timeouts;
    * an item's own exception fails only that item; an exception of the whole batch function
      fails that batch's items;
    * if the worker task dies anyway (a bug, a stray cancellation), the items of its batch get
      a 503 and a new worker takes over the queue;
    * :meth:`stop` answers everything still waiting with a 503, and so are calls after it.

    Args:
        process: the synchronous batch function (decode + embed + search).
        max_size: the most items in one batch (``IMGRET_BATCH_MAX_SIZE``).
        max_wait_s: how long the first item of a batch waits for company
            (``IMGRET_BATCH_MAX_WAIT_MS`` / 1000).
        max_queue: the most items waiting (with batching off: running) at once
            (``IMGRET_BATCH_QUEUE_MAX``).
        on_batch: called with each batch's size (a metrics hook): the items it ran, or for a
            staged function the items that reached the model.
        overlap: for a staged function, decode the next batch while the model runs this one
            (else the two stages of a batch still run on their own threads, but the next
            batch is collected once this one is answered).
        followups: where :class:`FollowUp` results are finished (off the batch's threads);
            ``followup_cost(item)`` is what an item reserves there when it is submitted
            (0: none; a request that would overfill it gets a 503 before being queued).
    """

    def __init__(
        self,
        process: BatchFn[T, R],
        *,
        max_size: int,
        max_wait_s: float,
        max_queue: int = DEFAULT_MAX_QUEUE,
        on_batch: Callable[[int], None] | None = None,
        overlap: bool = True,
        followups: FollowUpPool | None = None,
        followup_cost: Callable[[T], int] | None = None,
    ):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, not {max_size}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, not {max_queue}")
        self.process = process
        self.max_size = max_size
        self.max_wait_s = max(0.0, max_wait_s)
        self.max_queue = max_queue
        self.on_batch = on_batch
        self.overlap = overlap
        self.followups = followups
        self.followup_cost = followup_cost or (lambda _item: 0)
        self._queue: asyncio.Queue[_Pending[T, R]] | None = None
        self._worker: asyncio.Task[None] | None = None
        # Items deferred by the batch function: they start the next batch.
        self._carry: deque[_Pending[T, R]] = deque()
        # The batch being collected or processed (the worker's, shared so that whoever ends
        # the worker can answer its callers).
        self._batch: list[_Pending[T, R]] = []
        self._running_unbatched = 0
        self._stopped = False
        # Staged functions: one decode thread, one model thread, and the batch in the model
        # (its task answers its callers; at most one at a time).
        self._decode_pool: ThreadPoolExecutor | None = None
        self._model_pool: ThreadPoolExecutor | None = None
        self._finishing: asyncio.Task[None] | None = None
        self._finishing_batch: list[_Pending[T, R]] = []
        # Done as soon as the model thread is free again, before that batch's callers are
        # answered: the next batch starts first, and decodes while the loop sends the answers.
        self._model_free: asyncio.Future[None] | None = None
        self._deadline = 0.0  # until when the batch being collected waits for company

    @property
    def enabled(self) -> bool:
        return self.max_size > 1

    @property
    def waiting(self) -> int:
        """Items queued and not yet in a batch."""
        return (self._queue.qsize() if self._queue is not None else 0) + len(self._carry)

    async def start(self) -> None:
        """Start the worker task (inside the running loop: the app's lifespan)."""
        self._stopped = False
        if self.followups is not None:
            self.followups.start()
        if self.enabled and self._worker is None:
            self._queue = asyncio.Queue()
            self._decode_pool = ThreadPoolExecutor(
                1, thread_name_prefix="imgret-decode", initializer=_os_thread_name,
                initargs=("imgret-decode",))
            self._model_pool = ThreadPoolExecutor(
                1, thread_name_prefix="imgret-model", initializer=_os_thread_name,
                initargs=("imgret-model",))
            self._spawn_worker()

    async def stop(self) -> None:
        """Stop the worker; everything still waiting, and every later call, gets a 503."""
        self._stopped = True
        if self._worker is not None:
            await cancel_and_wait(self._worker)
            self._worker = None
        error = ServiceUnavailable("the server is shutting down; retry in a moment")
        interrupted: asyncio.CancelledError | None = None
        if self._finishing is not None:
            try:
                await finished(self._finishing)  # the batch in the model is answered
            except asyncio.CancelledError as exc:
                interrupted = exc  # stop() itself was cancelled: 503 everyone, then re-raise
            self._finishing = None
            self._fail(self._finishing_batch, error)
            self._finishing_batch = []
        self._fail(self._batch, error)
        self._fail(self._carry, error)
        self._carry.clear()
        if self._queue is not None:
            while not self._queue.empty():
                self._fail([self._queue.get_nowait()], error)
        pools = [pool for pool in (self._decode_pool, self._model_pool) if pool is not None]
        self._decode_pool = self._model_pool = None
        if interrupted is not None:
            for pool in pools:
                pool.shutdown(wait=False)
            raise interrupted
        if self.followups is not None:
            await self.followups.stop()
        for pool in pools:
            # Waits for a decode the worker left behind (it cannot be interrupted): no thread
            # outlives the batcher.
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown, True)

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
            ServiceUnavailable: the queue has no room for all of ``items`` (nothing is
                queued then), or the batcher is stopped.
            BaseException: without ``return_exceptions``, the first failed item's error.
        """
        if not items:
            return []
        if self._stopped:
            raise ServiceUnavailable("the server is shutting down; retry in a moment")
        if self.enabled and self._queue is None:
            raise RuntimeError("DynamicBatcher.start() was not awaited (app lifespan not run)")
        self._check_room(len(items), self.waiting if self.enabled else self._running_unbatched)
        costs = [self.followup_cost(item) for item in items] if self.followups else []
        unspent = [sum(costs)]
        if unspent[0] and self.followups is not None:
            self.followups.reserve(unspent[0])  # 503 before anything is queued
        try:
            if not self.enabled:
                results = await self._run_unbatched(items)
            else:
                results = await self._run_batched(items)
            results = await self._follow_up(results, costs, unspent)
        finally:
            if unspent[0] and self.followups is not None:
                self.followups.release(unspent[0])
        return results if return_exceptions else [_unwrap(result) for result in results]

    async def _run_batched(self, items: Sequence[T]) -> list[R | BaseException]:
        assert self._queue is not None
        if self._worker is None or self._worker.done():
            # The done-callback normally replaces a dead worker first; this closes the gap.
            self._replace_worker(self._worker)
        loop = asyncio.get_running_loop()
        futures = []
        for item in items:
            future: asyncio.Future[R] = loop.create_future()
            self._queue.put_nowait(_Pending(item, future))
            futures.append(future)
        # Wait for all, so one bad item does not leave the others' futures unobserved.
        return await asyncio.gather(*futures, return_exceptions=True)

    async def _follow_up(self, results: list[Any], costs: list[int],
                         unspent: list[int]) -> list[R | BaseException]:
        """Finish the :class:`FollowUp` results on the follow-up pool (concurrently, each
        with its item's reserved cost, handed over to the pool as it is queued)."""
        followups = [(row, result) for row, result in enumerate(results)
                     if isinstance(result, FollowUp)]
        if not followups:
            return results
        if self.followups is None:
            raise RuntimeError("the batch function returned a FollowUp but the batcher has "
                               "no follow-up pool")
        runs: list[asyncio.Future[Any]] = []
        try:
            for row, result in followups:
                cost = costs[row] if row < len(costs) else 0
                unspent[0] -= cost  # the pool's now: given back when its work ends
                runs.append(self.followups.submit(result.finish, cost))
        except ServiceUnavailable:
            for run in runs:
                run.cancel()
            raise
        # If this caller goes away, gather cancels the runs: a queued one never starts, a
        # running one finishes in its thread (and only then gives its cost back).
        finished = await asyncio.gather(*runs, return_exceptions=True)
        out = list(results)
        for (row, _), value in zip(followups, finished, strict=True):
            if isinstance(value, asyncio.CancelledError):
                # Not this caller's cancellation (that would have ended the gather): the
                # pool stopped before the work started.
                value = ServiceUnavailable("the server is shutting down; retry in a moment")
            out[row] = value
        return out

    # ----------------------------------------------------------------------- internals

    async def _run_unbatched(self, items: Sequence[T]) -> list[R | BaseException]:
        self._running_unbatched += len(items)
        try:
            results = list(await anyio.to_thread.run_sync(self._process_checked, list(items)))
        finally:
            self._running_unbatched -= len(items)
        self._report(len(items))
        if any(isinstance(result, Deferred) for result in results):
            raise RuntimeError("the batch function deferred an item of a one-item call")
        return results

    def _check_room(self, count: int, waiting: int) -> None:
        if waiting + count > self.max_queue:
            raise ServiceUnavailable(
                f"the search queue is full ({waiting} images waiting, at most {self.max_queue}: "
                "IMGRET_BATCH_QUEUE_MAX); retry shortly"
            )

    def _spawn_worker(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="dynamic-batcher")
        self._worker.add_done_callback(self._replace_worker)

    def _replace_worker(self, task: asyncio.Task[None] | None) -> None:
        """Done-callback of the worker: unless stopping, answer its batch and start anew."""
        if self._stopped or task is not self._worker:
            return  # stop() ended it, or it was already replaced
        if task is not None:
            if task.cancelled():
                logger.error("the batch worker was cancelled; starting a new one")
            else:
                logger.error("the batch worker died; starting a new one",
                             exc_info=task.exception())
        self._fail(self._batch, ServiceUnavailable(
            "the search worker failed while processing this request; retry"
        ))
        self._batch = []
        self._spawn_worker()

    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            process = self.process
            staged = isinstance(process, StagedBatchFn) and self._model_pool is not None
            # A staged batch starts decoding its first items at once and takes the rest of
            # the wait's arrivals while it decodes (see _run_staged).
            batch = await self._collect(self._queue, wait=not staged)
            deadline = self._deadline
            process = self.process  # replaced meanwhile (tests do): the batch runs the new one
            staged = isinstance(process, StagedBatchFn) and self._model_pool is not None
            # A caller that went away (client disconnect) no longer needs its slot.
            live = [pending for pending in batch if not pending.future.done()]
            if not live:
                self._batch = []
                continue
            if staged:
                await self._run_staged(process, live, self._queue, deadline)
                continue
            work = asyncio.ensure_future(
                anyio.to_thread.run_sync(self._process_checked, [p.item for p in live])
            )
            try:
                results = await asyncio.shield(work)
            except asyncio.CancelledError:
                # Stopping: the thread cannot be interrupted anyway, so let this batch finish
                # and answer its callers; stop() answers the ones still queued.
                self._deliver(live, await _settled(work, len(live)))
                self._batch = []
                raise
            except Exception as exc:  # noqa: BLE001 - every waiter must hear about it
                logger.exception("batch of %d failed", len(live))
                results = [exc] * len(live)
            self._deliver(live, results)
            self._batch = []
            self._report(len(live))

    async def _collect(self, queue: asyncio.Queue[_Pending[T, R]],
                       wait: bool = True) -> list[_Pending[T, R]]:
        """The next batch: deferred items first, then the queue (waiting up to max_wait_s
        unless ``wait`` is false; the deadline is left in ``self._deadline``)."""
        batch: list[_Pending[T, R]] = []
        self._batch = batch  # filled in place: stop() and a replacement worker see it
        while self._carry and len(batch) < self.max_size:
            batch.append(self._carry.popleft())
        if not batch:
            batch.append(await queue.get())
            # Counted from when the worker got the first item, not from when it was submitted:
            # measured (resnet18, 16 clients, 2 cores) the submission clock ran batches of 8 at
            # 144-147 requests/s and p99 351-407 ms, this one batches of 15 at 161-167 and
            # 264-285 ms (the callers answered by the last batch have time to come back).
            deadline = asyncio.get_running_loop().time() + self.max_wait_s
        else:
            deadline = 0.0  # carried items have waited a batch already: take what is queued
        self._deadline = deadline
        if not wait:
            deadline = 0.0
        while len(batch) < self.max_size:
            # Whatever is already queued joins without waiting.
            if not queue.empty():
                batch.append(queue.get_nowait())
                continue
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                # Not wait_for: on Python 3.11 it swallows a stop()'s cancellation that
                # arrives in the same loop pass as an item, and the worker runs on.
                async with asyncio.timeout(remaining):
                    batch.append(await queue.get())
            except TimeoutError:
                break
        return batch

    # ----------------------------------------------------------------- staged functions

    async def _run_staged(self, process: StagedBatchFn, live: list[_Pending[T, R]],
                          queue: asyncio.Queue[_Pending[T, R]], deadline: float) -> None:
        """Decode ``live``, growing the batch with what arrives while it decodes (until the
        ``deadline`` of its first item's wait) and while the model is busy, then hand it to
        the model thread. With ``overlap`` this returns at once (the caller collects the next
        batch meanwhile), else when the model thread is free again."""
        assert self._decode_pool is not None and self._model_pool is not None
        taken: list[_Pending[T, R]] = []
        prepared: Any = None
        chunk = live
        try:
            while True:
                try:
                    prepared = await self._prepare(process, [p.item for p in chunk], prepared)
                except Exception as exc:  # noqa: BLE001 - every waiter must hear about it
                    logger.exception("decoding a batch of %d failed", len(chunk))
                    self._fail([*taken, *chunk], exc)
                    self._batch = []
                    return  # (the finally discards what was prepared)
                start = len(taken)
                taken.extend(chunk)
                self._answer_early(taken, prepared.results, start)
                rows = sum(result is None for result in prepared.results)
                model_busy = self._model_free is not None and not self._model_free.done()
                loop = asyncio.get_running_loop()
                if prepared.full or rows >= self.max_size or (
                        not model_busy and loop.time() >= deadline and queue.empty()):
                    break
                # What arrived while this decoded, or arrives while the model is busy or the
                # first item's wait lasts, joins this batch.
                chunk = await self._more(queue, self.max_size - rows, deadline)
                if not chunk:
                    break
                self._batch.extend(chunk)
            if prepared is not None and taken and not any(r is None for r in prepared.results) \
                    and all(isinstance(r, Deferred) for r in prepared.results):
                # The function must make progress; refuse instead of looping forever.
                self._carry = deque(p for p in self._carry if p not in taken)
                self._fail(taken, RuntimeError("the batch function deferred every item of a "
                                               "batch"))
            waiting = [p for p, r in zip(taken, prepared.results, strict=True) if r is None]
            if waiting:
                # One batch in the model at a time.
                if self._model_free is not None and not self._model_free.done():
                    # Not shielded: one hop fewer, so this wakes before the callers it answers
                    # (cancelling it here only marks it done).
                    await self._model_free
                loop = asyncio.get_running_loop()
                self._finishing_batch = taken
                self._model_free = loop.create_future()
                self._finishing = loop.create_task(
                    self._finish(process, prepared, taken, self._model_free),
                    name="dynamic-batcher-model")
                prepared = None
                if not self.overlap:
                    await self._model_free
            self._batch = []  # answered, carried, or the model task's now
        finally:
            # Not finished here: nothing waits for it (when cancelled, whoever ends the
            # worker answers the batch's callers with a 503).
            if prepared is not None:
                process.discard_batch(prepared)

    async def _prepare(self, process: StagedBatchFn, items: list[T], into: Any) -> Any:
        """``process.prepare_batch`` on the decode thread. If this task is cancelled, the
        decode still finishes in its thread, and its batch is discarded."""
        assert self._decode_pool is not None
        future: Future[Any] = self._decode_pool.submit(process.prepare_batch, items, into)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            if into is None:
                future.add_done_callback(lambda f: _discard(process, f))
            raise

    def _answer_early(self, taken: list[_Pending[T, R]], results: Sequence[Any],
                      start: int) -> None:
        """Answer the items of ``taken[start:]`` that failed while being decoded, and carry
        the deferred ones to the next batch (ahead of everything newer, in their order)."""
        deferred = []
        for pending, result in zip(taken[start:], results[start:], strict=True):
            if result is None or pending.future.done():
                continue
            if isinstance(result, Deferred):
                deferred.append(pending)
            elif isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)
        self._carry.extendleft(reversed(deferred))

    async def _more(self, queue: asyncio.Queue[_Pending[T, R]], limit: int,
                    deadline: float) -> list[_Pending[T, R]]:
        """Up to ``limit`` queued items. With none queued, waits for one while the batch in
        the model is still running, else until ``deadline``; ``[]`` when none came."""
        items: list[_Pending[T, R]] = []
        if queue.empty():
            loop = asyncio.get_running_loop()
            waits: set[asyncio.Future[Any]] = set()
            if self._model_free is not None and not self._model_free.done():
                waits.add(self._model_free)
                timeout = None
            else:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    return []
            getter = asyncio.ensure_future(queue.get())
            try:
                await asyncio.wait({getter, *waits}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    # A stop() landing during this wait must still end the worker.
                    await cancel_and_wait(getter)
                if getter.done() and not getter.cancelled():
                    items.append(getter.result())
                    self._batch.append(items[-1])  # answered by whoever ends the worker
            if not items:
                return []
            self._batch.pop()  # the caller adds the chunk to the batch
        while len(items) < limit and not queue.empty():
            items.append(queue.get_nowait())
        return items

    async def _finish(self, process: StagedBatchFn, prepared: Any,
                      taken: list[_Pending[T, R]], model_free: asyncio.Future[None]) -> None:
        """Run the model stage of a batch on the model thread and answer its callers."""
        assert self._model_pool is not None
        waiting = [r is None for r in prepared.results]
        rows = sum(waiting)
        try:
            results = await asyncio.wrap_future(
                self._model_pool.submit(process.finish_batch, prepared))
            if len(results) != len(taken):
                raise RuntimeError(f"batch function returned {len(results)} results for "
                                   f"{len(taken)}")
        except Exception as exc:  # noqa: BLE001 - every waiter must hear about it
            logger.exception("batch of %d failed", rows)
            results = [exc] * len(taken)
        finally:
            # Wakes the worker ahead of the callers below (the loop runs callbacks in order).
            if not model_free.done():
                model_free.set_result(None)
        for pending, result, pending_model in zip(taken, results, waiting, strict=True):
            if not pending_model or pending.future.done():
                continue
            if isinstance(result, Deferred):
                result = RuntimeError("the batch function deferred an item in its last stage")
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)
        self._report(rows)

    def _deliver(
        self, live: list[_Pending[T, R]], results: Sequence[R | BaseException]
    ) -> None:
        deferred = [pending for pending, result in zip(live, results, strict=True)
                    if isinstance(result, Deferred) and not pending.future.done()]
        if deferred and len(deferred) == len(live):
            # The batch function must make progress; refuse instead of looping forever.
            results = [RuntimeError("the batch function deferred every item of a batch")] * len(
                live
            )
            deferred = []
        for pending, result in zip(live, results, strict=True):
            if pending.future.done() or isinstance(result, Deferred):
                continue
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)
        # Ahead of everything newer, in their order.
        self._carry.extendleft(reversed(deferred))

    def _process_checked(self, items: list[T]) -> Sequence[R | BaseException]:
        results = self.process(items)
        if len(results) != len(items):
            raise RuntimeError(f"batch function returned {len(results)} results for {len(items)}")
        return results

    def _report(self, size: int) -> None:
        if self.on_batch is None:
            return
        try:
            self.on_batch(size)
        except Exception:  # noqa: BLE001 - a metrics hook must not stop the batcher
            logger.exception("the on_batch hook failed")

    @staticmethod
    def _fail(pendings: Sequence[_Pending[T, R]] | deque[_Pending[T, R]],
              error: BaseException) -> None:
        for pending in pendings:
            if not pending.future.done():
                pending.future.set_exception(error)


def _followup_thread(name: str, nice: int) -> None:
    """A follow-up worker: named for the OS, and ``nice`` steps below the process's CPU
    priority (Linux gives each thread its own nice value; best effort elsewhere)."""
    _os_thread_name(name)
    with contextlib.suppress(Exception):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)


def _os_thread_name(name: str) -> None:
    """Name this thread for the OS too (``top -H``, ``/proc/PID/task/*/comm``): Linux only,
    best effort."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _discard(process: StagedBatchFn, future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        process.discard_batch(future.result())


async def _settled(work: asyncio.Future, count: int) -> Sequence[object]:
    """The results of a batch still running in its thread, or its error for every item."""
    try:
        return await work
    except Exception as exc:  # noqa: BLE001
        return [exc] * count


def _unwrap(result: R | BaseException) -> R:
    if isinstance(result, BaseException):
        raise result
    return result
