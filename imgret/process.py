"""Process-wide state of long-running work: the objects that live as long as it does are kept
out of Python's garbage collections.

A process that imported torch, torchvision, numpy, SQLAlchemy, pydantic and FastAPI and
loaded a model holds ~460,000 objects tracked by the cyclic garbage collector. Every full
collection scans all of them with the process stopped, hundreds of milliseconds on a small
machine, every few tens of seconds of serving under load (every request in flight waits: the
p99 that docs/service_bench.md shows for it) and about once per few thousand ingested images
(the ingest's pipeline stalls meanwhile). ``gc.freeze`` moves them
to a permanent generation that collections skip, so a full collection scans only what was
made since (1-4 ms); forked workers that inherit them frozen do not write to their pages
when they collect either (the copy-on-write the ``gc.freeze`` documentation warns about).
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_lock = threading.Lock()
_depth = 0  # how many frozen_long_lived blocks are open


@contextlib.contextmanager
def frozen_long_lived() -> Iterator[None]:
    """Freeze every object that exists now (after collecting the young generations) for the
    length of the block: they are still freed by reference counting, and cycles among them
    are collected once the outermost block ends (``gc.unfreeze``).

    Enter it once the long-lived objects exist (the app started, the model loaded) and, in
    a process that forks workers, before it forks. Blocks nest (an ingest inside a serving
    process): an inner one freezes what was made since, and only the outermost unfreezes.
    There is no full collection first: it takes as long as the pauses this avoids (~175 ms),
    and the tests start an app per test; what start-up left as cyclic garbage since the last
    full collection stays until the block ends.
    """
    global _depth
    started = time.perf_counter()
    with _lock:
        gc.collect(1)
        gc.freeze()
        _depth += 1
    if logger.isEnabledFor(logging.DEBUG):
        # Only then: get_freeze_count walks the whole permanent generation (~35 ms for the
        # ~500,000 objects of a serving or ingesting process), on every block.
        logger.debug("%d objects kept out of garbage collection (%.1f ms)",
                     gc.get_freeze_count(), (time.perf_counter() - started) * 1000)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()


def in_own_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a new thread that ends with it: its result, or its
    exception raised here. The calling thread waits.

    For torch work off a serving process's model thread (loading a model, embedding a gallery
    upload). Every thread that runs a parallel torch operator keeps a team of OpenMP worker
    threads for as long as it lives, and once more OpenMP threads exist than cores, libgomp
    stops spinning between parallel regions, so that each of the many regions of a forward
    pass waits for its workers to wake: a forward pass on a thread of a process where another
    thread had run torch before is markedly slower than on the only one (docs/service_bench.md,
    "One OpenMP team"). A pooled worker thread
    (anyio's, which FastAPI runs sync routes on) would keep its team; this thread ends, and
    its team with it.

    ``fn`` runs in a copy of the caller's context variables, as with ``asyncio.to_thread``.
    """
    done: Future[T] = Future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            done.set_result(context.run(fn, *args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            done.set_exception(exc)

    thread = threading.Thread(target=run, name=f"imgret-{getattr(fn, '__name__', 'task')}")
    thread.start()
    thread.join()
    return done.result()
