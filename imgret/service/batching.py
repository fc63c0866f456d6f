"""Dynamic batching: concurrent requests are queued and processed together, off the event loop.

:class:`DynamicBatcher` is the engine; what it runs is a :class:`BatchStages` object, a batch
function in two stages (the search pipeline, :class:`imgret.service.pipeline.SearchPipeline`):

* ``prepare_batch(items, into=None)`` (the decode thread) starts a batch, or adds items to
  one, and returns a :class:`Prepared` batch: one result slot per item so far, ``None`` for
  "waiting for stage 2", the item's own exception, or :class:`Deferred` ("no room in this
  batch, run it in the next one"); ``full`` says it takes no more items;
* ``finish_batch(prepared)`` (the model thread) returns every item's result, in order: its
  answer, its exception, or a :class:`~imgret.service.followups.FollowUp` to finish on the
  batcher's follow-up pool;
* ``discard_batch(prepared)`` drops a prepared batch that will not be finished.

There is one engine: a plain batch function is stages whose ``prepare_batch`` only collects
the items (the tests drive the engine that way).

Refusals (queue full, shutting down, a dead worker) are :mod:`imgret.service.unavailable`'s
exceptions; :mod:`imgret.service.errors` answers them with 503 and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import anyio.to_thread

from imgret.service.followups import FollowUp, FollowUpPool
from imgret.service.os_threads import name_os_thread
from imgret.service.tasks import cancel_and_wait, finished
from imgret.service.unavailable import QueueFull, ServiceUnavailable, ShuttingDown, WorkerFailed

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 256  # IMGRET_BATCH_QUEUE_MAX

T = TypeVar("T")
Q = TypeVar("Q")  # one queued item (a query)
A = TypeVar("A")  # one item's answer
Q_contra = TypeVar("Q_contra", contravariant=True)
A_co = TypeVar("A_co", covariant=True)
P = TypeVar("P", bound="Prepared[Any]")  # a prepared batch, the stages' own type

# What finish_batch gives an item: its answer, work that finishes it, or its exception.
Outcome = T | FollowUp[T] | BaseException


class Deferred(Exception):
    """Put in an item's result slot by ``prepare_batch``: "no room in this batch, run it in
    the next one" (the batch's decoded-pixel budget is spent). The batcher queues the item
    again ahead of newer ones. A batch must take at least one item."""


class Prepared(Protocol[A_co]):
    """What the batcher reads of a batch after its first stage."""

    @property
    def results(self) -> Sequence[A_co | BaseException | None]:
        """One slot per item given so far: ``None`` (waiting for ``finish_batch``), the
        item's exception or :class:`Deferred`, or already its answer."""
        ...

    @property
    def full(self) -> bool:
        """The batch takes no more items."""
        ...


@runtime_checkable
class BatchStages(Protocol[Q_contra, P, A_co]):
    """A batch function in two stages, which the batcher overlaps: while the model runs one
    batch (``finish_batch``, on the batcher's model thread), the next one is collected and
    prepared (``prepare_batch``, on its decode thread), and grows with what arrives until the
    model is free (``prepare_batch(more, into=batch)``). Every prepared batch reaches
    ``finish_batch`` or ``discard_batch``."""

    def prepare_batch(self, items: Sequence[Q_contra], into: P | None = None) -> P: ...

    def finish_batch(self, prepared: P) -> Sequence[Outcome[A_co]]: ...

    def discard_batch(self, prepared: P) -> None: ...


@dataclass
class _Pending(Generic[Q, A]):
    item: Q
    future: asyncio.Future[A | FollowUp[A]]


class DynamicBatcher(Generic[Q, A]):
    """Collect items from concurrent callers and run them through ``process`` in batches.

    A worker task takes the first queued item and whatever else is queued, and hands them to
    ``prepare_batch`` on the decode thread at once; the batch then takes what arrives while it
    decodes and during ``max_wait_s`` after its first item (and, with ``overlap``, while the
    model is busy with the previous batch), up to ``max_size`` items, and goes to
    ``finish_batch`` on the model thread. The event loop keeps accepting requests meanwhile,
    and those form the next batch: under load the batches grow by themselves and the per-call
    cost of the model (Python overhead, kernel launches, thread start-up of the CPU backend) is
    paid once per batch instead of once per request. One thread always runs the model, so the
    CPU backend keeps one warm team of OpenMP workers instead of one per thread of a pool.

    ``max_size == 1`` turns batching off: every call runs both stages of its items in anyio's
    thread pool, concurrently, which is what a plain FastAPI sync endpoint would do (the
    baseline of ``benchmarks/service_bench.py``).

    Failure handling (every caller gets an answer, never a hang):

    * at most ``max_queue`` items wait; past that, callers get
      :class:`~imgret.service.unavailable.QueueFull` at once instead of an unbounded queue and
      timeouts;
    * an item's own exception fails only that item; an exception of a whole stage fails that
      batch's items;
    * if the worker task dies anyway (a bug, a stray cancellation), the items of its batch get
      :class:`~imgret.service.unavailable.WorkerFailed` and a new worker takes over the queue;
    * :meth:`stop` answers the batch in the model, and everything still waiting, and every
      later call, gets :class:`~imgret.service.unavailable.ShuttingDown`.

    Args:
        process: the batch's stages (decode; embed + search).
        max_size: the most items in one batch (``IMGRET_BATCH_MAX_SIZE``).
        max_wait_s: how long the first item of a batch waits for company
            (``IMGRET_BATCH_MAX_WAIT_MS`` / 1000).
        max_queue: the most items waiting (with batching off: running) at once
            (``IMGRET_BATCH_QUEUE_MAX``).
        on_batch: called with each batch's size, the items that reached ``finish_batch`` (a
            metrics hook).
        overlap: prepare the next batch while the model runs this one (else the next batch is
            collected once the model is free).
        followups: where :class:`~imgret.service.followups.FollowUp` results are finished (off the
            batch's threads); ``followup_cost(item)`` is what an item reserves there when it
            is submitted (0: none; a request that would overfill it is refused before being
            queued).
    """

    def __init__(
        self,
        process: BatchStages[Q, P, A],
        *,
        max_size: int,
        max_wait_s: float,
        max_queue: int = DEFAULT_MAX_QUEUE,
        on_batch: Callable[[int], None] | None = None,
        overlap: bool = True,
        followups: FollowUpPool | None = None,
        followup_cost: Callable[[Q], int] | None = None,
    ):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, not {max_size}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, not {max_queue}")
        if not isinstance(process, BatchStages):
            raise TypeError("process must have prepare_batch, finish_batch and discard_batch")
        # The prepared batch's type is the stages' own business: the batcher only hands it
        # back to the same object, and reads it through the Prepared protocol.
        self.process: BatchStages[Q, Any, A] = process
        self.max_size = max_size
        self.max_wait_s = max(0.0, max_wait_s)
        self.max_queue = max_queue
        self.on_batch = on_batch
        self.overlap = overlap
        self.followups = followups
        self.followup_cost = followup_cost or (lambda _item: 0)
        self._queue: asyncio.Queue[_Pending[Q, A]] | None = None
        self._worker: asyncio.Task[None] | None = None
        # Items deferred by the stages: they start the next batch.
        self._carry: deque[_Pending[Q, A]] = deque()
        # The batch being collected or prepared (the worker's, shared so that whoever ends
        # the worker can answer its callers).
        self._batch: list[_Pending[Q, A]] = []
        self._running_unbatched = 0
        self._stopped = False
        # One decode thread, one model thread, and the batch in the model (its task answers
        # its callers; at most one at a time).
        self._decode_pool: ThreadPoolExecutor | None = None
        self._model_pool: ThreadPoolExecutor | None = None
        self._finishing: asyncio.Task[None] | None = None
        self._finishing_batch: list[_Pending[Q, A]] = []
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
                1, thread_name_prefix="imgret-decode", initializer=name_os_thread,
                initargs=("imgret-decode",))
            self._model_pool = ThreadPoolExecutor(
                1, thread_name_prefix="imgret-model", initializer=name_os_thread,
                initargs=("imgret-model",))
            self._spawn_worker()

    async def stop(self) -> None:
        """Stop the worker; everything still waiting, and every later call, gets
        :class:`~imgret.service.unavailable.ShuttingDown`."""
        self._stopped = True
        if self._worker is not None:
            await cancel_and_wait(self._worker)
            self._worker = None
        error = ShuttingDown()
        interrupted: asyncio.CancelledError | None = None
        if self._finishing is not None:
            try:
                await finished(self._finishing)  # the batch in the model is answered
            except asyncio.CancelledError as exc:
                interrupted = exc  # stop() itself was cancelled: refuse everyone, then re-raise
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

    async def submit(self, item: Q) -> A:
        """Process one item, batched with whatever else arrives meanwhile."""
        return (await self.submit_many([item]))[0]

    async def submit_many(
        self, items: Sequence[Q], *, return_exceptions: bool = False
    ) -> list[A | BaseException]:
        """Process several items (one request's), each queued like a single one.

        Args:
            items: the items, in order.
            return_exceptions: put each failed item's exception in its slot instead of
                raising.

        Raises:
            QueueFull: the queue has no room for all of ``items`` (nothing is queued then).
            PoolFull: the follow-up pool cannot reserve the items' cost (nothing queued).
            ShuttingDown: the batcher is stopped.
            BaseException: without ``return_exceptions``, the first failed item's error.
        """
        if not items:
            return []
        if self._stopped:
            raise ShuttingDown()
        if self.enabled and self._queue is None:
            raise RuntimeError("DynamicBatcher.start() was not awaited (app lifespan not run)")
        self._check_room(len(items), self.waiting if self.enabled else self._running_unbatched)
        costs = [self.followup_cost(item) for item in items] if self.followups else []
        unspent = [sum(costs)]
        if unspent[0] and self.followups is not None:
            self.followups.reserve(unspent[0])  # refused before anything is queued
        try:
            if not self.enabled:
                outcomes = await self._run_unbatched(items)
            else:
                outcomes = await self._run_batched(items)
            results = await self._follow_up(outcomes, costs, unspent)
        finally:
            if unspent[0] and self.followups is not None:
                self.followups.release(unspent[0])
        return results if return_exceptions else [_unwrap(result) for result in results]

    async def _run_batched(self, items: Sequence[Q]) -> list[Outcome[A]]:
        assert self._queue is not None
        if self._worker is None or self._worker.done():
            # The done-callback normally replaces a dead worker first; this closes the gap.
            self._replace_worker(self._worker)
        loop = asyncio.get_running_loop()
        futures = []
        for item in items:
            future: asyncio.Future[A | FollowUp[A]] = loop.create_future()
            self._queue.put_nowait(_Pending(item, future))
            futures.append(future)
        # Wait for all, so one bad item does not leave the others' futures unobserved.
        return await asyncio.gather(*futures, return_exceptions=True)

    async def _follow_up(self, outcomes: list[Outcome[A]], costs: list[int],
                         unspent: list[int]) -> list[A | BaseException]:
        """Finish the :class:`~imgret.service.followups.FollowUp` results on the follow-up pool
        (concurrently, each with its item's reserved cost, handed over to the pool as it is
        queued)."""
        followups = [(row, outcome) for row, outcome in enumerate(outcomes)
                     if isinstance(outcome, FollowUp)]
        if not followups:
            return [outcome for outcome in outcomes if not isinstance(outcome, FollowUp)]
        if self.followups is None:
            raise RuntimeError("the batch function returned a FollowUp but the batcher has "
                               "no follow-up pool")
        runs: list[asyncio.Future[A]] = []
        try:
            for row, followup in followups:
                cost = costs[row] if row < len(costs) else 0
                unspent[0] -= cost  # the pool's now: given back when its work ends
                runs.append(self.followups.submit(followup.finish, cost))
        except ServiceUnavailable:
            for run in runs:
                run.cancel()
            raise
        # If this caller goes away, gather cancels the runs: a queued one never starts, a
        # running one finishes in its thread (and only then gives its cost back).
        done = iter(await asyncio.gather(*runs, return_exceptions=True))
        out: list[A | BaseException] = []
        for outcome in outcomes:
            if isinstance(outcome, FollowUp):
                value = next(done)
                # Not this caller's cancellation (that would have ended the gather): the
                # pool stopped before the work started.
                outcome = ShuttingDown() if isinstance(value, asyncio.CancelledError) else value
            out.append(outcome)
        return out

    # --------------------------------------------------------------------- batching off

    async def _run_unbatched(self, items: Sequence[Q]) -> list[Outcome[A]]:
        self._running_unbatched += len(items)
        try:
            outcomes, sizes = await anyio.to_thread.run_sync(self._run_whole, list(items))
        finally:
            self._running_unbatched -= len(items)
        for size in sizes:
            self._report(size)
        return outcomes

    def _run_whole(self, items: list[Q]) -> tuple[list[Outcome[A]], list[int]]:
        """Both stages of one call's items in this thread, and again for the items a batch
        deferred, until every item has its outcome. Returns the outcomes and the size of
        each batch that reached the model stage."""
        outcomes: dict[int, Outcome[A]] = {}
        sizes: list[int] = []
        rows = list(range(len(items)))
        while rows:
            prepared = self.process.prepare_batch([items[row] for row in rows])
            early = list(prepared.results)  # finish_batch may fill the slots in place
            waiting = sum(slot is None for slot in early)
            answers: Sequence[Outcome[A] | None] = early
            if waiting:
                answers = self.process.finish_batch(prepared)
                if len(answers) != len(rows):
                    raise RuntimeError(f"batch function returned {len(answers)} results for "
                                       f"{len(rows)}")
                sizes.append(waiting)
            else:
                self.process.discard_batch(prepared)
            deferred = []
            for row, slot, answer in zip(rows, early, answers, strict=True):
                if slot is not None:
                    if isinstance(slot, Deferred):
                        deferred.append(row)
                    else:
                        outcomes[row] = slot
                elif isinstance(answer, Deferred):
                    outcomes[row] = RuntimeError("the batch function deferred an item in its "
                                                 "last stage")
                else:
                    outcomes[row] = answer
            if deferred and len(deferred) == len(rows):
                # The stages must make progress; refuse instead of looping forever.
                for row in deferred:
                    outcomes[row] = RuntimeError("the batch function deferred every item of "
                                                 "a batch")
                break
            rows = deferred
        return [outcomes[row] for row in range(len(items))], sizes

    # ------------------------------------------------------------------------- batching

    def _check_room(self, count: int, waiting: int) -> None:
        if waiting + count > self.max_queue:
            raise QueueFull(
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
        self._fail(self._batch, WorkerFailed(
            "the search worker failed while processing this request; retry"
        ))
        self._batch = []
        self._spawn_worker()

    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            batch = await self._collect(self._queue)
            # A caller that went away (client disconnect) no longer needs its slot.
            live = [pending for pending in batch if not pending.future.done()]
            if not live:
                self._batch = []
                continue
            # Read per batch: the stages may be replaced while the worker waits (tests do).
            await self._run_batch(self.process, live, self._queue, self._deadline)

    async def _collect(self, queue: asyncio.Queue[_Pending[Q, A]]) -> list[_Pending[Q, A]]:
        """The start of the next batch: the deferred items (up to ``max_size``), else the
        next queued item, then whatever is queued already. Its deadline for company is left in
        ``self._deadline``: ``max_wait_s`` after the first item was taken, or none for deferred
        items (they have waited a batch already)."""
        batch: list[_Pending[Q, A]] = []
        self._batch = batch  # filled in place: stop() and a replacement worker see it
        while self._carry and len(batch) < self.max_size:
            batch.append(self._carry.popleft())
        if batch:
            self._deadline = 0.0
        else:
            batch.append(await queue.get())
            # Counted from when the worker took the first item, not from when it was
            # submitted: the callers answered by the last batch have time to come back and
            # join this one (larger batches and a lower p99: benchmarks/service_bench.py).
            self._deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while len(batch) < self.max_size and not queue.empty():
            batch.append(queue.get_nowait())
        return batch

    async def _run_batch(self, process: BatchStages[Q, Any, A], live: list[_Pending[Q, A]],
                         queue: asyncio.Queue[_Pending[Q, A]], deadline: float) -> None:
        """Prepare ``live``, growing the batch with what arrives while it decodes (until the
        ``deadline`` of its first item's wait) and while the model is busy, then hand it to
        the model thread. With ``overlap`` this returns at once (the caller collects the next
        batch meanwhile), else when the model thread is free again."""
        taken: list[_Pending[Q, A]] = []
        prepared: Prepared[A] | None = None
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
            assert prepared is not None  # the loop prepared at least its first chunk
            if all(isinstance(r, Deferred) for r in prepared.results):
                # The stages must make progress; refuse instead of looping forever.
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
            # worker answers the batch's callers).
            if prepared is not None:
                process.discard_batch(prepared)

    async def _prepare(self, process: BatchStages[Q, Any, A], items: list[Q],
                       into: Prepared[A] | None) -> Prepared[A]:
        """``process.prepare_batch`` on the decode thread. If this task is cancelled, the
        decode still finishes in its thread, and its batch is discarded."""
        assert self._decode_pool is not None
        future: Future[Prepared[A]] = self._decode_pool.submit(process.prepare_batch, items,
                                                               into)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            if into is None:
                future.add_done_callback(lambda f: _discard(process, f))
            raise

    def _answer_early(self, taken: list[_Pending[Q, A]],
                      results: Sequence[A | BaseException | None], start: int) -> None:
        """Answer the items of ``taken[start:]`` that failed while being prepared, and carry
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

    async def _more(self, queue: asyncio.Queue[_Pending[Q, A]], limit: int,
                    deadline: float) -> list[_Pending[Q, A]]:
        """Up to ``limit`` queued items. With none queued, waits for one while the batch in
        the model is still running, else until ``deadline``; ``[]`` when none came."""
        items: list[_Pending[Q, A]] = []
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
                # Not wait_for: on Python 3.11 it swallows a stop()'s cancellation that
                # arrives in the same loop pass as an item, and the worker runs on.
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

    async def _finish(self, process: BatchStages[Q, Any, A], prepared: Prepared[A],
                      taken: list[_Pending[Q, A]], model_free: asyncio.Future[None]) -> None:
        """Run the model stage of a batch on the model thread and answer its callers."""
        assert self._model_pool is not None
        waiting = [r is None for r in prepared.results]
        rows = sum(waiting)
        results: Sequence[Outcome[A]]
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

    def _report(self, size: int) -> None:
        if self.on_batch is None:
            return
        try:
            self.on_batch(size)
        except Exception:  # noqa: BLE001 - a metrics hook must not stop the batcher
            logger.exception("the on_batch hook failed")

    @staticmethod
    def _fail(pendings: Sequence[_Pending[Q, A]] | deque[_Pending[Q, A]],
              error: BaseException) -> None:
        for pending in pendings:
            if not pending.future.done():
                pending.future.set_exception(error)


def _discard(process: BatchStages[Any, Any, Any], future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        process.discard_batch(future.result())


def _unwrap(result: T | BaseException) -> T:
    if isinstance(result, BaseException):
        raise result
    return result
